"""The engine behind the proxy listens on a Unix socket (serving/compose/enginesock.py): no TCP port for a local user
to squat while it is away. The setting and the argv; HTTP over the socket with its listener named by SO_PEERCRED
(base/unixsock.py, base/httpget.py, the proxy's connector); then the daemon, the fake engine with --uds, the real
proxy and a squatter of another uid on serve.port as processes."""

import asyncio
import dataclasses
import os
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from gpuwarden.base import httpget, sockowner, unixsock
from gpuwarden.base.yamlfile import InvalidConfig
from gpuwarden.config import ProxyConfig, ServeConfig, parse_text
from gpuwarden.proxy.upstream import EngineUnixConnector, NotTheEngine
from gpuwarden.serving.compose import enginesock
from gpuwarden.serving.compose.enginesock import conflict_finding, engine_socket, engine_url, fallback_finding
from gpuwarden.serving.compose.engines import engine_for
from gpuwarden.serving.compose.profiles import Profile
from gpuwarden.serving.run import ports
from test_engine_owner import recording_server, squatters  # noqa: F401 (squatters: a fixture)
from test_faults import fake, no_fakes_left, status  # noqa: F401 (fixtures)

VLLM, SGLANG = engine_for("vllm"), engine_for("sglang")
STATE = {"STATE_DIRECTORY": "/var/lib/gpuwarden"}


def serve(listen="auto", proxy=True, **changes):
    return ServeConfig(enabled=True, model="/m", engine_listen=listen,
                       proxy=dataclasses.replace(ProxyConfig(), enabled=proxy), **changes)


# -- the setting and the argv (no process) ---------------------------------------------------------------------------

def passwd(*users):
    """Injected user and group tables: (name, primary gid) pairs, and group 100's listed members."""
    entries = [pwd.struct_passwd((name, "x", 1000 + i, gid, "", "/", "/bin/sh")) for i, (name, gid) in enumerate(users)]
    by_name = {e.pw_name: e for e in entries}

    def getgrgid(gid):
        if gid != 100:
            raise KeyError(gid)
        return type("G", (), {"gr_mem": ["carol"]})()
    return dict(getpwnam=lambda n: by_name[n], getgrgid=getgrgid, getpwall=lambda: entries)


def test_a_primary_group_shared_with_another_user_is_named_and_only_as_root():
    """The attacker's F3 (2026-12-02): Debian's adduser --system puts a user in the shared nogroup; a member of the
    socket folder's group unlinked the live engine's socket and bound its own, and serving stayed down."""
    tables = passwd(("srv", 65534), ("mallory", 65534), ("alice", 200), ("svc", 100), ("bob", 300))
    assert enginesock.group_shared("srv", root=True, **tables) == ["mallory"]
    assert enginesock.group_shared("svc", root=True, **tables) == ["carol"]  # a listed member
    assert enginesock.group_shared("alice", root=True, **tables) == []
    assert enginesock.group_shared("srv", root=False, **tables) == []  # not root: the folder is the user's own, 0700
    assert enginesock.group_shared("nosuch", root=True, **tables) == []  # identity.resolve says so


def test_a_socket_that_cannot_be_had_is_a_warning_for_auto_and_an_error_for_unix(monkeypatch):
    """The attacker's F5: auto fell back to TCP without a word, and unix with the proxy off left the engine on a
    socket no client reaches; both passed check."""
    monkeypatch.setattr(enginesock, "group_shared", lambda user, **_: ["mallory"] if user == "srv" else [])
    shared = serve(user="srv")
    assert engine_socket(shared, VLLM, STATE) is None  # auto: TCP...
    found = fallback_finding(shared, VLLM, STATE)  # ...said
    assert found.rule == "engine-listen-tcp-fallback" and "also mallory's" in found.message, found
    assert "127.0.0.1:8000" in found.message and "give serve.user a group of its own" in found.fix
    with pytest.raises(ValueError, match="serve.user srv's primary group is also mallory's"):
        engine_socket(serve("unix", user="srv"), VLLM, STATE)
    long = {"STATE_DIRECTORY": "/" + "x" * 100}
    assert "longer than a Unix socket's 107 bytes" in fallback_finding(serve(user="ok"), VLLM, long).message
    lonely = fallback_finding(serve("unix", proxy=False, user="ok"), VLLM, STATE)
    assert lonely.rule == "engine-listen-unix-without-proxy" and "no client but gpuwarden" in lonely.message
    for quiet in (serve(user="ok"), serve("tcp", user="srv"), serve(proxy=False, user="srv")):
        assert fallback_finding(quiet, VLLM, STATE) is None, quiet  # a socket, or TCP by choice
    assert fallback_finding(serve(user="ok"), SGLANG, STATE) is None  # SGLang has no flag: TCP by its nature


def test_engine_listen_reads_auto_tcp_or_unix_and_names_the_line_of_anything_else(tmp_path):
    for value in ("auto", "tcp", "unix"):
        cfg = parse_text(f"serve:\n  model: /m\n  engine_listen: {value}\n", str(tmp_path / "g.yaml"))
        assert cfg.serve.engine_listen == value
    assert parse_text("serve:\n  model: /m\n", str(tmp_path / "g.yaml")).serve.engine_listen == "auto"
    with pytest.raises(InvalidConfig) as caught:
        parse_text("serve:\n  model: /m\n  engine_listen: udp\n", str(tmp_path / "g.yaml"))
    assert "g.yaml:3: serve.engine_listen" in str(caught.value), caught.value


def test_auto_is_the_socket_behind_the_proxy_for_vllm_and_tcp_otherwise():
    path = engine_socket(serve(), VLLM, STATE)
    assert path == "/var/lib/gpuwarden/engine/8000.sock"
    assert engine_url(serve(), VLLM, STATE) == "http+unix://%2Fvar%2Flib%2Fgpuwarden%2Fengine%2F8000.sock"
    assert engine_socket(serve(proxy=False), VLLM, STATE) is None  # users call the engine: its port
    assert engine_socket(serve(), SGLANG, STATE) is None  # SGLang 0.5 has no such flag
    assert engine_socket(serve("tcp"), VLLM, STATE) is None
    assert engine_socket(serve("unix", proxy=False), VLLM, STATE) == path  # asked for: nobody but gpuwarden reaches it
    assert engine_url(serve(proxy=False), VLLM, STATE) == "http://127.0.0.1:8000"
    with pytest.raises(ValueError, match="SGLang has no flag to listen on a Unix socket"):
        engine_socket(serve("unix"), SGLANG, STATE)
    long = {"STATE_DIRECTORY": "/" + "x" * 100}
    assert engine_socket(serve(), VLLM, long) is None  # past sun_path's 107 bytes: auto keeps the port
    with pytest.raises(ValueError, match="longer than a Unix socket's 107 bytes"):
        engine_socket(serve("unix"), VLLM, long)


def test_the_argv_behind_the_proxy_has_uds_and_no_host_or_port_and_the_users_listen_flags_are_one_finding(
        monkeypatch):
    monkeypatch.setenv("STATE_DIRECTORY", "/var/lib/gpuwarden")
    profile = Profile("p", "", "", "vllm", (), (1, 8), 0.0, (), (), (), (), (), ())
    argv = VLLM.argv(serve(args=("--port", "9000")), profile)
    assert argv[-2:] == ("--uds", "/var/lib/gpuwarden/engine/8000.sock"), argv
    assert "--host" not in argv and argv.count("--port") == 1  # only the user's, overridden by --uds
    assert VLLM.argv(serve(proxy=False), profile)[-4:] == ("--host", "127.0.0.1", "--port", "8000")
    found = conflict_finding(serve(), VLLM, ("--port", "9000", "--uds=/tmp/x"))
    assert found.rule == "listen-flags-in-args" and found.facts == ("--port", "--uds"), found
    assert "the Unix socket /var/lib/gpuwarden/engine/8000.sock" in found.message
    assert conflict_finding(serve(), VLLM, ("--max-model-len", "4096")) is None


# -- HTTP over a Unix socket, its listener named (threads and sockets of this process) -------------------------------

def unix_server(path: Path, answer: bytes, seen: list):
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(4)

    def run():
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            with conn:
                data = b""
                while b"\r\n\r\n" not in data:
                    chunk = conn.recv(4096)
                    if not chunk:
                        break
                    data += chunk
                seen.append(data)
                if data:
                    conn.sendall(answer)

    threading.Thread(target=run, daemon=True).start()
    return listener


def test_httpget_reads_a_unix_socket_and_writes_nothing_where_another_uid_listens(tmp_path):
    seen = []
    path = tmp_path / "e.sock"
    listener = unix_server(path, b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok", seen)
    try:
        url = unixsock.url(str(path))
        assert unixsock.path_of(url) == str(path) and unixsock.path_of("http://127.0.0.1:8000") is None
        reply = httpget.get(url + "/health", 5, 1024, owner=os.geteuid())
        assert reply.code == 200 and reply.body == b"ok"
        assert seen[0].startswith(b"GET /health HTTP/1.1\r\nHost: localhost\r\n"), seen
        me = pwd.getpwuid(os.geteuid()).pw_name
        if os.geteuid() == 0:  # root connects as the owner it names: here another uid, whom the folder keeps out
            with pytest.raises(httpget.HttpError, match="Permission denied"):
                httpget.get(url + "/metrics", 5, 1024, owner=os.geteuid() + 1)
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:  # the listener's uid, by SO_PEERCRED
            conn.connect(str(path))
            assert sockowner.why_not(conn, os.geteuid()) is None
            why = sockowner.why_not(conn, os.geteuid() + 1)
        assert f"unix:{path} is answered by a socket of user {me}" in why and "nothing sent to it" in why, why
        assert len(seen) == 1 or all(data == b"" for data in seen[1:]), seen  # nothing else carried a request
    finally:
        listener.close()


def test_the_proxys_unix_connector_writes_nothing_to_a_socket_of_another_uid(tmp_path):
    path = str(tmp_path / "e.sock")

    async def scenario():
        seen = []
        runner = await recording_server(seen)
        await web.UnixSite(runner, path).start()
        try:
            for uid, expected in ((os.geteuid(), 200), (os.geteuid() + 1, None)):
                connector = EngineUnixConnector(path, uid=uid)
                async with aiohttp.ClientSession(connector=connector) as session:
                    try:
                        async with session.post("http://localhost/v1/chat/completions", data=b"{}",
                                                headers={"Authorization": "Bearer sk-secret"}) as answer:
                            assert answer.status == expected
                    except aiohttp.ClientConnectorError as exc:
                        assert expected is None and isinstance(exc.os_error, NotTheEngine), exc
                        assert f"(uid {os.geteuid() + 1}): nothing sent to it" in str(exc)
                        assert connector.refused == 1
            assert seen == ["/v1/chat/completions"]
        finally:
            await runner.cleanup()

    asyncio.run(scenario())


# -- under the daemon, with the proxy, a squatter on serve.port (processes) ------------------------------------------

def fake_pid(d, after=0):
    """The pid the fake engine said it runs as, in its first line from after on."""
    index = d.wait_index("INFO fakechild pid", timeout=60, after=after)
    return int(d.lines[index].split("INFO fakechild pid ")[1].split()[0]), index


@pytest.mark.process
def test_behind_the_proxy_the_engine_has_no_port_so_a_squatter_blocks_nothing_across_a_crash_and_a_reload(
        write, fake, daemons, proxy_daemon, no_fakes_left, squatters, passable_state):
    """A user of another uid (nobody) holds serve.port from before the daemon starts. The fake engine listens on
    its socket in the state directory (--uds) and on no TCP port: it starts, the daemon reads its /health and
    /metrics over the socket (RUNNING, its stats in /status), requests through the proxy get 200; a SIGKILL of the
    engine (its socket left behind) and a reload that changes its flags each bring a new engine on the same path.
    The squatter is never connected to, and the daemon never says the start is blocked."""
    from test_query_of_death import Call, healthy, served_config

    path, base, port, proxy_port = served_config(write, fake, "killer")
    squatter = squatters(port)
    squatter.wait_bound()
    state = passable_state  # as /var/lib/gpuwarden: 0755 on a path serve.user can pass
    command, env = proxy_daemon
    d = daemons(path, command=command, env=dict(env, STATE_DIRECTORY=str(state)))
    first = healthy(d)
    sock = state / "engine" / f"{port}.sock"
    assert "vLLM healthy after" in d.lines[first] and f"on unix:{sock}" in d.lines[first], d.lines[first]
    d.wait_for("the proxy healthy after", timeout=60)
    status_, _, data, error = Call(proxy_port, "fine, thanks").result()
    assert status_ == 200, (status_, data, error)
    pid, said = fake_pid(d)
    assert pid not in ports.holders(set(ports.listening_sockets(port, host="127.0.0.1")))  # the squatter's port
    assert _tcp_listeners_of(pid) == [], "the engine listens on TCP"
    folder = (state / "engine").stat()  # root's, serve.user's group's, nobody else's
    assert sock.is_socket() and sock.stat().st_uid == pwd.getpwnam(fake["user"]).pw_uid
    assert folder.st_uid == 0 and folder.st_gid == pwd.getpwnam(fake["user"]).pw_gid
    assert folder.st_mode & 0o7777 == 0o1770  # sticky: the group may not unlink serve.user's socket
    deadline = time.monotonic() + 60  # a bound for a hang: the daemon's /metrics read over the socket fills it
    while not ((status(base).get("vllm") or {}).get("requests_running") is not None) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert status(base)["serving"]["state"] == "RUNNING" and status(base)["vllm"]["requests_running"] is not None

    os.kill(pid, signal.SIGKILL)  # its socket file stays: the next start removes it, or vLLM's bind would fail
    again = healthy(d, first + 1)
    _, said = fake_pid(d, said + 1)
    assert Call(proxy_port, "fine, thanks").result()[0] == 200

    path.write_text(path.read_text().replace("  port:", "  args: [--max-model-len, '64']\n  port:", 1))
    d.proc.send_signal(signal.SIGHUP)
    healthy(d, again + 1)
    assert Call(proxy_port, "fine, thanks").result()[0] == 200
    assert not any("vllm_start_blocked" in line or "is in use by" in line for line in d.lines), d.log
    assert squatter.conns == 0 and squatter.data == b"", (squatter.conns, squatter.data)
    assert d.stop() == 0


def _tcp_listeners_of(pid: int) -> list[str]:
    """/proc/PID/net/tcp's listening lines (state 0A) whose inode is one of pid's sockets."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    out = []
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:
                out.append(line)
    return out


UNDER_THE_UNIT = r'''
import os, socket, subprocess, sys
from gpuwarden.base import httpget, unixsock
from gpuwarden.serving.compose.enginesock import make_socket_dir, socket_dir
from gpuwarden.serving.compose.identity import resolve

identity = resolve(sys.argv[1])
os.umask(0o077)  # the unit's: the engine's socket is born 0600
make_socket_dir(identity, create=True)
path = str(socket_dir() / "8000.sock")
engine = subprocess.Popen(["setpriv", f"--reuid={identity.uid}", f"--regid={identity.gid}", "--clear-groups",
                           "/usr/bin/python3", "-c", "import socket, sys\ns = socket.socket(socket.AF_UNIX)\n"
                           "s.bind(sys.argv[1]); s.listen(1); print('up', flush=True)\nc, _ = s.accept(); c.recv(4096)\n"
                           "c.sendall(b'HTTP/1.1 200 OK\\r\\nContent-Length: 2\\r\\n\\r\\nok')", path],
                          stdout=subprocess.PIPE, text=True)
try:
    assert engine.stdout.readline() == "up\n"
    try:
        socket.socket(socket.AF_UNIX).connect(path)
        print("root's own connect: passed")
    except PermissionError:
        print("root's own connect: EACCES")
    reply = httpget.get(unixsock.url(path) + "/health", 10, 100, owner=identity.uid)
    print("as the socket's user:", reply.code, reply.body.decode())
finally:
    engine.kill()
'''


@pytest.mark.process
def test_under_the_units_capabilities_root_reaches_the_engines_0600_socket_only_as_its_user(child_user, tmp_path):
    """As the unit runs the daemon (no CAP_DAC_OVERRIDE, umask 0077): root may not connect to the socket serve.user
    made, and httpget connects with the thread's fsuid and fsgid set to serve.user's, through the folder root lets
    serve.user's group into."""
    if os.geteuid() != 0:
        pytest.skip("the unit's capabilities and another user: needs root (as CI)")
    state = Path(tempfile.mkdtemp(prefix="gw-unit-"))
    state.chmod(0o755)
    try:
        script = tmp_path / "under_the_unit.py"
        script.write_text(UNDER_THE_UNIT)
        done = subprocess.run(["setpriv", "--bounding-set", "-all,+sys_admin,+setuid,+setgid,+kill", "--inh-caps=-all",
                               "--no-new-privs", sys.executable, str(script), child_user],
                              env=dict(os.environ, STATE_DIRECTORY=str(state)), capture_output=True, text=True,
                              timeout=60)
        assert done.returncode == 0, done.stdout + done.stderr
        assert done.stdout.splitlines() == ["root's own connect: EACCES", "as the socket's user: 200 ok"], done.stdout
    finally:
        shutil.rmtree(state, ignore_errors=True)
