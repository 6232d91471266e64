"""Power: the draw, the limits (enforced, the card's maximum, the one gpuwarden chose) and the energy counter.
Rules: the clocks held down by the power limit while busy (power_capped), or by the card's design power
(at_design_power, a notice; alerts.warn_at_design_power makes it power_capped too)."""

from __future__ import annotations

from ...gpu import throttle
from ...gpu.base import ClockEventReason as R
from ...gpu.base import GpuSample
from ...gpu.throttle import headroom_w, reasons
from ...tune.tunables import power_limit_is
from ..alerts import INACTIVE, INFO, WARNING, Check, GpuContext, Rule
from ..rows import COUNTER, gpu_row
from .clocks import clock_loss


def _power_check(s: GpuSample, ctx: GpuContext, at_max: bool) -> Check:
    """SwPowerCap while busy, at the maximum limit (at_max) or below it."""
    if not ctx.busy or R.SwPowerCap not in reasons(s):
        return INACTIVE
    headroom = headroom_w(s)
    is_max = throttle.at_max_power_limit(s)
    warn_anyway = ctx.settings.warn_at_design_power
    if not ((is_max and not warn_anyway) if at_max else (not is_max or warn_anyway)):
        return INACTIVE
    observed, short, loss = clock_loss(s, ctx)
    draw = f"{s.power_w:.0f} W" if s.power_w is not None else "? W"
    limit = f"{s.power_limit_w:.0f} W" if s.power_limit_w is not None else "the limit"
    if is_max:
        return Check(True, f"{observed}; drawing {draw}", f"at its maximum power limit {limit} (SwPowerCap)", short,
                     "nothing to change: this is the card's design power, and no higher limit is allowed", loss)
    chosen = ctx.power_limit_chosen
    if chosen is not None and power_limit_is(s.power_limit_w, chosen[0]):
        # A choice, not a fault: still said (one line names the cause of the clock loss), never undone.
        return Check(True, f"{observed}; drawing {draw}", f"at the power limit {chosen[1]}, {limit} (SwPowerCap)",
                     short, "nothing to fix: the limit was chosen, and the clock loss shown is its price", loss)
    fix = (f"raise tuning.power_limit_w by up to {headroom:g} W, to {s.power_limit_max_w:g} W (the card's maximum), "
           "or accept the clock loss") if headroom is not None else ""
    return Check(True, f"{observed}; drawing {draw}", f"at power limit {limit} (SwPowerCap)", short, fix, loss)


def power_capped(s: GpuSample, ctx: GpuContext) -> Check:
    return _power_check(s, ctx, at_max=False)


def at_design_power(s: GpuSample, ctx: GpuContext) -> Check:
    return _power_check(s, ctx, at_max=True)


# swept: a tune sweep's power limit trips these (alerts.Rule.swept)
RULES = (
    Rule("power_capped", WARNING, "the card is at its power limit; raise tuning.power_limit_w within the "
         "constraints (`gpuwarden plan` shows them), or accept the clock loss", power_capped, swept=True),
    Rule("at_design_power", INFO, "nothing to change: this is the card's design power", at_design_power,
         swept=True),
)

ROWS = (
    gpu_row("gpuwarden_gpu_power_watts", "Current power draw", "sample.power_w"),
    gpu_row("gpuwarden_gpu_power_limit_watts", "Enforced power limit", "sample.power_limit_w"),
    gpu_row("gpuwarden_gpu_power_limit_max_watts", "Highest power limit the GPU accepts", "sample.power_limit_max_w"),
    gpu_row("gpuwarden_gpu_power_limit_chosen_watts", "Power limit gpuwarden sets on purpose: tuning.power_limit_w, "
            "or a tune sweep's step; absent where none is chosen. Where it equals the enforced limit, a power cap "
            "there is that choice", lambda v: v.power_limit_chosen[0] if v.power_limit_chosen else None),
    gpu_row("gpuwarden_gpu_energy_joules", "Energy used since the driver loaded", "sample.energy_joules",
            COUNTER),
)
