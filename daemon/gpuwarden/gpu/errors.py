"""Errors every GPU backend raises, named after the NVML return codes they mirror.

The simulator raises these same classes, so code above gpu/ handles a real
card and a simulated one identically.
"""

from __future__ import annotations


class GpuError(Exception):
    """A GPU call failed. `nvml_code` is the NVML return code it corresponds to."""

    nvml_code = 999
    nvml_name = "NVML_ERROR_UNKNOWN"

    def __init__(self, message: str):
        super().__init__(message)


class NotSupported(GpuError):
    nvml_code, nvml_name = 3, "NVML_ERROR_NOT_SUPPORTED"


class NoPermission(GpuError):
    nvml_code, nvml_name = 4, "NVML_ERROR_NO_PERMISSION"


class InvalidArgument(GpuError):
    nvml_code, nvml_name = 2, "NVML_ERROR_INVALID_ARGUMENT"


class GpuLost(GpuError):
    nvml_code, nvml_name = 15, "NVML_ERROR_GPU_IS_LOST"


class Unavailable(GpuError):
    """NVML itself cannot start: no driver, no library, or no GPU."""

    nvml_code, nvml_name = 9, "NVML_ERROR_DRIVER_NOT_LOADED"


BY_CODE = {cls.nvml_code: cls for cls in (NotSupported, NoPermission, InvalidArgument, GpuLost)}
