"""What the GPU is really doing, from GPM (NVML's GPU Performance Monitoring, Hopper and newer; gpu/nvml_gpm.py):
the SMs' busy share and occupancy, the tensor cores', the memory's bandwidth in use, the non-tensor FP32 and
FP16 math, and PCIe and NVLink traffic. "Utilization" (device.py) says that some kernel ran in the sample
window: a kernel that sleeps on one SM reads 99.5 % there and 0.8 % SM activity here, so a decode-bound engine,
a compute-bound prefill and an engine starved by its CPU tell apart only here.

Read with the counters: each figure is the mean over counters_interval_s (the first read only primes). A GPU
without GPM (before Hopper, or where the driver says no) has none of these series. No rule yet."""

from __future__ import annotations

from ..rows import gpu_row

RULES = ()

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
