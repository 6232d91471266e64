"""Sample cost per GPU: gpuwarden's NVML backend against one `nvidia-smi --query-gpu` run with the same fields.

    python3 benchmarks/sample_cost.py [--repeats 200] [--smi-runs 30]

Read-only: NVML is wrapped so that setters cannot be reached (tests/hardware).
nvidia_gpu_exporter runs such an nvidia-smi on every scrape; gpuwarden reads
NVML in-process on every poll, and the slow counters every counters_interval_s.
Needs a GPU host with nvidia-smi.
"""

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "hardware"))

from nvml_readonly import ReadOnlyNvml  # noqa: E402

from gpuwarden.gpu.errors import GpuError  # noqa: E402
from gpuwarden.gpu.nvml import NvmlBackend  # noqa: E402

# The same fields a GpuSample carries, as nvidia-smi names them.
SMI_FIELDS = ("index,uuid,name,pci.bus_id,compute_cap,clocks.sm,clocks.mem,clocks.gr,clocks.max.sm,clocks.max.mem,"
              "clocks.max.gr,power.draw,power.limit,power.min_limit,power.max_limit,power.default_limit,"
              "temperature.gpu,utilization.gpu,utilization.memory,memory.used,memory.total,persistence_mode,pstate,"
              "clocks_event_reasons.active")


def timed(fn, repeats):
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), sorted(times)[int(0.9 * len(times))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--smi-runs", type=int, default=30)
    args = parser.parse_args()
    try:
        backend = NvmlBackend(ReadOnlyNvml(), counters_interval_s=1e9)  # counters: first sample only
    except GpuError as exc:
        raise SystemExit(f"sample_cost: needs an NVIDIA GPU host: {exc}") from None
    gpus = backend.gpus()
    n = len(gpus)
    for gpu in gpus:
        gpu.sample()  # warm up; reads the slow counters once
    poll = timed(lambda: [g.sample() for g in gpus], args.repeats)
    backend.counters_interval_s = 0  # now every sample also reads energy and the six violation counters

    def with_counters():
        for g in gpus:
            g.sample()
    counters = timed(with_counters, max(10, args.repeats // 10))
    cmd = ["nvidia-smi", f"--query-gpu={SMI_FIELDS}", "--format=csv,noheader,nounits"]
    subprocess.run(cmd, check=True, capture_output=True)
    smi = timed(lambda: subprocess.run(cmd, check=True, capture_output=True), args.smi_runs)
    backend.close()
    print(f"| what ({n} GPU{'s' if n > 1 else ''}) | median per GPU | p90 per GPU |")
    print("| --- | ---: | ---: |")
    print(f"| gpuwarden poll sample (NVML, in-process) | {poll[0] / n * 1e6:.0f} µs | {poll[1] / n * 1e6:.0f} µs |")
    print(f"| gpuwarden sample + energy + 6 violation counters | {counters[0] / n * 1e3:.2f} ms | "
          f"{counters[1] / n * 1e3:.2f} ms |")
    print(f"| nvidia-smi --query-gpu (same fields, one process) | {smi[0] / n * 1e3:.1f} ms | "
          f"{smi[1] / n * 1e3:.1f} ms |")
    print(f"\nnvidia-smi / gpuwarden poll sample, medians: {smi[0] / poll[0]:.0f}x")
    print(f"nvidia-smi / gpuwarden sample with counters, medians: {smi[0] / counters[0]:.1f}x")


if __name__ == "__main__":
    main()
