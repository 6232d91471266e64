"""A small state file read and written safely: never a FIFO's wait or a link's target, never more than its cap.

Read: opened O_NOFOLLOW|O_NONBLOCK (a FIFO put where the file was does not wait for a writer, a link is refused),
a regular file only, at most max_bytes read. Every small file the daemon reads goes through it: its state files
(the sweep marker, the originals, the children's record, the installed-engine cache, the metrics URL), the
config and rules files (yamlfile, which follows links), the engine's credentials (secrets, with their owner and
mode checked before a byte is read), the first line of the engine's script (flagcheck) and the simulator's channel.

Written (write_atomic): to a temp name beside the file, created afresh with O_EXCL|O_NOFOLLOW|O_NONBLOCK (so a
FIFO, link or folder planted at the temp name is never waited on nor followed), then renamed over the file, so a
reader sees the old file or the new one, never half of one. Every file the daemon keeps in its state and runtime
directories is written through it.
"""

from __future__ import annotations

import logging
import os
import stat
import threading
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger("gpuwarden")
_writing = threading.Lock()  # one temp name per file: two threads of ours must not share it


class Unreadable(Exception):
    """The file is there but is not one to read (a link, a FIFO, a device, too large, an I/O error); str() says
    why. For callers with words of their own: errno, the OSError's where the open or the read failed; st, the
    file's status once it was opened (st without errno: not a regular file, or too large)."""

    def __init__(self, why: str, errno: int | None = None, st: os.stat_result | None = None):
        super().__init__(why)
        self.errno, self.st = errno, st


def under(real: str, folder: str) -> bool:
    """Whether the real path is strictly inside folder (a real path too)."""
    return real.startswith(folder.rstrip("/") + "/")


def opened_path(fd: int) -> str:
    """The path of what fd is open on, as the kernel names it now ("" where it cannot say)."""
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return ""


def read(path: Path | str, max_bytes: int, follow: bool = False,
         check: Callable[[os.stat_result], None] | None = None, head: bool = False,
         inside: str | None = None) -> bytes | None:
    """The file's bytes; None when there is no file; Unreadable, in words, for anything else. follow: a link is
    read through (where the path is the user's own choice, as a config file's). check: called with the open file's
    status before a byte is read, to refuse it by raising. head: the first max_bytes bytes of a longer file,
    instead of Unreadable. inside: a real folder the file opened must be in (what was opened, not what the path
    named before: a folder on the way may be another user's to swap for a link)."""
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | (0 if follow else os.O_NOFOLLOW)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise Unreadable(exc.strerror or str(exc), exc.errno) from None
    except ValueError:  # a NUL in the path (attacker 17's F5: a config's path with one was a traceback and exit 1)
        raise Unreadable("the path has a NUL byte") from None
    try:
        if inside is not None and not under(opened_path(fd), inside):
            raise Unreadable(f"not inside {inside}")
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise Unreadable("not a regular file", st=st)
        if check is not None:
            check(st)  # what it raises goes to the caller as it is
        raw = _read_up_to(fd, max_bytes + 1, st)
    finally:
        os.close(fd)
    if len(raw) > max_bytes:
        if head:
            return raw[:max_bytes]
        raise Unreadable(f"more than {max_bytes} bytes", st=st)
    return raw


def _read_up_to(fd: int, size: int, st: os.stat_result) -> bytes:
    raw = b""
    try:
        while len(raw) < size and (chunk := os.read(fd, size - len(raw))):
            raw += chunk
    except OSError as exc:
        raise Unreadable(exc.strerror or str(exc), exc.errno, st) from None
    return raw


def temp_name(path: Path) -> Path:
    return path.with_name(path.name + ".tmp")


def write_atomic(path: Path, data: bytes, mode: int = 0o600, durable: bool = False, shared: bool = False) -> None:
    """path holds data, whole, with exactly mode. durable: the file and its folder are fsynced before this
    returns (on disk for good, for a marker that must survive a power cut). shared: other processes may write the
    file at the same time (the simulator's channel), so the temp name is this process's own (one shared name
    would let one writer's clear take the other's half-written file). Raises OSError."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}") if shared else temp_name(path)
    with _writing:
        _clear(tmp)
        # O_EXCL: whatever appears at tmp between the clear and here (a link, a FIFO) fails the open, never
        # gets written through; O_NONBLOCK keeps even that open from waiting.
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                     0o600)
        try:
            os.fchmod(fd, mode)  # exactly mode, whatever the umask
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            if durable:
                os.fsync(fd)
        except BaseException:
            os.close(fd)
            _clear(tmp)
            raise
        os.close(fd)
        os.replace(tmp, path)
    if durable:
        folder = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(folder)
        finally:
            os.close(folder)


def _clear(tmp: Path) -> None:
    """No entry at tmp: a crash's leftover file goes quietly; anything else put there (a FIFO, a link, a
    folder) goes with a line, never opened. OSError where it cannot go (a folder with something in it)."""
    try:
        st = os.lstat(tmp)
    except FileNotFoundError:
        return
    if stat.S_ISREG(st.st_mode):
        os.unlink(tmp)
        return
    kind = "a folder" if stat.S_ISDIR(st.st_mode) else "a link" if stat.S_ISLNK(st.st_mode) else \
        "a FIFO" if stat.S_ISFIFO(st.st_mode) else "a special file"
    try:
        (os.rmdir if stat.S_ISDIR(st.st_mode) else os.unlink)(tmp)
    except OSError as exc:
        raise OSError(exc.errno, f"{kind} is at {tmp}, where only our own temp file belongs, and cannot be "
                                 f"removed ({exc.strerror})") from None
    log.warning("%s was at %s, where only our own temp file belongs: removed, never followed", kind, tmp)
