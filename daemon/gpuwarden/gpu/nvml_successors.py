"""NVML calls that CUDA 14 removes, and the call that replaces each.

nvidia-ml-py 13.615's pynvml.py marks each of these "DEPRECATED ... will be removed in CUDA 14.0". The backend
(gpu/nvml.py, gpu/nvml_counters.py) asks the successor first and the old call only where the driver or the
installed nvidia-ml-py lacks the successor; tests/test_nvml_calls.py fails on a call of an old name whose
successor the package never calls. Checked against pynvml.py (nvidia-ml-py 12.560.30, 12.570.86, 13.580.82,
13.615.71) and on an H200 with driver 580.159.04, where each pair answered the same.
"""

from __future__ import annotations

DEPRECATED = {
    # nvidia-ml-py 12.570+ (not 12.560): the wrapper fills c_nvmlTemperature_v1_t; same (handle, sensor) call.
    "nvmlDeviceGetTemperature": "nvmlDeviceGetTemperatureV",
    # nvidia-ml-py 12.535+: the same bits under the new name.
    "nvmlDeviceGetCurrentClocksThrottleReasons": "nvmlDeviceGetCurrentClocksEventReasons",
    "nvmlDeviceGetSupportedClocksThrottleReasons": "nvmlDeviceGetSupportedClocksEventReasons",
    # "Use nvmlDeviceGetFieldValues instead": NVML_FI_DEV_PERF_POLICY_* (74 + policy), in nvidia-ml-py 10.418+.
    "nvmlDeviceGetViolationStatus": "nvmlDeviceGetFieldValues",
    # nvidia-ml-py 12.550+ (with c_nvmlGpuFabricInfoV_t); the old one read state 0 on a fabric that was up.
    "nvmlDeviceGetGpuFabricInfo": "nvmlDeviceGetGpuFabricInfoV",
    # "Do not use": nvmlDeviceGetClock (nvidia-ml-py 10.418+) with NVML_CLOCK_ID_APP_CLOCK_DEFAULT (2) or
    # _APP_CLOCK_TARGET (1) reads the same clocks (1980 MHz both ways on that H200).
    "nvmlDeviceGetDefaultApplicationsClock": "nvmlDeviceGetClock",
    "nvmlDeviceGetApplicationsClock": "nvmlDeviceGetClock",
    # The setters the tuning uses instead of applications clocks.
    "nvmlDeviceSetApplicationsClocks": "nvmlDeviceSetGpuLockedClocks",
    "nvmlDeviceResetApplicationsClocks": "nvmlDeviceResetGpuLockedClocks",
    "nvmlDeviceSetGpcClkVfOffset": "nvmlDeviceSetClockOffsets",
    "nvmlDeviceSetMemClkVfOffset": "nvmlDeviceSetClockOffsets",
}
