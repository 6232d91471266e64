"""The NVSwitch fabric: the GPU's registration with the fabric manager. Rule: not completed with success
(fabric_not_ready), which leaves the GPU without NVLink peers."""

from __future__ import annotations

from ...gpu.base import GpuSample
from ..alerts import CRITICAL, INACTIVE, Check, GpuContext, Rule
from ..rows import flag, gpu_row


def fabric_not_ready(s: GpuSample, ctx: GpuContext) -> Check:
    h = s.health
    if h.fabric_ready is not False:
        return INACTIVE
    what = f"completed with {h.fabric_error}" if h.fabric_error else h.fabric.replace("_", " ")
    return Check(True, f"NVSwitch fabric registration {what}: no NVLink peers for tensor parallelism",
                 "fabric completed, status success", "fabric " + (h.fabric_error or h.fabric))


RULES = (
    Rule("fabric_not_ready", CRITICAL, "start the fabric manager (`systemctl enable --now nvidia-fabricmanager`, "
         "its version the driver's) and read its log; `nvidia-smi -q` shows the GPU's Fabric State and Status",
         fabric_not_ready, for_s=60.0),
)

ROWS = (
    gpu_row("gpuwarden_gpu_fabric_ready", "1 when the GPU's NVSwitch fabric registration completed with success "
            "(where the GPU has a fabric)", lambda v: flag(v.sample.health.fabric_ready)),
)
