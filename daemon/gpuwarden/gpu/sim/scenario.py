"""Scenario files for the simulated backend: GPU models plus a timeline.

The format is documented in docs/scenario-format.md; the built-in scenarios live in
gpu/scenarios/*.yaml and double as examples.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from collections.abc import Mapping

from ...base import yamlfile
from ...base.schema import MISSING, Reader, type_name
from ..base import GPM_RATIOS, GPM_RATES, PEER_PATHS

BUILTIN_DIR = Path(__file__).resolve().parent.parent / "scenarios"

NOT_SUPPORTED_CHOICES = ("memory_info", "power_limit", "memory_locked_clocks", "persistence_mode",
                         "energy", "violation_counters", "clock_event_reasons", "pcie", "memory_errors", "gpm")
BRAND_CHOICES = ("NVIDIA RTX", "Quadro RTX", "Quadro", "GeForce", "GeForce RTX", "Titan", "Tesla", "NVIDIA")
TOPOLOGY_CHOICES = tuple(PEER_PATHS)
PERSISTENCED_CHOICES = ("running", "stopped", "absent")  # true and false mean running and absent
IOMMU_CHOICES = ("off", "passthrough", "translating")


def gpm_param(field: str) -> str:
    """The `gpm` event's parameter for a GpuSample GPM field: a ratio in percent, a rate in MiB/s (as NVML)."""
    return field.replace("_ratio", "_pct").replace("_bytes_per_s", "_mib_per_s")


# Event kind -> {parameter: (required, low, high)}; numbers only, except `hardware`.
EVENT_PARAMS: dict[str, dict[str, tuple[bool, float, float]]] = {
    "load": {"utilization_pct": (True, 0, 100), "memory_used_pct": (False, 0, 100)},
    "clock_collapse": {"sm_clock_mhz": (False, 1, 100_000)},
    "power_cap": {"watts": (True, 1, 5_000)},
    "thermal_slowdown": {"temperature_c": (False, 0, 150), "sm_clock_mhz": (False, 1, 100_000)},
    "hw_thermal_slowdown": {"temperature_c": (False, 0, 150), "sm_clock_mhz": (False, 1, 100_000)},
    "hw_slowdown": {"sm_clock_mhz": (False, 1, 100_000)},
    "power_brake": {"sm_clock_mhz": (False, 1, 100_000)},
    "driver_reload": {},
    "gpu_lost": {},
    # a GPU reset (nvidia-smi --gpu-reset, or the daemon's): the card is gone for for_s, then back with its faults
    # cleared and its settings at the driver's defaults
    "gpu_reset": {"for_s": (False, 0, 60)},
    "pcie_link": {"generation": (True, 1, 6), "width": (False, 1, 32)},
    "ecc_uncorrected": {"count": (False, 1, 1_000_000)},
    "row_remap_pending": {},
    "row_remap_failure": {},
    "xid": {"xid": (True, 1, 1_000), "count": (False, 1, 100_000)},  # as NVML's event set reports them
    "recovery_action": {"action": (True, 0, 7)},  # nvmlDeviceGpuRecoveryAction_t (gpu/events.RECOVERY_ACTIONS)
    # NVLink: a link goes down (or, with speed_mbps, retrains slower); error counters grow at these rates
    "nvlink_fault": {"link": (True, 0, 35), "speed_mbps": (False, 1, 1_000_000)},
    "nvlink_errors": {"link": (True, 0, 35), "replay_per_s": (False, 0, 1e6), "recovery_per_s": (False, 0, 1e6),
                      "crc_per_s": (False, 0, 1e6)},
    "fabric_not_ready": {},  # the NVSwitch fabric's registration is in progress (the fabric manager is down)
    # GPM's figures, scripted: each one named replaces the one derived from the load (sim/backend.py)
    "gpm": {**{gpm_param(f): (False, 0, 100) for f in GPM_RATIOS},
            **{gpm_param(f): (False, 0, 10_000_000) for f in GPM_RATES}},
}
# Events that describe a condition with a start and (optionally) an end.
CONDITIONS = ("clock_collapse", "power_cap", "thermal_slowdown", "hw_thermal_slowdown",
              "hw_slowdown", "power_brake", "gpu_lost", "pcie_link", "row_remap_pending", "nvlink_fault",
              "nvlink_errors", "fabric_not_ready", "gpm")
PCIE_MAX = (5, 16)  # every simulated card sits in a Gen5 x16 slot
HBM_STACK_BITS = 1024  # an HBM stack's interface: an HBM card's memory bus is a multiple of it


@dataclass(frozen=True)
class GpuModel:
    name: str
    compute_capability: str
    memory_total_mib: int
    memory_bus_width_bits: int
    memory_clocks_mhz: tuple[int, ...]  # ascending
    graphics_clock_min_mhz: int
    graphics_clock_max_mhz: int
    graphics_clock_step_mhz: int
    idle_sm_clock_mhz: int
    idle_memory_clock_mhz: int
    boost_under_load: bool
    idle_power_w: float
    full_load_power_w: float  # at 100 % utilization and the max graphics clock
    default_power_limit_w: float
    min_power_limit_w: float
    max_power_limit_w: float
    idle_temperature_c: float
    celsius_per_watt: float
    not_supported: frozenset[str] = frozenset()
    brand: str | None = None
    form_factor: str | None = None
    nvlinks: int = 0  # NVLink links, each at nvlink_speed_mbps
    nvlink_speed_mbps: int = 0
    # An engine's CUDA context at rest: the card boosts to its max graphics clock and draws this much above idle
    # (an H200, driver 580.159.04: 116.2 W at 1980 MHz against 76.9 W bare; issue 54); 0: a context costs nothing
    context_w: float = 0.0

    @property
    def hbm(self) -> bool:
        """Whether its memory is HBM, which has the sensor NVML's memory temperature reads: a bus of whole HBM
        stacks (A100 and H100 5120 bits, H200 6144, B200 8192). GDDR cards' buses are 512 bits at most (RTX PRO,
        L4, L40S) and DGX Spark's LPDDR is 256: those report no memory temperature."""
        return self.memory_bus_width_bits >= HBM_STACK_BITS

    @property
    def graphics_clocks_mhz(self) -> tuple[int, ...]:
        """Supported graphics clocks, descending, as NVML lists them."""
        return tuple(range(self.graphics_clock_max_mhz, self.graphics_clock_min_mhz - 1,
                           -self.graphics_clock_step_mhz))


@dataclass(frozen=True)
class Event:
    at_s: float
    kind: str
    gpus: tuple[int, ...] | None  # None: every GPU
    params: Mapping[str, Any] = field(default_factory=dict)
    ends: bool = False  # the end of a condition started by an event of the same kind


@dataclass(frozen=True)
class Scenario:
    name: str
    description: str
    file: str
    as_root: bool
    nvidia_persistenced: str  # running, stopped (installed) or absent
    driver_version: str
    gpus: tuple[GpuModel, ...]
    events: tuple[Event, ...]  # sorted by time; condition ends included
    topology: str = "host_bridge"  # how every pair of GPUs talks: a key of gpu.base.PEER_PATHS
    iommu: str = "off"


def builtin_scenarios() -> list[str]:
    return sorted(p.stem for p in BUILTIN_DIR.glob("*.yaml"))


def resolve_scenario(name: str, base_dir: Path | None = None) -> Path | None:
    """A built-in name or a file path (relative to base_dir); None if neither exists."""
    if name in builtin_scenarios():
        return BUILTIN_DIR / f"{name}.yaml"
    path = Path(name)
    if not path.is_absolute() and base_dir is not None:
        path = base_dir / path
    return path if path.is_file() else None


def unknown_scenario(name: str) -> tuple[str, str]:
    """(message, allowed) for a scenario that is neither built in nor a file."""
    return (f"no scenario named '{name}' and no such file",
            "built-in: " + ", ".join(builtin_scenarios()) + ", or a path to a scenario file")


def load_scenario(path: str | Path) -> Scenario:
    """Parse and validate; raise ConfigError/ConfigErrors with FILE:LINE."""
    doc = yamlfile.load(path)
    if not isinstance(doc.value, dict):
        raise yamlfile.ConfigError(doc.file, 1, "(top level)",
                                   f"expected a scenario mapping, got {type_name(doc.value)}")
    r = Reader(doc)
    r.mapping((), ("name", "description", "as_root", "nvidia_persistenced", "driver_version", "topology", "iommu",
                   "gpus", "timeline"), required=("name", "gpus"))
    models: list[GpuModel] = []
    for i, _ in enumerate(r.sequence(("gpus",))):
        models.extend(_gpu_models(r, ("gpus", str(i))))
    if not models and not r.errors:
        r.fail(("gpus",), "a scenario needs at least one GPU")
    events = _timeline(r, models)
    topology = r.string(("topology",), "host_bridge", TOPOLOGY_CHOICES)
    if topology in ("nvlink", "nvswitch") and not all(m.nvlinks for m in models):
        r.fail(("topology",), f"topology {topology} needs nvlink: {{links: N}} on every GPU")
    persistenced = r.get(("nvidia_persistenced",))
    if isinstance(persistenced, bool) or persistenced is MISSING:
        persistenced = "running" if persistenced is True else "absent"
    else:
        persistenced = r.string(("nvidia_persistenced",), "absent", PERSISTENCED_CHOICES)
    r.raise_if_errors()
    return Scenario(
        name=r.string(("name",), Path(path).stem),
        description=r.string(("description",), ""),
        file=str(path),
        as_root=r.boolean(("as_root",), True),
        nvidia_persistenced=persistenced,
        driver_version=r.string(("driver_version",), "580.126.20"),
        gpus=tuple(models),
        events=tuple(sorted(events, key=lambda e: e.at_s)),
        topology=topology,
        iommu=r.string(("iommu",), "off", IOMMU_CHOICES),
    )


def _gpu_models(r: Reader, path: tuple[str, ...]) -> list[GpuModel]:
    keys = ("name", "count", "compute_capability", "memory_total_mib", "memory_bus_width_bits",
            "memory_clocks_mhz", "graphics_clocks_mhz", "idle_clocks_mhz", "boost_under_load",
            "power", "temperature", "not_supported", "brand", "form_factor", "nvlink")
    r.mapping(path, keys, required=("name", "compute_capability", "memory_clocks_mhz", "graphics_clocks_mhz"))
    count = r.number(path + ("count",), 1, 1, 64, integer=True)
    cc = r.get(path + ("compute_capability",))
    if not (isinstance(cc, str) and cc.count(".") == 1 and all(p.isdigit() for p in cc.split("."))):
        r.fail(path + ("compute_capability",), f"expected a quoted \"MAJOR.MINOR\" string, got {cc!r}",
               'e.g. "12.0"')
    mem = _int_list(r, path + ("memory_clocks_mhz",), 1)
    graphics = _int_list(r, path + ("graphics_clocks_mhz",), 3)
    if graphics and (len(graphics) != 3 or graphics[0] > graphics[1]):
        r.fail(path + ("graphics_clocks_mhz",), f"expected [MIN, MAX, STEP] with MIN <= MAX, got {graphics}")
        graphics = []
    gmin, gmax, gstep = graphics if graphics else (1, 1, 1)
    mem = sorted(mem) or [1]
    r.mapping(path + ("idle_clocks_mhz",), ("sm", "memory"))
    r.mapping(path + ("power",), ("idle_w", "full_load_w", "default_limit_w", "min_limit_w", "max_limit_w",
                                  "context_w"))
    r.mapping(path + ("temperature",), ("idle_c", "celsius_per_watt"))
    p = path + ("power",)
    full_w = r.number(p + ("full_load_w",), 300.0, 1, 5000, unit=" W")
    default_limit = r.number(p + ("default_limit_w",), full_w, 1, 5000, unit=" W")
    if r.get(path + ("nvlink",)) is not MISSING:
        r.mapping(path + ("nvlink",), ("links", "speed_mbps"), required=("links",))
    unsupported = r.sequence(path + ("not_supported",))
    for j, item in enumerate(unsupported):
        if item not in NOT_SUPPORTED_CHOICES:
            r.fail(path + ("not_supported", str(j)), f"unknown item {item!r}",
                   "allowed: " + ", ".join(NOT_SUPPORTED_CHOICES))
    model = GpuModel(
        name=r.string(path + ("name",), "Simulated GPU"),
        compute_capability=cc if isinstance(cc, str) else "0.0",
        memory_total_mib=r.number(path + ("memory_total_mib",), 24576, 1, 10_000_000, integer=True),
        memory_bus_width_bits=r.number(path + ("memory_bus_width_bits",), 256, 8, 65536, integer=True),
        memory_clocks_mhz=tuple(mem),
        graphics_clock_min_mhz=gmin, graphics_clock_max_mhz=gmax, graphics_clock_step_mhz=max(gstep, 1),
        idle_sm_clock_mhz=r.number(path + ("idle_clocks_mhz", "sm"), gmin, 1, 100_000, integer=True),
        idle_memory_clock_mhz=r.number(path + ("idle_clocks_mhz", "memory"), mem[0], 1, 100_000, integer=True),
        boost_under_load=r.boolean(path + ("boost_under_load",), True),
        idle_power_w=r.number(p + ("idle_w",), 20.0, 0, 5000, unit=" W"),
        full_load_power_w=full_w,
        default_power_limit_w=default_limit,
        min_power_limit_w=r.number(p + ("min_limit_w",), default_limit / 2, 1, 5000, unit=" W"),
        max_power_limit_w=r.number(p + ("max_limit_w",), default_limit, 1, 5000, unit=" W"),
        idle_temperature_c=r.number(path + ("temperature", "idle_c"), 30.0, 0, 150),
        celsius_per_watt=r.number(path + ("temperature", "celsius_per_watt"), 0.2, 0, 10),
        not_supported=frozenset(i for i in unsupported if isinstance(i, str)),
        brand=r.string(path + ("brand",), None, BRAND_CHOICES),
        form_factor=r.string(path + ("form_factor",), None, ("sxm", "pcie")),
        nvlinks=r.number(path + ("nvlink", "links"), 0, 1, 36, integer=True),
        nvlink_speed_mbps=r.number(path + ("nvlink", "speed_mbps"), 26562, 1, 1_000_000, integer=True),
        context_w=r.number(p + ("context_w",), 0.0, 0, 5000, unit=" W"),
    )
    if not model.min_power_limit_w <= model.default_power_limit_w <= model.max_power_limit_w:
        r.fail(p, "limits must satisfy min_limit_w <= default_limit_w <= max_limit_w")
    if model.full_load_power_w <= model.idle_power_w:  # the clock model divides by their difference
        r.fail(p + ("full_load_w",), f"full_load_w {model.full_load_power_w:g} W must be above idle_w "
               f"{model.idle_power_w:g} W")
    return [model] * count


def _int_list(r: Reader, path: tuple[str, ...], min_len: int) -> list[int]:
    value = r.get(path)
    if not isinstance(value, list) or len(value) < min_len or not all(
            isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value):
        r.fail(path, f"expected a list of positive whole MHz values, got {value!r}")
        return []
    return value


def _timeline(r: Reader, models: list[GpuModel]) -> list[Event]:
    gpu_count = len(models)
    events = []
    for i, _ in enumerate(r.sequence(("timeline",))):
        path = ("timeline", str(i))
        kind = r.string(path + ("event",), None, tuple(EVENT_PARAMS))
        params_spec = EVENT_PARAMS.get(kind, {})
        r.mapping(path, ("at_s", "until_s", "event", "gpus", *params_spec), required=("at_s", "event"))
        at = r.number(path + ("at_s",), 0.0, 0, 1e9, unit=" s")
        until = r.number(path + ("until_s",), None, 0, 1e9, unit=" s")
        if until is not None and kind not in CONDITIONS:
            r.fail(path + ("until_s",), f"'{kind}' is instantaneous and takes no until_s",
                   "until_s applies to: " + ", ".join(CONDITIONS))
        elif until is not None and until <= at:
            r.fail(path + ("until_s",), f"until_s {until:g} is not after at_s {at:g}")
        gpus = _gpu_selection(r, path + ("gpus",), gpu_count)
        params = {}
        for name, (required, low, high) in params_spec.items():
            if r.get(path + (name,)) is MISSING:
                if required:
                    r.fail(path, f"event '{kind}' needs '{name}'")
                continue
            value = r.number(path + (name,), None, low, high)
            if value is not None:
                params[name] = value
        if kind is None:
            continue
        link = params.get("link")
        if link is not None and any(link >= models[g].nvlinks for g in (gpus or range(gpu_count))):
            r.fail(path + ("link",), f"no NVLink link {link:g} on the GPUs it names",
                   "a link below each GPU's nvlink.links")
        events.append(Event(at, kind, gpus, params))
        if until is not None:
            events.append(Event(until, kind, gpus, params, ends=True))
    return events


def _gpu_selection(r: Reader, path: tuple[str, ...], gpu_count: int) -> tuple[int, ...] | None:
    value = r.get(path)
    if value is MISSING or value == "all":
        return None
    indices = value if isinstance(value, list) else [value]
    for index in indices:
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < gpu_count:
            r.fail(path, f"no GPU {index!r} in this scenario", f"all, or indices 0-{gpu_count - 1}")
            return None
    return tuple(indices)
