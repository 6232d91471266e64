"""Open the GPU backend a config names: the one place that joins the config and the gpu package.

A simulator scenario is a built-in name or a file relative to the config's
directory; an unknown one is a config error at gpu.scenario's line.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable, Sequence
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


# What a fresh interpreter does first with NVML: what the image after a handover (a new process image, the NVML
# library on disk loaded anew) must get through before it can watch a GPU.
NVML_PROBE = ("import pynvml\n"
              "try:\n    pynvml.nvmlInit()\nexcept pynvml.NVMLError as exc:\n    print(exc)\n    raise SystemExit(1)\n"
              "pynvml.nvmlShutdown()\n")
PROBE_S = 10.0  # nvmlInit takes well under a second with persistence mode, a few seconds without
PROBE_SAID_MAX = 300  # characters of what a failed probe printed, in the refusal


def would_open(config: Config, probe: Sequence[str] = (sys.executable, "-c", NVML_PROBE)) -> None:
    """Raise ConfigError or gpu.errors.Unavailable where a new process could not open the backend config names: a
    scenario resolved and read (the simulator), or NVML initialised by a fresh interpreter, which loads the
    library on disk (a driver's userspace upgraded beside its kernel module fails there, while this process still
    holds the library it loaded). The probe's deadline is PROBE_S."""
    if config.gpu.backend == "sim":
        open_configured(config).close()
        return
    from .gpu.errors import Unavailable

    try:
        done = subprocess.run(list(probe), stdin=subprocess.DEVNULL, capture_output=True, timeout=PROBE_S)
    except subprocess.TimeoutExpired:
        raise Unavailable(f"NVML did not initialise within {PROBE_S:g} s in a new process") from None
    except OSError as exc:
        raise Unavailable(f"NVML could not be tried in a new process: {exc.strerror or exc}") from None
    if done.returncode != 0:
        said = (done.stdout or done.stderr).decode("utf-8", "replace").strip().splitlines()
        raise Unavailable(f"NVML does not initialise in a new process: {(said[-1] if said else '')[:PROBE_SAID_MAX]}"
                          f" (exit status {done.returncode})")
