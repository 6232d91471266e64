"""The metrics port is never let go between two daemons: a handover (SIGUSR2, re-exec) passes the listening socket
across the exec as an inherited fd, and systemd's fd store (FDNAME=metrics) holds it across a crash restart, so a
local user looping bind() on the port cannot take it in between and keep the daemon from starting. Real processes:
the daemon (simulated GPUs) and a squatter running as `nobody`."""

import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from conftest import DaemonProcess, free_port, gpuwarden_cmd, subprocess_env
from test_faults import FLAGCHECK, fake, fault_config, no_fakes_left  # noqa: F401 (fixtures)


O_CLOEXEC = 0o2000000  # as /proc/PID/fdinfo shows the flags (octal)
SQUATTER = """
import socket, sys, time
host, port = sys.argv[1], int(sys.argv[2])
print("trying", flush=True)
while True:  # without SO_REUSEADDR, as an attacker's plain bind()
    s = socket.socket()
    try:
        s.bind((host, port))
    except OSError:
        s.close()
        time.sleep(0.0005)
        continue
    s.listen()
    print("bound", flush=True)
    time.sleep(3600)
"""


def config(write, port):
    return write("gpuwarden.yaml", f"poll_interval_s: 0.5\nmetrics:\n  listen: 127.0.0.1:{port}\n")


def get_metrics(port):
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
        return reply.status


def listening_inodes(port):
    """The inodes of the sockets listening on port (any address), from /proc/net/tcp{,6}."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                found.append(int(fields[9]))
    return found


def fds_of_socket(pid, inode):
    """pid's fds that are the socket inode, each with its close-on-exec flag."""
    found = {}
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}") == f"socket:[{inode}]":
                flags = next(line for line in Path(f"/proc/{pid}/fdinfo/{fd}").read_text().splitlines()
                             if line.startswith("flags:"))
                found[int(fd)] = bool(int(flags.split()[1], 8) & O_CLOEXEC)
        except OSError:  # an fd that closed meanwhile
            pass
    return found


@pytest.fixture
def squatter():
    """A local user (nobody) looping bind() on a port, as the attacker did; stopped at the end."""
    started = []

    def _start(port):
        proc = subprocess.Popen(["setpriv", "--reuid", "nobody", "--regid", "nogroup", "--clear-groups",
                                 "/usr/bin/python3", "-c", SQUATTER, "127.0.0.1", str(port)],
                                stdout=subprocess.PIPE, text=True)
        started.append(proc)
        assert proc.stdout.readline() == "trying\n"  # its loop runs from here on
        return proc

    yield _start
    for proc in started:
        proc.kill()
        proc.wait(10)


@pytest.mark.process
def test_a_handover_keeps_the_metrics_port_from_a_local_user_looping_bind(write, daemons, squatter):
    port = free_port()
    d = daemons(config(write, port), "--sim", "lock-lost")
    d.wait_for("serving /metrics and /status on", timeout=30)
    before = listening_inodes(port)
    assert len(before) == 1 and get_metrics(port) == 200
    attacker = squatter(port)
    mark = len(d.lines)
    d.proc.send_signal(signal.SIGUSR2)
    d.wait_for("SIGUSR2: handing over to the installed gpuwarden", after=mark, timeout=10)
    d.wait_for("serving /metrics and /status on", after=mark, timeout=30)
    assert get_metrics(port) == 200
    assert d.proc.poll() is None, "the same process serves on"
    assert "cannot serve metrics" not in d.log
    # The very socket crossed the exec: never closed, so there was no moment to bind in.
    assert listening_inodes(port) == before
    # Taken back as close-on-exec: nothing the new image starts inherits it.
    assert list(fds_of_socket(d.proc.pid, before[0]).values()) == [True]
    attacker.kill()
    assert "bound" not in attacker.communicate(timeout=10)[0]
    assert d.stop() == 0


class StoredDaemon(DaemonProcess):
    """`gpuwarden run` as systemd starts it after a crash: the fd store's fds from fd 3 on, named in LISTEN_FDNAMES,
    LISTEN_PID its own pid (a small exec wrapper sets it and puts the fds at 3, 4, ...). sock: the socket stored as
    metrics, or {name: fd} of every fd stored, in order."""

    WRAPPER = """
import fcntl, os, sys
fds = [int(fd) for fd in sys.argv[1].split(",")]
high = [fcntl.fcntl(fd, fcntl.F_DUPFD, 100) for fd in fds]  # out of the way of 3, 4, ...
for fd in fds:
    os.close(fd)
for n, fd in enumerate(high):
    os.dup2(fd, 3 + n)
    os.close(fd)
os.environ["LISTEN_PID"] = str(os.getpid())
os.execv(sys.executable, [sys.executable, *sys.argv[2:]])
"""

    def __init__(self, config_path, sock, notify_path, args=("--sim", "lock-lost"), command=None, env=None):
        self.lines = []
        fds = sock if isinstance(sock, dict) else {"metrics": sock.fileno()}
        command = command or gpuwarden_cmd()  # an interpreter and its arguments
        env = dict(env or subprocess_env(), LISTEN_FDS=str(len(fds)), LISTEN_FDNAMES=":".join(fds),
                   NOTIFY_SOCKET=notify_path)
        self.proc = subprocess.Popen([command[0], "-c", self.WRAPPER, ",".join(map(str, fds.values())),
                                      *command[1:], "run", "-c", str(config_path), *args],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                     pass_fds=tuple(fds.values()))
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()


def stored(notify):
    """The next FDSTORE message (its text, and the inode of the fd it carries), skipping the others."""
    while True:
        data, fds, _, _ = socket.recv_fds(notify, 4096, 4)
        inode = os.fstat(fds[0]).st_ino if fds else None
        for fd in fds:
            os.close(fd)
        if data.startswith(b"FDSTORE"):
            return data.decode(), inode


@pytest.fixture
def notify(tmp_path):
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(tmp_path / "notify.sock"))
    sock.settimeout(30)
    yield sock
    sock.close()


@pytest.mark.process
def test_a_restart_takes_the_metrics_socket_back_from_the_fd_store(write, tmp_path, notify):
    port = free_port()
    held = socket.create_server(("127.0.0.1", port))  # what the fd store kept of the daemon before
    inode = os.fstat(held.fileno()).st_ino
    d = StoredDaemon(config(write, port), held, notify.getsockname())
    try:
        d.wait_for("serving /metrics and /status on", timeout=30)
        assert get_metrics(port) == 200 and listening_inodes(port) == [inode]
        assert list(fds_of_socket(d.proc.pid, inode).values()) == [True]
        assert stored(notify) == ("FDSTORE=1\nFDNAME=metrics", inode)  # kept there for the restart after this one
        assert "cannot serve metrics" not in d.log
        d.stop()
        assert stored(notify) == ("FDSTOREREMOVE=1\nFDNAME=metrics", None)  # a stop: nothing to take back
    finally:
        d.stop(signal.SIGKILL)
        held.close()


@pytest.mark.process
def test_a_stored_metrics_socket_on_another_address_is_closed_and_the_port_bound_anew(write, tmp_path, notify):
    port = free_port()
    stale = socket.create_server(("127.0.0.1", 0))  # metrics.listen changed since it was stored
    inode = os.fstat(stale.fileno()).st_ino
    d = StoredDaemon(config(write, port), stale, notify.getsockname())
    try:
        d.wait_for("serving /metrics and /status on", timeout=30)
        assert get_metrics(port) == 200
        assert fds_of_socket(d.proc.pid, inode) == {}, "the stale socket is closed, not kept or leaked"
        assert stored(notify) == ("FDSTOREREMOVE=1\nFDNAME=metrics", None)  # systemd's copy of it goes too
        text, new = stored(notify)
        assert text == "FDSTORE=1\nFDNAME=metrics" and listening_inodes(port) == [new]
    finally:
        d.stop(signal.SIGKILL)
        stale.close()


# The engine's interpreter as the start's check runs it (installed versions, flag check): the first run waits
# until the test has looked at the daemon, then answers as tests/harness/fakechild-flagcheck does.
WAITING_PROBE = """#!/bin/sh
if mkdir {folder}/once 2>/dev/null; then
    exec 3<> {folder}/go  # open before saying so: the test's release finds a reader (bounded, if it never comes)
    echo checking > {folder}/at-check
    timeout 120 head -c 1 <&3 > /dev/null
fi
echo 'GPUWARDEN-FLAGCHECK {{"ok": true, "error": null, "version": "0.0.0+fake"}}'
"""


@pytest.mark.process
def test_the_passed_on_metrics_socket_is_close_on_exec_before_the_start_runs_the_engines_interpreter(
        write, tmp_path, notify, fake, no_fakes_left):
    """A crash restart (the fd store's socket at fd 3, inheritable as systemd passes it): the socket is taken,
    close-on-exec, before the check starts anything, so no process the check runs could inherit the port."""
    folder = Path(tempfile.mkdtemp(prefix="gpuwarden-probe-"))
    try:
        folder.chmod(0o777)  # serve.user runs the probe there
        for fifo in ("at-check", "go"):
            os.mkfifo(folder / fifo, 0o666)
            (folder / fifo).chmod(0o666)
        (folder / "python").write_text(WAITING_PROBE.format(folder=folder))
        (folder / "python").chmod(0o755)
        path, base, _ = fault_config(write, fake, "healthy")
        path.write_text(path.read_text().replace(str(FLAGCHECK), str(folder / "python")))
        port = int(base.rsplit(":", 1)[1])
        held = socket.create_server(("127.0.0.1", port))  # what the fd store kept of the daemon before
        inode = os.fstat(held.fileno()).st_ino
        d = StoredDaemon(path, held, notify.getsockname(), args=())
        held.close()  # the daemon's copy only: it alone holds the port from here on
        at_check = os.open(folder / "at-check", os.O_RDONLY | os.O_NONBLOCK)  # no wait for a writer
        try:
            assert select.select([at_check], [], [], 60)[0], "the check never ran the engine's interpreter"
            assert os.read(at_check, 64) == b"checking\n"  # the probe runs: the check is under way
            assert list(fds_of_socket(d.proc.pid, inode).values()) == [True], "close-on-exec during the check"
            release(folder / "go")
            d.wait_for("serving /metrics and /status on", timeout=60)
            assert get_metrics(port) == 200 and listening_inodes(port) == [inode]
            assert d.stop() == 0
        finally:
            os.close(at_check)
            release(folder / "go")  # a probe still waiting (a failed assertion) ends too
            d.stop(signal.SIGKILL)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def release(fifo):
    """Let a probe waiting on fifo go; nothing when none waits there."""
    try:
        fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
    except OSError:  # ENXIO: no reader
        return
    os.write(fd, b"go\n")
    os.close(fd)


def test_a_start_whose_check_refuses_the_config_closes_the_passed_on_metrics_socket(monkeypatch):
    """The listener is taken before the check; a check that raises still leaves nothing open (run's finish)."""
    from gpuwarden import config
    from gpuwarden.backends import open_configured
    from gpuwarden.service.daemon import Daemon, run
    from gpuwarden.service.metrics_port import METRICS_FD_ENV
    from gpuwarden.base.yamlfile import InvalidConfig

    port = free_port()
    passed = socket.create_server(("127.0.0.1", port))
    monkeypatch.setenv(METRICS_FD_ENV, str(passed.detach()))  # as a handover passes it across the exec
    monkeypatch.delenv("GPUWARDEN_HANDOVER", raising=False)
    cfg = config.parse_text("gpu:\n  backend: sim\n  scenario: dgx-spark\ntuning:\n  apply: false\n"
                            f"metrics:\n  listen: 127.0.0.1:{port}\n"
                            "serve:\n  enabled: true\n  model: /fake/model\n  user: gpuwarden-no-such-user\n")
    daemon = Daemon(cfg, open_configured(cfg))
    try:
        with pytest.raises(InvalidConfig, match="gpuwarden-no-such-user"):
            run(daemon)
    finally:
        daemon.backend.close()
    assert METRICS_FD_ENV not in os.environ
    assert daemon.server is None
    with pytest.raises(ConnectionRefusedError):  # the listener is closed: nothing listens on the port any more
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
