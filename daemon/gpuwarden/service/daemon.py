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

import logging
import math
import os
import select
import signal
import sys
import time
from collections.abc import Callable

from .. import __version__
from ..base import earlysignals, webconfig
from ..base.faultlog import FaultLog
from ..config import Config
from . import adoption, metrics_port, proxy_port
from .adoption import HANDOVER_ENV
from .control import ControlServer, open_control
from .event_thread import start_event_thread
from .heartbeat import Heartbeat
from .changes import Changes
from .metrics_port import MetricsPort
from .proxy_port import ProxyPort
from .recovery import Recovery
from ..tune.sweeps import Sweeps
from ..web.exposition import Exposition
from ..watch.eventwatch import EventWatcher
from ..watch.health import waiting
from ..watch.health_record import NAME as HEALTH_RECORD, HealthRecord, clear_handler, record_reboots
from ..gpu.base import GpuBackend
from ..watch.monitor import Monitor, describe_sample
from ..tune.idleclocks import IdleClocks
from ..tune.originals import originals_store
from ..proxy.child import PROXY_KIND
from ..serving.run.processes import ProcessOps
from ..serving.run import handover
from ..serving.run.runtime import ServingRuntime
from ..base.statedir import state_dir
from ..base.systemd import Notifier, flush_logs
from ..tune.tuning import Tuner, TuningLife

log = logging.getLogger("gpuwarden")

HANDLED_SIGNALS = earlysignals.SIGNALS
EVENTS_WAKE = 0  # the byte the GPU event thread writes to the wake-up pipe: no signal has number 0
ERROR_REPEAT_S = 60.0  # the same serving or poll error is logged at most this often
STOP_MARGIN_S = 30.0  # beyond the child's drain, for SIGKILL and restoring the tuning
# The side children the daemon runs beside the engine (serving/run/kinds.py): a reload that changes only one
# kind's spec restarts that child alone.
SIDE_KINDS = (PROXY_KIND,)


def reexec() -> None:
    """Become the installed gpuwarden, same pid and same command line (a handover: handle_usr2)."""
    os.environ[HANDOVER_ENV] = "1"
    flush_logs(2.0)
    earlysignals.block_for_exec()  # (again: reexec() is also called on its own)
    metrics_port.let_inherit()  # the port stays ours across the exec: Daemon.finish kept it open
    proxy_port.let_inherit()  # the proxy's too: Daemon.finish kept it open
    webconfig.let_inherit()  # the scrapers let in stay let in: Daemon.finish handed them over
    os.execv(sys.executable, [sys.executable, *sys.orig_argv[1:]])


class Daemon:
    """The daemon's one object: it builds the parts (the tuning's life, the monitor, the serving runtime, recovery,
    the metrics and proxy ports, the reload and handover), starts them in order, runs one poll (tick) through each
    with its faults kept in its own room, and stops them. It owns the running config and the stop; it never blocks
    the loop (a child is read off it, a stop is a timed state) and never works inside a signal handler."""

    def __init__(self, config: Config, backend: GpuBackend, reload: Callable[[], Config] | None = None,
                 notifier: Notifier | None = None, ops: ProcessOps | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.config = config
        self.backend = backend
        self.reload_config = reload
        self.notifier = notifier or Notifier()
        self.clock = clock
        self.tuning = TuningLife(backend, config, Tuner(backend, originals_store(config, backend)))
        self.sweeps = Sweeps(self.tuning, clock)  # `gpuwarden tune`'s leases (tune/sweeps.py)
        self.control: ControlServer | None = None
        self.health_record = HealthRecord.load(state_dir() / HEALTH_RECORD)  # reboots per GPU and fault, kept
        self.clear_health = clear_handler(self.health_record, lambda: {g.index: g.uuid for g in backend.gpus()})
        # a reboot for the same fault on the same GPU past health.reboots_before_inspect: "inspect the hardware"
        self.monitor = Monitor(config, backend, self.tuning, reboots=self.health_record.count)
        self.exposition = Exposition(lambda: self.monitor.snapshot, clock)
        self.metrics = MetricsPort(config.metrics, self.exposition, self.status_document, self.notifier,
                                   self._error_once)
        self.proxy_port = ProxyPort(self.notifier)  # the proxy's listener, kept across its restarts
        # The children and what watches them; the proxy is a side child the runtime asks for by config. Under
        # the unit (StateDirectory=) the running children are recorded, so that the daemon after this one
        # takes them over (serving/run/handover.py); a daemon run by hand adopts nothing.
        records = state_dir() if os.environ.get("STATE_DIRECTORY") else None
        self.serving = ServingRuntime(backend, sides=SIDE_KINDS, ops=ops, clock=clock, state_dir=records,
                                      keep_fd=self.notifier.keep_fd, clocks=IdleClocks(self.sweeps))
        self.recovery = Recovery(self.serving, self.tuning, backend, clock, config.health)  # health:'s own steps
        self.watcher: EventWatcher | None = None  # Xid and fatal events, on their own thread
        self.wake: Callable[[], None] | None = None  # run() sets it: wakes the loop as a signal does
        self.heartbeat = Heartbeat(self.notifier, lambda: self.config.poll_interval_s)
        self.changes = Changes(self)  # a reload (SIGHUP) and a handover (SIGUSR2), each checked whole first
        self.adopting = False  # start() found children to take over (a handover, or an engine a crash left)
        self.stopping = False
        self.started_at = time.time()
        # Each error message at most once every ERROR_REPEAT_S (its repeats dropped unsaid):
        self._errors = FaultLog(log, period_s=ERROR_REPEAT_S, clock=clock, level=logging.ERROR)

    # -- life cycle -------------------------------------------------------------
    def start(self, now: float) -> None:
        """Take the metrics port and check the plan and the serving command first (what can fail), then tune, start the
        engine, take the first sample, and tell systemd we are ready. Raises ConfigErrors for values a card or
        the engine rejects, StartupError if metrics.listen cannot be bound (a port another process holds is no
        such error: the daemon runs without metrics and the tick takes the port once it is free); neither
        leaves a GPU setting changed."""
        # First, before anything can fail: a start that fails with children to adopt leaves them serving
        # (leave_children). After a handover, or a crash of the daemon that left the engine serving, the engine
        # runs already, its flags checked when it started: only lint here, so the daemon watches it again within
        # seconds, not after the engine's import (a minute and more on a busy host, the engine unwatched).
        self.adopting = HANDOVER_ENV in os.environ or \
            adoption.engine_survives(self.serving, self.config.serve.engine)
        # a sweep cut by this daemon's predecessor's death (or its handover: a lease is its connection's, and
        # the connection did not carry over): its setting back first
        self.sweeps.recover(handover=HANDOVER_ENV in os.environ)
        webconfig.take_over(self.config.metrics.web)  # the scrapers the image before this one let in, if any
        # The sockets and pipes passed on before the check, which may start the engine's interpreter: taken (the
        # listener close-on-exec, the variables out of the environment) before anything is started from here.
        # A check that raises after this leaves them to finish() (run), which closes the listener.
        stored = handover.stored_fds()  # once: it takes LISTEN_FDS out of the environment
        self.metrics.open(stored.get("metrics"), now)
        self.proxy_port.open(stored.get("proxy"), self.config)
        # Adopting, the installed versions and model facts come from the cache, as the handover's check (on the old
        # image's loop) read them: one verdict for both, or a pip install under the running engine made the new
        # image refuse what the old one let through (exit 78). The running engine is not what they describe.
        plan, launch = self.check(self.config, deep=not self.adopting, on_loop=self.adopting)
        adoption.check_replacement(self.serving, launch, self.adopting)  # the engine's parser, where it is replaced
        for note in plan.notes:
            log.info("%s", note)
        log.info("before tuning: %s", " | ".join(describe_sample(g.sample()) for g in self.backend.gpus()))
        self.tuning.start(plan)
        self.control = open_control(self.wake, self.config.tuning.apply)
        self.watcher = start_event_thread(self.backend, self.wake)
        self.metrics.serve(now)
        adoption.start_serving(self.serving, launch, now, stored, self.config.serve.stop_timeout_s)
        self.tick(now)

    def check(self, config: Config, deep: bool, on_loop: bool = False):
        """Everything that makes a start refuse a config, nothing changed yet: (the tuning plan, the serving
        launch or None), from the tuning check and, when serving, the lint at error level and the flag facts
        (deep: the engine's own parser too). Raises InvalidConfig. A handover runs it first on the config on
        disk as the new image's start will (adopting: not deep), so that a config the new image would refuse
        is no handover, and an adopting start runs it as that check did (on_loop). on_loop: from the cache only
        (the main loop must not wait on the engine's interpreter), the model's files not read."""
        plan = self.tuning.check(config)
        launch = self.serving.prepare(config, deep=deep, on_loop=on_loop) if config.serve.enabled else None
        return plan, launch

    def leave_children(self) -> None:
        """start() failed with children to adopt: they serve on, unsupervised, for the next daemon to adopt."""
        adoption.leave_children(self.serving, self.adopting)

    @property
    def server(self):
        """The metrics server, while it serves."""
        return self.metrics.server

    def handle_gpu_events(self) -> None:
        """What woke the loop: `gpuwarden tune`'s requests on the control socket (answered here, on the loop
        that owns the GPUs), and events the watcher queued: log and count them now; a GPU that needs a reset
        or a reboot stops the serving engine on it (no restart loop on a broken GPU)."""
        if self.control is not None:
            self.control.serve(self.sweeps, self.clear_health)
        if self.watcher is None:
            return
        if self.watcher.failure is not None:
            self._error_once(f"GPU events stopped: {self.watcher.failure}")
        now = self.clock()
        holds = self.monitor.record_events(self.watcher.take(), now)
        if not self.stopping:
            # New events, and any GPU that waits for its action (an event's, or judged unhealthy): no engine on it.
            held = waiting(self.monitor.events.needs_reset, self.monitor.verdicts)
            self.recovery.hold(now, holds + list(held.items()))

    def tick(self, now: float, lag: float = 0.0) -> None:
        """One poll: a reload if one was asked for, advance serving (its faults stay there), then sample and
        publish the GPUs."""
        try:
            self.changes.tick()
        except Exception as exc:  # reload() keeps what runs on a bad config; this is a bug's last net
            self._error_once(f"reload: {type(exc).__name__}: {exc}")
        try:
            self.sweeps.tick()  # a sweep whose lease ran out: its setting back
        except Exception as exc:
            self._error_once(f"sweep: {type(exc).__name__}: {exc}")
        try:
            self.handle_gpu_events()  # any the wake-up missed
        except Exception as exc:
            self._error_once(f"GPU events: {type(exc).__name__}: {exc}")
        try:
            self.metrics.retry(now)
        except Exception as exc:
            self._error_once(f"metrics: {type(exc).__name__}: {exc}")
        serving, stats = self._serving_tick(now)
        try:
            snapshot = self.monitor.tick(now, lag, serving=serving, stats=stats, published_at=self.clock())
        except Exception as exc:  # one bad poll must not end the daemon; the next one may work
            self._error_once(f"poll failed: {type(exc).__name__}: {exc}")
            return
        try:  # joules per request: the engine's GPUs' energy for the proxy (serving/run/energyfeed.py)
            self.serving.feed_energy({v.sample.index: v.sample.power_w for v in snapshot.gpus})
        except Exception as exc:
            self._error_once(f"energy for the proxy: {type(exc).__name__}: {exc}")
        try:  # a GPU back: the engine held for it starts again; a reset the policy allows; the known answer
            self.recovery.tick(now, waiting(self.monitor.events.needs_reset, self.monitor.verdicts), self.stopping)
        except Exception as exc:
            self._error_once(f"recovery: {type(exc).__name__}: {exc}")
        try:  # its own room: a recovery fault must not leave a reboot uncounted
            record_reboots(self.health_record, self.monitor.verdicts.values(), time.time())
        except Exception as exc:
            self._error_once(f"health record: {type(exc).__name__}: {exc}")
        self.heartbeat.published(snapshot.published_at)
        if self.metrics.renders:
            self.exposition.published()
        status = snapshot.summary_line(numbers=False)  # the state, not this poll's readings
        status += self.metrics.held_note()  # while another process holds the port
        self.heartbeat.report(status, now, ready=self.serving.ready)

    def _serving_tick(self, now: float):
        """Advance the children and read the engine's metrics. Never raises: a serving fault is logged and
        the GPUs are still polled."""
        try:
            views, stats = self.serving.tick(now)
        except Exception as exc:
            self._error_once(f"serving: {type(exc).__name__}: {exc} (GPU monitoring goes on)")
            try:
                views, stats = self.serving.views(), None
            except Exception:
                views, stats = None, None
        # Running requests make a GPU busy even between kernels.
        running = stats.requests_running if stats else None
        self.monitor.report_running_requests(int(running) if running else None)
        return views, stats

    def _error_once(self, message: str) -> None:
        """Log an error, but the same one at most every ERROR_REPEAT_S."""
        self._errors.note(message, message)

    # -- stopping ------------------------------------------------------------------------
    def begin_stop(self, now: float) -> None:
        """Start stopping: the child drains (a timed state) while the loop keeps polling."""
        if self.stopping:
            return
        self.stopping = True
        self.changes.waiting.drop()
        self.notifier.stopping()
        running = not self.serving.stopped
        wait = self.serving.stop(now)  # the longest wait for SIGKILL: the engine's drain and its margin included
        if running:
            # systemd's TimeoutStopSec covers the default drain; a longer one asks for more time.
            self.notifier.extend_timeout(max(wait or 0.0, self.config.serve.stop_timeout_s) + STOP_MARGIN_S)

    @property
    def stop_done(self) -> bool:
        return self.stopping and self.serving.stopped

    def finish(self) -> None:
        """The last step of every exit, also after an error: stop the event thread, restore the tuning if
        asked (not on a handover: the new image keeps it), close the port (a handover passes it on instead)."""
        if self.watcher is not None:
            if not self.watcher.stop():
                log.warning("the GPU event thread did not end within 2 s")
            self.watcher = None
        if self.control is not None:
            self.control.stop()
            self.control = None
        handing_over = self.changes.handing_over
        if self.sweeps.lease is not None and not handing_over:
            self.sweeps.end("the daemon stops")  # before the restore below, which may put back less
        if not handing_over:
            self.tuning.restore()
        self.metrics.close(handing_over, self.stopping)
        self.proxy_port.close(handing_over)
        self.exposition.close()

    def status_document(self) -> dict:
        """What `gpuwarden status` shows: the daemon, plus the latest snapshot (finite numbers only)."""
        snapshot = self.monitor.snapshot
        age = None if snapshot is None else max(0.0, self.clock() - snapshot.published_at)
        return _finite({"daemon": {"version": __version__, "pid": os.getpid(), "started_at": self.started_at,
                                   "config_files": list(self.config.files),
                                   "poll_interval_s": self.config.poll_interval_s,
                                   "snapshot_age_seconds": age,
                                   "stale": age is not None and age > self.heartbeat.stale_after_s},
                        **(snapshot.as_dict() if snapshot else {})})

    # -- signal dispatch (by name, as in gunicorn) -----------------------------------
    def dispatch(self, signum: int) -> None:
        if signum == EVENTS_WAKE:
            self.handle_gpu_events()
            return
        name = "handle_" + signal.Signals(signum).name[3:].lower()
        (getattr(self.changes, name, None) or getattr(self, name))()  # SIGHUP and SIGUSR2: a change, checked first

    def handle_term(self) -> None:
        now = self.clock()
        if self.stopping:
            log.warning("SIGTERM again while stopping: not waiting for the children's drain")
            self.serving.kill_now(now)
            return
        log.info("SIGTERM received, stopping")
        self.begin_stop(now)

    def handle_int(self) -> None:
        now = self.clock()
        if self.stopping and not self.serving.stopped:
            self.serving.kill_now(now)
            return
        log.info("SIGINT received, stopping")
        self.begin_stop(now)

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
        # Those that came before this loop existed (earlysignals.py), first and in order; but a SIGUSR2 that
        # waited across a handover's exec asked for the code this image runs: one handover, said once.
        again = HANDOVER_ENV in os.environ and earlysignals.sent_before_exec(signal.SIGUSR2)
        for signum in earlysignals.take():
            if again and signum == signal.SIGUSR2:
                again = False
                log.info("SIGUSR2 again during the handover: already handed over to the installed gpuwarden")
                continue
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

    def close(self, restore: bool = True) -> None:
        """restore False (a handover): the handlers stay, doing nothing, until execv. The default they would get
        back ends the process on SIGHUP, and the other threads still running would take such a signal."""
        for sig, old in (self._old.items() if restore else ()):
            signal.signal(sig, old)
        signal.set_wakeup_fd(self._old_fd)
        os.close(self.read_fd)
        os.close(self.write_fd)


def run(daemon: Daemon, duration_s: float | None = None, clock: Callable[[], float] = time.monotonic,
        waker: SignalWaker | None = None) -> None:
    """The main loop: poll on a fixed period, feed the watchdog while polls are fresh, until stopped. waker: what
    the loop waits on between steps (a test's, on the clock it drives); by default the signals' pipe."""
    waker = waker or SignalWaker()
    daemon.wake = waker.wake
    try:
        start = clock()
        try:
            daemon.start(start)
        except BaseException:
            daemon.leave_children()  # (after a handover, or a crash: the engine serves on for the next daemon)
            raise
        poll = daemon.config.poll_interval_s
        next_tick = start + poll
        while not daemon.stop_done and not daemon.changes.handing_over:
            now = clock()
            daemon.heartbeat.feed_watchdog(now)
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
                try:  # a SIGUSR2 that waited for the engine's parser (or a restart under way), now settled
                    if daemon.changes.waiting.handover_ready():
                        daemon.changes.hand_over()
                        continue  # the loop ends, as after handle_usr2
                except Exception as exc:  # a bug's last net: no handover, the daemon runs on
                    daemon._error_once(f"SIGUSR2: {type(exc).__name__}: {exc}")
            waits = [next_tick - clock()]
            if daemon.heartbeat.fresh(clock()):  # a stale daemon sends no pings, so it must not wake up for them
                waits.append(daemon.notifier.next_watchdog_in(clock()))
            if duration_s is not None and not daemon.stopping:
                waits.append(start + duration_s - clock())
            for signum in waker.wait(min(w for w in waits if w is not None)):
                daemon.dispatch(signum)
            poll = daemon.config.poll_interval_s
    finally:
        daemon.finish()
        waker.close(restore=not daemon.changes.handing_over)
