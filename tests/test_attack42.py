"""Attacks on issue 42's surfaces: the reboot record (health.json), `gpuwarden health`, the reset command, a GPU
that flaps lost/back every poll, the control socket's clear, and NVML's recovery-action field. Each test crosses
one limit in docs/threats.md; the daemon and the commands run as real processes (under the unit's capabilities
where root and setpriv are here) wherever the fault is between processes."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import free_port, gpuwarden_cmd, subprocess_env
from gpuwarden.gpu.base import GpuHealth, GpuSample
from gpuwarden.service.recovery import ResetFailed, run_reset
from gpuwarden.serving.run.supervisor import HELD, RUNNING, STARTING
from gpuwarden.watch import health
from gpuwarden.watch.health import waiting
from gpuwarden.watch.health_record import HealthRecord, answer_clear
from test_recovery import rig

UNIT_CAPS = ["setpriv", "--bounding-set", "-all,+sys_admin,+setuid,+setgid,+kill", "--no-new-privs"]


def as_the_unit() -> list[str]:
    return UNIT_CAPS if os.geteuid() == 0 and shutil.which("setpriv") else []


def record_with_time(when: str) -> str:
    """A record of the daemon's shape whose one history entry has the time `when` (JSON text, as planted)."""
    return ('{"version": 1, "gpus": {}, "history": [{"time": ' + when + ', "uuid": "GPU-a", '
            '"event": "reboot required", "fault": "xid79", "count": 1}]}')


FORGED_TIMES = ["1" + "0" * 400, "1e300", "-0.5", "NaN"]


# -- the reboot record: times no clock gives ---------------------------------------------------------------------

@pytest.mark.parametrize("when", FORGED_TIMES)
def test_a_record_time_of_400_digits_or_past_any_clock_is_one_line_and_an_empty_record(tmp_path, caplog, when):
    """A 400-digit time raised OverflowError out of load() (math.isfinite converts it to a float): a traceback
    at the daemon's start. 1e300 passed the check and time.localtime() raised in `gpuwarden health`."""
    path = tmp_path / "health.json"
    path.write_text(record_with_time(when))
    os.chmod(path, 0o600)
    caplog.set_level(logging.INFO, logger="gpuwarden")
    record = HealthRecord.load(path)
    assert record.entries == [] and "a time is not a finite number of seconds" in record.problem
    assert len(caplog.records) == 1 and "\n" not in caplog.records[0].getMessage()


@pytest.mark.process
def test_gpuwarden_health_on_a_record_of_forged_times_prints_one_line_not_a_traceback(tmp_path):
    conf = tmp_path / "conf.yaml"
    conf.write_text("gpu: {backend: sim, scenario: rtx-pro-4000-headless}\nmetrics: {listen: none}\n")
    state = tmp_path / "state"
    state.mkdir()
    env = {**subprocess_env(), "STATE_DIRECTORY": str(state), "RUNTIME_DIRECTORY": str(tmp_path / "run")}
    for when in FORGED_TIMES:
        (state / "health.json").write_text(record_with_time(when))
        os.chmod(state / "health.json", 0o600)
        out = subprocess.run([*gpuwarden_cmd(), "health", "-c", str(conf)], capture_output=True, text=True,
                             env=env, timeout=60, check=False)
        assert "Traceback" not in out.stderr, (when, out.stderr)
        assert out.returncode == 3, (when, out.returncode, out.stderr)  # no daemon: the record is still shown
        assert "not read: a time is not a finite number of seconds" in out.stdout, (when, out.stdout)


@pytest.mark.process
def test_a_daemon_under_the_units_capabilities_starts_past_a_record_of_400_digit_times(tmp_path, daemons):
    conf = tmp_path / "conf.yaml"
    conf.write_text("gpu: {backend: sim, scenario: rtx-pro-4000-headless}\npoll_interval_s: 0.25\n"
                    f"metrics: {{listen: '127.0.0.1:{free_port()}'}}\n")
    state = tmp_path / "state"
    state.mkdir()
    (state / "health.json").write_text(record_with_time("1" + "0" * 400))
    os.chmod(state / "health.json", 0o600)
    env = {**subprocess_env(), "STATE_DIRECTORY": str(state), "RUNTIME_DIRECTORY": str(tmp_path / "run")}
    d = daemons(conf, env=env, command=[*as_the_unit(), *gpuwarden_cmd()])
    line = d.wait_for("ignored, starting empty", timeout=60)
    assert "a time is not a finite number of seconds" in line
    d.wait_for("serving /metrics", timeout=60)
    assert d.stop() == 0
    assert "Traceback" not in d.log


# -- a GPU that flaps lost/back every poll ----------------------------------------------------------------------

def flap(sup, clock, monitor, recovery, polls, lost_every=2):
    """Poll as the daemon does (hold for what waits, poll, recovery), the GPU lost on every lost_every-th poll."""
    gpu = monitor.backend.gpus()[0]
    for i in range(polls):
        recovery.hold(clock.now, list(waiting(monitor.events.needs_reset, monitor.verdicts).items()))
        if lost_every and i % lost_every == 0:
            gpu.reset(0.5)  # off the bus for this poll, back at the next
        monitor.tick(clock.now)
        recovery.tick(clock.now, waiting(monitor.events.needs_reset, monitor.verdicts))
        sup.tick(clock.now)
        clock.advance(1)
        gpu.backend.clock.advance(1)


def test_a_gpu_that_flaps_every_poll_does_not_restart_loop_the_engine_nor_flood_the_journal(caplog):
    """Before: 40 polls of a GPU lost and back every other poll started the engine 20 times (each release reset
    its restart budget) and wrote ~10 journal lines a flap: 200 lines."""
    caplog.set_level(logging.INFO, logger="gpuwarden")
    sup, ops, clock, monitor, recovery = rig()
    flap(sup, clock, monitor, recovery, 40)
    assert len(ops.children) <= 3, len(ops.children)  # the first start, one release, then it waits
    assert sup.state == HELD
    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.INFO]
    flapping = [m for m in lines if "health" in m and ("unhealthy" in m or "healthy again" in m)]
    back = [m for m in lines if "is back: planned and applied its tuning" in m]
    assert len(flapping) <= 8, flapping
    assert len(back) <= 2, back
    assert any("held again" in m and "its GPU flaps" in m for m in lines)
    # Once the GPU stays back long enough, the engine starts again by itself, once.
    flap(sup, clock, monitor, recovery, 15, lost_every=0)
    assert sup.state in (STARTING, RUNNING) and len(ops.children) <= 4


def test_a_single_loss_releases_the_engine_as_soon_as_the_gpu_is_back():
    sup, ops, clock, monitor, recovery = rig()
    flap(sup, clock, monitor, recovery, 1, lost_every=1)  # lost once
    flap(sup, clock, monitor, recovery, 1, lost_every=0)  # back: released at once (no flapping yet)
    assert sup.state in (STARTING, RUNNING) and len(ops.children) == 2


# -- the reset command ------------------------------------------------------------------------------------------

def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.process
def test_a_reset_command_that_leaves_a_helper_in_its_session_leaves_nothing_running(tmp_path):
    """Before: a command that exited 0 left its background helper (same session) running for good."""
    pidfile = tmp_path / "helper"
    script = ("import subprocess, sys; p = subprocess.Popen(['sleep', '300']); "
              f"open({str(pidfile)!r}, 'w').write(str(p.pid)); print('GPU reset ok')")
    assert run_reset([sys.executable, "-c", script], timeout_s=20) == "GPU reset ok"
    helper = int(pidfile.read_text())
    for _ in range(50):
        if not _alive(helper):
            break
        time.sleep(0.1)
    alive = _alive(helper)
    if alive:
        os.kill(helper, 9)
    assert not alive, "the reset command's helper outlived it"


@pytest.mark.process
def test_a_reset_command_that_prints_without_end_stops_at_the_write_limit_not_at_a_full_disk(tmp_path):
    """Before: 60 s of output went to a temp file without limit (GBs); now RLIMIT_FSIZE stops it at 64 MiB."""
    script = "import sys\nwhile True: sys.stdout.write('x' * 65536)"
    began = time.monotonic()
    with pytest.raises(ResetFailed, match="exit status"):
        run_reset([sys.executable, "-c", script], timeout_s=60)
    assert time.monotonic() - began < 30


# -- the control socket's clear ----------------------------------------------------------------------------------

def test_a_clear_whose_who_carries_terminal_escapes_reaches_the_journal_and_record_escaped(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="gpuwarden")
    record = HealthRecord(tmp_path / "health.json", boot_id=lambda: "b1")
    record.reboot_required("GPU-a", "xid79", 1.0)
    who = "\x1b]52;c;cm0gLXJmIH4=\x07\x1b[2J\r<0>root\nx"
    answer = answer_clear(record, {"op": "health_clear", "gpu": "0", "who": who}, "pid 1, uid 0", {0: "GPU-a"}, 2.0)
    assert answer["ok"]
    text = caplog.text + json.dumps(answer) + (tmp_path / "health.json").read_text()
    assert "\x1b" not in text and "\x07" not in text and "\r" not in text
    assert "\n" not in caplog.records[-1].getMessage()
    assert HealthRecord.load(tmp_path / "health.json", boot_id=lambda: "b1").problem is None


# -- NVML's recovery-action field out of range -----------------------------------------------------------------

@pytest.mark.parametrize("code", [8, 255, 2**32 - 1, 2**64, -1])
def test_a_recovery_action_code_past_the_table_is_unhealthy_inspect_not_an_exception(code):
    s = GpuSample(0, "GPU-0", "NVIDIA H100", "00000000:01:00.0", "9.0", health=GpuHealth(recovery_action=code))
    v = health.judge(s, health.Inputs(), 3)
    assert (v.state, v.action) == (health.UNHEALTHY, health.INSPECT)
    assert str(code) in v.reasons[0]
