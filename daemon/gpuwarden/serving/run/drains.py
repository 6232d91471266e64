"""A planned stop's drain, as the journal and gpuwarden_serving_drains_total tell it: how many requests were in
flight (running and waiting, from the engine's last /metrics read) when SIGTERM asked the engine to let them
finish, and whether they did within the drain (serving/compose/drain.py), or SIGKILL aborted what was left.

A crash or a stall is no drain: the supervisor ends that child without a SIGTERM to wait on.
"""

from __future__ import annotations

import logging
from collections import Counter

log = logging.getLogger("gpuwarden")

DRAINED, TIMED_OUT, ABORTED = "drained", "timed_out", "aborted"
OUTCOMES = (DRAINED, TIMED_OUT, ABORTED)  # ABORTED: no drain (drain_s 0, or an engine that cannot), or cut short


class DrainLog:
    """The drains of one engine's program. seconds None: a child that serves no requests (nothing said). counts:
    outcome -> planned stops that ended so, shared by the engine's programs one after another (the serving
    runtime's), so that a reload's drain, which ends its program, is still counted after it."""

    def __init__(self, title: str, seconds: float | None, counts: Counter | None = None):
        self.title, self.seconds = title, seconds
        self.counts = counts if counts is not None else Counter()
        self.in_flight: int | None = None  # requests running and waiting at the engine's last /metrics read
        self.active = False  # a stop of a serving engine began and has not ended

    def note(self, stats) -> None:
        """The engine's latest /metrics read (ServingStats; None: none), handed in while it runs or drains."""
        if stats is not None and stats.requests_running is not None and stats.requests_waiting is not None:
            self.in_flight = int(stats.requests_running + stats.requests_waiting)

    def began(self, serving: bool) -> None:
        """SIGTERM was sent for a planned stop; serving: the engine ran healthy (one that starts has no requests)."""
        if self.seconds is None or not serving:
            return
        self.active = True
        if self.seconds:
            log.info("draining %s: %s, up to %g s", self.title, _requests(self.in_flight, "in flight"), self.seconds)
            return
        self.counts[ABORTED] += 1
        if self.in_flight:
            log.warning("%s stops without a drain (serve.drain_s 0, or a version without one): %s", self.title,
                        _requests(self.in_flight, "in flight aborted"))

    def killed(self, cut: bool) -> None:
        """SIGKILL comes before the engine finished its drain: at its end, or cut short by a second stop."""
        if not (self.active and self.seconds):
            return
        self.active = False
        self.counts[ABORTED if cut else TIMED_OUT] += 1
        why = "drain cut short" if cut else "drain timed out"
        log.warning("%s %s: %s", self.title, why, _requests(self.in_flight, "aborted"))

    def ended(self, took: float, killed: bool) -> None:
        """The engine's process group is gone."""
        if self.active and self.seconds and not killed:
            self.active = False
            self.counts[DRAINED] += 1
            log.info("%s drained in %.1f s", self.title, took)

    def view(self) -> tuple[tuple[str, int], ...]:
        """(outcome, count) for every outcome, zeros too; () for a child that serves no requests."""
        return () if self.seconds is None else tuple((outcome, self.counts[outcome]) for outcome in OUTCOMES)


def _requests(count: int | None, what: str) -> str:
    if count is None:
        return f"an unknown number of requests {what}"  # no /metrics read yet
    return f"{count} request{'' if count == 1 else 's'} {what}"
