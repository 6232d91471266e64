"""Alert rules over GPU samples, and the per-GPU state machine that debounces them.

A rule must hold for `for_s` before it fires and be false for `clear_for_s`
before it resolves (pending -> firing -> clearing -> resolved), so a value that
hovers around a threshold never flaps. Only firing, resolving and the periodic
reminder are logged; pending and a clearing that came back are silent.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from ..gpu import throttle
from .xids import lookup
from ..config import AlertSettings
from ..gpu.base import ClockEventReason as R
from ..gpu.base import GpuSample
from ..gpu.throttle import Threshold, headroom_w, reasons
from ..tune.tunables import power_limit_is

INFO, WARNING, CRITICAL = "info", "warning", "critical"


@dataclass(frozen=True)
class GpuContext:
    """What a rule needs beyond the sample: the configured state and busy input."""

    busy: bool
    sm_lock: tuple[int, int] | None  # configured and applied locks; None if not locking
    memory_lock: tuple[int, int] | None
    persistence_wanted: bool
    settings: AlertSettings
    # Fraction of the recent window each NVML violation counter ran (monitor.DutyCycles): how much of the
    # time a reason held the clocks down, however it flapped between two polls.
    duty: Mapping[str, float] = field(default_factory=dict)
    duty_window_s: float = 0.0
    seen: R = R.NONE  # every reason seen in a sample during that window
    xids: tuple[tuple[int, int], ...] = ()  # (xid, count) of this GPU's recent Xids (eventwatch.RECENT_S)
    reset_needed: str | None = None  # an event asked for a GPU reset or a reboot, and none happened yet
    # NVLink links seen up since the start (a link never up and with no far end is not cabled: not a fault),
    # and each link's error counters' growth over the duty window: {(link, kind): errors}, with its seconds.
    nvlinks_seen_up: frozenset[int] = frozenset()
    nvlink_growth: Mapping[tuple[int, str], int] = field(default_factory=dict)
    nvlink_growth_s: float = 0.0
    # The power limit gpuwarden sets on this GPU on purpose and who chose it ("chosen in tuning.power_limit_w",
    # "set by a tune sweep"): TuningLife.chosen_power_limit. None: nobody here chose the card's limit.
    power_limit_chosen: tuple[float, str] | None = None


HW_DUTY_MIN = 0.10  # a critical hardware reason that slows the card this much of the time fires
# NVML's board-limit violation counter measures the hardware slowdown and the power brake (its thermal
# counter also counts software thermal capping, so HW thermal slowdown keeps to its streak).
DUTY_COUNTER = {R.HwSlowdown: "board_limit", R.HwPowerBrakeSlowdown: "board_limit"}


def _duty_for(reason: R, ctx: GpuContext) -> float | None:
    """The duty cycle of reason's counter, when the counter's growth can be put down to this reason: the
    power brake when it was seen in the window; the slowdown when it was seen, or the brake was not."""
    counter = DUTY_COUNTER.get(reason)
    if counter is None or counter not in ctx.duty:
        return None
    if reason == R.HwPowerBrakeSlowdown and R.HwPowerBrakeSlowdown not in ctx.seen:
        return None
    if reason == R.HwSlowdown and R.HwSlowdown not in ctx.seen and R.HwPowerBrakeSlowdown in ctx.seen:
        return None
    return ctx.duty[counter]


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


INACTIVE = Check(False)


def _clock_low(kind: str, clock: int | None, maximum: int | None, lock: tuple[int, int] | None,
               threshold: Threshold, ctx: GpuContext, s: GpuSample) -> Check:
    verdict = throttle.judge(clock, maximum, lock, threshold, s)
    if not ctx.busy or verdict is None:
        return INACTIVE
    basis = "" if threshold.mhz is not None else f" ({threshold} of {verdict.basis} {verdict.reference} MHz)"
    # Locking cannot raise a clock that power or heat holds down: then the fix is about those.
    fix = (f"the clock is held down by {', '.join(verdict.held.names())}, which a lock cannot override: see "
           "the power and thermal alerts for this GPU") if verdict.held else ""
    return Check(verdict.low, f"{kind} clock {clock} MHz while busy (util {_pct(s.utilization_pct)})",
                 f"< {verdict.limit:.0f} MHz{basis}", f"{clock} MHz", fix, float(clock))


def _pct(value: float | None) -> str:
    return "?" if value is None else f"{value:.0f}%"


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


def _loss(s: GpuSample, ctx: GpuContext) -> tuple[str, str, float | None]:
    """(observed text, short text, percent) of the SM clock against the lock, else the max clock."""
    reference = ctx.sm_lock[1] if ctx.sm_lock else s.max_sm_clock_mhz
    if not reference or s.sm_clock_mhz is None:
        return "", "", None
    loss = (s.sm_clock_mhz - reference) / reference * 100
    basis = "locked" if ctx.sm_lock else "max"
    return f"SM clock {s.sm_clock_mhz} MHz, {loss:+.0f}% of {basis} {reference} MHz", f"{loss:+.0f}%", loss


def _power_check(s: GpuSample, ctx: GpuContext, at_max: bool) -> Check:
    """SwPowerCap while busy, at the maximum limit (at_max) or below it."""
    if not ctx.busy or R.SwPowerCap not in reasons(s):
        return INACTIVE
    headroom = headroom_w(s)
    is_max = throttle.at_max_power_limit(s)
    warn_anyway = ctx.settings.warn_at_design_power
    if not ((is_max and not warn_anyway) if at_max else (not is_max or warn_anyway)):
        return INACTIVE
    observed, short, loss = _loss(s, ctx)
    draw = f"{s.power_w:.0f} W" if s.power_w is not None else "? W"
    limit = f"{s.power_limit_w:.0f} W" if s.power_limit_w is not None else "the limit"
    if is_max:
        return Check(True, f"{observed}; drawing {draw}", f"at its maximum power limit {limit} (SwPowerCap)", short,
                     "nothing to change: this is the card's design power, and no higher limit is allowed", loss)
    chosen = ctx.power_limit_chosen
    if chosen is not None and power_limit_is(s.power_limit_w, chosen[0]):
        # A choice, not a fault: still said (one line names the cause of the clock loss), never undone.
        return Check(True, f"{observed}; drawing {draw}", f"at the power limit {chosen[1]}, {limit} (SwPowerCap)",
                     short, "nothing to fix: the limit was chosen, and the clock loss shown is its price", loss)
    fix = (f"raise tuning.power_limit_w by up to {headroom:g} W, to {s.power_limit_max_w:g} W (the card's maximum), "
           "or accept the clock loss") if headroom is not None else ""
    return Check(True, f"{observed}; drawing {draw}", f"at power limit {limit} (SwPowerCap)", short, fix, loss)


def power_capped(s: GpuSample, ctx: GpuContext) -> Check:
    return _power_check(s, ctx, at_max=False)


def at_design_power(s: GpuSample, ctx: GpuContext) -> Check:
    return _power_check(s, ctx, at_max=True)



def _reason_rule(reason: R) -> Callable[[GpuSample, GpuContext], Check]:
    def check(s: GpuSample, ctx: GpuContext) -> Check:
        duty = _duty_for(reason, ctx)
        # A hardware reason that toggles faster than for_s never holds for a whole streak; its violation
        # counter still says how much of the time it slowed the card.
        flapping = duty is not None and duty >= HW_DUTY_MIN
        if reason not in reasons(s) and not flapping:
            return INACTIVE
        observed, short, _ = _loss(s, ctx)
        temp = f", {s.temperature_c:.0f} C" if s.temperature_c is not None else ""
        if flapping:
            observed = (f"{reason.name} held the clocks down {duty * 100:.0f}% of the last "
                        f"{ctx.duty_window_s:.0f} s (violation counter {DUTY_COUNTER[reason]})"
                        + (f"; {observed}" if observed and reason in reasons(s) else ""))
            short = f"{duty * 100:.0f}% of the time"
        return Check(True, observed + temp, f"{reason.name} active, or >= {HW_DUTY_MIN * 100:.0f}% of the time",
                     short, value=-duty if duty is not None else None)
    return check


def pcie_link_degraded(s: GpuSample, ctx: GpuContext) -> Check:
    """Idle links train down on purpose (power saving): only a busy GPU's link counts."""
    h = s.health
    if not ctx.busy or not h.link_degraded:
        return INACTIVE
    replays = "" if h.pcie_replays is None else f", {h.pcie_replays} replay" + ("" if h.pcie_replays == 1 else "s")
    return Check(True, f"PCIe link {h.link()} while busy (util {_pct(s.utilization_pct)}){replays}",
                 "the link's full generation and width", f"Gen{h.pcie_generation} x{h.pcie_width}")


def nvlink_degraded(s: GpuSample, ctx: GpuContext) -> Check:
    """A link that was up (or knows its far end) is down, or runs slower than the GPU's fastest link."""
    h = s.health
    problems = h.nvlink_problems(ctx.nvlinks_seen_up)
    if not problems:
        return INACTIVE
    up = sum(n.state in ("up", "sleep") for n in h.nvlinks)
    return Check(True, f"NVLink {'; '.join(problems)}; {up} of {len(h.nvlinks)} links up",
                 "every link up at the GPU's full speed", f"{up}/{len(h.nvlinks)} links", value=float(up))


NVLINK_CRC_PER_S = 100.0  # DCGM: "RM has informed us that CRC errors only matter at rates of 100+ per second"


def nvlink_errors(s: GpuSample, ctx: GpuContext) -> Check:
    """Replays or recoveries since the window began (any: DCGM's health check fails on one), or CRC errors
    at 100/s or more."""
    grew = ctx.nvlink_growth
    seconds = max(ctx.nvlink_growth_s, 1e-9)
    bad = {key: n for key, n in grew.items() if n and (key[1] != "crc" or n / seconds >= NVLINK_CRC_PER_S)}
    if not bad:
        return INACTIVE
    text = ", ".join(f"link {link} {kind} +{n}" + (f" ({n / seconds:.0f}/s)" if kind == "crc" else "")
                     for (link, kind), n in sorted(bad.items()))
    total = sum(bad.values())
    return Check(True, f"NVLink errors in the last {ctx.nvlink_growth_s:.0f} s: {text}",
                 f"no replay or recovery; CRC below {NVLINK_CRC_PER_S:.0f}/s", f"+{total} errors",
                 value=-float(total))


def fabric_not_ready(s: GpuSample, ctx: GpuContext) -> Check:
    h = s.health
    if h.fabric_ready is not False:
        return INACTIVE
    what = f"completed with {h.fabric_error}" if h.fabric_error else h.fabric.replace("_", " ")
    return Check(True, f"NVSwitch fabric registration {what}: no NVLink peers for tensor parallelism",
                 "fabric completed, status success", "fabric " + (h.fabric_error or h.fabric))


def ecc_uncorrected(s: GpuSample, ctx: GpuContext) -> Check:
    count = s.health.ecc_uncorrected
    return Check(bool(count), f"{count} uncorrected ECC error(s) since the driver loaded", "0", f"{count} ECC")


def row_remap_pending(s: GpuSample, ctx: GpuContext) -> Check:
    h = s.health
    pending = bool(h.remap_pending) or bool(h.retire_pending)
    what = "a remapped memory row" if h.remap_pending else "a retired memory page"
    return Check(pending, f"{what} waits for a GPU reset", "none pending", "reset pending")


def row_remap_failure(s: GpuSample, ctx: GpuContext) -> Check:
    return Check(bool(s.health.remap_failure), "a memory row could not be remapped", "no remap failure",
                 "remap failed")


def gpu_xid(s: GpuSample, ctx: GpuContext) -> Check:
    if not ctx.xids:
        return INACTIVE
    seen = ", ".join(f"Xid {x} ({lookup(x).meaning}) x{n}" for x, n in ctx.xids)
    return Check(True, f"{seen} in the last 5 minutes", "no Xid", f"Xid {ctx.xids[0][0]}")


def gpu_needs_reset(s: GpuSample, ctx: GpuContext) -> Check:
    return Check(ctx.reset_needed is not None, ctx.reset_needed or "", "no reset or reboot pending", "needs reset")


def persistence_off(s: GpuSample, ctx: GpuContext) -> Check:
    return Check(ctx.persistence_wanted and s.persistence_mode is False, "persistence mode off",
                 "configured on", "off")


def gpu_lost(s: GpuSample, ctx: GpuContext) -> Check:
    return Check(not s.up, f"GPU unreadable: {s.error}", "NVML must answer", "lost")


RULES: tuple[Rule, ...] = (
    Rule("sm_clock_low", WARNING, "lock the clocks (tuning.gpu_clocks: max) and check `gpuwarden plan`",
         sm_clock_low),
    Rule("memory_clock_low", WARNING, "lock the GPU clocks or tuning.memory_clocks: max", memory_clock_low),
    Rule("clock_lock_lost", WARNING, "a driver reload or GPU reset dropped the lock; gpuwarden re-applies it",
         clock_lock_lost),
    Rule("power_capped", WARNING, "the card is at its power limit; raise tuning.power_limit_w within the "
         "constraints (`gpuwarden plan` shows them), or accept the clock loss", power_capped),
    Rule("at_design_power", INFO, "nothing to change: this is the card's design power", at_design_power),
    Rule("thermal_slowdown", WARNING, "improve cooling or airflow", _reason_rule(R.SwThermalSlowdown)),
    Rule("hw_thermal_slowdown", CRITICAL, "the GPU is overheating: check fans and airflow now",
         _reason_rule(R.HwThermalSlowdown)),
    Rule("hw_slowdown", CRITICAL, "check the power supply and cabling (HW slowdown asserted)",
         _reason_rule(R.HwSlowdown)),
    Rule("power_brake", CRITICAL, "the system asserted the power brake: check the PSU and its load",
         _reason_rule(R.HwPowerBrakeSlowdown)),
    Rule("persistence_off", WARNING, "a driver reload turned it off; gpuwarden re-applies it through NVML's "
         "deprecated setter: `systemctl enable --now nvidia-persistenced` keeps it on the supported way",
         persistence_off),
    Rule("gpu_lost", CRITICAL, "check `dmesg` for Xid errors; the GPU may need a reset or a reboot", gpu_lost),
    Rule("gpu_xid", WARNING, "the journal line names the Xid, its meaning and the processes on the GPU; an "
         "application fault (13, 31, 43) restarts only what died", gpu_xid, for_s=0.0),
    Rule("gpu_needs_reset", CRITICAL, "drain the GPU, then reset it (nvidia-smi -r) or reboot as the line says; "
         "then `systemctl reload gpuwarden` starts the engine again", gpu_needs_reset, for_s=0.0),
    Rule("pcie_link_degraded", WARNING, "reseat the card, check the riser and cable, and the slot's PCIe setting "
         "in the BIOS; a link below its generation or width slows loading and tensor parallelism",
         pcie_link_degraded),
    Rule("nvlink_degraded", WARNING, "look for Xid 74 in `dmesg` and at `nvidia-smi nvlink -s`; drain the GPU "
         "and reset it (or reboot): a link that stays down after that needs the vendor (the board or its NVLink "
         "connectors); meanwhile tensor parallelism runs on the links that are left", nvlink_degraded),
    Rule("nvlink_errors", WARNING, "`nvidia-smi nvlink -e` shows the counters per link; replays and recoveries "
         "mean the link retrains: drain and reset the GPU, and if they go on, have the board serviced",
         nvlink_errors, for_s=0.0),
    Rule("fabric_not_ready", CRITICAL, "start the fabric manager (`systemctl enable --now nvidia-fabricmanager`, "
         "its version the driver's) and read its log; `nvidia-smi -q` shows the GPU's Fabric State and Status",
         fabric_not_ready, for_s=60.0),
    Rule("ecc_uncorrected", CRITICAL, "drain the GPU and reset it (or reboot); if it recurs, the card needs "
         "replacing", ecc_uncorrected),
    Rule("row_remap_pending", WARNING, "drain the GPU and reset it (or reboot): the remap takes effect then",
         row_remap_pending),
    Rule("row_remap_failure", CRITICAL, "the card needs replacing: a memory row could not be remapped",
         row_remap_failure),
)


# Host-wide serving alerts: evaluated on the supervisor's view, debounced, logged and counted like the rest.
# The names keep "vllm" (they are public: alert rules and dashboards use them); they fire for any engine.
def vllm_fatal(view, _ctx=None) -> Check:
    return Check(view is not None and view.state == "FATAL", f"{view.title} FATAL: {view.problem}" if view else "",
                 f"{view.title if view else 'the engine'} must be running", "FATAL")


def vllm_stalled(view, samples=()) -> Check:
    """The engine makes no progress (serving/watch/stall.py), with what its GPUs did in those seconds."""
    if view is None or not view.stalled:
        return INACTIVE
    mine = [s for s in samples if s.up and (not view.gpus or s.index in view.gpus)]
    picture = "; ".join(_gpu_picture(s) for s in mine)
    return Check(True, f"{view.title} stalled: {view.stalled}" + (f"; {picture}" if picture else ""),
                 "tokens must be counted while requests run", "stalled")


SPINNING_UTIL_PCT, SPINNING_POWER_FRACTION, IDLE_UTIL_PCT = 90, 0.3, 10


def _gpu_picture(s: GpuSample) -> str:
    """e.g. "GPU0 util 98% at 21 W of 300 W: a kernel is spinning"."""
    util, power, limit = s.utilization_pct, s.power_w, s.power_limit_w
    text = f"GPU{s.index} util {_pct(util)}" + (f" at {power:.0f} W" if power is not None else "") + \
        (f" of {limit:.0f} W" if limit is not None else "")
    if util is not None and power is not None and limit and util >= SPINNING_UTIL_PCT \
            and power < SPINNING_POWER_FRACTION * limit:
        return text + ": a kernel is spinning (busy at low power)"
    if util is not None and util < IDLE_UTIL_PCT:
        return text + ": the GPU is idle, so the engine waits on something else (the host, a lock, NCCL)"
    return text


def vllm_start_blocked(view, _ctx=None) -> Check:
    # A node of a multi-node engine waiting for its head ("waiting for rank 0", "waiting for the Ray head") is
    # not blocked by anything here that a person could free: ServingNodeDown names the node that is missing.
    waiting = view is not None and (view.problem or "").startswith("waiting for ")
    return Check(view is not None and view.blocked and not waiting,
                 f"{view.title} start waits: {view.problem}" if view else "",
                 "the GPUs and the port must be free", "waiting")


SERVING_RULES: tuple[Rule, ...] = (
    Rule("vllm_stalled", CRITICAL, "serve.restart_on_stall restarts it (group kill, backoff); if it recurs, look "
         "for the engine's last lines, its known-bad versions (`gpuwarden doctor`) and Xid errors in `dmesg`",
         vllm_stalled, for_s=0.0),
    Rule("vllm_fatal", CRITICAL, "fix the cause in the engine's error lines above, then `systemctl reload gpuwarden` "
         "to try again", vllm_fatal),
    Rule("vllm_start_blocked", WARNING, "stop the process named here or free the memory or port; the engine starts "
         "as soon as they are free", vllm_start_blocked),
)
RULES_BY_NAME = {rule.name: rule for rule in RULES + SERVING_RULES}
# Rules that the daemon answers by re-applying the tuning.
REAPPLY_ON = ("clock_lock_lost", "persistence_off")

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
