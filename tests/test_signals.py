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
    rules = [r.name for r in signals.RULES + signals.SERVING_RULES]
    assert len(rules) == len(set(rules)) == len(signals.RULES_BY_NAME)
    rows = [r.name for r in signals.GPU_ROWS + signals.SERVING_ROWS + alerts.ROWS]
    assert len(rows) == len(set(rows))
    assert all(name.startswith("gpuwarden_") for name in rows)
    assert set(signals.REAPPLY_ON) <= set(rules)
