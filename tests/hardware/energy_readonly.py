#!/usr/bin/env python3
"""READ-ONLY, for a real GPU machine: does NVML's total-energy counter agree with the integral of its power
readings? (issue 29: within 3 %, idle and under load)

    python3 tests/hardware/energy_readonly.py [--gpu 0] [--seconds 30] [--interval-ms 25]

Over --seconds idle, then over --seconds of a bf16 matmul loop (torch) on the GPU, it reads the energy counter
(nvmlDeviceGetTotalEnergyConsumption: mJ since the driver loaded, Volta and newer) at the start and the end, and
samples the power (nvmlDeviceGetPowerUsage: mW) every --interval-ms; it prints one JSON document: the counter's
joules, the trapezoid integral of the power readings, and their difference in %. NVML documents power readings
on Ampere and newer as a 1 s average on some boards (nvmlDeviceGetFieldValues NVML_FI_DEV_POWER_INSTANT is the
instant one where supported); both are recorded, so the comparison says which agrees.

It NEVER calls a setter: no persistence mode, clocks, power limit, application clocks or reset. The only NVML
calls are nvmlInit, nvmlShutdown, DeviceGetHandleByIndex, DeviceGetName, DeviceGetTotalEnergyConsumption,
DeviceGetPowerUsage, DeviceGetFieldValues, DeviceGetPowerManagementLimit (read).
"""

import argparse
import json
import sys
import threading
import time

try:
    import pynvml as _pynvml
except ImportError:
    sys.exit("energy_readonly.py needs nvidia-ml-py (pip install nvidia-ml-py)")

READ_PREFIXES = ("nvmlDeviceGet", "nvmlSystemGet", "nvmlErrorString", "c_nvml")  # reads, and the structs they fill


class ReadOnlyNvml:
    """pynvml with every call that could change a GPU removed (as tests/hardware/nvml_readonly.py does)."""

    NVMLError = _pynvml.NVMLError
    nvmlInit = staticmethod(_pynvml.nvmlInit)
    nvmlShutdown = staticmethod(_pynvml.nvmlShutdown)

    def __getattr__(self, name):
        value = getattr(_pynvml, name)
        if not callable(value) or name.startswith(READ_PREFIXES):
            return value
        raise PermissionError(f"read-only probe: NVML call {name} is not allowed here")


pynvml = ReadOnlyNvml()

POWER_INSTANT = getattr(pynvml, "NVML_FI_DEV_POWER_INSTANT", 186)  # nvml.h: instant power, Hopper and newer


def instant_w(handle):
    try:
        value = pynvml.nvmlDeviceGetFieldValues(handle, [POWER_INSTANT])[0]
        if value.nvmlReturn != pynvml.NVML_SUCCESS:
            return None
        return value.value.uiVal / 1000.0
    except pynvml.NVMLError:
        return None


def trapezoid(samples, key):
    points = [(t, s[key]) for t, s in samples if s[key] is not None]
    return sum((t1 - t0) * (a + b) / 2 for (t0, a), (t1, b) in zip(points, points[1:])), points


def measure(handle, seconds, interval_s, load=None):
    samples = []
    stop = threading.Event()
    worker = None
    if load is not None:
        worker = threading.Thread(target=load, args=(stop,), daemon=True)
        worker.start()
        time.sleep(2.0)  # the kernels are running and the clocks up before the window opens
    e0, t0 = pynvml.nvmlDeviceGetTotalEnergyConsumption(handle), time.monotonic()
    while True:
        now = time.monotonic()
        samples.append((now, {"average": pynvml.nvmlDeviceGetPowerUsage(handle) / 1000.0,
                              "instant": instant_w(handle)}))
        if now - t0 >= seconds:
            break
        time.sleep(max(0.0, interval_s - (time.monotonic() - now)))
    e1, t1 = pynvml.nvmlDeviceGetTotalEnergyConsumption(handle), time.monotonic()
    if worker is not None:
        stop.set()
        worker.join(30)
    counter_j = (e1 - e0) / 1000.0
    out = {"seconds": t1 - t0, "samples": len(samples), "counter_j": counter_j,
           "counter_mean_w": counter_j / (t1 - t0)}
    for key in ("average", "instant"):
        joules, points = trapezoid(samples, key)
        if len(points) < 2:
            out[key] = None
            continue
        # the integral spans the first to the last sample; scale it to the counter's window
        span = points[-1][0] - points[0][0]
        joules *= (t1 - t0) / span if span else 1.0
        out[key] = {"integral_j": joules, "mean_w": joules / (t1 - t0),
                    "difference_pct": (joules - counter_j) / counter_j * 100 if counter_j else None}
    return out


def matmul_load(gpu):
    import torch

    device = torch.device(f"cuda:{gpu}")
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device=device)
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device=device)

    def run(stop):
        while not stop.is_set():
            for _ in range(20):
                a @ b
            torch.cuda.synchronize(device)
    return run


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpu", type=int, default=0)
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--interval-ms", type=float, default=25.0)
    args = parser.parse_args()
    pynvml.nvmlInit()
    try:
        handle = pynvml.nvmlDeviceGetHandleByIndex(args.gpu)
        name = pynvml.nvmlDeviceGetName(handle)
        result = {"gpu": args.gpu, "name": name.decode() if isinstance(name, bytes) else name,
                  "driver": pynvml.nvmlSystemGetDriverVersion(),
                  "power_limit_w": pynvml.nvmlDeviceGetPowerManagementLimit(handle) / 1000.0,
                  "interval_ms": args.interval_ms}
        result["idle"] = measure(handle, args.seconds, args.interval_ms / 1e3)
        result["matmul_bf16"] = measure(handle, args.seconds, args.interval_ms / 1e3, matmul_load(args.gpu))
        worst = [abs(w[k]["difference_pct"]) for w in (result["idle"], result["matmul_bf16"])
                 for k in ("average", "instant") if w.get(k) and w[k]["difference_pct"] is not None]
        result["within_3_pct"] = {k: all(abs(w[k]["difference_pct"]) <= 3 for w in (result["idle"],
                                                                                     result["matmul_bf16"]) if w.get(k))
                                  for k in ("average", "instant")}
        result["worst_difference_pct"] = max(worst) if worst else None
    finally:
        pynvml.nvmlShutdown()
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
