"""A simulated card's physics: the clocks, power and temperature its load, locks, power limit and the scenario's
conditions give (operating_point), with the reasons a real card reports for a clock held low."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..base import ClockEventReason as R
from .scenario import GpuModel

if TYPE_CHECKING:
    from .backend import SimGpu

# Default SM clock under each slowdown, as a fraction of the max clock.
SLOWDOWN_FRACTION = {"thermal_slowdown": 0.7, "hw_thermal_slowdown": 0.5, "hw_slowdown": 0.5}
SLOWDOWN_REASON = {"clock_collapse": R.NONE, "thermal_slowdown": R.SwThermalSlowdown,
                   "hw_thermal_slowdown": R.HwThermalSlowdown, "hw_slowdown": R.HwSlowdown,
                   "power_brake": R.HwPowerBrakeSlowdown}
# Which violation counter each reason feeds.
VIOLATION_OF = {R.SwPowerCap: "power", R.SwThermalSlowdown: "thermal", R.HwThermalSlowdown: "thermal",
                R.HwSlowdown: "board_limit", R.HwPowerBrakeSlowdown: "board_limit",
                R.GpuIdle: "low_utilization"}


def floor_clock(model: GpuModel, mhz: float) -> int:
    """The highest supported graphics clock at or below mhz."""
    clocks = model.graphics_clocks_mhz
    return next((c for c in clocks if c <= mhz + 1e-6), clocks[-1])


def draw(m: GpuModel, utilization: float, sm_mhz: float, context: bool = False) -> float:
    """Watts at this load and clock; context: an engine holds a CUDA context on the card, which draws at least
    model.context_w above idle at the boost clock (its boost at rest; under load the load's draw, which includes
    it), in proportion to how far the clock stands above the idle clock: a lock at the card's lowest clock holds a
    context at bare idle (serve.idle's clocks, design/idle-engine.md)."""
    load = m.idle_power_w + utilization / 100 * (m.full_load_power_w - m.idle_power_w) * (
        sm_mhz / m.graphics_clock_max_mhz)
    if not context:
        return load
    span = m.graphics_clock_max_mhz - m.idle_sm_clock_mhz
    raised = 1.0 if span <= 0 else min(1.0, max(0.0, (sm_mhz - m.idle_sm_clock_mhz) / span))
    return max(load, m.idle_power_w + m.context_w * raised)


def operating_point(gpu: SimGpu) -> tuple[int, int, float, float, R]:
    """(sm MHz, memory MHz, watts, celsius, reasons) for the card's state now: its load, locks, power limit and
    conditions."""
    m = gpu.model
    busy = gpu.utilization > 0
    reasons = R.NONE
    if gpu.gpu_lock:
        sm = gpu.gpu_lock[1]
        if sm < m.graphics_clock_max_mhz:
            reasons |= R.ApplicationsClocksSetting
    elif (busy or gpu.context and m.context_w) and m.boost_under_load:
        sm = m.graphics_clock_max_mhz  # a context boosts the clock even at rest, where the model says it costs
    else:
        sm = m.idle_sm_clock_mhz
    if not busy and not gpu.gpu_lock:
        reasons |= R.GpuIdle
    limit = min(gpu.power_limit_w, gpu.conditions.get("power_cap", {}).get("watts", float("inf")))
    if busy and draw(m, gpu.utilization, sm) > limit:
        per_mhz = (draw(m, gpu.utilization, m.graphics_clock_max_mhz) - m.idle_power_w) / m.graphics_clock_max_mhz
        sm = min(sm, floor_clock(m, (limit - m.idle_power_w) / per_mhz))
        reasons |= R.SwPowerCap
    for kind, reason in SLOWDOWN_REASON.items():
        if kind in gpu.conditions:
            default = SLOWDOWN_FRACTION.get(kind, 0) * m.graphics_clock_max_mhz or m.idle_sm_clock_mhz
            sm = min(sm, floor_clock(m, gpu.conditions[kind].get("sm_clock_mhz", default)))
            reasons |= reason
    if gpu.memory_lock:
        mem = gpu.memory_lock[1]
    elif gpu.gpu_lock or (busy and m.boost_under_load):
        mem = m.memory_clocks_mhz[-1]
    else:
        mem = m.idle_memory_clock_mhz
    power = draw(m, gpu.utilization, sm, gpu.context)
    temp = m.idle_temperature_c + (power - m.idle_power_w) * m.celsius_per_watt
    for kind in ("thermal_slowdown", "hw_thermal_slowdown"):
        temp = gpu.conditions.get(kind, {}).get("temperature_c", temp)
    return sm, mem, power, temp, reasons
