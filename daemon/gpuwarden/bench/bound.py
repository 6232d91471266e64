"""What bound a step: the GPUs' memory, their compute, or neither (the host), from GPM's SM, tensor and DRAM
activity over the step's own seconds (watch.summarize_gpu's means).

"Utilization" reads 100 % for all three: a decode that waits on DRAM, a prefill that fills the tensor
cores and an engine whose GPU waits on its CPU scheduler. GPM tells them apart. Readings that set the thresholds
(a real H200): a bf16 matmul 95 % SM, 93 % tensor, 16 % DRAM; a device-to-device copy 98 % SM, 0 tensor,
87 % DRAM; a sleep kernel 0.8 % SM at 99.5 % utilization.
"""

from __future__ import annotations

import statistics

# Memory-bound: DRAM at least this busy, and busier than the tensor cores. Decode streams the weights for every
# token and reads 0.7-0.9 of the bandwidth on a card it fills; a matmul reads 0.16, so 0.6 sits well between.
MEMORY_DRAM_MIN = 0.6
# Compute-bound: the tensor cores this busy (a matmul or a prefill: 0.85-0.93; decode about 0.2)...
COMPUTE_TENSOR_MIN = 0.5
# ...or the SMs this busy without DRAM high (non-tensor compute: FP32 kernels, sampling).
COMPUTE_SM_MIN = 0.8
# Host-bound: the SMs busy less than half the time requests ran. The GPU waits on the engine's CPU (scheduling,
# tokenizing, tiny batches) or on the network between nodes; a sleep kernel reads 0.008 here at 99.5 % utilization.
HOST_SM_MAX = 0.5
# A GPU below this mean utilization over a step serves none of it (another engine's, or a spare): left out, so that
# one busy GPU of eight is judged as itself and not as an eighth of its activity.
BUSY_UTILIZATION_MIN_PCT = 5.0
FIELDS = ("sm_active_ratio", "tensor_active_ratio", "dram_bandwidth_ratio")  # GpuSample's, as /status gives them
MEANS = tuple(f"{field}_mean" for field in FIELDS)  # watch.summarize_gpu's, over a step
NOT_REPORTED = "the GPUs give no GPM figures (NVML's GPU Performance Monitoring: Hopper and newer)"


def bound(sm: float, tensor: float, dram: float) -> str:
    """"memory", "compute", "host" or "mixed" (none of the three stands out) from a busy step's activity (0..1)."""
    if dram >= MEMORY_DRAM_MIN and dram > tensor:
        return "memory"
    if tensor >= COMPUTE_TENSOR_MIN or sm >= COMPUTE_SM_MIN:
        return "compute"  # DRAM lower: below MEMORY_DRAM_MIN, or no busier than the tensor cores
    if sm < HOST_SM_MAX:
        return "host"
    return "mixed"


def step_activity(gpus: list[dict], ok_requests: int) -> dict:
    """The step's SM, tensor and DRAM activity, means over the GPUs that served it, and the bound they name.
    Without GPM the figures are None and "why" says so; a step whose requests all failed names no bound."""
    out = {"sm_active": None, "tensor_active": None, "dram_bandwidth": None, "gpus": [], "bound": None, "why": None}
    reporting = [g for g in gpus if all(g.get(key) is not None for key in MEANS)]
    if not reporting:
        out["why"] = NOT_REPORTED if gpus else "no GPU was read during the step"
        return out
    busy = [g for g in reporting
            if g.get("utilization_pct_mean") is None or g["utilization_pct_mean"] >= BUSY_UTILIZATION_MIN_PCT]
    judged = busy or reporting  # none busy while requests ran: every GPU idled, waiting on the host
    sm, tensor, dram = (statistics.fmean(g[key] for g in judged) for key in MEANS)
    out.update(sm_active=sm, tensor_active=tensor, dram_bandwidth=dram, gpus=[g["index"] for g in judged])
    if ok_requests:
        out["bound"] = bound(sm, tensor, dram)
    else:
        out["why"] = "no request of the step completed"
    return out


def describe(activity: dict | None) -> str:
    """"memory-bound (SM 60%, tensor 20%, DRAM 80%)", or why none is named."""
    if not activity:
        return "not measured"
    if activity.get("bound") is None:  # the whole reason for no GPM is said once, under the table
        why = "no GPM figures" if activity.get("why") == NOT_REPORTED else activity.get("why")
        return f"not measured ({why})"
    figures = (f"SM {activity['sm_active'] * 100:.0f}%, tensor {activity['tensor_active'] * 100:.0f}%, "
               f"DRAM {activity['dram_bandwidth'] * 100:.0f}%")
    name = activity["bound"]
    if name == "host":
        return f"host-bound ({figures}: the GPU waits on the CPU or the network)"
    if name == "mixed":
        return f"no single bound ({figures})"
    return f"{name}-bound ({figures})"
