"""The GPU's health (watch/health.py: one verdict from all its inputs): its state and the action it requires, per
GPU and for the host. Rules: a GPU that must not serve (gpu_unhealthy) and one that serves but needs an action
soon (gpu_degraded); each names the action, with the runbook for it. Their alerts explain the input alerts
(gpu_xid, gpu_needs_reset, gpu_lost, ...): etc/alertmanager inhibits those where the action's alert fires."""

from __future__ import annotations

from ...gpu.base import GpuSample
from ..alerts import CRITICAL, INACTIVE, WARNING, Check, GpuContext, Rule
from ..health import ACTIONS, DEGRADED, INSPECT, REBOOT, RESET_GPU, RESTART_ENGINE, STATES, UNHEALTHY
from ..rows import Row

# What to do for each action: the daemon rules' fix, and the shipped Prometheus rules' runbook annotation
# (etc/prometheus/gpuwarden-rules.yml; a test holds them equal).
RUNBOOK = {
    RESTART_ENGINE: "stop the serving engine and start it again (`systemctl reload gpuwarden`): that drains the "
                    "GPU's peer-to-peer traffic where the driver asks for it (DRAIN_P2P) and restarts what an "
                    "application Xid killed; a fabric still registering needs `systemctl enable --now "
                    "nvidia-fabricmanager` first",
    RESET_GPU: "drain the GPU and stop what uses it, then reset it (`nvidia-smi -r -i GPU`) or reboot "
               "(health.reset_gpu lets gpuwarden reset it); once it answers, gpuwarden re-applies the tuning and "
               "starts the engine",
    REBOOT: "drain the node and reboot it: only a reboot brings this GPU back; gpuwarden counts the reboots per "
            "fault and asks for an inspection after health.reboots_before_inspect",
    INSPECT: "take the GPU out of service and have the hardware looked at: a failed row remap or fabric "
             "registration, a fault back after repeated reboots, or a link below its width (reseat the card, "
             "check the riser, the cable and the BIOS); the vendor replaces a failing card",
}


def _check(ctx: GpuContext, state: str) -> Check:
    v = ctx.health
    if v is None or v.state != state:
        return INACTIVE
    return Check(True, f"{state}: {'; '.join(v.reasons)}", "state healthy, action none", v.action_text,
                 fix=f"{v.action_text}: {RUNBOOK[v.action]}")


def gpu_unhealthy(s: GpuSample, ctx: GpuContext) -> Check:
    return _check(ctx, UNHEALTHY)


def gpu_degraded(s: GpuSample, ctx: GpuContext) -> Check:
    return _check(ctx, DEGRADED)


RULES = (
    # At once: its inputs are events, or alerts that already waited (a lost GPU serves nothing meanwhile).
    Rule("gpu_unhealthy", CRITICAL, "the GPU must not serve: the line names the action and its reasons",
         gpu_unhealthy, for_s=0.0),
    Rule("gpu_degraded", WARNING, "the GPU serves, but needs the action named soon (at the next maintenance "
         "window)", gpu_degraded),
)


def _one_hot(snap, values: tuple[str, ...], attr: str):
    for view in snap.gpus:
        if view.health is not None:
            current = getattr(view.health, attr)
            yield from (((str(view.sample.index), value), int(value == current)) for value in values)


def _host(snap):
    if snap.gpus:
        state = snap.host_health.state
        yield from (((value,), int(value == state)) for value in STATES)


# Every GPU, answering or not (a lost one is the unhealthiest).
ROWS = (
    Row("gpuwarden_gpu_health", "1 for the GPU's health state (healthy; degraded: serving, act soon; unhealthy: "
        "must not serve), 0 for the other two", ("gpu", "state"), lambda snap: _one_hot(snap, STATES, "state")),
    Row("gpuwarden_gpu_action_required", "1 for the action the GPU's health requires (none, restart_engine, "
        "reset_gpu, reboot, inspect), 0 for the others", ("gpu", "action"),
        lambda snap: _one_hot(snap, ACTIONS, "action")),
    Row("gpuwarden_host_health", "1 for the host's health state, the worst of its GPUs'", ("state",), _host),
)
