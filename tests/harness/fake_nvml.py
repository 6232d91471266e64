"""A stand-in for the `pynvml` module: the calls NvmlBackend makes, over plain dicts.

Errors are injected per call name (and optionally per device) with NVML's own
return codes, so the tests exercise the backend's real error handling.

By default it is a driver and an nvidia-ml-py that have both each deprecated call and its successor
(gpuwarden.gpu.nvml_successors.DEPRECATED). driver_lacks names calls that answer FUNCTION_NOT_FOUND, as pynvml
does against an older libnvidia-ml (or, with the old names, a CUDA 14 driver that removed them); pynvml_lacks
names calls the module itself does not have, as an older nvidia-ml-py.
"""

import ctypes
import time
from collections import Counter
from types import SimpleNamespace

from harness.fake_gpm import FakeGpm

NOT_SUPPORTED, NO_PERMISSION, INVALID_ARGUMENT, GPU_IS_LOST = 3, 4, 2, 15
FUNCTION_NOT_FOUND, LIBRARY_NOT_FOUND, UNKNOWN = 13, 12, 999


class NVMLError(Exception):
    def __init__(self, value):
        self.value = value
        super().__init__(value)

    def __str__(self):
        return {3: "Not Supported", 4: "Insufficient Permissions", 2: "Invalid Argument", 15: "GPU is lost",
                13: "Function Not Found", 12: "NVML Shared Library Not Found"}.get(self.value, "Unknown Error")


def device(uuid, bus, **over):
    """An H100-like device record; `over` replaces any field."""
    dev = dict(uuid=uuid.encode(), name=b"NVIDIA H100 80GB HBM3", busId=bus.encode(), cc=(9, 0),
               clocks={0: 1980, 1: 1980, 2: 2619}, max_clocks={0: 1980, 1: 1980, 2: 2619},
               power_mw=312_500, limit_mw=700_000, constraints=(200_000, 700_000), default_mw=700_000,
               temp=41, util=(97, 60), mem=(40 * 2**30, 80 * 2**30), reserved=616 * 2**20, persistence=0, pstate=0,
               reasons=0x4, violations={0: 5_000_000_000, 1: 0, 2: 0, 3: 0, 4: 0, 5: 0},
               energy_mj=123_456_789, bus_width=5120, mem_clocks=[2619, 1593],
               graphics_clocks=[1980, 1965, 210], gpu_lock=None, mem_lock=None,
               pcie=(5, 5, 16, 16), replays=0, ecc_uncorrected=0, remapped=(0, 0, 0, 0), retired=None,
               retire_pending=None,  # health: remapped rows on Ampere and later, retired pages before
               nvlinks=None,  # a list of nvlink(...) records; None: no NVLink (NOT_SUPPORTED)
               nvlink_fields=True,  # the per-link fields 161-165 answer (else only the per-link calls do)
               fabric=None,  # (state, status) of nvmlDeviceGetGpuFabricInfoV; None: NOT_SUPPORTED
               brand=14, module_id=1, default_app_clock=1755, c2c=None,  # an SXM H100: brand NVIDIA, module 1
               mem_temp=None,  # NVML_FI_DEV_MEMORY_TEMP (field 82) in C; None: NOT_SUPPORTED
               recovery_action=None)  # NVML_FI_DEV_GET_GPU_RECOVERY_ACTION (230); None: NOT_SUPPORTED
    dev.update(over)
    return dev


def nvlink(remote, state=1, speed=26562, replay=0, recovery=0, crc=0, remote_type=0):
    """One NVLink link's record: the far end's PCI bus id and its device type (0 GPU, 2 NVSwitch)."""
    return dict(remote=remote.encode(), remote_type=remote_type, state=state, speed=speed, replay=replay,
                recovery=recovery, crc=crc)


class FabricInfo(ctypes.Structure):
    """The part of pynvml's c_nvmlGpuFabricInfoV_t the backend reads (filled through ctypes.byref)."""

    _fields_ = [("version", ctypes.c_uint), ("status", ctypes.c_uint), ("state", ctypes.c_uint)]


class FakeNvml(FakeGpm):  # GPM's calls: tests/harness/fake_gpm.py
    NVMLError = NVMLError
    nvmlMemory_v2 = 0x02000028  # pynvml's version word for nvmlDeviceGetMemoryInfo_v2
    c_nvmlGpuFabricInfoV_t = FabricInfo

    def __init__(self, devices, ancestors=None, driver_lacks=(), pynvml_lacks=()):
        self.devices = devices
        self.driver_lacks = set(driver_lacks)
        self.pynvml_lacks = set(pynvml_lacks)
        self.ancestors = ancestors or {}  # frozenset of two NVML indices -> topology level (default host bridge)
        self.fail = {}  # (call name, device index or None) -> NVML return code
        self.calls = Counter()
        self.inits = 0
        self.events = []  # (device index, NVML event type, event data), handed out by nvmlEventSetWait_v2

    def __getattribute__(self, name):
        if name.startswith("nvml") and name in object.__getattribute__(self, "pynvml_lacks"):
            raise AttributeError(name)  # an nvidia-ml-py from before the call
        return object.__getattribute__(self, name)

    # -- helpers ----------------------------------------------------------------
    def _check(self, name, index=None):
        self.calls[name] += 1
        if name in self.driver_lacks:
            raise NVMLError(FUNCTION_NOT_FOUND)
        for key in ((name, index), (name, None)):
            if key in self.fail:
                raise NVMLError(self.fail[key])

    def _dev(self, name, handle):
        self._check(name, handle.index)
        if self.devices[handle.index].get("lost"):
            raise NVMLError(GPU_IS_LOST)
        return self.devices[handle.index]

    # -- library ----------------------------------------------------------------
    def nvmlInit(self):
        self._check("nvmlInit")
        self.inits += 1

    def nvmlShutdown(self):
        self._check("nvmlShutdown")

    def nvmlSystemGetDriverVersion(self):
        return "580.126.20"

    def nvmlDeviceGetCount(self):
        return len(self.devices)

    def nvmlDeviceGetHandleByIndex(self, index):
        return SimpleNamespace(index=index)

    def nvmlDeviceGetHandleByUUID(self, uuid):
        self._check("nvmlDeviceGetHandleByUUID")
        for i, dev in enumerate(self.devices):
            if dev["uuid"].decode() == uuid and not dev.get("lost"):
                return SimpleNamespace(index=i)
        raise NVMLError(6)

    # -- reads ------------------------------------------------------------------
    def nvmlDeviceGetUUID(self, h): return self._dev("nvmlDeviceGetUUID", h)["uuid"]
    def nvmlDeviceGetName(self, h): return self._dev("nvmlDeviceGetName", h)["name"]
    def nvmlDeviceGetPciInfo(self, h): return SimpleNamespace(busId=self._dev("nvmlDeviceGetPciInfo", h)["busId"])
    def nvmlDeviceGetCudaComputeCapability(self, h): return self._dev("nvmlDeviceGetCudaComputeCapability", h)["cc"]
    def nvmlDeviceGetMemoryBusWidth(self, h): return self._dev("nvmlDeviceGetMemoryBusWidth", h)["bus_width"]
    def nvmlDeviceGetClockInfo(self, h, t): return self._dev("nvmlDeviceGetClockInfo", h)["clocks"][t]
    def nvmlDeviceGetMaxClockInfo(self, h, t): return self._dev("nvmlDeviceGetMaxClockInfo", h)["max_clocks"][t]
    def nvmlDeviceGetPowerUsage(self, h): return self._dev("nvmlDeviceGetPowerUsage", h)["power_mw"]
    def nvmlDeviceGetEnforcedPowerLimit(self, h): return self._dev("nvmlDeviceGetEnforcedPowerLimit", h)["limit_mw"]
    def nvmlDeviceGetPowerManagementDefaultLimit(self, h):
        return self._dev("nvmlDeviceGetPowerManagementDefaultLimit", h)["default_mw"]
    def nvmlDeviceGetPowerManagementLimitConstraints(self, h):
        return list(self._dev("nvmlDeviceGetPowerManagementLimitConstraints", h)["constraints"])
    def nvmlDeviceGetTemperature(self, h, sensor): return self._dev("nvmlDeviceGetTemperature", h)["temp"]
    def nvmlDeviceGetTemperatureV(self, h, sensor, version=0x100000C):  # nvmlTemperature_v1, as pynvml 12.570+
        assert sensor == 0, "NVML_TEMPERATURE_GPU"
        return self._dev("nvmlDeviceGetTemperatureV", h)["temp"]
    def nvmlDeviceGetUtilizationRates(self, h):
        gpu, memory = self._dev("nvmlDeviceGetUtilizationRates", h)["util"]
        return SimpleNamespace(gpu=gpu, memory=memory)
    def nvmlDeviceGetMemoryInfo(self, h, version=None):
        """As NVML: v1 counts the driver's reservation as used; v2 (nvmlMemory_v2) reports it apart."""
        dev = self._dev("nvmlDeviceGetMemoryInfo_v2" if version else "nvmlDeviceGetMemoryInfo", h)
        (used, total), reserved = dev["mem"], dev["reserved"]
        if version:
            return SimpleNamespace(used=used, total=total, reserved=reserved, free=total - used - reserved)
        return SimpleNamespace(used=used + reserved, total=total, free=total - used - reserved)
    def nvmlDeviceGetPersistenceMode(self, h): return self._dev("nvmlDeviceGetPersistenceMode", h)["persistence"]
    def nvmlDeviceGetPerformanceState(self, h): return self._dev("nvmlDeviceGetPerformanceState", h)["pstate"]
    def nvmlDeviceGetCurrentClocksEventReasons(self, h):
        return self._dev("nvmlDeviceGetCurrentClocksEventReasons", h)["reasons"]
    def nvmlDeviceGetCurrentClocksThrottleReasons(self, h):
        return self._dev("nvmlDeviceGetCurrentClocksThrottleReasons", h)["reasons"]
    def nvmlDeviceGetViolationStatus(self, h, policy):
        ns = self._dev("nvmlDeviceGetViolationStatus", h)["violations"][policy]
        return SimpleNamespace(referenceTime=0, violationTime=ns)
    def nvmlDeviceGetTotalEnergyConsumption(self, h):
        return self._dev("nvmlDeviceGetTotalEnergyConsumption", h)["energy_mj"]
    def nvmlDeviceGetSupportedMemoryClocks(self, h):
        return self._dev("nvmlDeviceGetSupportedMemoryClocks", h)["mem_clocks"]
    def nvmlDeviceGetSupportedGraphicsClocks(self, h, mem):
        return self._dev("nvmlDeviceGetSupportedGraphicsClocks", h)["graphics_clocks"]

    def _opt(self, name, h, key):
        """A health field, or NOT_SUPPORTED where the record has None (as the GPU would answer)."""
        value = self._dev(name, h)[key]
        if value is None:
            raise NVMLError(NOT_SUPPORTED)
        return value
    def nvmlDeviceGetCurrPcieLinkGeneration(self, h): return self._opt("nvmlDeviceGetCurrPcieLinkGeneration", h, "pcie")[0]
    def nvmlDeviceGetMaxPcieLinkGeneration(self, h): return self._opt("nvmlDeviceGetMaxPcieLinkGeneration", h, "pcie")[1]
    def nvmlDeviceGetCurrPcieLinkWidth(self, h): return self._opt("nvmlDeviceGetCurrPcieLinkWidth", h, "pcie")[2]
    def nvmlDeviceGetMaxPcieLinkWidth(self, h): return self._opt("nvmlDeviceGetMaxPcieLinkWidth", h, "pcie")[3]
    def nvmlDeviceGetPcieReplayCounter(self, h): return self._opt("nvmlDeviceGetPcieReplayCounter", h, "replays")
    def nvmlDeviceGetTotalEccErrors(self, h, error_type, counter_type):
        assert (error_type, counter_type) == (1, 0), "uncorrected, volatile"
        return self._opt("nvmlDeviceGetTotalEccErrors", h, "ecc_uncorrected")
    def nvmlDeviceGetRemappedRows(self, h): return tuple(self._opt("nvmlDeviceGetRemappedRows", h, "remapped"))
    def nvmlDeviceGetRetiredPages(self, h, cause):
        return list(self._opt("nvmlDeviceGetRetiredPages", h, "retired")[cause])
    def nvmlDeviceGetRetiredPagesPendingStatus(self, h):
        return self._opt("nvmlDeviceGetRetiredPagesPendingStatus", h, "retire_pending")

    # -- NVLink, the fabric, the board and the topology ------------------------------------------------------
    def _link(self, name, h, link):
        links = self._dev(name, h)["nvlinks"]
        if links is None:
            raise NVMLError(NOT_SUPPORTED)
        if not 0 <= link < len(links):
            raise NVMLError(INVALID_ARGUMENT)
        return links[link]
    def nvmlDeviceGetNvLinkState(self, h, link):
        return int(self._link("nvmlDeviceGetNvLinkState", h, link)["state"] == 1)
    def nvmlDeviceGetNvLinkRemotePciInfo(self, h, link):
        return SimpleNamespace(busId=self._link("nvmlDeviceGetNvLinkRemotePciInfo", h, link)["remote"])
    def nvmlDeviceGetNvLinkRemoteDeviceType(self, h, link):
        return self._link("nvmlDeviceGetNvLinkRemoteDeviceType", h, link)["remote_type"]
    def nvmlDeviceGetNvLinkErrorCounter(self, h, link, counter):
        return self._link("nvmlDeviceGetNvLinkErrorCounter", h, link)[("replay", "recovery", "crc")[counter]]
    def nvmlDeviceGetGpuFabricInfoV(self, h, ref):
        fabric = self._dev("nvmlDeviceGetGpuFabricInfoV", h)["fabric"]
        if fabric is None:
            raise NVMLError(NOT_SUPPORTED)
        ref._obj.state, ref._obj.status = fabric
        return 0
    def nvmlErrorString(self, code): return {27: b"Not Ready"}.get(code, b"Unknown Error")
    def nvmlDeviceGetBrand(self, h): return self._dev("nvmlDeviceGetBrand", h)["brand"]
    def nvmlDeviceGetModuleId(self, h): return self._dev("nvmlDeviceGetModuleId", h)["module_id"]
    def nvmlDeviceGetDefaultApplicationsClock(self, h, clock):
        return self._opt("nvmlDeviceGetDefaultApplicationsClock", h, "default_app_clock")
    def nvmlDeviceGetClock(self, h, clock, clock_id):
        """NVML_CLOCK_ID_CURRENT (0), or the applications clock's target (1) and default (2): one value here."""
        if clock_id == 0:
            return self._dev("nvmlDeviceGetClock", h)["clocks"][clock]
        return self._opt("nvmlDeviceGetClock", h, "default_app_clock")
    def nvmlDeviceGetC2cModeInfoV(self, h):
        return SimpleNamespace(isC2cEnabled=self._opt("nvmlDeviceGetC2cModeInfoV", h, "c2c"))
    def nvmlDeviceGetTopologyCommonAncestor(self, h1, h2):
        self._check("nvmlDeviceGetTopologyCommonAncestor")
        return self.ancestors.get(frozenset((h1.index, h2.index)), 30)
    def nvmlDeviceGetP2PStatus(self, h1, h2, index):
        """NVLink peer-to-peer (index 2) is OK (0) between devices a link joins, else NOT_SUPPORTED (5)."""
        self._check("nvmlDeviceGetP2PStatus")
        links = self.devices[h1.index]["nvlinks"] or []
        joined = any(link["remote"] == self.devices[h2.index]["busId"] for link in links)
        return 0 if index == 2 and joined else 5

    def nvmlDeviceGetFieldValues(self, h, field_ids):
        """As NVML: one status per field; valueType 1 (unsigned int) or 3 (unsigned long long). A per-link
        field comes as (field id, link)."""
        dev = self._dev("nvmlDeviceGetFieldValues", h)
        remapped = dev["remapped"]
        known = {83: dev["energy_mj"],
                 **{74 + p: ns for p, ns in dev["violations"].items()},
                 187: dev["constraints"][0], 188: dev["constraints"][1], 189: dev["default_mw"],
                 94: dev["replays"], 4: dev["ecc_uncorrected"], 82: dev["mem_temp"], 230: dev["recovery_action"],
                 **({142 + i: v for i, v in enumerate(remapped)} if remapped is not None else {})}
        known = {k: v for k, v in known.items() if k not in dev.get("unsupported_fields", ())}
        links = dev["nvlinks"] or []
        per_link = {161: "replay", 162: "recovery", 163: "crc", 164: "speed", 165: "state"}
        out = []
        for field in field_ids:
            self.calls[f"field {field}"] += 1
            if isinstance(field, tuple):
                fid, link = field
                ok = dev["nvlink_fields"] and fid in per_link and link < len(links)
                value = links[link][per_link[fid]] if ok else None
            else:
                value = known.get(field)
            code = dev.get("field_errors", {}).get(field)  # a field's own status other than NOT_SUPPORTED
            if value is None or code:
                out.append(SimpleNamespace(fieldId=field, nvmlReturn=code or NOT_SUPPORTED, valueType=0, value=None))
            else:
                out.append(SimpleNamespace(fieldId=field, nvmlReturn=0, valueType=3,
                                           value=SimpleNamespace(ullVal=value)))
        return out

    # -- events: a test queues (device index, event type, data) in .events -------------------------------
    def nvmlEventSetCreate(self):
        self._check("nvmlEventSetCreate")
        self.event_set = SimpleNamespace(registered={}, freed=False)
        return self.event_set
    def nvmlDeviceGetSupportedEventTypes(self, h):
        return self._dev("nvmlDeviceGetSupportedEventTypes", h).get("event_types", 0x8 | 0x2 | 0x4000 | 0x8000 | 0x1000 | 0x2000)
    def nvmlDeviceRegisterEvents(self, h, mask, event_set):
        self._check("nvmlDeviceRegisterEvents", h.index)
        event_set.registered[h.index] = mask
    def nvmlEventSetWait_v2(self, event_set, timeout_ms):
        self._check("nvmlEventSetWait_v2")
        if not self.events:
            time.sleep(min(timeout_ms, 20) / 1000)
            raise NVMLError(10)  # NVML_ERROR_TIMEOUT
        index, event_type, data = self.events.pop(0)
        return SimpleNamespace(device=SimpleNamespace(index=index), eventType=event_type, eventData=data)
    def nvmlEventSetFree(self, event_set):
        event_set.freed = True

    def nvmlDeviceGetComputeRunningProcesses(self, h):
        return [SimpleNamespace(pid=pid, usedGpuMemory=used)
                for pid, used in self._dev("nvmlDeviceGetComputeRunningProcesses", h).get("processes", [])]

    # -- setters ----------------------------------------------------------------
    def nvmlDeviceSetPersistenceMode(self, h, mode): self._dev("nvmlDeviceSetPersistenceMode", h)["persistence"] = mode
    def nvmlDeviceSetPowerManagementLimit(self, h, mw):
        dev = self._dev("nvmlDeviceSetPowerManagementLimit", h)
        if not dev["constraints"][0] <= mw <= dev["constraints"][1]:
            raise NVMLError(INVALID_ARGUMENT)
        dev["limit_mw"] = mw
    def nvmlDeviceSetGpuLockedClocks(self, h, low, high):
        dev = self._dev("nvmlDeviceSetGpuLockedClocks", h)
        dev["gpu_lock"] = (low, high)
        dev["clocks"][0] = dev["clocks"][1] = high
    def nvmlDeviceResetGpuLockedClocks(self, h): self._dev("nvmlDeviceResetGpuLockedClocks", h)["gpu_lock"] = None
    def nvmlDeviceSetMemoryLockedClocks(self, h, low, high):
        self._dev("nvmlDeviceSetMemoryLockedClocks", h)["mem_lock"] = (low, high)
    def nvmlDeviceResetMemoryLockedClocks(self, h): self._dev("nvmlDeviceResetMemoryLockedClocks", h)["mem_lock"] = None
