"""Faults that come once per request (a bad body, a slow client, an engine that is down) logged once per kind
per minute, with a count: a flood of them costs a line a minute, not a line (or a traceback) each.

The same goes for what aiohttp and asyncio log themselves about clients ("Error handling request" with a
traceback for each malformed request, "socket.accept() out of system resource" for each failed accept): their
records go through `quiet()` into the same counts, in one line. Only an exception that passed through gpuwarden's
own code keeps its traceback, the first time its kind is seen: a bug in the proxy still shows where it is, once.
"""

from __future__ import annotations

import logging
import os
import threading
import time

log = logging.getLogger("gpuwarden.proxy")
PACKAGE_DIR = os.path.dirname(os.path.dirname(__file__))  # gpuwarden/, as its code objects name their files
PERIOD_S = 60.0
# Where aiohttp and asyncio log what clients do to them.
LOUD_LOGGERS = ("aiohttp.server", "aiohttp.web", "aiohttp.access", "aiohttp.internal", "asyncio")


class FaultLog:
    def __init__(self, period_s: float = PERIOD_S, clock=time.monotonic):
        self.period_s, self.clock = period_s, clock
        self._lock = threading.Lock()  # dumps fail on the executor's threads
        self._kinds: dict[str, list] = {}  # kind -> [period end, count since the line, level, last message]

    def note(self, kind: str, message: str, level: int = logging.WARNING, exc_info=None) -> None:
        """One occurrence: logged now if it is the first of its kind this minute, else counted."""
        with self._lock:
            entry = self._kinds.get(kind)
            now = self.clock()
            if entry is not None and now < entry[0]:
                entry[1], entry[3] = entry[1] + 1, message
                return
            first_ever = entry is None
            self._kinds[kind] = [now + self.period_s, 0, level, message]
        log.log(level, "proxy: %s", message, exc_info=exc_info if first_ever else None)

    def flush(self) -> None:
        """The counts of kinds whose minute is over, one line each (called every second by the listener)."""
        lines = []
        with self._lock:
            now = self.clock()
            for kind, entry in list(self._kinds.items()):
                if now >= entry[0] and entry[1]:
                    lines.append((entry[2], f"proxy: {entry[1]} more {kind} in the last {self.period_s:g} s; the "
                                            f"last: {entry[3]}"))
                    entry[0], entry[1] = now + self.period_s, 0
        for level, line in lines:
            log.log(level, "%s", line)

    def quiet(self, names=LOUD_LOGGERS) -> None:
        """Route these loggers' records through the counts, as one line each."""
        for name in names:
            logging.getLogger(name).addFilter(self._filter)

    def _filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.INFO:
            return False
        exc = record.exc_info[1] if record.exc_info else None
        first_line = str(record.msg).partition("\n")[0]  # asyncio adds the transport's repr: new for each connection
        kind = f"{record.name} '{first_line}'" + (f" ({type(exc).__name__})" if exc else "")
        try:
            text = record.getMessage()
        except (TypeError, ValueError):
            text = str(record.msg)
        text = f"{record.name}: {text}" + (f": {type(exc).__name__}: {exc}" if exc else "")
        self.note(kind, " ".join(text.split())[:500], record.levelno, record.exc_info if _ours(exc) else None)
        return False  # note() wrote its own line, or counted it


def _ours(exc: BaseException | None) -> bool:
    """Whether the exception passed through gpuwarden's code (a bug of ours), not only aiohttp's or asyncio's."""
    tb = exc.__traceback__ if exc is not None else None
    while tb is not None:
        if tb.tb_frame.f_code.co_filename.startswith(PACKAGE_DIR + os.sep):
            return True
        tb = tb.tb_next
    return False
