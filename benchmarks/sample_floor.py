"""The floor under the daemon's per-poll sample: what NVML itself costs when asked at the poll's spacing.

    PYTHONPATH=daemon python3 benchmarks/sample_floor.py [--polls 40] [--spacing 0.5]

Four things are timed in turn, each after --spacing seconds of sleep, as the daemon's loop sleeps between
polls: the daemon's full NvmlGpu.sample(); the six reads the clock and power alerts need (SM and memory
clock, power, utilization, temperature, clock-event reasons) through the daemon's read seam into a
GpuSample; the same six as bare NVML calls with no Python around them; and one bare call. The last two are
the floor: no Python code can sample below them. Read-only (tests/hardware/nvml_readonly.py). Needs a GPU.
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "hardware"))

from nvml_readonly import ReadOnlyNvml  # noqa: E402

from gpuwarden.gpu.base import GpuSample  # noqa: E402
from gpuwarden.gpu.errors import GpuError  # noqa: E402
from gpuwarden.gpu.nvml import CLOCK_MEM, CLOCK_SM, TEMPERATURE_GPU, NvmlBackend  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--polls", type=int, default=40, help="timings per variant")
    parser.add_argument("--spacing", type=float, default=0.5, help="seconds of sleep before each timing")
    args = parser.parse_args()
    try:
        backend = NvmlBackend(ReadOnlyNvml())
    except GpuError as exc:
        raise SystemExit(f"sample_floor: needs an NVIDIA GPU host: {exc}") from None
    gpu = backend.gpus()[0]
    gpu.sample()  # static fields and the first counters read
    nvml, handle, read = gpu.nvml, gpu.handle, gpu._read

    def six_built() -> GpuSample:
        util, power = read("nvmlDeviceGetUtilizationRates"), read("nvmlDeviceGetPowerUsage")
        return GpuSample(gpu.index, gpu.uuid, gpu.name, gpu.pci_bus_id, gpu.compute_capability, up=True,
                         timestamp=time.monotonic(), sm_clock_mhz=read("nvmlDeviceGetClockInfo", CLOCK_SM),
                         memory_clock_mhz=read("nvmlDeviceGetClockInfo", CLOCK_MEM), power_w=power * 1e-3,
                         temperature_c=read("nvmlDeviceGetTemperature", TEMPERATURE_GPU),
                         utilization_pct=util.gpu, memory_utilization_pct=util.memory,
                         clock_event_reasons=gpu._reasons())

    def six_bare() -> None:
        nvml.nvmlDeviceGetClockInfo(handle, CLOCK_SM)
        nvml.nvmlDeviceGetClockInfo(handle, CLOCK_MEM)
        nvml.nvmlDeviceGetPowerUsage(handle)
        nvml.nvmlDeviceGetUtilizationRates(handle)
        nvml.nvmlDeviceGetTemperature(handle, TEMPERATURE_GPU)
        nvml.nvmlDeviceGetCurrentClocksEventReasons(handle)

    variants = {"the daemon's full sample": gpu.sample, "six reads into a GpuSample": six_built,
                "six bare NVML calls": six_bare, "one bare call (SM clock)": lambda: nvml.nvmlDeviceGetClockInfo(
                    handle, CLOCK_SM)}
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(args.polls):
        for name, fn in variants.items():
            time.sleep(args.spacing)
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    backend.close()
    print(f"{args.polls} timings each, {args.spacing:g} s of sleep before each\n")
    print("| what | median | p90 | min |")
    print("| --- | ---: | ---: | ---: |")
    for name, values in times.items():
        values.sort()
        print(f"| {name} | {statistics.median(values) * 1e6:.0f} µs | {values[int(0.9 * len(values))] * 1e6:.0f} µs | "
              f"{values[0] * 1e6:.0f} µs |")


if __name__ == "__main__":
    main()
