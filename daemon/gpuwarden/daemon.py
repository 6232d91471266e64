"""The long-running daemon: tune once, then sample every poll interval.

As in gunicorn's arbiter, signal handlers do nothing but wake the main loop
(through signal.set_wakeup_fd); the loop reads which signals arrived and
dispatches them by name, so no work ever runs inside a handler.
"""

from __future__ import annotations

import logging
import os
import select
import signal
import time
from collections.abc import Callable

from .config import Config
from .gpu.base import GpuBackend, GpuSample
from .tuning import Plan, Tuner, make_plan

log = logging.getLogger("gpuwarden")

HANDLED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def describe_sample(s: GpuSample) -> str:
    """One compact, readable summary of a GPU for the log."""
    if not s.up:
        return f"GPU{s.index} DOWN ({s.error})"
    parts = [f"GPU{s.index} sm {_num(s.sm_clock_mhz)}/{_num(s.max_sm_clock_mhz)} MHz",
             f"mem {_num(s.memory_clock_mhz)} MHz"]
    power = f"{s.power_w:.0f}" if s.power_w is not None else "?"
    parts.append(f"{power}/{s.power_limit_w:.0f} W" if s.power_limit_w is not None else f"{power} W")
    parts.append(f"{_num(s.temperature_c)} C")
    parts.append(f"util {_num(s.utilization_pct)}%")
    if s.performance_state is not None:
        parts.append(f"P{s.performance_state}")
    reasons = s.clock_event_reasons.names() if s.clock_event_reasons else []
    if reasons:
        parts.append("[" + ",".join(reasons) + "]")
    return " ".join(parts)


def _num(value: float | None) -> str:
    return "?" if value is None else f"{value:.0f}"


class Daemon:
    def __init__(self, config: Config, backend: GpuBackend):
        self.config = config
        self.backend = backend
        self.tuner = Tuner(backend)
        self.plan: Plan | None = None
        self.stopping = False

    def start(self) -> None:
        """Plan, and apply unless read-only. Raises ConfigErrors for unsupported values."""
        self.plan = make_plan(self.backend, self.config)
        for note in self.plan.notes:
            log.info("%s", note)
        log.info("before tuning: %s", " | ".join(describe_sample(g.sample()) for g in self.backend.gpus()))
        if not self.config.tuning.apply:
            for action in self.plan.actions:
                log.info("read-only (tuning.apply is false), would do: %s", action.describe())
            return
        for outcome in self.tuner.apply(self.plan):
            if not outcome.ok:
                log.error("tuning %s", outcome.describe())
        for outcome in self.tuner.verify(self.plan):
            (log.info if outcome.ok else log.warning)("tuning %s", outcome.describe("verified"))

    def tick(self) -> list[GpuSample]:
        samples = [gpu.sample() for gpu in self.backend.gpus()]
        log.info("%s", " | ".join(describe_sample(s) for s in samples))
        return samples

    def stop(self) -> None:
        if self.config.tuning.apply and self.config.tuning.restore_on_stop:
            for outcome in self.tuner.restore():
                (log.info if outcome.ok else log.error)("restore %s", outcome.describe())

    # -- signal dispatch (by name, as in gunicorn) -----------------------------------
    def handle_term(self) -> None:
        log.info("SIGTERM received, stopping")
        self.stopping = True

    def handle_int(self) -> None:
        log.info("SIGINT received, stopping")
        self.stopping = True

    def handle_hup(self) -> None:
        log.info("SIGHUP received; config reload is not implemented yet, keeping the current config")

    def dispatch(self, signum: int) -> None:
        name = signal.Signals(signum).name[3:].lower()
        getattr(self, f"handle_{name}")()


class SignalWaker:
    """Signals wake a select() through a pipe; handlers only let the byte through."""

    def __init__(self) -> None:
        self.read_fd, self.write_fd = os.pipe()
        os.set_blocking(self.read_fd, False)
        os.set_blocking(self.write_fd, False)
        self._old_fd = signal.set_wakeup_fd(self.write_fd)
        self._old = {s: signal.signal(s, lambda *_: None) for s in HANDLED_SIGNALS}

    def wait(self, timeout: float) -> list[int]:
        """Signals that arrived, waiting at most timeout seconds for one."""
        try:
            ready, _, _ = select.select([self.read_fd], [], [], max(0.0, timeout))
        except InterruptedError:
            ready = [self.read_fd]
        if not ready:
            return []
        try:
            return list(os.read(self.read_fd, 64))
        except BlockingIOError:
            return []

    def close(self) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)
        signal.set_wakeup_fd(self._old_fd)
        os.close(self.read_fd)
        os.close(self.write_fd)


def run(daemon: Daemon, duration_s: float | None = None, clock: Callable[[], float] = time.monotonic) -> None:
    """The main loop: tick on a fixed period until a stop signal or duration_s."""
    waker = SignalWaker()
    try:
        daemon.start()
        start = next_tick = clock()
        while not daemon.stopping:
            now = clock()
            if duration_s is not None and now - start >= duration_s:
                log.info("ran for %g s as asked, stopping", duration_s)
                break
            if now >= next_tick:
                daemon.tick()
                # Keep the period fixed; after a stall, skip missed ticks rather than burst.
                next_tick = max(next_tick + daemon.config.poll_interval_s, now)
            timeout = next_tick - clock()
            if duration_s is not None:
                timeout = min(timeout, start + duration_s - clock())
            for signum in waker.wait(timeout):
                daemon.dispatch(signum)
        daemon.stop()
    finally:
        waker.close()
