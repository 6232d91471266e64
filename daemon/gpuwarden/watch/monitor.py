"""Sample every GPU, evaluate the alert rules, keep the latest snapshot. It tunes nothing: it reads the
locks from the tuning's life cycle (tuning.TuningLife) and tells it what the readings show.

The snapshot is the one source for the log, the metrics, the STATUS line and
`gpuwarden status`; it is immutable and replaced whole on each tick, so the
metrics server's and the render threads (web/) read it without locks.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from types import ModuleType
from typing import TYPE_CHECKING

from . import health
from .alerts import CRITICAL, FIRING, WARNING, AlertState, GpuContext, Poll
from ..config import Config
from .eventwatch import EventBook, processes_on
from ..gpu.base import GPM_SHOWN, GpuBackend, GpuSample
from .health import Verdict
from .rows import Row
from .signals import BUDGET_RULES, GPU_ROWS, SERVING_RULES, SIGNALS, rows_of, rules_of, windows_of
from .signals.nvlink import LinkErrors
from .signals.serving import EnergyWindow, RestSavings
from ..base.systemd import NOTICE
from ..gpu.throttle import is_busy
from ..tune.tuning import TuningLife

if TYPE_CHECKING:
    from ..serving.probe.metrics import ServingStats
    from ..serving.run.supervisor import ServingView

log = logging.getLogger("gpuwarden")
STALL_POLLS = 3  # a gap of this many poll intervals between two readings is a stall, not a poll
DUTY_WINDOW_S = 10.0  # at least; three counter reads when counters_interval_s is longer


@dataclass(frozen=True)
class GpuView:
    sample: GpuSample
    sm_lock: tuple[int, int] | None
    memory_lock: tuple[int, int] | None
    power_limit_chosen: tuple[float, str] | None = None  # the limit set on purpose, and by whom (TuningLife)
    windows: Mapping[type, object] = field(default_factory=dict)  # each signal's window's reading (GpuContext's)
    health: Verdict | None = None  # can it serve, and what must happen to it (watch/health.py)


@dataclass(frozen=True)
class AlertView:
    alert: str
    gpu: int | None  # None: host-wide
    uuid: str
    severity: str
    phase: str
    firing: bool
    observed: str
    threshold: str
    short: str
    fired_at: float  # monotonic seconds

    def as_dict(self) -> dict:
        return {k: getattr(self, k) for k in ("alert", "gpu", "uuid", "severity", "phase", "observed",
                                              "threshold", "short")}


@dataclass(frozen=True)
class Snapshot:
    taken_at: float  # wall-clock seconds
    monotonic: float
    gpus: tuple[GpuView, ...]
    alerts: tuple[AlertView, ...]  # every rule on every GPU, firing or not
    transitions: dict[tuple[str, int, str], int] = field(default_factory=dict)  # (alert, gpu, to) -> count
    reapplies: dict[int, int] = field(default_factory=dict)  # gpu -> count
    event_counts: dict[tuple[int, int, str], int] = field(default_factory=dict)  # (gpu, xid or -1, kind) -> count
    sample_duration_s: float = 0.0
    loop_lag_s: float = 0.0
    read_only: bool = False
    children: tuple[ServingView, ...] = ()  # the supervised children, the serving engine first
    stats: ServingStats | None = None  # the engine's own counters
    sequence: int = 0  # polls published so far
    published_at: float = 0.0  # monotonic seconds when this snapshot was published
    loop_lag: LagWindow | None = None
    tokens_per_joule: float | None = None  # the engine's generated tokens over its GPUs' energy (EnergyWindow)
    rows: tuple[Row, ...] = GPU_ROWS  # the metric rows of the signals it was read with, for /metrics
    budget: dict | None = None  # tuning.power_budget_w's split (tune/budget.PowerBudget.view); None: no budget
    idle_saved: tuple[tuple[int, float, str], ...] = ()  # (gpu, watts, source) while the engine rests (RestSavings)
    idle_saved_joules: float = 0.0  # what its rests saved since the daemon started

    @property
    def serving(self) -> ServingView | None:
        """The serving engine's view (None when serving is off)."""
        return self.children[0] if self.children else None

    def firing(self) -> list[AlertView]:
        return [a for a in self.alerts if a.firing]

    @property
    def host_health(self) -> Verdict:
        """The worst of the GPUs' verdicts."""
        return health.host(v.health for v in self.gpus if v.health is not None)

    def summary_line(self, numbers: bool = True) -> str:
        """One line for /status's "status", e.g. `2 GPUs · locked 3090 MHz · GPU0 power_capped (-16%)`.
        Without numbers, the state alone (`... · GPU0 power_capped`, tok/s left out), for systemd's STATUS=:
        it changes when the state does, not with every poll's reading."""
        n = len(self.gpus)
        parts = [f"{n} GPU" + ("s" if n != 1 else "")]
        locks = sorted({v.sm_lock[1] for v in self.gpus if v.sm_lock})
        if self.read_only:
            parts.append("read-only")
        elif locks:
            parts.append(f"locked {locks[0]} MHz" if len(locks) == 1 else f"locked {locks[0]}-{locks[-1]} MHz")
        else:
            parts.append("clocks not locked")
        if activity := self._activity_part(numbers):
            parts.append(activity)
        # What must happen comes before what fires: "GPU1 unhealthy: reboot" says more than its four alerts.
        parts += [f"GPU{v.sample.index} {v.health.state}: {v.health.action_text}" for v in self.gpus
                  if v.health is not None and v.health.state != health.HEALTHY]
        firing = sorted(self.firing(), key=lambda a: (a.severity != CRITICAL, a.gpu is not None, a.gpu or 0, a.alert))
        shown = [(f"GPU{a.gpu} " if a.gpu is not None else "") + a.alert
                 + (f" ({a.short})" if a.short and numbers else "") for a in firing[:3]]
        if len(firing) > 3:
            shown.append(f"+{len(firing) - 3} more")
        parts.append(", ".join(shown) if shown else "ok")
        if self.serving is not None:
            parts.append(self._serving_part(numbers))
        return " · ".join(parts)

    def _activity_part(self, numbers: bool) -> str:
        """GPM's SM, tensor and DRAM activity, the mean over the GPUs that report it, e.g. `SM 45%, tensor 30%,
        DRAM 61%`; "" where none does. Without numbers (systemd's STATUS=) to the nearest 10%: the line moves when
        the work does, not with each counters read's noise."""
        shown = []
        for name, field in GPM_SHOWN.items():
            values = [v for g in self.gpus if g.sample.up and (v := getattr(g.sample, field)) is not None]
            if values:
                mean = 100 * sum(values) / len(values)
                shown.append(f"{name} {mean if numbers else round(mean, -1):.0f}%")
        return ", ".join(shown)

    def _serving_part(self, numbers: bool) -> str:
        s = self.serving
        model = s.model.rstrip("/").rsplit("/", 1)[-1]
        if s.state == "RESTING":  # serve.idle: a choice, said as one
            wake = f"; its last wake took {s.wake_s:.0f} s" if s.wake_s is not None else ""
            return f"{s.title} at rest ({model}, {s.profile}): the next request wakes it{wake}{self._saving(numbers)}"
        if s.clocks_rest:  # serve.idle's clocks: the engine runs, its GPUs' clocks at rest
            return (f"{s.title} at rest ({model}, {s.profile}): its GPUs at their lowest clock until the next "
                    f"request{self._saving(numbers)}")
        if s.state != "RUNNING":
            return f"{s.title} {s.state} ({model}, {s.profile})" + (f": {s.problem}" if s.problem else "")
        rate = self.stats.generation_tokens_per_s if self.stats and numbers else None
        since = ""
        if s.started_at is not None:  # a clock time, not an age: the line changes when the engine does
            fmt = "%H:%M" if time.time() - s.started_at < 86400 else "%b %d %H:%M"
            since = f", up since {time.strftime(fmt, time.localtime(s.started_at))}"
        per_joule = f", {self.tokens_per_joule:.3g} tok/J" if self.tokens_per_joule is not None and numbers else ""
        return f"{model} ({s.profile}) " + (f"{rate:.0f} tok/s{per_joule}" if rate is not None else "serving") + since

    def _saving(self, numbers: bool) -> str:
        """e.g. "; saving 39 W (seen awake)": the rest's watts, on `gpuwarden status`, not in STATUS=."""
        if not numbers or not self.idle_saved:
            return ""
        sources = sorted({source for _, _, source in self.idle_saved})
        where = "seen awake" if sources == ["seen"] else "estimated from an H200" if sources == ["h200"] else \
            "seen awake and estimated"
        return f"; saving {sum(w for _, w, _ in self.idle_saved):.0f} W ({where})"

    def as_dict(self) -> dict:
        return {
            "taken_at": self.taken_at,
            "read_only": self.read_only,
            "status": self.summary_line(),
            "gpus": [{**v.sample.as_dict(), "sm_lock_mhz": list(v.sm_lock) if v.sm_lock else None,
                      "memory_lock_mhz": list(v.memory_lock) if v.memory_lock else None,
                      "health": v.health.as_dict() if v.health else None} for v in self.gpus],
            "health": self.host_health.as_dict(),
            "alerts_firing": [a.as_dict() for a in self.firing()],
            "tuning_reapplies": {str(k): v for k, v in self.reapplies.items()},
            "sample_duration_seconds": self.sample_duration_s,
            "loop_lag_seconds": self.loop_lag_s,
            "sequence": self.sequence,
            "loop_lag": self.loop_lag.as_dict() if self.loop_lag else None,
            "serving": dataclasses.asdict(self.serving) if self.serving else None,
            "children": [dataclasses.asdict(c) for c in self.children],
            "serving_stats": dataclasses.asdict(self.stats) if self.stats else None,
            "tokens_per_joule": self.tokens_per_joule,
            "idle_saved": [{"gpu": gpu, "watts": watts, "source": source} for gpu, watts, source in self.idle_saved],
            "idle_saved_joules": self.idle_saved_joules,
            "vllm": dataclasses.asdict(self.stats) if self.stats else None,  # the older name of serving_stats
            # tuning.power_budget_w's split (tune/budget.PowerBudget.view, GPU indices as strings); None: no budget
            "power_budget": {**self.budget, "alloc": {str(i): w for i, w in self.budget["alloc"].items()}}
            if self.budget is not None else None,
        }


@dataclass(frozen=True)
class LagWindow:
    """How late the last polls started against their schedule: the loop's health in three numbers."""

    polls: int
    p50_s: float
    p99_s: float
    max_s: float

    @classmethod
    def of(cls, lags: list[float]) -> LagWindow:
        ordered = sorted(lags)
        pick = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))]  # noqa: E731
        return cls(len(ordered), pick(0.5), pick(0.99), ordered[-1])

    def as_dict(self) -> dict:
        return {"polls": self.polls, "p50_seconds": self.p50_s, "p99_seconds": self.p99_s, "max_seconds": self.max_s}


LAG_WINDOW = 300  # polls
# A GPU whose health changed FLAP_CHANGES times within FLAP_S (lost and back every poll) gets at most one change
# line per FLAP_S, which counts the changes not said: a flapping card must not flood the journal.
FLAP_CHANGES, FLAP_S = 6, 60.0


class Monitor:
    """One poll of the GPUs: sample each, keep each signal's window, evaluate the rules and the health verdicts,
    record the events the event thread queued, and publish the Snapshot everything else reads. It owns the alert
    states, the windows, the events' book and the latest snapshot; it never changes a GPU setting (it tells the
    tuning's life what it sees) and never touches a child."""

    def __init__(self, config: Config, backend: GpuBackend, tuning: TuningLife,
                 wall: Callable[[], float] = time.time, signals: Iterable[ModuleType] = SIGNALS,
                 reboots: Callable[[str, str], int] = health.no_reboots):
        self.config = config
        self.backend = backend
        self.tuning = tuning  # it tunes; the monitor reads its locks and tells it what it sees
        self.wall = wall
        signals = tuple(signals)  # watch/signals/: their rules, their rows, and one of each of their windows
        self.rules, self.rows = rules_of(signals), rows_of(signals)
        self.windows = {kind: kind() for kind in windows_of(signals)}
        self.states = {(rule.name, gpu.index): AlertState(rule, gpu.index, gpu.uuid)
                       for gpu in backend.gpus() for rule in self.rules}
        self.serving_states = {rule.name: AlertState(rule, None, "") for rule in SERVING_RULES}
        self.budget_states = {rule.name: AlertState(rule, None, "") for rule in BUDGET_RULES}  # host-wide too
        self.transitions: Counter = Counter()
        self._last_sample_log = float("-inf")
        self.running_requests: int | None = None  # fed from the engine's metrics; counts as busy
        self.snapshot: Snapshot | None = None
        self._lags: deque[float] = deque(maxlen=LAG_WINDOW)
        self.events = EventBook(config.alerts.repeat_s)
        self._last_tick: float | None = None
        self.polls = 0  # polls taken; the counters are read on every counters_every()-th, for all GPUs at once
        self.energy = EnergyWindow()  # the serving engine's tokens per joule
        self.savings = RestSavings()  # serve.idle's watts saved while the engine rests
        self.reboots = reboots  # (uuid, fault) -> reboots recorded for it (watch/health_record.py): escalation
        self.verdicts: dict[int, Verdict] = {}  # gpu -> its last verdict, to log each change once
        self._reboots_failed = False  # the reboot record failed once: said once
        self._changes: dict[int, deque[float]] = {}  # gpu -> when its last FLAP_CHANGES health changes came
        self._flap_said: dict[int, tuple[float, int]] = {}  # gpu -> (its last change line while flapping, unsaid)

    def counters_every(self) -> int:
        """Read the slow counters every this many polls: counters_interval_s on the poll schedule. (Each GPU
        timing its own reads drifted with jitter: 10 or 11 polls apart, and on different polls per GPU.)"""
        return max(1, round(self.config.counters_interval_s / self.config.poll_interval_s))

    def reconfigure(self, config: Config) -> None:
        """A reloaded config: its alert settings from the next poll on (the events' repeat too)."""
        self.config = config
        self.events.repeat_every(config.alerts.repeat_s)

    def gpus_were_reset(self) -> None:
        """The operator says the GPUs were reset (a reload): none counts as waiting for a reset any more."""
        self.events.all_reset()

    def report_running_requests(self, count: int | None) -> None:
        self.running_requests = count

    def _context(self, sample: GpuSample, poll: Poll) -> GpuContext:
        settings = self.config.alerts
        sm_lock, mem_lock = self.tuning.locks.get(sample.index, (None, None))
        busy = is_busy(sample, settings.busy_utilization_pct, self.running_requests)
        # Read-only mode sets nothing, so "configured on" is only a wish there, not drift. While
        # nvidia-persistenced runs, the plan leaves persistence mode to it (some distributions run it with
        # --no-persistence-mode, and that is their choice), so off is not drift either.
        wanted = (self.config.tuning.apply and not self.tuning.persistenced
                  and self.config.tuning.for_gpu(sample.index, sample.uuid).persistence_mode)
        windows = {kind: window.read(sample, poll) for kind, window in self.windows.items()}
        ctx = GpuContext(busy, sm_lock, mem_lock, wanted, settings,
                         self.tuning.chosen_power_limit(sample.index, sample.uuid), windows)
        inputs = health.Inputs(poll.events.needs_reset.get(sample.index), poll.events.pending.get(sample.index),
                               tuple(poll.events.recent_xids(sample.index, poll.now)), busy,
                               ctx.window(LinkErrors).seen_up)
        return dataclasses.replace(ctx, health=health.judge(sample, inputs, self.config.health.reboots_before_inspect,
                                                           self._reboots))

    def record_events(self, events: list, now: float) -> list[tuple[int, str]]:
        """Log and count GPU events (eventwatch.EventBook); return (gpu, why) for those that ask for a reset
        or a reboot (gpu -1: a GPU that could not be named)."""
        if not events:  # the usual poll: nothing to look up
            return []
        gpus = {g.index: g for g in self.backend.gpus()}

        def processes(index: int) -> str:
            gpu = gpus.get(index)
            return processes_on([pid for pid, _ in gpu.compute_processes()]) if gpu is not None else "unknown"

        holds = []
        for event in events:
            why = self.events.record(event, now, processes)
            if why is not None:
                holds.append((event.gpu, why))
        return holds

    def tick(self, now: float, loop_lag_s: float = 0.0, serving: tuple[ServingView, ...] | None = None,
             stats: ServingStats | None = None, published_at: float | None = None) -> Snapshot:
        """Sample, evaluate, and publish one complete snapshot (web/ reads it any time)."""
        # After a stall (SIGSTOP, a frozen host) one reading cannot show that a condition held for for_s:
        # pending and clearing timers start again from this reading.
        stalled = self._last_tick is not None and now - self._last_tick > STALL_POLLS * self.config.poll_interval_s
        self._last_tick = now
        self._lags.append(loop_lag_s)
        started = time.perf_counter()
        counters = self.polls % self.counters_every() == 0
        self.polls += 1
        samples = [gpu.sample(counters) for gpu in self.backend.gpus()]
        contexts = {}  # gpu -> what its rules read, for the snapshot
        duration = time.perf_counter() - started
        if now - self._last_sample_log >= self.config.log_interval_s:
            self._last_sample_log = now
            log.info("%s", " | ".join(describe_sample(s) for s in samples))
        poll = Poll(now, counters, max(DUTY_WINDOW_S, 3 * self.config.counters_interval_s), self.events)
        for sample in samples:
            if self.tuning.gpu_answered(sample):  # back after being lost: reset or reloaded
                self.events.cleared(sample.index)
            elif sample.up and self.events.reset_unseen(sample.index, sample.health.recovery_action):
                log.log(NOTICE, "GPU%d: its driver's recovery action reads none again: it was reset between two polls; "
                        "it no longer waits", sample.index)
                self.events.cleared(sample.index)
            ctx = contexts[sample.index] = self._context(sample, poll)
            self._health_changed(ctx.health, now)
            for rule in self.rules:
                if rule.swept and sample.index in self.tuning.held:
                    continue  # a sweep (gpuwarden tune) set this clock or power limit: not a fault to act on
                state = self.states[(rule.name, sample.index)]
                event = state.step(rule.check(sample, ctx), now, self.config.alerts, restart_timers=stalled)
                if event:
                    self._log_event(event, state, sample, now)
            self.tuning.drifted(sample, [rule.name for rule in self.rules if rule.reapply
                                         and self.states[(rule.name, sample.index)].phase == FIRING], now)
        self.tuning.budget_tick(samples, now)  # the power budget's split follows the demand just read
        engine = serving[0] if serving else None  # the serving rules are about the engine
        for state in self.serving_states.values():
            check = state.rule.check(engine, samples)
            if state.rule.any_child and not check.active:
                check = next((c for view in (serving or ())[1:] if (c := state.rule.check(view, samples)).active),
                             check)
            event = state.step(check, now, self.config.alerts, restart_timers=stalled)
            if event:
                self._log_event(event, state, None, now)
        host_alerts = [_view(state) for state in self.serving_states.values()] if serving else []
        budget = self.tuning.budget.view() if self.tuning.budget is not None else None
        for state in self.budget_states.values():  # evaluated without a budget too: a reload that drops it resolves
            event = state.step(state.rule.check(budget, samples), now, self.config.alerts, restart_timers=stalled)
            if event:
                self._log_event(event, state, None, now)
        host_alerts += [_view(state) for state in self.budget_states.values() if budget is not None or state.firing]
        self.snapshot = Snapshot(
            taken_at=self.wall(), monotonic=now,
            gpus=tuple(GpuView(s, *self.tuning.locks.get(s.index, (None, None)), contexts[s.index].power_limit_chosen,
                               contexts[s.index].windows, contexts[s.index].health) for s in samples),
            alerts=tuple([_view(state) for state in self.states.values()] + host_alerts),
            transitions=dict(self.transitions), reapplies=dict(self.tuning.reapplies), event_counts=dict(self.events.counts),
            sample_duration_s=duration, loop_lag_s=loop_lag_s, read_only=not self.config.tuning.apply,
            children=tuple(serving or ()), stats=stats, sequence=(self.snapshot.sequence + 1) if self.snapshot else 1,
            published_at=time.monotonic() if published_at is None else published_at,
            loop_lag=LagWindow.of(list(self._lags)),
            tokens_per_joule=self._efficiency(engine, stats, samples, counters, now), rows=self.rows,
            budget=budget, idle_saved=self.savings.add(engine, stats, samples, now),
            idle_saved_joules=self.savings.joules)
        return self.snapshot

    def unhealthy(self) -> list[tuple[int, str]]:
        """(gpu index, its action and reasons as one text) of each GPU that must not serve, as of the last poll:
        what the daemon asks before it starts or keeps an engine on a GPU."""
        gpus = self.snapshot.gpus if self.snapshot else ()
        return [(v.sample.index, v.health.text()) for v in gpus
                if v.health is not None and v.health.state == health.UNHEALTHY]

    def _reboots(self, uuid: str, fault: str) -> int:
        """The reboot count, or 0 where its record cannot say (a corrupt state file): the poll goes on, said once."""
        try:
            return int(self.reboots(uuid, fault))
        except Exception as exc:  # the record's fault stays in its room: no GPU goes unwatched for it
            if not self._reboots_failed:
                self._reboots_failed = True
                log.error("health: the reboot count for %s %s cannot be read (%s: %s); counted as 0", uuid, fault,
                          type(exc).__name__, exc)
            return 0

    def _health_changed(self, verdict: Verdict, now: float = 0.0) -> None:
        """One journal line when a GPU's state or action changes, saying the action: WARNING degraded, CRITICAL
        unhealthy, NOTICE back to healthy. A GPU healthy from the start says nothing; one that flaps (FLAP_S)
        one line a FLAP_S."""
        was = self.verdicts.get(verdict.gpu, Verdict(verdict.gpu))
        self.verdicts[verdict.gpu] = verdict
        if (was.state, was.action) == (verdict.state, verdict.action):
            return
        who = f"GPU{verdict.gpu} {verdict.uuid} health"
        changes = self._changes.setdefault(verdict.gpu, deque(maxlen=FLAP_CHANGES))
        changes.append(now)
        if len(changes) == FLAP_CHANGES and now - changes[0] < FLAP_S:
            said, unsaid = self._flap_said.get(verdict.gpu, (-FLAP_S, 0))
            if now - said < FLAP_S:
                self._flap_said[verdict.gpu] = (said, unsaid + 1)
                return
            self._flap_said[verdict.gpu] = (now, 0)
            who += f" (flapping: {FLAP_CHANGES} changes within {now - changes[0]:.0f} s, {unsaid} not logged)"
        if verdict.state == health.HEALTHY:
            log.log(NOTICE, "%s: healthy again (was %s: %s)", who, was.state, was.action_text)
            return
        level = logging.CRITICAL if verdict.state == health.UNHEALTHY else logging.WARNING
        log.log(level, "%s: %s; action: %s; reasons: %s", who, verdict.state, verdict.action_text,
                "; ".join(verdict.reasons))

    def _efficiency(self, engine, stats, samples, counters: bool, now: float) -> float | None:
        """Tokens per joule over the last EnergyWindow.WINDOW_S, from the polls that read the energy counters (the
        tokens counted at the same poll): the engine's GPUs, or all of them where its spec names none."""
        if engine is None or stats is None or stats.generation_tokens_total is None:
            self.energy = EnergyWindow()
            return None
        if counters:
            gpus = set(engine.gpus) or {s.index for s in samples}
            energy = [s.energy_joules for s in samples if s.index in gpus]
            if energy and None not in energy:
                self.energy.add(now, stats.generation_tokens_total, sum(energy))
        return self.energy.tokens_per_joule()

    def _log_event(self, event: str, state: AlertState, sample: GpuSample | None, now: float) -> None:
        rule, check = state.rule, state.check
        who = f"GPU{state.gpu} {state.uuid} {rule.name}" if state.gpu is not None else rule.name
        if event == "resolved":
            self.transitions[(rule.name, state.gpu, "resolved")] += 1
            log.log(NOTICE, "%s resolved after %.0f s (worst: %s)", who, now - state.fired_at,
                    state.worst.observed or check.observed)
            return
        if event == "firing":
            self.transitions[(rule.name, state.gpu, "firing")] += 1
        level = {CRITICAL: logging.CRITICAL, WARNING: logging.WARNING}.get(rule.severity, NOTICE)
        what = "firing" if event == "firing" else f"still firing after {now - state.fired_at:.0f} s"
        fix = check.fix or rule.hint
        if sample is None:  # host-wide: no clock-event reasons to show
            log.log(level, "%s %s: %s; fix: %s", who, what, check.observed, fix)
            return
        reasons = ",".join(sample.clock_event_reasons.names()) if sample.clock_event_reasons else "none"
        log.log(level, "%s %s: %s %s; reasons: %s; fix: %s", who, what, check.observed, check.threshold,
                reasons, fix)


def _view(state: AlertState) -> AlertView:
    check = state.check
    return AlertView(state.rule.name, state.gpu, state.uuid, state.rule.severity, state.phase, state.firing,
                     check.observed, check.threshold, check.short, state.fired_at)


def describe_sample(s: GpuSample) -> str:
    """One compact, readable summary of a GPU for the log."""
    if not s.up:
        return f"GPU{s.index} DOWN ({s.error})"
    parts = [f"GPU{s.index} sm {_num(s.sm_clock_mhz)}/{_num(s.max_sm_clock_mhz)} MHz",
             f"mem {_num(s.memory_clock_mhz)} MHz"]
    power = _num(s.power_w)
    parts.append(f"{power}/{s.power_limit_w:.0f} W" if s.power_limit_w is not None else f"{power} W")
    parts.append(f"{_num(s.temperature_c)} C")
    parts.append(f"util {_num(s.utilization_pct)}%")
    if s.performance_state is not None:
        parts.append(f"P{s.performance_state}")
    reasons = s.clock_event_reasons.names() if s.clock_event_reasons else []
    if reasons:
        parts.append("[" + ",".join(reasons) + "]")
    return " ".join(parts)


def _num(value: float | None) -> str:
    return "?" if value is None else f"{value:.0f}"
