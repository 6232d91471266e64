"""The rule machinery: what a rule is and what its check says (each signal's rules live in watch/signals/),
the context a rule reads beyond the sample (each signal's window contributes its own part), and the per-GPU state
machine that debounces them.

A rule must hold for `for_s` before it fires and be false for `clear_for_s`
before it resolves (pending -> firing -> clearing -> resolved), so a value that
hovers around a threshold never flaps. Only firing, resolving and the periodic
reminder are logged; pending and a clearing that came back are silent.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from ..config import AlertSettings
from ..gpu.base import GpuSample
from .rows import COUNTER, Row

if TYPE_CHECKING:
    from .eventwatch import EventBook

INFO, WARNING, CRITICAL = "info", "warning", "critical"


@dataclass(frozen=True)
class Poll:
    """One poll as a signal's window sees it."""

    now: float
    fresh: bool  # this poll read the slow counters (counters_interval_s)
    window_s: float  # how far back a window looks (monitor.DUTY_WINDOW_S, or three counter reads when longer)
    events: EventBook  # the GPU events the event thread brought (the xid signal's window reads its book)


class Window(Protocol):
    """A signal's memory of earlier polls, declared as its WINDOW (watch/signals/): the monitor keeps one of each
    and reads it once per GPU per poll, before the rules; the rules find the reading in ctx.window(TheClass), the
    signal's rows in view.windows."""

    EMPTY: ClassVar[object]  # the reading a rule sees where none was taken (a check asked outside a poll)

    def read(self, sample: GpuSample, poll: Poll) -> object: ...


@dataclass(frozen=True)
class GpuContext:
    """What a rule needs beyond the sample: the configured state, the busy input, and what each signal's window
    read for this GPU on this poll."""

    busy: bool
    sm_lock: tuple[int, int] | None  # configured and applied locks; None if not locking
    memory_lock: tuple[int, int] | None
    persistence_wanted: bool
    settings: AlertSettings
    # The power limit gpuwarden sets on this GPU on purpose and who chose it ("chosen in tuning.power_limit_w",
    # "set by a tune sweep"): TuningLife.chosen_power_limit. None: nobody here chose the card's limit.
    power_limit_chosen: tuple[float, str] | None = None
    windows: Mapping[type, object] = field(default_factory=dict)  # each window's reading, by its class
    health: Any = None  # this poll's verdict (watch/health.Verdict), for the health signal's rules

    def window(self, kind: type[Window]) -> Any:
        """This poll's reading of a signal's window; its EMPTY one where none was read."""
        return self.windows.get(kind, kind.EMPTY)


@dataclass(frozen=True)
class Check:
    active: bool
    observed: str = ""  # e.g. "SM clock 180 MHz"
    threshold: str = ""  # e.g. "< 1545 MHz (50% of locked 3090 MHz)"
    short: str = ""  # for the STATUS line, e.g. "-16%"
    fix: str = ""  # when set, the fix for what this reading shows (else the rule's)
    value: float | None = None  # how bad (lower is worse): the resolved line quotes the worst reading


@dataclass(frozen=True)
class Rule:
    name: str
    severity: str
    hint: str
    check: Callable[[GpuSample, GpuContext], Check]
    for_s: float | None = None  # None: alerts.for_s; a rule whose condition is already a duration fires at once
    # A rule that a sweep's own settings trip (tune/sweeps.py): held as it is on the GPUs a sweep holds, and
    # evaluated again once the configured setting is back.
    swept: bool = False
    reapply: bool = False  # the daemon answers it by applying the tuning again (a lock or a mode a reset dropped)
    # A serving rule that a side child (the proxy) trips as well as the engine: evaluated on the first child that
    # meets it, the engine first (its port taken by a local user is an outage for clients as the engine's is).
    any_child: bool = False


INACTIVE = Check(False)


def pct(value: float | None) -> str:
    return "?" if value is None else f"{value:.0f}%"


INACTIVE_PHASE, PENDING, FIRING, CLEARING = "inactive", "pending", "firing", "clearing"


@dataclass
class AlertState:
    """One rule on one GPU."""

    rule: Rule
    gpu: int | None  # None: a host-wide alert (serving)
    uuid: str
    phase: str = INACTIVE_PHASE
    since: float = 0.0  # when the condition last changed (for pending / clearing)
    fired_at: float = 0.0
    last_logged: float = 0.0
    check: Check = INACTIVE
    worst: Check = INACTIVE  # the worst reading of this episode, for the resolved line

    @property
    def firing(self) -> bool:
        return self.phase in (FIRING, CLEARING)

    def step(self, check: Check, now: float, settings: AlertSettings, restart_timers: bool = False) -> str | None:
        """Advance on one evaluation; return 'firing', 'resolved', 'reminder' or None. restart_timers: the
        previous reading is too old to count, so pending and clearing start again from this one."""
        if restart_timers and self.phase in (PENDING, CLEARING):
            self.since = now
        if check.active:
            self.check = check  # the last active observation
            if self.phase == INACTIVE_PHASE or (check.value is not None and (
                    self.worst.value is None or check.value < self.worst.value)):
                self.worst = check  # a new episode starts from this reading
        if self.phase == INACTIVE_PHASE:
            if not check.active:
                return None
            self.phase, self.since = PENDING, now
        if self.phase == PENDING:
            if not check.active:
                self.phase = INACTIVE_PHASE
                return None
            if now - self.since >= (settings.for_s if self.rule.for_s is None else self.rule.for_s):
                self.phase, self.fired_at, self.last_logged = FIRING, now, now
                return "firing"
            return None
        if check.active:
            self.phase = FIRING  # a clearing that came back is still the same alert
            if now - self.last_logged >= settings.repeat_s:
                self.last_logged = now
                return "reminder"
            return None
        if self.phase == FIRING:
            self.phase, self.since = CLEARING, now
        if now - self.since >= settings.clear_for_s:
            self.phase = INACTIVE_PHASE
            return "resolved"
        return None


def _gpu_label(gpu: int | None) -> str:
    return "all" if gpu is None else str(gpu)


# Every rule's state on /metrics: host-wide ones (the engine serves across the GPUs) carry gpu="all".
ROWS = (
    Row("gpuwarden_alert_active", "1 while an alert fires", ("alert", "gpu", "severity"),
        lambda snap: [((a.alert, _gpu_label(a.gpu), a.severity), int(a.firing)) for a in snap.alerts]),
    Row("gpuwarden_alert_transitions", "Alert state changes, by new state", ("alert", "gpu", "to"),
        lambda snap: [((alert, _gpu_label(gpu), to), count) for (alert, gpu, to), count
                      in sorted(snap.transitions.items(), key=lambda item: str(item[0]))], COUNTER),
)
