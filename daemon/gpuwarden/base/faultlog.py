"""Faults that can come in floods (a bad request, a slow client, an engine that is down) logged at most once a
period, with a count: a flood costs a line a minute, not a line (or a traceback) each.

The first fault after a quiet period is told at once; the others of the period are counted, and flush() (called
every second or so by the server's loop) tells the count once the period is over. Each server words its own
lines (first, more): the proxy keeps a period for each kind of fault, and tells the first of a kind as its own
message, then "N more KIND"; the metrics endpoint keeps one period for all kinds, and tells every line as a count
for each kind (by_kind=False). The fields a line may use: {kind}, {count} (faults in the line), {counts} ("3 hung
up, 1 unauthorized", most first), {last} (the latest fault's message) and {period} (seconds).

Without a count line (more=None) a kind is said at most once a period and its repeats are dropped unsaid: the
daemon's loop errors (service/daemon.py) and the rank watch's blind spell (serving/run/ranks.py). A caller that
words its own line asks admit() whether to say it, and how many were counted since: the GPU events' book
(watch/eventwatch.py) tells that count inside the kind's next line.

The same goes for what a library logs itself about clients (aiohttp's "Error handling request" with a traceback
for each malformed request, asyncio's "socket.accept() out of system resource" for each failed accept): quiet()
routes those loggers' records into the same counts. Only an exception that passed through gpuwarden's own code
keeps its traceback, the first time its kind is seen: a bug of ours still shows where it is, once.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

PACKAGE_DIR = os.path.dirname(os.path.dirname(__file__))  # gpuwarden/, as its code objects name their files
PERIOD_S = 60.0


@dataclass
class _Period:
    ends: float
    level: int  # of the fault that opened it: its count line is logged at the same level
    last: str  # the message of the latest fault counted
    counts: Counter[str] = field(default_factory=Counter)  # faults since the period's last line, by kind


class FaultLog:
    def __init__(self, logger: logging.Logger, first: str = "{last}", more: str | None = None,
                 period_s: float = PERIOD_S, clock=time.monotonic, level: int = logging.WARNING, by_kind: bool = True):
        """first: the line of a fault told at once; more: the line of the faults a period counted (the fields are
        in the module's doc), None to drop them unsaid (an error said at most once a period). level: of a fault
        noted without one."""
        self.logger, self.first, self.more = logger, first, more
        self.period_s, self.clock, self.level, self.by_kind = period_s, clock, level, by_kind
        self._lock = threading.Lock()  # the proxy's dumps fail on the executor's threads
        self._periods: dict[str, _Period] = {}  # by kind (by_kind), else one under ""

    def note(self, kind: str, message: str, level: int | None = None, exc_info=None) -> None:
        """One fault: logged now if it is the first of its period, else counted. exc_info: a traceback to log,
        only the first time this kind is seen."""
        level = self.level if level is None else level
        with self._lock:
            seen = (kind if self.by_kind else "") in self._periods
            if self._admit(kind, message, level, self.clock()) is None:
                return
            line = self._line(self.first, Counter({kind: 1}), message)
        self.logger.log(level, "%s", line, exc_info=None if seen else exc_info)

    def admit(self, kind: str, now: float | None = None) -> int | None:
        """For a caller that words its own line: None while this kind's period runs (the fault is counted), else
        how many of the kind were counted since its last line (a new period begins: the caller tells this one,
        with that count where its line has one). now: the fault's time, if not the clock's."""
        with self._lock:
            return self._admit(kind, "", self.level, self.clock() if now is None else now)

    def _admit(self, kind: str, message: str, level: int, now: float) -> int | None:
        key = kind if self.by_kind else ""
        period = self._periods.get(key)
        if period is not None and now < period.ends:
            period.counts[kind] += 1
            period.last = message
            return None
        self._periods[key] = _Period(now + self.period_s, level, message)
        return period.counts.total() if period is not None else 0

    def set_period(self, seconds: float) -> None:
        """A new period length (a reloaded setting), for the periods running now too: each ends as if it had begun
        with this length."""
        with self._lock:
            for period in self._periods.values():
                period.ends += seconds - self.period_s
            self.period_s = seconds

    def flush(self) -> None:
        """The counts of the periods that are over, a line each."""
        lines = []
        with self._lock:
            now = self.clock()
            for period in self._periods.values():
                if now >= period.ends and period.counts and self.more is not None:
                    lines.append((period.level, self._line(self.more, period.counts, period.last)))
                    period.ends, period.counts = now + self.period_s, Counter()
        for level, line in lines:
            self.logger.log(level, "%s", line)

    def _line(self, template: str, counts: Counter[str], last: str) -> str:
        return template.format(kind=next(iter(counts)), count=counts.total(), last=last, period=self.period_s,
                               counts=", ".join(f"{count} {kind}" for kind, count in counts.most_common()))

    def quiet(self, names: Iterable[str]) -> None:
        """Route these loggers' records (a library's, about what clients did to it) through the counts."""
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
    """Whether the exception passed through gpuwarden's code (a bug of ours), not only a library's."""
    tb = exc.__traceback__ if exc is not None else None
    while tb is not None:
        if tb.tb_frame.f_code.co_filename.startswith(PACKAGE_DIR + os.sep):
            return True
        tb = tb.tb_next
    return False
