"""What an NVML GPU reads every counters_interval_s rather than every poll: the cumulative counters, the power
limits, and the link and memory health, as many as the driver allows in one nvmlDeviceGetFieldValues call.

NvmlGpu (gpu/nvml.py) holds one NvmlCounters and publishes its latest values in every sample; every NVML call
still goes through NvmlGpu._read, the seam.
"""

from __future__ import annotations

import ctypes
from typing import Any

from . import errors
from .base import NVLINK_ERRORS, VIOLATION_POLICIES, GpuHealth, NvLink
from .nvml_gpm import NvmlGpm
from .nvml_values import error_name, scaled

ECC_UNCORRECTED, ECC_VOLATILE = 1, 0  # NVML_MEMORY_ERROR_TYPE_UNCORRECTED, NVML_VOLATILE_ECC
PAGE_RETIRED_SBE, PAGE_RETIRED_DBE = 0, 1  # NVML_PAGE_RETIREMENT_CAUSE_*
# nvmlDeviceGetFieldValues reads the counters in one call; a field the GPU does not support comes back with
# its own error and is read the old way. Field ids from nvml.h (NVML_FI_DEV_*). On a lent H100 this took a
# poll with the counters from 11.4 to 6.4 ms; the per-poll fields gained nothing from it (275 against
# 318 µs, benchmarks/RESULTS.md), so those stay single calls.
COUNTER_FIELDS = {
    "energy_mj": 83,  # TOTAL_ENERGY_CONSUMPTION
    **{f"violation_ns:{name}": 74 + policy for name, policy in VIOLATION_POLICIES.items()},  # PERF_POLICY_*
    "min_limit_mw": 187, "max_limit_mw": 188, "default_limit_mw": 189,  # POWER_MIN/MAX/DEFAULT_LIMIT
    "pcie_replays": 94,  # PCIE_REPLAY_COUNTER
    "ecc_uncorrected": 4,  # ECC_DBE_VOL_TOTAL
    "remapped_cor": 142, "remapped_unc": 143, "remap_pending": 144, "remap_failure": 145,  # REMAPPED_*
    "memory_temp_c": 82,  # MEMORY_TEMP: HBM's sensor; no single call reads it, so batched or not at all
    # NVML_FI_DEV_GET_GPU_RECOVERY_ACTION (nvidia-ml-py 13.615): what the driver says must happen to the GPU now
    # (nvmlDeviceGpuRecoveryAction_t, gpu/events.RECOVERY_ACTIONS). Batched or not at all, like MEMORY_TEMP; a
    # driver from before it answers NOT_SUPPORTED (or INVALID_ARGUMENT for an id it does not know) once.
    "recovery_action": 230,
}
# NVLink, per link: one field each, with the link as its scope (pynvml takes (field id, scope id) pairs):
# NVML_FI_DEV_NVLINK_ERROR_DL_REPLAY 161, _DL_RECOVERY 162, _DL_CRC 163, NVML_FI_DEV_NVLINK_GET_SPEED 164 (MB/s),
# NVML_FI_DEV_NVLINK_GET_STATE 165. The _COUNT_TOTAL fields (38, 45, 52, 59) answer NOT_SUPPORTED on an H100
# with driver 580, where these answer. Where they do not, nvmlDeviceGetNvLinkState and
# nvmlDeviceGetNvLinkErrorCounter (NVML_NVLINK_ERROR_DL_REPLAY 0, _RECOVERY 1, _CRC_FLIT 2) are asked per link.
# On that H100 the three error fields cost ~0.75 ms per link each (16.5 ms for 18 links in one batch), state
# and speed 0.02 ms: so they are read with the counters, every counters_interval_s (benchmarks/RESULTS.md 14).
NVLINK_FIELDS = {"replay": 161, "recovery": 162, "crc": 163, "speed": 164, "state": 165}
NVLINK_COUNTERS = {"replay": 0, "recovery": 1, "crc": 2}
NVLINK_STATES = {0: "down", 1: "up", 2: "sleep", 3: "off"}  # NVML_NVLINK_STATE_INACTIVE, ACTIVE, SLEEP, ..._DISABLED
NVLINK_SWITCH = 2  # NVML_NVLINK_DEVICE_TYPE_SWITCH (nvmlDeviceGetNvLinkRemoteDeviceType)
FABRIC_STATES = {1: "not_started", 2: "in_progress", 3: "completed"}  # NVML_GPU_FABRIC_STATE_*; 0: no fabric
# A field's own status that will not change: unsupported here, or an id this driver does not know (newer than it).
DEAD_FIELD_CODES = (errors.NotSupported.nvml_code, errors.InvalidArgument.nvml_code)
VALUE_FIELDS = ("dVal", "uiVal", "ulVal", "ullVal", "sllVal", "siVal", "usVal")  # by nvmlValueType_t


class NvmlCounters:
    """One GPU's slow reads, and their latest values."""

    def __init__(self, gpu: Any):  # its NvmlGpu: the seam, the batching switch, its NVLink links and their far ends
        self.gpu = gpu
        self._read = gpu._read  # every call through the one seam, with its cache of what is unsupported
        self.energy: float | None = None
        self.violations: dict[str, float | None] = {}
        self.limits: tuple = (None, None)  # (power constraints, default limit)
        self.health = GpuHealth()
        self.memory_temperature: float | None = None
        self._dead_fields: set = set()  # batched fields that answered NOT_SUPPORTED: not asked for again
        self.gpm = NvmlGpm(gpu)  # GPM's SM, tensor and DRAM activity (Hopper on): read here, with the counters

    def read(self) -> None:
        """The slow cumulative counters (energy ~4 ms, violations ~0.8 ms each as single calls), the power
        limits, and the link and memory health, which change seldom: every counters_interval_s, not every
        poll, and as many as the driver allows in one batched call."""
        per_link = {f"nvlink:{link}:{kind}": (field, link)
                    for link in self.gpu.links for kind, field in NVLINK_FIELDS.items()}
        fields = self._fields({**COUNTER_FIELDS, **per_link})
        self.energy = scaled(self._field_or_read(fields, "energy_mj", "nvmlDeviceGetTotalEnergyConsumption"), 1e-3)
        for name, policy in VIOLATION_POLICIES.items():
            ns = fields.get(f"violation_ns:{name}")
            # nvmlDeviceGetViolationStatus is gone in CUDA 14 (gpu/nvml_successors.py): asked only where the
            # field values call or this field is missing, never for a batch that failed this once.
            if ns is None and not self._has_field(COUNTER_FIELDS[f"violation_ns:{name}"]):
                status = self._read("nvmlDeviceGetViolationStatus", policy)
                ns = status.violationTime if status is not None else None
            self.violations[name] = ns * 1e-9 if ns is not None else None
        low, high = fields.get("min_limit_mw"), fields.get("max_limit_mw")
        constraints = (low, high) if low is not None and high is not None else \
            self._read("nvmlDeviceGetPowerManagementLimitConstraints")
        self.limits = (constraints, self._field_or_read(fields, "default_limit_mw",
                                                        "nvmlDeviceGetPowerManagementDefaultLimit"))
        self.health = self._read_health(fields)
        self.memory_temperature = fields.get("memory_temp_c")
        self.gpm.read()  # paired with the last read: each figure is the mean over the interval between them

    def _fields(self, wanted: dict[str, int | tuple[int, int]]) -> dict[str, float]:
        """wanted's fields (an id, or (id, scope) for a per-link one) in one nvmlDeviceGetFieldValues call, by
        name; a field that this GPU or driver does not support is left out (the caller reads it the old way,
        and it is not asked for again), and so is everything when the call itself is missing or batching is
        off (NvmlBackend.batched)."""
        if not self.gpu.backend.batched:
            return {}
        wanted = {name: field for name, field in wanted.items() if field not in self._dead_fields}
        values = self._read("nvmlDeviceGetFieldValues", tuple(wanted.values()))
        if values is None:
            return {}
        out = {}
        for (name, field), value in zip(wanted.items(), values, strict=False):
            if value.nvmlReturn == 0 and 0 <= value.valueType < len(VALUE_FIELDS):
                out[name] = getattr(value.value, VALUE_FIELDS[value.valueType])
            elif value.nvmlReturn in DEAD_FIELD_CODES:
                self._dead_fields.add(field)
        return out

    def _has_field(self, field: int) -> bool:
        """Whether this driver answers field through nvmlDeviceGetFieldValues (as far as we know yet);
        batching off reads as a driver without the call."""
        return self.gpu.backend.batched and not self.gpu.lacks("nvmlDeviceGetFieldValues") and \
            field not in self._dead_fields

    def _field_or_read(self, fields: dict[str, float], name: str, fn_name: str, *args: Any) -> Any:
        """The batched value when the batch had it, else the single NVML call."""
        return fields[name] if name in fields else self._read(fn_name, *args)

    def _read_health(self, fields: dict[str, float]) -> GpuHealth:
        r = self._read
        batched = ("remapped_cor", "remapped_unc", "remap_pending", "remap_failure")
        rows = tuple(int(fields[k]) for k in batched) if all(k in fields for k in batched) else \
            r("nvmlDeviceGetRemappedRows")  # (correctable, uncorrectable, pending, failure): Ampere and later
        retired = pending = None
        if rows is None:  # older GPUs retire pages instead
            pages = [r("nvmlDeviceGetRetiredPages", cause) for cause in (PAGE_RETIRED_SBE, PAGE_RETIRED_DBE)]
            if any(p is not None for p in pages):
                retired = sum(len(p) for p in pages if p is not None)
            pending = r("nvmlDeviceGetRetiredPagesPendingStatus")
        return GpuHealth(
            pcie_generation=r("nvmlDeviceGetCurrPcieLinkGeneration"),
            pcie_generation_max=r("nvmlDeviceGetMaxPcieLinkGeneration"),
            pcie_width=r("nvmlDeviceGetCurrPcieLinkWidth"),
            pcie_width_max=r("nvmlDeviceGetMaxPcieLinkWidth"),
            pcie_replays=self._field_or_read(fields, "pcie_replays", "nvmlDeviceGetPcieReplayCounter"),
            ecc_uncorrected=self._field_or_read(fields, "ecc_uncorrected", "nvmlDeviceGetTotalEccErrors",
                                                ECC_UNCORRECTED, ECC_VOLATILE),
            remapped_rows_correctable=rows[0] if rows else None,
            remapped_rows_uncorrectable=rows[1] if rows else None,
            remap_pending=bool(rows[2]) if rows else None,
            remap_failure=bool(rows[3]) if rows else None,
            retired_pages=retired,
            retire_pending=bool(pending) if pending is not None else None,
            nvlinks=tuple(self._nvlink(link, fields) for link in self.gpu.links),
            **self._fabric(),
            recovery_action=int(fields["recovery_action"]) if "recovery_action" in fields else None,
        )

    def _nvlink(self, link: int, fields: dict[str, float]) -> NvLink:
        """One link's state and error counters: from the batch, else asked one by one."""
        state = fields.get(f"nvlink:{link}:state")
        if state is None:
            active = self._read("nvmlDeviceGetNvLinkState", link)
            state = None if active is None else int(bool(active))
        # A link NVML did not answer for this time is not a link down: no alert on a failed read.
        state_name = NVLINK_STATES.get(int(state), "unknown") if state is not None else "unknown"
        if link not in self.gpu.remote and state_name == "up":
            self.gpu.find_remote(link)  # it came up since: now it can say where it goes
        bus, kind = self.gpu.remote.get(link, (None, None))
        peer = self.gpu.peer_names.get(bus) or ("NVSwitch" if kind == NVLINK_SWITCH else bus)
        counts = {}
        for name in NVLINK_ERRORS:
            value = fields.get(f"nvlink:{link}:{name}")
            if value is None:
                value = self._read("nvmlDeviceGetNvLinkErrorCounter", link, NVLINK_COUNTERS[name])
            counts[name] = int(value) if value is not None else None
        speed = fields.get(f"nvlink:{link}:speed")
        return NvLink(link, state_name, peer, int(speed) if speed else None, **counts)

    def _fabric(self) -> dict:
        """The NVSwitch fabric's state through the versioned call (the old nvmlDeviceGetGpuFabricInfo answered
        state 0 on an H100 whose nvidia-smi -q said Completed): {} where there is no fabric."""
        struct = getattr(self.gpu.nvml, "c_nvmlGpuFabricInfoV_t", None)
        if struct is None:
            return {}
        info = struct()
        if self._read("nvmlDeviceGetGpuFabricInfoV", ctypes.byref(info)) is None:
            return {}
        state = FABRIC_STATES.get(int(info.state))
        if state is None:
            return {}
        error = None
        if state == "completed" and int(info.status) != 0:
            error = error_name(self.gpu.nvml, int(info.status))
        return {"fabric": state, "fabric_error": error}
