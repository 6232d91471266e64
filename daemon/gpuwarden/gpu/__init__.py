"""GPU access: one interface (base.Gpu), a real NVML backend and a simulator.

Nothing above this package knows which backend is in use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING
from collections.abc import Callable

from .base import ClockEventReason, Gpu, GpuBackend, GpuCapabilities, GpuSample
from .errors import GpuError

if TYPE_CHECKING:
    from ..config import Config

__all__ = ["ClockEventReason", "Gpu", "GpuBackend", "GpuCapabilities", "GpuSample", "GpuError", "open_backend"]


def open_backend(config: Config, clock: Callable[[], float] | None = None) -> GpuBackend:
    """Open the backend the config names. Raises gpu.errors.Unavailable or ConfigError."""
    if config.gpu.backend == "sim":
        from .sim.backend import SimBackend
        from .sim.scenario import load_scenario

        return SimBackend(load_scenario(config.gpu.scenario_path), clock=clock)
    from .nvml import NvmlBackend

    kwargs = {"clock": clock} if clock is not None else {}
    return NvmlBackend(counters_interval_s=config.counters_interval_s, **kwargs)
