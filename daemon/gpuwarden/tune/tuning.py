"""GPU tuning in four steps: plan (data only), apply, verify, restore; and its life on a running daemon
(TuningLife: re-apply on drift, back again after a reset, release on reload, restore at stop).

Following Red Hat tuned: each setting (tunables.TUNABLES) has apply / verify /
unapply, and the original value is recorded before the first change so it can
be put back. This module runs the steps over the table for every GPU; what a
setting means lives in its Tunable.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from . import tunables
from ..gpu import errors
from ..gpu.base import Gpu, GpuBackend, GpuCapabilities, GpuSample
from .originals import OriginalsStore
from ..base.systemd import NOTICE
from .tunables import Step, Unfit, persistenced_fix
from . import budget
from .budget import Mover, PowerBudget
from .wanted import Configured, GpuTuning
from ..base.yamlfile import ConfigError, ConfigErrors

log = logging.getLogger("gpuwarden")


@dataclass(frozen=True)
class Action:
    gpu: int
    uuid: str
    setting: str  # a key of tunables.BY_KEY
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
    return tunables.BY_KEY[setting].show(value, current)


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

def make_plan(backend: GpuBackend, config: Configured) -> Plan:
    """What tuning would do on each GPU. Touches nothing; raises ConfigErrors
    when a configured value is outside what a card supports."""
    gpus = backend.gpus()
    problems: list[ConfigError] = []
    per_gpu: dict[tuple, list[Gpu]] = {}  # the same problem on several GPUs is said once, naming them all
    _check_override_keys(config, gpus, problems)
    state = backend.persistenced_state()
    persistenced = state == "running"
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
    fallback = [a.gpu for g in plans for a in g.actions if a.setting == "persistence_mode" and a.change]
    if fallback:  # said once: a daemon logs the plan's notes at start, not on a reload or a re-apply
        where = "installed but not running" if state == "stopped" else "not installed"
        notes.append(f"nvidia-persistenced is {where}: gpuwarden falls back to NVML's persistence-mode setter on "
                     f"GPU {', '.join(map(str, fallback))}, which the driver deprecates (NVRM: Persistence mode is "
                     f"deprecated); the supported way: {persistenced_fix(state)}")
    for (path, message, allowed), on in per_gpu.items():
        names = sorted({g.name for g in on})
        who = f"GPU {on[0].index} ({on[0].name}, {on[0].uuid})" if len(on) == 1 else \
            f"GPUs {', '.join(str(g.index) for g in on)} ({', '.join(names)})"
        problems.append(config.error(path, f"{who}: {message}", allowed))
    notes += _budget_notes(config, gpus, problems)
    if problems:
        raise ConfigErrors(sorted(problems, key=lambda e: (e.file, e.line, e.key)))
    return Plan(tuple(plans), tuple(notes), persistenced)


def _budget_notes(config: Configured, gpus: list[Gpu], problems: list[ConfigError]) -> list[str]:
    """tuning.power_budget_w: a config error below the cards' minimum limits, else the split it would make now
    (from each card's current draw and demand), as a note of the plan."""
    t = config.tuning
    if t.power_budget_w is None:
        return []
    cards, lost = budget.cards_of(gpus, {g.index: g.sample() for g in gpus}, t.power_share, {})
    floor = budget.minimum_w(cards)
    if floor > t.power_budget_w:
        problems.append(config.error(("tuning", "power_budget_w"),
                                     f"{t.power_budget_w:g} W is below the minimum power limits of the "
                                     f"{len(cards)} GPUs, {floor:g} W in all", f"at least {floor:g} W"))
        return []
    if not cards:
        return [f"power budget {t.power_budget_w:g} W: no GPU reports power-limit constraints, nothing to split"]
    alloc = budget.static_split(cards, t.power_budget_w, lost) if lost else budget.split(cards, t.power_budget_w)
    how = "a static split (GPU " + ", ".join(map(str, lost)) + " lost)" if lost else "by demand now"
    restore = ["tuning.restore_on_stop with the budget: at a stop each card's original power limit comes back only "
               "while the sum of the limits fits the budget; the others keep the budget's split"] \
        if t.restore_on_stop else []
    return [f"power budget {t.power_budget_w:g} W, split {how}: {budget.describe(alloc, t.power_budget_w)}; "
            f"it follows the demand every {budget.MOVE_EVERY_S:g} s", *restore]


def _check_override_keys(config: Configured, gpus: list[Gpu], problems: list[ConfigError]) -> None:
    known = {str(g.index) for g in gpus} | {g.uuid for g in gpus}
    indices = f"0-{len(gpus) - 1}" if gpus else "none"
    for key, _ in config.tuning.overrides:
        if key not in known:
            problems.append(config.error(("tuning", "gpus", key), "no such GPU on this host",
                                         f"GPU indices {indices}, or their UUIDs from `gpuwarden plan`"))


def _gpu_actions(config: Configured, gpu: Gpu, want: GpuTuning, sample: GpuSample, caps: GpuCapabilities,
                 persistenced: bool, per_gpu: dict[tuple, list[Gpu]]) -> list[Action]:
    actions = []
    for tunable in tunables.TUNABLES:
        try:
            step = tunable.plan(getattr(want, tunable.key), sample, caps, persistenced)
        except Unfit as unfit:
            path = config.tuning.override_source(gpu.index, gpu.uuid, tunable.key)
            per_gpu.setdefault((path, unfit.message, unfit.allowed), []).append(gpu)
            continue
        if step is not None:
            actions.append(Action(gpu.index, gpu.uuid, tunable.key, step.current, step.target, step.change,
                                  step.note))
    return actions


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

    values: dict[str, Any] = field(default_factory=dict)  # setting -> original, for records_original ones
    locked: set[str] = field(default_factory=set)  # settings whose locks gpuwarden set
    recorded: set[str] = field(default_factory=set)  # settings whose original has been recorded

    def frozen(self) -> tuple:
        return dict(self.values), set(self.locked), set(self.recorded)


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
                self.original[gpu.index] = OriginalState(
                    {t.key: s.get(t.key) for t in tunables.TUNABLES if t.records_original},
                    set(s.get("locked", [])), set(s.get("recorded", [])))

    def _save(self) -> None:
        if self.store is None:
            return
        by_uuid = {g.index: g.uuid for g in self.backend.gpus()}
        self.store.save({by_uuid[i]: {**s.values, "locked": sorted(s.locked), "recorded": sorted(s.recorded)}
                         for i, s in self.original.items() if i in by_uuid})

    def _gpu(self, index: int) -> Gpu:
        return next(g for g in self.backend.gpus() if g.index == index)

    def apply(self, plan: Plan) -> list[Outcome]:
        outcomes = []
        before = {i: s.frozen() for i, s in self.original.items()}
        for action in plan.actions:
            self._record_original(action)  # unchanged ones too: a later re-apply must not mistake drift for it
            if not action.change:
                continue
            tunable = tunables.BY_KEY[action.setting]
            try:
                tunable.set(self._gpu(action.gpu), action.target)
            except errors.GpuError as exc:
                outcomes.append(Outcome(action, False, str(exc), type(exc)))
                continue
            if tunable.lock_of:
                self.original[action.gpu].locked.add(action.setting)
            outcomes.append(Outcome(action, True))
        if {i: s.frozen() for i, s in self.original.items()} != before:
            self._save()  # before anything else can happen to this daemon
        return outcomes

    def _record_original(self, action: Action) -> None:
        state = self.original.setdefault(action.gpu, OriginalState())
        if action.setting in state.recorded:
            return
        state.recorded.add(action.setting)
        if tunables.BY_KEY[action.setting].records_original:
            state.values[action.setting] = action.current

    def verify(self, plan: Plan) -> list[Outcome]:
        """Read every planned setting back."""
        samples = {g.index: g.sample() for g in self.backend.gpus()}
        return [_verify(action, samples[action.gpu]) for action in plan.actions if action.target is not None]

    def restore(self, only: set[tuple[int, str]] | None = None, leave: set[tuple[int, str]] = frozenset(),
                lowers_first: bool = False) -> list[Outcome]:
        """Put back what apply changed (or only these (gpu, setting) pairs, less those to leave as they are);
        forget what was restored. Settings go back in reverse table order: the power limit, the locks, then
        persistence mode; GPU by GPU, and with lowers_first (a power budget) the GPUs whose power limit goes down
        before those whose limit goes up, so that the sum of the limits never passes what it ends at."""
        outcomes = []
        order = (lambda item: (self._raises_power(*item), item[0])) if lowers_first else (lambda item: item[0])
        for index, state in sorted(self.original.items(), key=order):
            gpu = self._gpu(index)
            for tunable in reversed(tunables.TUNABLES):
                todo, value = tunable.undo(state.values.get(tunable.key), tunable.key in state.locked)
                if not todo or (only is not None and (index, tunable.key) not in only) or (index, tunable.key) in leave:
                    continue
                action = Action(index, gpu.uuid, tunable.key, None, value, True, "restore")
                try:
                    tunable.set(gpu, value)
                    outcomes.append(Outcome(action, True))
                except errors.GpuError as exc:
                    outcomes.append(Outcome(action, False, str(exc), type(exc)))
                state.locked.discard(tunable.key)
                state.recorded.discard(tunable.key)
                state.values.pop(tunable.key, None)
        if outcomes:
            self._save()
        return outcomes

    def original_power_limits(self) -> dict[int, float]:
        """The power limits restore would put back, by GPU."""
        return {i: s.values["power_limit_w"] for i, s in self.original.items()
                if s.values.get("power_limit_w") is not None}

    def _raises_power(self, index: int, state: OriginalState) -> bool:
        original = state.values.get("power_limit_w")
        if original is None:
            return False
        current = _enforced_limit(self._gpu(index))
        return current is None or original > current


def _verify(action: Action, sample: GpuSample) -> Outcome:
    if not sample.up:
        return Outcome(action, False, f"GPU is down: {sample.error}", errors.GpuLost)
    step = Step(action.current, action.target, action.change, action.note)
    ok, message = tunables.BY_KEY[action.setting].verify(step, sample)
    return Outcome(action, ok, message)


BACK_LINE_S = 60.0  # a GPU's "is back" line at most once in this (a flapping GPU returns every other poll)


class TuningLife:
    """The tuning's whole life on a running daemon, in one place: plan and apply at start (and verify), the
    locks the clock alerts measure against, planning a GPU that answers again (a reset or a driver reload
    dropped what it had), re-applying on drift (rate-limited), releasing what a reload no longer wants, and
    restoring at stop. The monitor reads `locks` and `persistenced` and reports what it sees (gpu_answered,
    drifted); the daemon hands it the config (start, reload) and the stop."""

    def __init__(self, backend: GpuBackend, config: Configured, tuner: Tuner):
        self.backend = backend
        self.config = config
        self.tuner = tuner
        self.plan: Plan | None = None
        self.tuned = False  # something was applied: restore_on_stop has something to put back
        self.locks: dict[int, tuple] = {}  # gpu -> (sm lock, memory lock) the clock alerts measure against
        self.persistenced = False  # persistence mode left to nvidia-persistenced
        self.reapplies: Counter = Counter()  # gpu -> re-applies after drift
        self._last_reapply: dict[int, float] = {}
        self._unplanned: set[int] = set()  # unreadable when planned: planned as soon as they answer
        self._was_up: dict[int, bool] = {}
        self._back_said: dict[int, tuple[float, int]] = {}  # gpu -> (its last "is back" line, returns unsaid since)
        self.held: set[int] = set()  # GPUs a sweep's lease holds (sweeps.py): no re-apply on them meanwhile
        self.held_setting: str | None = None  # the setting it sweeps there: a reload leaves it to the sweep's end
        self.held_step: Any = None  # the value the sweep last set there (None: none yet)
        self.budget = self._budget(config)  # tuning.power_budget_w's split and mover (tune/budget.py)

    def _budget(self, config: Configured) -> PowerBudget | None:
        t = config.tuning
        if t.power_budget_w is None:
            return None
        return PowerBudget(t.power_budget_w, t.power_share, Mover(self._set_budget_limit, _enforced_limit))

    def _set_budget_limit(self, gpu: Gpu, watts: float) -> None:
        """A budget move, through the tuner: the card's original limit is recorded before its first change."""
        action = Action(gpu.index, gpu.uuid, "power_limit_w", gpu.sample().power_limit_w, watts, True,
                        "power budget")
        for outcome in self.tuner.apply(Plan((GpuPlan(gpu.index, gpu.uuid, gpu.name, (action,)),))):
            if not outcome.ok:
                log.warning("power budget: %s", outcome.describe())
        self.tuned = True

    def budget_tick(self, samples: list[GpuSample], now: float) -> None:
        """The daemon's poll: every budget.MOVE_EVERY_S, the budget's split follows the demand read in samples. A
        sweep's cards (gpuwarden tune) keep its step; the rest of the budget is split over the others."""
        if self.budget is None:
            return
        try:
            self.budget.tick(self.backend.gpus(), {s.index: s for s in samples}, now, self._swept_limits(samples),
                             self.config.tuning.apply)
        except Exception as exc:  # the budget's fault stays in its room: the poll goes on, the limits stay
            log.error("power budget: %s: %s", type(exc).__name__, exc)

    def _swept_limits(self, samples: list[GpuSample]) -> dict[int, float]:
        if self.held_setting != "power_limit_w":
            return {}
        enforced = {s.index: s.power_limit_w for s in samples}
        return {i: float(self.held_step) if self.held_step is not None else enforced.get(i) or 0.0
                for i in self.held}

    def check(self, config: Configured) -> Plan:
        """The plan config gives on these GPUs; ConfigErrors for a value a card cannot take. Changes nothing."""
        return make_plan(self.backend, config)

    def start(self, plan: Plan) -> None:
        """Apply the plan (or say what read-only would do), verify it, and track its locks."""
        self._use(plan, self.config)
        if not self.config.tuning.apply:
            for action in plan.actions:
                log.info("read-only (tuning.apply is false), would do: %s", action.describe())
            return
        self.tuned = True
        plan = self._unheld(plan)
        for outcome in self.tuner.apply(plan):
            if not outcome.ok:
                log.error("tuning %s", outcome.describe())
        for outcome in self.tuner.verify(plan):
            (log.info if outcome.ok else log.warning)("tuning %s", outcome.describe("verified"))

    def reload(self, config: Configured, plan: Plan) -> None:
        """A reloaded config (its plan checked already): undo what it no longer wants, apply what it does."""
        old, self.config = self.config, config
        if config.tuning == old.tuning:
            return
        if (config.tuning.power_budget_w, config.tuning.power_shares) != (old.tuning.power_budget_w,
                                                                          old.tuning.power_shares):
            self.budget = self._budget(config)  # a new split at the next poll; the limits in force stay till then
        if old.tuning.apply:
            # A setting the new plan leaves alone (gpu_clocks: auto on a datacenter card) is not kept either.
            kept = {(a.gpu, a.setting) for a in plan.actions if a.target is not None} if config.tuning.apply \
                else set()
            dropped = {(a.gpu, a.setting) for a in (self.plan.actions if self.plan else ())} - kept
            dropped = {(g, k) for g, k in dropped if not self._is_held(g, k)}  # the sweep's end sets those
            for outcome in self.tuner.restore(only=dropped):
                (log.info if outcome.ok else log.error)("reload: no longer wanted, %s", outcome.describe())
        self.start(plan)

    def chosen_power_limit(self, index: int, uuid: str) -> tuple[float, str] | None:
        """The power limit gpuwarden sets on this GPU on purpose, and who chose it: a sweep's step while a sweep
        holds the GPU's power limit, else tuning.power_limit_w while the tuning applies. None where neither does:
        a limit found on the card, or set by somebody else, is nobody's choice here."""
        if self._is_held(index, "power_limit_w") and self.held_step is not None:
            return float(self.held_step), "set by a tune sweep"
        if self.budget is not None and self.config.tuning.apply:
            return self.budget.chosen(index)
        wanted = self.config.tuning.for_gpu(index, uuid).power_limit_w
        if wanted is None or not self.config.tuning.apply:
            return None
        return wanted, "chosen in " + ".".join(self.config.tuning.override_source(index, uuid, "power_limit_w"))

    def _is_held(self, gpu: int, setting: str) -> bool:
        return gpu in self.held and setting == self.held_setting

    def _unheld(self, plan: Plan) -> Plan:
        """The plan less the setting a sweep holds on its GPUs: a reload mid-sweep must not set the configured
        value over the step being measured; the sweep's end puts the (new) configured value there."""
        held = [a for a in plan.actions if self._is_held(a.gpu, a.setting)]
        for action in held:
            log.log(NOTICE, "GPU%d %s is a sweep's (gpuwarden tune) until it ends: the reloaded value comes then",
                    action.gpu, action.setting)
        if not held:
            return plan
        return dataclasses.replace(plan, gpus=tuple(
            dataclasses.replace(g, actions=tuple(a for a in g.actions if not self._is_held(a.gpu, a.setting)))
            for g in plan.gpus))

    def restore(self) -> None:
        """At stop, with restore_on_stop: the originals back; with a power budget, a card's original power limit
        only while the sum of the limits still fits the budget (over_budget)."""
        if not (self.tuned and self.config.tuning.apply and self.config.tuning.restore_on_stop):
            return
        try:
            leave = {(i, "power_limit_w") for i in self.over_budget()}
            for outcome in self.tuner.restore(leave=leave, lowers_first=self.budget is not None):
                (log.info if outcome.ok else log.error)("restore %s", outcome.describe())
        except Exception as exc:
            log.error("restore failed: %s: %s", type(exc).__name__, exc)

    def over_budget(self) -> list[int]:
        """With tuning.power_budget_w, the GPUs whose original power limit stays off at the stop: the originals that
        lower a card go back, then those that raise one, in GPU order, each only while the sum of the limits fits
        the budget (4 x 600 W of originals on a 1,500 W budget passed it after every stop). The rest keep the
        budget's split, said in one line."""
        if self.budget is None:
            return []
        originals = self.tuner.original_power_limits()
        limits = {}
        for gpu in self.backend.gpus():  # a card that cannot be read counts as the budget counted it last
            limits[gpu.index] = budget.watts(_enforced_limit(gpu))
            if limits[gpu.index] is None:
                limits[gpu.index] = self.budget.enforced.get(gpu.index, self.budget.budget_w)
        after, left = dict(limits), []
        for index in sorted(originals, key=lambda i: (originals[i] > limits.get(i, 0.0), i)):
            if sum({**after, index: originals[index]}.values()) <= self.budget.budget_w + budget.WATT / 2:
                after[index] = originals[index]
            else:
                left.append(index)
        if left:
            many = len(left) > 1
            log.log(NOTICE, "restore: GPU %s power limit%s left at the power budget's %s W: %s original limit%s (%s W) "
                    "would take the sum of the limits to %g W, past tuning.power_budget_w %g W",
                    ", ".join(map(str, left)), "s" if many else "", ", ".join(f"{limits[i]:g}" for i in left),
                    "their" if many else "its", "s" if many else "", ", ".join(f"{originals[i]:g}" for i in left),
                    sum({**limits, **originals}.values()), self.budget.budget_w)
        return left

    def _use(self, plan: Plan, config: Configured) -> None:
        self.plan = plan
        self.persistenced = plan.persistenced
        self.locks = {}
        self._track_locks(plan, config.tuning.apply)
        # A GPU that could not be read is planned, tuned and watched as soon as it answers.
        self._unplanned = {g.index for g in plan.gpus if g.down}

    def _track_locks(self, plan: Plan, applied: bool) -> None:
        for action in plan.actions if applied else ():
            lock_of = tunables.BY_KEY[action.setting].lock_of
            if lock_of:
                sm, mem = self.locks.get(action.gpu, (None, None))
                self.locks[action.gpu] = (action.target, mem) if lock_of == "sm" else (sm, action.target)

    def gpu_answered(self, sample: GpuSample) -> bool:
        """A poll's reading of one GPU. One that answers again after being lost (or was unreadable when the
        plan was made) gets its wanted tuning planned, applied and its locks tracked, like any other; a driver
        reload while it was away dropped whatever it had. True when it came back."""
        was_up, self._was_up[sample.index] = self._was_up.get(sample.index, True), sample.up
        if not sample.up or (was_up and sample.index not in self._unplanned):
            return False
        self._unplanned.discard(sample.index)
        try:
            plan = make_plan(self.backend, self.config)
        except ConfigErrors as exc:
            log.error("GPU%d is back, but its tuning does not fit it: %s", sample.index, exc.errors[0])
            return True
        mine = Plan(tuple(g for g in plan.gpus if g.index == sample.index), persistenced=plan.persistenced)
        self.locks.pop(sample.index, None)
        self._track_locks(mine, self.config.tuning.apply)
        if not self.config.tuning.apply:
            return True
        outcomes = self.tuner.apply(self._unheld(mine))
        done = "; ".join(o.describe() for o in outcomes) or "nothing to change"
        said, unsaid = self._back_said.get(sample.index, (-BACK_LINE_S, 0))
        now = time.monotonic()
        if now - said < BACK_LINE_S:  # a GPU that flaps (lost and back every poll): one line a minute
            self._back_said[sample.index] = (said, unsaid + 1)
            return True
        self._back_said[sample.index] = (now, 0)
        again = f" ({unsaid} more returns before this one not logged: it flaps)" if unsaid else ""
        log.log(NOTICE, "GPU%d %s is back: planned and applied its tuning: %s%s", sample.index, sample.uuid, done,
                again)
        return True

    def gpu_was_reset(self, index: int) -> None:
        """The daemon reset this GPU (service/recovery.py), which dropped its settings: at its next reading it is
        planned and tuned as one that answers again (gpu_answered), and the monitor clears its wait for a reset."""
        self._unplanned.add(index)

    def drifted(self, sample: GpuSample, causes: list[str], now: float) -> None:
        """Alerts that mean a setting was lost fire on this GPU: re-apply its tuning, at most once per
        alerts.reapply_min_interval_s."""
        if not causes or not self.config.tuning.apply or not sample.up or sample.index in self.held:
            return
        last = self._last_reapply.get(sample.index, float("-inf"))
        if now - last < self.config.reapply_min_interval_s:
            return
        self._last_reapply[sample.index] = now
        try:
            plan = make_plan(self.backend, self.config)
        except ConfigErrors as exc:
            log.error("GPU%d re-apply skipped, the tuning no longer fits the card: %s", sample.index, exc.errors[0])
            return
        mine = Plan(tuple(g for g in plan.gpus if g.index == sample.index))
        outcomes = self.tuner.apply(mine)
        self.reapplies[sample.index] += 1
        done = "; ".join(o.describe() for o in outcomes) or "nothing to change"
        log.warning("GPU%d %s re-applied tuning after %s: %s", sample.index, sample.uuid, ", ".join(causes), done)


def _enforced_limit(gpu: Gpu) -> float | None:
    """The limit NVML enforces on this card now; None when it cannot be read."""
    sample = gpu.sample()
    return sample.power_limit_w if sample.up else None
