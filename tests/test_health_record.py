"""The reboot record (watch/health_record.py): a count per GPU UUID and fault that survives daemon restarts and goes
up once per boot, the escalation it feeds, the repair that clears it, its bounds, and the files an attacker plants
where it lives (garbage, huge, a link, another owner's, a FIFO): each one logged line and an empty record."""

from __future__ import annotations

import json
import logging
import os
import shutil
import threading

import pytest

from conftest import free_port, gpuwarden_cmd, subprocess_env
from gpuwarden.config import HealthPolicy
from gpuwarden.gpu.base import GpuHealth, GpuSample
from gpuwarden.watch import health
from gpuwarden.watch import health_record as hr
from gpuwarden.watch.health_record import HealthRecord, answer_clear


class Boots:
    """/proc/sys/kernel/random/boot_id, as the test says: boot() is a reboot."""

    def __init__(self):
        self.n = 1

    def __call__(self) -> str:
        return f"boot-{self.n}"

    def boot(self):
        self.n += 1


@pytest.fixture
def boots():
    return Boots()


@pytest.fixture
def path(tmp_path):
    return tmp_path / "health.json"


def restart(path, boots) -> HealthRecord:
    """The daemon stopped and started again: what it knows is what the file kept."""
    return HealthRecord.load(path, boot_id=boots)


def test_the_count_survives_a_restart_and_goes_up_once_per_boot(path, boots):
    record = restart(path, boots)
    assert record.count("GPU-a", "xid79") == 0 and record.problem is None  # no file: empty, nothing wrong
    assert record.reboot_required("GPU-a", "xid79", 100.0) == 1
    record.save()
    again = restart(path, boots)  # a daemon restarted within the same boot counts nothing twice
    assert again.count("GPU-a", "xid79") == 1
    assert again.reboot_required("GPU-a", "xid79", 110.0) == 1
    again.save()
    boots.boot()
    after = restart(path, boots)
    assert after.count("GPU-a", "xid79") == 1
    assert after.reboot_required("GPU-a", "xid79", 200.0) == 2
    after.save()
    assert restart(path, boots).count("GPU-a", "xid79") == 2
    assert [e["count"] for e in restart(path, boots).history("GPU-a")] == [1, 2]
    assert os.stat(path).st_mode & 0o777 == 0o600


def test_a_flapping_fault_counts_once_per_boot_and_notes_once(path, boots):
    record = restart(path, boots)
    for i in range(5000):
        record.reboot_required("GPU-a", "recovery_action", float(i))
    assert record.count("GPU-a", "recovery_action") == 1
    assert len(record.history()) == 1
    boots.boot()
    assert record.reboot_required("GPU-a", "recovery_action", 6000.0) == 2


def test_the_count_escalates_to_inspect_after_reboots_before_inspect_across_restarts(path, boots):
    n = HealthPolicy().reboots_before_inspect
    lost = GpuSample(0, "GPU-lost", "NVIDIA H100", "00000000:01:00.0", "9.0", up=False, error="GPU is lost",
                     health=GpuHealth())
    actions = []
    for _ in range(n + 1):
        record = restart(path, boots)  # each boot a new daemon, which knows only the file
        verdict = health.judge(lost, health.Inputs(), n, record.count)
        actions.append(verdict.action)
        if verdict.action == health.REBOOT:
            for fault in verdict.faults:
                record.reboot_required(lost.uuid, fault, 1000.0)
            record.save()
        boots.boot()
    assert actions == [health.REBOOT] * n + [health.INSPECT]
    assert restart(path, boots).count("GPU-lost", "gpu_lost") == n


def test_clear_resets_one_gpus_counts_and_keeps_who(path, boots):
    record = restart(path, boots)
    record.reboot_required("GPU-a", "xid79", 1.0)
    record.reboot_required("GPU-a", "recovery_action", 1.0)
    record.reboot_required("GPU-b", "xid79", 1.0)
    record.clear("GPU-a", "alice (pid 7, uid 0)", 2.0)
    record.save()
    after = restart(path, boots)
    assert after.count("GPU-a", "xid79") == 0 and after.count("GPU-a", "recovery_action") == 0
    assert after.count("GPU-b", "xid79") == 1
    assert after.history("GPU-a")[-1] == {"time": 2.0, "uuid": "GPU-a", "event": "cleared",
                                          "who": "alice (pid 7, uid 0)", "counts": {"xid79": 1, "recovery_action": 1}}
    boots.boot()
    assert after.reboot_required("GPU-a", "xid79", 3.0) == 1  # counting starts afresh after the repair


def test_a_gpu_back_under_another_index_keeps_its_count_and_clears_by_either_name(path, boots, caplog):
    record = restart(path, boots)
    record.reboot_required("GPU-moved", "xid79", 1.0)  # it was GPU 0 when it fell off the bus
    caplog.set_level(logging.INFO, logger="gpuwarden")
    now = {0: "GPU-new", 1: "GPU-moved"}  # after the reboot another card enumerates first
    answer = answer_clear(record, {"op": "health_clear", "gpu": "1", "who": "alice"}, "pid 9, uid 0", now, 5.0)
    assert answer == {"ok": True, "uuid": "GPU-moved", "index": 1, "cleared": {"xid79": 1},
                      "who": "alice (pid 9, uid 0)"}
    assert record.count("GPU-moved", "xid79") == 0
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [("health: GPU 1 (GPU-moved) cleared by alice (pid 9, uid 0): a repair recorded; its reboot "
                      "counts (xid79 x1) reset")]
    # a GPU not listed now (still off the bus) is named by the UUID the record knows
    record.reboot_required("GPU-gone", "gpu_lost", 6.0)
    answer = answer_clear(record, {"op": "health_clear", "gpu": "GPU-gone", "who": "bob"}, "pid 9, uid 0", now, 7.0)
    assert answer["ok"] and answer["index"] is None and record.count("GPU-gone", "gpu_lost") == 0
    assert restart(path, boots).history("GPU-gone")[-1]["who"] == "bob (pid 9, uid 0)"  # saved


def test_a_clear_of_a_gpu_still_lost_does_not_count_this_boots_fault_again(path, boots, caplog):
    """Issue 51, finding 8: the daemon counts what each poll's verdict says (record_reboots); a clear while the GPU
    is still off the bus was followed by the next poll's count at once: 1 again, and the repair's history said a
    reboot was required in the boot it was cleared in. One fault is one record: this boot's is counted already."""
    from gpuwarden.watch.health_record import record_reboots

    lost = GpuSample(0, "GPU-lost", "NVIDIA H100", "00000000:01:00.0", "9.0", up=False, error="GPU is lost",
                     health=GpuHealth())
    record = restart(path, boots)
    poll = lambda now: record_reboots(record, [health.judge(lost, health.Inputs(), 3, record.count)], now)  # noqa: E731
    poll(1.0)
    assert record.counts("GPU-lost") == {"gpu_lost": 1}
    caplog.set_level(logging.INFO, logger="gpuwarden")
    answer = answer_clear(record, {"op": "health_clear", "gpu": "GPU-lost", "who": "alice"}, "pid 9, uid 0", {}, 2.0)
    assert answer["ok"] and answer["cleared"] == {"gpu_lost": 1}
    for now in (3.0, 4.0, 5.0):  # the GPU is still lost: the polls go on
        poll(now)
    assert record.count("GPU-lost", "gpu_lost") == 0 and record.counts("GPU-lost") == {}
    assert [e["event"] for e in record.history("GPU-lost")] == ["reboot required", "cleared"]
    from gpuwarden.cli.health import render
    assert f"No reboots recorded in {path}." in render(False, None, [], record)  # `gpuwarden health`
    again = restart(path, boots)  # the daemon restarted within the boot: the file says so too
    record_reboots(again, [health.judge(lost, health.Inputs(), 3, again.count)], 6.0)
    assert again.count("GPU-lost", "gpu_lost") == 0
    boots.boot()  # rebooted, and still lost: the repair did not hold, counted from 1
    record_reboots(again, [health.judge(lost, health.Inputs(), 3, again.count)], 7.0)
    assert again.counts("GPU-lost") == {"gpu_lost": 1}


@pytest.mark.parametrize("message, said", [
    ({"gpu": "3", "who": "a"}, "no GPU 3 here now"),
    ({"gpu": "GPU-nobody", "who": "a"}, "no such GPU here, and none the record knows"),
    ({"gpu": 0, "who": "a"}, "gpu: expected an index or a UUID"),
    ({"gpu": "GPU-\x1b]52;c;x\x07", "who": "a"}, "gpu: expected an index or a UUID"),
    ({"gpu": "x" * 200, "who": "a"}, "gpu: expected an index or a UUID"),
    ({"gpu": "0"}, "who: expected the name"),
    ({"gpu": "0", "who": "w" * 65}, "who: expected the name"),
])
def test_a_clear_request_out_of_shape_is_one_error_and_changes_nothing(path, boots, message, said):
    record = restart(path, boots)
    record.reboot_required("GPU-a", "xid79", 1.0)
    answer = answer_clear(record, {"op": "health_clear", **message}, "pid 1, uid 0", {0: "GPU-a"}, 2.0)
    assert answer["ok"] is False and said in answer["error"]
    assert record.count("GPU-a", "xid79") == 1 and not path.exists()


def test_every_bound_holds_and_a_full_record_fits_its_file(path, boots):
    record = restart(path, boots)
    worst = "\"\\\x1b" * 100  # quotes and backslashes double in JSON; control characters are kept as "?"
    for g in range(hr.GPUS_MAX + 10):
        for f in range(hr.FAULTS_MAX + 4):
            boots.boot()
            record.reboot_required(f"{g:04d}{worst}", f"{f:04d}{worst}", float(g * 100 + f))
    for g in range(hr.GPUS_MAX + 10):
        record.clear(f"{g:04d}{worst}", worst, 1e6)
    assert len(record.history()) == hr.HISTORY_MAX and record.history()[-1]["event"] == "cleared"
    assert not any(record.counts(u) for u in record.gpus)  # every one was cleared (this boot's fault kept at 0)
    assert len(record.gpus) <= 1
    for g in range(hr.GPUS_MAX + 10):
        for f in range(hr.FAULTS_MAX + 4):
            boots.boot()
            record.reboot_required(f"{g:04d}{worst}", f"{f:04d}{worst}", float(g * 100 + f))
    assert len(record.gpus) == hr.GPUS_MAX and min(record.gpus).startswith("0010")  # the oldest ten went
    assert all(len(faults) == hr.FAULTS_MAX for faults in record.gpus.values())
    assert all(min(faults).startswith("0004") for faults in record.gpus.values())  # each GPU's oldest four went
    assert all(len(u) == hr.STRING_MAX and hr.clean(u) == u and "\x1b" not in u for u in record.gpus)
    # the worst the bounds allow: every GPU full of the longest, most escaped keys, and a full history of clears
    record.gpus = {hr.clean(f"{g:04d}{worst}"): {hr.clean(f"{f:04d}{worst}"): {
        "count": hr.COUNT_MAX, "boot": hr.clean(worst), "first": 1e12, "last": 1e12}
        for f in range(hr.FAULTS_MAX)} for g in range(hr.GPUS_MAX)}
    record.entries = [{"time": 1e12, "uuid": hr.clean(worst), "event": "cleared", "who": hr.clean(worst),
                       "counts": {hr.clean(f"{f:04d}{worst}"): hr.COUNT_MAX for f in range(hr.FAULTS_MAX)}}
                      for _ in range(hr.HISTORY_MAX)]
    record.save()
    assert record.save_error is None and path.stat().st_size <= hr.FILE_MAX
    back = restart(path, boots)
    assert back.problem is None and back.gpus == record.gpus and back.history() == record.history()


def test_times_a_clock_cannot_give_are_kept_as_0_not_a_file_the_next_start_refuses(path, boots):
    record = restart(path, boots)
    record.reboot_required("GPU-a", "xid79", float("nan"))
    record.clear("GPU-b", "x", -5.0)
    record.save()
    assert restart(path, boots).problem is None


def valid_file() -> str:
    return json.dumps({"version": 1, "gpus": {"GPU-a": {"xid79": {"count": 2, "boot": "b", "first": 1, "last": 2}}},
                       "history": []})


def forged(**change) -> str:
    data = json.loads(valid_file())
    data["gpus"]["GPU-a"]["xid79"].update(change)
    return json.dumps(data)


@pytest.mark.parametrize("content, said", [
    (b"\x00\xff garbage", "not JSON"),
    (b"[" * 100_000, "not JSON"),
    (b"[1, 2]", "not a JSON object"),
    (b"x" * (hr.FILE_MAX + 1), f"more than {hr.FILE_MAX} bytes"),
    (json.dumps({"version": 2, "gpus": {}, "history": []}).encode(), "expected {\"version\": 1"),
    (forged(count=-1).encode(), "a count is not a whole number"),
    (forged(count=True).encode(), "a count is not a whole number"),
    (forged(count=10**30).encode(), "a count is not a whole number"),
    (forged(last=float("nan")).encode(), "a time is not a finite number"),
    (forged(extra=1).encode(), "expected count, boot, first, last"),
    (json.dumps({"version": 1, "gpus": {"GPU-\x1b[2J": {}}, "history": []}).encode(), "not printable text"),
    (json.dumps({"version": 1, "gpus": {f"G{i}": {} for i in range(hr.GPUS_MAX + 1)}, "history": []}).encode(),
     f"more than {hr.GPUS_MAX} GPUs"),
    (json.dumps({"version": 1, "gpus": {}, "history": [{"event": "rm -rf", "time": 1, "uuid": "u"}]}).encode(),
     "a history entry"),
])
def test_a_corrupt_or_forged_file_is_one_line_and_an_empty_record(path, boots, caplog, content, said):
    path.write_bytes(content)
    os.chmod(path, 0o600)
    caplog.set_level(logging.INFO, logger="gpuwarden")
    record = restart(path, boots)
    assert record.gpus == {} and record.history() == [] and said in record.problem
    assert [r.levelname for r in caplog.records] == ["WARNING"] and said in caplog.records[0].getMessage()
    assert "\n" not in caplog.records[0].getMessage()
    record.reboot_required("GPU-a", "xid79", 1.0)
    record.save()  # the next save replaces it with a record of ours
    assert restart(path, boots).count("GPU-a", "xid79") == 1


def test_a_file_another_user_owns_or_may_write_is_not_trusted(path, boots, caplog):
    if os.geteuid() != 0:
        pytest.skip("chown needs root")
    path.write_text(valid_file())
    os.chmod(path, 0o600)
    assert restart(path, boots).count("GPU-a", "xid79") == 2  # the same file, ours: taken
    os.chown(path, 65534, 65534)
    record = restart(path, boots)
    assert record.gpus == {} and "owned by uid 65534, not 0" in record.problem
    os.chown(path, 0, 0)
    os.chmod(path, 0o666)
    record = restart(path, boots)
    assert record.gpus == {} and "mode 0666 lets others write it" in record.problem


def test_a_link_where_the_record_belongs_is_not_followed_and_the_save_replaces_the_link(path, boots, tmp_path):
    target = tmp_path / "elsewhere.json"
    target.write_text(valid_file())
    os.chmod(target, 0o600)
    path.symlink_to(target)
    record = restart(path, boots)
    assert record.gpus == {} and "a symbolic link" in record.problem
    record.reboot_required("GPU-z", "xid79", 1.0)
    record.save()
    assert not path.is_symlink() and json.loads(target.read_text()) == json.loads(valid_file())  # never written through


def test_a_fifo_where_the_record_belongs_is_never_waited_on(path, boots):
    os.mkfifo(path, 0o600)
    box = {}
    reader = threading.Thread(target=lambda: box.update(record=restart(path, boots)), daemon=True)
    reader.start()
    reader.join(10)
    assert not reader.is_alive(), "the load waited on a FIFO with no writer"
    assert box["record"].gpus == {} and "not a regular file" in box["record"].problem


def test_a_save_that_cannot_write_is_one_line_and_keeps_the_counts(tmp_path, boots, caplog):
    path = tmp_path / "no-such-folder" / "health.json"
    record = HealthRecord.load(path, boot_id=boots)
    record.reboot_required("GPU-a", "xid79", 1.0)
    caplog.set_level(logging.INFO, logger="gpuwarden")
    record.save()
    assert record.save_error and record.count("GPU-a", "xid79") == 1
    assert len(caplog.records) == 1 and "not written" in caplog.records[0].getMessage()


# -- times no clock gives, read at the start and by `gpuwarden health` (test_health_cli.py) ----------------------------

UNIT_CAPS = ["setpriv", "--bounding-set", "-all,+sys_admin,+setuid,+setgid,+kill", "--no-new-privs"]


def as_the_unit() -> list[str]:
    return UNIT_CAPS if os.geteuid() == 0 and shutil.which("setpriv") else []


def record_with_time(when: str) -> str:
    """A record of the daemon's shape whose one history entry has the time `when` (JSON text, as planted)."""
    return ('{"version": 1, "gpus": {}, "history": [{"time": ' + when + ', "uuid": "GPU-a", '
            '"event": "reboot required", "fault": "xid79", "count": 1}]}')


FORGED_TIMES = ["1" + "0" * 400, "1e300", "-0.5", "NaN"]


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


# -- the control socket's clear ----------------------------------------------------------------------------------------

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
