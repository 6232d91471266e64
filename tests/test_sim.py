"""The simulated backend behaves the way users reported real cards do; its served-workload channel
(gpu/sim/power.py, GPUWARDEN_SIM_STATE) takes whatever another local user writes there."""

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest

from conftest import ROOT, free_port, gpuwarden_cmd, subprocess_env
from gpuwarden import config
from gpuwarden.backends import open_configured
from gpuwarden.gpu import errors
from gpuwarden.gpu.base import ClockEventReason as R
from gpuwarden.gpu.sim import power
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


# -- the served-workload channel, written by another local user --------------------------------------------------------
# load.json, gpus.json and clock.json in a folder another local user owns and writes, read by the simulator in a
# daemon that runs with the unit's capabilities (no CAP_DAC_OVERRIDE), by doctor (test_doctor.py) and by bench's
# local GPU view.

UNIT_CAPS = ["setpriv", "--bounding-set", "-all,+sys_admin,+setuid,+setgid,+kill", "--no-new-privs"]
AS_NOBODY = ["setpriv", "--reuid", "nobody", "--regid", "nogroup", "--clear-groups"]
BIG_TEXT = "9" * 400


def needs_root_and_setpriv():
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root (to act as another local user) and setpriv")


def as_nobody(script: str, *args: str) -> None:
    """Run a small Python script as the user nobody (the local attacker), its files its own."""
    subprocess.run([*AS_NOBODY, sys.executable, "-c", script, *args], check=True, timeout=30,
                   env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")})


PLANT = """
import os, sys
folder, name, kind, text = sys.argv[1:5]
path = os.path.join(folder, name)
tmp = path + ".planting"
if os.path.lexists(tmp):
    os.unlink(tmp)
if kind == "file":
    with open(tmp, "w") as f:
        f.write(text)
elif kind == "fifo":
    os.mkfifo(tmp)
elif kind == "link":
    os.symlink(text, tmp)
elif kind == "dir":
    os.mkdir(tmp)
    if os.path.lexists(path) and not os.path.isdir(path):
        os.unlink(path)
if os.path.isdir(path) and not os.path.islink(path):
    os.rmdir(path)
os.rename(tmp, path)
"""


def plant(folder: Path, name: str, kind: str, text: str = "") -> None:
    as_nobody(PLANT, str(folder), name, kind, text)


@pytest.fixture
def nobody_channel():
    """A channel folder the user nobody owns (0755), in a folder every user may pass through (pytest's tmp_path
    is root's own, 0700)."""
    needs_root_and_setpriv()
    outer = Path(tempfile.mkdtemp(prefix="gpuwarden-sim-channel-"))
    try:
        outer.chmod(0o755)
        chan = outer / "chan"
        chan.mkdir()
        shutil.chown(chan, "nobody")
        yield chan
    finally:
        shutil.rmtree(outer, ignore_errors=True)


def sim_config(scenario: str = "h100-nvswitch", listen: str = "none"):
    return config.parse_text(f"gpu:\n  backend: sim\n  scenario: {scenario}\nmetrics:\n  listen: {listen}\n")


HOSTILE_LOADS = [
    '{"open": 0, "at": %s}' % BIG_TEXT,  # OverflowError: int too large to convert to float, in every sample
    '{"open": 0, "at": -%s}' % BIG_TEXT,
    '{"open": 0, "at": NaN}', '{"open": 0, "at": Infinity}', '{"open": 0, "at": true}',
    '{"open": 1, "prefill_share": %s}' % BIG_TEXT, '{"open": 1, "prefill_share": NaN}',
    '{"open": 1, "prefill_share": -5}', '{"open": 1, "prefill_share": true}', '{"open": 1, "prefill_share": "x"}',
    '{"open": 1, "prefill_share": [[0.5]]}', '{"open": %s}' % BIG_TEXT, '{"open": "1"}', '[' * 30000,
    '{"open": 1, "at": 1e308, "prefill_share": 1e308}',
]


def test_the_load_file_is_read_without_arithmetic_on_what_it_says(tmp_path):
    """Every hostile load.json reads as a load or as nothing: never an exception out of read_load (a sample's)."""
    for text in HOSTILE_LOADS:
        (tmp_path / "load.json").write_text(text)
        load = power.read_load(tmp_path)  # before: OverflowError for the 400-digit "at"
        assert load is None or (isinstance(load.busy, bool) and load.prefill_share in (None,)), (text, load)
    # a share the workload may say is still read
    (tmp_path / "load.json").write_text('{"open": 2, "prefill_share": 0.25}')
    assert power.read_load(tmp_path) == power.Load(True, 0.25)
    (tmp_path / "load.json").write_text(json.dumps({"open": 0, "at": time.monotonic()}))
    assert power.read_load(tmp_path) == power.Load(True, None)  # gone idle a moment ago: the busy hold


HOSTILE_GPUS = ['{"gpus": 5}', '{"gpus": "ab"}', '{"gpus": {"0": {}}}', '{"gpus": [5, null, []]}',
                '{"gpus": [{"index": 0, "gpu_lock": [1000, %s]}]}' % BIG_TEXT,
                '{"gpus": [{"index": 0, "gpu_lock": [1000, 1e308]}]}',
                '{"gpus": [{"index": 0, "gpu_lock": [-5, -5]}]}', '{"gpus": [{"index": 0, "gpu_lock": [1500, 1000]}]}',
                '{"gpus": [{"index": 0, "gpu_lock": [true, true]}]}', '{"gpus": [{"index": 0, "gpu_lock": [0, 0]}]}',
                '{"gpus": [{"index": 0, "power_limit_w": true}]}', '{"gpus": [{"index": 0, "power_limit_w": NaN}]}',
                '{"gpus": [{"index": [0], "power_limit_w": 500}]}']


def test_a_hostile_settings_file_is_ignored_and_the_simulated_cards_start_as_the_driver_left_them(tmp_path,
                                                                                                    monkeypatch):
    monkeypatch.setenv(power.ENV, str(tmp_path))
    for text in HOSTILE_GPUS:
        (tmp_path / "gpus.json").write_text(text)
        backend = open_configured(sim_config(), ManualClock())  # before: TypeError, OverflowError at the start
        gpu = backend.gpus()[0]
        sample = gpu.sample()
        assert gpu.gpu_lock is None, (text, gpu.gpu_lock)  # never -5 MHz, a lock past its top, or True MHz
        assert sample.up and sample.sm_clock_mhz > 0 and sample.power_limit_w == gpu.model.default_power_limit_w
    # a lock the card takes still comes back, as after a daemon killed mid-sweep
    (tmp_path / "gpus.json").write_text('{"gpus": [{"index": 0, "gpu_lock": [1000, 1500], "power_limit_w": 500}]}')
    gpu = open_configured(sim_config(), ManualClock()).gpus()[0]
    assert gpu.gpu_lock == (1000, 1500) and gpu.power_limit_w == 500


HOSTILE_CLOCKS = ['{"to_s": 5, "at": %s}' % BIG_TEXT, '{"to_s": %s, "at": 1}' % BIG_TEXT, '{"to_s": Infinity, "at": 1}',
                  '{"to_s": 5, "at": NaN}', '{"to_s": true, "at": true}', '{"to_s": 1e300, "at": -1e300}']


def test_a_hostile_clock_file_never_stops_nor_breaks_the_simulated_timeline(tmp_path):
    """clock.json (a test moves the timeline on, power.move_clock) is in the same folder: a 400-digit "at" raised
    OverflowError out of every sample, Infinity put the timeline at infinity for good."""
    now = power.movable(lambda: 10.0, tmp_path)
    for text in HOSTILE_CLOCKS:
        (tmp_path / "clock.json").write_text(text)
        assert now() == 10.0, text
    power.move_clock(tmp_path, 100.0)
    assert 100.0 <= now() < 101.0  # a real move still moves it


@pytest.mark.parametrize("kind", ["fifo", "link", "dir"])
def test_a_channel_file_that_is_no_file_reads_as_nothing_at_once(tmp_path, kind):
    """load.json and clock.json are read by every sample, on the daemon's loop: a FIFO with no writer, a link to
    /dev/zero (endless) or a folder in their place reads as nothing and never waits (base/smallfile.py). If a read
    waited, this test would hang where the process test below only sees polls stop."""
    for name in ("load.json", "clock.json"):
        path = tmp_path / name
        if kind == "fifo":
            os.mkfifo(path)
        elif kind == "link":
            os.symlink("/dev/zero", path)
        else:
            path.mkdir()
    assert power.read_load(tmp_path) is None
    assert power.movable(lambda: 10.0, tmp_path)() == 10.0


@pytest.mark.process
def test_a_channel_another_user_owns_and_rewrites_leaves_the_daemon_polling_under_the_units_capabilities(
        tmp_path, daemons, nobody_channel):
    """The channel's folder is nobody's, so the daemon (root without CAP_DAC_OVERRIDE) cannot write gpus.json there
    and reads whatever nobody puts: a lock no float holds at its start, then every hostile load.json, a FIFO, a
    link to /dev/zero and a folder in its place. Before: the daemon did not start (OverflowError); started on a good
    file, every poll failed from the first hostile load on ("poll failed", "not feeding the watchdog")."""
    chan = nobody_channel
    plant(chan, "gpus.json", "file", '{"gpus": [{"index": 0, "gpu_lock": [1000, %s]}]}' % BIG_TEXT)
    plant(chan, "load.json", "file", HOSTILE_LOADS[0])
    port = free_port()
    conf = tmp_path / "g.yaml"
    conf.write_text(f"gpu: {{backend: sim, scenario: h100-nvswitch}}\npoll_interval_s: 0.25\n"
                    f"metrics: {{listen: '127.0.0.1:{port}'}}\n")
    env = {**subprocess_env(), power.ENV: str(chan), "STATE_DIRECTORY": str(tmp_path / "state"),
           "RUNTIME_DIRECTORY": str(tmp_path / "run")}
    d = daemons(conf, env=env, command=[*UNIT_CAPS, *gpuwarden_cmd()])
    d.wait_for("serving /metrics", timeout=60)
    base = f"http://127.0.0.1:{port}"

    def sequence():
        """Polls published: 0 before the first (its /status has no snapshot yet: "serving /metrics" comes first)."""
        with urllib.request.urlopen(f"{base}/status", timeout=5) as reply:
            return json.loads(reply.read()).get("sequence", 0)

    def polled_after_planting():
        """Two more polls published: at least one began after the plant, and read it (no timing: a count)."""
        planted = sequence()
        deadline = time.monotonic() + 60  # a bound on a hang: a read that waited for ever stops the polls
        while sequence() < planted + 2:
            assert time.monotonic() < deadline and d.proc.poll() is None, "polls stopped after a plant"
            time.sleep(0.05)

    plants = [("load.json", "file", text) for text in HOSTILE_LOADS[1:]] + \
        [("load.json", "fifo", ""), ("load.json", "link", "/dev/zero"), ("load.json", "dir", ""),
         ("load.json", "file", HOSTILE_LOADS[0])] + [("clock.json", "file", text) for text in HOSTILE_CLOCKS]
    for name, kind, text in plants:
        plant(chan, name, kind, text)
        polled_after_planting()
    with urllib.request.urlopen(f"{base}/status", timeout=5) as reply:
        state = json.loads(reply.read())
    gpu = state["gpus"][0]
    assert gpu["sm_lock_mhz"] is None and 0 < gpu["sm_clock_mhz"] <= gpu["max_sm_clock_mhz"], gpu
    assert d.stop() == 0
    log = "\n".join(d.lines)
    # No poll failed on what it read. How long a poll may take is not timed here: that no read of the channel
    # waits is proven in the unit tier (test_a_channel_file_that_is_no_file_reads_as_nothing_at_once).
    for bad in ("Traceback", "poll failed"):
        assert bad not in log, log[-3000:]
    assert not any(p.name.startswith(".gpus.json.") for p in chan.iterdir())  # no temp file of ours left there
