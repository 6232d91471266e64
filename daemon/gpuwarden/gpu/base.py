"""The one GPU interface and the one sample value every backend returns."""

from __future__ import annotations

import dataclasses
import enum
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from collections.abc import Mapping
from typing import Any


class ClockEventReason(enum.IntFlag):
    """Why clocks are below their maximum (NVML clock-event / throttle reason bits)."""

    NONE = 0
    GpuIdle = 0x1
    ApplicationsClocksSetting = 0x2
    SwPowerCap = 0x4
    HwSlowdown = 0x8
    SyncBoost = 0x10
    SwThermalSlowdown = 0x20
    HwThermalSlowdown = 0x40
    HwPowerBrakeSlowdown = 0x80
    DisplayClockSetting = 0x100

    def names(self) -> list[str]:
        return [r.name for r in ClockEventReason if r and r in self]


# NVML perf-policy ids for the cumulative violation counters we read.
VIOLATION_POLICIES = {
    "power": 0,
    "thermal": 1,
    "sync_boost": 2,
    "board_limit": 3,
    "low_utilization": 4,
    "reliability": 5,
}

# How two GPUs exchange peer traffic, from NVML's topology (gpu/nvml.py): over NVLink (direct, or through
# NVSwitch), over the chip-to-chip link of a Grace superchip, or over PCIe through the nearest common ancestor
# (nvmlGpuTopologyLevel_t: INTERNAL, SINGLE and MULTIPLE switches, HOSTBRIDGE, NODE, SYSTEM).
PEER_PATHS = {"nvlink": "NVLink", "nvswitch": "NVLink through NVSwitch", "c2c": "C2C through the Grace CPUs",
              "pcie_board": "PCIe on one board", "pcie_switch": "a PCIe switch", "host_bridge": "a PCIe host bridge",
              "cpu": "PCIe through the CPU", "cpu_interconnect": "PCIe across CPU sockets"}
OFF_PCIE = ("nvlink", "nvswitch", "c2c")  # peer paths that never cross PCIe, nor an IOMMU on it
NVLINK_ERRORS = ("replay", "recovery", "crc")  # the data-link-layer counters `nvidia-smi nvlink -e` shows
# The GpuSample fields GPM gives (the ratios first, then bytes per second); gpu/nvml_gpm.py has NVML's id of each.
GPM_RATIOS = ("graphics_engine_active_ratio", "sm_active_ratio", "sm_occupancy_ratio", "tensor_active_ratio",
              "tensor_hmma_active_ratio", "dram_bandwidth_ratio", "fp32_active_ratio", "fp16_active_ratio")
GPM_RATES = ("pcie_tx_bytes_per_s", "pcie_rx_bytes_per_s", "nvlink_tx_bytes_per_s", "nvlink_rx_bytes_per_s")
GPM_FIELDS = GPM_RATIOS + GPM_RATES
# What `gpuwarden status` and doctor show of GPM beside utilization: the three that tell a sleeping kernel, a
# memory-bound decode and a compute-bound prefill apart (all read 100 % utilization).
GPM_SHOWN = {"SM": "sm_active_ratio", "tensor": "tensor_active_ratio", "DRAM": "dram_bandwidth_ratio"}


def gpm_activity(gpu: Mapping[str, Any]) -> str:
    """e.g. "SM 1% · tensor 0% · DRAM 0%" from a sample's fields (GpuSample.as_dict, or /status's GPU entry); a
    figure the GPU does not report is left out, so "" where it has no GPM or has not read it yet."""
    return " · ".join(f"{label} {gpu[name] * 100:.0f}%" for label, name in GPM_SHOWN.items()
                      if isinstance(gpu.get(name), (int, float)))


@dataclass(frozen=True)
class NvLink:
    """One NVLink link of a GPU, read with the counters. A counter the GPU does not report is None."""

    link: int
    # "up", "down", "sleep" (a low-power state it leaves on traffic), "off" (up, traffic disabled), "unknown"
    # (unreadable this time: neither up nor down)
    state: str
    peer: str | None = None  # "GPU1", "NVSwitch", or the remote PCI bus id; None: unknown
    speed_mbps: int | None = None  # MB/s per direction as NVML says (26562 on an H100)
    replay: int | None = None  # cumulative since the driver loaded
    recovery: int | None = None
    crc: int | None = None  # flow-control-unit (flit) CRC errors


@dataclass(frozen=True)
class GpuBoard:
    """What the card says it is, read once: the tuning's clock default follows it (tunables.clock_class)."""

    brand: str | None = None  # NVML's brand: "NVIDIA RTX", "GeForce", "Tesla", "NVIDIA" (H100, B200), ...
    form_factor: str | None = None  # "sxm" (a module on a baseboard), "pcie"; None: not reported
    default_graphics_clock_mhz: int | None = None  # the default applications clock, where the card has one


@dataclass(frozen=True)
class GpuHealth:
    """The PCIe link, NVLink, the NVSwitch fabric and the memory's health. None (or no links): this GPU does
    not report it (then nothing is said)."""

    pcie_generation: int | None = None
    pcie_generation_max: int | None = None  # what both the GPU and the slot support
    pcie_width: int | None = None
    pcie_width_max: int | None = None
    pcie_replays: int | None = None  # cumulative link-level retransmissions
    ecc_uncorrected: int | None = None  # volatile: since the driver loaded
    remapped_rows_correctable: int | None = None
    remapped_rows_uncorrectable: int | None = None
    remap_pending: bool | None = None  # a remap waits for a GPU reset
    remap_failure: bool | None = None  # a row could not be remapped: the card needs replacing
    retired_pages: int | None = None  # older GPUs (before Ampere) retire pages instead of remapping rows
    retire_pending: bool | None = None
    nvlinks: tuple[NvLink, ...] = ()
    # NVSwitch systems: the GPU's registration with the fabric manager (nvmlDeviceGetGpuFabricInfoV):
    # "completed", "in_progress", "not_started"; None where the GPU has no fabric. A GPU whose fabric is not
    # ready has no NVLink peers: tensor parallelism fails or falls back.
    fabric: str | None = None
    fabric_error: str | None = None  # a completed registration's failure, as nvmlErrorString says it
    # The driver's recovery action, polled (NVML_FI_DEV_GET_GPU_RECOVERY_ACTION): a code of gpu/events.py
    # RECOVERY_ACTIONS, 0 none; None where the driver does not report it (before the field existed).
    recovery_action: int | None = None

    @property
    def fabric_ready(self) -> bool | None:
        if self.fabric is None:
            return None
        return self.fabric == "completed" and self.fabric_error is None

    def nvlink_problems(self, seen_up: frozenset[int] = frozenset()) -> list[str]:
        """Links down or slower than the GPU's fastest, e.g. ["link 3 down (to GPU1)", "link 5 at 13281 of
        26562 MB/s"]. A link down counts where it knows its far end or was seen up (seen_up): one that never
        was, with no far end, is not cabled (a bridge-less PCIe card). A sleeping link wakes on traffic."""
        fastest = max((n.speed_mbps for n in self.nvlinks if n.state == "up" and n.speed_mbps), default=None)
        out = []
        for n in self.nvlinks:
            if n.state in ("down", "off") and (n.peer or n.link in seen_up):
                out.append(f"link {n.link} {'down' if n.state == 'down' else 'up with traffic disabled'}"
                           + (f" (to {n.peer})" if n.peer else ""))
            elif n.state == "up" and fastest and n.speed_mbps and n.speed_mbps < fastest:
                out.append(f"link {n.link} at {n.speed_mbps} of {fastest} MB/s")
        return out

    def nvlink_errors(self) -> dict[str, int]:
        """Each NVLink error counter summed over the links that report it."""
        return {kind: sum(getattr(n, kind) for n in self.nvlinks if getattr(n, kind) is not None)
                for kind in NVLINK_ERRORS if any(getattr(n, kind) is not None for n in self.nvlinks)}

    @property
    def link_degraded(self) -> bool:
        """The link trained below what the GPU and the slot support."""
        gen, gen_max, width, width_max = (self.pcie_generation, self.pcie_generation_max, self.pcie_width,
                                          self.pcie_width_max)
        return (gen is not None and gen_max is not None and gen < gen_max) or \
            (width is not None and width_max is not None and width < width_max)

    def link(self) -> str | None:
        """e.g. "Gen2 x16 of Gen5 x16"."""
        if self.pcie_generation is None or self.pcie_width is None:
            return None
        text = f"Gen{self.pcie_generation} x{self.pcie_width}"
        if self.pcie_generation_max is not None and self.pcie_width_max is not None:
            text += f" of Gen{self.pcie_generation_max} x{self.pcie_width_max}"
        return text


@dataclass(frozen=True, slots=True)
class GpuSample:
    """One reading of one GPU. A field the card does not support is None."""

    index: int
    uuid: str
    name: str
    pci_bus_id: str
    compute_capability: str | None  # "12.0"
    up: bool = True  # False when the GPU is lost or unreadable; then most fields are None
    timestamp: float = 0.0  # monotonic seconds when read
    sm_clock_mhz: int | None = None
    memory_clock_mhz: int | None = None
    graphics_clock_mhz: int | None = None
    max_sm_clock_mhz: int | None = None
    max_memory_clock_mhz: int | None = None
    max_graphics_clock_mhz: int | None = None
    power_w: float | None = None
    power_limit_w: float | None = None
    power_limit_min_w: float | None = None
    power_limit_max_w: float | None = None
    power_limit_default_w: float | None = None
    temperature_c: float | None = None
    utilization_pct: float | None = None
    memory_utilization_pct: float | None = None
    memory_used_bytes: int | None = None
    memory_total_bytes: int | None = None
    memory_reserved_bytes: int | None = None  # the driver's own reservation, not in memory_used_bytes
    memory_unified: bool = False  # the memory figures are the system's, which the GPU shares (DGX Spark)
    persistence_mode: bool | None = None
    performance_state: int | None = None  # 0 (P0, fastest) .. 15
    clock_event_reasons: ClockEventReason | None = None
    violation_seconds: Mapping[str, float | None] = field(default_factory=dict)  # keys: VIOLATION_POLICIES
    energy_joules: float | None = None
    memory_temperature_c: float | None = None  # the memory's own sensor (HBM), read with the counters
    memory_bus_width_bits: int | None = None
    # GPM, NVML's GPU Performance Monitoring (Hopper and newer; gpu/nvml_gpm.py), read with the counters: each
    # reading pairs the GPU's performance counters with the last reading's, so each is the mean over the time
    # between them (counters_interval_s). None: GPM unsupported on this GPU, or before the second reading (the
    # first only primes). The ratios are shares of that time, 0..1 (GPM_FIELDS).
    graphics_engine_active_ratio: float | None = None  # some kernel ran: what "utilization" means, as GPM sees it
    sm_active_ratio: float | None = None  # the SMs' busy share: a sleep kernel is 1.0 above and ~0.01 here
    sm_occupancy_ratio: float | None = None  # resident warps against the SMs' maximum
    tensor_active_ratio: float | None = None  # the tensor cores, any precision
    tensor_hmma_active_ratio: float | None = None  # the tensor cores on HMMA (FP16/BF16) work
    dram_bandwidth_ratio: float | None = None  # the memory's bandwidth in use against its peak
    fp32_active_ratio: float | None = None  # non-tensor FP32 math
    fp16_active_ratio: float | None = None  # non-tensor FP16 math
    pcie_tx_bytes_per_s: float | None = None  # PCIe from this GPU
    pcie_rx_bytes_per_s: float | None = None  # PCIe to this GPU
    nvlink_tx_bytes_per_s: float | None = None  # all NVLink links together; None on a GPU without NVLink
    nvlink_rx_bytes_per_s: float | None = None
    # The host's driver and the newest CUDA it runs ("13.0"), read once per backend: the serving lint compares
    # them with the CUDA the engine was built for. None: not known (the simulator gives the driver only).
    driver_version: str | None = None
    cuda_driver_version: str | None = None
    health: GpuHealth = field(default_factory=GpuHealth)  # the links and memory, read with the counters
    board: GpuBoard = field(default_factory=GpuBoard)
    # How this GPU reaches each other GPU of the host (index -> a key of PEER_PATHS), read once per backend.
    peer_paths: Mapping[int, str] = field(default_factory=dict)
    iommu: str | None = None  # the host's IOMMU (gpu/iommu.py): off, passthrough, translating; read once
    error: str | None = None  # why the GPU is down, when up is False

    @property
    def memory_bandwidth_bytes_per_s(self) -> float | None:
        """Peak DRAM bandwidth implied by the current memory clock (double data rate)."""
        if self.memory_clock_mhz is None or self.memory_bus_width_bits is None:
            return None
        return 2 * self.memory_clock_mhz * 1e6 * self.memory_bus_width_bits / 8

    def as_dict(self) -> dict:
        out = {name: getattr(self, name) for name in self.__dataclass_fields__}
        out["violation_seconds"] = dict(self.violation_seconds)
        reasons = self.clock_event_reasons
        out["clock_event_reasons"] = None if reasons is None else reasons.names()
        out["memory_bandwidth_bytes_per_s"] = self.memory_bandwidth_bytes_per_s
        out["health"] = dataclasses.asdict(self.health)
        out["board"] = dataclasses.asdict(self.board)
        out["peer_paths"] = {str(k): v for k, v in self.peer_paths.items()}
        return out


@dataclass(frozen=True)
class GpuCapabilities:
    """What a GPU accepts, read once: the limits tuning is validated against."""

    memory_clocks_mhz: tuple[int, ...] = ()  # supported memory clocks, descending
    graphics_clocks_mhz: tuple[int, ...] = ()  # supported at the highest memory clock, descending
    power_limit_min_w: float | None = None
    power_limit_max_w: float | None = None
    power_limit_default_w: float | None = None


class Gpu(ABC):
    """One GPU. Setters raise gpu.errors classes; sample() never raises."""

    index: int
    uuid: str
    name: str
    pci_bus_id: str

    @abstractmethod
    def sample(self, counters: bool | None = None) -> GpuSample:
        """counters: read the slow counters (energy, violations, the links' and memory's health) now (True),
        keep the last reading (False), or None: when counters_interval_s has passed for this GPU. The first
        sample always reads them. The monitor decides for all GPUs at once, on the poll schedule."""

    @abstractmethod
    def capabilities(self) -> GpuCapabilities: ...

    @abstractmethod
    def gpm_unsupported(self) -> str | None:
        """Why GPM (SM, tensor and DRAM activity) is not read on this GPU, as the driver (or the scenario) says
        it; None: it is read. Known once a sample has read the counters: it asks nothing itself (doctor)."""

    @abstractmethod
    def compute_processes(self) -> list[tuple[int, int | None]]:
        """(pid, GPU memory bytes or None) of the compute processes on this GPU."""

    @abstractmethod
    def set_persistence_mode(self, enabled: bool) -> None: ...

    @abstractmethod
    def set_gpu_locked_clocks(self, min_mhz: int, max_mhz: int) -> None: ...

    @abstractmethod
    def reset_gpu_locked_clocks(self) -> None: ...

    @abstractmethod
    def set_memory_locked_clocks(self, min_mhz: int, max_mhz: int) -> None: ...

    @abstractmethod
    def reset_memory_locked_clocks(self) -> None: ...

    @abstractmethod
    def set_power_limit_w(self, watts: float) -> None: ...

    def energy_mj(self) -> int | None:
        """The card's energy counter now, whole mJ since the driver loaded (NVML's total energy, Volta and newer):
        one call, for the engine's GPUs on every poll (joules per request, serving/run/energyfeed.py); None: no
        counter, or it did not answer."""
        return None

    def note_engine(self, held: bool) -> None:
        """The daemon's engine holds a CUDA context on this card (held) or none: the simulator draws the context's
        watts from it (sim/physics.py); a real card knows without being told."""


class GpuBackend(ABC):
    """The GPUs of one host, in PCI bus order."""

    @abstractmethod
    def gpus(self) -> list[Gpu]: ...

    @abstractmethod
    def driver_version(self) -> str | None: ...

    @abstractmethod
    def persistenced_state(self) -> str:
        """nvidia-persistenced: "running", "stopped" (installed, not running) or "absent"."""

    def persistenced_running(self) -> bool:
        return self.persistenced_state() == "running"

    def events(self) -> Any:
        """A source of GPU events (gpu/events.py: wait(timeout_s) -> [GpuEvent], close(), registered), or None
        when this backend has none."""
        return None

    def close(self) -> None:
        """Release the backend; safe to call twice."""
