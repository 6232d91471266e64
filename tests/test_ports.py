"""Whose port it is: only the listeners that take the child's own address count (issue 35, finding 1).

A local user may listen on the child's port number on another address (127.0.0.2:P beside 127.0.0.1:P, or
[::1]:P with IPV6_V6ONLY beside 0.0.0.0:P). Under the unit the daemon has no CAP_SYS_PTRACE, so it judges a
listener by its owner uid alone: such a listener, counted, made every liveness probe fail and the engine FATAL.
"""

import json
import os
import pwd
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest

from conftest import free_port, gpuwarden_cmd, subprocess_env
from gpuwarden.config import parse_text
from gpuwarden.gpu.sim.backend import ManualClock
from gpuwarden.proxy.child import proxy_spec
from gpuwarden.serving.compose.identity import Identity
from gpuwarden.serving.run import ports
from gpuwarden.serving.run.supervisor import RUNNING, Program
from test_faults import fake, fault_config, no_fakes_left, status  # noqa: F401 (fixtures)
from test_serving import FakeOps, running_supervisor

HEADER = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n"
ROW = "   {n}: {local}:{port:04X} {remote} 0A 00000000:00000000 00:00000000 00000000  {uid}  0 {inode} 1\n"
V4 = {"127.0.0.1": "0100007F", "127.0.0.2": "0200007F", "0.0.0.0": "00000000"}
V6 = {"::1": "00000000000000000000000001000000", "::": "00000000000000000000000000000000",
      "::ffff:127.0.0.1": "0000000000000000FFFF00000100007F"}
UNIT_CAPS = ["setpriv", "--bounding-set", "-all,+sys_admin,+setuid,+setgid,+kill", "--no-new-privs"]
NOBODY = 65534


def tables(tmp_path, port, v4=(), v6=()):
    """A fake /proc with listeners (address, uid, inode) on port in net/tcp and net/tcp6."""
    (tmp_path / "net").mkdir(exist_ok=True)
    for name, rows, hexed in (("tcp", v4, V4), ("tcp6", v6, V6)):
        remote = "0" * len(next(iter(hexed.values()))) + ":0000"
        (tmp_path / "net" / name).write_text(HEADER + "".join(
            ROW.format(n=n, local=hexed[address], port=port, remote=remote, uid=uid, inode=inode)
            for n, (address, uid, inode) in enumerate(rows)))
    return str(tmp_path)


def test_a_listener_on_another_address_of_the_port_is_not_the_childs(tmp_path):
    proc = tables(tmp_path, 8123, v4=[("127.0.0.1", 0, 10), ("127.0.0.2", NOBODY, 11)],
                  v6=[("::1", NOBODY, 12), ("::", NOBODY, 13)])
    assert ports.listening_sockets(8123, proc, host="127.0.0.1") == {10: 0}
    assert ports.listening_sockets(8123, proc, host="::1") == {12: NOBODY, 13: NOBODY}
    assert ports.listening_sockets(8123, proc) == {10: 0, 11: NOBODY, 12: NOBODY, 13: NOBODY}  # no host: all
    # the error line names only the listeners that take the host's connections
    assert ports.who_listens(8123, proc, host="127.0.0.1") == "a process of user root"


def test_beside_a_wildcard_ipv4_listener_an_ipv6_only_one_is_not_the_childs(tmp_path):
    # [::1]:P with IPV6_V6ONLY may be bound beside 0.0.0.0:P, and so may [::]:P: neither takes IPv4
    proc = tables(tmp_path, 8123, v4=[("0.0.0.0", 0, 10)], v6=[("::1", NOBODY, 12), ("::", NOBODY, 13)])
    assert ports.listening_sockets(8123, proc, host="0.0.0.0") == {10: 0}


def test_the_wildcard_of_the_hosts_family_and_a_v4_mapped_address_are_the_hosts(tmp_path):
    # A squatter on the wildcard takes the host's connections: it still counts, and owns_port refuses it.
    proc = tables(tmp_path, 8123, v4=[("0.0.0.0", NOBODY, 10)], v6=[("::ffff:127.0.0.1", 0, 11)])
    assert ports.listening_sockets(8123, proc, host="127.0.0.1") == {10: NOBODY, 11: 0}
    assert ports.who_listens(8123, proc, host="127.0.0.1") == "a process of user root, a process of user nobody"


def test_a_host_is_matched_as_the_kernels_table_writes_it():
    assert ports.covering("127.1") == {"127.0.0.1", "0.0.0.0"}
    assert ports.covering("::ffff:127.0.0.1") == {"127.0.0.1", "0.0.0.0"}
    assert ports.covering("fe80::1%lo") == {"fe80::1", "::"}
    assert ports.covering("0:0::1") == {"::1", "::"}
    assert ports.covering("localhost") >= {"127.0.0.1", "0.0.0.0"}  # a name: every address it resolves to


# -- real sockets, the daemon's check run under the unit's capabilities ------------------------------------

def needs_root_and_setpriv():
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root (to start listeners as other users) and setpriv")


def listen_as(user, host, port, v6only=False):
    """A real listener on host:port held by a process of user (it ends when its stdin closes)."""
    code = ("import socket, sys\n"
            f"s = socket.socket(socket.AF_INET6 if ':' in {host!r} else socket.AF_INET)\n"
            f"if {v6only}: s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)\n"
            f"s.bind(({host!r}, {port})); s.listen()\n"
            "print('listening', flush=True); sys.stdin.read()\n")
    entry = pwd.getpwnam(user)
    proc = subprocess.Popen(["/usr/bin/python3", "-c", code], user=entry.pw_uid, group=entry.pw_gid,
                            extra_groups=[], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd="/")
    assert proc.stdout.readline() == "listening\n", f"{user} could not listen on {host}:{port}"
    return proc


def ended(*procs):
    for proc in procs:
        proc.stdin.close()
        proc.wait(10)


def check_under_the_unit(host, port, pid, uid):
    """owns_port and who_listens as the daemon runs them under the unit (no CAP_SYS_PTRACE), and whether the
    holder's /proc/PID/fd was unreadable there (ports.Unseen: the path that judges by uid alone)."""
    code = ("import json, sys\n"
            "from gpuwarden.serving.run import ports\n"
            "from gpuwarden.serving.run.processes import ProcessOps\n"
            f"host, port, pid, uid = {host!r}, {port}, {pid}, {uid}\n"
            "try:\n"
            "    ports.holders(set(ports.listening_sockets(port, host=host)), [pid]); unseen = False\n"
            "except ports.Unseen:\n"
            "    unseen = True\n"
            "ops = ProcessOps()\n"
            "print(json.dumps([ops.owns_port(host, port, [pid], uid), ops.who_listens(host, port), unseen]))\n")
    out = subprocess.run([*UNIT_CAPS, sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env=subprocess_env())
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


@pytest.mark.process
@pytest.mark.parametrize("ours, theirs, v6only", [("127.0.0.1", "127.0.0.2", False), ("0.0.0.0", "::1", True),
                                                  ("127.0.0.1", "::", True), ("::1", "127.0.0.1", False)])
def test_a_local_users_listener_on_another_address_leaves_the_port_ours_under_the_unit(child_user, ours, theirs,
                                                                                       v6only):
    needs_root_and_setpriv()
    port = free_port()
    child = listen_as(child_user, ours, port)
    try:
        squatter = listen_as("nobody", theirs, port, v6only)
        try:
            owned, who, unseen = check_under_the_unit(ours, port, child.pid, pwd.getpwnam(child_user).pw_uid)
        finally:
            ended(squatter)
    finally:
        ended(child)
    assert unseen, "the check must run where the child's fds cannot be read, as under the unit"
    assert owned, f"{theirs}:{port} of user nobody was taken for a listener on {ours}:{port}"
    assert who == f"a process of user {child_user}"


@pytest.mark.process
def test_a_local_user_on_the_wildcard_that_takes_the_childs_address_is_still_refused(child_user):
    needs_root_and_setpriv()
    port = free_port()
    child = listen_as(child_user, "127.0.0.1", free_port())  # ours, elsewhere: the squatter holds the port
    squatter = listen_as("nobody", "0.0.0.0", port)
    try:
        owned, who, unseen = check_under_the_unit("127.0.0.1", port, child.pid, pwd.getpwnam(child_user).pw_uid)
    finally:
        ended(squatter, child)
    assert unseen and not owned and who == "a process of user nobody"


# -- the daemon under the unit, the engine and the proxy beside a squatter on another address ---------------

@pytest.mark.parametrize("title", ["vLLM", "the proxy"])
def test_the_child_starts_and_stays_up_beside_a_squatter_on_another_address(write, fake, child_user, title,
                                                                            no_fakes_left):
    """The issue's reproduction, with the daemon under the unit's capabilities: the squatter listens on
    127.0.0.2 at the child's port before the daemon starts (the start's own /health check then meets it) and
    through the liveness probes that follow."""
    needs_root_and_setpriv()
    proxy = title == "the proxy"
    if proxy and subprocess.run(["runuser", "-u", child_user, "--", sys.executable, "-c", ""]).returncode:
        pytest.skip(f"{child_user} cannot run {sys.executable}, which the proxy runs on")
    port, proxy_port = free_port(), free_port()
    squatters = [listen_as("nobody", "127.0.0.2", proxy_port if proxy else port)]
    extra = f"  proxy:\n    enabled: true\n    listen: 127.0.0.1:{proxy_port}\n" if proxy else ""
    path, base, _ = fault_config(write, fake, "healthy", port=port, extra=extra)
    daemon = subprocess.Popen([*UNIT_CAPS, *gpuwarden_cmd(), "run", "-c", str(path)], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, env=subprocess_env())
    lines = []
    reader = threading.Thread(target=lambda: lines.extend(daemon.stdout), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not any(f"{title} healthy after" in x for x in lines):
            assert daemon.poll() is None and "not trusted" not in "".join(lines), "".join(lines)
            time.sleep(0.05)
        # One more squatter while it runs, then three liveness probes (3 failures ended the child), counted in
        # /status; the test then looks for the failures squatters caused.
        squatters.append(listen_as("nobody", "127.0.0.3", proxy_port if proxy else port))
        first = probes(base, title)
        deadline = time.monotonic() + 60
        while probes(base, title) < first + 3:
            assert time.monotonic() < deadline and daemon.poll() is None, "".join(lines)
            time.sleep(0.05)
        assert status(base)["serving"]["state"] == "RUNNING", "".join(lines)
    finally:
        daemon.send_signal(signal.SIGTERM)
        daemon.wait(30)
        reader.join(5)
        ended(*squatters)
    log = "".join(lines)
    assert log.count(f"{title} healthy after") == 1, log
    assert "liveness probe failed" not in log and "not by" not in log and "restarts in" not in log, log


def probes(base, title):
    """The liveness probes the child named title has had answered since it last turned RUNNING (/status)."""
    return next(c["probes"] for c in status(base)["children"] if c["title"] == title)


# -- the supervisor asks about the child's own address: the engine's and the proxy's ---------------------------

def test_the_proxy_and_the_engine_are_judged_on_their_own_address():
    sup, ops, _ = running_supervisor()
    assert ops.owner_asked == ("127.0.0.1", 8123)
    cfg = parse_text("serve:\n  model: /m\n  host: 0.0.0.0\n  proxy: {enabled: true, listen: '[::1]:9001'}\n",
                     "g.yaml")
    me = pwd.getpwuid(os.geteuid())
    clock = ManualClock(100)
    ops = FakeOps(clock)
    ops.health_ok = True
    proxy = Program(proxy_spec(cfg, Identity(me.pw_name, me.pw_uid, me.pw_gid, me.pw_dir, (), False)), ops=ops,
                    clock=clock)
    proxy.start(clock.now)
    proxy.tick(clock.now)
    assert proxy.state == RUNNING and ops.owner_asked == ("::1", 9001)
