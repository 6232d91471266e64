"""Open the GPU backend a config names: the one place that joins the config and the gpu package.

A simulator scenario is a built-in name or a file relative to the config's
directory; an unknown one is a config error at gpu.scenario's line.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from .config import Config
from .gpu import GpuBackend, open_backend
from .gpu.sim.scenario import resolve_scenario, unknown_scenario


def scenario_file(config: Config) -> Path:
    """The scenario file for backend "sim"; ConfigError naming gpu.scenario when there is none."""
    path = resolve_scenario(config.gpu.scenario, config.gpu.base_dir or Path.cwd())
    if path is None:
        raise config.error(("gpu", "scenario"), *unknown_scenario(config.gpu.scenario))
    return path


def open_configured(config: Config, clock: Callable[[], float] | None = None) -> GpuBackend:
    """The backend config.gpu names. Raises gpu.errors.Unavailable or ConfigError."""
    scenario = scenario_file(config) if config.gpu.backend == "sim" else None
    return open_backend(config.gpu.backend, scenario, config.counters_interval_s, clock)
