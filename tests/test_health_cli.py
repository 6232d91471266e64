"""`gpuwarden health` and `gpuwarden health clear GPU` as real processes against a daemon on the simulator: the
states from /status, the counts and history from the record, a repair recorded through the control socket with
who ran it, the record surviving the daemon's restarts; and the ways a clear is refused, each one line."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from conftest import free_port, gpuwarden_cmd, subprocess_env
from gpuwarden.watch.health_record import HealthRecord
from test_health_record import FORGED_TIMES, record_with_time


class Host:
    """A config on the simulated RTX PRO 4000 pair, its state and runtime folders, and the commands run on it."""

    def __init__(self, tmp: Path, daemons, tuning: str = ""):
        self.tmp, self.daemons = tmp, daemons
        tmp.mkdir(parents=True, exist_ok=True)
        self.conf = tmp / "conf.yaml"
        self.conf.write_text(f"gpu: {{backend: sim, scenario: rtx-pro-4000-headless}}\npoll_interval_s: 0.25\n"
                             f"metrics: {{listen: '127.0.0.1:{free_port()}'}}\n{tuning}")
        self.state, self.run_dir = tmp / "state", tmp / "run"
        self.env = {**subprocess_env(), "STATE_DIRECTORY": str(self.state), "RUNTIME_DIRECTORY": str(self.run_dir),
                    "SUDO_USER": "alice"}
        self.daemon = None

    def start(self):
        self.daemon = self.daemons(self.conf, env=self.env)
        self.daemon.wait_for("serving /metrics")
        return self.daemon

    def stop(self):
        assert self.daemon.stop() == 0

    def health(self, *args):
        out = subprocess.run([*gpuwarden_cmd(), "health", "-c", str(self.conf), *args], capture_output=True,
                             text=True, env=self.env, timeout=60)
        assert "Traceback" not in out.stderr, out.stderr
        return out.returncode, out.stdout, out.stderr

    def record(self) -> HealthRecord:
        return HealthRecord.load(self.state / "health.json")


@pytest.fixture
def host(tmp_path, daemons):
    return Host(tmp_path, daemons)


def uuids(h: Host) -> list[str]:
    status, out, _ = h.health("--json")
    assert status == 0, out
    return [g["uuid"] for g in json.loads(out)["gpus"]]


def write_record(h: Host, uuid: str, boots: int):
    """What the daemons of earlier boots left: xid79 asked for a reboot in `boots` of them."""
    h.state.mkdir(parents=True, exist_ok=True)
    record = HealthRecord.load(h.state / "health.json", boot_id=lambda: "now")
    for n in range(boots):
        record.boot_id = lambda n=n: f"boot-{n}"
        record.reboot_required(uuid, "xid79", 1_700_000_000.0 + n)
    record.save()


@pytest.mark.process
def test_health_shows_states_and_counts_and_clear_records_who_across_restarts(host):
    host.start()
    first, second = uuids(host)
    status, out, err = host.health()
    assert status == 0 and err == ""
    assert f"0    {first}" in out and f"1    {second}" in out and "No reboots recorded in" in out
    host.stop()

    write_record(host, first, 3)  # three boots in which Xid 79 asked for a reboot
    host.start()  # a daemon restarted: the count is what the file kept
    status, out, _ = host.health()
    assert status == 0 and f"  {first}  xid79: 3" in out
    assert out.count("reboot required: xid79") == 3 and "(reboot 3)" in out

    status, out, err = host.health("clear", "0")
    assert status == 0 and err == "", err
    assert out.startswith(f"GPU 0 ({first}): repair recorded by alice (pid ") and ", uid 0)" in out
    assert out.rstrip().endswith("reboot counts reset (were: xid79 x3)")
    line = host.daemon.wait_for("cleared by alice")
    assert f"health: GPU 0 ({first}) cleared by alice (pid " in line and "(xid79 x3) reset" in line
    record = host.record()
    assert record.count(first, "xid79") == 0
    assert record.history(first)[-1]["event"] == "cleared" and record.history(first)[-1]["who"].startswith("alice")

    host.stop()
    host.start()  # and again: the repair stays recorded
    status, out, _ = host.health()
    assert status == 0 and "No reboots recorded in" in out and f"{first}  cleared by alice (pid " in out
    assert "(was: xid79 x3)" in out


@pytest.mark.process
def test_a_gpu_named_by_uuid_or_by_its_index_now_is_cleared_and_a_bad_name_is_one_line(host):
    host.start()
    _, second = uuids(host)
    host.stop()
    write_record(host, second, 1)
    write_record(host, "GPU-fallen-off-the-bus", 2)  # a GPU the daemon no longer lists
    host.start()
    status, out, err = host.health("clear", "GPU-fallen-off-the-bus")
    assert status == 0 and out.startswith("GPU ? (GPU-fallen-off-the-bus): repair recorded by alice"), out + err
    status, out, err = host.health("clear", second)
    assert status == 0 and out.startswith(f"GPU 1 ({second}): repair recorded"), out + err
    assert host.record().count(second, "xid79") == 0
    for name, said in (("7", "no GPU 7 here now: name it by its UUID"),
                       ("GPU-nobody", "GPU-nobody: no such GPU here, and none the record knows"),
                       ("GPU-\x1b]52;c;aGk=\x07", "gpu: expected an index or a UUID")):
        status, out, err = host.health("clear", name)
        assert (status, out) == (1, "") and len(err.splitlines()) == 1, err
        assert err.startswith(f"gpuwarden: health clear: {said}"), err
    assert "\x1b" not in host.daemon.log


@pytest.mark.process
def test_clear_without_a_daemon_or_from_a_read_only_one_is_one_line_and_the_record_is_still_shown(tmp_path, daemons):
    h = Host(tmp_path, daemons)
    write_record(h, "GPU-a", 2)
    status, out, err = h.health()  # no daemon: the counts are still there to read
    assert status == 3 and "  GPU-a  xid79: 2" in out
    assert len(err.splitlines()) == 1 and "gpuwarden: no daemon answers on http://127.0.0.1:" in err
    assert err.rstrip().endswith(": the states are not shown")
    status, out, err = h.health("clear", "0")
    assert status == 69 and len(err.splitlines()) == 1 and "no daemon answers on" in err and "control.sock" in err
    ro = Host(tmp_path / "ro", daemons, tuning="tuning: {apply: false}\n")
    ro.start()
    status, out, err = ro.health("clear", "0")
    assert status == 69 and "a read-only daemon opens no control socket" in err and len(err.splitlines()) == 1


@pytest.mark.process
def test_bad_arguments_are_one_line():
    env = subprocess_env()
    for args, said in ((["clear"], "health clear: name the GPU"), (["0"], "did you mean `gpuwarden health clear 0`")):
        out = subprocess.run([*gpuwarden_cmd(), "health", *args], capture_output=True, text=True, env=env, timeout=60)
        assert out.returncode == 78 and len(out.stderr.splitlines()) == 1 and said in out.stderr, out.stderr


def test_a_caller_not_root_is_told_in_one_line(cli, monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    status, out, err = cli("health", "clear", "0")
    assert (status, out) == (77, "") and err.splitlines() == [
        ("gpuwarden: health clear asks the daemon over its root-only control socket: run it as root "
         "(sudo gpuwarden health clear GPU)")]


@pytest.mark.process
def test_another_user_cannot_clear_through_the_socket(daemons):
    """nobody, reaching the socket's folder, is stopped by the socket's mode: the record keeps its counts."""
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root (to act as another local user) and setpriv")
    outer = Path(tempfile.mkdtemp(prefix="gpuwarden-health-"))
    try:
        outer.chmod(0o755)
        h = Host(outer, daemons)
        write_record(h, "GPU-a", 2)
        h.run_dir.mkdir(mode=0o755)
        h.start()
        sock = h.run_dir / "control.sock"
        client = ("import json, socket, sys\ns = socket.socket(socket.AF_UNIX)\n"
                  "try:\n    s.connect(sys.argv[1])\nexcept OSError as e:\n    print('refused', e.strerror); sys.exit()\n"
                  "s.sendall(b'{\"op\": \"health_clear\", \"gpu\": \"GPU-a\", \"who\": \"mallory\"}\\n')\n"
                  "print(s.makefile().readline())\n")
        out = subprocess.run(["setpriv", "--reuid", "nobody", "--regid", "nogroup", "--clear-groups",
                              "/usr/bin/python3", "-c", client, str(sock)], capture_output=True, text=True, timeout=30)
        assert out.stdout.strip() == "refused Permission denied", out.stdout + out.stderr
        assert h.record().count("GPU-a", "xid79") == 2 and "mallory" not in h.daemon.log
    finally:
        shutil.rmtree(outer, ignore_errors=True)


def test_not_reported_where_the_daemon_has_no_health_and_what_it_reports_escaped(cli, tmp_path, monkeypatch):
    from gpuwarden.web import status as web_status

    monkeypatch.setenv("STATE_DIRECTORY", str(tmp_path))
    conf = tmp_path / "conf.yaml"
    conf.write_text("gpu: {backend: sim, scenario: rtx-pro-4000-headless}\n")
    state = {"daemon": {}, "gpus": [{"index": 0, "uuid": "GPU-a"}]}
    monkeypatch.setattr(web_status, "fetch_status", lambda metrics, auth=None: state)
    status, out, _ = cli("health", "-c", conf)
    lines = out.splitlines()
    assert status == 0 and lines[0] == "host: not reported (this daemon reports no health)"
    assert lines[2].split() == ["0", "GPU-a", "not", "reported", "-", "-"]
    state = {"daemon": {}, "health": {"state": "unhealthy", "action": "reboot", "action_text": "reboot"},
             "gpus": [{"index": 0, "uuid": "GPU-a", "health": {"state": "unhealthy", "action": "reboot",
                                                               "action_text": "reboot",
                                                               "reasons": ["Xid 79\x1b]52;c;aGk=\x07", "lost"]}}]}
    status, out, _ = cli("health", "-c", conf)
    lines = out.splitlines()
    assert status == 0 and lines[0] == "host: unhealthy, action reboot"
    assert lines[2].split(None, 4)[:4] == ["0", "GPU-a", "unhealthy", "reboot"] and "; lost" in lines[2]
    assert "\x1b" not in out and "\x07" not in out  # the daemon's strings never move the terminal
    status, out, _ = cli("health", "-c", conf, "--json")
    assert json.loads(out)["gpus"][0]["reasons"] == ["Xid 79\x1b]52;c;aGk=\x07", "lost"]


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
