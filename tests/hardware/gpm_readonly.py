"""GPM against nvidia-smi on a real Hopper (or newer) GPU, read-only (run by hand on a GPU host; not collected by
pytest, no GPU in CI).

    PYTHONPATH=daemon python3 tests/hardware/gpm_readonly.py --seconds 8

Four loads run on GPU 0 (NVML's and nvidia-smi's index 0, PCI order; CUDA_DEVICE_ORDER=PCI_BUS_ID makes it
torch's cuda:0 too), each for --seconds after its warm-up, one at a time in a child process: a bf16 matrix
product loop, a device-to-device copy loop, a sleep kernel (torch.cuda._sleep: one thread spinning on the
clock, so "utilization" reads ~100 % while the SMs idle) and idle. Meanwhile
  (a) gpuwarden's NVML backend (gpu/nvml.py, its GPM in gpu/nvml_gpm.py) samples GPU 0 with its counters every
      --interval seconds, so each GPM figure is the mean over that interval;
  (b) `nvidia-smi dmon -i 0 --gpm-metrics 1,2,3,5,10 -d 1 -o T` runs beside it.
Per load it prints the mean of each figure from both and the difference in points, as a Markdown table, and
what a GPM read cost.

dmon's GPM ids are NVML's nvmlGpmMetricId_t (nvml.h; NVIDIA's NVML API reference, "GPM Enums",
https://docs.nvidia.com/deploy/nvml-api/group__nvmlGpmEnums.html; `nvidia-smi dmon --gpm-metrics 1,2,13` prints
columns gract, smutil, fp16, as shown in https://leimao.github.io/blog/NVIDIA-NVML-GPU-Statistics/):
1 GRAPHICS_UTIL (any app active: gpuwarden's graphics_engine_active_ratio), 2 SM_UTIL (the SMs' busy share:
sm_active_ratio), 3 SM_OCCUPANCY (sm_occupancy_ratio), 5 ANY_TENSOR_UTIL (tensor_active_ratio), 10 DRAM_BW_UTIL
(dram_bandwidth_ratio). The script takes them by position: the last five columns of each line, in that order.

Nothing is set on the card: NVML is wrapped so that only reads pass (the device and system getters, GPM's
support query, its samples and its metrics); any other call is refused, recorded, and makes the exit status 1.
nvidia-smi runs only as `dmon`. Exit 2 where GPU 0 has no GPM (the driver's answer is printed).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import multiprocessing
import os
import queue
import statistics
import subprocess
import sys
import threading
import time
from datetime import datetime

import pynvml
from gpuwarden.gpu.nvml import NvmlBackend
from nvml_readonly import REFUSED, ReadOnlyNvml  # tests/hardware/, beside this script

DMON_METRICS = (1, 2, 3, 5, 10)
# dmon's GPM column -> (its name here, gpuwarden's GpuSample field); utilization is NVML's own, beside them
COMPARED = {1: ("graphics activity (gract)", "graphics_engine_active_ratio"), 2: ("SM activity", "sm_active_ratio"),
            3: ("SM occupancy", "sm_occupancy_ratio"), 5: ("tensor activity", "tensor_active_ratio"),
            10: ("DRAM bandwidth", "dram_bandwidth_ratio")}
LOADS = ("matmul", "copy", "sleep", "idle")


# -- the loads, in a child process --------------------------------------------------------------------------------

def load(name: str, ready, stop) -> None:
    os.environ["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"  # cuda:0 is NVML's GPU 0
    import torch

    dev = torch.device("cuda:0")
    if name == "matmul":
        a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
        b = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
        step = lambda: [torch.matmul(a, b) for _ in range(8)]
    elif name == "copy":
        src = torch.empty(2 * 1024**3, device=dev, dtype=torch.uint8)
        dst = torch.empty_like(src)
        step = lambda: [dst.copy_(src) for _ in range(4)]
    elif name == "sleep":
        step = lambda: torch.cuda._sleep(50_000_000)  # cycles: ~25 ms at 2 GHz, one thread
    else:
        torch.zeros(1, device=dev)  # a context, and nothing to do
        step = None
    if step is not None:
        step()
    torch.cuda.synchronize()
    ready.set()
    while not stop.is_set():
        if step is None:
            time.sleep(0.05)
            continue
        step()
        torch.cuda.synchronize()  # a bounded queue: the load stops when asked


def start_load(ctx, name: str):
    """The load in a spawned child, once it runs: (the child, its stop event); None (said) if it did not start."""
    ready, stop = ctx.Event(), ctx.Event()
    child = ctx.Process(target=load, args=(name, ready, stop), daemon=True)
    child.start()
    if not ready.wait(120):
        print(f"{name}: the load did not start", file=sys.stderr)
        return None
    return child, stop


# -- nvidia-smi dmon ----------------------------------------------------------------------------------------------

def dmon(lines: queue.Queue) -> subprocess.Popen:
    """nvidia-smi dmon on GPU 0 with the GPM metrics, each line as (wall time of day, [values])."""
    proc = subprocess.Popen(["nvidia-smi", "dmon", "-i", "0", "--gpm-metrics", ",".join(map(str, DMON_METRICS)),
                             "-d", "1", "-o", "T"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def pump():
        for line in proc.stdout:
            lines.put((time.time(), line.rstrip("\n")))

    threading.Thread(target=pump, daemon=True).start()
    return proc


def seconds_of_day(hms: str, near: float) -> float | None:
    """dmon's HH:MM:SS (local time) as an epoch second, on the day of `near`."""
    try:
        clock = datetime.strptime(hms, "%H:%M:%S").time()
    except ValueError:
        return None
    day = datetime.fromtimestamp(near)
    stamp = datetime.combine(day.date(), clock).timestamp()
    return stamp - 86400 if stamp - near > 43200 else stamp + 86400 if near - stamp > 43200 else stamp


def dmon_rows(lines: list[tuple[float, str]]) -> tuple[list[tuple[float, dict]], list[str]]:
    """(epoch second, {"util": %, metric id: %}) per data line; and the header and any other text it printed."""
    rows, other, header = [], [], None
    for received, line in lines:
        if line.startswith("#"):
            if header is None:
                header = line.lstrip("#").split()
                other.append(line)
            continue
        cells = line.split()
        if not cells or header is None or len(cells) != len(header):
            other.append(line)
            continue
        at = seconds_of_day(cells[0], received) if header[0].lower() == "time" else received
        values = {}
        if "sm" in header:
            values["util"] = cells[header.index("sm")]
        for metric, cell in zip(DMON_METRICS, cells[-len(DMON_METRICS):]):
            values[metric] = cell
        rows.append((at if at is not None else received,
                     {k: float(v) for k, v in values.items() if v.replace(".", "", 1).isdigit()}))
    return rows, other


# -- the run ------------------------------------------------------------------------------------------------------

def mean(values: list[float]) -> float | None:
    return statistics.fmean(values) if values else None


def show(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=8.0, help="each load's measured time (default 8)")
    parser.add_argument("--interval", type=float, default=1.0, help="gpuwarden's GPM read interval (default 1)")
    parser.add_argument("--settle", type=float, default=1.5,
                        help="seconds left out at each load's start, while the last one's figures drain")
    args = parser.parse_args()

    backend = NvmlBackend(ReadOnlyNvml(), counters_interval_s=args.interval)
    gpu = backend.gpus()[0]
    gpu.sample(True)  # primes GPM
    gpm = gpu.counters.gpm
    try:  # the installed distribution's; PYTHONPATH may put another pynvml.py first: its path is printed too
        version = importlib.metadata.version("nvidia-ml-py")
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    version += f" (pynvml from {getattr(pynvml, '__file__', '?')})"
    print(f"GPU 0: {gpu.name} ({gpu.pci_bus_id}), driver {backend.driver_version()}, nvidia-ml-py {version}")
    if gpm.unsupported is not None:
        print(f"GPM is not read on GPU 0: {gpm.unsupported}")
        backend.close()
        return 2 if not REFUSED else 1

    lines: queue.Queue = queue.Queue()
    smi = dmon(lines)
    ours: list[tuple[float, dict]] = []
    costs: list[float] = []
    windows: dict[str, tuple[float, float]] = {}
    ctx = multiprocessing.get_context("spawn")
    try:
        for name in LOADS:
            if (started := start_load(ctx, name)) is None:
                return 1
            child, stop = started
            start = time.time()
            end = start + args.settle + args.seconds
            while time.time() < end:
                time.sleep(args.interval)
                sample = gpu.sample(True)
                if gpm.cost_s is not None:
                    costs.append(gpm.cost_s)
                ours.append((time.time(), {"util": sample.utilization_pct, **{
                    metric: getattr(sample, field) * 100 for metric, (_, field) in COMPARED.items()
                    if getattr(sample, field) is not None}}))
            windows[name] = (start + args.settle, end)
            stop.set()
            child.join(30)
    finally:
        time.sleep(1.5)  # dmon's last line
        smi.terminate()
        smi.wait(10)
        backend.close()
    received = []
    while not lines.empty():
        received.append(lines.get())
    theirs, other = dmon_rows(received)

    print(f"\n{args.seconds:g} s per load after {args.settle:g} s settling; gpuwarden read GPM every "
          f"{args.interval:g} s (each figure the mean since the last read), nvidia-smi dmon every 1 s.\n")
    print("| load | figure | gpuwarden % | nvidia-smi dmon % | difference (points) |")
    print("| --- | --- | --- | --- | --- |")
    worst = 0.0
    for name, (low, high) in windows.items():
        mine = [v for at, v in ours if low < at <= high]
        smis = [v for at, v in theirs if low < at <= high]
        for key, label in [("util", "utilization (NVML; dmon's sm)")] + [(m, COMPARED[m][0]) for m in COMPARED]:
            a = mean([v[key] for v in mine if key in v])
            b = mean([v[key] for v in smis if key in v])
            diff = None if a is None or b is None else a - b
            if diff is not None and key != "util":
                worst = max(worst, abs(diff))
            print(f"| {name} | {label} | {show(a)} | {show(b)} | {'-' if diff is None else f'{diff:+.1f}'} |")
    if costs:
        ms = sorted(c * 1e3 for c in costs)
        print(f"\nA GPM read (a sample, and nvmlGpmMetricsGet for {len(gpm.values) or 'the'} figures of a pair): "
              f"median {statistics.median(ms):.2f} ms, max {ms[-1]:.2f} ms over {len(ms)} reads.")
    print(f"Largest GPM difference from nvidia-smi: {worst:.1f} points ({'within' if worst <= 5 else 'OVER'} 5).")
    if not theirs:
        print("nvidia-smi dmon gave no data lines; it printed:\n" + "\n".join(other[:20]))
    if REFUSED:
        print(f"REFUSED NVML calls (a setter was attempted): {sorted(set(REFUSED))}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
