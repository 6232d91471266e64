"""The engine from a container image on real podman (issue 53): Debian 12's podman 4.3.1 serving its API on a socket
of the test's own (tests/harness/podman_rig.py), a local image from `podman import`, the fake engine inside it, and
the daemon under the unit's capability set. Nothing of podman is mocked.

One daemon's life shares the container starts (a few seconds each): a stray an earlier run left is removed at the
start; the engine serves from its container as serve.user without capabilities; a crash of the engine brings a new
container after the backoff; a SIGKILL of the daemon leaves the same container serving, and the next daemon adopts it;
the stop drains it and leaves no labelled container."""

import json
import os
import pwd
import signal
import stat
import subprocess
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from conftest import free_port, gpuwarden_cmd, subprocess_env
from gpuwarden.serving.compose.container import LABEL_CHILD, LABEL_HOST, LABEL_OWNER, host_id
from gpuwarden.serving.run.ports import port_free
from harness.podman_rig import IMAGE, fake_vllm_dist

pytestmark = pytest.mark.podman
ROOT = Path(__file__).resolve().parent.parent
UNIT_CAPS = ["setpriv", "--bounding-set", "-all,+sys_admin,+setuid,+setgid,+kill", "--no-new-privs"]


def health(port):
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as reply:
            return reply.status
    except OSError:
        return None


def status_of(pid):
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    return {k: v.strip() for k, v in fields.items()}


# socketcall(SYS_SOCKET, {AF_VSOCK, SOCK_STREAM, 0}) through the i386 ABI (int 0x80) from a 64-bit process: the
# family sits behind a pointer (in the low 4 GiB, MAP_32BIT), which no seccomp rule reads. "ok": a socket came back.
INT80 = r"""import ctypes, struct
libc = ctypes.CDLL(None)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
args = libc.mmap(None, 4096, 3, 0x22 | 0x40, -1, 0)
ctypes.memmove(args, struct.pack("<III", 40, 1, 0), 12)
code = b"\x53\xb8\x66\x00\x00\x00\xbb\x01\x00\x00\x00\xb9" + struct.pack("<I", args) + b"\xcd\x80\x5b\xc3"
page = libc.mmap(None, 4096, 7, 0x22, -1, 0)
ctypes.memmove(page, code, len(code))
print("ok" if ctypes.CFUNCTYPE(ctypes.c_int)(page)() >= 0 else "no")
"""
SYSCALLS = """import ctypes, errno, os, socket, subprocess, sys, threading
libc = ctypes.CDLL(None, use_errno=True)
def said(name, result):
    print(name, "ok" if result >= 0 else errno.errorcode[ctypes.get_errno()])
said("unshare", libc.unshare(0x10000000))  # CLONE_NEWUSER
said("keyctl", libc.syscall(250, 0, -3, 0))  # keyctl(KEYCTL_GET_KEYRING_ID, the session keyring), x86-64
libc.personality.argtypes = [ctypes.c_ulong]  # as C passes it: 0xffffffff zero-extended, not an int's -1
said("personality", libc.personality(0x0008))  # PER_LINUX32, which the unit's LockPersonality=yes refuses
said("personality query", libc.personality(0xFFFFFFFF))
for family in (40, 1, 2, 10, 16):  # AF_VSOCK, then the unit's AF_UNIX AF_INET AF_INET6 AF_NETLINK
    try:
        socket.socket(family, socket.SOCK_RAW if family == 16 else socket.SOCK_STREAM).close()
        print("socket", family, "ok")
    except OSError:
        print("socket", family, "no")
thread = threading.Thread(target=lambda: None)
thread.start()
thread.join()
print("thread ok")
pid = os.fork()
if pid == 0:
    os._exit(0)
print("fork", "ok" if os.waitpid(pid, 0)[1] == 0 else "no")
done = subprocess.run([sys.executable, "-c", INT80], capture_output=True, text=True)
print("socketcall", "ok" if done.stdout.strip() == "ok" else "no")
""".replace("INT80", repr(INT80))


def inside(podman, cid, user, code):
    """The lines code prints, run by python3 in the running container cid as user (an exec: the container's
    seccomp profile, capabilities and no_new_privs hold for it)."""
    who = pwd.getpwnam(user)
    exec_id = podman.api.exec_create(cid, ["python3", "-c", code], user=f"{who.pw_uid}:{who.pw_gid}")["Id"]
    return podman.api.exec_start(exec_id).decode().splitlines()


def serving(podman, write, tmp_path, child_user, proxy_port=None, base_env=None, state=None):
    """A config serving the fake engine from the tests' image, its state folder of its own (the containers' owner
    label): (state, env, owner, port, path). Behind the proxy the state folder is conftest.passable_state: the
    engine's socket is in it, and serve.user must pass it."""
    if state is None:
        state = tmp_path / "state"
        state.mkdir()
        state.chmod(0o755)
    env = dict(base_env or subprocess_env(), STATE_DIRECTORY=str(state))
    port = free_port()
    dist = fake_vllm_dist(tmp_path)
    proxy = f"  proxy: {{enabled: true, listen: '127.0.0.1:{proxy_port}', hold_s: 60}}\n" if proxy_port else ""
    path = write("gpuwarden.yaml", f"""poll_interval_s: 0.5
metrics:
  listen: 127.0.0.1:{free_port()}
gpu:
  backend: sim
  scenario: dgx-spark
serve:
  enabled: true
  profile: generic
  model: /fake/model
  command: [python3, /gw-harness/fakechild.py, --mode, drain]
  port: {port}
  user: {child_user}
  env: {{PYTHONPATH: /opt/fakevllm}}
  drain_s: 5
  startup_timeout_s: 120
  stop_timeout_s: 10
  liveness_interval_s: 1
  backoff_max_s: 1
  container:
    image: {podman.image()}
    socket: {podman.socket}
    mounts: [{ROOT / 'tests' / 'harness'}:/gw-harness, {dist}:/opt/fakevllm]
{proxy}""")
    return state, env, str(state), port, path


def test_a_container_engine_serves_is_back_after_a_crash_is_adopted_after_a_daemon_sigkill_and_leaves_nothing(
        podman, write, daemons, tmp_path, child_user):
    state, env, owner, port, path = serving(podman, write, tmp_path, child_user)
    # A stray an earlier run of this gpuwarden left under another name (an older serve.port): removed at the start.
    stray = podman.api.create_container(podman.image(), command=["sleep", "600"], name=f"gpuwarden-vllm-{port}-old",
                                        labels={LABEL_HOST: host_id(), LABEL_CHILD: "vllm", LABEL_OWNER: owner})["Id"]
    podman.api.start(stray)
    try:
        d = daemons(path, env=env, command=[*UNIT_CAPS, *gpuwarden_cmd()])
        d.wait_for("vLLM healthy after", timeout=180)
        assert "vLLM 0.32.0" in d.wait_for("in image " + podman.image(), timeout=5)  # read from the image
        d.wait_for(f"vLLM 0.32.0 accepts the flags (checked with python3 in {podman.image()})", timeout=1)
        d.wait_for(f"removed container {stray[:12]} (gpuwarden-vllm-{port}-old", timeout=60)
        (first,) = podman.labelled(LABEL_OWNER, owner)
        assert first["Names"] == [f"/gpuwarden-vllm-{port}"] and first["State"] == "running"
        assert health(port) == 200
        engine = status_of(podman.pid_of(first["Id"]))
        assert engine["Uid"].split()[0] == str(pwd.getpwnam(child_user).pw_uid)
        assert engine["CapEff"] == engine["CapPrm"] == "0000000000000000" and engine["NoNewPrivs"] == "1"
        # The unit's system-call rules hold inside (serving/compose/sandbox.py): no namespace, no keyring, no
        # AF_VSOCK for the engine's user; threads, fork and the unit's socket families work.
        assert engine["Seccomp"] == "2"
        assert inside(podman, first["Id"], child_user, SYSCALLS) == ["unshare EPERM", "keyctl EPERM",
                                                                     "personality ENOSYS", "personality query ok",
                                                                     "socket 40 no",
                                                                     "socket 1 ok", "socket 2 ok", "socket 10 ok",
                                                                     "socket 16 ok", "thread ok", "fork ok",
                                                                     "socketcall no"]
        shim = int(d.wait_for("vLLM starting (pid", timeout=1).split("(pid ")[1].split(",")[0])
        assert status_of(shim)["CapEff"] == "0000000000000000" and status_of(shim)["Uid"].split()[0] == "0"
        assert "--shutdown-timeout" in " ".join(json.loads(Path(f"/proc/{shim}/cmdline").read_bytes()
                                                          .split(b"\0")[-2])["argv"])  # the drain, as for a process

        # The engine inside dies: the container ends, the shim with it, and after the backoff a new container serves.
        mark = len(d.lines)
        os.kill(podman.pid_of(first["Id"]), signal.SIGKILL)
        d.wait_for("vLLM exited", after=mark, timeout=60)
        d.wait_for("vLLM restarts in", after=mark, timeout=30)
        d.wait_for("vLLM healthy after", after=mark, timeout=180)
        (second,) = podman.labelled(LABEL_OWNER, owner)
        assert second["Id"] != first["Id"] and health(port) == 200

        # The daemon is SIGKILLed: the container serves on, and the next daemon adopts the same one.
        d.proc.kill()
        d.proc.wait(10)
        assert health(port) == 200
        d2 = daemons(path, env=env, command=[*UNIT_CAPS, *gpuwarden_cmd()])
        d2.wait_for("adopted after a restart of the daemon", timeout=60)
        (same,) = podman.labelled(LABEL_OWNER, owner)
        assert same["Id"] == second["Id"] and same["State"] == "running" and health(port) == 200, \
            (same["State"], "\n".join(d2.lines[-30:]))
        time.sleep(3)  # a few polls: the adopted engine stays (attacker 12's F1: it was replaced at once)
        assert "vLLM starting (pid" not in "\n".join(d2.lines) and "replacing it" not in "\n".join(d2.lines)
        (same,) = podman.labelled(LABEL_OWNER, owner)
        assert same["Id"] == second["Id"] and same["State"] == "running"

        # A reload to an image the runtime does not have, or a mount that does not exist, is refused before anything
        # stops (attacker 12's F5: a typo stopped the healthy container and ended FATAL); so is one to flags the
        # image's own parser refuses (the engine's flag check, run in a container of the image).
        original = path.read_text()
        for edit, said in ((original.replace(f"image: {podman.image()}", "image: localhost/no-such-image:1"),
                            "podman has no image localhost/no-such-image:1"),
                           (original.replace("/opt/fakevllm]", "/opt/fakevllm, /nonexistent/hf:/hf]"),
                            "/nonexistent/hf does not exist"),
                           (original.replace("  drain_s: 5\n", "  args: [--no-such-flag]\n  drain_s: 5\n"),
                            "serve.args: vLLM rejects the flags: unrecognized arguments: --no-such-flag")):
            path.write_text(edit)
            mark = len(d2.lines)
            d2.proc.send_signal(signal.SIGHUP)
            assert said in d2.wait_for("reload failed, still running the previous config", after=mark, timeout=120)
            (same,) = podman.labelled(LABEL_OWNER, owner)
            assert same["Id"] == second["Id"] and same["State"] == "running" and health(port) == 200
        path.write_text(original)

        # The stop: the engine drains through the runtime's stop, and no container of this gpuwarden is left.
        assert d2.stop() == 0
        assert "vLLM drained in" in "\n".join(d2.lines)
        assert podman.labelled(LABEL_OWNER, owner) == []
        assert "Traceback" not in "\n".join(d.lines + d2.lines)

        # What a stop left (a shim killed at its stop timeout): the unit's ExecStopPost removes it.
        left = podman.api.create_container(podman.image(), command=["sleep", "600"], name=f"gpuwarden-vllm-{port}",
                                           labels={LABEL_HOST: host_id(), LABEL_CHILD: "vllm",
                                                   LABEL_OWNER: owner})["Id"]
        stop = subprocess.run([*gpuwarden_cmd(), "cleanup", "-c", str(path)], env=dict(env, SERVICE_RESULT="success"),
                              capture_output=True, text=True, timeout=60)
        assert stop.returncode == 0 and f"removed container {left[:12]} (gpuwarden-vllm-{port}" in stop.stdout, stop
        assert podman.labelled(LABEL_OWNER, owner) == []
    finally:
        podman.remove_labelled(LABEL_OWNER, owner)


def test_a_reload_that_changes_the_image_drains_the_old_container_and_fails_no_request_through_the_proxy(
        podman, write, daemons, tmp_path, child_user, proxy_daemon, passable_state):
    """The reload's restart of a process engine, for a container: the proxy is told first and holds new requests,
    the old container drains those in flight (the runtime's stop, with the drain's timeout), the new image's
    container serves the held ones; a steady client through the proxy sees no failed request. The engine listens on
    its Unix socket, not on TCP, as a process engine behind the proxy does."""
    from test_planned_restart import Clients

    second = podman.image() + "-again"
    assert podman.cli("tag", podman.image(), second).returncode == 0
    proxy_port = free_port()
    command, base_env = proxy_daemon
    state, env, owner, port, path = serving(podman, write, tmp_path, child_user, proxy_port, base_env,
                                            passable_state)
    try:
        d = daemons(path, env=env, command=[*UNIT_CAPS, *command])
        d.wait_for("vLLM healthy after", timeout=180)
        d.wait_for("the proxy healthy after", timeout=60)
        (old,) = podman.labelled(LABEL_OWNER, owner)
        # behind the proxy the engine listens on its socket, mounted from the state directory, and on no TCP port:
        # no local user reaches it past the proxy's key
        socket_path = state / "engine" / f"{port}.sock"
        assert stat.S_ISSOCK(socket_path.stat().st_mode)
        assert port_free("127.0.0.1", port), "the container engine listens on TCP behind the proxy"
        slow = Clients(proxy_port)
        slow.stop()  # none: only its one() for the two in flight
        long = [threading.Thread(target=slow.one, args=(3,), daemon=True) for _ in range(2)]
        for thread in long:
            thread.start()
        steady = Clients(proxy_port)
        mark = len(d.lines)
        path.write_text(path.read_text().replace(f"image: {podman.image()}", f"image: {second}"))
        d.proc.send_signal(signal.SIGHUP)
        d.wait_for("proxy: the engine stops for a planned restart", after=mark, timeout=60)
        d.wait_for("vLLM drained in", after=mark, timeout=60)
        d.wait_for("vLLM healthy after", after=mark, timeout=180)
        d.wait_for("proxy: engine back after", after=mark, timeout=60)
        outcomes = steady.stop()
        for thread in long:
            thread.join(30)
        statuses = [status for status, _, _ in outcomes + slow.outcomes]
        assert statuses and set(statuses) == {200}, [o for o in outcomes + slow.outcomes if o[0] != 200][:5]
        assert len(slow.outcomes) == 2
        (new,) = podman.labelled(LABEL_OWNER, owner)
        assert new["Id"] != old["Id"], new

        # The same name, another image (a pull or a tag since the start), and a reload with the config unchanged:
        # the engine restarts on the new image, as a process engine does on a vLLM upgraded under it, and no request
        # fails through the proxy.
        retagged = podman.derived(tmp_path, "io.gpuwarden.test=retagged")
        assert podman.cli("tag", retagged, second).returncode == 0
        steady = Clients(proxy_port)
        mark = len(d.lines)
        d.proc.send_signal(signal.SIGHUP)
        said = d.wait_for(f"reload: {second} is now image sha256:{retagged.removeprefix('sha256:')[:12]}", after=mark,
                          timeout=120)
        assert "restarting it on the new image" in said
        d.wait_for("vLLM healthy after", after=mark, timeout=180)
        d.wait_for("proxy: engine back after", after=mark, timeout=60)
        outcomes = steady.stop()
        assert outcomes and {status for status, _, _ in outcomes} == {200}, [o for o in outcomes if o[0] != 200][:5]
        (third,) = podman.labelled(LABEL_OWNER, owner)
        image_of = podman.api.inspect_container(third["Id"])["Image"]
        assert third["Id"] != new["Id"] and image_of.removeprefix("sha256:") == retagged.removeprefix("sha256:")
        mark = len(d.lines)
        d.proc.send_signal(signal.SIGHUP)  # nothing changed since: no restart
        d.wait_for("config reloaded from", after=mark, timeout=60)
        time.sleep(2)
        assert [c["Id"] for c in podman.labelled(LABEL_OWNER, owner)] == [third["Id"]]
        assert d.stop() == 0
        assert podman.labelled(LABEL_OWNER, owner) == []
    finally:
        podman.remove_labelled(LABEL_OWNER, owner)
        podman.cli("untag", second)


@pytest.mark.parametrize("edit, said", [
    (lambda text, podman: text.replace("/opt/fakevllm]", "/opt/fakevllm, /nonexistent/hf:/hf]"),
     "serve.container.mounts.2: /nonexistent/hf does not exist"),
    (lambda text, podman: text.replace(f"socket: {podman.socket}", "socket: /run/nothing-here.sock"),
     "serve.container.image: podman's API socket /run/nothing-here.sock: No such file or directory"),
    (lambda text, podman: text.replace(f"image: {podman.image()}", "image: localhost/no-such-image:1"),
     "serve.container.image: podman has no image localhost/no-such-image:1"),
    (lambda text, podman: text.replace("env: {PYTHONPATH: /opt/fakevllm}", "env: {}"),
     f"serve.container.image: {IMAGE} has no vllm for its python3"),
    (lambda text, podman: text.replace("  drain_s: 5\n", "  args: [--no-such-flag]\n  drain_s: 5\n"),
     "serve.args: vLLM rejects the flags: unrecognized arguments: --no-such-flag"),
    (lambda text, podman: text.replace("  container:\n", "  container:\n    runtime: docker\n"),  # attacker 19's F1
     "is podman's API (serve.container.runtime says docker): set runtime: podman"),
], ids=["mount", "socket", "image", "engine", "flags", "docker-on-podman"])
def test_check_says_what_a_container_engine_lacks_or_its_images_parser_refuses_in_one_line_with_exit_78(
        podman, write, tmp_path, child_user, edit, said):
    _, env, owner, _, path = serving(podman, write, tmp_path, child_user)
    path.write_text(edit(path.read_text(), podman))
    done = subprocess.run([*UNIT_CAPS, *gpuwarden_cmd(), "check", "--deep", "-c", str(path)], env=env,
                          capture_output=True, text=True, timeout=300)
    errors = [line for line in done.stderr.splitlines() if said.split(":")[0] in line]
    assert done.returncode == 78 and len(errors) == 1 and said in errors[0], (said, done.stdout, done.stderr)
    assert "Traceback" not in done.stderr and podman.labelled(LABEL_OWNER, owner) == []  # the probe's removed
