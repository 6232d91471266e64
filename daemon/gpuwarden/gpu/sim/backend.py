"""The simulated backend: GPUs that behave the way users reported real ones do.

Clocks follow a small physical model: a locked clock holds unless the power
draw it implies exceeds the limit (then it sinks, with SwPowerCap), a headless
card without `boost_under_load` stays at idle clocks under load, and a driver
reload drops every lock. Setters fail with the same error classes as NVML.
"""

from __future__ import annotations

import time
import uuid as uuidlib
from collections.abc import Callable

from .. import errors
from ..base import (NVLINK_ERRORS, VIOLATION_POLICIES, Gpu, GpuBackend, GpuBoard, GpuCapabilities, GpuHealth, GpuSample, NvLink)
from ..events import GpuEvent
from . import gpm
from .physics import VIOLATION_OF, operating_point
from . import power as channel_io
from .scenario import PCIE_MAX, Event, GpuModel, Scenario

MIB = 1024 * 1024
RESET_S = 1.0  # a scripted gpu_reset's default time off the bus
MEMORY_ABOVE_DIE_C = 4  # the simulated HBM's sensor: the die's temperature plus this (no heat model of its own)


class ManualClock:
    """A time source that tests advance by hand: no sleeping."""

    def __init__(self, start: float = 0.0):
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def wall_clock() -> Callable[[], float]:
    """Seconds since the simulation started, from the monotonic clock."""
    start = time.monotonic()
    return lambda: time.monotonic() - start


class SimBackend(GpuBackend):
    def __init__(self, scenario: Scenario, clock: Callable[[], float] | None = None):
        self.scenario = scenario
        # The served workload's channel (sim/power.py): the cards' settings outlive this process, as a real
        # card's do while its driver stays loaded, so tuning's originals are kept on disk too (originals.py).
        # Through it a test also moves the timeline on to a fault (clock.json) once its engine is up.
        self.channel = channel_io.channel()
        clock = clock or wall_clock()
        self.clock = channel_io.movable(clock, self.channel) if self.channel is not None else clock
        self._pending = list(scenario.events)
        self._time = self.clock()
        self._gpus = [SimGpu(self, i, model) for i, model in enumerate(scenario.gpus)]
        self.persistent = self.channel is not None
        if self.channel is not None:
            self._load_settings(self.channel)
        self.advance()
        self.publish()

    def _load_settings(self, directory) -> None:
        for saved in channel_io.read_gpus(directory):
            gpu = next((g for g in self._gpus if g.index == saved.get("index")), None)
            if gpu is None:
                continue
            m = gpu.model
            limit = saved.get("power_limit_w")
            if isinstance(limit, (int, float)) and m.min_power_limit_w <= limit <= m.max_power_limit_w:
                gpu.power_limit_w = float(limit)
            lock = saved.get("gpu_lock")
            if isinstance(lock, list) and len(lock) == 2 and all(isinstance(v, int) for v in lock):
                gpu.gpu_lock = (lock[0], lock[1])

    def publish(self) -> None:
        """Tell the served workload each card's settings and the clock it keeps under load."""
        if self.channel is None:
            return
        try:
            channel_io.write_gpus(self.channel, [g.published() for g in self._gpus])
        except OSError:
            pass  # the workload keeps the last settings it saw; the daemon goes on

    def gpus(self) -> list[Gpu]:
        return list(self._gpus)

    def events(self) -> SimEvents:
        return SimEvents(self)

    def driver_version(self) -> str | None:
        return self.scenario.driver_version

    def persistenced_state(self) -> str:
        return self.scenario.nvidia_persistenced

    def advance(self) -> None:
        """Play the timeline up to now, integrating energy and violation time."""
        now = self.clock()
        load = channel_io.read_load(self.channel) if self.channel is not None else None
        if load is not None:
            self._integrate_to(now)  # the time before this look ran at the old load
            for gpu in self._gpus:  # the cards the server names (load.json's "gpus"; all without it) serve its load
                mine = load.serves(gpu.index)
                gpu.utilization = 100.0 if load.busy and mine else 0.0
                gpu.prefill_share = load.prefill_share if mine else None
        while self._pending and self._pending[0].at_s <= now:
            event = self._pending.pop(0)
            self._integrate_to(max(event.at_s, self._time))
            for gpu in self._gpus:
                if event.gpus is None or gpu.index in event.gpus:
                    gpu.apply(event)
        for gpu in self._gpus:
            gpu.reset_done(now)
        self._integrate_to(now)

    def _integrate_to(self, t: float) -> None:
        dt = t - self._time
        if dt > 0:
            for gpu in self._gpus:
                gpu.integrate(dt)
            self._time = t


class SimGpu(Gpu):
    def __init__(self, backend: SimBackend, index: int, model: GpuModel):
        self.backend, self.index, self.model = backend, index, model
        self.name = model.name
        self.uuid = "GPU-" + str(uuidlib.uuid5(uuidlib.NAMESPACE_URL,
                                               f"gpuwarden-sim/{backend.scenario.name}/{index}"))
        self.pci_bus_id = f"00000000:{(index + 1) * 0x10:02X}:00.0"
        self.utilization = 0.0
        self.prefill_share: float | None = None  # what the served workload does (sim/power.py), for sim/gpm.py
        self.memory_used_pct = 1.0
        self.conditions: dict[str, dict] = {}  # active condition events by kind
        self.lost = False
        self.energy_j = 0.0
        self.violations = {name: 0.0 for name in VIOLATION_POLICIES}
        self.processes: list[tuple[int, int | None]] = []  # compute processes a test puts on the card
        self.context = False  # an engine of the daemon's holds a CUDA context here (note_engine)
        self.ecc_uncorrected = 0
        self.remap_failure = False
        self.pcie_replays = 0.0
        self.nvlink_errors = {link: dict.fromkeys(NVLINK_ERRORS, 0.0) for link in range(model.nvlinks)}
        self.back_at: float | None = None  # a reset in progress (lost meanwhile): when the card answers again
        self.resets = 0
        self._reset_driver_state()

    def _reset_driver_state(self) -> None:
        """What a driver load leaves: no locks, persistence off, default power limit."""
        self.persistence = False
        self.gpu_lock: tuple[int, int] | None = None
        self.memory_lock: tuple[int, int] | None = None
        self.power_limit_w = self.model.default_power_limit_w
        self.recovery_action = 0  # the driver's recovery action field: none until an event sets one

    # -- timeline ---------------------------------------------------------------
    def apply(self, event: Event) -> None:
        # One condition of a kind per GPU, except on NVLink, where each link has its own.
        key = f"{event.kind}:{int(event.params['link'])}" if "link" in event.params else event.kind
        if event.ends:
            self.conditions.pop(key, None)
            if event.kind == "gpu_lost":
                self.lost = False
                self._reset_driver_state()  # it comes back through a driver re-probe
            return
        if event.kind == "load":
            self.utilization = event.params["utilization_pct"]
            self.memory_used_pct = event.params.get("memory_used_pct", self.memory_used_pct)
        elif event.kind == "driver_reload":
            self._reset_driver_state()
        elif event.kind == "gpu_reset":
            self.reset(float(event.params.get("for_s", RESET_S)), at=event.at_s)
        elif event.kind == "gpu_lost":
            self.lost = True
        elif event.kind == "ecc_uncorrected":
            self.ecc_uncorrected += int(event.params.get("count", 1))
        elif event.kind == "row_remap_failure":
            self.remap_failure = True
        elif event.kind == "recovery_action":  # to the event thread (SimEvents), and the polled field follows it
            self.recovery_action = int(event.params["action"])
        elif event.kind != "xid":  # an Xid only goes to the event thread (SimEvents), as NVML's event set does
            self.conditions[key] = dict(event.params)

    def reset(self, seconds: float = 0.0, at: float | None = None) -> None:
        """A GPU reset: lost for `seconds`, then back (reset_done) with every condition and the volatile ECC count
        cleared and the driver's defaults (no locks, no recovery action); a failed row remap stays."""
        self.resets, self.ecc_uncorrected, self.lost = self.resets + 1, 0, True
        self.conditions.clear()
        self.back_at = (self.backend.clock() if at is None else at) + seconds
        self.reset_done(self.backend.clock())

    def reset_done(self, now: float) -> None:
        if self.back_at is not None and now >= self.back_at:  # the reset's time is up: it answers again
            self.back_at, self.lost = None, False
            self._reset_driver_state()

    def _nvlinks(self) -> tuple[NvLink, ...]:
        """Links spread over the other GPUs in turn (all-to-all), or all to NVSwitch."""
        m, scenario = self.model, self.backend.scenario
        others = [f"GPU{i}" for i in range(len(scenario.gpus)) if i != self.index]
        links = []
        for link in range(m.nvlinks):
            fault = self.conditions.get(f"nvlink_fault:{link}")
            peer = "NVSwitch" if scenario.topology == "nvswitch" else others[link % len(others)] if others else None
            speed = int(fault["speed_mbps"]) if fault and "speed_mbps" in fault else m.nvlink_speed_mbps
            errors = {k: int(v) for k, v in self.nvlink_errors[link].items()}
            links.append(NvLink(link, "down" if fault and "speed_mbps" not in fault else "up", peer, speed, **errors))
        return tuple(links)

    def _health(self) -> GpuHealth:
        ns = self.model.not_supported
        link = self.conditions.get("pcie_link", {})
        gen_max, width_max = PCIE_MAX
        pcie = {} if "pcie" in ns else dict(
            pcie_generation=int(link.get("generation", gen_max)), pcie_generation_max=gen_max,
            pcie_width=int(link.get("width", width_max)), pcie_width_max=width_max,
            pcie_replays=int(self.pcie_replays))
        memory = {} if "memory_errors" in ns else dict(
            ecc_uncorrected=self.ecc_uncorrected, remapped_rows_correctable=0,
            remapped_rows_uncorrectable=int(self.ecc_uncorrected > 0),
            remap_pending="row_remap_pending" in self.conditions, remap_failure=self.remap_failure)
        fabric = {}
        if self.backend.scenario.topology == "nvswitch":
            fabric = {"fabric": "in_progress" if "fabric_not_ready" in self.conditions else "completed"}
        return GpuHealth(**pcie, **memory, nvlinks=self._nvlinks(), **fabric, recovery_action=self.recovery_action)

    def integrate(self, dt: float) -> None:
        if self.lost:
            return
        _, _, power, _, reasons = operating_point(self)
        self.energy_j += power * dt
        if "pcie_link" in self.conditions and self.utilization:
            self.pcie_replays += 10 * dt  # a link that trains down under load retries
        for link, counts in self.nvlink_errors.items():
            rates = self.conditions.get(f"nvlink_errors:{link}", {})
            for kind in NVLINK_ERRORS:
                counts[kind] += rates.get(f"{kind}_per_s", 0) * dt
        for reason, counter in VIOLATION_OF.items():
            if reason in reasons:
                self.violations[counter] += dt

    def published(self) -> dict:
        """What the served workload reads (sim/power.py): the settings, and the clock fraction under full load."""
        m, utilization = self.model, self.utilization
        self.utilization = 100.0
        try:
            sm = operating_point(self)[0]
        finally:
            self.utilization = utilization
        return {"index": self.index, "power_limit_w": self.power_limit_w,
                "gpu_lock": list(self.gpu_lock) if self.gpu_lock else None,
                "loaded_fraction": sm / m.graphics_clock_max_mhz,
                "decode_knee_fraction": channel_io.decode_knee_fraction(m.idle_power_w, m.full_load_power_w,
                                                                        m.max_power_limit_w)}

    # -- Gpu interface ----------------------------------------------------------
    def energy_mj(self) -> int | None:
        self.backend.advance()
        return None if self.lost or "energy" in self.model.not_supported else int(self.energy_j * 1000)

    def sample(self, counters: bool | None = None) -> GpuSample:
        self.backend.advance()  # the simulated counters integrate continuously: there is nothing to schedule
        now = self.backend.clock()
        if self.lost:
            return GpuSample(self.index, self.uuid, self.name, self.pci_bus_id, self.model.compute_capability,
                             up=False, timestamp=now, error=f"GPU {self.index} ({self.uuid}) is lost")
        m, ns = self.model, self.model.not_supported
        sm, mem, power, temp, reasons = operating_point(self)
        limits = "power_limit" not in ns
        total = m.memory_total_mib * MIB
        return GpuSample(
            self.index, self.uuid, self.name, self.pci_bus_id, m.compute_capability,
            up=True, timestamp=now,
            sm_clock_mhz=sm, memory_clock_mhz=mem, graphics_clock_mhz=sm,
            max_sm_clock_mhz=m.graphics_clock_max_mhz, max_memory_clock_mhz=m.memory_clocks_mhz[-1],
            max_graphics_clock_mhz=m.graphics_clock_max_mhz,
            power_w=round(power, 3),
            power_limit_w=self.power_limit_w if limits else None,
            power_limit_min_w=m.min_power_limit_w if limits else None,
            power_limit_max_w=m.max_power_limit_w if limits else None,
            power_limit_default_w=m.default_power_limit_w if limits else None,
            temperature_c=round(temp),
            memory_temperature_c=round(temp) + MEMORY_ABOVE_DIE_C if m.hbm else None,  # HBM's own sensor
            utilization_pct=self.utilization,
            memory_utilization_pct=self.utilization * mem / m.memory_clocks_mhz[-1],
            # Without NVML memory figures the backend reports the system's, which the GPU shares (DGX Spark):
            # the simulated system has memory_total_mib.
            memory_used_bytes=int(total * self.memory_used_pct / 100),
            memory_total_bytes=total,
            memory_unified="memory_info" in ns,
            driver_version=self.backend.scenario.driver_version,
            health=self._health(),
            persistence_mode=self.persistence if "persistence_mode" not in ns else None,
            performance_state=0 if sm > m.idle_sm_clock_mhz else 8,
            clock_event_reasons=reasons if "clock_event_reasons" not in ns else None,
            violation_seconds=dict(self.violations) if "violation_counters" not in ns
            else dict.fromkeys(self.violations),
            energy_joules=self.energy_j if "energy" not in ns else None,
            memory_bus_width_bits=m.memory_bus_width_bits,
            **gpm.figures(m, self.utilization, len(self.backend.scenario.gpus) - 1, self.conditions.get("gpm"),
                          self.prefill_share),
            board=GpuBoard(m.brand, m.form_factor),
            peer_paths={i: self.backend.scenario.topology for i in range(len(self.backend.scenario.gpus))
                        if i != self.index},
            iommu=self.backend.scenario.iommu,
        )

    def compute_processes(self) -> list[tuple[int, int | None]]:
        return list(self.processes)

    def note_engine(self, held: bool) -> None:
        self.context = held

    def capabilities(self) -> GpuCapabilities:
        m = self.model
        limits = "power_limit" not in m.not_supported
        return GpuCapabilities(
            memory_clocks_mhz=tuple(sorted(m.memory_clocks_mhz, reverse=True)),
            graphics_clocks_mhz=m.graphics_clocks_mhz,
            power_limit_min_w=m.min_power_limit_w if limits else None,
            power_limit_max_w=m.max_power_limit_w if limits else None,
            power_limit_default_w=m.default_power_limit_w if limits else None,
        )

    def gpm_unsupported(self) -> str | None:
        if gpm.supported(self.model):
            return None
        why = "gpm in its not_supported" if "gpm" in self.model.not_supported else \
            f"compute capability {self.model.compute_capability}, before Hopper"
        return f"scenario {self.backend.scenario.name} models this {self.name} without it ({why})"

    def _setter(self, what: str, feature: str | None = None) -> None:
        """The checks a real setter makes, in NVML's order."""
        self.backend.advance()
        where = f"GPU {self.index} ({self.uuid}): {what}"
        if self.lost:
            raise errors.GpuLost(f"{where} failed: the GPU is lost (NVML_ERROR_GPU_IS_LOST)")
        if feature in self.model.not_supported:
            raise errors.NotSupported(f"{where} is not supported on this GPU (NVML_ERROR_NOT_SUPPORTED)")
        if not self.backend.scenario.as_root:
            raise errors.NoPermission(f"{where} needs root or CAP_SYS_ADMIN (NVML_ERROR_NO_PERMISSION)")

    def _check_range(self, what: str, low: float, high: float, allowed_low: float, allowed_high: float) -> None:
        if low > high or low < allowed_low or high > allowed_high:
            raise errors.InvalidArgument(
                f"GPU {self.index} ({self.uuid}): {what} was rejected as out of range "
                f"(allowed {allowed_low:g}-{allowed_high:g}) (NVML_ERROR_INVALID_ARGUMENT)")

    def set_persistence_mode(self, enabled: bool) -> None:
        self._setter("setting persistence mode", "persistence_mode")
        self.persistence = enabled

    def set_gpu_locked_clocks(self, min_mhz: int, max_mhz: int) -> None:
        self._setter(f"locking GPU clocks to {min_mhz}-{max_mhz} MHz")
        m = self.model
        self._check_range(f"locking GPU clocks to {min_mhz}-{max_mhz} MHz", min_mhz, max_mhz,
                          m.graphics_clocks_mhz[-1], m.graphics_clock_max_mhz)
        self.gpu_lock = (min_mhz, max_mhz)
        self.backend.publish()

    def reset_gpu_locked_clocks(self) -> None:
        self._setter("resetting locked GPU clocks")
        self.gpu_lock = None
        self.backend.publish()

    def set_memory_locked_clocks(self, min_mhz: int, max_mhz: int) -> None:
        what = f"locking memory clocks to {min_mhz}-{max_mhz} MHz"
        self._setter(what, "memory_locked_clocks")
        self._check_range(what, min_mhz, max_mhz, self.model.memory_clocks_mhz[0], self.model.memory_clocks_mhz[-1])
        self.memory_lock = (min_mhz, max_mhz)

    def reset_memory_locked_clocks(self) -> None:
        self._setter("resetting locked memory clocks", "memory_locked_clocks")
        self.memory_lock = None

    def set_power_limit_w(self, watts: float) -> None:
        what = f"setting the power limit to {watts:g} W"
        self._setter(what, "power_limit")
        self._check_range(what, watts, watts, self.model.min_power_limit_w, self.model.max_power_limit_w)
        self.power_limit_w = watts
        self.backend.publish()


class SimEvents:
    """The timeline's xid and recovery_action events, handed out as NVML's event set would: when due."""

    def __init__(self, backend: SimBackend):
        self.clock = backend.clock
        self.registered = {g.index: ["xid", "recovery_action"] for g in backend.gpus()}
        indices = [g.index for g in backend.gpus()]
        self._due: list[tuple[float, GpuEvent]] = []
        for event in backend.scenario.events:
            if event.kind not in ("xid", "recovery_action") or event.ends:
                continue
            for index in event.gpus if event.gpus is not None else indices:
                if event.kind == "xid":
                    count = int(event.params.get("count", 1))
                    self._due += [(event.at_s, GpuEvent(index, "xid", int(event.params["xid"])))] * count
                else:
                    self._due.append((event.at_s, GpuEvent(index, "recovery_action", int(event.params["action"]))))
        self._due.sort(key=lambda pair: pair[0])
        self._closed = False

    def wait(self, timeout_s: float) -> list[GpuEvent]:
        deadline = time.monotonic() + timeout_s
        while not self._closed:
            now = self.clock()
            if self._due and self._due[0][0] <= now:
                ready = [event for at, event in self._due if at <= now]
                self._due = self._due[len(ready):]
                return ready
            left = deadline - time.monotonic()
            if left <= 0:
                return []
            time.sleep(min(left, 0.05))
        return []

    def close(self) -> None:
        self._closed = True

