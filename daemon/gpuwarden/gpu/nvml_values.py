"""NVML's answers in our spelling: text, one form of PCI bus id, scaled units, an error code's name.

Shared by the NVML backend (gpu/nvml.py) and its slow counters (gpu/nvml_counters.py).
"""

from __future__ import annotations

from typing import Any


def text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def pci_bus(bus_id: str) -> str:
    """A PCI bus id in one spelling: NVML gives "00000000:18:00.0" here and "0000:18:00.0" there."""
    parts = bus_id.strip().lower().split(":")
    if len(parts) == 3 and all(parts):
        try:
            return f"{int(parts[0], 16):04x}:{parts[1]}:{parts[2]}"
        except ValueError:
            pass
    return bus_id.strip().lower()


def scaled(value: float | None, factor: float) -> float | None:
    return None if value is None else value * factor


def error_name(nvml: Any, code: int) -> str:
    try:
        return text(nvml.nvmlErrorString(code))
    except (AttributeError, nvml.NVMLError):  # an old pynvml, or a code the library does not know
        return f"NVML error {code}"
