"""The long-running daemon: tune, then monitor on a fixed period until stopped.

As in gunicorn's arbiter, signal handlers do nothing but wake the main loop
(through signal.set_wakeup_fd); the loop reads which signals arrived and
dispatches them by name (handle_term, handle_hup, ...), so no work ever runs
inside a handler and a signal can never interrupt a half-done step.

The loop never waits on anything it does not own: reads of the child happen
on worker threads with a total deadline, stopping the child is a timed state
the tick advances, and log lines go through a bounded queue. Serving and GPU
monitoring fail separately, and the watchdog is fed only while snapshots are
published on schedule, so systemd restarts a daemon whose polls stopped.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import select
import signal
import time
from collections.abc import Callable

from . import __version__, earlysignals
from .config import Config
from .exporter import Exposition, MetricsServer
from .gpuevents import EventWatcher
from .gpu.base import GpuBackend
from .monitor import Monitor, describe_sample
from .originals import originals_store
from .proxy.child import PROXY, proxy_program
from .serving.prepare import PreparedServe, prepare_serve
from .serving.processes import ProcessOps
from .statedir import listen_file
from .serving.metrics import MetricsReader
from .serving.stall import Progress, StallWatch
from .serving.supervisor import FATAL, RUNNING, Program, Supervisor
from .systemd import Notifier, flush_logs
from .tuning import Plan, Tuner, make_plan
from .yamlfile import ConfigErrors, InvalidConfig

log = logging.getLogger("gpuwarden")

HANDLED_SIGNALS = earlysignals.SIGNALS
EVENTS_WAKE = 0  # the byte the GPU event thread writes to the wake-up pipe: no signal has number 0
# Settings a reload cannot change in a running daemon.
RESTART_ONLY = ("gpu", "metrics", "counters_interval_s")
ERROR_REPEAT_S = 60.0  # the same serving or poll error is logged at most this often
STOP_MARGIN_S = 30.0  # beyond the child's drain, for SIGKILL and restoring the tuning


class StartupError(Exception):
    """The daemon cannot start; the message is one line for the user."""


class Daemon:
    def __init__(self, config: Config, backend: GpuBackend, reload: Callable[[], Config] | None = None,
                 notifier: Notifier | None = None, ops: ProcessOps | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.config = config
        self.backend = backend
        self.reload_config = reload
        self.notifier = notifier or Notifier()
        self.ops = ops or ProcessOps()  # one for every child: it knows which processes we started
        self.clock = clock
        self.tuner = Tuner(backend, originals_store(config))
        self.monitor = Monitor(config, backend, self.tuner)
        self.exposition = Exposition(lambda: self.monitor.snapshot, clock)
        self.plan: Plan | None = None
        self.server: MetricsServer | None = None
        self.supervisor: Supervisor | None = None
        self.pending: Supervisor | None = None  # the next child, started once the old one has stopped
        self.stats_reader: MetricsReader | None = None  # the engine's /metrics
        self.stall_watch: StallWatch | None = None  # is the engine making progress
        self.watcher: EventWatcher | None = None  # Xid and fatal events, on their own thread
        self.wake: Callable[[], None] | None = None  # run() sets it: wakes the loop as a signal does
        self.ready_sent = False
        self.reload_asked = False  # a SIGHUP came: the next tick reloads
        self.stopping = False
        self.tuned = False
        self.started_at = time.time()
        self.published_at: float | None = None
        self._stale_logged = False
        self._errors: dict[str, float] = {}  # message -> when last logged

    # -- life cycle -------------------------------------------------------------
    def start(self, now: float) -> None:
        """Check the plan and the serving command and take the port first (what can fail), then tune, start the
        engine, take the first sample, and tell systemd we are ready. Raises ConfigErrors for values a card or
        the engine rejects, StartupError if the metrics port is taken; neither leaves a GPU setting changed."""
        self.plan = make_plan(self.backend, self.config)
        serving = self._prepare_serving(self.config, deep=True) if self.config.serve.enabled else None
        if self.config.metrics.listen is not None:
            try:
                self.server = MetricsServer(self.config.metrics.listen, self.exposition, self.status_document,
                                            self.config.metrics.web)
            except OSError as exc:
                host, port = self.config.metrics.listen
                raise StartupError(f"cannot serve metrics on {host}:{port}: {exc.strerror} "
                                   "(change metrics.listen, or set it to none)") from None
        for note in self.plan.notes:
            log.info("%s", note)
        log.info("before tuning: %s", " | ".join(describe_sample(g.sample()) for g in self.backend.gpus()))
        self._tune(self.plan)
        self._watch_events()
        if self.server is not None:
            self.server.start()
            log.info("serving /metrics and /status on %s", self.config.metrics.url)
            if os.environ.get("RUNTIME_DIRECTORY"):  # systemd's RuntimeDirectory=: the unit makes one
                with contextlib.suppress(OSError):
                    listen_file().write_text(self.config.metrics.url + "\n")
        if serving is not None:
            self.supervisor = serving
            self.stats_reader, self.stall_watch = self._reader(self.config), self._stall_watch(self.config)
            self.supervisor.start(now)
        self.tick(now)

    def _watch_events(self) -> None:
        """Start the thread that waits for Xid and fatal events (where the backend reports them)."""
        try:
            source = self.backend.events()
        except Exception as exc:  # the events are extra: polling goes on without them
            log.warning("GPU events unavailable: %s: %s", type(exc).__name__, exc)
            return
        if source is None:
            log.info("GPU events: this backend reports none; Xids show only in the kernel log")
            return
        kinds = "; ".join(f"GPU{gpu} {','.join(names)}" for gpu, names in sorted(source.registered.items()))
        log.info("GPU events: waiting for %s", kinds or "none (no GPU reports events)")
        self.watcher = EventWatcher(source, self.wake)
        self.watcher.start()

    def handle_gpu_events(self) -> None:
        """Events the watcher queued: log and count them now; a GPU that needs a reset or a reboot stops
        the serving engine on it (no restart loop on a broken GPU)."""
        if self.watcher is None:
            return
        if self.watcher.failure is not None:
            self._error_once(f"GPU events stopped: {self.watcher.failure}")
        now = self.clock()
        holds = self.monitor.record_events(self.watcher.take(), now)
        if self.supervisor is None or self.stopping:
            return
        engine = self.supervisor.main
        mine = {g.index for g in engine.gpus}
        # New events, and any GPU still waiting for a reset (an engine started since must not run there).
        for gpu, why in holds + list(self.monitor.events.needs_reset.items()):
            if gpu in mine or gpu < 0:
                engine.hold(now, f"GPU{gpu} {why}" if gpu >= 0 else why)

    def _prepare_serving(self, config: Config, deep: bool, on_loop: bool = False) -> Supervisor:
        """Everything a start needs, checked, without starting: engine, profile, GPUs, lint, spawnability (and
        with deep, the engine's own parser). Raises ConfigErrors when something would block the start."""
        prepared: PreparedServe = prepare_serve(config, self.backend, deep=deep, create_home=True, on_loop=on_loop)
        title = prepared.command.engine.title
        if prepared.home_note:
            log.info("%s's user %s", title, prepared.home_note)
        if prepared.installed is not None:
            log.info("%s: %s", title, prepared.installed.describe())
        for finding in prepared.findings:
            log.warning("%s lint %s", title, finding)
        problems = prepared.blocking(config)
        if problems:
            raise ConfigErrors(problems)
        if prepared.flags is not None:
            log.info("%s %s accepts the flags (checked with %s)", title, prepared.flags.version, prepared.flags.python)
        chosen = {g.index for g in prepared.command.gpus}
        engine = Program(config.serve, prepared.command, prepared.identity,
                         [g for g in self.backend.gpus() if g.index in chosen], ops=self.ops, clock=self.clock)
        if not config.serve.proxy.enabled:
            return Supervisor([engine])
        return Supervisor([engine, proxy_program(config, engine, prepared.identity, ops=self.ops, clock=self.clock)])

    def _reader(self, config: Config) -> MetricsReader:
        engine = self.supervisor.main.engine
        return MetricsReader(config.serve.url + engine.metrics_path, engine.metric_names, self.clock)

    def _stall_watch(self, config: Config) -> StallWatch:
        main = self.supervisor.main
        serve = config.serve
        return StallWatch(serve.stall_after_s, serve.probe_after_s, serve.probe_timeout_s,
                          serve.url + main.engine.completions_path, main.engine.served_model(serve, main.command.argv),
                          self.clock, key=main.engine.api_key(main.command.argv, main.command.env))

    def _tune(self, plan: Plan) -> None:
        self.monitor.use_plan(plan, applied=self.config.tuning.apply)
        if not self.config.tuning.apply:
            for action in plan.actions:
                log.info("read-only (tuning.apply is false), would do: %s", action.describe())
            return
        self.tuned = True
        for outcome in self.tuner.apply(plan):
            if not outcome.ok:
                log.error("tuning %s", outcome.describe())
        for outcome in self.tuner.verify(plan):
            (log.info if outcome.ok else log.warning)("tuning %s", outcome.describe("verified"))

    def tick(self, now: float, lag: float = 0.0) -> None:
        """One poll: a reload if one was asked for, advance serving (its faults stay there), then sample and
        publish the GPUs."""
        if self.reload_asked:
            self.reload_asked = False
            try:
                self.reload()
            except Exception as exc:  # reload() keeps what runs on a bad config; this is a bug's last net
                self._error_once(f"reload: {type(exc).__name__}: {exc}")
        try:
            self.handle_gpu_events()  # any the wake-up missed
        except Exception as exc:
            self._error_once(f"GPU events: {type(exc).__name__}: {exc}")
        serving, stats = self._serving_tick(now)
        try:
            snapshot = self.monitor.tick(now, lag, serving=serving, stats=stats, published_at=self.clock())
        except Exception as exc:  # one bad poll must not end the daemon; the next one may work
            self._error_once(f"poll failed: {type(exc).__name__}: {exc}")
            return
        self.published_at = snapshot.published_at
        if self._stale_logged:
            log.log(logging.WARNING, "polls are published again; feeding the watchdog")
            self._stale_logged = False
        if self.server is not None:
            self.exposition.published()
        status = snapshot.summary_line()
        # READY once everything is usable: tuned, and the engine healthy when serving. An engine that went FATAL
        # also ends the start-up, so that `systemctl start` returns and the STATUS line says why.
        if not self.ready_sent and (self.supervisor is None or self.supervisor.main.state in (RUNNING, FATAL)):
            flush_logs(0.5)  # once: the journal then shows "vLLM healthy" before systemd's "Started"
            self.notifier.ready(status)
            self.ready_sent = True
        self.notifier.status(status)

    def _serving_tick(self, now: float):
        """Advance the children and read the engine's metrics. Never raises: a serving fault is logged and
        the GPUs are still polled."""
        try:
            self._swap_in_pending(now)
            if self.supervisor is None:
                self.monitor.report_running_requests(None)
                return None, None
            engine = self.supervisor.main
            was_running = engine.state == RUNNING
            self.supervisor.tick(now)
            stats = None
            if engine.state == RUNNING:
                if not was_running:
                    self.stats_reader.reset()  # a new child: its counters restart at zero
                    self.stall_watch.reset(now)
                stats = self.stats_reader.read(now)
                progress = Progress(stats.tokens_total, stats.requests_running, stats.requests_waiting) \
                    if stats else None
                engine.note_stall(now, self.stall_watch.update(now, progress), self.config.serve.restart_on_stall)
            # Running requests make a GPU busy even between kernels.
            running = stats.requests_running if stats else None
            self.monitor.report_running_requests(int(running) if running else None)
            return self.supervisor.views(), stats
        except Exception as exc:
            self._error_once(f"serving: {type(exc).__name__}: {exc} (GPU monitoring goes on)")
            try:
                return (self.supervisor.views() if self.supervisor else None), None
            except Exception:
                return None, None

    def _swap_in_pending(self, now: float) -> None:
        """After a reload, the new child starts once the old one is fully stopped."""
        if self.supervisor is not None and not self.supervisor.stopped:
            return
        if self.pending is not None:
            self.supervisor, self.pending = self.pending, None
            self.stats_reader, self.stall_watch = self._reader(self.config), self._stall_watch(self.config)
            self.supervisor.start(now)
        elif self.supervisor is not None and not self.config.serve.enabled:
            self.supervisor = self.stats_reader = self.stall_watch = None

    def _error_once(self, message: str) -> None:
        """Log an error, but the same one at most every ERROR_REPEAT_S."""
        now = self.clock()
        if now - self._errors.get(message, float("-inf")) >= ERROR_REPEAT_S:
            self._errors[message] = now
            log.error("%s", message)

    # -- the watchdog means "the snapshot is fresh" -------------------------------------
    @property
    def stale_after_s(self) -> float:
        return max(3 * self.config.poll_interval_s, self.config.poll_interval_s + 2.0)

    def fresh(self, now: float) -> bool:
        return self.published_at is not None and now - self.published_at <= self.stale_after_s

    def feed_watchdog(self, now: float) -> None:
        if self.fresh(now):
            self.notifier.watchdog(now)
        elif self.published_at is not None and not self._stale_logged:
            self._stale_logged = True
            log.critical("no poll published for %.1f s: not feeding the watchdog", now - self.published_at)

    # -- stopping ------------------------------------------------------------------------
    def begin_stop(self, now: float) -> None:
        """Start stopping: the child drains (a timed state) while the loop keeps polling."""
        if self.stopping:
            return
        self.stopping = True
        self.pending = None
        self.notifier.stopping()
        if self.supervisor is not None:
            # systemd's TimeoutStopSec covers the default drain; a longer one asks for more time.
            self.notifier.extend_timeout(self.config.serve.stop_timeout_s + STOP_MARGIN_S)
            self.supervisor.stop(now)

    @property
    def stop_done(self) -> bool:
        return self.stopping and (self.supervisor is None or self.supervisor.stopped)

    def finish(self) -> None:
        """The last step of every exit, also after an error: stop the event thread, restore the tuning if
        asked, close the port."""
        if self.watcher is not None:
            if not self.watcher.stop():
                log.warning("the GPU event thread did not end within 2 s")
            self.watcher = None
        if self.tuned and self.config.tuning.apply and self.config.tuning.restore_on_stop:
            try:
                for outcome in self.tuner.restore():
                    (log.info if outcome.ok else log.error)("restore %s", outcome.describe())
            except Exception as exc:
                log.error("restore failed: %s: %s", type(exc).__name__, exc)
        if self.server is not None:
            self.server.stop()
            self.server = None
            if os.environ.get("RUNTIME_DIRECTORY"):
                with contextlib.suppress(OSError):
                    listen_file().unlink()
        self.exposition.close()

    def status_document(self) -> dict:
        """What `gpuwarden status` shows: the daemon, plus the latest snapshot (finite numbers only)."""
        snapshot = self.monitor.snapshot
        age = None if snapshot is None else max(0.0, self.clock() - snapshot.published_at)
        return _finite({"daemon": {"version": __version__, "pid": os.getpid(), "started_at": self.started_at,
                                   "config_files": list(self.config.files),
                                   "poll_interval_s": self.config.poll_interval_s,
                                   "snapshot_age_seconds": age, "stale": age is not None and age > self.stale_after_s},
                        **(snapshot.as_dict() if snapshot else {})})

    # -- signal dispatch (by name, as in gunicorn) -----------------------------------
    def dispatch(self, signum: int) -> None:
        if signum == EVENTS_WAKE:
            self.handle_gpu_events()
            return
        getattr(self, "handle_" + signal.Signals(signum).name[3:].lower())()

    def handle_term(self) -> None:
        now = self.clock()
        if self.stopping:
            log.warning("SIGTERM again while stopping: not waiting for the children's drain")
            if self.supervisor is not None:
                self.supervisor.kill_now(now)
            return
        log.info("SIGTERM received, stopping")
        self.begin_stop(now)

    def handle_int(self) -> None:
        now = self.clock()
        if self.stopping and self.supervisor is not None:
            self.supervisor.kill_now(now)
            return
        log.info("SIGINT received, stopping")
        self.begin_stop(now)

    def handle_hup(self) -> None:
        """A reload is asked for; the next poll carries it out, so that any number of SIGHUPs in a row cost at
        most one reload per poll and the loop keeps its schedule (and the watchdog its food)."""
        self.reload_asked = True

    def reload(self) -> None:
        """Reload: load, validate and prepare everything first; on any error keep running what runs."""
        if self.reload_config is None:
            log.warning("SIGHUP received, but this daemon has no config file to reload")
            return
        if self.stopping:
            log.warning("SIGHUP received while stopping: ignored")
            return
        try:
            new = self.reload_config()
            changed = [key for key in RESTART_ONLY if getattr(new, key) != getattr(self.config, key)]
            new = dataclasses.replace(new, **{key: getattr(self.config, key) for key in changed})
            plan = make_plan(self.backend, new)
            serve_changed = new.serve != self.config.serve
            # Only serve.proxy changed: the proxy restarts, the engine keeps serving.
            proxy_only = (serve_changed and self.supervisor is not None and self.pending is None
                          and dataclasses.replace(new.serve, proxy=self.config.serve.proxy) == self.config.serve)
            # lint only, with the installed versions from the cache: nothing here waits on the engine's interpreter
            serving = (self._prepare_serving(new, deep=False, on_loop=True)
                       if serve_changed and not proxy_only and new.serve.enabled else None)
        except InvalidConfig as exc:
            problems = exc.errors
            more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
            log.error("reload failed, still running the previous config: %s%s", problems[0], more)
            return
        except Exception as exc:  # RecursionError, MemoryError, a bug: still keep what runs
            log.error("reload failed, still running the previous config: %s: %s", type(exc).__name__, exc)
            return
        if changed:
            log.warning("reload: %s only change on restart; keeping the running values", ", ".join(changed))
        if self.monitor.events.needs_reset:  # the operator reset the GPUs (or says they need none)
            log.info("reload: no GPU counts as waiting for a reset any more")
            self.monitor.events.needs_reset.clear()
        old, self.config = self.config, new
        self.monitor.config = new
        if new.tuning != old.tuning:
            self._release_dropped(old, plan)
            self.plan = plan
            self._tune(plan)
        now = self.clock()
        if proxy_only:
            main = self.supervisor.main
            log.info("reload: serve.proxy changed; restarting the proxy only")
            self.supervisor.replace(PROXY, proxy_program(new, main, main.identity, ops=self.ops, clock=self.clock)
                                    if new.serve.proxy.enabled else None, now)
        elif serve_changed:
            if self.supervisor is not None:
                self.supervisor.stop(now)  # the new child starts once this one has stopped
            self.pending = serving
        elif self.supervisor is not None:
            self.supervisor.reset(now)
        log.info("config reloaded from %s", ", ".join(new.files))

    def _release_dropped(self, old: Config, plan: Plan) -> None:
        """Undo settings the old tuning made that the new one no longer wants."""
        if not old.tuning.apply:
            return
        kept = {(a.gpu, a.setting) for a in plan.actions} if self.config.tuning.apply else set()
        dropped = {(a.gpu, a.setting) for a in (self.plan.actions if self.plan else ())} - kept
        for outcome in self.tuner.restore(only=dropped):
            (log.info if outcome.ok else log.error)("reload: no longer wanted, %s", outcome.describe())


def _finite(value):
    """The same structure with NaN and infinities as None: /status must be valid JSON."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


class SignalWaker:
    """Signals wake a select() through a pipe; the handlers themselves do nothing."""

    def __init__(self) -> None:
        self.read_fd, self.write_fd = os.pipe()
        os.set_blocking(self.read_fd, False)
        os.set_blocking(self.write_fd, False)
        self._old_fd = signal.set_wakeup_fd(self.write_fd)
        self._old = {s: earlysignals.original(s, signal.signal(s, lambda *_: None)) for s in HANDLED_SIGNALS}
        # Those that came before this loop existed (earlysignals.py), first and in order.
        for signum in earlysignals.take():
            os.write(self.write_fd, bytes([signum]))

    def wait(self, timeout: float) -> list[int]:
        """Signals that arrived, waiting at most timeout seconds for one."""
        try:
            ready, _, _ = select.select([self.read_fd], [], [], max(0.0, timeout))
        except InterruptedError:
            ready = [self.read_fd]
        if not ready:
            return []
        try:
            data = os.read(self.read_fd, 64)
        except BlockingIOError:
            return []
        # Signals in order; any number of GPU-event wake-ups (a storm) as one.
        return [b for b in data if b != EVENTS_WAKE] + ([EVENTS_WAKE] if EVENTS_WAKE in data else [])

    def wake(self) -> None:
        """From another thread: wake the loop for GPU events."""
        try:
            os.write(self.write_fd, bytes([EVENTS_WAKE]))
        except (BlockingIOError, OSError):
            pass  # the pipe is full: the loop is awake already

    def close(self) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)
        signal.set_wakeup_fd(self._old_fd)
        os.close(self.read_fd)
        os.close(self.write_fd)


def run(daemon: Daemon, duration_s: float | None = None, clock: Callable[[], float] = time.monotonic) -> None:
    """The main loop: poll on a fixed period, feed the watchdog while polls are fresh, until stopped."""
    waker = SignalWaker()
    daemon.wake = waker.wake
    try:
        start = clock()
        daemon.start(start)
        poll = daemon.config.poll_interval_s
        next_tick = start + poll
        while not daemon.stop_done:
            now = clock()
            daemon.feed_watchdog(now)
            if duration_s is not None and now - start >= duration_s and not daemon.stopping:
                log.info("ran for %g s as asked, stopping", duration_s)
                daemon.begin_stop(now)
            if now >= next_tick:
                lag = now - next_tick
                # Alerts count time on the schedule, so for_s spans whole polls: a tick that runs a
                # millisecond late must not push firing back by a whole poll interval. After a stall
                # (longer than a poll), the schedule is abandoned: the reading is stamped with the real time.
                stamp = next_tick if lag < poll else now
                daemon.tick(stamp, lag=lag)
                next_tick = stamp + poll
            waits = [next_tick - clock()]
            if daemon.fresh(clock()):  # a stale daemon sends no pings, so it must not wake up for them
                waits.append(daemon.notifier.next_watchdog_in(clock()))
            if duration_s is not None and not daemon.stopping:
                waits.append(start + duration_s - clock())
            for signum in waker.wait(min(w for w in waits if w is not None)):
                daemon.dispatch(signum)
            poll = daemon.config.poll_interval_s
    finally:
        daemon.finish()
        waker.close()
