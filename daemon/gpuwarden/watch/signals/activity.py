"""What the GPU is really doing, from GPM (NVML's GPU Performance Monitoring, Hopper and newer; gpu/nvml_gpm.py):
the SMs' busy share and occupancy, the tensor cores', the memory's bandwidth in use, the non-tensor FP32 and
FP16 math, and PCIe and NVLink traffic. "Utilization" (device.py) says that some kernel ran in the sample
window: a kernel that sleeps on one SM reads 99.5 % there and 0.8 % SM activity here, so a decode-bound engine,
a compute-bound prefill and an engine starved by its CPU tell apart only here.

Read with the counters: each figure is the mean over counters_interval_s (the first read only primes). A GPU
without GPM (before Hopper, or where the driver says no) has none of these series.

Rule: busy_but_idle, a notice (not a warning): kernels run nearly all the time, yet almost no SM works, for a
minute. Both figures are GPM's, the mean over the same interval, so a bursty load cannot pair a busy instant
with an idle mean (NVML's utilization is a sample of its own, shorter period)."""

from __future__ import annotations

from ...gpu.base import GpuSample
from ..alerts import INACTIVE, INFO, Check, GpuContext, Rule, pct
from ..rows import gpu_row

KERNELS_BUSY_MIN = 0.80  # GPM's graphics-engine activity: kernels ran this share of the interval, or more
# SM activity below this is a GPU that waits while it reads busy: a kernel that sleeps or spins on one SM read
# 0.8 % on a real H200, a bf16 matmul 95 %, a device-to-device copy 98 %. Decode at batch 1 of a
# small model keeps a few SMs busy, and is one of the causes this names.
SM_IDLE_MAX = 0.10
BUSY_BUT_IDLE_FOR_S = 60.0  # six GPM reads at the default counters_interval_s: a pattern, not a pause


def busy_but_idle(s: GpuSample, ctx: GpuContext) -> Check:
    """Kernels run nearly all the time but almost no SM works: the GPU reads busy and waits. GPM's figures, so
    only on GPUs that report GPM (Hopper and newer)."""
    kernels, sm = s.graphics_engine_active_ratio, s.sm_active_ratio
    if kernels is None or sm is None or kernels < KERNELS_BUSY_MIN or sm >= SM_IDLE_MAX:
        return INACTIVE
    util = f"utilization {pct(s.utilization_pct)}, " if s.utilization_pct is not None else ""
    return Check(True, f"{util}kernels active {pct(kernels * 100)} of the time, SM active {sm * 100:.1f}%",
                 f"kernels active >= {KERNELS_BUSY_MIN * 100:.0f}% with SM active < {SM_IDLE_MAX * 100:.0f}% for "
                 f"{BUSY_BUT_IDLE_FOR_S:.0f} s", f"SM {sm * 100:.0f}%")


RULES = (
    Rule("busy_but_idle", INFO, "a notice: the GPU reads busy but its SMs wait. Likely causes: the engine's "
         "scheduling is CPU-bound (look at its host threads' CPU), its batches are tiny (few requests at once), or "
         "it waits on the network between nodes (NCCL); `gpuwarden bench` shows each step's SM and tensor "
         "activity", busy_but_idle, for_s=BUSY_BUT_IDLE_FOR_S),
)

_MEAN = ", the mean over counters_interval_s (GPM, Hopper and newer)"

ROWS = (
    gpu_row("gpuwarden_gpu_graphics_engine_active_ratio", "Share of time any kernel (or graphics work) ran on the "
            "GPU" + _MEAN, "sample.graphics_engine_active_ratio"),
    gpu_row("gpuwarden_gpu_sm_active_ratio", "Share of the SMs busy with at least one warp" + _MEAN,
            "sample.sm_active_ratio"),
    gpu_row("gpuwarden_gpu_sm_occupancy_ratio", "Resident warps against the SMs' maximum" + _MEAN,
            "sample.sm_occupancy_ratio"),
    gpu_row("gpuwarden_gpu_tensor_active_ratio", "Share of time the SMs' tensor cores worked, any precision" + _MEAN,
            "sample.tensor_active_ratio"),
    gpu_row("gpuwarden_gpu_tensor_hmma_active_ratio", "Share of time the tensor cores did HMMA (FP16, BF16) work"
            + _MEAN, "sample.tensor_hmma_active_ratio"),
    gpu_row("gpuwarden_gpu_dram_bandwidth_ratio", "Memory bandwidth in use against its peak" + _MEAN,
            "sample.dram_bandwidth_ratio"),
    gpu_row("gpuwarden_gpu_fp32_active_ratio", "Share of time the SMs did non-tensor FP32 math" + _MEAN,
            "sample.fp32_active_ratio"),
    gpu_row("gpuwarden_gpu_fp16_active_ratio", "Share of time the SMs did non-tensor FP16 math" + _MEAN,
            "sample.fp16_active_ratio"),
    gpu_row("gpuwarden_gpu_pcie_tx_bytes_per_second", "PCIe traffic from the GPU" + _MEAN,
            "sample.pcie_tx_bytes_per_s"),
    gpu_row("gpuwarden_gpu_pcie_rx_bytes_per_second", "PCIe traffic to the GPU" + _MEAN,
            "sample.pcie_rx_bytes_per_s"),
    gpu_row("gpuwarden_gpu_nvlink_tx_bytes_per_second", "NVLink traffic from the GPU, all links" + _MEAN,
            "sample.nvlink_tx_bytes_per_s"),
    gpu_row("gpuwarden_gpu_nvlink_rx_bytes_per_second", "NVLink traffic to the GPU, all links" + _MEAN,
            "sample.nvlink_rx_bytes_per_s"),
)
