"""The production backend: NVML through nvidia-ml-py (module `pynvml`).

Every call goes through `NvmlGpu._read`, the seam tests replace by passing a
fake module. One failing field never fails the whole sample; GPU_IS_LOST
marks the GPU down until NVML can be re-initialised and finds it again.
An NvmlGpu's slow reads are its NvmlCounters (gpu/nvml_counters.py), its
setters NvmlSettings (gpu/nvml_settings.py).
"""

from __future__ import annotations

import contextlib
import importlib
import sys
import time
from itertools import combinations
from pathlib import Path
from typing import Any
from collections.abc import Callable

from . import errors
from .base import ClockEventReason, Gpu, GpuBackend, GpuBoard, GpuCapabilities, GpuSample
from .events import NvmlEvents
from .iommu import iommu_state
from .nvml_counters import NVLINK_SWITCH, NvmlCounters
from .nvml_settings import NvmlSettings
from .nvml_successors import DEPRECATED
from .nvml_values import pci_bus, scaled, text
from .sysmem import system_memory

CLOCK_GRAPHICS, CLOCK_SM, CLOCK_MEM = 0, 1, 2
MAX_NVLINKS = 36  # NVML_NVLINK_MAX_LINKS
# nvmlDeviceGetTopologyCommonAncestor's level (nvmlGpuTopologyLevel_t) -> base.PEER_PATHS
TOPOLOGY = {0: "pcie_board", 10: "pcie_switch", 20: "pcie_switch", 30: "host_bridge", 40: "cpu", 50: "cpu_interconnect"}
P2P_NVLINK, P2P_OK = 2, 0  # NVML_P2P_CAPS_INDEX_NVLINK, NVML_P2P_STATUS_OK
BRANDS = {1: "Quadro", 2: "Tesla", 3: "NVS", 5: "GeForce", 6: "Titan", 12: "Quadro RTX", 13: "NVIDIA RTX",
          14: "NVIDIA", 15: "GeForce RTX", 16: "Titan RTX"}  # nvmlBrandType_t (NVML_BRAND_*)
TEMPERATURE_GPU = 0
CLOCK_ID_APP_DEFAULT = 2  # NVML_CLOCK_ID_APP_CLOCK_DEFAULT (nvmlClockId_t)
FUNCTION_NOT_FOUND = 13
ARGUMENT_VERSION_MISMATCH = 25  # a versioned call (nvmlDeviceGetTemperatureV) whose struct this driver does not know
REINIT_INTERVAL_S = 5.0  # how often to retry NVML while a GPU is lost


# Where nvidia-persistenced is found when it is installed but not running (Debian's non-free package, NVIDIA's
# CUDA repository, the .run installer).
PERSISTENCED_FILES = ("/usr/bin/nvidia-persistenced", "/usr/sbin/nvidia-persistenced",
                      "/lib/systemd/system/nvidia-persistenced.service",
                      "/usr/lib/systemd/system/nvidia-persistenced.service",
                      "/etc/systemd/system/nvidia-persistenced.service")


def persistenced_state(proc_root: str = "/proc", files: tuple[str, ...] = PERSISTENCED_FILES) -> str:
    """nvidia-persistenced: "running", "stopped" (installed) or "absent"."""
    if persistenced_pids(proc_root):
        return "running"
    return "stopped" if any(Path(f).exists() for f in files) else "absent"


def persistenced_pids(proc_root: str = "/proc") -> list[int]:
    """PIDs of nvidia-persistenced (its comm is cut to 15 characters)."""
    pids = []
    for comm in Path(proc_root).glob("[0-9]*/comm"):
        try:
            if comm.read_text().strip() == "nvidia-persiste":
                pids.append(int(comm.parent.name))
        except OSError:
            continue  # the process ended while we looked
    return sorted(pids)


class NvmlBackend(GpuBackend):
    def __init__(self, nvml: Any = None, clock: Callable[[], float] = time.monotonic,
                 counters_interval_s: float = 10.0, proc_root: str = "/proc", batched: bool = True):
        self.nvml = nvml if nvml is not None else _import_pynvml()
        self.batched = batched  # read fields with nvmlDeviceGetFieldValues where the driver has it
        self.clock = clock
        self.counters_interval_s = counters_interval_s
        self.proc_root = proc_root
        self._open = False
        self._last_reinit = float("-inf")
        self._init()
        self.driver = (self.driver_version(), self.cuda_driver_version())  # read once: the same for every GPU
        self.iommu = iommu_state()
        handles = []
        for i in range(self._call(self.nvml.nvmlDeviceGetCount)):
            handle = self._call(self.nvml.nvmlDeviceGetHandleByIndex, i)
            try:
                bus = text(self.nvml.nvmlDeviceGetPciInfo(handle).busId).lower()
            except self.nvml.NVMLError:
                bus = f"~unreadable-{i}"  # a GPU lost at start sorts last and reports itself down
            handles.append((bus, handle))
        handles.sort(key=lambda pair: pair[0])  # PCI order = CUDA_DEVICE_ORDER=PCI_BUS_ID
        self._gpus = [NvmlGpu(self, index, handle) for index, (_, handle) in enumerate(handles)]
        self._read_topology()

    def _read_topology(self) -> None:
        """How each pair of GPUs talks, read once (and after a re-init): NVLink where a link joins them, directly
        or both through NVSwitch (or NVML's NVLink peer-to-peer status says so); C2C where both are Grace
        superchips' GPUs; else PCIe through their nearest common ancestor. A pair NVML cannot place is left out
        (unknown), never guessed."""
        names = {pci_bus(g.pci_bus_id): f"GPU{g.index}" for g in self._gpus}
        for gpu in self._gpus:
            gpu.peer_names, gpu.peer_paths = names, {}
        for a, b in combinations([g for g in self._gpus if g.up], 2):
            try:
                kind = a.path_to(b)
            except errors.GpuLost:
                continue  # it reports itself down; its pairs are unknown until it is back
            if kind is not None:
                a.peer_paths[b.index] = b.peer_paths[a.index] = kind

    def _init(self) -> None:
        self._call(self.nvml.nvmlInit)
        self._open = True

    def _call(self, fn: Callable, *args: Any) -> Any:
        """Call NVML where failure means NVML is unusable (start-up)."""
        try:
            return fn(*args)
        except self.nvml.NVMLError as exc:
            raise errors.Unavailable(f"NVML: {exc} (is the NVIDIA driver loaded?)") from None

    def gpus(self) -> list[Gpu]:
        return list(self._gpus)

    def events(self) -> NvmlEvents | None:
        """Xid and fatal events for every GPU that reports them; None when NVML has no event sets here."""
        if not hasattr(self.nvml, "nvmlEventSetCreate"):
            return None
        try:
            return NvmlEvents(self.nvml, {g.index: g.handle for g in self._gpus if g.up},
                              {g.uuid: g.index for g in self._gpus})
        except self.nvml.NVMLError:
            return None

    def driver_version(self) -> str | None:
        try:
            return text(self.nvml.nvmlSystemGetDriverVersion())
        except self.nvml.NVMLError:
            return None

    def cuda_driver_version(self) -> str | None:
        """The newest CUDA this driver runs, "13.0" (NVML answers 13000)."""
        try:
            version = self.nvml.nvmlSystemGetCudaDriverVersion_v2()
        except (AttributeError, self.nvml.NVMLError):  # an old nvidia-ml-py, or a driver without the call
            return None
        return f"{version // 1000}.{version % 1000 // 10}" if isinstance(version, int) and version > 0 else None

    def persistenced_state(self) -> str:
        return persistenced_state(self.proc_root)

    def reinit(self) -> bool:
        """Restart NVML and re-find every GPU by UUID; rate-limited."""
        now = self.clock()
        if now - self._last_reinit < REINIT_INTERVAL_S:
            return False
        self._last_reinit = now
        try:
            if self._open:
                self._open = False
                self.nvml.nvmlShutdown()
            self.nvml.nvmlInit()
            self._open = True
        except self.nvml.NVMLError:
            return False
        self.driver = (self.driver_version(), self.cuda_driver_version())  # a reload may bring another driver
        for gpu in self._gpus:
            gpu.refind()
        self._read_topology()
        return True

    def close(self) -> None:
        if self._open:
            self._open = False
            for gpu in self._gpus:  # GPM's two sample buffers per GPU, while NVML can still free them
                gpu.counters.gpm.close()
            with contextlib.suppress(self.nvml.NVMLError):  # shutting down anyway
                self.nvml.nvmlShutdown()


# Where the Debian package puts its pinned copy of nvidia-ml-py (not in main), off the system's path.
VENDOR_DIR = "/usr/share/gpuwarden/vendor"


def _import_pynvml() -> Any:
    try:
        return importlib.import_module("pynvml")
    except ImportError:
        pass
    if Path(VENDOR_DIR, "pynvml.py").is_file():
        sys.path.append(VENDOR_DIR)
        return importlib.import_module("pynvml")
    raise errors.Unavailable("NVML: the nvidia-ml-py package (module pynvml) is not installed")


class NvmlGpu(NvmlSettings, Gpu):
    def __init__(self, backend: NvmlBackend, index: int, handle: Any):
        self.backend = backend
        self.nvml = backend.nvml
        self.index = index
        self.handle = handle
        self.up = True
        self.down_reason: str | None = None
        self._unsupported: set[tuple] = set()  # (call, args) that said NOT_SUPPORTED: not asked again
        self._missing: set[str] = set()  # calls this nvidia-ml-py or driver lacks: their older name is asked
        self._counters_at = float("-inf")
        self.uuid, self.name, self.pci_bus_id = f"GPU-unknown-{index}", "unknown", "unknown"
        self.compute_capability = None
        self.memory_bus_width_bits, self.max_clocks = None, dict.fromkeys((CLOCK_SM, CLOCK_MEM, CLOCK_GRAPHICS))
        self.memory_unified = False  # NVML has no memory for it: the system's is reported (gpu/sysmem.py)
        self.board = GpuBoard()
        self.links: tuple[int, ...] = ()  # its NVLink links, found once
        self.remote: dict[int, tuple[str, int | None]] = {}  # link -> (the far end's PCI bus, device type)
        self.c2c = False  # a Grace superchip's GPU, joined to its CPU by C2C
        self.peer_names: dict[str, str] = {}  # PCI bus -> "GPU1": the backend's GPUs, to name a link's far end
        self.peer_paths: dict[int, str] = {}
        self.counters = NvmlCounters(self)  # read every counters_interval_s, published in every sample
        try:
            self._read_identity()
            self._read_static()
        except errors.GpuLost as exc:  # lost already at start: come up, report it down
            self.up, self.down_reason = False, str(exc)

    def _read_identity(self) -> None:
        self.uuid = text(self._read("nvmlDeviceGetUUID") or self.uuid)
        self.name = text(self._read("nvmlDeviceGetName") or self.name)
        pci = self._read("nvmlDeviceGetPciInfo")
        self.pci_bus_id = text(pci.busId) if pci is not None else self.pci_bus_id
        cc = self._read("nvmlDeviceGetCudaComputeCapability")
        self.compute_capability = f"{cc[0]}.{cc[1]}" if cc else None

    def _read_static(self) -> None:
        """Fields that never change but cost 0.2-1.4 ms each on an H200: read once per handle."""
        self.memory_bus_width_bits = self._read("nvmlDeviceGetMemoryBusWidth")
        self.max_clocks = {clock: self._read("nvmlDeviceGetMaxClockInfo", clock)
                           for clock in (CLOCK_SM, CLOCK_MEM, CLOCK_GRAPHICS)}
        brand, module = self._read("nvmlDeviceGetBrand"), self._read("nvmlDeviceGetModuleId")
        self.board = GpuBoard(BRANDS.get(brand, f"brand {brand}") if brand is not None else None,
                              # a module on a baseboard (SXM) has an id; a PCIe card answers 0
                              None if module is None else "sxm" if module > 0 else "pcie",
                              self._read_successor(("nvmlDeviceGetClock", CLOCK_GRAPHICS, CLOCK_ID_APP_DEFAULT),
                                                   ("nvmlDeviceGetDefaultApplicationsClock", CLOCK_GRAPHICS)))
        c2c = self._read("nvmlDeviceGetC2cModeInfoV")
        self.c2c = bool(getattr(c2c, "isC2cEnabled", 0))
        # A GPU without NVLink answers NOT_SUPPORTED for every link; one with it answers a state for each of
        # its links (0 for one that is down), and an error past the last.
        self.links = tuple(link for link in range(MAX_NVLINKS) if self._read("nvmlDeviceGetNvLinkState", link)
                           is not None)
        self.remote = {}
        for link in self.links:
            self.find_remote(link)

    def find_remote(self, link: int) -> None:
        """The far end of a link, as long as it is up enough to say."""
        pci = self._read("nvmlDeviceGetNvLinkRemotePciInfo", link)
        if pci is not None:
            self.remote[link] = (pci_bus(text(pci.busId)), self._read("nvmlDeviceGetNvLinkRemoteDeviceType", link))

    def path_to(self, other: NvmlGpu) -> str | None:
        """How this GPU reaches other (a key of base.PEER_PATHS), or None when NVML cannot say."""
        theirs = pci_bus(other.pci_bus_id)
        if any(bus == theirs for bus, _ in self.remote.values()):
            return "nvlink"
        switched = lambda g: any(kind == NVLINK_SWITCH for _, kind in g.remote.values())  # noqa: E731
        if switched(self) and switched(other):
            return "nvswitch"
        if self._read("nvmlDeviceGetP2PStatus", other.handle, P2P_NVLINK) == P2P_OK:
            return "nvlink"
        if self.c2c and other.c2c:
            return "c2c"
        return TOPOLOGY.get(self._read("nvmlDeviceGetTopologyCommonAncestor", other.handle))

    # -- the seam ---------------------------------------------------------------
    def _read(self, fn_name: str, *args: Any) -> Any:
        """One NVML read: None if unsupported or failing; GpuLost propagates."""
        # A handle or a ctypes reference stands for its kind: a call NOT_SUPPORTED for one peer or one buffer
        # is so for all of them.
        key = (fn_name, tuple(a if isinstance(a, (int, str, tuple)) else type(a).__name__ for a in args))
        if key in self._unsupported:
            return None
        fn = getattr(self.nvml, fn_name, None)
        if fn is None:  # an old nvidia-ml-py without this call
            self._unsupported.add(key)
            self._missing.add(fn_name)
            return None
        try:
            return fn(self.handle, *args)
        except self.nvml.NVMLError as exc:
            code = getattr(exc, "value", None)
            if code == errors.GpuLost.nvml_code:
                raise errors.GpuLost(f"GPU {self.index} ({getattr(self, 'uuid', '?')}) is lost") from None
            if code in (errors.NotSupported.nvml_code, FUNCTION_NOT_FOUND, ARGUMENT_VERSION_MISMATCH):
                self._unsupported.add(key)  # it will not start working: stop asking
                # No answer from this call on this driver, for good: where it is a successor (or the batched
                # fields), the old call is asked instead (FUNCTION_NOT_FOUND: the driver lacks the symbol).
                self._missing.add(fn_name)
            return None

    def lacks(self, fn_name: str) -> bool:
        """Whether the installed nvidia-ml-py or the driver has no fn_name (asked at least once)."""
        return fn_name in self._missing

    def _read_successor(self, new: tuple, old: tuple) -> Any:
        """new's read, (name, *args); old's only where this nvidia-ml-py or driver lacks new's call: CUDA 14
        removes old (gpu/nvml_successors.py). Any other failure of new is None, as any read's."""
        assert DEPRECATED[old[0]] == new[0], f"{old[0]} is not replaced by {new[0]}"
        value = self._read(*new)
        return self._read(*old) if value is None and self.lacks(new[0]) else value

    # -- reading ----------------------------------------------------------------
    def energy_mj(self) -> int | None:
        value = self._read("nvmlDeviceGetTotalEnergyConsumption") if self.up else None
        return int(value) if isinstance(value, int) and value >= 0 else None

    def sample(self, counters: bool | None = None) -> GpuSample:
        now = self.backend.clock()
        if not self.up and not (self.backend.reinit() and self.up):
            return self._down(now)
        try:
            return self._sample(now, counters)
        except errors.GpuLost as exc:
            self.up, self.down_reason = False, str(exc)
            return self._down(now)

    def _down(self, now: float) -> GpuSample:
        return GpuSample(self.index, self.uuid, self.name, self.pci_bus_id, self.compute_capability,
                         up=False, timestamp=now, error=self.down_reason)

    def refind(self) -> None:
        """After an NVML re-init: take a fresh handle for our UUID, if the GPU is back."""
        try:
            self.handle = self.nvml.nvmlDeviceGetHandleByUUID(self.uuid)
            self.nvml.nvmlDeviceGetClockInfo(self.handle, CLOCK_SM)  # must answer to count as back
            self._read_static()
        except (self.nvml.NVMLError, errors.GpuLost) as exc:
            self.up, self.down_reason = False, f"GPU {self.index} ({self.uuid}) not back: {exc}"
            return
        self.up, self.down_reason = True, None

    def _sample(self, now: float, counters: bool | None) -> GpuSample:
        r = self._read
        due = now - self._counters_at >= self.backend.counters_interval_s if counters is None else counters
        if due or self._counters_at == float("-inf"):
            self.counters.read()
            self._counters_at = now
        power_mw = r("nvmlDeviceGetPowerUsage")
        limit_mw = r("nvmlDeviceGetEnforcedPowerLimit")
        constraints, default_mw = self.counters.limits  # they change only when a limit's range does: with the counters
        util = r("nvmlDeviceGetUtilizationRates")
        used, total, reserved = self._memory()
        persistence = r("nvmlDeviceGetPersistenceMode")
        return GpuSample(
            self.index, self.uuid, self.name, self.pci_bus_id, self.compute_capability,
            up=True, timestamp=now,
            sm_clock_mhz=r("nvmlDeviceGetClockInfo", CLOCK_SM),
            memory_clock_mhz=r("nvmlDeviceGetClockInfo", CLOCK_MEM),
            graphics_clock_mhz=r("nvmlDeviceGetClockInfo", CLOCK_GRAPHICS),
            max_sm_clock_mhz=self.max_clocks[CLOCK_SM],
            max_memory_clock_mhz=self.max_clocks[CLOCK_MEM],
            max_graphics_clock_mhz=self.max_clocks[CLOCK_GRAPHICS],
            power_w=scaled(power_mw, 1e-3),
            power_limit_w=scaled(limit_mw, 1e-3),
            power_limit_min_w=scaled(constraints[0], 1e-3) if constraints else None,
            power_limit_max_w=scaled(constraints[1], 1e-3) if constraints else None,
            power_limit_default_w=scaled(default_mw, 1e-3),
            temperature_c=self._read_successor(("nvmlDeviceGetTemperatureV", TEMPERATURE_GPU),
                                               ("nvmlDeviceGetTemperature", TEMPERATURE_GPU)),
            memory_temperature_c=self.counters.memory_temperature,
            utilization_pct=util.gpu if util is not None else None,
            memory_utilization_pct=util.memory if util is not None else None,
            memory_used_bytes=used,
            memory_total_bytes=total,
            memory_reserved_bytes=reserved,
            memory_unified=self.memory_unified,
            persistence_mode=bool(persistence) if persistence is not None else None,
            performance_state=r("nvmlDeviceGetPerformanceState"),
            clock_event_reasons=self._reasons(),
            violation_seconds=dict(self.counters.violations),
            energy_joules=self.counters.energy,
            memory_bus_width_bits=self.memory_bus_width_bits,
            **self.counters.gpm.values,  # GPM's figures (gpu/nvml_gpm.py), none where unsupported or priming
            driver_version=self.backend.driver[0],
            cuda_driver_version=self.backend.driver[1],
            health=self.counters.health,
            board=self.board,
            peer_paths=dict(self.peer_paths),
            iommu=self.backend.iommu,
        )

    def _memory(self) -> tuple[int | None, int | None, int | None]:
        """(used, total, reserved) bytes. NVML's v2 call tells the driver's reservation apart (an idle H200:
        0 used, 616 MiB reserved); the v1 call counts it as used, so older drivers report reserved None."""
        version = getattr(self.nvml, "nvmlMemory_v2", None)
        memory = self._read("nvmlDeviceGetMemoryInfo", version) if version is not None else None
        if memory is not None:
            return memory.used, memory.total, memory.reserved
        memory = self._read("nvmlDeviceGetMemoryInfo")
        if memory is not None:
            return memory.used, memory.total, None
        if ("nvmlDeviceGetMemoryInfo", ()) in self._unsupported:  # no memory of its own: unified (GB10)
            shared = system_memory()
            if shared is not None:
                self.memory_unified = True
                return shared[0], shared[1], None
        return None, None, None

    def _reasons(self) -> ClockEventReason | None:
        # Drivers before 535 (and nvidia-ml-py before 12.535) only have the older "throttle reasons" name.
        value = self._read_successor(("nvmlDeviceGetCurrentClocksEventReasons",),
                                     ("nvmlDeviceGetCurrentClocksThrottleReasons",))
        return ClockEventReason(value) if value is not None else None

    def compute_processes(self) -> list[tuple[int, int | None]]:
        try:
            procs = self._read("nvmlDeviceGetComputeRunningProcesses") or []
        except errors.GpuLost:
            return []
        return [(p.pid, getattr(p, "usedGpuMemory", None)) for p in procs]

    def gpm_unsupported(self) -> str | None:
        return self.counters.gpm.unsupported  # gpu/nvml_gpm.py keeps the driver's answer

    def capabilities(self) -> GpuCapabilities:
        mem = sorted(self._read("nvmlDeviceGetSupportedMemoryClocks") or [], reverse=True)
        graphics = sorted(self._read("nvmlDeviceGetSupportedGraphicsClocks", mem[0]) or [], reverse=True) if mem else []
        constraints = self._read("nvmlDeviceGetPowerManagementLimitConstraints")
        default_mw = self._read("nvmlDeviceGetPowerManagementDefaultLimit")
        return GpuCapabilities(
            memory_clocks_mhz=tuple(mem),
            graphics_clocks_mhz=tuple(graphics),
            power_limit_min_w=scaled(constraints[0], 1e-3) if constraints else None,
            power_limit_max_w=scaled(constraints[1], 1e-3) if constraints else None,
            power_limit_default_w=scaled(default_mw, 1e-3),
        )
