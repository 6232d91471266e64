"""A small state file read safely: never a FIFO's wait or a link's target, never more than its cap.

Opened O_NOFOLLOW|O_NONBLOCK (a FIFO put where the file was does not wait for a writer, a link is refused), a
regular file only, at most max_bytes read. The control channel's sweep marker and the simulator's channel read
their files through it.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path


class Unreadable(Exception):
    """The file is there but is not one to read (a link, a FIFO, a device, too large, an I/O error)."""


def read(path: Path, max_bytes: int) -> bytes | None:
    """The file's bytes; None when there is no file; Unreadable, in words, for anything else."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise Unreadable(exc.strerror or str(exc)) from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise Unreadable("not a regular file")
        raw = os.read(fd, max_bytes + 1)
    except OSError as exc:
        raise Unreadable(exc.strerror or str(exc)) from None
    finally:
        os.close(fd)
    if len(raw) > max_bytes:
        raise Unreadable(f"more than {max_bytes} bytes")
    return raw
