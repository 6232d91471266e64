"""Cost of each NVML read gpuwarden makes, on a real GPU (read-only).

    python3 benchmarks/nvml_call_cost.py [REPEATS]

Prints the median and p90 microseconds per call, slowest first, so the poll
loop can keep slow reads out of every sample.
"""

import statistics
import sys
import time

import pynvml as n


def main(repeats: int) -> None:
    n.nvmlInit()
    h = n.nvmlDeviceGetHandleByIndex(0)
    calls = {
        "ClockInfo(SM)": lambda: n.nvmlDeviceGetClockInfo(h, n.NVML_CLOCK_SM),
        "ClockInfo(MEM)": lambda: n.nvmlDeviceGetClockInfo(h, n.NVML_CLOCK_MEM),
        "MaxClockInfo(SM)": lambda: n.nvmlDeviceGetMaxClockInfo(h, n.NVML_CLOCK_SM),
        "PowerUsage": lambda: n.nvmlDeviceGetPowerUsage(h),
        "EnforcedPowerLimit": lambda: n.nvmlDeviceGetEnforcedPowerLimit(h),
        "PowerManagementLimitConstraints": lambda: n.nvmlDeviceGetPowerManagementLimitConstraints(h),
        "PowerManagementDefaultLimit": lambda: n.nvmlDeviceGetPowerManagementDefaultLimit(h),
        "Temperature": lambda: n.nvmlDeviceGetTemperature(h, n.NVML_TEMPERATURE_GPU),
        "UtilizationRates": lambda: n.nvmlDeviceGetUtilizationRates(h),
        "MemoryInfo": lambda: n.nvmlDeviceGetMemoryInfo(h),
        "PersistenceMode": lambda: n.nvmlDeviceGetPersistenceMode(h),
        "PerformanceState": lambda: n.nvmlDeviceGetPerformanceState(h),
        "CurrentClocksEventReasons": lambda: n.nvmlDeviceGetCurrentClocksEventReasons(h),
        "ViolationStatus(POWER)": lambda: n.nvmlDeviceGetViolationStatus(h, n.NVML_PERF_POLICY_POWER),
        "TotalEnergyConsumption": lambda: n.nvmlDeviceGetTotalEnergyConsumption(h),
        "MemoryBusWidth": lambda: n.nvmlDeviceGetMemoryBusWidth(h),
    }
    rows = []
    for name, call in calls.items():
        call()
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            call()
            times.append((time.perf_counter() - t) * 1e6)
        times.sort()
        rows.append((statistics.median(times), times[int(len(times) * 0.9)], name))
    for median, p90, name in sorted(rows, reverse=True):
        print(f"{name:34s} median {median:9.1f} us   p90 {p90:9.1f} us")
    n.nvmlShutdown()


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 50)
