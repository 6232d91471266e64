"""Whether the host's IOMMU translates DMA: then NCCL's GPU-to-GPU traffic goes through the root complex."""

from __future__ import annotations

from pathlib import Path


def iommu_state(iommu_dir: Path = Path("/sys/class/iommu"), cmdline: Path = Path("/proc/cmdline")) -> str:
    """off (no IOMMU), passthrough (iommu=pt), or translating."""
    try:
        if not any(iommu_dir.iterdir()):
            return "off"
    except OSError:
        return "off"
    try:
        words = cmdline.read_text().split()
    except OSError:
        words = []
    return "passthrough" if {"iommu=pt", "iommu.passthrough=1"} & set(words) else "translating"
