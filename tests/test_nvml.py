"""The NVML backend over a fake pynvml module, with NVML errors injected per call."""

import pytest

from harness.fake_nvml import (FUNCTION_NOT_FOUND, GPU_IS_LOST, INVALID_ARGUMENT, LIBRARY_NOT_FOUND, NO_PERMISSION,
                       NOT_SUPPORTED, UNKNOWN, FakeNvml, device, nvlink)
from gpuwarden import config
from gpuwarden.gpu import errors
from gpuwarden.gpu.base import ClockEventReason as R
from gpuwarden.gpu.nvml import MAX_NVLINKS, REINIT_INTERVAL_S, NvmlBackend, persistenced_pids, persistenced_state
from gpuwarden.gpu.sim.backend import ManualClock
from gpuwarden.tune.tuning import Tuner, make_plan


def backend_with(*devices, counters_interval_s=10.0):
    fake = FakeNvml(list(devices))
    clock = ManualClock(100.0)
    return NvmlBackend(fake, clock=clock, counters_interval_s=counters_interval_s), fake, clock


def two_gpus():
    # NVML index order differs from PCI order on purpose.
    return backend_with(device("GPU-bbb", "00000000:9A:00.0"), device("GPU-aaa", "00000000:18:00.0"))


def test_gpus_are_ordered_by_pci_bus_id():
    backend, _, _ = two_gpus()
    assert [(g.index, g.uuid, g.pci_bus_id) for g in backend.gpus()] == [
        (0, "GPU-aaa", "00000000:18:00.0"), (1, "GPU-bbb", "00000000:9A:00.0")]


def test_sample_converts_every_field_to_base_units():
    backend, _, _ = backend_with(device("GPU-aaa", "00000000:18:00.0"))
    s = backend.gpus()[0].sample()
    assert s.up and s.name == "NVIDIA H100 80GB HBM3" and s.compute_capability == "9.0"
    assert (s.sm_clock_mhz, s.memory_clock_mhz, s.graphics_clock_mhz) == (1980, 2619, 1980)
    assert (s.max_sm_clock_mhz, s.max_memory_clock_mhz) == (1980, 2619)
    assert s.power_w == pytest.approx(312.5) and s.power_limit_w == pytest.approx(700)
    assert (s.power_limit_min_w, s.power_limit_max_w, s.power_limit_default_w) == pytest.approx((200, 700, 700))
    assert (s.temperature_c, s.utilization_pct, s.memory_utilization_pct) == (41, 97, 60)
    assert (s.memory_used_bytes, s.memory_total_bytes) == (40 * 2**30, 80 * 2**30)
    assert s.persistence_mode is False and s.performance_state == 0
    assert s.clock_event_reasons == R.SwPowerCap and s.clock_event_reasons.names() == ["SwPowerCap"]
    assert s.violation_seconds["power"] == pytest.approx(5.0) and s.violation_seconds["thermal"] == 0
    assert s.energy_joules == pytest.approx(123_456.789)
    assert s.memory_bus_width_bits == 5120
    assert s.memory_bandwidth_bytes_per_s == pytest.approx(2 * 2619e6 * 5120 / 8)


def test_not_supported_field_is_none_and_not_asked_again(monkeypatch):
    # The power constraints are unsupported both as fields of the batched call and as their own call.
    backend, fake, _ = backend_with(device("GPU-aaa", "00000000:18:00.0", unsupported_fields=(187, 188)))
    fake.fail[("nvmlDeviceGetMemoryInfo", None)] = NOT_SUPPORTED  # both versions, as on a GB10
    fake.fail[("nvmlDeviceGetMemoryInfo_v2", None)] = NOT_SUPPORTED
    fake.fail[("nvmlDeviceGetPowerManagementLimitConstraints", None)] = NOT_SUPPORTED
    monkeypatch.setattr("gpuwarden.gpu.nvml.system_memory", lambda: None)  # nor a /proc/meminfo to fall back on
    gpu = backend.gpus()[0]
    first, second = gpu.sample(), gpu.sample()
    assert first.memory_total_bytes is None and first.power_limit_min_w is None
    assert first.sm_clock_mhz == 1980 and first.power_w == pytest.approx(312.5)  # the rest still reads
    assert second.memory_used_bytes is None
    assert fake.calls["nvmlDeviceGetMemoryInfo"] == 1 and fake.calls["nvmlDeviceGetMemoryInfo_v2"] == 1


def test_a_gpu_without_memory_of_its_own_reports_the_systems(monkeypatch, tmp_path):
    """DGX Spark: NVML answers NOT_SUPPORTED for GB10's memory, which is the system's (unified)."""
    from gpuwarden.gpu.sysmem import system_memory

    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       127401000 kB\nMemFree:         1000000 kB\nMemAvailable:   100000000 kB\n")
    assert system_memory(meminfo) == ((127401000 - 100000000) * 1024, 127401000 * 1024)
    assert system_memory(tmp_path / "missing") is None
    monkeypatch.setattr("gpuwarden.gpu.nvml.system_memory", lambda: system_memory(meminfo))
    backend, fake, _ = backend_with(device("GPU-aaa", "00000000:18:00.0"))
    fake.fail[("nvmlDeviceGetMemoryInfo", None)] = NOT_SUPPORTED
    fake.fail[("nvmlDeviceGetMemoryInfo_v2", None)] = NOT_SUPPORTED
    s = backend.gpus()[0].sample()
    assert s.memory_unified and s.memory_total_bytes == 127401000 * 1024
    assert s.memory_used_bytes == (127401000 - 100000000) * 1024 and s.memory_reserved_bytes is None
    discrete = backend_with(device("GPU-bbb", "00000000:19:00.0"))[0].gpus()[0].sample()
    assert not discrete.memory_unified and discrete.memory_total_bytes != 127401000 * 1024


def test_transient_error_is_none_this_time_and_retried():
    backend, fake, _ = backend_with(device("GPU-aaa", "00000000:18:00.0"))
    gpu = backend.gpus()[0]
    fake.fail[("nvmlDeviceGetTemperatureV", None)] = UNKNOWN
    assert gpu.sample().temperature_c is None
    del fake.fail[("nvmlDeviceGetTemperatureV", None)]
    assert gpu.sample().temperature_c == 41


def test_older_driver_falls_back_to_throttle_reasons():
    backend, fake, _ = backend_with(device("GPU-aaa", "00000000:18:00.0", reasons=0x21))
    fake.fail[("nvmlDeviceGetCurrentClocksEventReasons", None)] = FUNCTION_NOT_FOUND
    gpu = backend.gpus()[0]
    assert gpu.sample().clock_event_reasons == R.GpuIdle | R.SwThermalSlowdown
    assert gpu.sample().clock_event_reasons == R.GpuIdle | R.SwThermalSlowdown
    assert fake.calls["nvmlDeviceGetCurrentClocksEventReasons"] == 1  # not asked again
    assert fake.calls["nvmlDeviceGetCurrentClocksThrottleReasons"] == 2


def test_gpu_lost_marks_it_down_then_reinit_brings_it_back():
    backend, fake, clock = two_gpus()
    gone = fake.devices[0]  # NVML index 0 is PCI-order GPU 1 (GPU-bbb)
    gone["lost"] = True
    samples = [g.sample() for g in backend.gpus()]
    assert samples[0].up and not samples[1].up
    assert "GPU-bbb" in samples[1].error and "lost" in samples[1].error
    inits = fake.inits
    clock.advance(1)
    assert not backend.gpus()[1].sample().up  # still lost: one re-init attempt
    clock.advance(1)
    backend.gpus()[1].sample()
    assert fake.inits == inits + 1, "re-init is rate-limited"
    gone["lost"] = False
    clock.advance(REINIT_INTERVAL_S)
    back = backend.gpus()[1].sample()
    assert back.up and back.uuid == "GPU-bbb" and back.sm_clock_mhz == 1980
    assert backend.gpus()[0].sample().up


@pytest.mark.parametrize("batched", [True, False])
def test_slow_counters_are_read_every_counters_interval_only(batched):
    backend, fake, clock = backend_with(device("GPU-aaa", "00000000:18:00.0"), counters_interval_s=5)
    backend.batched = batched
    gpu = backend.gpus()[0]
    for _ in range(10):
        gpu.sample()
        clock.advance(1)
    if batched:  # one nvmlDeviceGetFieldValues per counters read
        assert fake.calls["nvmlDeviceGetFieldValues"] == 2 and fake.calls["field 83"] == 2
        assert fake.calls["field 74"] == 2 and fake.calls["nvmlDeviceGetViolationStatus"] == 0
    else:
        assert fake.calls["nvmlDeviceGetTotalEnergyConsumption"] == 2
        assert fake.calls["nvmlDeviceGetViolationStatus"] == 2 * 6
    assert fake.calls["nvmlDeviceGetPowerUsage"] == 10
    assert fake.calls["nvmlDeviceGetPowerManagementLimitConstraints"] == (0 if batched else 2)  # not every poll
    assert fake.calls["nvmlDeviceGetClockInfo"] == 10 * 3
    assert fake.calls["nvmlDeviceGetMaxClockInfo"] == 3  # static, ~1.4 ms each on an H200: read once
    fake.devices[0]["energy_mj"] += 5000
    clock.advance(5)
    assert gpu.sample().energy_joules == pytest.approx(123_461.789)


def test_unsupported_violation_policy_is_none():
    # Unsupported as fields of the batched call (PERF_POLICY_*) and as their own call.
    backend, fake, _ = backend_with(device("GPU-aaa", "00000000:18:00.0", unsupported_fields=range(74, 80)))
    fake.fail[("nvmlDeviceGetViolationStatus", None)] = NOT_SUPPORTED
    assert set(backend.gpus()[0].sample().violation_seconds.values()) == {None}


@pytest.mark.parametrize("code,cls,text", [
    (NO_PERMISSION, errors.NoPermission, "needs root or CAP_SYS_ADMIN (NVML_ERROR_NO_PERMISSION)"),
    (NOT_SUPPORTED, errors.NotSupported, "is not supported on this GPU"),
    (INVALID_ARGUMENT, errors.InvalidArgument, "was rejected as out of range"),
    (GPU_IS_LOST, errors.GpuLost, "the GPU is lost"),
])
def test_setter_errors_become_clear_gpu_errors(code, cls, text):
    backend, fake, _ = backend_with(device("GPU-aaa", "00000000:18:00.0"))
    fake.fail[("nvmlDeviceSetGpuLockedClocks", None)] = code
    with pytest.raises(cls) as info:
        backend.gpus()[0].set_gpu_locked_clocks(1980, 1980)
    assert str(info.value).startswith("GPU 0 (GPU-aaa): locking GPU clocks to 1980-1980 MHz")
    assert text in str(info.value)


def test_power_limit_is_set_in_milliwatts():
    backend, fake, _ = backend_with(device("GPU-aaa", "00000000:18:00.0"))
    backend.gpus()[0].set_power_limit_w(450.5)
    assert fake.devices[0]["limit_mw"] == 450_500


def test_nvml_missing_is_unavailable():
    fake = FakeNvml([])
    fake.fail[("nvmlInit", None)] = LIBRARY_NOT_FOUND
    with pytest.raises(errors.Unavailable, match="NVML Shared Library Not Found"):
        NvmlBackend(fake)


def test_capabilities():
    backend, _, _ = backend_with(device("GPU-aaa", "00000000:18:00.0"))
    caps = backend.gpus()[0].capabilities()
    assert caps.memory_clocks_mhz == (2619, 1593) and caps.graphics_clocks_mhz[0] == 1980
    assert (caps.power_limit_min_w, caps.power_limit_max_w) == (200, 700)


def test_tuning_end_to_end_through_the_nvml_backend():
    backend, fake, _ = two_gpus()
    cfg = config.parse_text("tuning:\n  power_limit_w: 650\n  gpus:\n    GPU-bbb: {gpu_clocks: [1965, 1965]}\n")
    plan = make_plan(backend, cfg)
    tuner = Tuner(backend)
    assert all(o.ok for o in tuner.apply(plan) + tuner.verify(plan))
    by_uuid = {d["uuid"].decode(): d for d in fake.devices}
    # gpu_clocks: auto leaves the SXM H100 (brand NVIDIA, module 1) alone; the override locks.
    assert by_uuid["GPU-aaa"]["gpu_lock"] is None and by_uuid["GPU-bbb"]["gpu_lock"] == (1965, 1965)
    assert by_uuid["GPU-aaa"]["limit_mw"] == 650_000 and by_uuid["GPU-aaa"]["persistence"] == 1
    tuner.restore()
    assert by_uuid["GPU-bbb"]["gpu_lock"] is None and by_uuid["GPU-aaa"]["limit_mw"] == 700_000
    assert by_uuid["GPU-aaa"]["persistence"] == 0


def test_persistenced_is_found_by_its_truncated_comm(tmp_path):
    for pid, comm in ((12, "bash"), (345, "nvidia-persiste"), (7, "python3")):
        (tmp_path / str(pid)).mkdir()
        (tmp_path / str(pid) / "comm").write_text(comm + "\n")
    assert persistenced_pids(str(tmp_path)) == [345]


def test_persistenced_is_running_installed_or_absent(tmp_path):
    binary = tmp_path / "nvidia-persistenced"
    assert persistenced_state(str(tmp_path), (str(binary),)) == "absent"
    binary.touch()
    assert persistenced_state(str(tmp_path), (str(binary),)) == "stopped"
    (tmp_path / "77").mkdir()
    (tmp_path / "77" / "comm").write_text("nvidia-persiste\n")
    assert persistenced_state(str(tmp_path), (str(binary),)) == "running"


def test_gpu_lost_at_start_comes_up_down_not_crashing():
    lost = device("GPU-bbb", "00000000:9A:00.0")
    backend, fake, _ = backend_with(device("GPU-aaa", "00000000:18:00.0"), lost)
    lost["lost"] = True
    fresh = NvmlBackend(fake, clock=ManualClock())
    samples = [g.sample() for g in fresh.gpus()]
    assert [s.up for s in samples] == [True, False]


def test_memory_reserved_by_the_driver_is_apart_from_used():
    # An idle H200: nvidia-smi shows 0 MiB used and 616 MiB reserved; v1 of the call counts both as used.
    nvml = FakeNvml([device("GPU-a", "00000000:01:00.0", mem=(0, 141 * 2**30), reserved=616 * 2**20)])
    s = NvmlBackend(nvml).gpus()[0].sample()
    assert (s.memory_used_bytes, s.memory_reserved_bytes) == (0, 616 * 2**20)
    old = FakeNvml([device("GPU-a", "00000000:01:00.0", mem=(0, 141 * 2**30), reserved=616 * 2**20)])
    old.fail[("nvmlDeviceGetMemoryInfo_v2", None)] = FUNCTION_NOT_FOUND  # a driver without the v2 call
    s = NvmlBackend(old).gpus()[0].sample()
    assert (s.memory_used_bytes, s.memory_reserved_bytes) == (616 * 2**20, None)


def test_link_and_memory_health_are_read_every_counters_interval():
    clock = ManualClock(0)
    nvml = FakeNvml([device("GPU-a", "00000000:01:00.0", pcie=(2, 5, 16, 16), replays=1415, ecc_uncorrected=2,
                            remapped=(3, 1, 1, 0))])
    gpu = NvmlBackend(nvml, clock=clock, counters_interval_s=10).gpus()[0]
    h = gpu.sample().health
    assert h.link() == "Gen2 x16 of Gen5 x16" and h.link_degraded and h.pcie_replays == 1415
    assert (h.ecc_uncorrected, h.remapped_rows_correctable, h.remapped_rows_uncorrectable) == (2, 3, 1)
    assert h.remap_pending is True and h.remap_failure is False and h.retired_pages is None
    calls = nvml.calls["field 142"]  # REMAPPED_COR, in the batched read with the counters
    clock.advance(1)
    gpu.sample()
    assert nvml.calls["field 142"] == calls  # not every poll
    clock.advance(10)
    gpu.sample()
    assert nvml.calls["field 142"] == calls + 1


def test_older_gpus_report_retired_pages_and_unsupported_health_is_none():
    older = FakeNvml([device("GPU-a", "00000000:01:00.0", remapped=None, retired=([1, 2], [3]), retire_pending=1)])
    h = NvmlBackend(older).gpus()[0].sample().health
    assert h.retired_pages == 3 and h.retire_pending is True and h.remap_pending is None
    bare = FakeNvml([device("GPU-a", "00000000:01:00.0", pcie=None, replays=None, ecc_uncorrected=None,
                            remapped=None)])
    h = NvmlBackend(bare).gpus()[0].sample().health
    assert h.link() is None and not h.link_degraded and h.ecc_uncorrected is None and h.retired_pages is None


def test_batched_and_single_reads_agree_and_an_unsupported_field_falls_back():
    one, _, _ = backend_with(device("GPU-aaa", "00000000:18:00.0", remapped=(3, 1, 1, 0)))
    other, fake, _ = backend_with(device("GPU-aaa", "00000000:18:00.0", remapped=(3, 1, 1, 0)))
    other.batched = False
    a, b = one.gpus()[0].sample(), other.gpus()[0].sample()
    assert (a.power_w, a.power_limit_w, a.power_limit_min_w, a.power_limit_max_w, a.power_limit_default_w,
            a.energy_joules, a.violation_seconds, a.health) == \
           (b.power_w, b.power_limit_w, b.power_limit_min_w, b.power_limit_max_w, b.power_limit_default_w,
            b.energy_joules, b.violation_seconds, b.health)
    partial, fake, _ = backend_with(device("GPU-aaa", "00000000:18:00.0", unsupported_fields=(83, 94)))
    s = partial.gpus()[0].sample()
    assert s.energy_joules == pytest.approx(123_456.789) and s.health.pcie_replays == 0
    assert fake.calls["nvmlDeviceGetTotalEnergyConsumption"] == 1 and fake.calls["nvmlDeviceGetPcieReplayCounter"] == 1
    assert fake.calls["nvmlDeviceGetViolationStatus"] == 0  # the fields it did have came from the batch



def nvswitch_host(nvlink_fields=True, fabric=(3, 0)):
    """Two H100s on NVSwitch: 4 links each to a switch, link 3 of GPU 0 down (its far end still known)."""
    def links(bad=None, **errors):
        return [nvlink("00000000:c0:00.0", remote_type=2, state=0 if i == bad else 1, **errors) for i in range(4)]
    fake = FakeNvml([device("GPU-aaa", "00000000:18:00.0", nvlinks=links(bad=3, replay=2, crc=7),
                            nvlink_fields=nvlink_fields, fabric=fabric),
                     device("GPU-bbb", "00000000:9A:00.0", nvlinks=links(), nvlink_fields=nvlink_fields,
                            fabric=fabric)])
    return NvmlBackend(fake, clock=ManualClock(0)), fake


@pytest.mark.parametrize("batched", [True, False])
def test_nvlink_links_their_state_far_end_and_errors_batched_or_per_link(batched):
    """One nvmlDeviceGetFieldValues with (field, link) pairs where the driver answers them (161-165), else
    nvmlDeviceGetNvLinkState and nvmlDeviceGetNvLinkErrorCounter per link: the same links either way."""
    backend, fake = nvswitch_host(nvlink_fields=batched)
    h = backend.gpus()[0].sample().health
    assert [(n.link, n.state, n.peer) for n in h.nvlinks] == [(0, "up", "NVSwitch"), (1, "up", "NVSwitch"),
                                                              (2, "up", "NVSwitch"), (3, "down", "NVSwitch")]
    assert (h.nvlinks[0].replay, h.nvlinks[0].recovery, h.nvlinks[0].crc) == (2, 0, 7)
    assert h.nvlink_errors() == {"replay": 8, "recovery": 0, "crc": 28}
    assert h.nvlink_problems() == ["link 3 down (to NVSwitch)"]
    assert h.nvlinks[0].speed_mbps == (26562 if batched else None)  # only the batch has the speed
    assert fake.calls["nvmlDeviceGetNvLinkErrorCounter"] == (0 if batched else 4 * 3)
    assert fake.calls["field (161, 0)"] == 1
    backend.gpus()[0].sample(counters=True)
    assert fake.calls["field (161, 0)"] == (2 if batched else 1)  # a field the batch refused is not asked again


def test_the_fabric_is_read_through_the_versioned_call_and_the_board_once():
    backend, _ = nvswitch_host()
    s = backend.gpus()[0].sample()
    assert (s.health.fabric, s.health.fabric_error, s.health.fabric_ready) == ("completed", None, True)
    assert (s.board.brand, s.board.form_factor, s.board.default_graphics_clock_mhz) == ("NVIDIA", "sxm", 1755)
    backend, _ = nvswitch_host(fabric=(2, 0))
    assert backend.gpus()[0].sample().health.fabric_ready is False  # in progress
    backend, _ = nvswitch_host(fabric=(3, 27))
    assert backend.gpus()[0].sample().health.fabric_error == "Not Ready"
    backend, _ = nvswitch_host(fabric=None)  # no fabric: nothing said
    assert backend.gpus()[0].sample().health.fabric_ready is None


def test_peer_paths_come_from_nvlink_nvswitch_c2c_or_the_pcie_topology():
    backend, _ = nvswitch_host()
    assert [g.sample().peer_paths for g in backend.gpus()] == [{1: "nvswitch"}, {0: "nvswitch"}]
    # Direct links (GPU 0 <-> GPU 1), and a third GPU behind a PCIe switch from one, a host bridge from the
    # other; NVML's index order differs from PCI order (indices 0, 1, 2 are buses 9a, 18, 3b).
    a, b, c = "00000000:9A:00.0", "00000000:18:00.0", "00000000:3B:00.0"
    fake = FakeNvml([device("GPU-a", a, nvlinks=[nvlink(b), nvlink(b)]), device("GPU-b", b, nvlinks=[nvlink(a)]),
                     device("GPU-c", c)], ancestors={frozenset((0, 2)): 10, frozenset((1, 2)): 30})
    gpus = NvmlBackend(fake).gpus()  # PCI order: GPU-b (18), GPU-c (3b), GPU-a (9a)
    assert [g.uuid for g in gpus] == ["GPU-b", "GPU-c", "GPU-a"]
    assert gpus[0].sample().peer_paths == {1: "host_bridge", 2: "nvlink"}
    assert gpus[2].sample().peer_paths == {0: "nvlink", 1: "pcie_switch"}
    assert [n.peer for n in gpus[2].sample().health.nvlinks] == ["GPU0", "GPU0"]
    grace = FakeNvml([device("GPU-a", a, c2c=1), device("GPU-b", b, c2c=1)])
    assert NvmlBackend(grace).gpus()[0].sample().peer_paths == {1: "c2c"}
    unknown = FakeNvml([device("GPU-a", a), device("GPU-b", b)])
    unknown.fail[("nvmlDeviceGetTopologyCommonAncestor", None)] = NOT_SUPPORTED
    assert NvmlBackend(unknown).gpus()[0].sample().peer_paths == {}  # unknown, never guessed


def test_a_gpu_without_nvlink_reports_no_links_and_is_not_asked_again():
    backend, fake, _ = backend_with(device("GPU-aaa", "00000000:18:00.0"))
    gpu = backend.gpus()[0]
    assert gpu.sample().health.nvlinks == () and gpu.sample(counters=True).health.nvlinks == ()
    assert fake.calls["nvmlDeviceGetNvLinkState"] == MAX_NVLINKS  # each link once, at start
    assert not any(name.startswith("field (16") for name in fake.calls)
