"""Is this clock low, and why: the one answer the alert rules, the tuning's verify and `doctor` share.

A clock below its lock or threshold is explained when NVML reports a reason
that holds it down (power, heat, the hardware slowdown, the power brake, or
SyncBoost pinning it to a slower GPU of its group): locking cannot raise it
then, and the fix is about that reason. A clock that is low while the GPU is
busy, with no such reason, is what locking fixes.
"""

from __future__ import annotations

from dataclasses import dataclass

from .base import ClockEventReason as R
from .base import GpuSample

HELD_DOWN = (R.SwPowerCap | R.SwThermalSlowdown | R.HwThermalSlowdown | R.HwSlowdown | R.HwPowerBrakeSlowdown
             | R.SyncBoost)
HARDWARE = R.HwThermalSlowdown | R.HwSlowdown | R.HwPowerBrakeSlowdown  # the critical ones: act now
LOCK_TOLERANCE_MHZ = 30  # real cards report clocks a step or so off the lock
AT_MAX_POWER_W = 0.5  # a limit this close to the card's maximum is the maximum


@dataclass(frozen=True)
class Threshold:
    """A clock threshold: absolute MHz, or a fraction of the locked (else max) clock."""

    mhz: float | None = None
    fraction: float | None = None

    def resolve(self, reference_mhz: float | None) -> float | None:
        if self.mhz is not None:
            return self.mhz
        if self.fraction is None or reference_mhz is None:
            return None
        return self.fraction * reference_mhz

    def __str__(self) -> str:
        return f"{self.mhz:g} MHz" if self.mhz is not None else f"{self.fraction * 100:g}%"


def reasons(sample: GpuSample) -> R:
    return sample.clock_event_reasons or R.NONE


def held_down_by(sample: GpuSample) -> R:
    """The reported reasons that hold a clock below its lock or maximum (R.NONE: nothing explains it)."""
    return reasons(sample) & HELD_DOWN


def is_busy(sample: GpuSample, busy_utilization_pct: float, running_requests: float | None = None) -> bool:
    """Busy: a kernel ran at least busy_utilization_pct of the time, or the engine runs requests (a GPU
    between kernels still serves them)."""
    return (sample.utilization_pct or 0) >= busy_utilization_pct or bool(running_requests)


def within_lock(clock: int, lock: tuple[int, int]) -> bool:
    return lock[0] - LOCK_TOLERANCE_MHZ <= clock <= lock[1] + LOCK_TOLERANCE_MHZ


def below_lock(clock: int, lock: tuple[int, int]) -> bool:
    return clock < lock[0] - LOCK_TOLERANCE_MHZ


def headroom_w(sample: GpuSample) -> float | None:
    """Watts the power limit could still be raised by (None: not reported)."""
    if sample.power_limit_w is None or sample.power_limit_max_w is None:
        return None
    return max(0.0, sample.power_limit_max_w - sample.power_limit_w)


def at_max_power_limit(sample: GpuSample) -> bool:
    """The enforced limit is the card's maximum: SwPowerCap there is its design power, nothing to raise."""
    headroom = headroom_w(sample)
    return headroom is not None and headroom < AT_MAX_POWER_W


@dataclass(frozen=True)
class LowClock:
    """One clock judged against its threshold: the numbers a message needs."""

    low: bool
    clock: int
    limit: float
    reference: float | None  # the lock's top, else the max clock
    basis: str  # "locked" or "max"
    held: R  # reasons that explain it (R.NONE: locking fixes it)


def judge(clock: int | None, maximum: int | None, lock: tuple[int, int] | None,
          threshold: Threshold, sample: GpuSample) -> LowClock | None:
    """clock against threshold, resolved on the lock's top (else the maximum); None when it cannot be said."""
    reference = lock[1] if lock else maximum
    limit = threshold.resolve(reference)
    if clock is None or limit is None:
        return None
    return LowClock(clock < limit, clock, limit, reference, "locked" if lock else "max", held_down_by(sample))
