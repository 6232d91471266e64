"""The proxy's port is never free (the restart window): the daemon binds the proxy's listener once and keeps it for its
life (base/keptlistener.py), passing it to each proxy it starts as an inherited fd; a handover carries it across the
exec, and after a crash systemd's fd store gives it back (FDNAME=proxy). Before, a local user looping bind() took the
port while the proxy restarted and read every client's request, API key included.

Each test of a proxy's restart opens the gap on purpose and holds it still: the daemon is stopped (SIGSTOP) once its
proxy is gone and before the next is started, so that what the gap is (the daemon alone holds the socket) is checked,
not hoped for.
In it, another uid's bind fails and a client's connection waits in the backlog; then the daemon goes on, starts the
next proxy on the same socket, and that proxy answers the waiting client. A squatter of another uid loops on bind()
over the whole test (tests/harness/squatter.py) and never gets the port. Real processes: the daemon on the simulator,
its proxy (as serve.user), the fake engine, the squatters."""

import http.client
import json
import os
import pwd
import re
import signal
import socket
import subprocess
import threading
import time

import pytest

from gpuwarden.serving.run import handover
from conftest import free_port
from gpuwarden.base import sockowner
from gpuwarden.serving.run import ports
from test_engine_owner import squatters  # noqa: F401 (fixture)
from test_faults import fake, no_fakes_left  # noqa: F401 (fixtures)
from test_metrics_listener import StoredDaemon, config, fds_of_socket, listening_inodes
from test_query_of_death import CHAT, SECRET, Call, served_config

# One bind of HOST:PORT by another uid, as an attacker would try it: with SO_REUSEADDR, then with SO_REUSEPORT too.
BIND_ONCE = """
import errno, socket, sys
for reuseport in (0, 1):
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, reuseport)
    try:
        s.bind((sys.argv[1], int(sys.argv[2])))
        print("BOUND")
    except OSError as exc:
        print(errno.errorcode.get(exc.errno, exc.errno))
    s.close()
"""
PROXY_LINE = re.compile(r"the proxy (?:starting \(pid|adopted after [^:]*: pid) (\d+)")


def bind_as_nobody(port):
    """What each bind of 127.0.0.1:port by user nobody got (BIND_ONCE): an errno name, or BOUND."""
    done = subprocess.run(["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", "/usr/bin/python3",
                           "-c", BIND_ONCE, "127.0.0.1", str(port)], capture_output=True, text=True, timeout=60)
    return done.stdout.split() or [done.stderr]


def holders(inode):
    """The processes that have the socket open, but for this one (its copies from the notify socket stand for what
    systemd's store holds)."""
    return set(ports.holders({inode})) - {os.getpid()}


def proxy_pid(d, after=0):
    """The pid of the proxy the daemon started or adopted last, from its log (from index after on)."""
    pids = [int(m.group(1)) for line in d.lines[after:] if (m := PROXY_LINE.search(line))]
    assert pids, d.log
    return pids[-1]


def until(predicate, what, within_s=60):
    """Wait for predicate (a bound for a hang, not a speed)."""
    deadline = time.monotonic() + within_s
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.005)


class Waiting:
    """A client that connects while no proxy runs: the connection is taken into the kept socket's backlog (a free
    port would refuse it) and its request, with an API key, is sent at once; the next proxy answers it."""

    def __init__(self, port):
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        self.conn.connect()  # ConnectionRefusedError here: nothing listened
        body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "fine, thanks"}]})
        self.conn.request("POST", CHAT, body=body, headers={"Authorization": f"Bearer {SECRET}",
                                                           "Content-Type": "application/json"})

    def answer(self):
        reply = self.conn.getresponse()
        status, data = reply.status, reply.read()
        self.conn.close()
        return status, data


def in_the_gap(d, inode, port):
    """The daemon is stopped (SIGSTOP) with no proxy running: it alone holds the socket, another uid cannot bind
    the port either way, and a client's connection waits in the backlog."""
    assert holders(inode) == {d.proc.pid}, "no proxy holds the socket, the daemon does"
    assert bind_as_nobody(port) == ["EADDRINUSE", "EADDRINUSE"]
    client = Waiting(port)
    assert holders(inode) == {d.proc.pid}, "still the gap: no proxy took the socket meanwhile"
    return client


def kill_in_the_gap(d, inode, port):
    """SIGKILL the proxy with the daemon stopped, so that the gap stays open while in_the_gap looks at it; the
    daemon then goes on, and restarts the proxy. Returns (the killed pid, the client that waits)."""
    old = proxy_pid(d)
    d.proc.send_signal(signal.SIGSTOP)
    try:
        os.kill(old, signal.SIGKILL)
        until(lambda: old not in holders(inode), "the killed proxy still holds the socket")  # a zombie holds none
        client = in_the_gap(d, inode, port)
    finally:
        d.proc.send_signal(signal.SIGCONT)
    return old, client


def served_again(d, inode, port, old, client, after):
    """After a gap: the next proxy (another pid) serves on the very same socket, beside the daemon, and the client
    that waited in the gap gets the engine's answer through it."""
    started = d.wait_index("the proxy starting (pid", timeout=60, after=after)
    d.wait_for("the proxy healthy after", timeout=60, after=started)
    new = proxy_pid(d, after)
    status, data = client.answer()
    assert status == 200 and b'"fine"' in data, (status, data, d.log)
    assert new != old and holders(inode) == {d.proc.pid, new}
    assert listening_inodes(port) == [inode], "the same socket listens: never closed, never bound anew"
    status, _, data, error = Call(port, "fine, thanks").result()
    assert status == 200 and b'"fine"' in data, (status, data, error)
    # The daemon's probes of the proxy on its socket pass, the connection accepted yet or not (health.judge).
    assert "the proxy liveness probe failed" not in d.log, d.log
    return new


def squatter_never_got_it(squatter):
    """The squatter's loop ran throughout (still running, never bound), each bind refused as in use; it is ended
    here, before the daemon's stop lets the port go (and it would take it then)."""
    assert squatter.proc.poll() is None and not squatter.bound.is_set(), squatter.data
    squatter.stop()
    assert not squatter.bound.is_set() and squatter.refused == {"EADDRINUSE"} and squatter.data == b""


def behind_the_proxy(write, fake, daemons, proxy_daemon, **env):
    """The daemon serving the fake engine behind its proxy, healthy, an ordinary request answered through it:
    (the daemon, the config, the proxy's port, the inode of the one socket listening there)."""
    path, _, _, proxy_port = served_config(write, fake, "killer")
    command, base = proxy_daemon
    d = daemons(path, command=command, env=dict(base, **env))
    d.wait_for("the proxy healthy after", timeout=60)
    d.wait_for("vLLM healthy after", timeout=60)
    status, _, data, error = Call(proxy_port, "fine, thanks").result()
    assert status == 200, (status, data, error)
    inodes = listening_inodes(proxy_port)
    assert len(inodes) == 1 and holders(inodes[0]) == {d.proc.pid, proxy_pid(d)}, (inodes, d.log)
    return d, path, proxy_port, inodes[0]


def looping_squatter(squatters, port):
    squatter = squatters(port)
    squatter.wait_trying()  # from here on it tries every millisecond, until the test's end
    return squatter


@pytest.mark.process
def test_a_killed_proxys_port_stays_the_daemons_and_the_next_proxy_serves_on_the_same_socket(
        write, fake, daemons, proxy_daemon, no_fakes_left, squatters):
    """SIGKILL: the killed proxy's socket is the daemon's still; in the gap another uid cannot bind the port, a
    client waits in the backlog and is answered by the next proxy, on the same socket. Before, the port was free
    from the kill until the next proxy's bind (at least the 1 s backoff)."""
    d, _, port, inode = behind_the_proxy(write, fake, daemons, proxy_daemon)
    squatter = looping_squatter(squatters, port)
    after = len(d.lines)
    old, client = kill_in_the_gap(d, inode, port)
    served_again(d, inode, port, old, client, after)
    assert "in use by" not in d.log
    squatter_never_got_it(squatter)
    assert d.stop() == 0
    assert holders(inode) == set() and listening_inodes(port) == [], "a stop lets the port go"


def slow_client(port):
    """A request whose body never comes whole: the proxy that took it drains it (up to its 2 s) when it stops, its
    listening fd closed already, so that the reload's gap is wide enough for the test to find and stop it."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=60)
    sock.sendall(f"POST {CHAT} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n"
                 "\r\n{\"model\"".encode())
    return sock


@pytest.mark.process
def test_a_reload_that_restarts_the_proxy_keeps_its_port_the_daemons_and_the_next_proxy_serves_on_it(
        write, fake, daemons, proxy_daemon, no_fakes_left, squatters):
    """A reload that changes serve.proxy restarts the proxy alone: between the old proxy's stop (its own fd closed
    as it drains) and the next proxy's start, the daemon alone holds the socket; the test stops the daemon there.
    Another uid cannot bind the port, a client waits in the backlog and the next proxy answers it, on the same
    socket."""
    d, path, port, inode = behind_the_proxy(write, fake, daemons, proxy_daemon)
    squatter = looping_squatter(squatters, port)
    old = proxy_pid(d)
    draining = slow_client(port)
    after = len(d.lines)
    path.write_text(path.read_text().replace("hold_s: 300", "hold_s: 250"))
    d.proc.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + 60
    while True:  # the old proxy closed its fd and no next one runs: stop the daemon there, and look again
        assert time.monotonic() < deadline, ("no gap seen", d.log)
        if holders(inode) == {d.proc.pid}:
            d.proc.send_signal(signal.SIGSTOP)
            if holders(inode) == {d.proc.pid}:
                break
            d.proc.send_signal(signal.SIGCONT)  # (a proxy came between the two looks: no gap to hold)
        time.sleep(0.002)
    try:
        client = in_the_gap(d, inode, port)
    finally:
        d.proc.send_signal(signal.SIGCONT)
    assert d.wait_index("restarting the proxy only", timeout=60, after=after) < \
        d.wait_index("the proxy starting (pid", timeout=60, after=after)
    served_again(d, inode, port, old, client, after)
    draining.close()
    assert "in use by" not in d.log
    squatter_never_got_it(squatter)
    assert d.stop() == 0
    assert holders(inode) == set() and listening_inodes(port) == []


@pytest.mark.process
def test_a_handover_carries_the_proxys_socket_across_the_exec_and_the_new_image_starts_its_next_proxy_on_it(
        write, fake, daemons, proxy_daemon, no_fakes_left, squatters, tmp_path, passable_state):
    """SIGUSR2: the daemon re-executes itself; the proxy is adopted (same pid), and the daemon's own fd of the
    proxy's socket crosses the exec (the same inode before and after, close-on-exec again in the new image). Then the
    proxy is killed: the new image holds the port through the gap and starts the next proxy on that socket."""
    state = passable_state  # the engine's socket in it (serving/compose/enginesock.py): serve.user passes it
    d, _, port, inode = behind_the_proxy(write, fake, daemons, proxy_daemon, STATE_DIRECTORY=str(state))
    squatter = looping_squatter(squatters, port)
    proxy, daemon_pid = proxy_pid(d), d.proc.pid
    assert list(fds_of_socket(daemon_pid, inode).values()) == [True], "the daemon's own fd, close-on-exec"
    mark = len(d.lines)
    d.proc.send_signal(signal.SIGUSR2)
    d.wait_for("SIGUSR2: handing over to the installed gpuwarden", after=mark, timeout=10)
    d.wait_for(f"the proxy adopted after an upgrade (re-exec, same daemon pid): pid {proxy}, ", after=mark,
               timeout=60)
    d.wait_for("vLLM adopted after an upgrade", after=mark, timeout=60)
    assert d.proc.poll() is None and d.proc.pid == daemon_pid
    assert list(fds_of_socket(daemon_pid, inode).values()) == [True], "the same socket, close-on-exec again"
    assert holders(inode) == {daemon_pid, proxy} and listening_inodes(port) == [inode]
    assert "the proxy starting (pid" not in "\n".join(d.lines[mark:]), "adopted, not replaced"
    after = len(d.lines)
    old, client = kill_in_the_gap(d, inode, port)
    served_again(d, inode, port, old, client, after)
    assert "in use by" not in d.log and "not adopting" not in d.log
    squatter_never_got_it(squatter)
    assert d.stop() == 0
    assert holders(inode) == set() and listening_inodes(port) == []


@pytest.mark.process
def test_a_handover_with_only_serve_proxy_changed_on_disk_replaces_the_proxy_and_the_engine_serves_on(
        write, fake, daemons, proxy_daemon, no_fakes_left, passable_state):
    """The attacker's finding 1 of 2026-12-02 (on 3568284): hold_s edited, then SIGUSR2 (an upgrade's postinst sends
    it): the new image found the adopted proxy's command changed and replaced every child, the engine too (a request
    in flight got 502; a real vLLM loads for minutes). Now only the proxy is replaced, as a SIGHUP does it."""
    d, path, port, inode = behind_the_proxy(write, fake, daemons, proxy_daemon, STATE_DIRECTORY=str(passable_state))
    engine = int(re.findall(r"vLLM starting \(pid (\d+)", d.log)[-1])
    proxy = proxy_pid(d)
    path.write_text(path.read_text().replace("hold_s: 300", "hold_s: 123"))
    mark = len(d.lines)
    d.proc.send_signal(signal.SIGUSR2)
    d.wait_for("vLLM adopted after an upgrade", after=mark, timeout=60)
    d.wait_for("the proxy's command, environment or user changed since it was started: replacing it", after=mark, timeout=60)
    d.wait_for("the proxy healthy after", after=mark, timeout=60)
    new = proxy_pid(d, after=mark)
    assert new != proxy and "--hold-s 123" in open(f"/proc/{new}/cmdline").read().replace("\0", " ")
    after = "\n".join(d.lines[mark:])
    assert "vLLM starting (pid" not in after and "vLLM's command, environment or user changed" not in after, after
    assert handover.start_ticks(engine) is not None, "the same engine serves on"
    status, _, data, error = Call(port, "fine, thanks").result()
    assert status == 200, (status, data, error)
    assert d.stop() == 0


class Notify:
    """A NOTIFY_SOCKET read on a thread: every message in order, with the fds each carried (kept open)."""

    def __init__(self, path):
        self.path = str(path)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(self.path)
        self.sock.settimeout(0.2)
        self.messages, self.stop = [], threading.Event()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self):
        while not self.stop.is_set():
            try:
                data, fds, _, _ = socket.recv_fds(self.sock, 4096, 8)
            except TimeoutError:
                continue
            self.messages.append((data.decode(), fds))

    def wait(self, text, within_s=60):
        """The fds of the first message that is text."""
        until(lambda: any(m == text for m, _ in self.messages), (text, self.messages), within_s)
        return next(fds for m, fds in self.messages if m == text)

    def stored(self):
        """What systemd's store holds now, by name: the fd of each FDSTORE not taken out since (FDSTOREREMOVE)."""
        held = {}
        for text, fds in list(self.messages):
            fields = dict(line.split("=", 1) for line in text.splitlines())
            if "FDSTORE" in fields:
                held[fields["FDNAME"]] = fds[0]
            elif "FDSTOREREMOVE" in fields:
                held.pop(fields["FDNAME"], None)
        return held

    def close(self):
        self.stop.set()
        self.reader.join(10)
        self.sock.close()
        for _, fds in self.messages:
            for fd in fds:
                os.close(fd)


@pytest.mark.process
def test_a_crash_restart_takes_the_proxys_socket_back_from_the_fd_store_and_starts_the_next_proxy_on_it(
        write, fake, daemons, proxy_daemon, no_fakes_left, squatters, tmp_path, passable_state):
    """The daemon puts the proxy's listening socket in systemd's store (FDSTORE=1, FDNAME=proxy, the fd attached);
    it crashes (SIGKILL: its proxy and engine serve on); the next daemon, given what the store holds as systemd gives
    it (from fd 3 on, named in LISTEN_FDNAMES, LISTEN_FDS, LISTEN_PID its pid: the proxy's and the metrics socket,
    the children's output pipes), adopts the proxy and takes the socket instead of binding one: when the proxy is
    killed it holds the port through the gap and starts the next proxy on it."""
    state = passable_state  # the engine's socket in it (serving/compose/enginesock.py): serve.user passes it
    notify = Notify(tmp_path / "notify.sock")
    later = inode = None
    try:
        d, path, port, inode = behind_the_proxy(write, fake, daemons, proxy_daemon, STATE_DIRECTORY=str(state),
                                                NOTIFY_SOCKET=notify.path)
        (fd,) = notify.wait("FDSTORE=1\nFDNAME=proxy")
        stored = socket.socket(fileno=os.dup(fd))
        assert stored.type == socket.SOCK_STREAM and stored.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)
        assert stored.getsockname() == ("127.0.0.1", port) and os.fstat(fd).st_ino == inode
        squatter = looping_squatter(squatters, port)
        proxy = proxy_pid(d)
        d.proc.kill()  # a crash: no stop, nothing let go; its children serve on
        d.proc.wait(60)
        assert "FDSTOREREMOVE=1\nFDNAME=proxy" not in [m for m, _ in notify.messages]
        stored.close()
        held = notify.stored()  # as systemd gives them back: the listeners, and the children's output pipes
        assert {"proxy", "metrics", "child-proxy", "child-vllm"} <= set(held), notify.messages
        command, env = proxy_daemon
        later = StoredDaemon(path, held, notify.path, args=(), command=command,
                             env=dict(env, STATE_DIRECTORY=str(state)))
        later.wait_for(f"the proxy adopted after a restart of the daemon: pid {proxy}, ", timeout=60)
        later.wait_for("vLLM adopted after a restart of the daemon", timeout=60)
        at = 3 + list(held).index("proxy")  # where the wrapper put it, as systemd would
        assert fds_of_socket(later.proc.pid, inode) == {at: True}, "taken where it was given, close-on-exec"
        assert holders(inode) == {later.proc.pid, proxy} and listening_inodes(port) == [inode]
        assert "not adopting" not in later.log and "the proxy starting (pid" not in later.log
        for _, fds in notify.messages:  # the test's copies closed: the daemon and its proxies alone hold it
            for fd in fds:
                os.close(fd)
            fds.clear()
        after = len(later.lines)
        old, client = kill_in_the_gap(later, inode, port)
        served_again(later, inode, port, old, client, after)
        assert "in use by" not in later.log
        squatter_never_got_it(squatter)
        assert later.stop() == 0
        # A stop leaves the socket in systemd's store, which systemd keeps for a restart (a job queued) and lets go
        # at a full stop; the daemon's copy is closed (the test's copies were, above: the port is free here).
        assert "FDSTOREREMOVE=1\nFDNAME=proxy" not in [m for m, _ in notify.messages]
        assert holders(inode) == set() and listening_inodes(port) == []
    finally:
        if later is not None:
            later.end()
        notify.close()
        for pid in holders(inode) if inode is not None else ():  # a proxy the crash left, no daemon adopted (a failure)
            os.kill(pid, signal.SIGKILL)


@pytest.mark.process
def test_a_restart_whose_config_runs_no_proxy_lets_the_stored_proxy_socket_go(write, tmp_path):
    """The daemon before ran a proxy and the store kept its socket; this one's config runs none: the socket is closed
    (no client waits in a backlog nobody reads: it is refused) and taken out of systemd's store."""
    port = free_port()
    held = socket.create_server(("127.0.0.1", port))  # what the fd store kept of the daemon before
    inode = os.fstat(held.fileno()).st_ino
    notify = Notify(tmp_path / "notify.sock")
    d = StoredDaemon(config(write, free_port()), {"proxy": held.fileno()}, notify.path)
    try:
        d.wait_for("serving /metrics and /status on", timeout=30)
        notify.wait("FDSTOREREMOVE=1\nFDNAME=proxy")
        assert fds_of_socket(d.proc.pid, inode) == {}, "closed, neither kept nor leaked"
        held.close()
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", port), timeout=10).close()
        assert d.stop() == 0
    finally:
        d.end()
        notify.close()


@pytest.mark.process
def test_a_connection_to_a_kept_listener_is_its_makers_until_accepted_and_the_accepters_after():
    """Why the daemon's probe of its proxy takes a socket of either uid (serving/run/health.judge): the kept listener
    is the daemon's, and a connection the proxy has not accepted yet is the daemon's user's; accept() makes it the
    proxy's user's (the kernel's sock_graft). Asking for the proxy's user alone failed the liveness probe whenever
    it came before the accept, and three in a row restarted the proxy."""
    if os.geteuid() != 0:
        pytest.skip("the accepting process must take another uid: needs root (as CI)")
    nobody = pwd.getpwnam("nobody").pw_uid
    listener = socket.create_server(("127.0.0.1", 0))  # made by this process, as the daemon makes the proxy's
    client = socket.create_connection(listener.getsockname(), timeout=10)
    assert sockowner.why_not(client, (nobody, 0)) is None  # queued: the listener's maker's
    assert "not of the engine's user nobody" in sockowner.why_not(client, nobody)
    accepted, done = os.pipe(), os.pipe()
    pid = os.fork()
    if pid == 0:  # the proxy: another uid, accepting on the inherited listener
        try:
            os.setuid(nobody)
            conn, _ = listener.accept()
            os.write(accepted[1], b"x")
            os.read(done[0], 1)
        finally:
            os._exit(0)
    try:
        assert os.read(accepted[0], 1) == b"x"
        assert sockowner.why_not(client, (nobody, 0)) is None
        assert "is answered by a socket of user nobody" in sockowner.why_not(client, 0)
    finally:
        os.write(done[1], b"x")
        os.waitpid(pid, 0)
        for fd in (*accepted, *done):
            os.close(fd)
        client.close()
        listener.close()


@pytest.mark.process
def test_a_reload_or_handover_to_an_address_it_cannot_have_is_refused_and_what_runs_serves_on(
        write, fake, daemons, proxy_daemon, no_fakes_left, passable_state):
    """Attacker 11's F1 and F2: a reload to a serve.proxy.listen that is not this host's (a typo) or whose port
    another process holds stopped the running proxy, and its successor waited for good, serving down with no alert;
    a reload of the engine to a TCP port another process holds stopped the engine first. Now each is refused in one
    line before anything stops (the proxy's new address bound and kept at once: KeptListener.stage), the same
    proxy and engine serve on, and so does a handover with the same config on disk. A reload to a free address
    then moves the proxy there."""
    d, path, port, inode = behind_the_proxy(write, fake, daemons, proxy_daemon,
                                            STATE_DIRECTORY=str(passable_state))
    proxy, engine = proxy_pid(d), running_engine(d)
    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen()
    taken = held.getsockname()[1]
    original = path.read_text()
    cases = [(f"'127.0.0.1:{port}'", "'192.0.2.1:%d'" % port, "serve.proxy.listen: 192.0.2.1:%d cannot be listened on: "
              "Cannot assign requested address" % port),
             (f"'127.0.0.1:{port}'", f"'127.0.0.1:{taken}'", f"serve.proxy.listen: 127.0.0.1:{taken} cannot be "
              "listened on: in use by"),
             ("  enabled: true\n", f"  enabled: true\n  engine_listen: tcp\n", None)]
    for old, new, said in cases:
        if said is None:  # the engine moved to TCP, on the held port
            text = re.sub(r"\n  port: \d+\n", f"\n  port: {taken}\n", original).replace(old, new, 1)
            said = f"serve.port: port {taken} on 127.0.0.1 is in use by"
        else:
            text = original.replace(old, new)
        assert text != original
        path.write_text(text)
        mark = len(d.lines)
        d.proc.send_signal(signal.SIGHUP)
        line = d.wait_for("reload failed, still running the previous config", after=mark, timeout=30)
        assert said in line and "serves on" in line, (said, line)
        mark = len(d.lines)
        d.proc.send_signal(signal.SIGUSR2)
        line = d.wait_for("SIGUSR2: no handover", after=mark, timeout=30)
        assert said in line, (said, line)
        assert proxy_pid(d) == proxy and running_engine(d) == engine and d.proc.poll() is None
        assert listening_inodes(port) == [inode] and holders(inode) == {d.proc.pid, proxy}
        status, _, data, error = Call(port, "fine, thanks").result()
        assert status == 200, (status, data, error)
    # A reload that binds a new proxy address and is then refused for the engine's port lets that address go (attacker
    # 12's F9: it stayed bound, nobody serving on it).
    staged = free_port()
    path.write_text(re.sub(r"\n  port: \d+\n", f"\n  port: {taken}\n", original)
                    .replace("  enabled: true\n", "  enabled: true\n  engine_listen: tcp\n", 1)
                    .replace(f"'127.0.0.1:{port}'", f"'127.0.0.1:{staged}'"))
    mark = len(d.lines)
    d.proc.send_signal(signal.SIGHUP)
    assert f"port {taken} on 127.0.0.1 is in use by" in d.wait_for("reload failed, still running", after=mark, timeout=30)
    probe = socket.socket()
    with probe:
        probe.bind(("127.0.0.1", staged))  # free again
    held.close()
    moved = free_port()
    path.write_text(original.replace(f"'127.0.0.1:{port}'", f"'127.0.0.1:{moved}'"))
    mark = len(d.lines)
    d.proc.send_signal(signal.SIGHUP)
    d.wait_for("the proxy healthy after", after=mark, timeout=60)
    status, _, data, error = Call(moved, "fine, thanks").result()
    assert status == 200 and running_engine(d) == engine, (status, data, error)
    assert d.stop() == 0


def running_engine(d):
    """The pid of the engine the daemon started last, from its log."""
    pids = re.findall(r"vLLM starting \(pid (\d+)", d.log)
    assert pids, d.log
    return int(pids[-1])


@pytest.mark.process
def test_the_proxys_port_held_by_a_local_user_fires_vllm_start_blocked_naming_the_holder(write, fake, daemons,
                                                                                          proxy_daemon, no_fakes_left):
    """Attacker 17's F3: a local user who took the proxy's port at a restart got clients' keys, and only an INFO line
    said so: vllm_start_blocked read the engine's view alone. It fires for the proxy too, naming the holder."""
    from test_planned_restart import with_proxy
    from test_ports import ended, listen_as

    path, base, port, proxy_port = with_proxy(write, fake)
    squatter = listen_as("nobody", "127.0.0.1", proxy_port)
    try:
        command, env = proxy_daemon
        d = daemons(path, command=command, env=env)
        d.wait_for("vLLM healthy after", timeout=120)
        line = d.wait_for("vllm_start_blocked firing", timeout=30)
        assert f"port {proxy_port} on 127.0.0.1 is in use by" in line and "nobody" in line, line
    finally:
        ended(squatter)
    d.wait_for("the proxy healthy after", timeout=120)  # the port let go: the proxy starts, and the alert resolves
    d.wait_for("vllm_start_blocked resolved", timeout=30)
    assert d.stop() == 0
