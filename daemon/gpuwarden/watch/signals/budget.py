"""The power budget (tuning.power_budget_w, tune/budget.py): the budget, each card's share of it and the limits the
budget set. The drawn watts are power's rows (gpuwarden_gpu_power_watts). Shown only where a budget is configured.
Its fault at run time, the GPUs' minimum limits above the budget (a GPU added since the config was checked), is the
host-wide rule power_budget_short (HOST_RULES: evaluated once a poll on the budget's view, after its move); the
split stays where it was meanwhile."""

from __future__ import annotations

from ..alerts import INACTIVE, WARNING, Check, Rule
from ..rows import COUNTER, Row

RULES = ()  # per GPU: none


def power_budget_short(view, _samples=()) -> Check:
    """The GPUs' minimum power limits come to more than tuning.power_budget_w (checked at start and at every
    reload, so at run time a GPU was added or a card's range changed): the budget cannot be kept, and its split
    stays as it was."""
    if view is None or not view.get("short"):
        return INACTIVE
    return Check(True, f"power budget: {view['short']}", f"the GPUs' minimum limits must fit {view['budget_w']:g} W",
                 "budget short")


HOST_RULES = (
    Rule("power_budget_short", WARNING, "raise tuning.power_budget_w to at least the sum this line names (every GPU "
         "counts at its minimum limit; a weight in tuning.power_shares does not leave one out), then `systemctl "
         "reload gpuwarden`; or take the added GPU out of the host", power_budget_short, for_s=0.0),
)


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
