"""Open the GPU backend a config names: the one place that joins the config and the gpu package.

A simulator scenario is a built-in name or a file relative to the config's
directory; an unknown one is a config error at gpu.scenario's line.
"""

from __future__ import annotations

import subprocess
import sys
import threading
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


# What the image after a handover does first (a new process image: the NVML library and nvidia-ml-py on disk loaded
# anew, the Debian package's vendored copy found as the daemon finds it): open the NVML backend, then close it.
NVML_PROBE = ("import sys\nfrom gpuwarden.gpu import errors, open_backend\n"
              "try:\n    open_backend('nvml').close()\nexcept errors.GpuError as exc:\n    print(exc)\n    sys.exit(1)\n")
PROBE_S = 10.0  # nvmlInit takes well under a second with persistence mode, a few seconds without
PROBE_SAID_MAX = 300  # characters of what a failed probe printed, in the refusal


def would_open(config: Config, probe: Sequence[str] = (sys.executable, "-c", NVML_PROBE)) -> None:
    """Raise ConfigError or gpu.errors.Unavailable where a new process could not open the backend config names: a
    scenario resolved and read (the simulator), or the NVML backend opened by a fresh interpreter, which loads the
    library and nvidia-ml-py on disk (a driver's userspace upgraded beside its kernel module fails there, while
    this process still holds the library it loaded). The caller waits PROBE_S at most."""
    if config.gpu.backend == "sim":
        open_configured(config).close()
        return
    from .gpu.errors import Unavailable

    try:
        proc = subprocess.Popen(list(probe), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, start_new_session=True)
    except OSError as exc:
        raise Unavailable(f"NVML could not be tried in a new process: {exc.strerror or exc}") from None
    try:
        out, _ = proc.communicate(timeout=PROBE_S)
    except subprocess.TimeoutExpired:
        # Killed, and reaped off the loop: an nvmlInit stuck in the driver may not die at once, and the loop must
        # not wait for it past PROBE_S.
        proc.kill()
        threading.Thread(target=proc.wait, daemon=True, name="nvml-probe-reaper").start()
        raise Unavailable(f"NVML did not open within {PROBE_S:g} s in a new process") from None
    if proc.returncode != 0:
        said = out[-64 * 1024:].decode("utf-8", "replace").strip().splitlines()
        raise Unavailable(f"NVML does not open in a new process: {(said[-1] if said else '')[:PROBE_SAID_MAX]}"
                          f" (exit status {proc.returncode})")
