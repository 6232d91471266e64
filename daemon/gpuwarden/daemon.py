"""The long-running daemon: tune, then monitor on a fixed period until stopped.

As in gunicorn's arbiter, signal handlers do nothing but wake the main loop
(through signal.set_wakeup_fd); the loop reads which signals arrived and
dispatches them by name (handle_term, handle_hup, ...), so no work ever runs
inside a handler and a signal can never interrupt a half-done step.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import select
import signal
import time
from collections.abc import Callable

from . import __version__
from .config import Config
from .exporter import MetricsServer, make_registry
from .gpu.base import GpuBackend
from .monitor import Monitor, describe_sample
from .serving.prepare import prepare_serve
from .serving.supervisor import FATAL, RUNNING, Supervisor
from .serving.vllm_metrics import VllmMetricsReader
from .systemd import Notifier
from .tuning import Plan, Tuner, make_plan
from .yamlfile import ConfigError, ConfigErrors

log = logging.getLogger("gpuwarden")

HANDLED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
# Settings a reload cannot change in a running daemon.
RESTART_ONLY = ("gpu", "metrics", "counters_interval_s")


class StartupError(Exception):
    """The daemon cannot start; the message is one line for the user."""


class Daemon:
    def __init__(self, config: Config, backend: GpuBackend, reload: Callable[[], Config] | None = None,
                 notifier: Notifier | None = None):
        self.config = config
        self.backend = backend
        self.reload_config = reload
        self.notifier = notifier or Notifier()
        self.tuner = Tuner(backend)
        self.monitor = Monitor(config, backend, self.tuner)
        self.plan: Plan | None = None
        self.server: MetricsServer | None = None
        self.supervisor: Supervisor | None = None
        self.vllm_reader: VllmMetricsReader | None = None
        self.ready_sent = False
        self.stopping = False
        self.started_at = time.time()

    # -- life cycle -------------------------------------------------------------
    def start(self, now: float) -> None:
        """Plan and tune, serve metrics, take the first sample, then tell systemd we are ready.
        Raises ConfigErrors for values a card rejects, StartupError if the port is taken."""
        self.plan = make_plan(self.backend, self.config)
        for note in self.plan.notes:
            log.info("%s", note)
        log.info("before tuning: %s", " | ".join(describe_sample(g.sample()) for g in self.backend.gpus()))
        self._tune(self.plan)
        if self.config.metrics.listen is not None:
            try:
                self.server = MetricsServer(self.config.metrics.listen, make_registry(lambda: self.monitor.snapshot),
                                            self.status)
            except OSError as exc:
                host, port = self.config.metrics.listen
                raise StartupError(f"cannot serve metrics on {host}:{port}: {exc.strerror} "
                                   "(change metrics.listen, or set it to none)") from None
            self.server.start()
            log.info("serving /metrics and /status on %s", self.config.metrics.url)
        if self.config.serve.enabled:
            self._start_serving(now, deep=True)
        self.tick(now)

    def _start_serving(self, now: float, deep: bool) -> None:
        """Check the vLLM command (lint; with deep, vLLM's own parser too), then start the child.
        Raises ConfigErrors when something blocks the start."""
        prepared = prepare_serve(self.config, self.backend, deep=deep)
        for finding in prepared.findings:
            log.warning("vLLM lint %s", finding)
        problems = prepared.blocking(self.config)
        if problems:
            raise ConfigErrors(problems)
        if prepared.flags is not None:
            log.info("vLLM %s accepts the flags (checked with %s)", prepared.flags.vllm_version,
                     prepared.flags.python)
        chosen = {g.index for g in prepared.command.gpus}
        self.supervisor = Supervisor(self.config.serve, prepared.command,
                                     [g for g in self.backend.gpus() if g.index in chosen])
        self.vllm_reader = VllmMetricsReader(self.config.serve.url + "/metrics")
        self.supervisor.start(now)

    def _tune(self, plan: Plan) -> None:
        self.monitor.use_plan(plan, applied=self.config.tuning.apply)
        if not self.config.tuning.apply:
            for action in plan.actions:
                log.info("read-only (tuning.apply is false), would do: %s", action.describe())
            return
        for outcome in self.tuner.apply(plan):
            if not outcome.ok:
                log.error("tuning %s", outcome.describe())
        for outcome in self.tuner.verify(plan):
            (log.info if outcome.ok else log.warning)("tuning %s", outcome.describe("verified"))

    def tick(self, now: float, lag: float = 0.0) -> None:
        try:
            serving, stats = self._serving_tick(now) if self.supervisor is not None else (None, None)
            snapshot = self.monitor.tick(now, lag, serving=serving, vllm=stats)
        except Exception as exc:  # one bad poll must not end the daemon; the next one may work
            log.error("poll failed: %s: %s", type(exc).__name__, exc)
            return
        status = snapshot.status_line()
        # READY once everything is usable: tuned, and vLLM healthy when serving. A vLLM that went FATAL
        # also ends the start-up, so that `systemctl start` returns and the STATUS line says why.
        if not self.ready_sent and (self.supervisor is None or self.supervisor.state in (RUNNING, FATAL)):
            self.notifier.ready(status)
            self.ready_sent = True
        self.notifier.status(status)

    def _serving_tick(self, now: float):
        """Advance the vLLM child and read its metrics, before the GPUs are evaluated."""
        was_running = self.supervisor.state == RUNNING
        self.supervisor.tick(now)
        stats = None
        if self.supervisor.state == RUNNING:
            if not was_running:
                self.vllm_reader.reset()  # a new child: its counters restart at zero
            stats = self.vllm_reader.read(now)
        # Running requests make a GPU busy even between kernels.
        self.monitor.report_running_requests(int(stats.requests_running) if stats and stats.requests_running
                                             else None)
        return self.supervisor.view(), stats

    def stop(self) -> None:
        self.notifier.stopping()
        if self.supervisor is not None:
            self.supervisor.stop()
        if self.config.tuning.apply and self.config.tuning.restore_on_stop:
            for outcome in self.tuner.restore():
                (log.info if outcome.ok else log.error)("restore %s", outcome.describe())
        if self.server is not None:
            self.server.stop()
            self.server = None

    def status(self) -> dict:
        """What `gpuwarden status` shows: the daemon, plus the latest snapshot."""
        snapshot = self.monitor.snapshot
        return {"daemon": {"version": __version__, "pid": os.getpid(), "started_at": self.started_at,
                           "config_files": list(self.config.files), "poll_interval_s": self.config.poll_interval_s},
                **(snapshot.as_dict() if snapshot else {})}

    # -- signal dispatch (by name, as in gunicorn) -----------------------------------
    def dispatch(self, signum: int) -> None:
        getattr(self, "handle_" + signal.Signals(signum).name[3:].lower())()

    def handle_term(self) -> None:
        log.info("SIGTERM received, stopping")
        self.stopping = True

    def handle_int(self) -> None:
        log.info("SIGINT received, stopping")
        self.stopping = True

    def handle_hup(self) -> None:
        """Reload: validate the new config first; on any error keep running the old one."""
        if self.reload_config is None:
            log.warning("SIGHUP received, but this daemon has no config file to reload")
            return
        try:
            new = self.reload_config()
            changed = [key for key in RESTART_ONLY if getattr(new, key) != getattr(self.config, key)]
            new = dataclasses.replace(new, **{key: getattr(self.config, key) for key in changed})
            plan = make_plan(self.backend, new)
        except (ConfigError, ConfigErrors) as exc:
            problems = exc.errors if isinstance(exc, ConfigErrors) else [exc]
            more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
            log.error("reload failed, still running the previous config: %s%s", problems[0], more)
            return
        if changed:
            log.warning("reload: %s only change on restart; keeping the running values", ", ".join(changed))
        old, self.config = self.config, new
        self.monitor.config = new
        if new.tuning != old.tuning:
            self._release_dropped(old, plan)
            self.plan = plan
            self._tune(plan)
        self._reload_serving(old)
        log.info("config reloaded from %s", ", ".join(new.files))

    def _reload_serving(self, old: Config) -> None:
        """A changed serve section restarts vLLM; an unchanged one only leaves FATAL."""
        now = time.monotonic()
        if self.config.serve == old.serve:
            if self.supervisor is not None:
                self.supervisor.reset(now)
            return
        if self.supervisor is not None:
            self.supervisor.stop()
            self.supervisor = None
        if self.config.serve.enabled:
            try:  # lint only: vLLM's parser takes too long to run inside the watchdog's window
                self._start_serving(now, deep=False)
            except (ConfigError, ConfigErrors) as exc:
                problems = exc.errors if isinstance(exc, ConfigErrors) else [exc]
                log.error("reload: vLLM not started: %s", problems[0])

    def _release_dropped(self, old: Config, plan: Plan) -> None:
        """Undo settings the old tuning made that the new one no longer wants."""
        if not old.tuning.apply:
            return
        kept = {(a.gpu, a.setting) for a in plan.actions} if self.config.tuning.apply else set()
        dropped = {(a.gpu, a.setting) for a in (self.plan.actions if self.plan else ())} - kept
        for outcome in self.tuner.restore(only=dropped):
            (log.info if outcome.ok else log.error)("reload: no longer wanted, %s", outcome.describe())


class SignalWaker:
    """Signals wake a select() through a pipe; the handlers themselves do nothing."""

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
    """The main loop: poll on a fixed period, ping the watchdog, until a stop signal or duration_s."""
    waker = SignalWaker()
    try:
        start = clock()
        daemon.start(start)
        next_tick = start + daemon.config.poll_interval_s
        while not daemon.stopping:
            now = clock()
            daemon.notifier.watchdog(now)
            if duration_s is not None and now - start >= duration_s:
                log.info("ran for %g s as asked, stopping", duration_s)
                break
            if now >= next_tick:
                # Alerts count time on the schedule, so for_s spans whole polls: a tick that runs a
                # millisecond late must not push firing back by a whole poll interval.
                daemon.tick(next_tick, lag=now - next_tick)
                # Keep the period fixed; after a stall, skip missed ticks rather than burst.
                next_tick = max(next_tick + daemon.config.poll_interval_s, now)
            waits = [next_tick - clock(), daemon.notifier.next_watchdog_in(clock())]
            if duration_s is not None:
                waits.append(start + duration_s - clock())
            for signum in waker.wait(min(w for w in waits if w is not None)):
                daemon.dispatch(signum)
        daemon.stop()
    finally:
        waker.close()
