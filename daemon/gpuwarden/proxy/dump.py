"""--dump-dir: each request as received and as sent upstream, per session, for `gpuwarden proxy diff`.

Prompts are private: the directory is made 0700 and each file 0600, opened without following links. Files are
UTF-8 whatever the locale (a lone surrogate written as its JSON escape): CJK text escaped as ASCII took twice
its size, which a 32 MB body made a 130 MB dump. The
directory is bounded by count (`keep` files) and by size (`max_bytes`), the oldest files going first; both count
what is on disk when the proxy starts, so restarts do not add up. A dump that alone would pass `max_bytes` is not
kept. A session is the client's own id where it sends one (Anthropic metadata.user_id, as Claude Code does), else
the client's address and the API; it becomes a folder name of [A-Za-z0-9_-] only, never starting with "-", with a hash of the id where
anything had to change, so no id is a path (`..`, `/`) and no two ids share a folder.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import stat
import threading
import time
from collections import deque
from pathlib import Path

log = logging.getLogger("gpuwarden.proxy")
SAFE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_-]{0,63}")  # never a leading "-": no name reads as an option
UNSAFE = re.compile(r"[^A-Za-z0-9_-]+")
TURN_NAME = re.compile(r"\d{8}T\d{6}\.\d{9}Z\.json")


def session_of(body: dict, api: str, peer: str | None) -> str:
    """A folder name for the request's session, whatever the client sent."""
    metadata = body.get("metadata")
    user = metadata.get("user_id") if isinstance(metadata, dict) else None
    raw = user if isinstance(user, str) and user else f"{api}-{peer or 'unknown'}"
    if SAFE_NAME.fullmatch(raw):
        return raw
    digest = hashlib.sha256(raw.encode("utf-8", "surrogatepass")).hexdigest()[:16]
    name = f"{UNSAFE.sub('_', raw)[-40:]}-{digest}"
    return "_" + name if name.startswith("-") else name


class Dumper:
    def __init__(self, directory: Path, keep: int, max_bytes: int, report=None):
        self.directory, self.keep, self.max_bytes = directory, keep, max_bytes
        self.report = report or (lambda kind, message: log.error("proxy: %s", message))  # FaultLog.note
        self._lock = threading.Lock()  # dumps are written on the executor's threads
        self._files, self._bytes = self._on_disk()  # (file, size), oldest first
        with self._lock:
            self._prune()

    def open(self, session: str, path: str) -> Turn | None:
        """A new turn's file; None (and a line) when the directory cannot be written."""
        try:
            folder = self.directory / session
            for d in (self.directory, folder):
                d.mkdir(mode=0o700, exist_ok=True)
            ns = time.time_ns()  # one reading for both parts, so names sort in time order
            name = folder / f"{time.strftime('%Y%m%dT%H%M%S', time.gmtime(ns // 10**9))}.{ns % 10**9:09d}Z.json"
            fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        except OSError as exc:
            self.report("failed dumps", f"dump to {self.directory} failed: {exc}")
            return None
        turn = Turn(self, name, os.fdopen(fd, "wb"))
        try:
            turn.write(json.dumps({"path": path, "session": session})[:-1])  # the object stays open for the parts
        except (OSError, TooBig) as exc:
            turn.failed = str(exc)
        return turn

    def kept(self, name: Path, size: int) -> None:
        with self._lock:
            self._files.append((name, size))
            self._bytes += size
            self._prune()

    def _prune(self) -> None:
        while len(self._files) > self.keep or self._bytes > self.max_bytes:
            old, size = self._files.popleft()
            self._bytes -= size
            old.unlink(missing_ok=True)
            try:
                old.parent.rmdir()  # the session's last file: its folder goes too
            except OSError:
                pass

    def _on_disk(self) -> tuple[deque, int]:
        """The dump files already there (regular files named as ours, in folders, no links), oldest first."""
        found = []
        try:
            folders = [f for f in self.directory.iterdir() if stat.S_ISDIR(f.lstat().st_mode)]
            for folder in folders:
                for f in folder.iterdir():
                    st = f.lstat()
                    if TURN_NAME.fullmatch(f.name) and stat.S_ISREG(st.st_mode):
                        found.append((st.st_mtime_ns, f, st.st_size))
        except FileNotFoundError:
            pass
        except OSError as exc:
            self.report("failed dumps", f"the dumps already in {self.directory} cannot be counted: {exc}")
        found.sort()
        return deque((f, size) for _, f, size in found), sum(size for _, _, size in found)


class TooBig(Exception):
    pass


class Turn:
    """One dump file being written: the request as received (before the rules change it), then as sent. Parts
    are streamed (json.dump writes piece by piece), so a big body is never held twice."""

    def __init__(self, dumper: Dumper, name: Path, out):
        self.dumper, self.name, self.out, self.size = dumper, name, out, 0
        self.failed: str | None = None

    def write(self, text: str) -> None:  # the file interface json.dump writes to
        data = text.encode("utf-8", "backslashreplace")  # a lone surrogate: \ud800, a JSON escape in its string
        self.size += len(data)
        if self.size > self.dumper.max_bytes:
            raise TooBig(f"over --dump-max-bytes ({self.dumper.max_bytes} bytes) alone")
        self.out.write(data)

    def part(self, key: str, value) -> None:
        if self.failed is None:
            try:
                self.write(f", {json.dumps(key)}: ")
                json.dump(value, self, ensure_ascii=False)
            except (OSError, ValueError, TooBig) as exc:
                self.failed = str(exc)

    def close(self, applied: dict) -> Path | None:
        """The file kept (the directory pruned to its bounds), or None and a line when it was not."""
        self.part("applied", applied)
        if self.failed is None:
            try:
                self.write("}")
            except (OSError, TooBig) as exc:
                self.failed = str(exc)
        try:
            self.out.close()
        except OSError as exc:
            self.failed = self.failed or str(exc)
        if self.failed is not None:
            self.name.unlink(missing_ok=True)
            try:
                self.name.parent.rmdir()
            except OSError:
                pass
            self.dumper.report("failed dumps", f"dump to {self.dumper.directory} not kept: {self.failed}")
            return None
        self.dumper.kept(self.name, self.size)
        return self.name
