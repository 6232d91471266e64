"""A daemon that ends (a crash, SIGKILL) or hands over to new code (an upgrade: SIGUSR2, re-exec, same PID)
leaves its engine serving, and the daemon after it takes the engine back: same PID, its output read again,
watched again. Only a process provably its own is adopted (start time, user and command line); one whose
command the config no longer asks for is replaced as a reload would. Real processes throughout: the daemon
and the fake engine (tests/harness/fakechild.py)."""

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

from conftest import subprocess_env
from gpuwarden.serving.run import handover
from test_faults import fake, fault_config, no_fakes_left, status, wait_until  # noqa: F401 (fixtures)


def engine_of(base):
    """(state, pid) of the engine as the daemon reports it."""
    try:
        serving = status(base).get("serving") or {}
    except OSError:
        return None, None
    return serving.get("state"), (serving.get("pid") if "pid" in serving else None)


def running_pid(base, timeout=30):
    return wait_until(lambda: (lambda s, p: p if s == "RUNNING" and p else None)(*engine_of(base)), timeout)


def env_with_state(tmp_path):
    folder = tmp_path / "state"
    folder.mkdir(exist_ok=True)
    return dict(subprocess_env(), STATE_DIRECTORY=str(folder)), folder


@pytest.mark.process
def test_a_restarted_daemon_adopts_the_engine_it_left_and_watches_it_again(write, fake, daemons, tmp_path,
                                                                            no_fakes_left):
    path, base, port = fault_config(write, fake, "healthy,chatty")
    env, folder = env_with_state(tmp_path)
    first = daemons(path, env=env)
    pid = running_pid(base)
    record = handover.load(folder)
    assert [c.name for c in record.children] == ["vllm"] and record.children[0].pid == pid
    first.proc.kill()  # SIGKILL: no stop, no cleanup; the engine goes on serving
    first.proc.wait(10)
    assert handover.start_ticks(pid) is not None, "the engine outlived its daemon"
    second = daemons(path, env=env)
    line = second.wait_for("adopted after a restart of the daemon", timeout=30)
    assert f"pid {pid}, up " in line and "still serving" in line
    assert running_pid(base) == pid, "the same engine, not a new one"
    assert "vLLM starting (pid" not in second.log
    # Its flags were checked when it started: the second daemon does not wait on the engine's parser again
    # before it watches the engine (on a busy host that took longer than systemd's restart loop allowed).
    assert "accepts the flags" in first.log and "accepts the flags" not in second.log
    # Watched again: killed, it is noticed and restarted as any engine is.
    mark = len(second.lines)
    os.kill(pid, signal.SIGKILL)
    second.wait_for("vLLM exited with an exit status nobody could see", after=mark, timeout=20)
    second.wait_for("vLLM starting (pid", after=mark, timeout=30)
    assert running_pid(base) != pid
    assert second.stop() == 0
    assert handover.load(folder).children == ()  # a stop leaves nothing to adopt


@pytest.mark.process
def test_a_handover_re_executes_in_place_and_keeps_the_engine_and_its_output(write, fake, daemons, tmp_path,
                                                                            no_fakes_left):
    path, base, port = fault_config(write, fake, "healthy,chatty")
    env, folder = env_with_state(tmp_path)
    d = daemons(path, env=env)
    pid = running_pid(base)
    daemon_pid = d.proc.pid
    mark = len(d.lines)
    d.proc.send_signal(signal.SIGUSR2)
    d.wait_for("SIGUSR2: handing over to the installed gpuwarden", after=mark, timeout=10)
    for _ in range(100):  # a logrotate or `systemctl reload` meeting the re-exec: held, never the end of it
        d.proc.send_signal(signal.SIGHUP)
        time.sleep(0.005)
    line = d.wait_for("adopted after an upgrade (re-exec, same daemon pid)", after=mark, timeout=30)
    assert f"pid {pid}, up " in line
    assert d.proc.poll() is None and d.proc.pid == daemon_pid
    assert status(base)["daemon"]["pid"] == daemon_pid
    assert running_pid(base) == pid
    after = len(d.lines)
    d.wait_for("vllm: INFO fakechild tick", after=after, timeout=10)  # the same pipe, read by the new image
    assert "vLLM starting (pid" not in "\n".join(d.lines[mark:])
    # (A SIGHUP before the handover needs no reload of its own: the new image reads the config anew.)
    # A handover with a config on disk that would not start is refused: the daemon and its engine keep running.
    good = path.read_text()
    path.write_text(good + "poll_interval_s: [broken\n")
    mark = len(d.lines)
    d.proc.send_signal(signal.SIGUSR2)
    d.wait_for("SIGUSR2: no handover, the config on disk would not start", after=mark, timeout=10)
    time.sleep(1)
    assert d.proc.poll() is None and running_pid(base) == pid
    path.write_text(good)
    # The re-executed daemon watches the engine it kept: killed, it is noticed and restarted as any engine is.
    # (The nspawn boot's real vLLM is restarted by `systemctl restart` after its upgrade instead.)
    mark = len(d.lines)
    os.kill(pid, signal.SIGKILL)
    d.wait_for("vLLM exited with signal SIGKILL", after=mark, timeout=20)
    d.wait_for("vLLM starting (pid", after=mark, timeout=30)
    new = running_pid(base)
    assert new != pid
    # The re-executed daemon still stops its engine: nothing is left.
    assert d.stop() == 0
    assert handover.start_ticks(new) is None


@pytest.mark.process
def test_a_handover_while_the_engine_loads_waits_for_its_health_and_never_probes_its_liveness(
        write, fake, daemons, tmp_path, no_fakes_left):
    """An upgrade's SIGUSR2 while the engine still loads its model (a boot, a reload): the new image adopts it
    as STARTING, as it was, and waits for its health; the proxy is not told it is up, and no liveness probe
    (one failure is enough here) ends the load. Adopted as RUNNING, it was killed by liveness a few seconds on."""
    path, base, port = fault_config(write, fake, "loading,chatty", serve_extra="  liveness_failures: 1\n")
    env, folder = env_with_state(tmp_path)
    d = daemons(path, env=env)
    d.wait_for("vLLM starting (pid", timeout=30)
    pid = wait_until(lambda: (lambda s, p: p if s == "STARTING" and p else None)(*engine_of(base)), timeout=30)
    assert [(c.pid, c.starting) for c in handover.load(folder).children] == [(pid, True)]
    mark = len(d.lines)
    d.proc.send_signal(signal.SIGUSR2)
    line = d.wait_for("adopted after an upgrade (re-exec, same daemon pid)", after=mark, timeout=30)
    assert f"pid {pid}, up " in line and "still starting" in line
    wait_until(lambda: engine_of(base)[0], timeout=30)  # the new image's first snapshot (its /status had none yet)
    assert engine_of(base) == ("STARTING", pid)
    d.wait_for("vllm: INFO fakechild tick", after=len(d.lines), timeout=10)  # the new image reads its output
    os.kill(pid, signal.SIGUSR1)  # the model loaded
    d.wait_for("vLLM healthy after", after=mark, timeout=120)
    assert running_pid(base) == pid
    after = "\n".join(d.lines[mark:])
    assert "liveness probe failed" not in after and "vLLM starting (pid" not in after
    wait_until(lambda: [(c.pid, c.starting) for c in handover.load(folder).children] == [(pid, False)], timeout=10)
    assert d.stop() == 0


def test_an_engine_adopted_while_starting_counts_its_start_up_from_its_own_start():
    """The supervisor on fake process calls and a clock the test drives: adopted STARTING, 30 s after its
    start, with startup_timeout_s 60 and two failed liveness probes enough to end a RUNNING one: unhealthy
    answers for 25 s more do not end it; healthy, it is RUNNING, 57 s from its start. Another adopted the same
    way fails at 60 s from its start, not from its adoption."""
    from gpuwarden.serving.run.processes import Child
    from gpuwarden.serving.run.supervisor import BACKOFF, RUNNING, STARTING
    from test_serving import supervisor

    for ends_healthy in (True, False):
        sup, ops, clock = supervisor()
        ops.groups[4242] = [4242]  # its process group, which answers on its port
        sup.adopt(Child(4242, 4242), clock.now, time.time() - 30, "an upgrade", starting=True)
        assert sup.state == STARTING
        for _ in range(5):
            clock.advance(5)
            sup.tick(clock.now)
            assert sup.state == STARTING
        ops.health_ok = ends_healthy
        clock.advance(2 if ends_healthy else 6)
        sup.tick(clock.now)
        if ends_healthy:
            assert sup.state == RUNNING and 56 < sup.time_to_healthy_s < 58
        else:
            assert sup.state == BACKOFF and "startup_timeout_s 60" in sup.problem
    sup, ops, clock = supervisor()  # one recorded RUNNING: probed at once
    sup.adopt(Child(4242, 4242), clock.now, time.time() - 30, "an upgrade")
    assert sup.state == RUNNING and sup.phase.next_probe == clock.now


def test_the_record_says_which_children_were_still_starting(tmp_path):
    """A JSON true or false says whether it was still starting; anything else (an older daemon's record, without the
    key; "yes"; 1) is not known (None), which adopt() treats as starting."""
    folder = tmp_path / "state"
    handover.save(folder, handover.Record((handover.Recorded("vllm", 10, 1, 0, "x", None, True, "e" * 64),
                                           handover.Recorded("proxy", 11, 1, 0, "y", None, False),
                                           handover.Recorded("side", 12, 1, 0, "z"))))
    assert [(c.starting, c.env_sha256) for c in handover.load(folder).children] == [
        (True, "e" * 64), (False, None), (None, None)]
    assert handover.env_digest({"A": "1", "B": "2"}) == handover.env_digest({"B": "2", "A": "1"}) != \
        handover.env_digest({"A": "1", "B": "3"})
    for value in ("", ', "starting": "yes"', ', "starting": 1', ', "starting": null'):
        (folder / handover.RECORD).write_text('{"children": [{"name": "vllm", "pid": 10, "start_ticks": 1, '
                                              f'"uid": 0, "argv_sha256": "x"{value}}}]}}')
        assert handover.load(folder).children[0].starting is None


def test_an_engine_whose_state_an_older_record_does_not_say_is_awaited_from_its_adoption():
    """The upgrade to this release reads a record without "starting": the engine may be loading (attacker 6's
    finding 2), so it is STARTING, startup_timeout_s 60 counted from the adoption (it has been up 3 h: from its start
    it would be cut at once); unhealthy for 55 s it stays, healthy it is RUNNING."""
    from gpuwarden.serving.run.processes import Child
    from gpuwarden.serving.run.supervisor import RUNNING, STARTING
    from test_serving import supervisor

    sup, ops, clock = supervisor()
    ops.groups[4242] = [4242]
    sup.adopt(Child(4242, 4242), clock.now, time.time() - 3 * 3600, "an upgrade", starting=None)
    for _ in range(11):
        clock.advance(5)
        sup.tick(clock.now)
        assert sup.state == STARTING
    ops.health_ok = True
    clock.advance(1)
    sup.tick(clock.now)
    sup.tick(clock.now)
    assert sup.state == RUNNING and sup.time_to_healthy_s == 56


@pytest.mark.process
def test_an_engine_whose_command_changed_meanwhile_is_replaced_as_a_reload_would(write, fake, daemons, tmp_path,
                                                                               no_fakes_left):
    path, base, port = fault_config(write, fake, "healthy")
    env, folder = env_with_state(tmp_path)
    first = daemons(path, env=env)
    pid = running_pid(base)
    first.proc.kill()
    first.proc.wait(10)
    path.write_text(path.read_text().replace('--mode, "healthy"', '--mode, "healthy,chatty"'))
    second = daemons(path, env=env)
    second.wait_for("vLLM's command, environment or user changed since it was started: replacing it", timeout=30)
    second.wait_for("vLLM starting (pid", timeout=30)
    new = running_pid(base)
    assert new != pid and handover.start_ticks(pid) is None
    assert second.stop() == 0


@pytest.mark.process
def test_a_handover_with_serve_env_changed_on_disk_replaces_the_engine_with_the_new_environment(
        write, fake, daemons, tmp_path, no_fakes_left):
    """Attacker 6's finding 3: serve.env edited, then SIGUSR2: the new image adopted the engine (same argv, same
    user) and took the new config for what ran, so no SIGHUP after ever gave it the variable. The record now holds
    a digest of the environment it was started with."""
    path, base, port = fault_config(write, fake, "healthy,chatty")
    env, folder = env_with_state(tmp_path)
    d = daemons(path, env=env)
    pid = running_pid(base)
    assert handover.load(folder).children[0].env_sha256 is not None
    path.write_text(path.read_text().replace("serve:\n", "serve:\n  env: {FOO_MARK: new-value}\n", 1))
    mark = len(d.lines)
    d.proc.send_signal(signal.SIGUSR2)
    d.wait_for("vLLM's command, environment or user changed since it was started: replacing it", after=mark,
               timeout=60)
    new = wait_until(lambda: (lambda p: p if p != pid else None)(running_pid(base)), timeout=60)
    with open(f"/proc/{new}/environ", "rb") as f:
        assert b"FOO_MARK=new-value" in f.read().split(b"\0")
    assert d.stop() == 0


@pytest.mark.process
def test_only_a_provably_own_process_is_adopted(tmp_path):
    """Same PID but another start time, another user, or another command line: never adopted."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        argv = [sys.executable, "-c", "import time; time.sleep(60)"]
        wait_until(lambda: handover.cmdline_digest(proc.pid) == handover.argv_digest(argv), timeout=10)  # exec'd
        ticks = handover.start_ticks(proc.pid)
        good = handover.Recorded("vllm", proc.pid, ticks, os.geteuid(), handover.argv_digest(argv))
        assert handover.proven(good) is None
        assert "another time" in handover.proven(handover.Recorded("vllm", proc.pid, ticks + 1, os.geteuid(),
                                                                   good.argv_sha256))
        assert "runs as uid" in handover.proven(handover.Recorded("vllm", proc.pid, ticks, os.geteuid() + 1,
                                                                  good.argv_sha256))
        assert "another command line" in handover.proven(handover.Recorded(
            "vllm", proc.pid, ticks, os.geteuid(), handover.argv_digest(argv + ["--port", "1"])))
    finally:
        proc.kill()
        proc.wait()
    assert "gone" in handover.proven(good)
    assert "not a child" in handover.proven(handover.Recorded("vllm", 1, 1, 0, good.argv_sha256))


@pytest.mark.process
def test_a_look_alike_recorded_engine_is_not_adopted_and_not_killed(write, fake, daemons, tmp_path,
                                                                    no_fakes_left):
    """A record that points at a process with the engine's command line but another start time (a recycled
    PID, or a forged record): the daemon says so, adopts nothing, and leaves that process alone."""
    path, base, port = fault_config(write, fake, "healthy")
    env, folder = env_with_state(tmp_path)
    look_alike = subprocess.Popen([fake["python"], str(fake["script"]), "--mode", "noaccept", "--port", "1"],
                                  stdout=subprocess.DEVNULL)
    try:
        argv = [fake["python"], str(fake["script"]), "--mode", "noaccept", "--port", "1"]
        wait_until(lambda: handover.cmdline_digest(look_alike.pid) == handover.argv_digest(argv), timeout=10)
        ticks = handover.start_ticks(look_alike.pid)
        handover.save(folder, handover.Record((handover.Recorded("vllm", look_alike.pid, ticks - 1, os.geteuid(),
                                                                 handover.argv_digest(argv)),)))
        d = daemons(path, env=env)
        d.wait_for("not adopting the recorded vllm: pid", timeout=30)
        assert running_pid(base) != look_alike.pid
        assert look_alike.poll() is None, "a process it cannot prove its own is left alone"
        assert d.stop() == 0
    finally:
        look_alike.kill()
        look_alike.wait()


@pytest.mark.process
def test_cleanup_keeps_children_after_a_crash_and_ends_them_after_a_stop(tmp_path):
    """The unit's ExecStopPost: after a crash (SERVICE_RESULT=signal) the recorded child is kept for the
    restarted daemon; after a stop that timed out it is ended."""
    env, folder = env_with_state(tmp_path)
    argv = [sys.executable, "-c", "import time; time.sleep(60)"]
    child = subprocess.Popen(argv, start_new_session=True)
    try:
        wait_until(lambda: handover.cmdline_digest(child.pid) == handover.argv_digest(argv), timeout=10)
        ticks = handover.start_ticks(child.pid)
        handover.save(folder, handover.Record((handover.Recorded("vllm", child.pid, ticks, os.geteuid(),
                                                                 handover.argv_digest(argv)),)))
        cmd = [sys.executable, "-m", "gpuwarden", "cleanup"]
        kept = subprocess.run(cmd, env=dict(env, SERVICE_RESULT="signal"), capture_output=True, text=True,
                              timeout=60)
        assert kept.returncode == 0 and "keeping 1 child(ren)" in kept.stdout
        assert child.poll() is None
        ended = subprocess.run(cmd, env=dict(env, SERVICE_RESULT="timeout"), capture_output=True, text=True,
                               timeout=60)
        assert ended.returncode == 0
        assert child.wait(10) == -signal.SIGKILL
        assert handover.load(folder) is None
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


@pytest.mark.parametrize("kind", ["fifo", "huge", "garbage", "symlink", "overflow", "deep"])
def test_a_record_that_is_not_ours_adopts_nothing_and_says_so_once(tmp_path, kind, caplog):
    folder = tmp_path / "state"
    folder.mkdir()
    path = folder / handover.RECORD
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "huge":
        path.write_text(json.dumps({"children": [], "pad": "x" * (handover.MAX_RECORD_BYTES + 1)}))
    elif kind == "garbage":
        path.write_text('{"children": [{"name": 1}]}')
    elif kind == "overflow":
        path.write_text('{"children": [{"name": "vllm", "pid": 1e400, "start_ticks": 1, "uid": 0, '
                        '"argv_sha256": "x"}]}')
    elif kind == "deep":
        path.write_text('{"children": ' + "[" * 30000 + "]" * 30000 + "}")
    else:
        (tmp_path / "elsewhere.json").write_text('{"children": []}')
        path.symlink_to(tmp_path / "elsewhere.json")
    assert handover.load(folder) is None
    assert len([r for r in caplog.records if "adopting nothing" in r.getMessage()]) == 1
