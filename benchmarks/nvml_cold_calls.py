"""What each NVML read of a poll costs when asked once a second, as the daemon asks (read-only).

    PYTHONPATH=daemon python3 benchmarks/nvml_cold_calls.py [--polls 30]

benchmarks/nvml_call_cost.py times each call back to back, where NVML answers in a few µs; spaced a second
apart, the first call of a poll and two others cost far more. The calls run in the poll's order, then in
reverse, so that "first" and "expensive" can be told apart. Needs a GPU host.
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "hardware"))

from nvml_readonly import ReadOnlyNvml  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--polls", type=int, default=30)
    args = parser.parse_args()
    n = ReadOnlyNvml()
    try:
        n.nvmlInit()
    except n.NVMLError as exc:
        raise SystemExit(f"nvml_cold_calls: needs an NVIDIA GPU host: {exc}") from None
    h = n.nvmlDeviceGetHandleByIndex(0)
    calls = [("ClockInfo SM", lambda: n.nvmlDeviceGetClockInfo(h, 1)),
             ("ClockInfo MEM", lambda: n.nvmlDeviceGetClockInfo(h, 2)),
             ("ClockInfo GR", lambda: n.nvmlDeviceGetClockInfo(h, 0)),
             ("PowerUsage", lambda: n.nvmlDeviceGetPowerUsage(h)),
             ("EnforcedPowerLimit", lambda: n.nvmlDeviceGetEnforcedPowerLimit(h)),
             ("UtilizationRates", lambda: n.nvmlDeviceGetUtilizationRates(h)),
             ("MemoryInfo", lambda: n.nvmlDeviceGetMemoryInfo(h)),
             ("PersistenceMode", lambda: n.nvmlDeviceGetPersistenceMode(h)),
             ("Temperature", lambda: n.nvmlDeviceGetTemperature(h, 0)),
             ("PerformanceState", lambda: n.nvmlDeviceGetPerformanceState(h)),
             ("ClocksEventReasons", lambda: n.nvmlDeviceGetCurrentClocksEventReasons(h))]
    for order, seq in (("in the poll's order", calls), ("reversed", calls[::-1])):
        times = {name: [] for name, _ in seq}
        for _ in range(args.polls):
            time.sleep(1.0)
            for name, fn in seq:
                start = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - start)
        print(f"{order}: " + " | ".join(f"{k} {statistics.median(v) * 1e6:.0f} µs" for k, v in times.items()))


if __name__ == "__main__":
    main()
