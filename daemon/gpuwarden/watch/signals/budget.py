"""The power budget (tuning.power_budget_w, tune/budget.py): the budget, each card's share of it and the limits the
budget set. The drawn watts are power's rows (gpuwarden_gpu_power_watts). Shown only where a budget is configured.
Its fault at run time (the cards' minimums above the budget, as when a GPU is added) is logged as an error and
shown by gpuwarden_power_budget_short; the split stays where it was."""

from __future__ import annotations

from ..rows import COUNTER, Row

RULES = ()


def _budgeted(snap) -> bool:
    return snap.budget is not None


def _allocations(snap):
    return (((str(i),), w) for i, w in sorted(snap.budget["alloc"].items()))


ROWS = (
    Row("gpuwarden_power_budget_watts", "The most the GPUs together may draw (tuning.power_budget_w)", (),
        lambda snap: (((), snap.budget["budget_w"]),), shown=_budgeted),
    Row("gpuwarden_gpu_power_allocation_watts", "The power limit the budget gives this GPU now", ("gpu",),
        _allocations, shown=_budgeted),
    Row("gpuwarden_power_budget_moves", "Power limits the budget set to follow the demand", (),
        lambda snap: (((), snap.budget["moves"]),), kind=COUNTER, shown=_budgeted),
    Row("gpuwarden_power_budget_static", "1 while the budget holds a static split (a GPU lost, or a limit that did "
        "not read back)", (), lambda snap: (((), int(snap.budget["fallback"] is not None)),), shown=_budgeted),
    Row("gpuwarden_power_budget_short", "1 while the GPUs' minimum limits pass the budget: raise "
        "tuning.power_budget_w", (), lambda snap: (((), int(snap.budget["short"] is not None)),), shown=_budgeted),
)
