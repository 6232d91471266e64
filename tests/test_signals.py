"""The signals package's contract: every signal file is named in SIGNALS (a file left out would watch nothing),
each declares RULES and ROWS, and no rule or metric name is used twice."""

import pkgutil

from gpuwarden.watch import alerts, signals


def test_every_signal_file_is_registered_and_declares_rules_and_rows():
    files = {m.name for m in pkgutil.iter_modules(signals.__path__)}
    registered = {s.__name__.rsplit(".", 1)[-1] for s in signals.SIGNALS}
    assert files - {"serving"} == registered  # serving's rules are host-wide: SERVING_RULES, SERVING_ROWS
    for signal in (*signals.SIGNALS, signals.serving):
        assert isinstance(signal.RULES, tuple) and isinstance(signal.ROWS, tuple) and signal.__doc__


def test_no_rule_or_metric_name_is_used_twice():
    rules = [r.name for r in signals.RULES + signals.SERVING_RULES + signals.BUDGET_RULES]
    assert len(rules) == len(set(rules)) == len(signals.RULES_BY_NAME)
    rows = [r.name for r in signals.GPU_ROWS + signals.SERVING_ROWS + alerts.ROWS]
    assert len(rows) == len(set(rows))
    assert all(name.startswith("gpuwarden_") for name in rows)
    assert {r.name for r in signals.RULES if r.reapply} == {"clock_lock_lost", "persistence_off"}


def test_a_new_signal_with_a_window_is_one_module_and_its_rule_fires_and_its_row_renders(caplog):
    # tests/harness/toy_signal.py: RULES, ROWS and a WINDOW, handed to the monitor beside the real signals (in the
    # daemon: named in SIGNALS); nothing in alerts.py, monitor.py or web/exposition.py knows it.
    import logging

    from harness import toy_signal
    from prometheus_client import generate_latest

    from gpuwarden import config
    from gpuwarden.backends import open_configured
    from gpuwarden.gpu.sim.backend import ManualClock
    from gpuwarden.tune.tuning import Tuner, TuningLife
    from gpuwarden.watch.alerts import FIRING
    from gpuwarden.watch.monitor import Monitor
    from gpuwarden.web.exposition import make_registry

    def played(*more):
        cfg = config.parse_text("gpu:\n  backend: sim\n  scenario: h100-nvswitch\nmetrics:\n  listen: none\n"
                                "poll_interval_s: 1\ncounters_interval_s: 1\n")  # a window of 10 s
        clock = ManualClock()
        backend = open_configured(cfg, clock)
        monitor = Monitor(cfg, backend, TuningLife(backend, cfg, Tuner(backend)), signals=(*signals.SIGNALS, *more))
        seen = {}
        while clock.now <= 30:  # the scenario's load: 0% until 10 s, then 95%
            snapshot = monitor.tick(clock.now)
            seen[clock.now] = snapshot.gpus[0].windows.get(toy_signal.AverageUtilization)
            clock.advance(1)
        return monitor, seen, generate_latest(make_registry(lambda: snapshot)).decode()

    with caplog.at_level(logging.INFO, logger="gpuwarden"):
        monitor, seen, text = played(toy_signal)
    assert seen[5.0] == 0.0 and 0 < seen[15.0] < 95 and seen[30.0] == 95.0  # the window's reading, poll by poll
    assert monitor.states[("toy_busy", 0)].phase == FIRING
    assert any("toy_busy firing: utilization " in r.getMessage() for r in caplog.records)
    assert "# TYPE gpuwarden_toy_utilization_average_ratio gauge" in text
    assert 'gpuwarden_toy_utilization_average_ratio{gpu="0"} 0.95' in text
    assert 'gpuwarden_alert_active{alert="toy_busy",gpu="0",severity="info"} 1.0' in text
    _, _, plain = played()  # the daemon's own signals: no toy
    assert "toy" not in plain and plain.count("gpuwarden_alert_active{") < text.count("gpuwarden_alert_active{")


def test_a_rule_asked_outside_a_poll_reads_its_windows_empty_reading():
    from gpuwarden import config
    from gpuwarden.gpu.base import GpuSample
    from gpuwarden.watch.alerts import GpuContext

    kinds = signals.windows_of(signals.SIGNALS)
    assert {k.__name__ for k in kinds} == {"DutyCycles", "RecentEvents", "LinkErrors"}
    sample = GpuSample(0, "GPU-a", "card", "0000:01:00.0", "9.0", sm_clock_mhz=1980, max_sm_clock_mhz=1980)
    ctx = GpuContext(True, None, None, False, config.AlertSettings())  # no window read
    assert not [rule.name for rule in signals.RULES if rule.check(sample, ctx).active]
