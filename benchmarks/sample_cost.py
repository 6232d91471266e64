"""Sample cost per GPU as the daemon pays it: samples spaced at the poll interval, the batched reads
(nvmlDeviceGetFieldValues) against the single calls they replace, side by side in one run, and one
`nvidia-smi --query-gpu` run with the same fields.

    python3 benchmarks/sample_cost.py [--interval 1.0] [--polls 120] [--smi-runs 20]

Back-to-back samples (the old version of this benchmark) measured 34 µs on a lent H200 while the running
daemon's own gpuwarden_sample_duration_seconds said 245 µs: NVML answers faster when asked again at once.
So each backend here samples once per --interval, alternating, as the daemon does, with the slow counters
every 10 s (counters_interval_s). Read-only: NVML is wrapped so that setters cannot be reached
(tests/hardware). Needs a GPU host with nvidia-smi.
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


def quantile(values, q):
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--interval", type=float, default=1.0, help="seconds between polls (the daemon's default)")
    parser.add_argument("--polls", type=int, default=120, help="polls per backend")
    parser.add_argument("--smi-runs", type=int, default=20)
    parser.add_argument("--back-to-back", type=int, default=200, help="samples without spacing, for comparison")
    args = parser.parse_args()
    try:
        backends = {"single calls (before)": NvmlBackend(ReadOnlyNvml(), batched=False),
                    "batched fields (after)": NvmlBackend(ReadOnlyNvml(), batched=True)}
    except GpuError as exc:
        raise SystemExit(f"sample_cost: needs an NVIDIA GPU host: {exc}") from None
    n = len(next(iter(backends.values())).gpus())
    times: dict[str, list[float]] = {name: [] for name in backends}
    counters: dict[str, list[float]] = {name: [] for name in backends}
    for backend in backends.values():
        for gpu in backend.gpus():
            gpu.sample()  # warm up: static fields and the first counters read
    next_poll = time.monotonic()
    for i in range(args.polls):
        for name, backend in backends.items():
            next_poll += args.interval / len(backends)
            time.sleep(max(0.0, next_poll - time.monotonic()))
            counter_poll = any(backend.clock() - g._counters_at >= backend.counters_interval_s
                               for g in backend.gpus())
            start = time.perf_counter()
            for gpu in backend.gpus():
                gpu.sample()
            (counters if counter_poll else times)[name].append((time.perf_counter() - start) / n)
    burst = {}
    for name, backend in backends.items():
        gpus = backend.gpus()
        samples = []
        for _ in range(args.back_to_back):
            start = time.perf_counter()
            for gpu in gpus:
                gpu.sample()
            samples.append((time.perf_counter() - start) / n)
        burst[name] = statistics.median(samples)
    cmd = ["nvidia-smi", f"--query-gpu={SMI_FIELDS}", "--format=csv,noheader,nounits"]
    subprocess.run(cmd, check=True, capture_output=True)
    smi = []
    for _ in range(args.smi_runs):
        start = time.perf_counter()
        subprocess.run(cmd, check=True, capture_output=True)
        smi.append((time.perf_counter() - start) / n)
    for backend in backends.values():
        backend.close()
    print(f"{n} GPU(s), polls every {args.interval:g} s, {args.polls} per backend, alternating\n")
    print("| what | median per GPU | p90 per GPU | back to back (median) |")
    print("| --- | ---: | ---: | ---: |")
    for name in backends:
        print(f"| poll sample, {name} | {statistics.median(times[name]) * 1e6:.0f} µs | "
              f"{quantile(times[name], 0.9) * 1e6:.0f} µs | {burst[name] * 1e6:.0f} µs |")
    for name in backends:
        if counters[name]:
            print(f"| poll with the counters (every 10 s), {name} | {statistics.median(counters[name]) * 1e3:.2f} ms | "
                  f"{quantile(counters[name], 0.9) * 1e3:.2f} ms | |")
    print(f"| nvidia-smi --query-gpu (same fields, one process) | {statistics.median(smi) * 1e3:.1f} ms | "
          f"{quantile(smi, 0.9) * 1e3:.1f} ms | |")
    before, after = (statistics.median(times[name]) for name in backends)
    print(f"\nbatched / single, poll medians: {after / before:.2f}")
    print(f"nvidia-smi / batched poll sample, medians: {statistics.median(smi) / after:.0f}x")


if __name__ == "__main__":
    main()
