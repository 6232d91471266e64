"""What systemd hears from the daemon each poll: READY= once everything is usable, STATUS= the state in one line,
and WATCHDOG=1 only while snapshots are published on schedule ("the snapshot is fresh"), so that systemd
restarts a daemon whose polls stopped.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from ..base.systemd import Notifier, flush_logs

log = logging.getLogger("gpuwarden")


class Heartbeat:
    def __init__(self, notifier: Notifier, poll_interval_s: Callable[[], float]):
        self.notifier = notifier
        self.poll_interval_s = poll_interval_s  # the running config's (a reload may change it)
        self.published_at: float | None = None
        self.ready_sent = False
        self._stale_logged = False

    # -- the watchdog means "the snapshot is fresh" -------------------------------------
    @property
    def stale_after_s(self) -> float:
        return max(3 * self.poll_interval_s(), self.poll_interval_s() + 2.0)

    def fresh(self, now: float) -> bool:
        return self.published_at is not None and now - self.published_at <= self.stale_after_s

    def feed_watchdog(self, now: float) -> None:
        if self.fresh(now):
            self.notifier.watchdog(now)
        elif self.published_at is not None and not self._stale_logged:
            self._stale_logged = True
            log.critical("no poll published for %.1f s: not feeding the watchdog", now - self.published_at)

    def published(self, at: float) -> None:
        """A poll's snapshot is out (monotonic seconds)."""
        self.published_at = at
        if self._stale_logged:
            log.log(logging.WARNING, "polls are published again; feeding the watchdog")
            self._stale_logged = False

    # -- READY= and STATUS= -------------------------------------------------------------
    def report(self, status: str, now: float, ready: bool) -> None:
        """The state after a poll. READY once everything is usable (ready: tuned, and the engine healthy when
        serving; an engine that went FATAL also ends the start-up, so that `systemctl start` returns and the
        STATUS line says why)."""
        if not self.ready_sent and ready:
            flush_logs(0.5)  # once: the journal then shows "vLLM healthy" before systemd's "Started"
            self.notifier.ready(status, now)
            self.ready_sent = True
        self.notifier.status(status, now)
