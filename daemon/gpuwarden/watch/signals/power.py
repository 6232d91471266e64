"""Power: the draw, the limits (enforced, the card's maximum, the one gpuwarden chose) and the energy counter.
Rules: the clocks held down by the power limit while busy. At a limit the config, tune or the budget chose it is
that choice (held_at_chosen_limit, a notice); at the card's design power it is at_design_power (a notice;
alerts.warn_at_design_power makes it power_capped too); at any other limit (one nobody here chose, or one lowered
below the choice by something else) it is power_capped, a warning."""

from __future__ import annotations

from ...gpu import throttle
from ...gpu.base import ClockEventReason as R
from ...gpu.base import GpuSample
from ...gpu.throttle import headroom_w, reasons
from ...tune.tunables import power_limit_is
from ..alerts import INACTIVE, INFO, WARNING, Check, GpuContext, Rule
from ..rows import COUNTER, gpu_row
from .clocks import clock_loss

CAPPED, DESIGN, CHOSEN = "capped", "design", "chosen"


def _kind(s: GpuSample, ctx: GpuContext) -> str:
    """Which rule a power cap is: held at the chosen limit (a choice), at the card's maximum (design power), or
    at a limit nobody here chose. Exactly one, so a cap is never both a notice and a warning."""
    chosen = ctx.power_limit_chosen
    is_max = throttle.at_max_power_limit(s)
    if is_max:
        return CAPPED if ctx.settings.warn_at_design_power else DESIGN
    if chosen is not None and power_limit_is(s.power_limit_w, chosen[0]):
        return CHOSEN
    return CAPPED


def _power_check(s: GpuSample, ctx: GpuContext, kind: str) -> Check:
    """SwPowerCap while busy, judged as one kind (_kind)."""
    if not ctx.busy or R.SwPowerCap not in reasons(s) or _kind(s, ctx) != kind:
        return INACTIVE
    observed, short, loss = clock_loss(s, ctx)
    draw = f"{s.power_w:.0f} W" if s.power_w is not None else "? W"
    limit = f"{s.power_limit_w:.0f} W" if s.power_limit_w is not None else "the limit"
    if throttle.at_max_power_limit(s):
        return Check(True, f"{observed}; drawing {draw}", f"at its maximum power limit {limit} (SwPowerCap)", short,
                     "nothing to change: this is the card's design power, and no higher limit is allowed", loss)
    chosen = ctx.power_limit_chosen
    if kind == CHOSEN:
        # A choice, not a fault: said (one line names the cause of the clock loss), never with advice to undo it.
        return Check(True, f"{observed}; drawing {draw}", f"held at {limit}, {chosen[1]} (SwPowerCap)", short,
                     "nothing to fix: the limit was chosen, and the clock loss shown is its price", loss)
    if chosen is not None and s.power_limit_w is not None and s.power_limit_w < chosen[0]:
        # Something else lowered the card below the choice (nvidia-smi -pl, another tool): raising the config
        # would change nothing, so the fix is to find that and set the choice again.
        return Check(True, f"{observed}; drawing {draw}",
                     f"at power limit {limit}, below the {chosen[0]:g} W {chosen[1]} (SwPowerCap)", short,
                     "something else lowered the limit (nvidia-smi -pl, a cron job, another tool): stop it, then "
                     "`systemctl reload gpuwarden` sets the chosen limit again", loss)
    headroom = headroom_w(s)
    fix = (f"raise tuning.power_limit_w by up to {headroom:g} W, to {s.power_limit_max_w:g} W (the card's maximum), "
           "or accept the clock loss") if headroom is not None else ""
    return Check(True, f"{observed}; drawing {draw}", f"at power limit {limit} (SwPowerCap)", short, fix, loss)


def power_capped(s: GpuSample, ctx: GpuContext) -> Check:
    return _power_check(s, ctx, CAPPED)


def at_design_power(s: GpuSample, ctx: GpuContext) -> Check:
    return _power_check(s, ctx, DESIGN)


def held_at_chosen_limit(s: GpuSample, ctx: GpuContext) -> Check:
    return _power_check(s, ctx, CHOSEN)


# swept: a tune sweep's power limit trips these (alerts.Rule.swept). held_at_chosen_limit is not: during a sweep
# the chosen limit is the sweep's step, and the notice names it as that (nothing to act on, and it says so).
RULES = (
    Rule("power_capped", WARNING, "the card is at a power limit nobody here chose, or below the one chosen; raise "
         "tuning.power_limit_w within the constraints (`gpuwarden plan` shows them), or accept the clock loss",
         power_capped, swept=True),
    Rule("at_design_power", INFO, "nothing to change: this is the card's design power", at_design_power,
         swept=True),
    Rule("held_at_chosen_limit", INFO, "nothing to fix: the config, tune or the power budget chose this limit, and "
         "the clock loss is its price", held_at_chosen_limit),
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
