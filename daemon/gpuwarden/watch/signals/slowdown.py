"""The clock-event reasons that slow the card: software thermal capping, the hardware's thermal slowdown, its
slowdown (power supply) and the power brake. Each reason is a rule (firing while its bit is set); NVML's violation
counters say how much of the time a flapping one held the clocks down (DutyCycles, the window)."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from ...gpu.base import VIOLATION_POLICIES, ClockEventReason
from ...gpu.base import ClockEventReason as R
from ...gpu.base import GpuSample
from ...gpu.throttle import reasons
from ..alerts import CRITICAL, INACTIVE, WARNING, Check, GpuContext, Poll, Rule
from ..rows import COUNTER, per_gpu_row
from .clocks import clock_loss

HW_DUTY_MIN = 0.10  # a critical hardware reason that slows the card this much of the time fires
# NVML's board-limit violation counter measures the hardware slowdown and the power brake (its thermal
# counter also counts software thermal capping, so HW thermal slowdown keeps to its streak).
DUTY_COUNTER = {R.HwSlowdown: "board_limit", R.HwPowerBrakeSlowdown: "board_limit"}
REASON_NAMES = [r.name for r in ClockEventReason if r]


def _duty_for(reason: R, window: Duty) -> float | None:
    """The duty cycle of reason's counter, when the counter's growth can be put down to this reason: the
    power brake when it was seen in the window; the slowdown when it was seen, or the brake was not."""
    counter = DUTY_COUNTER.get(reason)
    if counter is None or counter not in window.cycles:
        return None
    if reason == R.HwPowerBrakeSlowdown and R.HwPowerBrakeSlowdown not in window.seen:
        return None
    if reason == R.HwSlowdown and R.HwSlowdown not in window.seen and R.HwPowerBrakeSlowdown in window.seen:
        return None
    return window.cycles[counter]


def _reason_rule(reason: R) -> Callable[[GpuSample, GpuContext], Check]:
    def check(s: GpuSample, ctx: GpuContext) -> Check:
        window = ctx.window(DutyCycles)
        duty = _duty_for(reason, window)
        # A hardware reason that toggles faster than for_s never holds for a whole streak; its violation
        # counter still says how much of the time it slowed the card.
        flapping = duty is not None and duty >= HW_DUTY_MIN
        if reason not in reasons(s) and not flapping:
            return INACTIVE
        observed, short, _ = clock_loss(s, ctx)
        temp = f", {s.temperature_c:.0f} C" if s.temperature_c is not None else ""
        if flapping:
            observed = (f"{reason.name} held the clocks down {duty * 100:.0f}% of the last "
                        f"{window.window_s:.0f} s (violation counter {DUTY_COUNTER[reason]})"
                        + (f"; {observed}" if observed and reason in reasons(s) else ""))
            short = f"{duty * 100:.0f}% of the time"
        return Check(True, observed + temp, f"{reason.name} active, or >= {HW_DUTY_MIN * 100:.0f}% of the time",
                     short, value=-duty if duty is not None else None)
    return check


RULES = (
    Rule("thermal_slowdown", WARNING, "improve cooling or airflow", _reason_rule(R.SwThermalSlowdown)),
    Rule("hw_thermal_slowdown", CRITICAL, "the GPU is overheating: check fans and airflow now",
         _reason_rule(R.HwThermalSlowdown)),
    Rule("hw_slowdown", CRITICAL, "check the power supply and cabling (HW slowdown asserted)",
         _reason_rule(R.HwSlowdown)),
    Rule("power_brake", CRITICAL, "the system asserted the power brake: check the PSU and its load",
         _reason_rule(R.HwPowerBrakeSlowdown)),
)


@dataclass(frozen=True)
class Duty:
    """What DutyCycles read for one GPU on one poll."""

    cycles: Mapping[str, float]  # the fraction of the window each violation counter ran ({} while too little history)
    window_s: float
    seen: R  # every reason seen in a sample during the window


class DutyCycles:
    """Per GPU, the fraction of a recent window each NVML violation counter grew by: the share of the time a
    reason held the clocks down, however it flapped between two polls. Counters are read every
    counters_interval_s, so the window spans several. The signal's window (alerts.Window)."""

    EMPTY = Duty({}, 0.0, R.NONE)

    def __init__(self) -> None:
        self._seen: dict[int, deque[tuple[float, dict[str, float]]]] = {}
        self._reasons: dict[int, deque[tuple[float, ClockEventReason]]] = {}

    def read(self, sample: GpuSample, poll: Poll) -> Duty:
        return Duty(self.update(sample, poll.now, poll.window_s), poll.window_s,
                    self.reasons_seen(sample, poll.now, poll.window_s))

    def reasons_seen(self, sample: GpuSample, now: float, window_s: float) -> ClockEventReason:
        """Every reason present in this GPU's samples during the window."""
        history = self._reasons.setdefault(sample.index, deque())
        history.append((now, sample.clock_event_reasons or ClockEventReason.NONE))
        while history and now - history[0][0] > window_s:
            history.popleft()
        seen = ClockEventReason.NONE
        for _, present in history:
            seen |= present
        return seen

    def update(self, sample: GpuSample, now: float, window_s: float) -> dict[str, float]:
        history = self._seen.setdefault(sample.index, deque())
        counters = {k: v for k, v in sample.violation_seconds.items() if v is not None}
        if not counters:
            return {}
        if not history or history[-1][1] != counters:
            history.append((now, counters))
        while len(history) > 2 and now - history[1][0] >= window_s:
            history.popleft()
        (t0, first), (t1, last) = history[0], history[-1]
        if t1 - t0 < window_s / 2:
            return {}  # too little history to say
        return {k: max(0.0, min(1.0, (last[k] - first[k]) / (t1 - t0))) for k in last if k in first}


WINDOW = DutyCycles


def _active(view) -> list:
    present = view.sample.clock_event_reasons
    if present is None:
        return []
    return [((name,), int(ClockEventReason[name] in present)) for name in REASON_NAMES]


ROWS = (
    per_gpu_row("gpuwarden_gpu_clock_event_active", "1 while a clock-event (throttle) reason is active", ("reason",),
                _active),
    per_gpu_row("gpuwarden_gpu_clock_event_seconds", "Time clocks were held down, by NVML violation counter",
                ("reason",), lambda v: [((policy,), seconds) for policy in VIOLATION_POLICIES
                                        if (seconds := v.sample.violation_seconds.get(policy)) is not None], COUNTER),
)
