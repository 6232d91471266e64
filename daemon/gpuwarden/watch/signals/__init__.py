"""The GPU signals, one file each: what a reading means, its alert rules, its metric rows and its window.

SIGNALS is the order the rules are evaluated and logged in within one poll, and the order of their rows on
/metrics. A new signal is a module here with RULES and ROWS, named in SIGNALS.
"""

from __future__ import annotations

from ..alerts import Rule
from ..rows import Row
from . import clocks, device, fabric, memory, nvlink, pcie, power, serving, slowdown, thermal, xid

SIGNALS = (clocks, power, slowdown, thermal, device, xid, pcie, nvlink, fabric, memory)

RULES: tuple[Rule, ...] = tuple(rule for signal in SIGNALS for rule in signal.RULES)
SERVING_RULES: tuple[Rule, ...] = serving.RULES  # host-wide: evaluated on the supervisor's view
RULES_BY_NAME = {rule.name: rule for rule in RULES + SERVING_RULES}
# Rules that the daemon answers by re-applying the tuning.
REAPPLY_ON = ("clock_lock_lost", "persistence_off")

GPU_ROWS: tuple[Row, ...] = tuple(row for signal in SIGNALS for row in signal.ROWS)
SERVING_ROWS: tuple[Row, ...] = serving.ROWS
