"""--dump-dir: each request as received and as sent upstream, per session, for `gpuwarden proxy diff`.

Prompts are private: the directory is made 0700 and each file 0600, opened without following links, and at
most `keep` files are kept (the oldest go first). A session is the client's own id where it sends one
(Anthropic metadata.user_id, as Claude Code does), else the client's address and the API.
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
from pathlib import Path

log = logging.getLogger("gpuwarden.proxy")
SAFE = re.compile(r"[^A-Za-z0-9_.-]+")


def session_of(body: dict, api: str, peer: str | None) -> str:
    metadata = body.get("metadata")
    user = metadata.get("user_id") if isinstance(metadata, dict) else None
    raw = user if isinstance(user, str) and user else f"{api}-{peer or 'unknown'}"
    return SAFE.sub("_", raw)[-80:]  # a file name, whatever the client sent


class Dumper:
    def __init__(self, directory: Path, keep: int):
        self.directory, self.keep = directory, keep
        self._files: list[Path] | None = None  # oldest first, read once from the disk

    def write(self, session: str, path: str, received: dict, sent: dict, applied: dict) -> Path | None:
        """One turn's file; None (and one log line) when the directory cannot be written."""
        try:
            folder = self.directory / session
            for d in (self.directory, folder):
                d.mkdir(mode=0o700, exist_ok=True)
            ns = time.time_ns()  # one reading for both parts, so names sort in time order
            name = folder / f"{time.strftime('%Y%m%dT%H%M%S', time.gmtime(ns // 10**9))}.{ns % 10**9:09d}Z.json"
            fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            with os.fdopen(fd, "w", encoding="ascii") as out:  # escaped: any text, whatever the locale
                json.dump({"path": path, "session": session, "applied": applied, "received": received,
                           "sent": sent}, out)
            self._prune(name)
            return name
        except (OSError, TypeError, ValueError) as exc:
            log.error("proxy dump to %s failed: %s", self.directory, exc)
            return None

    def _prune(self, new: Path) -> None:
        if self._files is None:
            self._files = sorted(self.directory.glob("*/*.json"), key=lambda p: p.stat().st_mtime_ns)
        else:
            self._files.append(new)
        while len(self._files) > self.keep:
            old = self._files.pop(0)
            old.unlink(missing_ok=True)
            try:
                old.parent.rmdir()  # the session's last file: its folder goes too
            except OSError:
                pass
