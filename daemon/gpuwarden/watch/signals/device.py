"""The GPU itself: who it is, whether it answers, how busy it is, its performance state and persistence mode.
Rules: a GPU NVML cannot read (gpu_lost) and persistence mode a driver reload turned off (persistence_off, which
the daemon answers by re-applying the tuning: its re-applies are counted here too)."""

from __future__ import annotations

from ...gpu.base import GpuSample
from ..alerts import CRITICAL, WARNING, Check, GpuContext, Rule
from ..rows import COUNTER, Row, gpu_row


def persistence_off(s: GpuSample, ctx: GpuContext) -> Check:
    return Check(ctx.persistence_wanted and s.persistence_mode is False, "persistence mode off",
                 "configured on", "off")


def gpu_lost(s: GpuSample, ctx: GpuContext) -> Check:
    return Check(not s.up, f"GPU unreadable: {s.error}", "NVML must answer", "lost")


RULES = (
    Rule("persistence_off", WARNING, "a driver reload turned it off; gpuwarden re-applies it through NVML's "
         "deprecated setter: `systemctl enable --now nvidia-persistenced` keeps it on the supported way",
         persistence_off, reapply=True),
    Rule("gpu_lost", CRITICAL, "check `dmesg` for Xid errors; the GPU may need a reset or a reboot", gpu_lost),
)

# Every GPU, answering or not.
ROWS = (
    Row("gpuwarden_gpu_info", "GPU identity (value is always 1)",
        ("gpu", "uuid", "name", "pci_bus_id", "compute_capability"),
        lambda snap: [((str(s.index), s.uuid, s.name, s.pci_bus_id, s.compute_capability or ""), 1)
                      for s in (v.sample for v in snap.gpus)]),
    Row("gpuwarden_gpu_up", "1 if the GPU answered the last poll", ("gpu",),
        lambda snap: [((str(v.sample.index),), int(v.sample.up)) for v in snap.gpus]),
    Row("gpuwarden_tuning_reapplies", "Times the tuning was re-applied after drift", ("gpu",),
        lambda snap: [((str(v.sample.index),), snap.reapplies.get(v.sample.index, 0)) for v in snap.gpus], COUNTER),
    gpu_row("gpuwarden_gpu_utilization_ratio", "Fraction of time a kernel ran over the last sample period",
            lambda v: None if v.sample.utilization_pct is None else v.sample.utilization_pct / 100),
    gpu_row("gpuwarden_gpu_persistence_mode", "1 if persistence mode is on",
            lambda v: None if v.sample.persistence_mode is None else int(v.sample.persistence_mode)),
    gpu_row("gpuwarden_gpu_performance_state", "Performance state, 0 (P0, fastest) to 15", "sample.performance_state"),
)
