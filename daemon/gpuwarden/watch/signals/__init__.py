"""The GPU signals, one file each: what a reading means, its alert rules, its metric rows and its window.

SIGNALS is the order the rules are evaluated and logged in within one poll, and the order of their rows on
/metrics. A new signal is a module here with RULES and ROWS, named in SIGNALS; a signal whose rules need earlier
polls also declares WINDOW, the class of its memory of them (alerts.Window): the monitor keeps one and reads it
for each GPU on each poll, its rules find the reading in ctx.window(WINDOW), its rows in view.windows.
"""

from __future__ import annotations

from collections.abc import Iterable
from types import ModuleType

from ..alerts import Rule, Window
from ..rows import Row
from . import (activity, budget, clocks, device, fabric, health, memory, nvlink, pcie, power, serving, slowdown,
               thermal, xid)

# health last: its verdict reads what the others read (the monitor judges it before any rule runs)
SIGNALS = (clocks, power, budget, slowdown, thermal, device, activity, xid, pcie, nvlink, fabric, memory, health)


def rules_of(signals: Iterable[ModuleType]) -> tuple[Rule, ...]:
    return tuple(rule for signal in signals for rule in signal.RULES)


def rows_of(signals: Iterable[ModuleType]) -> tuple[Row, ...]:
    return tuple(row for signal in signals for row in signal.ROWS)


def windows_of(signals: Iterable[ModuleType]) -> tuple[type[Window], ...]:
    """The window classes of the signals that keep one."""
    return tuple(signal.WINDOW for signal in signals if hasattr(signal, "WINDOW"))


RULES: tuple[Rule, ...] = rules_of(SIGNALS)
SERVING_RULES: tuple[Rule, ...] = serving.RULES  # host-wide: evaluated on the supervisor's view
BUDGET_RULES: tuple[Rule, ...] = budget.HOST_RULES  # host-wide: evaluated on the power budget's view
RULES_BY_NAME = {rule.name: rule for rule in RULES + SERVING_RULES + BUDGET_RULES}

GPU_ROWS: tuple[Row, ...] = rows_of(SIGNALS)
SERVING_ROWS: tuple[Row, ...] = serving.ROWS
