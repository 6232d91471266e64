"""The proxy forwards only to the engine's user's socket (issue 51, finding 2): a local user of another uid who binds
the engine's port while it restarts is sent no byte, API keys and prompts included.

The owner of a connection's far end (base/sockowner.py) read from /proc/net/tcp text, from sock_diag answers and
from real sockets of this process; the proxy's connector (proxy/upstream.py) in this process; then the daemon, the
fake engine, the real proxy and a squatter of another uid (tests/harness/squatter.py) as processes."""

import asyncio
import base64
import errno
import os
import pwd
import signal
import socket
import struct
import subprocess
import sys
import threading
import time

import aiohttp
import pytest
from aiohttp import web

from conftest import ROOT, free_port, gpuwarden_cmd
from gpuwarden.base import sockowner
from gpuwarden.base.sockowner import ESTABLISHED, SYN_RECV, diag_reply, find_in_table, hexed
from gpuwarden.proxy.upstream import EngineConnector, NotTheEngine, engine_uid
from gpuwarden.serving.run import ports
from test_faults import fake, no_fakes_left  # noqa: F401 (fixtures)

SQUATTER = ROOT / "tests" / "harness" / "squatter.py"
HEAD = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n"


def ep(host, port):
    return sockowner._endpoint((host, port))


def line(n, local, remote, state, uid, inode):
    return (f"{n:4d}: {local} {remote} {state:02X} 00000000:00000000 00:00000000 00000000 {uid:5d}        0 "
            f"{inode} 1 0000000000000000 20 4 30 10 -1\n")


# -- /proc/net/tcp read as text (no process) ------------------------------------------------------------------------

def test_the_far_end_is_found_in_proc_net_tcp_by_all_four_addresses_and_its_owner_read():
    engine, client = ep("127.0.0.1", 8000), ep("127.0.0.1", 54321)
    # as a little-endian host prints them: 127.0.0.1 is 0100007F, 8000 is 1F40, 54321 is D431
    assert hexed(engine[1], six=False) == ("0100007F" if sys.byteorder == "little" else "7F000001")
    e, c = f"{hexed(engine[1], False)}:1F40", f"{hexed(client[1], False)}:D431"
    text = (HEAD + line(0, e, "00000000:0000", 0x0A, 998, 100)  # the engine's listener: never the far end
            + line(1, c, e, ESTABLISHED, 0, 101)  # our own end (root's)
            + line(2, e, c, ESTABLISHED, 998, 0)  # the far end, queued, not yet accepted: inode 0
            + line(3, e, f"{hexed(client[1], False)}:D432", ESTABLISHED, 65534, 102)).encode()  # another client's
    assert find_in_table(text, client, engine, six=False) == (ESTABLISHED, 998)
    # the same port taken by another user: the owner says so, whatever the port
    mallory = text.replace(b"  998        0 0 ", b"65534        0 0 ")
    assert find_in_table(mallory, client, engine, six=False) == (ESTABLISHED, 65534)
    # a connection the table does not hold (an engine on another host): nobody
    assert find_in_table(text, ep("127.0.0.1", 40000), engine, six=False) is None
    # the same port number on another address is another socket (an address is part of a port)
    assert find_in_table(text, client, ep("127.0.0.2", 8000), six=False) is None


def test_a_closed_end_beside_a_new_one_of_the_same_addresses_counts_last_and_syn_recv_names_its_listener():
    engine, client = ep("127.0.0.1", 8000), ep("127.0.0.1", 54321)
    e, c = f"{hexed(engine[1], False)}:1F40", f"{hexed(client[1], False)}:D431"
    tw = line(5, e, c, 0x06, 0, 0)  # TIME_WAIT: the kernel prints uid 0 for it, whoever owned it
    assert find_in_table((HEAD + tw).encode(), client, engine, six=False) == (6, 0)
    both = (HEAD + tw + line(6, e, c, SYN_RECV, 998, 0)).encode()
    assert find_in_table(both, client, engine, six=False) == (SYN_RECV, 998)


def test_ipv6_and_ipv4_taken_by_a_dual_stack_socket_are_read_from_tcp6():
    engine, client = ep("::1", 8000), ep("::1", 54321)
    assert hexed(engine[1], six=True) == ("00000000000000000000000001000000" if sys.byteorder == "little"
                                          else "00000000000000000000000000000001")
    e, c = f"{hexed(engine[1], True)}:1F40", f"{hexed(client[1], True)}:D431"
    text = (HEAD + line(0, e, c, ESTABLISHED, 998, 7)).encode()
    assert find_in_table(text, client, engine, six=True) == (ESTABLISHED, 998)
    assert find_in_table(text, client, engine, six=False) is None  # an IPv6 connection is never in tcp
    # 127.0.0.1 taken by a [::]:P socket: its end is ::ffff:127.0.0.1 in tcp6
    v4e, v4c = ep("127.0.0.1", 8000), ep("::ffff:127.0.0.1", 54321)
    assert v4c == ep("127.0.0.1", 54321)  # a mapped address is IPv4
    mapped = (HEAD + line(0, f"{hexed(v4e[1], True)}:1F40", f"{hexed(v4c[1], True)}:D431", ESTABLISHED, 65534,
                          8)).encode()
    assert hexed(v4e[1], True).startswith("0000000000000000FFFF0000" if sys.byteorder == "little"
                                          else "0000000000000000FFFF")
    assert find_in_table(mapped, v4c, v4e, six=True) == (ESTABLISHED, 65534)


def test_a_table_line_cut_short_is_no_answer():
    engine, client = ep("127.0.0.1", 8000), ep("127.0.0.1", 54321)
    needle = f"   0: {hexed(engine[1], False)}:1F40 {hexed(client[1], False)}:D431 01"
    assert find_in_table((HEAD + needle).encode(), client, engine, six=False) is None


# -- sock_diag's answers as bytes (no process) ----------------------------------------------------------------------

def reply(family, state, sport, dport, src, dst, uid, kind=20):
    body = struct.pack("=BBBB", family, state, 0, 0) + struct.pack("!HH16s16s", sport, dport, src.ljust(16, b"\0"),
                                                                    dst.ljust(16, b"\0"))
    body += struct.pack("=III", 0, 0, 0) + struct.pack("=IIIII", 0, 0, 0, uid, 0)
    return struct.pack("=IHHII", 16 + len(body), kind, 0, 1, 0) + body


def test_a_sock_diag_answer_counts_only_for_the_connection_asked_about():
    engine, client = ep("127.0.0.1", 8000), ep("127.0.0.1", 54321)
    lo = socket.inet_aton("127.0.0.1")
    assert diag_reply(reply(socket.AF_INET, ESTABLISHED, 8000, 54321, lo, lo, 998), client, engine) == (1, 998)
    # a lookup that finds no connected socket answers the port's listener: not this connection's end
    assert diag_reply(reply(socket.AF_INET, 0x0A, 8000, 0, lo, b"", 65534), client, engine) is None
    # a dual-stack socket that took an IPv4 connection answers as IPv6, its addresses mapped
    mapped = b"\0" * 10 + b"\xff\xff" + lo
    assert diag_reply(reply(socket.AF_INET6, ESTABLISHED, 8000, 54321, mapped, mapped, 7), client, engine) == (1, 7)
    assert diag_reply(reply(socket.AF_INET6, ESTABLISHED, 8000, 54321, b"\0" * 15 + b"\1", mapped, 7), client,
                      engine) is None
    error = struct.pack("=IHHII", 36, 2, 0, 1, 0)
    assert diag_reply(error + struct.pack("=i", -errno.ENOENT) + b"\0" * 16, client, engine) is None
    with pytest.raises(OSError):
        diag_reply(error + struct.pack("=i", -errno.EINVAL) + b"\0" * 16, client, engine)
    with pytest.raises(OSError):
        diag_reply(b"\0" * 8, client, engine)


def test_the_owner_of_a_real_connection_of_this_process_is_our_uid_by_either_reading():
    for family, host in ((socket.AF_INET, "127.0.0.1"), (socket.AF_INET6, "::1")):
        try:
            server = socket.socket(family)
            server.bind((host, 0))
        except OSError:
            continue  # no IPv6 here
        server.listen(4)
        with server, socket.create_connection(server.getsockname()[:2]) as ours:
            near, far = ours.getsockname(), ours.getpeername()
            assert sockowner.owner(near, far) == os.geteuid()  # queued, not yet accepted
            assert sockowner.table_owner(sockowner._endpoint(near), sockowner._endpoint(far)) == (ESTABLISHED,
                                                                                                 os.geteuid())
            accepted, _ = server.accept()
            with accepted:
                assert sockowner.owner(near, far) == os.geteuid()
                assert sockowner.owner(near, (far[0], far[1] + 1 if far[1] < 65535 else 1)) is None


# -- the proxy's connector, in this process (no process) ------------------------------------------------------------

def test_engine_user_names_a_user_a_uid_or_any():
    assert engine_uid(None) == os.geteuid() and engine_uid("any") is None and engine_uid("998") == 998
    assert engine_uid(pwd.getpwuid(0).pw_name) == 0
    with pytest.raises(ValueError, match="no user"):
        engine_uid("no-such-user-here")


def test_the_daemons_proxy_is_told_the_engines_user(tmp_path):
    from gpuwarden.config import parse_text
    from gpuwarden.proxy.child import proxy_spec
    from gpuwarden.serving.compose.identity import Identity

    cfg = parse_text("serve:\n  model: /m\n  proxy: {enabled: true}\n", str(tmp_path / "g.yaml"))
    argv = proxy_spec(cfg, Identity("vllm", 998, 998, "/var/lib/vllm", (), switch=True)).argv
    assert argv[argv.index("--engine-user") + 1] == "998"


async def recording_server(seen: list) -> web.AppRunner:
    """An aiohttp server (set up, no site yet) that answers every request 200 and records its path in seen."""

    async def anything(request):
        seen.append(request.path)
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", anything)
    runner = web.AppRunner(app)
    await runner.setup()
    return runner


def test_the_connector_writes_nothing_to_a_socket_of_another_uid_and_says_whose_it_is():
    async def scenario():
        seen = []
        runner = await recording_server(seen)
        port = free_port()
        site = web.TCPSite(runner, "127.0.0.1", port)
        await site.start()
        try:
            for uid, expected in ((os.geteuid(), 200), (os.geteuid() + 1, None), (None, 200)):
                connector = EngineConnector(uid=uid)
                async with aiohttp.ClientSession(connector=connector) as session:
                    try:
                        async with session.post(f"http://127.0.0.1:{port}/v1/chat/completions", data=b"{}",
                                                headers={"Authorization": "Bearer sk-secret"}) as answer:
                            assert answer.status == expected
                    except aiohttp.ClientConnectorError as exc:
                        assert expected is None
                        assert isinstance(exc.os_error, NotTheEngine), exc
                        assert f"is answered by a socket of user {pwd.getpwuid(os.geteuid()).pw_name}" in str(exc)
                        assert f"(uid {os.geteuid() + 1}) (a local user holds the engine's port)" in str(exc)
                        assert connector.refused == 1
            assert seen == ["/v1/chat/completions"] * 2  # the refused connection carried no request
        finally:
            await runner.cleanup()

    asyncio.run(scenario())


def test_the_daemons_keyed_probes_write_nothing_to_a_socket_of_another_uid():
    """The idle probe and the known-answer check carry the engine's API key: httpget writes to a socket of the
    engine's uid only (a listener of ours stands in for a squatter: the probe is told it is another uid's)."""
    from gpuwarden.base import httpget
    from gpuwarden.serving.probe import known, stall

    got = []
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(8)
        url = f"http://127.0.0.1:{server.getsockname()[1]}/v1/completions"

        def serve():
            for _ in range(3):
                conn, _ = server.accept()
                with conn:
                    conn.settimeout(5)
                    try:
                        data = conn.recv(65536)
                    except OSError:  # the reset
                        data = b""
                    got.append(data)
                    if data:
                        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 39\r\n\r\n"
                                     b'{"choices": [{"text": " jumps over"}]}\n')

        thread = threading.Thread(target=serve, daemon=True)
        thread.start()
        mallory = r"is answered by a socket of user .*, not of the engine's (user|uid)"
        with pytest.raises(httpget.HttpError, match=mallory):
            stall.probe(url, "m", 5, key="sk-secret", owner=os.geteuid() + 1)
        with pytest.raises(httpget.HttpError, match="nothing sent to it"):
            known.ask(url, "m", key="sk-secret", owner=os.geteuid() + 1)
        assert known.ask(url, "m", key="sk-secret", owner=os.geteuid()) == " jumps over"
        thread.join(10)
    assert got[:2] == [b"", b""] and b"sk-secret" in got[2]


# -- a squatter of another uid against the real proxy, alone and under the daemon -----------------------------------

class Squatter:
    """tests/harness/squatter.py as user nobody: it takes the port as soon as it is free, answers everything 200,
    and reports each connection and every byte it is sent."""

    def __init__(self, port, host="127.0.0.1"):
        self.conns, self.data, self.bound = 0, b"", threading.Event()
        self.trying, self.refused = threading.Event(), set()  # its bind() loop runs; the errnos it failed with
        self.proc = subprocess.Popen(["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups",
                                      "/usr/bin/python3", str(SQUATTER), "--port", str(port), "--host", host],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self):
        for text in self.proc.stdout:
            if text.startswith("TRYING"):
                self.trying.set()
            elif text.startswith("REFUSED "):
                self.refused.add(text.split()[1])
            elif text.startswith("BOUND"):
                self.bound.set()
            elif text.startswith("CONN"):
                self.conns += 1
            elif text.startswith("DATA "):
                self.data += base64.b64decode(text[5:])
            else:
                self.data += text.encode()  # anything else it says (a traceback) shows in the assertion

    def wait_trying(self, within_s=30):
        """Its loop runs: from here on it tries the port every millisecond (a bound for a hang)."""
        assert self.trying.wait(within_s), f"the squatter never began: {self.data!r}"

    def wait_bound(self, within_s=30):
        assert self.bound.wait(within_s), f"the squatter never got the port: {self.data!r}"

    def stop(self):
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)
        self.reader.join(10)  # all it said is read
        self.proc.stdout.close()


@pytest.fixture
def squatters():
    if os.geteuid() != 0:
        pytest.skip("the squatter must run as another uid than the engine's and the proxy's: needs root (as CI)")
    started = []

    def start(port, host="127.0.0.1"):
        started.append(Squatter(port, host))
        return started[-1]

    yield start
    for squatter in started:
        squatter.stop()


PROMPT = "my private prompt, never for another user"


@pytest.mark.process
def test_of_a_host_with_two_addresses_the_one_a_squatter_holds_is_skipped_for_the_engines(squatters):
    """An engine named "localhost" on 127.0.0.1, a squatter of another uid on [::1] of the same port: the proxy's
    connector goes on to the engine's address (aiohttp 3.8 tries the addresses one by one, 3.10 and later hands
    them over together), and the squatter reads no byte."""
    from aiohttp.abc import AbstractResolver

    port = free_port()
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", port))
    except OSError:
        pytest.skip("no IPv6 loopback here")
    squatter = squatters(port, "::1")
    squatter.wait_bound()

    class Both(AbstractResolver):
        async def resolve(self, host, port=0, family=0):
            return [{"hostname": host, "host": address, "port": port, "family": family, "proto": 0, "flags": 0}
                    for address, family in (("::1", socket.AF_INET6), ("127.0.0.1", socket.AF_INET))]

        async def close(self):
            pass

    async def models(request):
        return web.Response(text="the engine")

    async def scenario():
        app = web.Application()
        app.router.add_get("/v1/models", models)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        try:
            async with aiohttp.ClientSession(connector=EngineConnector(uid=os.geteuid(), resolver=Both())) as session:
                async with session.get(f"http://engine.test:{port}/v1/models",
                                       headers={"Authorization": "Bearer sk-secret"}) as answer:
                    assert answer.status == 200 and await answer.text() == "the engine"
                    assert session.connector.refused == 1
        finally:
            await runner.cleanup()

    asyncio.run(scenario())
    squatter.stop()  # its output read to the end (a connection it had not accepted yet is not counted)
    assert squatter.data == b"", squatter.data


@pytest.mark.process
def test_a_squatter_of_another_uid_on_the_engines_port_is_sent_no_byte_and_the_engine_after_it_is(squatters):
    """The squatter binds before the engine starts and answers /health 200: a proxy that holds 2 s answers 503
    when it keeps the port, and the journal says whose socket it is; a request held while it squats goes to the
    engine that takes the port after it. The squatter saw connections, never a byte."""
    from test_proxy import HERE, Process
    from test_query_of_death import SECRET, Call

    up_port = free_port()
    squatter = squatters(up_port)
    squatter.wait_bound()
    started = []
    try:
        short = Process([*gpuwarden_cmd(), "proxy", "-c", "none", "--upstream", f"http://127.0.0.1:{up_port}",
                         "--listen", f"127.0.0.1:{(short_port := free_port())}", "--hold-s", "2"], short_port)
        started.append(short)
        status, retry_after, data, error = Call(short_port, PROMPT, timeout=60).result()
        assert status == 503 and retry_after and b"did not come back within 2 s" in data, (status, data, error)
        assert any("is answered by a socket of user nobody (uid 65534), not of the engine's user root (uid 0)"
                   in text for text in short.lines), short.lines
        proxy = Process([*gpuwarden_cmd(), "proxy", "-c", "none", "--upstream", f"http://127.0.0.1:{up_port}",
                         "--listen", f"127.0.0.1:{(proxy_port := free_port())}", "--hold-s", "120"], proxy_port)
        started.append(proxy)
        held = Call(proxy_port, PROMPT)
        deadline = time.monotonic() + 60  # two of the hold's looks at /health, each over a connection the squatter
        while squatter.conns < 2:  # took (a bound on a hang: how soon is the box's business)
            assert time.monotonic() < deadline and held.status is None, (squatter.conns, held.status, held.data)
            time.sleep(0.1)
        assert held.status is None and held.error is None  # held, not answered by the squatter
        assert squatter.data == b"", squatter.data
        squatter.stop()
        engine = Process([sys.executable, str(HERE / "harness" / "fake_upstream.py"), "--port", str(up_port)],
                         up_port, "/debug/open")
        started.append(engine)
        status, _, data, error = held.result()
        assert status == 200, (status, data, error)
        assert dict(engine.get_json("/debug/last")["headers"])["Authorization"] == f"Bearer {SECRET}"
        assert squatter.data == b"" and SECRET not in "\n".join(proxy.lines + short.lines)
    finally:
        for p in reversed(started):
            p.stop()


@pytest.mark.process
def test_under_the_daemon_a_squatter_who_takes_the_port_while_the_engine_restarts_is_sent_nothing(
        write, fake, daemons, proxy_daemon, no_fakes_left, squatters):
    """The fake engine is killed; a user of another uid (nobody) takes its port and answers /health 200 while the
    daemon says the start is blocked. A request with an API key sent meanwhile is held, never sent to the squatter;
    once the squatter is gone the restarted engine answers it. Nothing of gpuwarden's (the proxy, the daemon's own
    /health and /metrics reads) writes a byte to the squatter. Before this check the squatter got the request."""
    from test_query_of_death import SECRET, Call, healthy, serving_behind_the_proxy

    # on TCP as asked (serve.engine_listen: tcp; behind the proxy vLLM's default is a Unix socket, which no one can
    # squat: tests/test_engine_socket.py)
    d, first, path, port, proxy_port = serving_behind_the_proxy(write, fake, daemons, proxy_daemon,
                                                                serve_extra="engine_listen: tcp")
    squatter = squatters(port)  # it loops on bind() until the engine's socket is gone
    time.sleep(0.5)
    engine = ports.holders(set(ports.listening_sockets(port, host="127.0.0.1")))
    assert engine and not squatter.bound.is_set(), engine
    for pid in engine:
        os.kill(pid, signal.SIGKILL)
    squatter.wait_bound()
    d.wait_for(("is in use by", "in use by a process of user nobody"), timeout=60, after=first)
    held = Call(proxy_port, PROMPT)
    time.sleep(2)  # the hold's looks at /health, the daemon's own probes: the squatter answers them all 200
    assert held.status is None and held.error is None, (held.status, held.data, held.error)
    assert squatter.data == b"", squatter.data
    blocked = "\n".join(line for line in d.lines if "in use by" in line)
    assert "nobody" in blocked, blocked
    squatter.stop()
    healthy(d, first + 1)
    status, _, data, error = held.result()
    assert status == 200 and b'"fine"' in data, (status, data, error)
    assert squatter.data == b"" and SECRET.encode() not in squatter.data
    assert d.stop() == 0
