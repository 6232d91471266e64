"""The simulated card's GPM figures (gpu/nvml_gpm.py reads the real ones): scripted by a `gpm` event, or else
derived from the load, so that the demo shows them.

Derived: the engine is active for the utilization's share of the time; the SMs are busy 0.9 of that (a slower
clock stretches the work, not the SMs' share of it); occupancy about half of that; the tensor
cores 0.6 of it, all HMMA (an LLM engine's BF16); a little non-tensor FP32 and FP16; the memory's bandwidth half
the utilization (decode reads the weights whatever the clock); PCIe a trickle, NVLink 25 GB/s each way at full
load where the card has links and peers. A real card's mix depends on its work: these only move with the load.
None for a card before Hopper (compute capability below 9.0: GPM starts there) or with `gpm` in not_supported.
"""

from __future__ import annotations

from collections.abc import Mapping

from ..base import GPM_FIELDS, GPM_RATIOS
from .scenario import GpuModel, gpm_param

MIB = 1024 * 1024


def supported(model: GpuModel) -> bool:
    major = model.compute_capability.split(".")[0]
    return "gpm" not in model.not_supported and major.isdigit() and int(major) >= 9


def figures(model: GpuModel, utilization_pct: float, peers: int,
            scripted: Mapping[str, float] | None) -> dict[str, float]:
    """GpuSample's GPM fields: {} where the card has no GPM."""
    if not supported(model):
        return {}
    busy = utilization_pct / 100
    sm = 0.9 * busy
    nvlink = 25e9 * busy if model.nvlinks and peers else None
    out = {"graphics_engine_active_ratio": busy, "sm_active_ratio": sm, "sm_occupancy_ratio": 0.45 * sm,
           "tensor_active_ratio": 0.6 * sm, "tensor_hmma_active_ratio": 0.6 * sm, "dram_bandwidth_ratio": 0.5 * busy,
           "fp32_active_ratio": 0.08 * sm, "fp16_active_ratio": 0.02 * sm,
           "pcie_tx_bytes_per_s": 0.2e9 * busy, "pcie_rx_bytes_per_s": 0.5e9 * busy,
           "nvlink_tx_bytes_per_s": nvlink, "nvlink_rx_bytes_per_s": nvlink}
    for field in GPM_FIELDS:
        value = (scripted or {}).get(gpm_param(field))
        if value is not None:
            out[field] = value / 100 if field in GPM_RATIOS else value * MIB
    return {field: round(value, 4) for field, value in out.items() if value is not None}
