"""The jobs that left the Daemon class for service/ modules of their own, each on its own: the heartbeat systemd
hears (watchdog, READY=, STATUS=), the one-line refusal of a reload or a handover, the metrics port's STATUS note.
The daemon tests run them inside real daemons; these pin their lines and their edges."""

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
