"""Leftovers found through the unit's cgroup (issue 35, finding 5 attacked again): a process that left the
engine's process group (setsid) before a daemon crash has init for its parent, not the restarted daemon, so
escaped() (processes re-parented to the daemon) never finds it. Under the unit every process of serve.user's
uid in the unit's own cgroup that no running child accounts for is a leftover of ours: the restarted daemon
and `gpuwarden cleanup` (ExecStopPost runs in the same cgroup) end it, SIGTERM then SIGKILL, one line each.
Outside the unit's cgroup nothing is touched: a daemon run by hand sits in a session scope.

Real processes in a real cgroup v2 made by the test (named as systemd names the unit's); the daemon and
cleanup run under the unit's capabilities. Skipped where no cgroup v2 can be made (not root, read-only)."""

import os
import pwd
import re
import signal
import subprocess
import uuid
from pathlib import Path

import pytest
from conftest import DaemonProcess, free_port, gpuwarden_cmd
from gpuwarden.serving.run import handover
from test_adoption import env_with_state, running_pid
from test_faults import fake, fakes_alive, fault_config, no_fakes_left, wait_until  # noqa: F401 (fixtures)


UNIT_CAPS = ["setpriv", "--bounding-set", "-all,+sys_admin,+setuid,+setgid,+kill", "--no-new-privs"]


def cgroup2_mount():
    for line in Path("/proc/self/mounts").read_text().splitlines():
        fields = line.split()
        if fields[2] == "cgroup2":
            return Path(fields[1])
    return None


@pytest.fixture
def cgroups():
    """make(name): a fresh cgroup v2 .../gwtest-XXXX/name (name as systemd names a unit's, or a session's);
    removed at the end (the test's own processes in it are gone by then)."""
    mount = cgroup2_mount()
    if os.geteuid() != 0 or mount is None:
        pytest.skip("needs root and a cgroup v2 hierarchy to make the unit's cgroup")
    top = mount / f"gwtest-{uuid.uuid4().hex[:8]}"
    try:
        top.mkdir()
    except OSError as exc:
        pytest.skip(f"cannot make a cgroup under {mount}: {exc.strerror}")
    made = []

    def make(name):
        folder = top / name
        folder.mkdir()
        made.append(folder)
        return folder

    yield make
    for folder in [*made, top]:  # a process killed a moment ago may still be leaving it (EBUSY meanwhile)
        wait_until(lambda f=folder: not f.exists() or not (f / "cgroup.procs").read_text(), timeout=10)
        folder.rmdir()


def within(folder, argv):
    """argv run in the cgroup from its first instruction on (a shell joins it, then execs: the same process),
    so that every child it starts is born there; folder None: argv as it is."""
    if folder is None:
        return list(argv)
    return ["sh", "-c", 'echo 0 > "$0/cgroup.procs" && exec "$@"', str(folder), *argv]


class DaemonIn(DaemonProcess):
    """`gpuwarden run` in a cgroup (playing the unit's) and under the unit's capabilities."""

    def __init__(self, folder, config_path, env):
        import threading

        self.lines = []
        self.proc = subprocess.Popen(within(folder, [*UNIT_CAPS, *gpuwarden_cmd(), "run", "-c", str(config_path)]),
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()


def cleanup_in(folder, env, result="success"):
    """ExecStopPost: `gpuwarden cleanup` in the unit's cgroup, under its capabilities."""
    return subprocess.run(within(folder, [*UNIT_CAPS, *gpuwarden_cmd(), "cleanup"]),
                          env=dict(env, SERVICE_RESULT=result), capture_output=True, text=True, timeout=60,
                          check=False)


def as_user(user, argv, folder=None):
    """argv as user, in its own session (as an escaped process is), in folder's cgroup (None: the test's own)."""
    return subprocess.Popen(within(folder, ["setpriv", "--reuid", user, "--regid", str(pwd.getpwnam(user).pw_gid),
                                            "--clear-groups", *argv]),
                            start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def live_of_uid(folder, uid):
    """Live (not zombie) processes of uid in the cgroup."""
    out = []
    for line in (folder / "cgroup.procs").read_text().split():
        try:
            state = Path(f"/proc/{line}/stat").read_text().rsplit(")", 1)[1].split()[0]
            owner = os.stat(f"/proc/{line}").st_uid
        except (OSError, IndexError):
            continue
        if state != "Z" and owner == uid:
            out.append(int(line))
    return out


def gone(pid):
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def grandchild_of(script, engine, besides):
    """The fake engine's setsid grandchild: a process of the fake child outside the engine's group."""
    for pid in fakes_alive(script):
        try:
            if pid != besides and os.getpgid(pid) != engine:
                return pid
        except ProcessLookupError:
            continue
    return None


HANG_S = 120  # a bound on a hang, never a timing rule: this file asserts what is stopped and in which order


@pytest.mark.process
def test_after_a_crash_and_serving_off_nothing_of_the_engine_is_left_in_the_unit(write, fake, cgroups, tmp_path,
                                                                               no_fakes_left):
    unit = cgroups("gpuwarden.service")
    uid = pwd.getpwnam(fake["user"]).pw_uid
    path, base, _ = fault_config(write, fake, "setsid")
    env, _ = env_with_state(tmp_path)
    # A process of the same user outside the unit's cgroup: never ours to end.
    outside = as_user(fake["user"], [fake["python"], str(fake["script"]), "--mode", "noaccept",
                                     "--port", str(free_port())])
    daemons = []
    try:
        daemons.append(DaemonIn(unit, path, env))
        engine = running_pid(base)
        straggler = wait_until(lambda: grandchild_of(fake["script"], engine, outside.pid), timeout=10)
        assert os.getsid(straggler) == straggler, "it left the engine's session and group"
        daemons[0].proc.kill()  # the crash: no stop, no cleanup; init takes the straggler, not the next daemon
        daemons[0].proc.wait(10)
        path.write_text(path.read_text().replace("  enabled: true", "  enabled: false", 1))

        daemons.append(DaemonIn(unit, path, env))
        second = daemons[1]
        # Order and outcome; each bound is only for a hang (HANG_S). The straggler is found once its engine's
        # group is gone (the sweep when nothing runs any more): the engine's stop, then the straggler's, then its
        # SIGKILL. A Debian 12 pass beside an attacker's runs took more than the 10 s this once allowed.
        first = second.wait_index(f"vllm pid {engine}: recorded by the daemon before, serving is off", HANG_S)
        found = second.wait_index(f"stopping pid {straggler} ", HANG_S, after=first)
        line = second.lines[found]
        assert "left behind in this unit's cgroup" in line and "SIGTERM, SIGKILL after 2 s" in line
        # It ignores SIGTERM (fakechild's setsid mode): SIGKILL after the grace.
        second.wait_for(f"pid {straggler} did not stop within its grace: SIGKILL", timeout=HANG_S, after=found)
        wait_until(lambda: gone(straggler), timeout=HANG_S)
        wait_until(lambda: gone(engine), timeout=HANG_S)
        assert second.stop() == 0
        cleanup = cleanup_in(unit, env)
        assert cleanup.returncode == 0, cleanup.stderr
        assert live_of_uid(unit, uid) == []
        assert outside.poll() is None, "a process of the same uid outside the unit's cgroup is left alone"
    finally:
        for d in daemons:
            if d.proc.poll() is None:
                d.proc.kill()
                d.proc.wait(30)
        outside.kill()
        outside.wait()


def leftover_and_record(unit, fake, folder):
    """A straggler of serve.user in the cgroup (as a setsid'd grandchild left after its engine) and the
    record a stopped daemon left (its engine already gone: only its user matters here)."""
    straggler = as_user(fake["user"], [fake["python"], str(fake["script"]), "--mode", "ignore-term",
                                       "--port", str(free_port())], unit)
    wait_until(lambda: Path(f"/proc/{straggler.pid}/cmdline").read_bytes().count(str(fake["script"]).encode()),
               timeout=10)
    uid = pwd.getpwnam(fake["user"]).pw_uid
    handover.save(folder, handover.Record((handover.Recorded("vllm", 2**22 + 7, 1, uid, "0" * 64),),
                                          stopping=True))
    return straggler


@pytest.mark.process
def test_cleanup_ends_a_leftover_of_serve_user_in_the_unit_s_cgroup_and_nothing_outside(fake, cgroups, tmp_path,
                                                                                       no_fakes_left):
    """The daemon's stop timed out (systemd SIGKILLed it): cleanup ends what it left in the unit's cgroup."""
    unit = cgroups("gpuwarden.service")
    env, folder = env_with_state(tmp_path)
    straggler = leftover_and_record(unit, fake, folder)
    outside = as_user(fake["user"], [fake["python"], str(fake["script"]), "--mode", "noaccept",
                                     "--port", str(free_port())])
    try:
        cleanup = cleanup_in(unit, env, "timeout")
        assert cleanup.returncode == 0, cleanup.stderr
        assert re.search(rf"stopping pid {straggler.pid} \(user {fake['user']}, python3\): left behind in this "
                         r"unit's cgroup.*SIGTERM, SIGKILL after 5 s", cleanup.stderr), cleanup.stderr
        assert f"pid {straggler.pid} did not stop within its grace: SIGKILL" in cleanup.stderr
        assert straggler.wait(5) == -signal.SIGKILL
        assert outside.poll() is None
        assert not (folder / handover.RECORD).exists()
    finally:
        for proc in (straggler, outside):
            proc.kill()
            proc.wait()


@pytest.mark.process
def test_outside_the_unit_s_cgroup_cleanup_touches_no_process_of_the_user(fake, cgroups, tmp_path, no_fakes_left):
    """A daemon run by hand sits in a session's scope: there a process of serve.user's uid may be the user's own,
    and it is left alone, as before."""
    scope = cgroups("session-9999.scope")
    env, folder = env_with_state(tmp_path)
    straggler = leftover_and_record(scope, fake, folder)
    try:
        cleanup = cleanup_in(scope, env, "timeout")
        assert cleanup.returncode == 0, cleanup.stderr
        assert "stopping pid" not in cleanup.stderr
        assert straggler.poll() is None
    finally:
        straggler.kill()
        straggler.wait()


def test_the_unit_s_cgroup_is_known_by_its_name_and_read_from_the_cgroup2_mount(tmp_path):
    """A fake /proc: the cgroup v2 line names the folder under the cgroup2 mount (octal escapes in the mount
    point read back); a session scope, a user's service, the root cgroup or a v1-only host is not the unit."""
    from gpuwarden.serving.run.processes import unit_cgroup

    proc = tmp_path / "proc"
    (proc / "self").mkdir(parents=True)

    def at(line, mounts="cgroup2 /sys/fs/cg\\040two cgroup2 rw 0 0\n"):
        (proc / "self" / "cgroup").write_text(f"1:name=systemd:/x\n{line}\n")
        (proc / "self" / "mounts").write_text("proc /proc proc rw 0 0\n" + mounts)
        return unit_cgroup(str(proc))

    assert at("0::/system.slice/gpuwarden.service") == Path("/sys/fs/cg two/system.slice/gpuwarden.service")
    assert at("0::/system.slice/system-gpuwarden.slice/gpuwarden@a.service") is not None
    for elsewhere in ("0::/", "0::/user.slice/user-0.slice/session-3.scope", "0::/system.slice/ssh.service",
                      "0::/user.slice/user-1000.slice/user@1000.service/app.slice/gpuwarden.service.scope",
                      "0::/system.slice/gpuwarden-e2e.service"):
        assert at(elsewhere) is None, elsewhere
    assert at("0::/system.slice/gpuwarden.service", mounts="") is None
