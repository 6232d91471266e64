"""Read-only facts for issues 54 and 56 on GPU 0: its graphics clocks' range (in P0 too), and NVML's total-energy
counter: how often it steps, by how much, and against the trapezoid of the power readings, polled as fast as NVML
answers, for 8 s each: bare idle, a CUDA context at rest, a bf16 matmul loop, the context after it. Only
nvmlDeviceGet*/nvmlSystemGet* calls: nothing is set.

    python3 tests/hardware/energy_steps_readonly.py      (needs nvidia-ml-py and torch; writes $OUT/energy.json)

Results: benchmarks/RESULTS.md section 30."""
import json, os, sys, time, threading
import pynvml as N

N.nvmlInit()
h = N.nvmlDeviceGetHandleByIndex(0)
out = {"name": N.nvmlDeviceGetName(h), "driver": N.nvmlSystemGetDriverVersion()}
try:
    mems = N.nvmlDeviceGetSupportedMemoryClocks(h)
    out["memory_clocks"] = mems
    out["graphics_clocks_minmax"] = [min(c := N.nvmlDeviceGetSupportedGraphicsClocks(h, mems[0])), max(c)]
    out["graphics_clocks_count"] = len(c)
    out["graphics_clocks_lowest5"] = sorted(c)[:5]
except N.NVMLError as e:
    out["clocks_error"] = str(e)
for name in ("nvmlDeviceGetMinMaxClockOfPState",):
    f = getattr(N, name, None)
    if f:
        try:
            out["pstate0_graphics_minmax"] = f(h, N.NVML_CLOCK_GRAPHICS, N.NVML_PSTATE_0)
        except N.NVMLError as e:
            out["pstate0_error"] = str(e)
try:
    out["locked_clocks_now"] = str(N.nvmlDeviceGetClockInfo(h, N.NVML_CLOCK_SM))
except N.NVMLError as e:
    out["sm_error"] = str(e)


def phase(label, seconds):
    """Poll energy (mJ) and power (mW) as fast as NVML answers for `seconds`: the counter's steps, and the
    trapezoid of power against the counter's delta."""
    t0 = time.monotonic()
    e0 = N.nvmlDeviceGetTotalEnergyConsumption(h)
    last_e, last_change = e0, t0
    steps, polls, power = [], 0, []
    while time.monotonic() - t0 < seconds:
        now = time.monotonic()
        e = N.nvmlDeviceGetTotalEnergyConsumption(h)
        p = N.nvmlDeviceGetPowerUsage(h)
        polls += 1
        power.append((now, p / 1000.0))
        if e != last_e:
            steps.append((now - last_change, e - last_e))
            last_e, last_change = e, now
    t1 = time.monotonic()
    e1 = N.nvmlDeviceGetTotalEnergyConsumption(h)
    integral = sum((b[0] - a[0]) * (a[1] + b[1]) / 2 for a, b in zip(power, power[1:]))
    gaps = sorted(s[0] for s in steps[1:]) or [0]
    sizes = sorted(s[1] for s in steps[1:]) or [0]
    out[label] = {"seconds": round(t1 - t0, 3), "polls": polls, "counter_j": (e1 - e0) / 1000.0,
                  "power_integral_j": round(integral, 3), "mean_w": round(integral / (power[-1][0] - power[0][0]), 2),
                  "counter_steps": len(steps), "step_gap_ms_p10_p50_p90": [round(1000 * gaps[int(q * (len(gaps) - 1))], 1) for q in (0.1, 0.5, 0.9)],
                  "step_mj_min_p50_max": [sizes[0], sizes[len(sizes) // 2], sizes[-1]]}


phase("bare_idle", 8)
import torch
x = torch.ones(1, device="cuda")  # a context
torch.cuda.synchronize()
time.sleep(3)
phase("context_at_rest", 8)
a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
stop = threading.Event()


def burn():
    while not stop.is_set():
        for _ in range(20):
            a @ b
        torch.cuda.synchronize()


t = threading.Thread(target=burn, daemon=True)
t.start()
time.sleep(1)
phase("matmul_load", 8)
stop.set()
t.join()
torch.cuda.synchronize()
time.sleep(2)
phase("context_after_load", 6)
print(json.dumps(out, indent=1))
os.makedirs(os.environ.get("OUT", "/tmp/out"), exist_ok=True)
open(os.path.join(os.environ.get("OUT", "/tmp/out"), "energy.json"), "w").write(json.dumps(out, indent=1))
