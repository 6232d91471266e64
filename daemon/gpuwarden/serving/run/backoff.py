"""A child's restart budget and its backoff, as supervisor's process.py has them: failures within
crash_loop_window_s up to crash_loop_failures turn FATAL; before that, each restart waits twice as long as the one
before (1 s, 2 s, 4 s ... backoff_max_s), and a run of stable_after_s starts the doubling again."""

from __future__ import annotations

from collections import deque

from .spec import Timing


class Backoff:
    def __init__(self) -> None:
        self.failures: deque[float] = deque()  # when each recent failure happened (the crash-loop window)
        self.consecutive = 0  # failures since the last stable run (the backoff's exponent)

    def running(self, now: float, since: float, timing: Timing) -> None:
        if self.consecutive and now - since >= timing.stable_after_s:
            self.consecutive = 0  # a stable run resets the backoff

    def failed(self, now: float, timing: Timing) -> float | None:
        """A failure at now: how long the next start waits, or None when the failures make a crash loop."""
        self.failures.append(now)
        while self.failures and now - self.failures[0] > timing.crash_loop_window_s:
            self.failures.popleft()
        if len(self.failures) >= timing.crash_loop_failures:
            return None
        self.consecutive += 1
        return min(timing.backoff_max_s, 2.0 ** (self.consecutive - 1))

    def reset(self) -> None:
        """SIGHUP after FATAL: a fresh budget."""
        self.failures.clear()
        self.consecutive = 0
