"""The simulated backend behaves the way users reported real cards do."""

import re

import pytest

from conftest import ROOT
from gpuwarden.gpu import errors
from gpuwarden.gpu.base import ClockEventReason as R
from gpuwarden.gpu.sim.backend import ManualClock, SimBackend
from gpuwarden.gpu.sim.scenario import builtin_scenarios, load_scenario, resolve_scenario
from gpuwarden.base.yamlfile import ConfigError, ConfigErrors


def sim(name, clock=None):
    clock = clock or ManualClock()
    return SimBackend(load_scenario(resolve_scenario(name)), clock), clock


def test_builtin_scenarios_are_shipped():
    assert set(builtin_scenarios()) >= {"rtx-pro-4000-headless", "rtx-pro-6000-tp4", "dgx-spark",
                                        "lock-lost", "gpu-lost", "thermal"}


def test_rtx_pro_4000_stays_at_boot_clocks_under_load_until_locked():
    backend, clock = sim("rtx-pro-4000-headless")
    gpus = backend.gpus()
    assert len(gpus) == 2
    clock.advance(5)
    for gpu in gpus:
        s = gpu.sample()
        assert (s.sm_clock_mhz, s.memory_clock_mhz) == (180, 405)
        assert s.utilization_pct == 60 and s.compute_capability == "12.0"
        assert s.memory_total_bytes == 24467 * 1024 * 1024 and s.persistence_mode is False
    gpus[0].set_gpu_locked_clocks(3090, 3090)
    s = gpus[0].sample()
    assert (s.sm_clock_mhz, s.memory_clock_mhz) == (3090, 14001)
    assert gpus[1].sample().sm_clock_mhz == 180  # only the locked one moved


def test_rtx_pro_4000_power_caps_at_145w_near_1935mhz():
    backend, clock = sim("rtx-pro-4000-headless")
    gpu = backend.gpus()[0]
    gpu.set_gpu_locked_clocks(3090, 3090)
    clock.advance(19.9)
    assert R.SwPowerCap not in gpu.sample().clock_event_reasons
    clock.advance(0.2)  # t=20: sustained load on GPU 0
    s = gpu.sample()
    assert s.sm_clock_mhz == 1935
    assert s.power_w == pytest.approx(145, abs=0.5)
    assert R.SwPowerCap in s.clock_event_reasons
    assert s.temperature_c == 63  # "purely power, not thermal (63C)"
    clock.advance(20)  # back to 60 % at t=40
    assert gpu.sample().sm_clock_mhz == 3090


def test_power_limit_outside_constraints_is_rejected_like_nvml():
    backend, _ = sim("rtx-pro-4000-headless")
    gpu = backend.gpus()[0]
    with pytest.raises(errors.InvalidArgument, match="160 W.*allowed 70-145"):
        gpu.set_power_limit_w(160)
    assert errors.InvalidArgument.nvml_code == 2  # NVML_ERROR_INVALID_ARGUMENT
    gpu.set_power_limit_w(120)
    assert gpu.sample().power_limit_w == 120


def test_locked_clock_outside_supported_range_is_rejected():
    backend, _ = sim("rtx-pro-4000-headless")
    with pytest.raises(errors.InvalidArgument):
        backend.gpus()[0].set_gpu_locked_clocks(3000, 3500)
    with pytest.raises(errors.InvalidArgument):
        backend.gpus()[0].set_gpu_locked_clocks(2400, 2000)


def test_setters_need_root_unless_the_scenario_runs_as_root(write):
    text = resolve_scenario("lock-lost").read_text().replace("as_root: true", "as_root: false")
    backend = SimBackend(load_scenario(write("user.yaml", text)), ManualClock())
    gpu = backend.gpus()[0]
    for call in (lambda: gpu.set_persistence_mode(True), lambda: gpu.set_gpu_locked_clocks(3090, 3090),
                 lambda: gpu.set_power_limit_w(120), gpu.reset_gpu_locked_clocks):
        with pytest.raises(errors.NoPermission, match="root or CAP_SYS_ADMIN"):
            call()
    assert gpu.sample().up  # reading needs no privilege


def test_driver_reload_drops_locks_persistence_and_power_limit():
    backend, clock = sim("lock-lost")
    gpu = backend.gpus()[0]
    gpu.set_persistence_mode(True)
    gpu.set_gpu_locked_clocks(3090, 3090)
    gpu.set_power_limit_w(140)
    clock.advance(9)
    s = gpu.sample()
    assert (s.sm_clock_mhz, s.persistence_mode, s.power_limit_w) == (3090, True, 140)
    clock.advance(1)  # driver reload at t=10
    s = gpu.sample()
    assert (s.sm_clock_mhz, s.persistence_mode, s.power_limit_w) == (180, False, 145)
    assert not (s.clock_event_reasons & (R.SwPowerCap | R.SwThermalSlowdown | R.HwSlowdown))


def test_gpu_lost_and_back():
    backend, clock = sim("gpu-lost")
    lost = backend.gpus()[1]
    lost.set_gpu_locked_clocks(3090, 3090)
    clock.advance(10)
    s = lost.sample()
    assert not s.up and "lost" in s.error and s.uuid == lost.uuid
    assert backend.gpus()[0].sample().up
    with pytest.raises(errors.GpuLost):
        lost.set_gpu_locked_clocks(3090, 3090)
    clock.advance(10)
    s = lost.sample()
    assert s.up and s.sm_clock_mhz == 180  # back, without its lock


def test_thermal_scenario_raises_each_reason_in_turn():
    backend, clock = sim("thermal")
    gpu = backend.gpus()[0]
    gpu.set_gpu_locked_clocks(3090, 3090)
    seen = {}
    for t in (5, 15, 27, 36, 42, 50):
        clock.now = t
        s = gpu.sample()
        seen[t] = (s.sm_clock_mhz, s.temperature_c, s.clock_event_reasons)
    assert seen[5][0] == 3090 and seen[5][2] == R.NONE
    assert R.SwThermalSlowdown in seen[15][2] and seen[15][1] == 88 and seen[15][0] < 3090
    assert R.HwThermalSlowdown in seen[27][2] and seen[27][1] == 95 and seen[27][0] <= 1545
    assert R.HwPowerBrakeSlowdown in seen[36][2] and seen[36][0] == 180
    assert R.HwSlowdown in seen[42][2]
    assert seen[50][0] == 3090 and seen[50][2] == R.NONE


def test_dgx_spark_reports_unsupported_fields_as_none():
    backend, _ = sim("dgx-spark")
    gpu = backend.gpus()[0]
    s = gpu.sample()
    assert s.compute_capability == "12.1" and s.name == "NVIDIA GB10"
    # NVML has no memory for GB10: the system's (unified) memory stands in, as the NVML backend reports it.
    assert s.memory_unified and s.memory_total_bytes == 124416 * 2**20 and s.memory_used_bytes is not None
    assert s.power_limit_w is None and s.power_w is not None
    assert s.memory_bandwidth_bytes_per_s == pytest.approx(273e9, rel=0.01)
    with pytest.raises(errors.NotSupported):
        gpu.set_power_limit_w(100)


def test_energy_and_violation_counters_integrate_over_sim_time():
    backend, clock = sim("rtx-pro-4000-headless")
    gpu = backend.gpus()[0]
    gpu.set_gpu_locked_clocks(3090, 3090)
    clock.advance(20)
    before = gpu.sample()
    clock.advance(10)  # 10 s power-capped at 145 W
    after = gpu.sample()
    assert after.energy_joules - before.energy_joules == pytest.approx(1450, rel=0.01)
    assert after.violation_seconds["power"] - before.violation_seconds["power"] == pytest.approx(10)


def test_clock_collapse_and_power_cap_events(write):
    text = resolve_scenario("lock-lost").read_text().split("timeline:")[0] + (
        "timeline:\n"
        "  - {at_s: 0, event: load, utilization_pct: 50}\n"
        "  - {at_s: 5, event: clock_collapse, until_s: 8}\n"
        "  - {at_s: 10, event: power_cap, watts: 80, until_s: 12}\n")
    backend = SimBackend(load_scenario(write("events.yaml", text)), clock := ManualClock())
    gpu = backend.gpus()[0]
    gpu.set_gpu_locked_clocks(2400, 2400)
    readings = {}
    for t in (1, 6, 9, 11, 13):
        clock.now = t
        readings[t] = gpu.sample()
    assert readings[1].sm_clock_mhz == 2400
    assert readings[6].sm_clock_mhz == 180 and readings[6].clock_event_reasons & R.SwPowerCap == 0
    assert readings[9].sm_clock_mhz == 2400
    assert readings[11].power_w <= 80 and R.SwPowerCap in readings[11].clock_event_reasons
    assert readings[13].sm_clock_mhz == 2400


def test_pci_order_and_stable_uuids():
    a, _ = sim("rtx-pro-6000-tp4")
    b, _ = sim("rtx-pro-6000-tp4")
    assert [g.uuid for g in a.gpus()] == [g.uuid for g in b.gpus()]
    assert len({g.uuid for g in a.gpus()}) == 4
    buses = [g.pci_bus_id for g in a.gpus()]
    assert buses == sorted(buses)


BAD_SCENARIOS = [
    ("gpus:\n  - name: G\n", 1, "(top level)", "missing required key 'name'"),
    ("name: x\ngpus: []\n", 2, "gpus", "at least one GPU"),
    ("name: x\ngpus:\n  - name: G\n    compute_capability: \"12.0\"\n    memory_clocks_mhz: [405]\n"
     "    graphics_clocks_mhz: [3090, 180, 15]\n", 6, "gpus.0.graphics_clocks_mhz", "MIN <= MAX"),
    ("name: x\ngpus:\n  - name: G\n    compute_capability: \"12.0\"\n    memory_clocks_mhz: [405]\n"
     "    graphics_clocks_mhz: [180, 3090, 15]\n    wings: 2\n", 7, "gpus.0.wings", "unknown key"),
    ("name: x\ngpus:\n  - name: G\n    compute_capability: \"12.0\"\n    memory_clocks_mhz: [405]\n"
     "    graphics_clocks_mhz: [180, 3090, 15]\ntimeline:\n  - {at_s: 1, event: meteor}\n", 8,
     "timeline.0.event", "not a valid choice"),
    ("name: x\ngpus:\n  - name: G\n    compute_capability: \"12.0\"\n    memory_clocks_mhz: [405]\n"
     "    graphics_clocks_mhz: [180, 3090, 15]\ntimeline:\n  - {at_s: 1, event: load}\n", 8,
     "timeline.0", "needs 'utilization_pct'"),
    ("name: x\ngpus:\n  - name: G\n    compute_capability: \"12.0\"\n    memory_clocks_mhz: [405]\n"
     "    graphics_clocks_mhz: [180, 3090, 15]\ntimeline:\n  - {at_s: 1, event: gpu_lost, gpus: [3]}\n", 8,
     "timeline.0.gpus", "no GPU 3"),
    ("name: x\ngpus:\n  - name: G\n    compute_capability: \"12.0\"\n    memory_clocks_mhz: [405]\n"
     "    graphics_clocks_mhz: [180, 3090, 15]\ntimeline:\n  - {at_s: 5, event: gpu_lost, until_s: 2}\n", 8,
     "timeline.0.until_s", "not after at_s"),
    ("name: x\ngpus:\n  - name: G\n    compute_capability: \"12.0\"\n    memory_clocks_mhz: [405]\n"
     "    graphics_clocks_mhz: [180, 3090, 15]\ntimeline:\n  - {at_s: 5, event: driver_reload, until_s: 9}\n", 8,
     "timeline.0.until_s", "instantaneous"),
    ("name: x\ngpus:\n  - name: G\n    compute_capability: \"9.0\"\n    memory_clocks_mhz: [2619]\n"
     "    graphics_clocks_mhz: [345, 1980, 15]\n    nvlink: {links: 4}\ntimeline:\n"
     "  - {at_s: 5, event: nvlink_fault, link: 4}\n", 9, "timeline.0.link", "no NVLink link 4"),
    ("name: x\ntopology: nvswitch\ngpus:\n  - name: G\n    compute_capability: \"9.0\"\n"
     "    memory_clocks_mhz: [2619]\n    graphics_clocks_mhz: [345, 1980, 15]\n", 2, "topology",
     "needs nvlink: {links: N}"),
    ("name: x\nnvidia_persistenced: maybe\ngpus:\n  - name: G\n    compute_capability: \"9.0\"\n"
     "    memory_clocks_mhz: [2619]\n    graphics_clocks_mhz: [345, 1980, 15]\n", 2, "nvidia_persistenced",
     "not a valid choice"),
]


@pytest.mark.parametrize("text,line,key,fragment", BAD_SCENARIOS)
def test_bad_scenarios_name_file_line_and_key(write, text, line, key, fragment):
    path = write("scenario.yaml", text)
    with pytest.raises((ConfigError, ConfigErrors)) as info:
        load_scenario(path)
    problems = info.value.errors if isinstance(info.value, ConfigErrors) else [info.value]
    assert any(str(p).startswith(f"{path}:{line}: {key}: ") and fragment in str(p) for p in problems), \
        [str(p) for p in problems]


def test_the_nvlink_scenarios_play_each_fault():
    backend, clock = sim("nvlink-down")
    assert [n.state for n in backend.gpus()[1].sample().health.nvlinks] == ["up"] * 18
    clock.advance(16)
    links = backend.gpus()[1].sample().health.nvlinks
    assert links[5].state == "down" and links[5].peer == "NVSwitch" and sum(n.state == "up" for n in links) == 17
    assert backend.gpus()[2].sample().health.nvlinks[7].speed_mbps == 13281
    clock.advance(15)
    assert backend.gpus()[1].sample().health.nvlink_problems() == []
    backend, clock = sim("nvlink-errors")
    clock.advance(20)
    errors = backend.gpus()[2].sample().health.nvlinks[3]
    assert (errors.replay, errors.recovery, errors.crc) == (20, 0, 0)
    assert backend.gpus()[0].sample().health.nvlink_errors() == {"replay": 0, "recovery": 0, "crc": 400}
    backend, clock = sim("fabric-not-ready")
    assert backend.gpus()[3].sample().health.fabric_ready is False
    clock.advance(100)
    assert backend.gpus()[3].sample().health.fabric == "completed"
    direct, _ = sim("nvlink-iommu")
    s = direct.gpus()[0].sample()
    assert s.peer_paths == {1: "nvlink", 2: "nvlink", 3: "nvlink"} and s.iommu == "translating"
    assert [n.peer for n in s.health.nvlinks[:4]] == ["GPU1", "GPU2", "GPU3", "GPU1"] and s.health.fabric is None
    pcie, _ = sim("rtx-pro-6000-tp4")
    assert pcie.gpus()[0].sample().peer_paths == {1: "host_bridge", 2: "host_bridge", 3: "host_bridge"}


def test_manual_clock_needs_no_sleep():
    backend, clock = sim("lock-lost")
    clock.advance(3600)  # an hour of sim time, instantly
    s = backend.gpus()[0].sample()
    assert s.timestamp == 3600 and s.energy_joules > 0


def test_a_card_whose_full_load_power_is_its_idle_power_is_refused(write):
    from gpuwarden.gpu.sim.scenario import load_scenario
    from gpuwarden.base.yamlfile import ConfigErrors

    path = write("s.yaml", "name: s\ngpus:\n  - name: G\n    compute_capability: \"12.0\"\n"
                 "    memory_clocks_mhz: [405]\n    graphics_clocks_mhz: [180, 3090, 15]\n"
                 "    power: {idle_w: 100, full_load_w: 100}\n")
    with pytest.raises(ConfigErrors) as info:
        load_scenario(path)
    assert [str(e) for e in info.value.errors] == [
        f"{path}:7: gpus.0.power.full_load_w: full_load_w 100 W must be above idle_w 100 W"]


def test_format_md_documents_every_event_the_parser_accepts_with_its_parameters_and_ranges():
    """docs/scenario-format.md's event table against scenario.EVENT_PARAMS: a row per event, and in it each parameter with
    "required" where the parser requires it and its range as LOW-HIGH; until_s exactly on the conditions."""
    from gpuwarden.gpu.sim.scenario import CONDITIONS, EVENT_PARAMS

    doc = (ROOT / "docs" / "scenario-format.md").read_text()
    rows = {}
    for line in doc.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and re.fullmatch(r"`\w+`", cells[0]):
            rows[cells[0].strip("`")] = cells[1]
    assert sorted(rows) == sorted(EVENT_PARAMS), "docs/scenario-format.md's event table and EVENT_PARAMS differ"
    for event, params in EVENT_PARAMS.items():
        cell = rows[event]
        named = set(re.findall(r"`(\w+)`", cell))
        assert named == set(params) | ({"until_s"} if event in CONDITIONS else set()), event
        for name, (required, low, high) in params.items():
            said = re.search(rf"`{name}` \(([^)]*)\)", cell)
            assert said, f"{event}.{name}: no (range) after it"
            assert ("required" in said.group(1)) == required, f"{event}.{name}: required is {required}"
            assert f"{low:.0f}-{high:.0f}" in said.group(1), f"{event}.{name}: range {low:.0f}-{high:.0f}"
