"""Read-only check of the NVML backend on a real NVIDIA GPU (run by hand on a GPU host).

    PYTHONPATH=daemon python3 tests/hardware/nvml_readonly.py [SECONDS]
    PYTHONPATH=daemon python3 tests/hardware/nvml_readonly.py guard GPUWARDEN-ARGS...

It prints the driver, each GPU's capabilities and every sample field as JSON
lines, then runs the daemon with tuning.apply false for a few seconds. NVML is
wrapped so that only reads pass: any setter or reset raises instead of
reaching the card. `guard` runs the gpuwarden command itself (doctor, plan,
run) with that wrapper in place of pynvml. Not collected by pytest (no GPU in CI).
"""

import json
import os
import sys
import time

import pynvml

from gpuwarden import config
from gpuwarden.service.daemon import Daemon, run
from gpuwarden.gpu.nvml import NvmlBackend
from gpuwarden.base.systemd import setup_logging
from gpuwarden.tune.tuning import make_plan

READ_PREFIXES = ("nvmlDeviceGet", "nvmlSystemGet", "nvmlErrorString", "c_nvml",  # reads, and the structs they fill
                 "nvmlEventSet", "nvmlDeviceRegisterEvents",  # waiting for events changes nothing on the card
                 "nvmlGpmQueryDeviceSupport", "nvmlGpmSample", "nvmlGpmMetricsGet")  # GPM's reads (gpu/nvml_gpm.py)


REFUSED: list[str] = []  # every call refused, for the exit status of a probe
# Set to hide GPM's calls, as an nvidia-ml-py without them would (gpuwarden then reads no GPM): the probe that
# measures what GPM adds to a poll runs the daemon once with them and once without.
HIDE_GPM = "GPUWARDEN_PROBE_NO_GPM"


class ReadOnlyNvml:
    """pynvml with every call that could change a GPU removed (refused, recorded in REFUSED)."""

    NVMLError = pynvml.NVMLError
    nvmlInit = staticmethod(pynvml.nvmlInit)
    nvmlShutdown = staticmethod(pynvml.nvmlShutdown)

    def __getattr__(self, name):
        if name.startswith("nvmlGpm") and os.environ.get(HIDE_GPM):
            raise AttributeError(name)
        value = getattr(pynvml, name)  # AttributeError for what pynvml lacks, as for the real module
        if not callable(value) or name.startswith(READ_PREFIXES):  # constants, and the reads
            return value
        REFUSED.append(name)
        raise PermissionError(f"read-only probe: NVML call {name} is not allowed here")


def main(seconds: float) -> int:
    cfg = config.parse_text("poll_interval_s: 0.5\ncounters_interval_s: 1\nlog_interval_s: 0\n"
                            "metrics:\n  listen: none\ntuning:\n  apply: false\n  memory_clocks: max\n",
                            name="probe.yaml")
    backend = NvmlBackend(ReadOnlyNvml(), counters_interval_s=cfg.counters_interval_s)
    print(json.dumps({"driver_version": backend.driver_version(), "gpus": len(backend.gpus()),
                      "nvidia_persistenced": backend.persistenced_running()}))
    for gpu in backend.gpus():
        caps = gpu.capabilities()
        print(json.dumps({"gpu": gpu.index, "capabilities": {
            "memory_clocks_mhz": caps.memory_clocks_mhz,
            "graphics_clocks_mhz": f"{len(caps.graphics_clocks_mhz)} values, "
                                   f"{caps.graphics_clocks_mhz[-1] if caps.graphics_clocks_mhz else None}-"
                                   f"{caps.graphics_clocks_mhz[0] if caps.graphics_clocks_mhz else None}",
            "power_limit_w": [caps.power_limit_min_w, caps.power_limit_default_w, caps.power_limit_max_w]}}))
    end = time.monotonic() + seconds
    missing: set[str] = set()
    while time.monotonic() < end:
        for gpu in backend.gpus():
            started = time.perf_counter()
            sample = gpu.sample()
            cost_us = (time.perf_counter() - started) * 1e6
            fields = sample.as_dict()
            missing |= {k for k, v in fields.items() if v is None and k != "error"}
            print(json.dumps({"sample_cost_us": round(cost_us), **fields}))
        time.sleep(0.5)
    print(json.dumps({"fields_never_read": sorted(missing)}))
    plan = make_plan(backend, cfg)
    for action in plan.actions:
        print("plan (not applied):", action.describe())
    setup_logging()
    run(Daemon(cfg, backend), duration_s=3)
    backend.close()
    return 0


def guard(argv: list[str]) -> int:
    """The gpuwarden command with the read-only wrapper as its pynvml."""
    sys.modules["pynvml"] = ReadOnlyNvml()  # gpu/nvml.py imports pynvml by name: it gets this
    from gpuwarden.base import earlysignals

    earlysignals.hold()
    from gpuwarden.cli.main import main as cli_main

    return cli_main(argv)


if __name__ == "__main__":
    if sys.argv[1:2] == ["guard"]:
        sys.exit(guard(sys.argv[2:]))
    sys.exit(main(float(sys.argv[1]) if len(sys.argv) > 1 else 4))
