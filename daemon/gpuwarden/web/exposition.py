"""The /metrics body from the latest snapshot (the /status JSON is the snapshot's own; web/server.py serves both).

Following client_python's guidance for exporters: our own CollectorRegistry and
a collector that builds fresh metric families on each scrape, in base units. A
scrape only reads the snapshot; it never calls NVML.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from .. import __version__
from ..tune import tunables
from ..gpu.base import VIOLATION_POLICIES, ClockEventReason
from ..watch.monitor import Snapshot

log = logging.getLogger("gpuwarden")
MHZ = 1e6
REASON_NAMES = [r.name for r in ClockEventReason if r]


class SnapshotCollector:
    def __init__(self, snapshot: Callable[[], Snapshot | None]):
        self.snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        build = GaugeMetricFamily("gpuwarden_build_info", "gpuwarden version", labels=["version"])
        build.add_metric([__version__], 1)
        yield build
        snap = self.snapshot()
        if snap is None:  # before the first tick
            return
        yield from _gpu_metrics(snap)
        yield from _alert_metrics(snap)
        if snap.serving is not None:
            yield from _serving_metrics(snap)
        yield GaugeMetricFamily("gpuwarden_sample_duration_seconds",
                                "Time the last poll took to sample every GPU", value=snap.sample_duration_s)
        yield GaugeMetricFamily("gpuwarden_loop_lag_seconds",
                                "How late the last poll started against its schedule", value=snap.loop_lag_s)
        yield GaugeMetricFamily("gpuwarden_last_sample_timestamp_seconds",
                                "Unix time of the last poll", value=snap.taken_at)


def _gauge(name: str, doc: str, labels: tuple[str, ...] = ("gpu",)) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, labels=list(labels))


def _gpu_metrics(snap: Snapshot) -> Iterator[Metric]:
    info = _gauge("gpuwarden_gpu_info", "GPU identity (value is always 1)",
                  ("gpu", "uuid", "name", "pci_bus_id", "compute_capability"))
    up = _gauge("gpuwarden_gpu_up", "1 if the GPU answered the last poll")
    # (metric, help, value from the view); value None means "not reported by this GPU".
    gauges = [
        ("gpuwarden_gpu_sm_clock_hertz", "Current SM clock", lambda v: _hz(v.sample.sm_clock_mhz)),
        ("gpuwarden_gpu_sm_clock_max_hertz", "Highest SM clock the GPU supports",
         lambda v: _hz(v.sample.max_sm_clock_mhz)),
        ("gpuwarden_gpu_memory_clock_hertz", "Current memory clock", lambda v: _hz(v.sample.memory_clock_mhz)),
        ("gpuwarden_gpu_memory_clock_max_hertz", "Highest memory clock the GPU supports",
         lambda v: _hz(v.sample.max_memory_clock_mhz)),
        ("gpuwarden_gpu_memory_bandwidth_bytes_per_second",
         "Peak memory bandwidth at the current memory clock (2 x clock x bus width / 8)",
         lambda v: v.sample.memory_bandwidth_bytes_per_s),
        ("gpuwarden_gpu_power_watts", "Current power draw", lambda v: v.sample.power_w),
        ("gpuwarden_gpu_power_limit_watts", "Enforced power limit", lambda v: v.sample.power_limit_w),
        ("gpuwarden_gpu_power_limit_max_watts", "Highest power limit the GPU accepts",
         lambda v: v.sample.power_limit_max_w),
        ("gpuwarden_gpu_power_limit_chosen_watts", ("Power limit gpuwarden sets on purpose: tuning.power_limit_w, "
         "or a tune sweep's step; absent where none is chosen. Where it equals the enforced limit, a power cap there "
         "is that choice"), lambda v: v.power_limit_chosen[0] if v.power_limit_chosen else None),
        ("gpuwarden_gpu_temperature_celsius", "GPU temperature", lambda v: v.sample.temperature_c),
        ("gpuwarden_gpu_utilization_ratio", "Fraction of time a kernel ran over the last sample period",
         lambda v: None if v.sample.utilization_pct is None else v.sample.utilization_pct / 100),
        ("gpuwarden_gpu_memory_used_bytes", "Device memory in use", lambda v: v.sample.memory_used_bytes),
        ("gpuwarden_gpu_memory_total_bytes", "Device memory in total", lambda v: v.sample.memory_total_bytes),
        ("gpuwarden_gpu_memory_reserved_bytes", "Device memory the driver reserves (not in used)",
         lambda v: v.sample.memory_reserved_bytes),
        ("gpuwarden_gpu_memory_unified", "1 if the memory figures are the system's, which the GPU shares "
         "(DGX Spark: NVML reports none of its own)", lambda v: int(v.sample.memory_unified)),
        ("gpuwarden_gpu_persistence_mode", "1 if persistence mode is on",
         lambda v: None if v.sample.persistence_mode is None else int(v.sample.persistence_mode)),
        ("gpuwarden_gpu_performance_state", "Performance state, 0 (P0, fastest) to 15",
         lambda v: v.sample.performance_state),
        ("gpuwarden_gpu_pcie_link_generation", "Current PCIe link generation",
         lambda v: v.sample.health.pcie_generation),
        ("gpuwarden_gpu_pcie_link_generation_max", "Highest PCIe generation the GPU and its slot support",
         lambda v: v.sample.health.pcie_generation_max),
        ("gpuwarden_gpu_pcie_link_width", "Current PCIe link width (lanes)", lambda v: v.sample.health.pcie_width),
        ("gpuwarden_gpu_pcie_link_width_max", "Widest PCIe link the GPU and its slot support",
         lambda v: v.sample.health.pcie_width_max),
        ("gpuwarden_gpu_ecc_uncorrected_errors", "Uncorrected ECC errors since the driver loaded (volatile)",
         lambda v: v.sample.health.ecc_uncorrected),
        ("gpuwarden_gpu_remapped_rows_correctable", "Memory rows remapped for correctable errors",
         lambda v: v.sample.health.remapped_rows_correctable),
        ("gpuwarden_gpu_remapped_rows_uncorrectable", "Memory rows remapped for uncorrectable errors",
         lambda v: v.sample.health.remapped_rows_uncorrectable),
        ("gpuwarden_gpu_row_remap_pending", "1 while a remapped row waits for a GPU reset",
         lambda v: _flag(v.sample.health.remap_pending)),
        ("gpuwarden_gpu_row_remap_failure", "1 once a row could not be remapped (replace the card)",
         lambda v: _flag(v.sample.health.remap_failure)),
        ("gpuwarden_gpu_retired_pages", "Memory pages retired (GPUs before Ampere)",
         lambda v: v.sample.health.retired_pages),
        ("gpuwarden_gpu_nvlink_links", "NVLink links the GPU has (where it has NVLink)",
         lambda v: len(v.sample.health.nvlinks) or None),
        ("gpuwarden_gpu_nvlink_links_up", "NVLink links up (or asleep, which wakes on traffic)",
         lambda v: sum(n.state in ("up", "sleep") for n in v.sample.health.nvlinks)
         if v.sample.health.nvlinks else None),
        ("gpuwarden_gpu_fabric_ready", "1 when the GPU's NVSwitch fabric registration completed with success "
         "(where the GPU has a fabric)", lambda v: _flag(v.sample.health.fabric_ready)),
    ]
    for lock in (t for t in tunables.TUNABLES if t.lock_of):  # a gauge for each clock lock the table sets
        gauges.append((f"gpuwarden_gpu_{lock.lock_of}_clock_lock_hertz", f"{lock.title} gpuwarden locks to "
                       "(upper bound)", lambda v, of=lock.lock_of: _hz(getattr(v, f"{of}_lock")[1])
                       if getattr(v, f"{of}_lock") else None))
    families = [(_gauge(name, doc), value) for name, doc, value in gauges]
    energy = CounterMetricFamily("gpuwarden_gpu_energy_joules", "Energy used since the driver loaded",
                                 labels=["gpu"])
    replays = CounterMetricFamily("gpuwarden_gpu_pcie_replays", "PCIe link-level retransmissions", labels=["gpu"])
    link_up = _gauge("gpuwarden_gpu_nvlink_link_up", "1 while the NVLink link is up (or asleep)", ("gpu", "link"))
    link_speed = _gauge("gpuwarden_gpu_nvlink_link_speed_bytes_per_second", "NVLink link speed per direction",
                        ("gpu", "link"))
    link_errors = CounterMetricFamily("gpuwarden_gpu_nvlink_errors", "NVLink data-link errors since the driver "
                                      "loaded, summed over the GPU's links (replay, recovery, crc)",
                                      labels=["gpu", "kind"])
    active = _gauge("gpuwarden_gpu_clock_event_active", "1 while a clock-event (throttle) reason is active",
                    ("gpu", "reason"))
    seconds = CounterMetricFamily("gpuwarden_gpu_clock_event_seconds",
                                  "Time clocks were held down, by NVML violation counter", labels=["gpu", "reason"])
    for view in snap.gpus:
        s = view.sample
        gpu = str(s.index)
        info.add_metric([gpu, s.uuid, s.name, s.pci_bus_id, s.compute_capability or ""], 1)
        up.add_metric([gpu], int(s.up))
        if not s.up:
            continue
        for family, value in families:
            v = value(view)
            if v is not None:
                family.add_metric([gpu], v)
        if s.energy_joules is not None:
            energy.add_metric([gpu], s.energy_joules)
        if s.health.pcie_replays is not None:
            replays.add_metric([gpu], s.health.pcie_replays)
        for n in s.health.nvlinks:
            if n.state != "unknown":
                link_up.add_metric([gpu, str(n.link)], int(n.state in ("up", "sleep")))
            if n.speed_mbps is not None:
                link_speed.add_metric([gpu, str(n.link)], n.speed_mbps * 1e6)
        for kind, count in s.health.nvlink_errors().items():
            link_errors.add_metric([gpu, kind], count)
        if s.clock_event_reasons is not None:
            for name in REASON_NAMES:
                active.add_metric([gpu, name], int(ClockEventReason[name] in s.clock_event_reasons))
        for policy in VIOLATION_POLICIES:
            v = s.violation_seconds.get(policy)
            if v is not None:
                seconds.add_metric([gpu, policy], v)
    yield info
    yield up
    for family, _ in families:
        yield family
    yield energy
    yield replays
    yield link_up
    yield link_speed
    yield link_errors
    yield active
    yield seconds


def _gpu_label(gpu: int | None) -> str:
    return "all" if gpu is None else str(gpu)


def _flag(value: bool | None) -> int | None:
    return None if value is None else int(value)


def _hz(mhz: float | None) -> float | None:
    return None if mhz is None else mhz * MHZ


def _alert_metrics(snap: Snapshot) -> Iterator[Metric]:
    active = _gauge("gpuwarden_alert_active", "1 while an alert fires", ("alert", "gpu", "severity"))
    for a in snap.alerts:  # host-wide ones (vLLM serves across the GPUs) carry gpu="all"
        active.add_metric([a.alert, _gpu_label(a.gpu), a.severity], int(a.firing))
    yield active
    transitions = CounterMetricFamily("gpuwarden_alert_transitions", "Alert state changes, by new state",
                                      labels=["alert", "gpu", "to"])
    for (alert, gpu, to), count in sorted(snap.transitions.items(), key=lambda item: str(item[0])):
        transitions.add_metric([alert, _gpu_label(gpu), to], count)
    yield transitions
    xid = CounterMetricFamily("gpuwarden_gpu_xid_errors", "Xid errors reported by NVML's event set",
                              labels=["gpu", "xid"])
    other = CounterMetricFamily("gpuwarden_gpu_events", "Other fatal GPU events (double-bit ECC, GPU unavailable, "
                                "recovery action, DRAM retirement, poisoned memory)", labels=["gpu", "kind"])
    totals = CounterMetricFamily("gpuwarden_gpu_xids", "All Xid errors of this GPU (0 until one comes: a series "
                                 "to alert and graph on)", labels=["gpu"])
    for view in snap.gpus:
        index = view.sample.index
        totals.add_metric([str(index)], sum(n for (gpu, _, kind), n in snap.event_counts.items()
                                            if gpu == index and kind == "xid"))
    yield totals
    for (gpu, number, kind), count in sorted(snap.event_counts.items()):
        if kind == "xid":
            xid.add_metric([str(gpu) if gpu >= 0 else "unknown", str(number)], count)
        else:
            other.add_metric([str(gpu) if gpu >= 0 else "unknown", kind], count)
    yield xid
    yield other
    reapplies = CounterMetricFamily("gpuwarden_tuning_reapplies", "Times the tuning was re-applied after drift",
                                    labels=["gpu"])
    for view in snap.gpus:
        reapplies.add_metric([str(view.sample.index)], snap.reapplies.get(view.sample.index, 0))
    yield reapplies


def _node_metrics(s: Any) -> Iterator[Metric]:
    """This node's part of a multi-node engine: who it is, and whether its part runs (a worker's needs the
    head to answer too). The head label (its rendezvous HOST:PORT) names the engine across the nodes."""
    rank = str(s.rank)
    info = _gauge("gpuwarden_serving_node_info", "This node's part of a multi-node engine: role, rank, node count, "
                  "backend's head address (value is always 1)", ("role", "rank", "nodes", "head"))
    info.add_metric([s.role, rank, str(s.nodes), s.head], 1)
    yield info
    up = _gauge("gpuwarden_serving_node_up", "1 while this node's part of the multi-node engine runs (a worker's: "
                "and the head's rendezvous answers)", ("rank", "head"))
    up.add_metric([rank, s.head], int(s.state == "RUNNING" and s.head_up is not False))
    yield up
    if s.head_up is not None:
        reach = _gauge("gpuwarden_serving_head_reachable", "1 if the head's rendezvous port accepted a connection "
                       "when last asked (workers only)", ("head",))
        reach.add_metric([s.head], int(s.head_up))
        yield reach


def _serving_metrics(snap: Snapshot) -> Iterator[Metric]:
    """Generic serving metrics with an engine label, for every engine, and the same numbers under the
    gpuwarden_vllm_* names (no label) while the engine is vLLM: those dashboards keep working this release."""
    from ..serving.run.supervisor import STATES

    s, stats = snap.serving, snap.stats
    legacy = s.engine == "vllm"
    info = _gauge("gpuwarden_serving_info", "The serving engine, model, profile and the engine's installed "
                  "version (empty where unknown; value is always 1)", ("engine", "model", "profile", "version"))
    info.add_metric([s.engine, s.model, s.profile, s.version], 1)
    yield info
    if s.role:
        yield from _node_metrics(s)
    state = _gauge("gpuwarden_serving_state", "1 for each supervised child's current state", ("child", "state"))
    for child in snap.children:
        for name in STATES:
            state.add_metric([child.engine, name], int(name == child.state))
    yield state
    restarts = CounterMetricFamily("gpuwarden_serving_restarts", "Times a supervised child was restarted",
                                   labels=["child"])
    stalls = CounterMetricFamily("gpuwarden_serving_stalls", "Times the engine made no progress (vllm_stalled)",
                                 labels=["child"])
    transitions = CounterMetricFamily("gpuwarden_serving_transitions", "State changes of a supervised child",
                                      labels=["child", "from", "to"])
    for child in snap.children:
        restarts.add_metric([child.engine], child.restarts)
        stalls.add_metric([child.engine], child.stalls)
        for old, new, count in child.transitions:
            transitions.add_metric([child.engine, old, new], count)
    yield restarts
    yield stalls
    yield transitions
    started = _gauge("gpuwarden_serving_start_time_seconds", "When the running child's process started (seconds "
                     "since the epoch; time() minus it is its uptime: an upgrade of gpuwarden does not reset it)",
                     ("child",))
    for child in snap.children:
        if child.started_at is not None:
            started.add_metric([child.engine], child.started_at)
    yield started
    values = (
        ("generation_tokens_per_second", "Generated tokens per second, between two polls",
         stats and stats.generation_tokens_per_s),
        ("prompt_tokens_per_second", "Prompt tokens per second, between two polls",
         stats and stats.prompt_tokens_per_s),
        ("requests_running", "Requests the engine is running", stats and stats.requests_running),
        ("requests_waiting", "Requests waiting in the engine's queue", stats and stats.requests_waiting),
        ("kv_cache_usage_ratio", "Fraction of the KV cache in use", stats and stats.kv_cache_usage_ratio))
    extras = [("last_exit_code", "Exit status of the last child (negative: signal)", s.last_exit_code),
              ("time_to_healthy_seconds", "Seconds from the last start to /health answering 200",
               s.time_to_healthy_s)]
    efficiency = ("tokens_per_joule", "Generated tokens per joule of the engine's GPUs (NVML's energy counters), "
                  "over the last minute", snap.tokens_per_joule)  # new: no gpuwarden_vllm_* twin
    for name, doc, value in (*values, *extras, efficiency):
        if value is not None:
            family = _gauge(f"gpuwarden_serving_{name}", doc, ("engine",))
            family.add_metric([s.engine], value)
            yield family
    if not legacy:
        return
    info = _gauge("gpuwarden_vllm_info", "The served model and profile (value is always 1)", ("model", "profile"))
    info.add_metric([s.model, s.profile], 1)
    yield info
    state = _gauge("gpuwarden_vllm_state", "1 for the vLLM child's current state", ("state",))
    for name in STATES:
        state.add_metric([name], int(name == s.state))
    yield state
    yield CounterMetricFamily("gpuwarden_vllm_restarts", "Times the vLLM child was restarted", value=s.restarts)
    for name, doc, value in (*extras, *values):
        if value is not None:
            yield GaugeMetricFamily(f"gpuwarden_vllm_{name}", doc, value=value)


def make_registry(snapshot: Callable[[], Snapshot | None]) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SnapshotCollector(snapshot))
    return registry


class Exposition:
    """The /metrics body, rendered once per published snapshot on its own thread, served as cached bytes.

    A scrape then costs a copy, not a render (about 30 ms for 64 GPUs on two cores), and the main
    loop never renders either. The snapshot's age is the one live line, appended per scrape, so a
    frozen daemon shows as a growing age instead of as fresh-looking numbers.
    """

    def __init__(self, snapshot: Callable[[], Snapshot | None], clock: Callable[[], float]):
        self.snapshot = snapshot
        self.clock = clock
        self.registry = make_registry(snapshot)
        self._rendered: tuple[Snapshot | None, bytes] = (None, generate_latest(self.registry))
        self._wake = threading.Event()
        self._closed = False
        self._last_error = ""
        self._thread = threading.Thread(target=self._render_loop, name="metrics-render", daemon=True)
        self._thread.start()

    def published(self) -> None:
        """Called by the loop after each snapshot; the render happens on the render thread."""
        self._wake.set()

    def _render_loop(self) -> None:
        while not self._closed:
            self._wake.wait()
            self._wake.clear()
            snap = self.snapshot()
            if snap is not self._rendered[0]:
                try:
                    self._rendered = (snap, generate_latest(self.registry))
                except Exception as exc:  # keep serving the last good body; say why once per new error
                    error = f"{type(exc).__name__}: {exc}"
                    if error != self._last_error:
                        self._last_error = error
                        log.error("metrics: rendering failed, serving the previous poll: %s", error)

    def body(self) -> bytes:
        snap, rendered = self._rendered
        if snap is None:
            return rendered
        age = max(0.0, self.clock() - snap.published_at)
        return rendered + (b"# HELP gpuwarden_snapshot_age_seconds Seconds since the daemon last published a "
                           b"poll; grows when the main loop is stuck\n# TYPE gpuwarden_snapshot_age_seconds gauge\n"
                           b"gpuwarden_snapshot_age_seconds %.3f\n" % age)

    def close(self) -> None:
        self._closed = True
        self._wake.set()
