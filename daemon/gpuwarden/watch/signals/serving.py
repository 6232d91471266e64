"""The serving engine, host-wide: its state, restarts and stalls, its own counters, and its tokens per joule
(EnergyWindow, the window). Rules: the engine stalled (vllm_stalled), given up (vllm_fatal) or waiting to start
(vllm_start_blocked), evaluated on the supervisor's view, debounced, logged and counted like the GPUs' rules.

The rule names keep "vllm" (they are public: alert rules and dashboards use them); they fire for any engine. The
rows are generic, with an engine label, and the same numbers under the gpuwarden_vllm_* names (no label) while
the engine is vLLM: those dashboards keep working this release."""

from __future__ import annotations

from ...gpu.base import GpuSample
from ..alerts import CRITICAL, INACTIVE, WARNING, Check, Rule, pct
from ..rows import COUNTER, Row


def vllm_fatal(view, _ctx=None) -> Check:
    return Check(view is not None and view.state == "FATAL", f"{view.title} FATAL: {view.problem}" if view else "",
                 f"{view.title if view else 'the engine'} must be running", "FATAL")


def vllm_stalled(view, samples=()) -> Check:
    """The engine makes no progress (serving/probe/stall.py), with what its GPUs did in those seconds."""
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
    text = f"GPU{s.index} util {pct(util)}" + (f" at {power:.0f} W" if power is not None else "") + \
        (f" of {limit:.0f} W" if limit is not None else "")
    if util is not None and power is not None and limit and util >= SPINNING_UTIL_PCT \
            and power < SPINNING_POWER_FRACTION * limit:
        return text + ": a kernel is spinning (busy at low power)"
    if util is not None and util < IDLE_UTIL_PCT:
        return text + ": the GPU is idle, so the engine waits on something else (the host, a lock, NCCL)"
    return text


def vllm_start_blocked(view, _ctx=None) -> Check:
    # Any child's (Rule.any_child): the proxy's port held by a local user is an outage too (attacker 17's F3: only
    # an INFO line said it, and clients' keys went to the holder). A node of a multi-node engine waiting for its head ("waiting for rank 0", "waiting for the Ray head") is
    # not blocked by anything here that a person could free: ServingNodeDown names the node that is missing.
    waiting = view is not None and (view.problem or "").startswith("waiting for ")
    return Check(view is not None and view.blocked and not waiting,
                 f"{view.title} start waits: {view.problem}" if view else "",
                 "the GPUs, the port and the engine's flags must let it start", "waiting")


RULES = (
    Rule("vllm_stalled", CRITICAL, "serve.restart_on_stall restarts it (group kill, backoff); if it recurs, look "
         "for the engine's last lines, its known-bad versions (`gpuwarden doctor`) and Xid errors in `dmesg`",
         vllm_stalled, for_s=0.0),
    Rule("vllm_fatal", CRITICAL, "fix the cause in the engine's error lines above, then `systemctl reload gpuwarden` "
         "to try again", vllm_fatal),
    Rule("vllm_start_blocked", WARNING, "do what the line says: stop the process named, free the memory or the port, "
         "or mend the file named (a key in vLLM's --config file behind the proxy); the engine starts at the next try "
         "after", vllm_start_blocked, any_child=True),
)


class EnergyWindow:
    """(time, generated tokens, joules) at each read of NVML's energy counter (nvmlDeviceGetTotalEnergyConsumption:
    mJ since the driver loaded, Volta and newer), the oldest dropped past WINDOW_S: the rate over about a minute
    is steady enough to read, and follows a change of the power limit within one."""

    WINDOW_S = 60.0

    def __init__(self) -> None:
        self.points: list[tuple[float, float, float]] = []

    def add(self, now: float, tokens: float, joules: float) -> None:
        if self.points and (tokens < self.points[-1][1] or joules < self.points[-1][2]):
            self.points = []  # the engine restarted (its counter began again) or the driver reloaded
        self.points.append((now, tokens, joules))
        while len(self.points) > 2 and now - self.points[1][0] >= self.WINDOW_S:
            self.points.pop(0)

    def tokens_per_joule(self) -> float | None:
        if len(self.points) < 2:
            return None
        (_, t0, j0), (_, t1, j1) = self.points[0], self.points[-1]
        return (t1 - t0) / (j1 - j0) if j1 > j0 else None


class RestSavings:
    """serve.idle's watts saved, per GPU of the engine while it rests (stopped, or its GPUs at their lowest clock):
    what the same poll would draw awake minus what it draws. "Awake" is this card's own draw awake with no request
    at the engine (its running and waiting counts both 0), the mean of those polls in the last WINDOW_S of them
    (source "seen"): a rest comes after serve.idle.after_s of exactly that, so it is nearly always known. Else (a
    daemon started during a rest) the context's cost measured on an H200 (design/idle-engine.md: 116.2 W with an
    idle context, 76.9 W without, at a 700 W limit), scaled by the card's power limit, and no more than the card could
    draw above its draw now within that limit (source "h200"). The first
    quiet poll after a busy one is not taken: the card's clock is still coming down; nor a card busy by its own
    reading (utilization 10 % or more), whatever the engine's counts say; nor a draw seen over STALE_S ago."""

    WINDOW_S = 60.0
    STALE_S = 3600.0  # an awake draw seen longer ago than this (a busy day since) is not today's: the estimate instead
    H200_CONTEXT_W, H200_LIMIT_W = 116.2 - 76.9, 700.0

    def __init__(self) -> None:
        self.awake: dict[int, list[tuple[float, float]]] = {}  # gpu -> (when, watts) of its quiet awake polls
        self.was_quiet = False
        self.joules = 0.0  # saved since the daemon started, summed poll by poll
        self.last: tuple[float, float] | None = None  # (when, watts saved in all) at the last resting poll

    def add(self, engine, stats, samples, now: float) -> tuple[tuple[int, float, str], ...]:
        """(gpu, watts saved, source) for each of the engine's GPUs that reads its power, while it rests; ()."""
        if engine is None:
            self.last, self.was_quiet = None, False
            return ()
        mine = [s for s in samples if s.up and s.power_w is not None and (not engine.gpus or s.index in engine.gpus)]
        if engine.state != "RESTING" and not engine.clocks_rest:
            self.last = None
            quiet = (engine.state == "RUNNING" and stats is not None and stats.requests_running == 0
                     and stats.requests_waiting == 0)
            if quiet and self.was_quiet:
                # the engine's counts are its own word: a card it keeps busy is not quiet whatever it says
                # (a card that reports none, MIG's: the counts alone)
                for s in (s for s in mine if s.utilization_pct is None or s.utilization_pct < IDLE_UTIL_PCT):
                    points = self.awake.setdefault(s.index, [])
                    points.append((now, s.power_w))
                    while now - points[0][0] > self.WINDOW_S:
                        points.pop(0)
            self.was_quiet = quiet
            return ()
        self.was_quiet = False
        saved = tuple((s.index, *self._saved(s, now)) for s in mine)
        total = sum(w for _, w, _ in saved)
        if self.last is not None:
            self.joules += (self.last[1] + total) / 2 * max(0.0, now - self.last[0])
        self.last = (now, total)
        return saved

    def _saved(self, sample, now: float) -> tuple[float, str]:
        points = [w for t, w in self.awake.get(sample.index, ()) if now - t <= self.STALE_S]
        if points:
            return max(0.0, sum(points) / len(points) - sample.power_w), "seen"
        limit = sample.power_limit_w or self.H200_LIMIT_W
        estimate = self.H200_CONTEXT_W * limit / self.H200_LIMIT_W
        if sample.power_limit_w:  # awake, the card would draw no more than its limit: a saving past that is none
            estimate = min(estimate, max(0.0, sample.power_limit_w - sample.power_w))
        return estimate, "h200"


def _serving(snap) -> bool:
    return snap.serving is not None


def _node(snap) -> bool:
    return snap.serving is not None and bool(snap.serving.role)


def _vllm(snap) -> bool:
    return snap.serving is not None and snap.serving.engine == "vllm"


def _states(snap):
    from ...serving.run.supervisor import STATES

    return [((child.engine, name), int(name == child.state)) for child in snap.children for name in STATES]


def _vllm_states(snap):
    from ...serving.run.supervisor import STATES

    return [((name,), int(name == snap.serving.state)) for name in STATES]


def _stat(field: str):
    return lambda snap: getattr(snap.stats, field) if snap.stats else None


# (name after gpuwarden_serving_ or gpuwarden_vllm_, help, value from the snapshot)
STATS = (
    ("generation_tokens_per_second", "Generated tokens per second, between two polls",
     _stat("generation_tokens_per_s")),
    ("prompt_tokens_per_second", "Prompt tokens per second, between two polls", _stat("prompt_tokens_per_s")),
    ("requests_running", "Requests the engine is running", _stat("requests_running")),
    ("requests_waiting", "Requests waiting in the engine's queue", _stat("requests_waiting")),
    ("kv_cache_usage_ratio", "Fraction of the KV cache in use", _stat("kv_cache_usage_ratio")))
EXTRAS = (
    ("last_exit_code", "Exit status of the last child (negative: signal)", lambda snap: snap.serving.last_exit_code),
    ("time_to_healthy_seconds", "Seconds from the last start to /health answering 200",
     lambda snap: snap.serving.time_to_healthy_s))
# serve.idle: new, no gpuwarden_vllm_* twin
WAKE = ("wake_seconds", "Seconds from the request that woke the resting engine (serve.idle) to /health answering 200, "
        "at its last wake (serve.idle's clocks: the daemon's put-back of its GPUs' clocks, from when it heard the "
        "request's wake)", lambda snap: snap.serving.wake_s)
EFFICIENCY = ("tokens_per_joule", "Generated tokens per joule of the engine's GPUs (NVML's energy counters), over the "
              "last minute", lambda snap: snap.tokens_per_joule)  # new: no gpuwarden_vllm_* twin


def _value_row(name: str, help: str, value, legacy: bool) -> Row:
    """The engine's figure: on the page only while it has one."""
    if legacy:
        return Row(f"gpuwarden_vllm_{name}", help, (), lambda snap: [((), value(snap))],
                   shown=lambda snap: _vllm(snap) and value(snap) is not None)
    return Row(f"gpuwarden_serving_{name}", help, ("engine",), lambda snap: [((snap.serving.engine,), value(snap))],
               shown=lambda snap: _serving(snap) and value(snap) is not None)


def _children(each):
    return lambda snap: [sample for child in snap.children for sample in each(child)]


ROWS = (
    Row("gpuwarden_serving_info", "The serving engine, model, profile and the engine's installed version (empty "
        "where unknown; value is always 1)", ("engine", "model", "profile", "version"),
        lambda snap: [((snap.serving.engine, snap.serving.model, snap.serving.profile, snap.serving.version), 1)],
        shown=_serving),
    # This node's part of a multi-node engine: who it is, and whether its part runs (a worker's needs the head to
    # answer too). The head label (its rendezvous HOST:PORT) names the engine across the nodes.
    Row("gpuwarden_serving_node_info", "This node's part of a multi-node engine: role, rank, node count, backend's "
        "head address (value is always 1)", ("role", "rank", "nodes", "head"),
        lambda snap: [((snap.serving.role, str(snap.serving.rank), str(snap.serving.nodes), snap.serving.head), 1)],
        shown=_node),
    Row("gpuwarden_serving_node_up", "1 while this node's part of the multi-node engine runs (a worker's: and the "
        "head's rendezvous answers)", ("rank", "head"),
        lambda snap: [((str(snap.serving.rank), snap.serving.head),
                       int(snap.serving.state == "RUNNING" and snap.serving.head_up is not False))], shown=_node),
    Row("gpuwarden_serving_head_reachable", "1 if the head's rendezvous port accepted a connection when last asked "
        "(workers only)", ("head",), lambda snap: [((snap.serving.head,), int(snap.serving.head_up))],
        shown=lambda snap: _node(snap) and snap.serving.head_up is not None),
    Row("gpuwarden_serving_state", "1 for each supervised child's current state", ("child", "state"), _states,
        shown=_serving),
    Row("gpuwarden_serving_restarts", "Times a supervised child was restarted", ("child",),
        _children(lambda c: [((c.engine,), c.restarts)]), COUNTER, _serving),
    Row("gpuwarden_serving_stalls", "Times the engine made no progress (vllm_stalled)", ("child",),
        _children(lambda c: [((c.engine,), c.stalls)]), COUNTER, _serving),
    Row("gpuwarden_serving_transitions", "State changes of a supervised child", ("child", "from", "to"),
        _children(lambda c: [((c.engine, old, new), n) for old, new, n in c.transitions]), COUNTER, _serving),
    Row("gpuwarden_serving_drains", "The engine's planned stops (reload, systemctl stop, a new profile, model or "
        "version) by outcome: drained (its requests in flight finished), timed_out (SIGKILL aborted what was left "
        "after serve.drain_s), aborted (no drain: drain_s 0, a version without one, or a second stop)", ("outcome",),
        lambda snap: list(((outcome,), n) for outcome, n in snap.serving.drains), COUNTER,
        lambda snap: _serving(snap) and bool(snap.serving.drains)),
    Row("gpuwarden_serving_start_time_seconds", "When the running child's process started (seconds since the "
        "epoch; time() minus it is its uptime: an upgrade of gpuwarden does not reset it)", ("child",),
        _children(lambda c: [((c.engine,), c.started_at)] if c.started_at is not None else []), shown=_serving),
    Row("gpuwarden_serving_rests", "Times the engine rested while no request came (serve.idle: stopped, or its GPUs "
        "locked at their lowest clock)", ("child",),
        _children(lambda c: [((c.engine,), c.rests)]), COUNTER, lambda snap: _serving(snap) and snap.serving.rests > 0),
    Row("gpuwarden_serving_idle_saved_watts", "Watts the engine's rest saves on each of its GPUs (serve.idle): what "
        "the card drew awake with no request minus what it draws now; source is where the awake draw comes from: "
        "seen (this card, the last minute awake with no request before the rest) or h200 (no such poll: the idle "
        "context's cost measured on an H200, 39.3 W at a 700 W limit, scaled by this card's limit)",
        ("gpu", "source"), lambda snap: [((str(gpu), source), watts) for gpu, watts, source in snap.idle_saved],
        shown=lambda snap: _serving(snap) and bool(snap.idle_saved)),
    Row("gpuwarden_serving_idle_saved_joules", "Joules the engine's rests saved on its GPUs since the daemon started "
        "(serve.idle): gpuwarden_serving_idle_saved_watts summed over the polls of each rest", (),
        lambda snap: [((), snap.idle_saved_joules)], COUNTER,
        shown=lambda snap: _serving(snap) and snap.serving.rests > 0),
    Row("gpuwarden_serving_clocks_at_rest", "1 while the engine runs with its GPUs at their lowest clock because no "
        "request came (serve.idle's clocks), else 0", ("child",),
        _children(lambda c: [((c.engine,), int(c.clocks_rest))]), shown=lambda snap: _serving(snap) and
        snap.serving.rests > 0),
    *(_value_row(name, help, value, legacy=False) for name, help, value in (*STATS, *EXTRAS, EFFICIENCY, WAKE)),
    Row("gpuwarden_vllm_info", "The served model and profile (value is always 1)", ("model", "profile"),
        lambda snap: [((snap.serving.model, snap.serving.profile), 1)], shown=_vllm),
    Row("gpuwarden_vllm_state", "1 for the vLLM child's current state", ("state",), _vllm_states, shown=_vllm),
    Row("gpuwarden_vllm_restarts", "Times the vLLM child was restarted", (),
        lambda snap: [((), snap.serving.restarts)], COUNTER, _vllm),
    *(_value_row(name, help, value, legacy=True) for name, help, value in (*EXTRAS, *STATS)),
)
