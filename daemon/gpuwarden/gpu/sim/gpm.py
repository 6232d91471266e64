"""The simulated card's GPM figures (gpu/nvml_gpm.py reads the real ones): scripted by a `gpm` event, or else
derived from the load, so that the demo shows them.

Derived, where the served workload says what share of its busy time is prefill (sim/power.py's channel): a mix of
two profiles, each at full load and scaled by the utilization. Decode reads every weight for a token or a few, so
it is memory-bound: DRAM bandwidth high, tensor cores mostly waiting on it, SMs busy but stalled. Prefill multiplies
whole prompts at once, so it is compute-bound: tensor cores and SMs near full, DRAM a fraction (a real H200's
readings: a bf16 matmul 95 % SM, 93 % tensor, 16 % DRAM; a device-to-device copy 98 % SM, 87 % DRAM).

Derived without a share (a scenario's load, or a server that does not say): the engine is active for the
utilization's share of the time; the SMs are busy 0.9 of that (a slower clock stretches the work, not the SMs' share
of it); the tensor cores 0.6 of it; the memory's bandwidth half the utilization (decode reads the weights whatever
the clock). Either way: occupancy about half the SM share; tensor work all HMMA (an LLM engine's BF16); a little
non-tensor FP32 and FP16; PCIe a trickle, NVLink 25 GB/s each way at full load where the card has links and peers.
None for a card before Hopper (compute capability below 9.0: GPM starts there) or with `gpm` in not_supported.
"""

from __future__ import annotations

from collections.abc import Mapping

from ..base import GPM_FIELDS, GPM_RATIOS
from .scenario import GpuModel, gpm_param

MIB = 1024 * 1024
# (SM active, tensor active, DRAM bandwidth) at full load
DECODE = (0.6, 0.2, 0.8)
PREFILL = (0.95, 0.85, 0.3)


def supported(model: GpuModel) -> bool:
    major = model.compute_capability.split(".")[0]
    return "gpm" not in model.not_supported and major.isdigit() and int(major) >= 9


def _activity(busy: float, prefill_share: float | None) -> tuple[float, float, float]:
    """(SM, tensor, DRAM) shares at this load."""
    if prefill_share is None:
        sm = 0.9 * busy
        return sm, 0.6 * sm, 0.5 * busy
    return tuple(busy * (d + prefill_share * (p - d)) for d, p in zip(DECODE, PREFILL))


def figures(model: GpuModel, utilization_pct: float, peers: int, scripted: Mapping[str, float] | None,
            prefill_share: float | None = None) -> dict[str, float]:
    """GpuSample's GPM fields: {} where the card has no GPM."""
    if not supported(model):
        return {}
    busy = utilization_pct / 100
    sm, tensor, dram = _activity(busy, prefill_share)
    nvlink = 25e9 * busy if model.nvlinks and peers else None
    out = {"graphics_engine_active_ratio": busy, "sm_active_ratio": sm, "sm_occupancy_ratio": 0.45 * sm,
           "tensor_active_ratio": tensor, "tensor_hmma_active_ratio": tensor, "dram_bandwidth_ratio": dram,
           "fp32_active_ratio": 0.08 * sm, "fp16_active_ratio": 0.02 * sm,
           "pcie_tx_bytes_per_s": 0.2e9 * busy, "pcie_rx_bytes_per_s": 0.5e9 * busy,
           "nvlink_tx_bytes_per_s": nvlink, "nvlink_rx_bytes_per_s": nvlink}
    for field in GPM_FIELDS:
        value = (scripted or {}).get(gpm_param(field))
        if value is not None:
            out[field] = value / 100 if field in GPM_RATIOS else value * MIB
    return {field: round(value, 4) for field, value in out.items() if value is not None}
