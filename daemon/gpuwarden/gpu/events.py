"""GPU events as they happen: Xid errors, double-bit ECC, a GPU that became unavailable, the driver's recovery
action, DRAM retirement, poisoned memory (contained or not). A source is waited on by one thread
(events.EventWatcher); nothing here logs.

NVML: one event set, each GPU registered for the kinds it supports (nvmlDeviceGetSupportedEventTypes), then
nvmlEventSetWait_v2 with a timeout, so the waiting thread can notice a stop.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

# NVML event type bits (nvml.h nvmlEventType*); the recovery action and unavailable ones need driver 550+.
XID = 0x8
DOUBLE_BIT_ECC = 0x2
DRAM_RETIREMENT = 0x400
DRAM_RETIREMENT_FAILURE = 0x800
# nvmlEventTypeNonFatalPoisonError, nvmlEventTypeFatalPoisonError (pynvml): an uncorrectable error in memory
# that the GPU contained (the process that read it ends, the rest runs on), or could not contain.
NONFATAL_POISON = 0x1000
FATAL_POISON = 0x2000
GPU_UNAVAILABLE = 0x4000
RECOVERY_ACTION = 0x8000
KINDS = {XID: "xid", DOUBLE_BIT_ECC: "double_bit_ecc", GPU_UNAVAILABLE: "gpu_unavailable",
         RECOVERY_ACTION: "recovery_action", DRAM_RETIREMENT: "dram_retirement",
         DRAM_RETIREMENT_FAILURE: "dram_retirement_failure", NONFATAL_POISON: "nonfatal_poison",
         FATAL_POISON: "fatal_poison"}
WANTED = sum(KINDS)
NVML_ERROR_TIMEOUT = 10
# nvmlDeviceGpuRecoveryAction_t: what the driver says must happen next (Xid 154's "recovery action").
# NVML's nvmlDeviceGpuRecoveryAction_t (nvml.h; cuda.bindings.nvml.DeviceGpuRecoveryAction documents each value)
RECOVERY_ACTIONS = {0: "none", 1: "reset the GPU", 2: "reboot the node", 3: "drain its peer-to-peer (NVLink) traffic",
                    4: "drain its peer-to-peer traffic, then reset the GPU", 5: "recover the IMEX domain",
                    6: "reset the GPU's PCIe bus", 7: "reboot the system"}


@dataclass(frozen=True)
class GpuEvent:
    gpu: int  # index
    kind: str  # a value of KINDS
    data: int  # the Xid number for "xid", the action code for "recovery_action"


class NvmlEvents:
    """Waits on NVML's event set for the given GPUs. registered: GPU index -> the kinds it reports."""

    def __init__(self, nvml: Any, handles: dict[int, Any], uuids: dict[str, int]):
        self.nvml = nvml
        self.registered: dict[int, list[str]] = {}
        self._uuids = uuids  # an event names its device by handle; our index is by PCI order, so by UUID
        self._set = nvml.nvmlEventSetCreate()
        for index, handle in handles.items():
            try:
                supported = nvml.nvmlDeviceGetSupportedEventTypes(handle)
                mask = supported & WANTED
                if mask:
                    nvml.nvmlDeviceRegisterEvents(handle, mask, self._set)
            except nvml.NVMLError:
                continue  # this GPU reports no events (or is lost): the others still do
            self.registered[index] = [name for bit, name in KINDS.items() if mask & bit]

    def wait(self, timeout_s: float) -> list[GpuEvent]:
        """The next event, or [] after timeout_s."""
        try:
            data = self.nvml.nvmlEventSetWait_v2(self._set, int(timeout_s * 1000))
        except self.nvml.NVMLError as exc:
            if getattr(exc, "value", None) == NVML_ERROR_TIMEOUT:
                return []
            raise
        kind = KINDS.get(int(data.eventType))
        if kind is None:
            return []
        try:
            uuid = self.nvml.nvmlDeviceGetUUID(data.device)
            index = self._uuids.get(uuid.decode() if isinstance(uuid, bytes) else uuid, -1)
        except self.nvml.NVMLError:
            index = -1  # a GPU that fell off the bus may not answer: -1 is "a GPU we cannot name"
        return [GpuEvent(index, kind, int(data.eventData))]

    def close(self) -> None:
        with contextlib.suppress(self.nvml.NVMLError):
            self.nvml.nvmlEventSetFree(self._set)
