"""The settings of an NVML GPU: persistence mode, locked clocks, the power limit (never called in read-only mode).

NvmlSettings is a part of NvmlGpu (gpu/nvml.py), whose nvml, handle, index and uuid it uses.
"""

from __future__ import annotations

from typing import Any

from . import errors


class NvmlSettings:
    """Gpu's setters through NVML, each failure turned into our error classes with a hint."""

    nvml: Any
    handle: Any
    index: int
    uuid: str

    def set_persistence_mode(self, enabled: bool) -> None:
        self._set("setting persistence mode", "nvmlDeviceSetPersistenceMode", 1 if enabled else 0)

    def set_gpu_locked_clocks(self, min_mhz: int, max_mhz: int) -> None:
        self._set(f"locking GPU clocks to {min_mhz}-{max_mhz} MHz", "nvmlDeviceSetGpuLockedClocks", min_mhz, max_mhz)

    def reset_gpu_locked_clocks(self) -> None:
        self._set("resetting locked GPU clocks", "nvmlDeviceResetGpuLockedClocks")

    def set_memory_locked_clocks(self, min_mhz: int, max_mhz: int) -> None:
        self._set(f"locking memory clocks to {min_mhz}-{max_mhz} MHz", "nvmlDeviceSetMemoryLockedClocks",
                  min_mhz, max_mhz)

    def reset_memory_locked_clocks(self) -> None:
        self._set("resetting locked memory clocks", "nvmlDeviceResetMemoryLockedClocks")

    def set_power_limit_w(self, watts: float) -> None:
        self._set(f"setting the power limit to {watts:g} W", "nvmlDeviceSetPowerManagementLimit",
                  int(round(watts * 1000)))

    def _set(self, what: str, fn_name: str, *args: Any) -> None:
        """One NVML setter, with its failure turned into our error classes."""
        try:
            getattr(self.nvml, fn_name)(self.handle, *args)
        except self.nvml.NVMLError as exc:
            code = getattr(exc, "value", None)
            cls = errors.BY_CODE.get(code, errors.GpuError)
            hint = {
                errors.NoPermission: "needs root or CAP_SYS_ADMIN",
                errors.NotSupported: "is not supported on this GPU",
                errors.InvalidArgument: "was rejected as out of range",
                errors.GpuLost: "failed: the GPU is lost",
            }.get(cls, f"failed: {exc}")
            raise cls(f"GPU {self.index} ({self.uuid}): {what} {hint} ({cls.nvml_name})") from None
