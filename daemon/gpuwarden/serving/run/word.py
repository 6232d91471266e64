"""The word from a child in front of the engine (ChildSpec.fronts_engine: the proxy) back to the daemon: that it
holds new requests for the engine's planned stop (or has no hold), or that a stop's word it answered no longer
stands (told the engine is up); with serve.idle, that no request came for its after_s (idle) or that one came while
the engine rests (wake). Not its log text, which is for people and may change: one JSON object a line,
{"v": 1, "word": "holding" | "no-hold" | "released" | "idle" | "wake"}, on a pipe of its own whose write end the
child inherits (its number in GPUWARDEN_WORD_FD). The daemon reads the other end each tick (WordReader); a handover
keeps it as it keeps the child's output pipe (serving/run/handover.py). The daemon's word to the child goes as
signals (serving/run/fronts.py)."""

from __future__ import annotations

import errno
import json
import logging
import os
import stat
from collections.abc import Mapping

log = logging.getLogger("gpuwarden")

WORD_ENV = "GPUWARDEN_WORD_FD"
VERSION = 1
HOLDING, NO_HOLD, RELEASED = "holding", "no-hold", "released"
# serve.idle (design/idle-engine.md): no request for its after_s (the engine may rest), and a request came while it
# rests (start it)
IDLE, WAKE = "idle", "wake"
WORDS = (HOLDING, NO_HOLD, RELEASED, IDLE, WAKE)
LINE_MAX = 256  # a word is some 40 bytes
WORDS_MAX = 64  # lines parsed as words in one tick
READ_MAX = 64 * 1024  # what one tick reads: a child that floods its word pipe costs the loop no more


def say(word: str, environ: Mapping[str, str] = os.environ) -> bool:
    """The child's side: write word on the pipe the daemon gave it, without waiting (a full pipe, a daemon gone or
    no pipe at all: False, nothing raised)."""
    fd = environ.get(WORD_ENV, "")
    if not fd.isdigit() or word not in WORDS:
        return False
    line = json.dumps({"v": VERSION, "word": word}).encode() + b"\n"
    try:
        return os.write(int(fd), line) == len(line)
    except OSError:  # EAGAIN (a full pipe: the daemon is not reading), EPIPE, EBADF
        return False


def kept_word(fd: int | None) -> int | None:
    """A word pipe's read end a handover kept (inherited, or from systemd's fd store), if it is one: a FIFO past the
    standard streams, made non-blocking and close-on-exec; else None (one that is not a pipe said)."""
    if fd is None:
        return None
    try:
        if fd <= 2 or not stat.S_ISFIFO(os.fstat(fd).st_mode):
            raise OSError(errno.EBADF, "not a pipe")
        os.set_blocking(fd, False)
        os.set_inheritable(fd, False)
    except OSError as exc:
        log.warning("a word pipe handed over is not one (%s): that front's answers are not heard until it restarts",
                    exc.strerror)
        return None
    return fd


def close_word(fd: int | None) -> None:
    if fd is not None:
        try:
            os.close(fd)
        except OSError:
            pass


def make_pipe() -> tuple[int, int]:
    """(read end, write end): the read end non-blocking and close-on-exec (the daemon's), the write end inheritable
    by the one child it is passed to and blocking-free for it too."""
    read, write = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
    return read, write


class WordReader:
    """The daemon's side of one child's word pipe: how many answers to the engine's stop it gave (holding or
    no-hold), and whether a released came after the last of them. A line longer than LINE_MAX, not JSON, of another
    version or another word is no word and is dropped; at most READ_MAX bytes a read."""

    def __init__(self, fd: int):
        self.fd = fd
        self.answers = 0
        self.released = False
        self.idles = self.wakes = 0  # serve.idle's words heard, each a count the runtime compares with its last
        self.ended = False  # the child closed its end (it ended)
        self._partial = b""

    def read(self) -> None:
        if self.ended:
            return
        data, left = b"", READ_MAX
        while left > 0:
            try:
                chunk = os.read(self.fd, min(left, 4096))
            except BlockingIOError:
                break
            except OSError as exc:
                if exc.errno == errno.EINTR:
                    continue
                self.ended = True
                break
            if not chunk:
                self.ended = True
                break
            data += chunk
            left -= len(chunk)
        *lines, self._partial = (self._partial + data).split(b"\n")
        if len(self._partial) > LINE_MAX:
            self._partial = b""  # no word is this long: what follows up to its end is dropped with it
        # Only a line that can be a word (a JSON object) is parsed, and at most WORDS_MAX a tick: 64 KiB of newlines
        # cost the loop 0.21 s a tick in json.loads failures (attacker 8's finding 7); a front says a word or two a stop.
        words = [line for line in lines if line.startswith(b"{") and len(line) <= LINE_MAX]
        for line in words[:WORDS_MAX]:
            self._heard(line)

    def _heard(self, line: bytes) -> None:
        try:
            message = json.loads(line)
        except (ValueError, RecursionError):
            return
        if not isinstance(message, dict) or message.get("v") != VERSION:
            return
        word = message.get("word")
        if word in (HOLDING, NO_HOLD):
            self.answers += 1
            self.released = False
        elif word == RELEASED:
            self.released = True
        elif word == IDLE:
            self.idles += 1
        elif word == WAKE:
            self.wakes += 1

    def close(self) -> None:
        try:
            os.close(self.fd)
        except OSError:
            pass
