"""GPU tuning in four steps: plan (data only), apply, verify, restore.

Following Red Hat tuned: each setting has apply / verify / unapply, and the
original value is recorded before the first change so it can be put back.
NVML cannot read a clock lock back, so clock verification reads the clock
itself and accepts a lower one only when a power or thermal reason explains it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any
from collections.abc import Iterable

from .config import Config, GpuTuning
from .gpu import errors
from .gpu.base import Gpu, GpuBackend, GpuCapabilities, GpuSample
from .originals import OriginalsStore
from .throttle import held_down_by, within_lock
from .yamlfile import ConfigError, ConfigErrors

POWER_TOLERANCE_W = 1.0


@dataclass(frozen=True)
class Action:
    gpu: int
    uuid: str
    setting: str  # persistence_mode | gpu_clocks | memory_clocks | power_limit_w
    current: Any  # what the GPU reads now (bool, MHz or W; None if unreadable)
    target: Any  # True, (min, max) MHz, or W
    change: bool  # False: nothing to do
    note: str = ""

    def describe(self) -> str:
        now = _show(self.setting, self.current, current=True)
        want = _show(self.setting, self.target, current=False)
        text = f"GPU {self.gpu} {self.setting}: {now} -> {want}" if self.change else \
            f"GPU {self.gpu} {self.setting}: {now}, no change"
        return f"{text} ({self.note})" if self.note else text

    def as_dict(self) -> dict:
        target = list(self.target) if isinstance(self.target, tuple) else self.target
        return {"gpu": self.gpu, "uuid": self.uuid, "setting": self.setting, "current": self.current,
                "target": target, "change": self.change, "note": self.note}


def _show(setting: str, value: Any, current: bool) -> str:
    if value is None:
        return "unreadable"
    if setting == "persistence_mode":
        return "on" if value else "off"
    if setting == "power_limit_w":
        return f"{value:g} W"
    if isinstance(value, tuple):
        return f"lock {value[0]}-{value[1]} MHz"
    return f"{value} MHz" + (" now" if current else "")


@dataclass(frozen=True)
class GpuPlan:
    index: int
    uuid: str
    name: str
    actions: tuple[Action, ...]
    down: bool = False  # unreadable when planned: nothing could be planned for it yet


@dataclass(frozen=True)
class Plan:
    gpus: tuple[GpuPlan, ...]
    notes: tuple[str, ...] = ()
    persistenced: bool = False  # nvidia-persistenced runs: persistence mode is left to it

    @property
    def actions(self) -> list[Action]:
        return [a for g in self.gpus for a in g.actions]

    def as_dict(self) -> dict:
        return {"notes": list(self.notes),
                "gpus": [{"index": g.index, "uuid": g.uuid, "name": g.name,
                          "actions": [a.as_dict() for a in g.actions]} for g in self.gpus]}


# -- plan -----------------------------------------------------------------------

def make_plan(backend: GpuBackend, config: Config) -> Plan:
    """What tuning would do on each GPU. Touches nothing; raises ConfigErrors
    when a configured value is outside what a card supports."""
    gpus = backend.gpus()
    problems: list[ConfigError] = []
    per_gpu: dict[tuple, list[Gpu]] = {}  # the same problem on several GPUs is said once, naming them all
    _check_override_keys(config, gpus, problems)
    persistenced = backend.persistenced_running()
    notes = ["nvidia-persistenced is running: it keeps the driver loaded, so gpuwarden leaves "
             "persistence mode to it"] if persistenced else []
    plans = []
    for gpu in gpus:
        sample = gpu.sample()
        if not sample.up:
            notes.append(f"GPU {gpu.index} ({gpu.uuid}) is down, nothing planned for it: {sample.error}")
            plans.append(GpuPlan(gpu.index, gpu.uuid, gpu.name, (), down=True))
            continue
        want = config.tuning.for_gpu(gpu.index, gpu.uuid)
        actions = _gpu_actions(config, gpu, want, sample, gpu.capabilities(), persistenced, per_gpu)
        plans.append(GpuPlan(gpu.index, gpu.uuid, gpu.name, tuple(actions)))
    for (path, message, allowed), on in per_gpu.items():
        names = sorted({g.name for g in on})
        who = f"GPU {on[0].index} ({on[0].name}, {on[0].uuid})" if len(on) == 1 else \
            f"GPUs {', '.join(str(g.index) for g in on)} ({', '.join(names)})"
        problems.append(config.error(path, f"{who}: {message}", allowed))
    if problems:
        raise ConfigErrors(sorted(problems, key=lambda e: (e.file, e.line, e.key)))
    return Plan(tuple(plans), tuple(notes), persistenced)


def _check_override_keys(config: Config, gpus: list[Gpu], problems: list[ConfigError]) -> None:
    known = {str(g.index) for g in gpus} | {g.uuid for g in gpus}
    indices = f"0-{len(gpus) - 1}" if gpus else "none"
    for key, _ in config.tuning.overrides:
        if key not in known:
            problems.append(config.error(("tuning", "gpus", key), "no such GPU on this host",
                                         f"GPU indices {indices}, or their UUIDs from `gpuwarden plan`"))


def _gpu_actions(config: Config, gpu: Gpu, want: GpuTuning, sample: GpuSample, caps: GpuCapabilities,
                 persistenced: bool, per_gpu: dict[tuple, list[Gpu]]) -> list[Action]:
    def fail(setting: str, message: str, allowed: str | None = None) -> None:
        path = config.tuning.override_source(gpu.index, gpu.uuid, setting)
        per_gpu.setdefault((path, message, allowed), []).append(gpu)

    actions = []
    if want.persistence_mode:
        current = sample.persistence_mode
        if persistenced:
            actions.append(Action(gpu.index, gpu.uuid, "persistence_mode", current, True, False,
                                  "left to nvidia-persistenced"))
        elif current is None:
            actions.append(Action(gpu.index, gpu.uuid, "persistence_mode", None, True, False,
                                  "not supported on this GPU"))
        else:
            actions.append(Action(gpu.index, gpu.uuid, "persistence_mode", current, True, not current))

    graphics = caps.graphics_clocks_mhz or tuple(c for c in (sample.max_graphics_clock_mhz,) if c)
    target = _clock_range(want.gpu_clocks, graphics, "gpu_clocks", fail)
    if target:
        actions.append(Action(gpu.index, gpu.uuid, "gpu_clocks", sample.sm_clock_mhz, target, True))
    memory = caps.memory_clocks_mhz or tuple(c for c in (sample.max_memory_clock_mhz,) if c)
    target = _clock_range(want.memory_clocks, memory, "memory_clocks", fail)
    if target:
        actions.append(Action(gpu.index, gpu.uuid, "memory_clocks", sample.memory_clock_mhz, target, True))

    if want.power_limit_w is not None:
        low, high = caps.power_limit_min_w, caps.power_limit_max_w
        if low is None or high is None:
            fail("power_limit_w", "setting a power limit is not supported on this GPU", "none")
        elif not low <= want.power_limit_w <= high:
            fail("power_limit_w", f"{want.power_limit_w:g} W is outside this GPU's power constraints",
                 f"allowed {low:g}-{high:g} W")
        else:
            current = sample.power_limit_w
            change = current is None or abs(current - want.power_limit_w) >= POWER_TOLERANCE_W / 2
            actions.append(Action(gpu.index, gpu.uuid, "power_limit_w", current, want.power_limit_w, change))
    return actions


def _clock_range(setting: Any, supported: Iterable[int], name: str, fail) -> tuple[int, int] | None:
    if setting is None:
        return None
    supported = sorted(supported)
    if not supported:
        fail(name, "this GPU lists no supported clocks, so they cannot be locked", "none")
        return None
    low, high = supported[0], supported[-1]
    if setting == "max":
        return (high, high)
    if setting[0] < low or setting[1] > high:
        fail(name, f"[{setting[0]}, {setting[1]}] MHz is not supported", f"allowed {low}-{high} MHz")
        return None
    return tuple(setting)


# -- apply / verify / restore ------------------------------------------------------

@dataclass(frozen=True)
class Outcome:
    action: Action
    ok: bool
    message: str = ""
    error: type[errors.GpuError] | None = None

    def describe(self, ok_word: str = "ok") -> str:
        return f"{self.action.describe()}: {ok_word if self.ok else 'FAILED'}" + (
            f", {self.message}" if self.message else "")


@dataclass
class OriginalState:
    """One GPU's settings before gpuwarden first changed them."""

    persistence_mode: bool | None = None
    power_limit_w: float | None = None
    locked: set[str] = field(default_factory=set)  # settings whose locks gpuwarden set
    recorded: set[str] = field(default_factory=set)  # settings whose original is above


class Tuner:
    def __init__(self, backend: GpuBackend, store: OriginalsStore | None = None):
        """store: where this boot's originals survive a restart of the daemon (None: memory only)."""
        self.backend = backend
        self.store = store
        self.original: dict[int, OriginalState] = {}
        saved = store.load() if store is not None else {}
        for gpu in backend.gpus():
            if gpu.uuid in saved:
                s = saved[gpu.uuid]
                self.original[gpu.index] = OriginalState(s.get("persistence_mode"), s.get("power_limit_w"),
                                                         set(s.get("locked", [])), set(s.get("recorded", [])))

    def _save(self) -> None:
        if self.store is None:
            return
        by_uuid = {g.index: g.uuid for g in self.backend.gpus()}
        self.store.save({by_uuid[i]: {"persistence_mode": s.persistence_mode, "power_limit_w": s.power_limit_w,
                                      "locked": sorted(s.locked), "recorded": sorted(s.recorded)}
                         for i, s in self.original.items() if i in by_uuid})

    def _gpu(self, index: int) -> Gpu:
        return next(g for g in self.backend.gpus() if g.index == index)

    def apply(self, plan: Plan) -> list[Outcome]:
        outcomes = []
        before = {i: (s.persistence_mode, s.power_limit_w, set(s.locked), set(s.recorded))
                  for i, s in self.original.items()}
        for action in plan.actions:
            self._record_original(action)  # unchanged ones too: a later re-apply must not mistake drift for it
            if not action.change:
                continue
            try:
                _set(self._gpu(action.gpu), action.setting, action.target)
            except errors.GpuError as exc:
                outcomes.append(Outcome(action, False, str(exc), type(exc)))
                continue
            if action.setting in ("gpu_clocks", "memory_clocks"):
                self.original[action.gpu].locked.add(action.setting)
            outcomes.append(Outcome(action, True))
        after = {i: (s.persistence_mode, s.power_limit_w, s.locked, s.recorded) for i, s in self.original.items()}
        if after != before:
            self._save()  # before anything else can happen to this daemon
        return outcomes

    def _record_original(self, action: Action) -> None:
        state = self.original.setdefault(action.gpu, OriginalState())
        if action.setting in state.recorded:
            return
        state.recorded.add(action.setting)
        if action.setting == "persistence_mode":
            state.persistence_mode = action.current
        if action.setting == "power_limit_w":
            state.power_limit_w = action.current

    def verify(self, plan: Plan) -> list[Outcome]:
        """Read every planned setting back."""
        samples = {g.index: g.sample() for g in self.backend.gpus()}
        return [_verify(action, samples[action.gpu]) for action in plan.actions if action.target is not None]

    def restore(self, only: set[tuple[int, str]] | None = None) -> list[Outcome]:
        """Put back what apply changed (or only these (gpu, setting) pairs); forget what was restored."""
        outcomes = []
        for index, state in sorted(self.original.items()):
            gpu = self._gpu(index)
            undo: list[tuple[str, Any]] = [(s, None) for s in sorted(state.locked)]
            if state.power_limit_w is not None:
                undo.append(("power_limit_w", state.power_limit_w))
            if state.persistence_mode is False:
                undo.append(("persistence_mode", False))
            for setting, value in undo:
                if only is not None and (index, setting) not in only:
                    continue
                action = Action(index, gpu.uuid, setting, None, value, True, "restore")
                try:
                    _set(gpu, setting, value)
                    outcomes.append(Outcome(action, True))
                except errors.GpuError as exc:
                    outcomes.append(Outcome(action, False, str(exc), type(exc)))
                state.locked.discard(setting)
                state.recorded.discard(setting)
                if setting == "power_limit_w":
                    state.power_limit_w = None
                if setting == "persistence_mode":
                    state.persistence_mode = None
        if outcomes:
            self._save()
        return outcomes


def _set(gpu: Gpu, setting: str, value: Any) -> None:
    """One setter; a None value for a clock means reset its lock."""
    if setting == "persistence_mode":
        gpu.set_persistence_mode(bool(value))
    elif setting == "gpu_clocks":
        gpu.set_gpu_locked_clocks(*value) if value else gpu.reset_gpu_locked_clocks()
    elif setting == "memory_clocks":
        gpu.set_memory_locked_clocks(*value) if value else gpu.reset_memory_locked_clocks()
    elif setting == "power_limit_w":
        gpu.set_power_limit_w(value)
    else:
        raise ValueError(f"unknown tuning setting {setting!r}")


def _verify(action: Action, sample: GpuSample) -> Outcome:
    if not sample.up:
        return Outcome(action, False, f"GPU is down: {sample.error}", errors.GpuLost)
    setting, target = action.setting, action.target
    if setting == "persistence_mode":
        if action.note and not action.change:  # left to nvidia-persistenced or unsupported
            return Outcome(action, True, action.note)
        ok = sample.persistence_mode is True
        return Outcome(action, ok, "" if ok else f"reads {_show(setting, sample.persistence_mode, True)}")
    if setting == "power_limit_w":
        ok = sample.power_limit_w is not None and abs(sample.power_limit_w - target) < POWER_TOLERANCE_W
        return Outcome(action, ok, "" if ok else f"reads {_show(setting, sample.power_limit_w, True)}")
    clock = sample.sm_clock_mhz if setting == "gpu_clocks" else sample.memory_clock_mhz
    if clock is None:
        return Outcome(action, False, "clock is unreadable")
    if within_lock(clock, target):
        return Outcome(action, True, f"reads {clock} MHz")
    held = held_down_by(sample)
    if clock < target[0] and held:
        return Outcome(action, True, f"reads {clock} MHz, held below the lock by {', '.join(held.names())}")
    return Outcome(action, False, f"reads {clock} MHz, outside the lock")
