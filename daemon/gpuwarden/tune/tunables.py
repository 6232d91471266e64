"""The tuning settings table: each per-GPU setting declared once, as Red Hat tuned registers its plugins.

A Tunable says how its config value is read, what the plan does with it on one
card (or why the card cannot take it), how it is set and reset, how it is
verified and shown, and what is recorded so that it can be put back. Config,
plan, apply, verify, restore and the re-apply on drift all go through TUNABLES;
a new setting (say, a workload power profile on Blackwell) is one class here
and its tests.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Union

from ..gpu.base import Gpu, GpuCapabilities, GpuSample
from ..base.schema import MISSING, NONE_WORDS, Reader, type_name
from ..gpu.throttle import held_down_by, within_lock
from ..base.yamlfile import Path_

MAX_MHZ = 100_000
MAX_WATTS = 5_000
POWER_TOLERANCE_W = 1.0

# A clock setting: "max", "auto" (max where the card needs it: clock_class), an inclusive (min, max) MHz range,
# or None (leave alone).
ClockTarget = Union[str, tuple[int, int], None]
# NVML's brands (nvmlDeviceGetBrand): workstation and desktop cards, whose headless ones can sit at idle clocks
# under load (the seeds' RTX PRO 4000: 180 MHz while serving), and datacenter ones, which boost by themselves.
WORKSTATION_BRANDS = ("NVIDIA RTX", "Quadro RTX", "Quadro", "GeForce", "GeForce RTX", "Titan", "Titan RTX", "NVS")
DATACENTER_BRANDS = ("Tesla", "NVIDIA")
BUSY_PCT = 20.0  # as alerts.busy_utilization_pct's default: a card this busy at half its max clock idles low


def clock_class(sample: GpuSample) -> tuple[bool, str]:
    """Whether `gpu_clocks: auto` locks this card's GPU clock at its max, and why, from what the card reports:
    busy yet at an idle clock with nothing holding it down (seen now), its compute capability, its brand and
    form factor. A datacenter card (an H100 boosts to 1980 MHz by itself, and cannot hold it at 700 W
    anyway) is left alone; so the plan does not pretend to fix what is not broken."""
    b, top, sm = sample.board, sample.max_graphics_clock_mhz, sample.sm_clock_mhz
    said = ", ".join(x for x in (b.brand, {"sxm": "SXM", "pcie": "PCIe"}.get(b.form_factor or ""),
                                 f"default {b.default_graphics_clock_mhz} MHz" if b.default_graphics_clock_mhz
                                 else "") if x)
    if (sample.utilization_pct or 0) >= BUSY_PCT and sm and top and sm <= top / 2 and not held_down_by(sample):
        return True, f"busy at {sm} MHz with no throttle reason: it idles low under load"
    if (sample.compute_capability or "").startswith("12."):
        return True, f"SM{sample.compute_capability} ({said or 'no brand'}): headless SM12x cards idle low under load"
    if b.brand in WORKSTATION_BRANDS:
        return True, f"a workstation card ({said}): headless ones can idle low under load"
    if b.brand in DATACENTER_BRANDS or b.form_factor == "sxm":
        return False, f"a datacenter card ({said}) boosts to {top} MHz by itself; a lock buys nothing"
    return True, f"the card does not say its class ({said or 'no brand, no form factor'}): locked as a workstation card"


@dataclass(frozen=True)
class Step:
    """What the plan does with one setting on one GPU."""

    current: Any  # what the GPU reads now (None: unreadable)
    target: Any
    change: bool  # False: nothing to do
    note: str = ""


class Unfit(Exception):
    """The card cannot take the configured value: (message, allowed) for a config error."""

    def __init__(self, message: str, allowed: str | None = None):
        super().__init__(message)
        self.message, self.allowed = message, allowed


class Tunable:
    key: str  # the config key under tuning: and tuning.gpus.ID:, and Action.setting
    default: Any  # the wanted value when the config says nothing
    lock_of: str | None = None  # "sm" or "memory": a lock the clock alerts measure against (and exported)
    title: str = ""  # for a lock: the clock's name in the metric's help
    records_original: bool = False  # the value before the first change is recorded and put back

    def parse(self, r: Reader, path: Path_, default: Any) -> Any:
        raise NotImplementedError

    def config_value(self, value: Any) -> Any:
        """The wanted value as the config file writes it (Config.as_dict)."""
        return "none" if value is None else value

    def plan(self, wanted: Any, sample: GpuSample, caps: GpuCapabilities, persistenced: bool) -> Step | None:
        """None when nothing is wanted; raises Unfit when this card cannot take the value."""
        raise NotImplementedError

    def set(self, gpu: Gpu, value: Any) -> None:
        """Apply value; for a lock, None resets it."""
        raise NotImplementedError

    def verify(self, step: Step, sample: GpuSample) -> tuple[bool, str]:
        raise NotImplementedError

    def undo(self, original: Any, locked: bool) -> tuple[bool, Any]:
        """(whether restore has something to do, the value to set) from what was recorded."""
        raise NotImplementedError

    def show(self, value: Any, current: bool) -> str:
        raise NotImplementedError


class PersistenceMode(Tunable):
    key, default, records_original = "persistence_mode", True, True

    def parse(self, r: Reader, path: Path_, default: Any) -> Any:
        return r.boolean(path, default)

    def plan(self, wanted, sample, caps, persistenced):
        if not wanted:
            return None
        current = sample.persistence_mode
        if persistenced:
            return Step(current, True, False, "left to nvidia-persistenced")
        if current is None:
            return Step(None, True, False, "not supported on this GPU")
        return Step(current, True, not current)

    def set(self, gpu, value):
        gpu.set_persistence_mode(bool(value))

    def verify(self, step, sample):
        if step.note and not step.change:  # left to nvidia-persistenced or unsupported
            return True, step.note
        ok = sample.persistence_mode is True
        return ok, "" if ok else f"reads {self.show(sample.persistence_mode, True)}"

    def undo(self, original, locked):
        return original is False, False  # it was off before us: turn it off again

    def show(self, value, current):
        return "unreadable" if value is None else ("on" if value else "off")


def persistenced_fix(state: str) -> str:
    """The supported way to persistence mode from nvidia-persistenced's state ("stopped": installed, not
    running; "absent"). NVML's setter is deprecated: on driver 580 it logs "NVRM: Persistence mode is
    deprecated ... use nvidia-persistenced"."""
    if state == "stopped":
        return "`systemctl enable --now nvidia-persistenced`"
    return ("install nvidia-persistenced (Debian: non-free; or NVIDIA's CUDA repository), then "
            "`systemctl enable --now nvidia-persistenced`")


class ClockLock(Tunable):
    """A locked clock range: GPU (SM) clocks or memory clocks. NVML cannot read a lock back, so it is
    verified by reading the clock, which a power or thermal reason may hold below the lock."""

    def __init__(self, key: str, lock_of: str, title: str, default: ClockTarget, auto: bool = False):
        self.key, self.lock_of, self.title, self.default, self.auto = key, lock_of, title, default, auto

    def parse(self, r, path, default):
        return clock_target(r, path, default, self.auto)

    def config_value(self, value):
        return list(value) if isinstance(value, tuple) else ("none" if value is None else value)

    def _reading(self, sample: GpuSample) -> int | None:
        return sample.sm_clock_mhz if self.lock_of == "sm" else sample.memory_clock_mhz

    def plan(self, wanted, sample, caps, persistenced):
        if wanted is None:
            return None
        note = ""
        if wanted == "auto":
            lock, why = clock_class(sample)
            if not lock:
                return Step(self._reading(sample), None, False, f"left unlocked: {why}")
            wanted, note = "max", f"auto: {why}"
        if self.lock_of == "sm":
            supported = caps.graphics_clocks_mhz or tuple(c for c in (sample.max_graphics_clock_mhz,) if c)
        else:
            supported = caps.memory_clocks_mhz or tuple(c for c in (sample.max_memory_clock_mhz,) if c)
        return Step(self._reading(sample), _clock_range(wanted, supported), True, note)

    def set(self, gpu, value):
        if self.lock_of == "sm":
            gpu.set_gpu_locked_clocks(*value) if value else gpu.reset_gpu_locked_clocks()
        else:
            gpu.set_memory_locked_clocks(*value) if value else gpu.reset_memory_locked_clocks()

    def verify(self, step, sample):
        clock = self._reading(sample)
        if clock is None:
            return False, "clock is unreadable"
        if within_lock(clock, step.target):
            return True, f"reads {clock} MHz"
        held = held_down_by(sample)
        if clock < step.target[0] and held:
            return True, f"reads {clock} MHz, held below the lock by {', '.join(held.names())}"
        return False, f"reads {clock} MHz, outside the lock"

    def undo(self, original, locked):
        return locked, None  # only a lock we set is reset

    def show(self, value, current):
        if value is None:
            return "unreadable"
        if isinstance(value, tuple):
            return f"lock {value[0]}-{value[1]} MHz"
        return f"{value} MHz" + (" now" if current else "")


class PowerLimit(Tunable):
    key, default, records_original = "power_limit_w", None, True

    def parse(self, r, path, default):
        return r.optional_number(path, default, 1, MAX_WATTS, unit=" W")

    def plan(self, wanted, sample, caps, persistenced):
        if wanted is None:
            return None
        low, high = caps.power_limit_min_w, caps.power_limit_max_w
        if low is None or high is None:
            raise Unfit("setting a power limit is not supported on this GPU", "none")
        if not low <= wanted <= high:
            raise Unfit(f"{wanted:g} W is outside this GPU's power constraints", f"allowed {low:g}-{high:g} W")
        current = sample.power_limit_w
        return Step(current, wanted, current is None or abs(current - wanted) >= POWER_TOLERANCE_W / 2)

    def set(self, gpu, value):
        gpu.set_power_limit_w(value)

    def verify(self, step, sample):
        ok = power_limit_is(sample.power_limit_w, step.target)
        return ok, "" if ok else f"reads {self.show(sample.power_limit_w, True)}"

    def undo(self, original, locked):
        return original is not None, original

    def show(self, value, current):
        return "unreadable" if value is None else f"{value:g} W"


def power_limit_is(enforced: float | None, target: float) -> bool:
    """The card enforces this limit, within the tolerance a set limit is verified with: the one test of "this is
    the limit the tuning set" (verify, and the power_capped alert's "a limit chosen")."""
    return enforced is not None and abs(enforced - target) < POWER_TOLERANCE_W


TUNABLES: tuple[Tunable, ...] = (PersistenceMode(), ClockLock("gpu_clocks", "sm", "SM clock", "auto", auto=True),
                                 ClockLock("memory_clocks", "memory", "Memory clock", None), PowerLimit())
BY_KEY = {t.key: t for t in TUNABLES}


def keys() -> tuple[str, ...]:
    return tuple(t.key for t in TUNABLES)


def clock_target(r: Reader, path: Path_, default: ClockTarget, auto: bool = False) -> ClockTarget:
    allowed = ("auto, " if auto else "") + f"max, none, or [MIN_MHZ, MAX_MHZ] with 1 <= MIN <= MAX <= {MAX_MHZ}"
    value = r.get(path)
    if value is MISSING:
        return default
    if value is None or (isinstance(value, str) and value.lower() in NONE_WORDS):
        return None
    if isinstance(value, str):
        if value.lower() in (("max", "auto") if auto else ("max",)):
            return value.lower()
        r.fail(path, f"'{value}' is not a clock setting", allowed)
        return default
    if not isinstance(value, list) or len(value) != 2:
        shape = f"a list of {len(value)}" if isinstance(value, list) else type_name(value)
        r.fail(path, f"expected a [MIN, MAX] pair, got {shape}", allowed)
        return default
    low, high = value
    if any(isinstance(v, bool) or not isinstance(v, int) for v in value):
        r.fail(path, f"clock values must be whole MHz, got {value!r}", allowed)
        return default
    if low < 1 or high > MAX_MHZ:
        r.fail(path, f"[{low}, {high}] MHz is out of range", allowed)
        return default
    if low > high:
        r.fail(path, f"min {low} MHz is above max {high} MHz", allowed)
        return default
    return (low, high)


def _clock_range(wanted: Any, supported: Iterable[int]) -> tuple[int, int]:
    supported = sorted(supported)
    if not supported:
        raise Unfit("this GPU lists no supported clocks, so they cannot be locked", "none")
    low, high = supported[0], supported[-1]
    if wanted == "max":
        return (high, high)
    if wanted[0] < low or wanted[1] > high:
        raise Unfit(f"[{wanted[0]}, {wanted[1]}] MHz is not supported", f"allowed {low}-{high} MHz")
    return tuple(wanted)
