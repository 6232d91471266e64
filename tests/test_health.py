"""The health model (watch/health.py): each input's state and action, the escalation after N reboots, the host
taking the worst; then each fault class's scenario played through the monitor."""

from __future__ import annotations

import pytest

from gpuwarden.gpu.base import GpuHealth, GpuSample, NvLink
from gpuwarden.watch import health
from gpuwarden.watch.health import DEGRADED, HEALTHY, UNHEALTHY, Inputs, judge


def sample(index=0, up=True, error=None, **h) -> GpuSample:
    return GpuSample(index, f"GPU-{index}", "NVIDIA H100", f"00000000:{index + 1:02X}:00.0", "9.0", up=up,
                     error=error, health=GpuHealth(**h))


def verdict(s=None, reboots=health.no_reboots, **inputs):
    return judge(s or sample(), Inputs(**inputs), 3, reboots)


def test_a_gpu_with_nothing_wrong_is_healthy_with_no_action():
    v = verdict(sample(remap_pending=False, remap_failure=False, ecc_uncorrected=0, recovery_action=0))
    assert (v.state, v.action, v.reasons, v.text()) == (HEALTHY, "none", (), "none")


@pytest.mark.parametrize("s, inputs, state, action, reason", [
    (sample(up=False, error="GPU is lost"), {}, UNHEALTHY, "reboot", "GPU lost from the bus (GPU is lost)"),
    (sample(recovery_action=1), {}, UNHEALTHY, "reset_gpu", "the driver's recovery action: reset the GPU"),
    (sample(recovery_action=2), {}, UNHEALTHY, "reboot", "the driver's recovery action: reboot the node"),
    (sample(recovery_action=3), {}, UNHEALTHY, "restart_engine", "peer-to-peer"),
    (sample(recovery_action=4), {}, UNHEALTHY, "reset_gpu", "then reset the GPU"),
    (sample(recovery_action=99), {}, UNHEALTHY, "inspect", "action: 99"),
    (sample(remap_pending=True), {}, DEGRADED, "reset_gpu", "a remapped row waits for a GPU reset"),
    (sample(remap_failure=True), {}, UNHEALTHY, "inspect", "could not be remapped"),
    (sample(ecc_uncorrected=2), {}, UNHEALTHY, "reset_gpu", "2 uncorrected ECC error(s)"),
    (sample(fabric="in_progress"), {}, DEGRADED, "restart_engine", "fabric registration in progress"),
    (sample(fabric="completed", fabric_error="Not Ready"), {}, UNHEALTHY, "inspect", "failed (Not Ready)"),
    (sample(pcie_generation=2, pcie_generation_max=5, pcie_width=16, pcie_width_max=16), {"busy": True},
     DEGRADED, "inspect", "PCIe link Gen2 x16 of Gen5 x16 while busy"),
    (sample(nvlinks=(NvLink(0, "up", "GPU1"), NvLink(1, "down", "GPU1"))), {}, DEGRADED, "reset_gpu",
     "NVLink link 1 down (to GPU1) (1 of 2 up)"),
    (sample(), {"needs_reset": "Xid 79 (GPU has fallen off the bus): reboot the node"}, UNHEALTHY, "reboot",
     "Xid 79"),
    (sample(), {"needs_reset": "Xid 48 (double-bit ECC error): reset the GPU"}, UNHEALTHY, "reset_gpu", "Xid 48"),
    (sample(), {"recent_xids": ((13, 2),)}, DEGRADED, "restart_engine", "Xid 13 (Graphics Engine Exception) x2"),
])
def test_each_input_gives_its_state_action_and_reason(s, inputs, state, action, reason):
    v = verdict(s, **inputs)
    assert (v.state, v.action) == (state, action)
    assert any(reason in r for r in v.reasons), v.reasons


def test_an_idle_link_trained_down_and_a_device_xid_are_not_findings():
    """Idle links train down to save power; Xid 92 (high single-bit rate) asks for nothing in the catalog."""
    v = verdict(sample(pcie_generation=1, pcie_generation_max=5, pcie_width=16, pcie_width_max=16),
                recent_xids=((92, 1),))
    assert v.state == HEALTHY


def test_the_recovery_event_is_said_once_where_the_field_says_it_too():
    v = verdict(sample(recovery_action=1), needs_reset="the driver set a recovery action: reset the GPU")
    assert len(v.reasons) == 1 and v.faults == ("recovery_action",)


def test_the_most_severe_finding_sets_state_and_action_and_comes_first():
    v = verdict(sample(remap_pending=True, remap_failure=True, ecc_uncorrected=1), recent_xids=((31, 1),))
    assert (v.state, v.action) == (UNHEALTHY, "inspect")
    assert v.reasons[0] == "a memory row could not be remapped"
    assert v.faults == ("remap_failure", "ecc_uncorrected", "remap_pending", "xid31")


def test_a_reboot_becomes_inspect_at_the_configured_count_for_that_fault_only():
    seen = []

    def reboots(uuid, fault):
        seen.append((uuid, fault))
        return {"gpu_lost": 3}.get(fault, 0)

    lost = verdict(sample(), reboots, needs_reset="Xid 79 (GPU has fallen off the bus): reboot the node")
    assert lost.action == "inspect" and "still after 3 reboots" in lost.reasons[0]
    other = verdict(sample(recovery_action=2), reboots)
    assert other.action == "reboot"
    assert seen == [("GPU-0", "gpu_lost"), ("GPU-0", "recovery_action")]  # Xid 79 is the GPU lost: one fault
    below = judge(sample(), Inputs(needs_reset="Xid 79 (x): reboot the node"), 4, reboots)
    assert below.action == "reboot"


def test_the_host_takes_the_worst_state_and_action():
    gpus = [verdict(sample(0)), verdict(sample(1, remap_pending=True)), verdict(sample(2, up=False))]
    h = health.host(gpus)
    assert (h.state, h.action) == (UNHEALTHY, "reboot")
    assert h.reasons == ("GPU1 degraded: reset the GPU", "GPU2 unhealthy: reboot")
    assert health.host([verdict(sample(0))]).state == HEALTHY
    assert health.host([]).state == HEALTHY


@pytest.mark.parametrize("answer, expected", [({"recovery_action": 2}, 2), ({"recovery_action": 0}, 0),
                                               ({}, None), ({"field_errors": {230: 2}}, None)])
def test_nvml_reads_the_recovery_action_in_the_batch_and_a_driver_without_it_is_asked_once(answer, expected):
    """NVML_FI_DEV_GET_GPU_RECOVERY_ACTION (230): an older driver answers NOT_SUPPORTED, or INVALID_ARGUMENT for
    an id it does not know; either way the field is None and left out of the next batches."""
    from harness.fake_nvml import FakeNvml, device
    from gpuwarden.gpu.nvml import NvmlBackend
    from gpuwarden.gpu.sim.backend import ManualClock

    fake = FakeNvml([device("GPU-aaa", "00000000:18:00.0", **answer)])
    gpu = NvmlBackend(fake, clock=ManualClock(100.0), counters_interval_s=10.0).gpus()[0]
    first, second = gpu.sample(counters=True), gpu.sample(counters=True)
    assert first.health.recovery_action == second.health.recovery_action == expected
    assert fake.calls["field 230"] == (2 if expected is not None else 1)
    assert fake.calls["field 83"] == 2  # the rest of the batch goes on


@pytest.mark.parametrize("code", [8, 255, 2**32 - 1, 2**64, -1])
def test_a_recovery_action_code_past_the_table_is_unhealthy_inspect_not_an_exception(code):
    s = GpuSample(0, "GPU-0", "NVIDIA H100", "00000000:01:00.0", "9.0", health=GpuHealth(recovery_action=code))
    v = health.judge(s, health.Inputs(), 3)
    assert (v.state, v.action) == (health.UNHEALTHY, health.INSPECT)
    assert str(code) in v.reasons[0]


# -- each fault class's scenario, played through the monitor ----------------------------------------------------

FAST = "poll_interval_s: 0.5\ncounters_interval_s: 1\nalerts:\n  for_s: 1\n  clear_for_s: 2\n"


def play(scenario, until, extra="", reboots=health.no_reboots, step=0.5):
    """The monitor on the scenario, the events delivered as the event thread would: {t: snapshot}."""
    from gpuwarden import config
    from gpuwarden.backends import open_configured
    from gpuwarden.gpu.sim.backend import ManualClock
    from gpuwarden.tune.tuning import Tuner, TuningLife
    from gpuwarden.watch.monitor import Monitor

    cfg = config.parse_text(f"gpu:\n  backend: sim\n  scenario: {scenario}\nmetrics:\n  listen: none\n{FAST}{extra}")
    clock = ManualClock()
    backend = open_configured(cfg, clock)
    tuning = TuningLife(backend, cfg, Tuner(backend))
    tuning.start(tuning.check(cfg))
    monitor = Monitor(cfg, backend, tuning, reboots=reboots)
    events, snaps = backend.events(), {}
    while clock.now <= until + 1e-9:
        monitor.record_events(events.wait(0), clock.now)
        snaps[clock.now] = monitor.tick(clock.now)
        clock.advance(step)
    return monitor, snaps


def states(snap):
    return [(v.health.state, v.health.action) for v in snap.gpus]


def health_lines(caplog):
    return [(r.levelname, r.getMessage()) for r in caplog.records if " health: " in r.getMessage()]


def metrics(snap):
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from gpuwarden.web.exposition import make_registry

    text = generate_latest(make_registry(lambda: snap)).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def firing(snap):
    return sorted((a.gpu, a.alert) for a in snap.firing() if a.alert in ("gpu_unhealthy", "gpu_degraded"))


def test_xid79_gpu_fallen_off_the_bus_is_unhealthy_reboot_and_the_host_takes_it(caplog):
    import logging

    with caplog.at_level(logging.INFO, logger="gpuwarden"):
        monitor, snaps = play("xid79", 15)
    assert states(snaps[9.5]) == [("healthy", "none")] * 2
    v = snaps[15.0].gpus[1].health
    assert states(snaps[15.0]) == [("healthy", "none"), ("unhealthy", "reboot")]
    assert v.reasons[0].startswith("GPU lost from the bus")
    assert v.reasons[1] == "Xid 79 (GPU has fallen off the bus): reboot the node"
    assert v.faults == v.reboot_faults == ("gpu_lost",)  # one fall off the bus, one fault (issue 51, finding 8)
    assert (snaps[15.0].host_health.state, snaps[15.0].host_health.action) == ("unhealthy", "reboot")
    assert health_lines(caplog) == [("CRITICAL", f"GPU1 {v.uuid} health: unhealthy; action: reboot; reasons: "
                                                 + "; ".join(v.reasons))]
    assert firing(snaps[15.0]) == [(1, "gpu_unhealthy")]
    assert monitor.unhealthy() == [(1, "reboot: " + "; ".join(v.reasons))]
    assert "GPU1 unhealthy: reboot · GPU1 gpu_lost" in snaps[15.0].summary_line(numbers=False)
    m = metrics(snaps[15.0])
    assert m[("gpuwarden_gpu_health", (("gpu", "1"), ("state", "unhealthy")))] == 1  # a lost GPU has its series
    assert m[("gpuwarden_gpu_health", (("gpu", "1"), ("state", "healthy")))] == 0
    assert m[("gpuwarden_gpu_action_required", (("action", "reboot"), ("gpu", "1")))] == 1
    assert m[("gpuwarden_gpu_action_required", (("action", "none"), ("gpu", "0")))] == 1
    assert m[("gpuwarden_host_health", (("state", "unhealthy"),))] == 1
    assert m[("gpuwarden_host_health", (("state", "healthy"),))] == 0
    status = snaps[15.0].as_dict()
    assert status["health"]["state"] == "unhealthy" and status["gpus"][1]["health"]["action"] == "reboot"


def test_xid79_after_the_configured_reboots_asks_for_the_hardware_to_be_inspected():
    counts = {"gpu_lost": 3}
    _, snaps = play("xid79", 11, reboots=lambda uuid, fault: counts.get(fault, 0))
    v = snaps[11.0].gpus[1].health
    assert (v.state, v.action) == ("unhealthy", "inspect")
    assert v.reasons[1] == "Xid 79 (GPU has fallen off the bus): reboot the node, still after 3 reboots"
    assert v.reasons[0].startswith("GPU lost from the bus") and v.reasons[0].endswith(", still after 3 reboots")
    _, snaps = play("xid79", 11, "health:\n  reboots_before_inspect: 4\n",
                    reboots=lambda uuid, fault: counts.get(fault, 0))
    assert snaps[11.0].gpus[1].health.action == "reboot"


def test_xid48_with_a_row_remap_pending_is_unhealthy_reset_and_a_remap_alone_is_degraded(caplog):
    import logging

    with caplog.at_level(logging.INFO, logger="gpuwarden"):
        _, snaps = play("xid48-row-remap", 25)
    assert states(snaps[15.0]) == [("unhealthy", "reset_gpu"), ("healthy", "none")]
    assert snaps[15.0].gpus[0].health.reasons == (
        "Xid 48 (double-bit ECC error): reset the GPU", "1 uncorrected ECC error(s)",
        "a remapped row waits for a GPU reset")
    assert states(snaps[25.0]) == [("unhealthy", "reset_gpu"), ("degraded", "reset_gpu")]
    assert [line[0] for line in health_lines(caplog)] == ["CRITICAL", "WARNING"]
    assert "GPU1 " in health_lines(caplog)[1][1] and "degraded; action: reset the GPU" in health_lines(caplog)[1][1]
    # degraded fires after alerts.for_s (1 s); unhealthy at once
    assert firing(snaps[20.5]) == [(0, "gpu_unhealthy")]
    assert firing(snaps[21.0]) == [(0, "gpu_unhealthy"), (1, "gpu_degraded")]
    alert = next(a for a in snaps[25.0].firing() if a.alert == "gpu_degraded")
    assert alert.observed == "degraded: a remapped row waits for a GPU reset" and alert.short == "reset the GPU"


def test_the_recovery_action_asks_for_a_reset_then_a_reboot(caplog):
    import logging

    with caplog.at_level(logging.INFO, logger="gpuwarden"):
        _, snaps = play("recovery-action", 35)
    assert snaps[15.0].gpus[0].sample.health.recovery_action == 1  # the polled field follows the event
    assert states(snaps[15.0])[0] == ("unhealthy", "reset_gpu")
    assert snaps[15.0].gpus[0].health.reasons == ("the driver's recovery action: reset the GPU",)  # said once
    assert states(snaps[35.0])[0] == ("unhealthy", "reboot")
    assert [(level, msg.split("; reasons")[0].split(" health: ")[1]) for level, msg in health_lines(caplog)] == [
        ("CRITICAL", "unhealthy; action: reset the GPU"), ("CRITICAL", "unhealthy; action: reboot")]
    assert metrics(snaps[35.0])[("gpuwarden_gpu_action_required", (("action", "reset_gpu"), ("gpu", "0")))] == 0


def test_an_nvlink_link_down_is_degraded_and_healthy_again_when_it_comes_back(caplog):
    import logging

    with caplog.at_level(logging.INFO, logger="gpuwarden"):
        _, snaps = play("nvlink-down", 35, "tuning:\n  apply: false\n")
    assert states(snaps[12.0])[1] == ("degraded", "reset_gpu")
    assert snaps[12.0].gpus[1].health.reasons == ("NVLink link 5 down (to NVSwitch) (17 of 18 up)",)
    assert states(snaps[35.0]) == [("healthy", "none"), ("healthy", "none"), ("degraded", "reset_gpu"),
                                   ("healthy", "none")]
    lines = [(level, msg.split(" ", 1)[0] + " " + msg.split(" health: ")[1].split("; reasons")[0])
             for level, msg in health_lines(caplog)]
    assert lines == [("WARNING", "GPU1 degraded; action: reset the GPU"),
                     ("WARNING", "GPU2 degraded; action: reset the GPU"),
                     ("NOTICE", "GPU1 healthy again (was degraded: reset the GPU)")]
    assert (snaps[20.0].host_health.state, snaps[20.0].host_health.action) == ("degraded", "reset_gpu")


def test_a_fabric_not_ready_is_degraded_until_it_completes():
    _, snaps = play("fabric-not-ready", 102, "tuning:\n  apply: false\n", step=2.0)
    assert states(snaps[50.0]) == [("degraded", "restart_engine")] * 4
    assert snaps[50.0].gpus[0].health.reasons == ("NVSwitch fabric registration in progress",)
    assert states(snaps[102.0]) == [("healthy", "none")] * 4
    assert "GPU0 degraded: restart the engine" in snaps[50.0].summary_line()


def test_the_shipped_prometheus_rules_carry_each_actions_runbook_and_inhibit_what_the_action_explains():
    import yaml
    from conftest import ROOT
    from gpuwarden.watch.signals.health import RUNBOOK

    rules = {r["alert"]: r for g in yaml.safe_load((ROOT / "etc/prometheus/gpuwarden-rules.yml").read_text())["groups"]
             for r in g["rules"] if "alert" in r}
    for action, runbook in RUNBOOK.items():
        alert = next(r for r in rules.values() if f'action="{action}"' in r["expr"])
        assert alert["annotations"]["runbook"] == runbook and runbook in " ".join(alert["annotations"]["description"].split())
    inhibit = yaml.safe_load((ROOT / "etc/alertmanager/gpuwarden-alertmanager.yml").read_text())["inhibit_rules"]
    muted = {target for rule in inhibit if "GpuActionReboot" in str(rule["source_matchers"])
             for target in str(rule["target_matchers"]).split('"')[1].split("|")}
    assert {"GpuXid", "GpuNeedsReset", "GpuLost", "Vllm.*"} <= muted


def test_status_shows_a_health_column_and_the_reasons_and_a_daemon_before_it_shows_a_dash():
    import time

    from gpuwarden.web.status import render_status

    _, snaps = play("xid79", 15)
    state = {**snaps[15.0].as_dict(), "daemon": {"version": "t", "pid": 1, "started_at": time.time()}}
    lines = render_status(state).splitlines()
    header = lines[1].split()
    assert header[:3] == ["GPU", "NAME", "HEALTH"]
    import re

    assert re.split(r"\s{2,}", lines[2])[2] == "healthy"
    assert "unhealthy: reboot" in lines[3] and "DOWN" in lines[3]
    assert lines[4] == "  GPU1 unhealthy: reboot, because: " + "; ".join(snaps[15.0].gpus[1].health.reasons)
    for gpu in state["gpus"]:
        del gpu["health"]
    assert re.split(r"\s{2,}", render_status(state).splitlines()[2])[2] == "-"


@pytest.mark.parametrize("scenario, at, severity, message", [
    ("h100-nvswitch", 0, "ok", "healthy, action none"),
    ("fabric-not-ready", 0, "warning", "degraded, action restart the engine: NVSwitch fabric registration in progress"),
    ("gpu-lost-at-start", 0, "error", "unhealthy, action reboot: GPU lost from the bus"),
])
def test_doctor_says_each_gpus_health_in_one_line(scenario, at, severity, message):
    from gpuwarden import config
    from gpuwarden.backends import open_configured
    from gpuwarden.gpu.sim.backend import ManualClock
    from gpuwarden.watch.doctor import diagnose

    cfg = config.parse_text(f"gpu:\n  backend: sim\n  scenario: {scenario}\n")
    findings = {f.check: f for f in diagnose(cfg, open_configured(cfg, ManualClock(at)), deep=False)}
    lines = [f for check, f in findings.items() if check.endswith(" health")]
    assert lines and all(f.check.startswith("GPU") for f in lines)
    worst = max(lines, key=lambda f: ["ok", "warning", "error"].index(f.severity))
    assert worst.severity == severity and worst.message.startswith(message), worst
    assert (worst.fix != "") == (severity != "ok")


def test_a_reboot_record_that_fails_counts_as_none_and_is_said_once(caplog):
    import logging

    def broken(uuid, fault):
        raise ValueError("state file is not JSON")

    with caplog.at_level(logging.ERROR, logger="gpuwarden"):
        _, snaps = play("xid79", 12, reboots=broken)
    assert snaps[12.0].gpus[1].health.action == "reboot"  # the polls went on
    said = [r.getMessage() for r in caplog.records if "reboot count" in r.getMessage()]
    assert len(said) == 1 and "ValueError: state file is not JSON" in said[0]


def test_three_boots_of_xid79_count_in_the_record_and_the_third_asks_for_inspection(tmp_path):
    """What the daemon does each poll (service/daemon.py): the monitor reads the record's counts, record_reboots
    counts each fault that asked for a reboot once per boot and saves; a new daemon (a new boot) loads the file."""
    from gpuwarden.watch.health_record import HealthRecord, record_reboots

    path, seen = tmp_path / "health.json", []
    for boot in ("boot-1", "boot-2", "boot-3", "boot-3"):  # the last: the daemon restarted within boot 3
        record = HealthRecord.load(path, boot_id=lambda boot=boot: boot)
        monitor, snaps = play("xid79", 15, reboots=record.count)
        record_reboots(record, monitor.verdicts.values(), 1000.0)
        monitor, snaps = play("xid79", 15, reboots=record.count)  # the next polls see this boot's count
        seen.append((record.count(snaps[15.0].gpus[1].health.uuid, "gpu_lost"), snaps[15.0].gpus[1].health.action))
    assert seen == [(1, "reboot"), (2, "reboot"), (3, "inspect"), (3, "inspect")]
    assert HealthRecord.load(path).counts(snaps[15.0].gpus[1].health.uuid) == {"gpu_lost": 3}  # saved, one fault


def test_an_engine_waits_for_every_unhealthy_gpu_each_text_ending_with_its_action():
    from gpuwarden.watch.health import waiting

    monitor, snaps = play("xid79", 15)
    wait = waiting({}, monitor.verdicts)
    assert list(wait) == [1] and wait[1].endswith(": reboot") and wait[1].startswith("GPU lost from the bus")
    # the events' book wins where it names the GPU (its text ends with the Xid table's action)
    assert waiting({1: "Xid 48 (double-bit ECC error): reset the GPU"}, monitor.verdicts)[1].endswith("reset the GPU")
    assert waiting({}, {0: snaps[15.0].gpus[0].health}) == {}  # a healthy GPU holds nothing


# -- one fault, one record (issue 51, finding 8) --------------------------------------------------------------

def test_one_xid79_is_one_reboot_fault_in_the_record(tmp_path):
    """Xid 79 and NVML's GPU_IS_LOST are one fall off the bus: one count a boot, not two (they were gpu_lost and
    xid79, each counted, so one fault reached reboots_before_inspect as fast as two)."""
    from gpuwarden.watch.health_record import HealthRecord, record_reboots

    record = HealthRecord.load(tmp_path / "health.json", boot_id=lambda: "boot-1")
    monitor, snaps = play("xid79", 15, reboots=record.count)
    v = snaps[15.0].gpus[1].health
    assert len(v.reasons) == 2 and v.reboot_faults == ("gpu_lost",)  # both inputs said, one fault
    record_reboots(record, monitor.verdicts.values(), 1000.0)
    assert record.counts(v.uuid) == {"gpu_lost": 1}
    assert [e["fault"] for e in record.history(v.uuid)] == ["gpu_lost"]


@pytest.mark.parametrize("why, field, fault", [
    ("Xid 79 (GPU has fallen off the bus): reboot the node", {"up": False, "error": "GPU is lost"}, "gpu_lost"),
    ("GPU unavailable: reboot the node", {"up": False, "error": "GPU is lost"}, "gpu_lost"),
    ("Xid 48 (double-bit ECC error): reset the GPU", {"ecc_uncorrected": 1}, "ecc_uncorrected"),
    ("double-bit ECC error: reset the GPU", {"ecc_uncorrected": 1}, "ecc_uncorrected"),
    ("Xid 64 (ECC page retirement or row remap failed): inspect the hardware", {"remap_failure": True},
     "remap_failure"),
    ("DRAM retirement failed: inspect the hardware", {"remap_failure": True}, "remap_failure"),
])
def test_an_event_and_the_reading_of_the_same_fault_are_one_fault(why, field, fault):
    up = {k: field.pop(k) for k in ("up", "error") if k in field}
    v = verdict(sample(**up, **field), needs_reset=why)
    assert v.faults == (fault,), v.faults


# -- the docs' Xid table and the code: one source (issue 51, finding 4) ------------------------------------------

DOCS = "docs/health.md"
ACTION_WORDS = {"none": "none", "restart the engine": "restart_engine", "reset": "reset_gpu",
                "reset the GPU": "reset_gpu", "reboot": "reboot", "inspect": "inspect", "inspect the hardware": "inspect"}


def docs_table(heading: str) -> list[list[str]]:
    """The rows of the first table under `## heading` in docs/health.md, as lists of cells (the header left out)."""
    from conftest import ROOT

    text = (ROOT / DOCS).read_text().split(f"\n## {heading}\n", 1)[1]
    rows = [line for line in text.split("\n## ")[0].splitlines() if line.startswith("| ")]
    return [[cell.strip() for cell in row.strip("|").split(" | ")] for row in rows[2:]]


def docs_xids() -> list[tuple[int, str, str, str]]:
    """The page's Xid table: (Xid, state, action, what happens to the engine on it)."""
    return [(int(number), state, ACTION_WORDS[action], engine)
            for number, _, state, action, engine in docs_table("Xids")]


def test_the_xid_table_in_the_docs_is_what_the_code_generates():
    import sys

    from conftest import ROOT
    sys.path.insert(0, str(ROOT / "docs" / "gen"))
    import xids_ref

    assert (ROOT / DOCS).read_text() == xids_ref.render(ROOT), "run: python3 docs/gen/xids_ref.py"
    from gpuwarden.watch import xids
    assert [n for n, *_ in docs_xids()] == sorted(xids.TABLE)


def test_every_xid_the_inputs_table_names_has_the_state_and_action_the_code_gives_it():
    """Before: the page said Xid 63 degraded ("it serves") and Xid 64 inspect; the code held the engine for a reset
    on both."""
    import re

    checked = {}
    for what, said, source in docs_table("Inputs"):
        row = f"{what} {source}"
        numbers = [int(n) for n in re.findall(r"\bXid (\d+)", row)]
        listed = re.search(r"\bXid \((\d+(?:, \d+)*)", row)
        numbers += [int(n) for n in listed.group(1).split(", ")] if listed else []
        if not numbers:
            continue
        state, action = said.split(" (")[0].split(", ", 1)
        for number in numbers:
            checked[number] = (state, ACTION_WORDS[action])
            assert health.xid_verdict(number) == checked[number], (number, what)
    assert set(checked) == {13, 31, 43, 48, 63, 64, 79}


@pytest.mark.parametrize("number, state, action, engine", docs_xids())
def test_each_xid_of_the_docs_table_gives_its_gpu_that_state_and_action_and_holds_only_where_it_says(
        number, state, action, engine):
    """The event as the event thread hands it to the monitor, one poll: the verdict and the wait (watch/health.waiting,
    what the daemon holds the engine for) are what the page's row says. The engine itself: test_recovery.py."""
    from gpuwarden.gpu.events import GpuEvent

    monitor, _ = play("dgx-spark", 0)
    holds = monitor.record_events([GpuEvent(0, "xid", number)], 1.0)
    snap = monitor.tick(1.0)
    v = snap.gpus[0].health
    assert (v.state, v.action) == (state, action), v.reasons
    held = 0 in health.waiting(monitor.events.needs_reset, monitor.verdicts)
    assert held == bool(holds) == engine.startswith("stopped")
