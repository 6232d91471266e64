"""The jobs that left the Daemon class for service/ modules of their own, each on its own: the heartbeat systemd
hears (watchdog, READY=, STATUS=), the one-line refusal of a reload or a handover, the metrics port's STATUS note.
The daemon tests run them inside real daemons; these pin their lines and their edges. And the main loop's timing on
the clock the test drives (run() with a DrivenWaker), the entry points' held signals, and the log queue: the
process tests (test_daemon.py, test_faults.py) count and order what a real daemon does, and time none of it."""

import logging

import pytest

from gpuwarden import config
from gpuwarden.base.yamlfile import ConfigError, ConfigErrors
from gpuwarden.service.heartbeat import Heartbeat
from gpuwarden.service.metrics_port import MetricsPort
from gpuwarden.service.reload import handover_refused, refusal


class Notes:
    """A Notifier that writes down what systemd would hear."""

    def __init__(self):
        self.heard = []

    def watchdog(self, now):
        self.heard.append(("WATCHDOG", now))

    def ready(self, status, now):
        self.heard.append(("READY", status))

    def status(self, status, now):
        self.heard.append(("STATUS", status))


def messages(caplog, level):
    return [r.getMessage() for r in caplog.records if r.levelno == level]


def test_the_watchdog_is_fed_only_while_polls_are_fresh_and_each_change_is_said_once(caplog):
    notes = Notes()
    beat = Heartbeat(notes, lambda: 1.0)  # a poll a second: stale after max(3, 3) s
    assert beat.stale_after_s == 3.0 and not beat.fresh(0.0)
    beat.feed_watchdog(0.0)  # nothing published yet: no ping, and nothing to say
    beat.published(10.0)
    with caplog.at_level(logging.INFO, logger="gpuwarden"):
        beat.feed_watchdog(13.0)
        beat.feed_watchdog(13.5)
        beat.feed_watchdog(14.0)
        beat.published(14.0)
        beat.feed_watchdog(14.5)
    assert notes.heard == [("WATCHDOG", 13.0), ("WATCHDOG", 14.5)]
    assert messages(caplog, logging.CRITICAL) == ["no poll published for 3.5 s: not feeding the watchdog"]
    assert messages(caplog, logging.WARNING) == ["polls are published again; feeding the watchdog"]


def test_ready_is_sent_once_and_only_when_serving_is_ready():
    notes = Notes()
    beat = Heartbeat(notes, lambda: 2.0)
    beat.report("starting", 1.0, ready=False)
    beat.report("ok", 2.0, ready=True)
    beat.report("ok", 3.0, ready=True)
    assert notes.heard == [("STATUS", "starting"), ("READY", "ok"), ("STATUS", "ok"), ("STATUS", "ok")]
    assert Heartbeat(notes, lambda: 2.0).stale_after_s == 6.0


def test_a_refused_config_is_one_line_with_the_count_of_the_rest():
    first, second = ConfigError("x.yaml", 3, "poll_interval_s", "too small"), ConfigError("x.yaml", 4, "a", "b")
    assert refusal(ConfigErrors([first, second])) == "x.yaml:3: poll_interval_s: too small (and 1 more)"
    assert refusal(first) == "x.yaml:3: poll_interval_s: too small"
    assert refusal(RecursionError("deep")) == "RecursionError: deep"


@pytest.mark.parametrize("raised, said", [
    (ConfigErrors([ConfigError("x.yaml", 1, "serve", "no model")]),
     "SIGUSR2: no handover, the config on disk would not start: x.yaml:1: serve: no model; this daemon keeps running"),
    (MemoryError("gone"),
     "SIGUSR2: no handover, the config on disk cannot be checked: MemoryError: gone; this daemon keeps running"),
])
def test_a_handover_the_new_image_would_refuse_is_refused_in_one_line(caplog, raised, said):
    def check():
        raise raised

    with caplog.at_level(logging.INFO, logger="gpuwarden"):
        assert handover_refused(check)
    assert messages(caplog, logging.ERROR) == [said]
    assert not handover_refused(lambda: None)


def test_the_status_line_says_while_another_process_holds_the_metrics_port():
    cfg = config.parse_text("gpu: {backend: sim, scenario: dgx-spark}\nmetrics:\n  listen: 127.0.0.1:9400\n")
    port = MetricsPort(cfg.metrics, None, dict, Notes(), print)
    assert port.held_note() == ""
    port.held_since = 5.0
    assert port.held_note() == " · metrics not served: 127.0.0.1:9400 is held by another process"


def test_the_daemons_loop_errors_are_said_once_a_minute_each(caplog):
    from gpuwarden.backends import open_configured
    from gpuwarden.gpu.sim.backend import ManualClock
    from gpuwarden.service.daemon import ERROR_REPEAT_S, Daemon

    now = [0.0]
    cfg = config.parse_text("gpu:\n  backend: sim\n  scenario: rtx-pro-4000-headless\nmetrics:\n  listen: none\n"
                            "tuning:\n  apply: false\n")
    daemon = Daemon(cfg, open_configured(cfg, ManualClock()), reload=lambda: cfg, clock=lambda: now[0])
    with caplog.at_level(logging.INFO, logger="gpuwarden"):
        for t in (0, 1, ERROR_REPEAT_S - 0.1, ERROR_REPEAT_S, ERROR_REPEAT_S + 1):
            now[0] = t
            daemon._error_once("poll failed: OSError: {x}")  # braces: the message is not a template
        daemon._error_once("serving: ValueError: y (GPU monitoring goes on)")
    assert messages(caplog, logging.ERROR) == ["poll failed: OSError: {x}", "poll failed: OSError: {x}",
                                               "serving: ValueError: y (GPU monitoring goes on)"]


class DrivenWaker:
    """run()'s waker on the clock the test drives: a wait advances the clock by its timeout, and hands the loop
    the signals the test queued for that moment (as the signals' pipe would)."""

    def __init__(self, clock, signals=()):
        self.clock = clock
        self.signals = sorted(signals)  # [(at, signum)]

    def wait(self, timeout):
        self.clock.advance(max(0.0, timeout))
        due = [s for at, s in self.signals if at <= self.clock.now]
        self.signals = [(at, s) for at, s in self.signals if at > self.clock.now]
        return due

    def wake(self):
        pass

    def close(self, restore=True):
        pass


def test_the_loop_pings_the_watchdog_at_half_its_timeout_between_polls_and_reloads_at_the_next_poll(caplog):
    """WATCHDOG_USEC of 1 s and a poll every 5 s: the loop wakes for the watchdog every 0.5 s (half the timeout, as
    systemd advises), not at each poll; polls keep their period; a SIGHUP is carried out at the next poll. On the
    clock the test drives (test_daemon.py's watchdog test checks the pings of a real daemon by their count)."""
    import signal

    from gpuwarden.backends import open_configured
    from gpuwarden.base.systemd import Notifier
    from gpuwarden.gpu.sim.backend import ManualClock
    from gpuwarden.service.daemon import Daemon, run

    clock = ManualClock()

    class Heard(Notifier):
        def __init__(self):
            super().__init__({"NOTIFY_SOCKET": "/nonexistent/notify", "WATCHDOG_USEC": "1000000"})
            self.heard = []

        def _send(self, message):
            self.heard.append((clock.now, message))

    cfg = config.parse_text("gpu:\n  backend: sim\n  scenario: rtx-pro-4000-headless\nmetrics:\n  listen: none\n"
                            "tuning:\n  apply: false\npoll_interval_s: 5\n")
    notifier = Heard()
    daemon = Daemon(cfg, open_configured(cfg, clock), reload=lambda: cfg, notifier=notifier, clock=clock)
    polls = []
    tick = daemon.tick
    daemon.tick = lambda now, lag=0.0: (polls.append((now, lag)), tick(now, lag))
    try:
        with caplog.at_level(logging.INFO, logger="gpuwarden"):
            run(daemon, duration_s=12, clock=clock, waker=DrivenWaker(clock, [(6.0, signal.SIGHUP)]))
    finally:
        daemon.backend.close()
    pings = [t for t, m in notifier.heard if m == "WATCHDOG=1"]
    assert pings == [0.5 * i for i in range(25)]  # 0 to 12 s: each 0.5 s, none missed, none between
    assert polls == [(0.0, 0.0), (5.0, 0.0), (10.0, 0.0)]  # on schedule, no lag on the driven clock
    reloads = [r for r in caplog.records if r.getMessage().startswith("config reloaded")]
    assert len(reloads) == 1 and daemon.monitor.snapshot.sequence == 3  # the SIGHUP at 6 s, carried out at 10 s
    assert notifier.heard[-1] == (12.0, "STOPPING=1")


def _before_hold(path):
    """The statements an entry point runs before earlysignals.hold(): module level, then the body of main()."""
    import ast

    before = []
    for node in ast.parse(path.read_text()).body:
        body = node.body if isinstance(node, ast.FunctionDef) and node.name == "main" else [node]
        for stmt in body:
            if "earlysignals.hold()" in ast.unparse(stmt):
                return before
            before.append(stmt)
    raise AssertionError(f"{path} never calls earlysignals.hold()")


@pytest.mark.parametrize("entry", ["entry.py", "__main__.py"])
def test_each_entry_point_holds_the_signals_before_any_slow_import(entry):
    """The console script (gpuwarden.entry) and `python -m gpuwarden` hold SIGHUP, SIGTERM, SIGINT and SIGUSR2
    before they import anything but the standard library and earlysignals, and the packages on the way there
    import nothing: the seconds of imports, config and NVML a busy host takes come after (earlysignals.py)."""
    import ast
    from pathlib import Path

    import gpuwarden

    package = Path(gpuwarden.__file__).parent
    before = _before_hold(package / entry)
    imports = [(n.module if isinstance(n, ast.ImportFrom) else None, [a.name for a in n.names]) for n in before
               if isinstance(n, (ast.Import, ast.ImportFrom))]
    assert all(module in (None, "base") and names in (["sys"], ["earlysignals"]) for module, names in imports), \
        imports
    assert all(isinstance(n, (ast.Import, ast.ImportFrom, ast.Expr, ast.FunctionDef)) for n in before), before
    for init in (package / "__init__.py", package / "base" / "__init__.py"):
        tree = ast.parse(init.read_text())
        assert not [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))], init
    source = ast.parse((package / "base" / "earlysignals.py").read_text())
    assert {a.name for n in ast.walk(source) if isinstance(n, ast.Import) for a in n.names} == {"signal"}


def test_a_sighup_held_during_start_up_is_the_loops_first_signal_and_asks_for_a_reload():
    """A SIGHUP that comes after hold() and before the loop (imports, config, NVML) ends nothing: it is written
    down, and the loop's waker hands it over first, so the loop carries it out as a reload (handle_hup)."""
    import signal

    from gpuwarden.backends import open_configured
    from gpuwarden.base import earlysignals
    from gpuwarden.service.daemon import Daemon, SignalWaker

    earlysignals.hold()
    try:
        assert signal.getsignal(signal.SIGHUP) is earlysignals._note  # or the SIGHUP below would end pytest
        signal.raise_signal(signal.SIGHUP)  # in the start-up
        waker = SignalWaker()  # the loop begins
        try:
            assert waker.wait(0) == [signal.SIGHUP]
        finally:
            waker.close()
    finally:
        earlysignals.release()
    cfg = config.parse_text("gpu:\n  backend: sim\n  scenario: dgx-spark\nmetrics:\n  listen: none\n"
                            "tuning:\n  apply: false\n")
    daemon = Daemon(cfg, open_configured(cfg), reload=lambda: cfg)
    try:
        daemon.dispatch(signal.SIGHUP)
    finally:
        daemon.backend.close()
    assert daemon.changes.reload_asked and not daemon.stopping


def test_a_log_sink_nobody_reads_never_blocks_the_loop_that_logs():
    """The daemon logs through a bounded queue to a writer thread (base/systemd.py's QueuedLog): with stderr a
    pipe nobody reads, the writer blocks once the pipe is full, and the loop's own log calls still return at
    once, dropping and counting what does not fit. tests/test_faults.py runs a daemon whose stderr nobody reads."""
    import os
    import threading

    from gpuwarden.base.systemd import JournalFormatter, QueuedLog

    read, write = os.pipe()
    handler = QueuedLog(JournalFormatter("%(message)s"), fd=write, capacity=100)
    logger = logging.getLogger("test_service_parts.sink")
    logger.addHandler(handler)
    logger.propagate = False
    line = "x" * 1000
    logged = threading.Thread(target=lambda: [logger.warning("%d %s", i, line) for i in range(2000)], daemon=True)
    try:
        logged.start()
        logged.join(60)  # 2 MB of lines into a 64 KiB pipe: the writer is stuck, the caller is not
        assert not logged.is_alive(), "a log call waited for the sink"
        assert handler.dropped >= 2000 - 100 - 100  # the queue's 100, and the pipe's share, at most
        assert not handler.drain(0.1)  # the sink is stuck indeed
    finally:
        logger.removeHandler(handler)
        os.close(read)  # the writer's write fails now (EPIPE: nobody reads), and it ends
        handler.close(5)
        os.close(write)
