"""The SM and memory clocks: how fast the GPU runs against its maximum or its lock. Rules: a busy GPU's clock
low (sm_clock_low, memory_clock_low; thresholds alerts.sm_clock_min_mhz, alerts.memory_clock_min_mhz) and a lock the
driver dropped (clock_lock_lost, which the daemon answers by re-applying the tuning)."""

from __future__ import annotations

from ...gpu import throttle
from ...gpu.base import GpuSample
from ...gpu.throttle import Threshold
from ...tune import tunables
from ..alerts import INACTIVE, WARNING, Check, GpuContext, Rule, pct
from ..rows import gpu_row, hz


def _clock_low(kind: str, clock: int | None, maximum: int | None, lock: tuple[int, int] | None,
               threshold: Threshold, ctx: GpuContext, s: GpuSample) -> Check:
    verdict = throttle.judge(clock, maximum, lock, threshold, s)
    if not ctx.busy or verdict is None:
        return INACTIVE
    basis = "" if threshold.mhz is not None else f" ({threshold} of {verdict.basis} {verdict.reference} MHz)"
    # Locking cannot raise a clock that power or heat holds down: then the fix is about those.
    fix = (f"the clock is held down by {', '.join(verdict.held.names())}, which a lock cannot override: see "
           "the power and thermal alerts for this GPU") if verdict.held else ""
    return Check(verdict.low, f"{kind} clock {clock} MHz while busy (util {pct(s.utilization_pct)})",
                 f"< {verdict.limit:.0f} MHz{basis}", f"{clock} MHz", fix, float(clock))


def sm_clock_low(s: GpuSample, ctx: GpuContext) -> Check:
    return _clock_low("SM", s.sm_clock_mhz, s.max_sm_clock_mhz, ctx.sm_lock, ctx.settings.sm_clock_min, ctx, s)


def memory_clock_low(s: GpuSample, ctx: GpuContext) -> Check:
    return _clock_low("memory", s.memory_clock_mhz, s.max_memory_clock_mhz, ctx.memory_lock,
                      ctx.settings.memory_clock_min, ctx, s)


def clock_lock_lost(s: GpuSample, ctx: GpuContext) -> Check:
    if ctx.sm_lock is None or s.sm_clock_mhz is None:
        return INACTIVE
    explained = bool(throttle.held_down_by(s))
    return Check(throttle.below_lock(s.sm_clock_mhz, ctx.sm_lock) and not explained, f"SM clock {s.sm_clock_mhz} MHz",
                 f"< locked min {ctx.sm_lock[0]} MHz with no power or thermal reason", f"{s.sm_clock_mhz} MHz")


def clock_loss(s: GpuSample, ctx: GpuContext) -> tuple[str, str, float | None]:
    """(observed text, short text, percent) of the SM clock against the lock, else the max clock: what the power
    and slowdown rules quote as the price of their cause."""
    reference = ctx.sm_lock[1] if ctx.sm_lock else s.max_sm_clock_mhz
    if not reference or s.sm_clock_mhz is None:
        return "", "", None
    loss = (s.sm_clock_mhz - reference) / reference * 100
    basis = "locked" if ctx.sm_lock else "max"
    return f"SM clock {s.sm_clock_mhz} MHz, {loss:+.0f}% of {basis} {reference} MHz", f"{loss:+.0f}%", loss


# swept: a tune sweep's clock trips these (alerts.Rule.swept)
RULES = (
    Rule("sm_clock_low", WARNING, "lock the clocks (tuning.gpu_clocks: max) and check `gpuwarden plan`",
         sm_clock_low, swept=True),
    Rule("memory_clock_low", WARNING, "lock the GPU clocks or tuning.memory_clocks: max", memory_clock_low,
         swept=True),
    Rule("clock_lock_lost", WARNING, "a driver reload or GPU reset dropped the lock; gpuwarden re-applies it",
         clock_lock_lost, swept=True, reapply=True),
)


def _lock_row(lock: tunables.Tunable):
    of = lock.lock_of
    return gpu_row(f"gpuwarden_gpu_{of}_clock_lock_hertz", f"{lock.title} gpuwarden locks to (upper bound)",
                   lambda v: hz(getattr(v, f"{of}_lock")[1]) if getattr(v, f"{of}_lock") else None)


ROWS = (
    gpu_row("gpuwarden_gpu_sm_clock_hertz", "Current SM clock", lambda v: hz(v.sample.sm_clock_mhz)),
    gpu_row("gpuwarden_gpu_sm_clock_max_hertz", "Highest SM clock the GPU supports",
            lambda v: hz(v.sample.max_sm_clock_mhz)),
    gpu_row("gpuwarden_gpu_memory_clock_hertz", "Current memory clock", lambda v: hz(v.sample.memory_clock_mhz)),
    gpu_row("gpuwarden_gpu_memory_clock_max_hertz", "Highest memory clock the GPU supports",
            lambda v: hz(v.sample.max_memory_clock_mhz)),
    gpu_row("gpuwarden_gpu_memory_bandwidth_bytes_per_second",
            "Peak memory bandwidth at the current memory clock (2 x clock x bus width / 8)",
            "sample.memory_bandwidth_bytes_per_s"),
    # a gauge for each clock lock the settings table sets
    *(_lock_row(t) for t in tunables.TUNABLES if t.lock_of),
)
