"""GPU access: one interface (base.Gpu), a real NVML backend and a simulator.

Nothing above this package knows which backend is in use, and nothing in it
knows about the config: open_backend takes plain values (backends.py maps a
config onto them).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from .base import ClockEventReason, Gpu, GpuBackend, GpuCapabilities, GpuSample
from .errors import GpuError

__all__ = ["ClockEventReason", "Gpu", "GpuBackend", "GpuCapabilities", "GpuSample", "GpuError", "open_backend"]


def open_backend(kind: str, scenario: Path | None = None, counters_interval_s: float = 10.0,
                 clock: Callable[[], float] | None = None) -> GpuBackend:
    """kind "nvml", or "sim" with the scenario file to simulate. Raises gpu.errors.Unavailable for NVML,
    yamlfile.InvalidConfig for a bad scenario file."""
    if kind == "sim":
        from .sim.backend import SimBackend
        from .sim.scenario import load_scenario

        if scenario is None:
            raise ValueError("the simulator needs a scenario file")
        return SimBackend(load_scenario(scenario), clock=clock)
    from .nvml import NvmlBackend

    kwargs = {"clock": clock} if clock is not None else {}
    return NvmlBackend(counters_interval_s=counters_interval_s, **kwargs)
