"""The PCIe link: its generation and width against what the GPU and the slot support, and its replays. Rule: a
busy GPU's link trained down (pcie_link_degraded)."""

from __future__ import annotations

from ...gpu.base import GpuSample
from ..alerts import INACTIVE, WARNING, Check, GpuContext, Rule, pct
from ..rows import COUNTER, gpu_row


def pcie_link_degraded(s: GpuSample, ctx: GpuContext) -> Check:
    """Idle links train down on purpose (power saving): only a busy GPU's link counts."""
    h = s.health
    if not ctx.busy or not h.link_degraded:
        return INACTIVE
    replays = "" if h.pcie_replays is None else f", {h.pcie_replays} replay" + ("" if h.pcie_replays == 1 else "s")
    return Check(True, f"PCIe link {h.link()} while busy (util {pct(s.utilization_pct)}){replays}",
                 "the link's full generation and width", f"Gen{h.pcie_generation} x{h.pcie_width}")


RULES = (
    Rule("pcie_link_degraded", WARNING, "reseat the card, check the riser and cable, and the slot's PCIe setting "
         "in the BIOS; a link below its generation or width slows loading and tensor parallelism",
         pcie_link_degraded),
)

ROWS = (
    gpu_row("gpuwarden_gpu_pcie_link_generation", "Current PCIe link generation", "sample.health.pcie_generation"),
    gpu_row("gpuwarden_gpu_pcie_link_generation_max", "Highest PCIe generation the GPU and its slot support",
            "sample.health.pcie_generation_max"),
    gpu_row("gpuwarden_gpu_pcie_link_width", "Current PCIe link width (lanes)", "sample.health.pcie_width"),
    gpu_row("gpuwarden_gpu_pcie_link_width_max", "Widest PCIe link the GPU and its slot support",
            "sample.health.pcie_width_max"),
    gpu_row("gpuwarden_gpu_pcie_replays", "PCIe link-level retransmissions", "sample.health.pcie_replays",
            COUNTER),
)
