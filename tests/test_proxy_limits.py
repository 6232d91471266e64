"""The proxy's limits on what clients send (issue 24): connections, deadlines, memory, dumps, header and body
fidelity. The proxy and the fake engine run as real processes (the rig of test_proxy.py); the clients here are
raw sockets that misbehave on purpose."""

import contextlib
import gzip
import http.client
import json
import logging
import os
import socket
import sys
import time
import urllib.request
import zlib

import pytest

from test_proxy import TOOLS, claude_code_request, last_upstream, rig, send  # noqa: F401 (rig: a fixture)
from gpuwarden.proxy.body import Budget, Refusal, decode, loads, parse_cost
from gpuwarden.proxy.dump import session_of
from gpuwarden.proxy.faults import proxy_faults as FaultLog
from gpuwarden.proxy.listener import connection_cap
from gpuwarden.proxy.normalize import Rules, apply
from gpuwarden.proxy.server import OFF_LOOP_BYTES, off_loop


def metric(proxy, name) -> float | None:
    text = urllib.request.urlopen(f"http://127.0.0.1:{proxy.port}/metrics", timeout=10).read().decode()
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    return None


def open_socket(port, data=b"", timeout=2.0):
    """A client connection that sent `data` and then stops; None when the connect did not go through."""
    try:
        sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    except OSError:
        return None
    if data:
        sock.sendall(data)
    return sock


def closed_by_peer(sock, within_s) -> bool:
    """Whether the other end closes this connection within within_s (whatever it answers first)."""
    sock.settimeout(within_s)
    deadline = time.monotonic() + within_s
    try:
        while time.monotonic() < deadline:
            if not sock.recv(65536):
                return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    except socket.timeout:
        return False
    return False


HALF_SENT = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{\"model\": "


# -- 2. connections ------------------------------------------------------------------------------------------

def test_a_compressed_body_however_small_is_made_ready_off_the_loop():
    """The attacker's F4 (2026-12-02): 32 KB of gzip inflated to 32 MiB on the event loop, the decision having been
    taken on the compressed size."""
    assert off_loop(32 << 10, "gzip", False) and off_loop(10, "deflate", False) and off_loop(10, " GZIP ", False)
    assert not off_loop(32 << 10, "", False) and not off_loop(32 << 10, "identity", False)
    assert off_loop(OFF_LOOP_BYTES + 1, "", False) and off_loop(10, "", True)


def test_the_connection_cap_leaves_room_in_the_fd_limit():
    for nofile in (400, 1024, 4096, 8448):
        cap = connection_cap(nofile)
        assert 2 * cap + 256 <= nofile < 2 * cap + 258  # clients and their upstreams, and 256 for the rest
    assert connection_cap(1024) == 384 and connection_cap(10**7) == 4096 and connection_cap(100) == 8


def test_limits_out_of_range_are_one_line_each(cli):
    for args in (("--client-timeout", "0"), ("--dump-max-bytes", "1000"), ("--max-body-bytes", "10")):
        status, out, err = cli("proxy", "-c", "none", *args)
        assert status == 78 and err.count("\n") == 1 and "--client-timeout 0.1 to 3600 s" in err, err


@pytest.mark.process
def test_a_crowd_of_half_sent_bodies_past_the_fd_limit_leaves_the_proxy_serving(rig):
    """More half-sent bodies than the proxy has descriptors: each new connection pushes out the oldest waiting
    one, so requests that arrive whole are served, and the log holds a line or two, not a traceback each."""
    upstream, proxy = rig(nofile=400)
    cap = connection_cap(400)
    crowd, failed = [], 0
    began = time.monotonic()
    while len(crowd) < 500 and failed < 5 and time.monotonic() - began < 60:
        sock = open_socket(proxy.port, HALF_SENT, timeout=1.0)
        failed = 0 if sock else failed + 1
        crowd += [sock] if sock else []
    try:
        assert len(crowd) == 500, f"the proxy stopped accepting after {len(crowd)} connections"
        for _ in range(20):
            assert send(proxy.port, "GET", "/health")[0].status == 200
            reply, data = send(proxy.port, "POST", "/v1/chat/completions", b'{"model": "tiny"}')
            assert reply.status == 200 and json.loads(data)["echo_bytes"] == 17
        assert metric(proxy, "gpuwarden_proxy_connections_max") == cap == 72
        assert metric(proxy, "gpuwarden_proxy_connections") <= cap
        assert metric(proxy, 'gpuwarden_proxy_failures_total{reason="evicted"}') >= 500 - cap
    finally:
        for sock in crowd:
            sock.close()
    assert send(proxy.port, "GET", "/health")[0].status == 200
    text = "\n".join(proxy.lines)
    assert "Traceback" not in text and "Too many open files" not in text, text[-3000:]
    assert len(proxy.lines) <= 8, proxy.lines  # the start lines and one per kind of fault


@pytest.mark.process
def test_requests_whose_clients_left_free_their_connections_to_the_engine_and_others_are_served(rig):
    """A client that sends a request and leaves ends it: its handler is cancelled
    (listener.Connection.connection_lost) and its
    connection to the engine closed, so the engine stops working for nobody. Before, with aiohttp 3.9 and later (the
    attacker's F1 of 2026-12-02), such requests held their connections to the engine until it answered, past the
    connection cap, which counts client connections only: the proxy's pool full, every new request waited 10 s for
    a 504 and was counted a suspect, and the look at /health timed out into an end of the engine that never was.
    Twice the pool here (the cap is 8 at 100 fds, the pool 12); a bound only for a hang."""
    upstream, proxy = rig(nofile=100)
    for n in range(24):
        sock = socket.create_connection(("127.0.0.1", proxy.port), timeout=5)
        sock.sendall(b"POST /slow?s=600 HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}")
        deadline = time.monotonic() + 60
        while upstream.get_json("/debug/open")["requests"] < n + 1 and time.monotonic() < deadline:
            time.sleep(0.02)  # the engine has it: then the client leaves
        sock.close()
        assert upstream.get_json("/debug/open")["requests"] == n + 1, f"request {n} never reached the engine"
    deadline = time.monotonic() + 60
    while upstream.get_json("/debug/open")["open"] and time.monotonic() < deadline:
        time.sleep(0.05)
    seen = upstream.get_json("/debug/open")
    assert seen["requests"] == 24 and seen["open"] == 0, seen
    reply, data = send(proxy.port, "POST", "/v1/chat/completions", b'{"model": "tiny"}')
    assert reply.status == 200 and json.loads(data)["echo_bytes"] == 17
    text = "\n".join(proxy.lines)
    assert "requests in flight at" not in text and "refusing client" not in text, text[-3000:]
    assert "every request is refused" not in text, text[-3000:]


@pytest.mark.process
def test_a_client_that_leaves_a_body_the_engine_does_not_read_leaves_no_connection_behind(rig):
    """The attacker's finding 1 of 2026-12-02, after F1's fix: a request whose client left was ended, but its
    connection to the engine, closed with body bytes still unsent, waited to write them for as long as the engine did
    not read (asyncio's close), its descriptor counted by nothing: 1,000 such clients in 22 s took the proxy to its
    fd limit, its looks at /health failed for want of descriptors and counted as ends. Such a connection is reset now
    (upstream.DropsUnsent): the proxy's descriptors come back to what they were. A bound only for a hang."""
    upstream, proxy = rig(nofile=100, rcvbuf=4096)  # the engine's window stays small: the rest waits at the proxy
    fds = lambda: len(os.listdir(f"/proc/{proxy.proc.pid}/fd"))  # noqa: E731
    send(proxy.port, "POST", "/v1/chat/completions", b'{"model": "tiny"}')  # the pool's first connection
    before, asked = fds(), upstream.get_json("/debug/open")["requests"]
    body = b"x" * (8 << 20)  # past what the kernel holds for the proxy (tcp_wmem's 4 MiB at most)
    for n in range(asked, asked + 12):
        sock = socket.create_connection(("127.0.0.1", proxy.port), timeout=5)
        sock.sendall(b"POST /deaf HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(body))
        sock.sendall(body)  # the proxy reads it whole, then sends it on: the engine reads almost none
        deadline = time.monotonic() + 60
        while upstream.get_json("/debug/open")["requests"] < n + 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        sock.close()
        assert upstream.get_json("/debug/open")["requests"] == n + 1, f"request {n} never reached the engine"
    deadline = time.monotonic() + 60
    while fds() > before + 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert fds() <= before + 2, (before, fds(), sorted(os.listdir(f"/proc/{proxy.proc.pid}/fd")))
    reply, data = send(proxy.port, "POST", "/v1/chat/completions", b'{"model": "tiny"}')
    assert reply.status == 200 and json.loads(data)["echo_bytes"] == 17
    text = "\n".join(proxy.lines)
    assert "requests in flight at" not in text and "refusing client" not in text, text[-3000:]


@pytest.mark.process
def test_a_pattern_slower_than_linear_costs_a_request_its_time_and_never_the_proxy(rig):
    """The attacker's F2 (2026-12-02): with `remove_patterns: ['\\s+$']`, one request of 150,000 spaces and an x held
    the proxy's loop until the daemon killed it, and five made it FATAL. Each such request now costs at most its
    patterns' time (normalize.PATTERNS_S, off the loop), goes to the engine as it came, and is one fault line."""
    upstream, proxy = rig("--remove-pattern", r"\s+$")
    body = json.dumps({"model": "tiny", "messages": [{"role": "system", "content": " " * 150_000 + "x"},
                                                    {"role": "user", "content": "hi"}]}).encode()
    pid = proxy.proc.pid
    for _ in range(5):
        reply, data = send(proxy.port, "POST", "/v1/chat/completions", body)
        assert reply.status == 200 and json.loads(data)["echo_bytes"] == len(body)  # as it came
        assert send(proxy.port, "GET", "/health")[0].status == 200
    assert last_upstream(upstream)[0] == body and proxy.proc.poll() is None and proxy.proc.pid == pid
    late = [line for line in proxy.lines if "remove_patterns took more than" in line]
    assert len(late) == 1 and "on 1 system text(s)" in late[0], proxy.lines  # once a minute


@pytest.mark.process
def test_past_the_cap_with_every_connection_served_a_new_one_gets_a_503(rig):
    upstream, proxy = rig(nofile=100, chunk_delay=0.02)  # the smallest cap: 8
    streams = []
    for _ in range(8):
        conn = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=10)
        conn.request("POST", "/v1/chat/completions", body=b'{"stream": true, "endless": true}')
        reply = conn.getresponse()
        assert reply.readline().startswith(b"data: ")
        streams.append((conn, reply))
    reply, data = send(proxy.port, "GET", "/health")
    assert reply.status == 503 and reply.getheader("Retry-After") == "1" and b"too many open connections" in data
    for conn, _ in streams:
        conn.close()
    deadline = time.monotonic() + 10
    while upstream.get_json("/debug/open")["open"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert send(proxy.port, "GET", "/health")[0].status == 200
    assert metric(proxy, 'gpuwarden_proxy_failures_total{reason="too_many_connections"}') == 1


@pytest.mark.process
def test_slow_headers_slow_bodies_and_idle_connections_are_closed_a_steady_body_is_not(rig):
    # 5 s windows: the steady body keeps its pace through a stall of 4 s of this test's thread (a busy box); with 1 s
    # windows, one stall of a second cut it
    upstream, proxy = rig("--client-timeout", "5")
    silent = open_socket(proxy.port)
    slow_headers = open_socket(proxy.port, b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
    slow_body = open_socket(proxy.port, HALF_SENT)
    # the attackers' bursts (2026-12-02): a body sent at once to near its end, then nothing, or a byte now and then:
    # the bytes sent earn no pause (an average-rate deadline was 65 s away); each window of 5 s must bring 80 KiB
    head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % (1 << 20)
    burst = open_socket(proxy.port, head + b"x" * ((1 << 20) - 1))
    trickle = open_socket(proxy.port, head + b"x" * ((1 << 20) - 100))
    # attacker 10's F1: a chunked body whose framing alone comes: a chunk-size line of endless zeros, no body byte
    padded = open_socket(proxy.port, b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                         b"Transfer-Encoding: chunked\r\n\r\n")
    kept_alive = open_socket(proxy.port, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    assert kept_alive.recv(65536).startswith(b"HTTP/1.1 200")
    body = json.dumps({"model": "tiny", "pad": "x" * (470 << 10)}).encode()
    steady = socket.create_connection(("127.0.0.1", proxy.port), timeout=30)  # its sends: a bound on a hang
    steady.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(body))
    trickled = 0
    for sock in (trickle, padded):  # never blocking this loop: a send that would wait is dropped (the steady pace)
        sock.setblocking(False)
    for at in range(0, len(body), 40 << 10):  # 80 KiB/s, over 6 s: past the 5 s deadline, above 16 KiB/s
        steady.sendall(body[at:at + (40 << 10)])
        with contextlib.suppress(OSError):  # a byte every half second: closed once a window brings too little
            trickle.sendall(b"x")
            trickled += 1
        with contextlib.suppress(OSError):  # 40 KiB of framing a half second: past the quota on the wire
            padded.sendall(b"0" * (40 << 10))
        time.sleep(0.5)
    steady.settimeout(30)
    assert steady.recv(65536).startswith(b"HTTP/1.1 200 OK"), proxy.lines
    for sock in (silent, slow_headers, slow_body, kept_alive, burst, trickle, padded):  # 5 s, swept every second
        assert closed_by_peer(sock, 30)
        sock.close()
    steady.close()
    for kind in ("idle", "slow_headers", "slow_body"):
        assert sum(f"connections closed ({kind})" in line for line in proxy.lines) <= 1
    assert [metric(proxy, f'gpuwarden_proxy_failures_total{{reason="{kind}"}}') for kind in
            ("idle", "slow_headers", "slow_body")] == [1, 1, 4]
    assert any("its body came slower than 16 KiB/s over 5 s" in line for line in proxy.lines), proxy.lines


def flood_head(proxy, before: bytes) -> None:
    """A request head of 100 header lines of 8 KB (after `before`): the proxy must close it on the way."""
    sock = open_socket(proxy.port, before + b"POST /v1/messages HTTP/1.1\r\nHost: x\r\n")
    with pytest.raises(OSError):
        for i in range(100):
            sock.sendall(b"X-Pad-%d: %s\r\n" % (i, b"v" * 8000))
            time.sleep(0.001)
    sock.close()


@pytest.mark.process
def test_headers_past_64_kib_close_the_connection(rig):
    """aiohttp alone takes 128 header lines of 8 KiB each (32,768 lines in 3.8): 380 such connections held 500 MB."""
    upstream, proxy = rig()
    flood_head(proxy, b"")
    assert metric(proxy, 'gpuwarden_proxy_failures_total{reason="big_headers"}') == 1
    headers = {f"X-Pad-{i}": "v" * 4000 for i in range(12)}  # 48 KiB: a big head, but within the limit
    assert send(proxy.port, "POST", "/v1/completions", b"{}", headers)[0].status == 200


@pytest.mark.process
def test_a_flood_of_malformed_requests_is_one_line_a_minute(rig):
    upstream, proxy = rig()
    for _ in range(300):
        sock = open_socket(proxy.port, b"NOT HTTP AT ALL\r\n\r\n")
        sock.settimeout(10)
        assert b" 400 Bad Request" in sock.recv(65536)
        sock.close()
    assert send(proxy.port, "GET", "/health")[0].status == 200
    time.sleep(0.3)
    assert "Traceback" not in "\n".join(proxy.lines), proxy.lines
    assert len(proxy.lines) <= 3 and sum("aiohttp.server" in line for line in proxy.lines) <= 1, proxy.lines


def test_faults_are_one_line_per_kind_per_minute_with_a_count(caplog):
    now = [0.0]
    faults = FaultLog(clock=lambda: now[0])
    faults.quiet(("asyncio",))
    try:
        with caplog.at_level(logging.INFO):
            for i in range(1000):
                faults.note("bad_json refusals (400)", f"request {i}: body is not JSON")
            faults.note("too_large refusals (413)", "over the cap")
            faults.flush()  # the minute is not over: nothing yet
            now[0] = 61
            faults.flush()
            faults.flush()  # said once
            for _ in range(100):  # what asyncio logs on each failed accept at the fd limit
                try:
                    raise OSError(24, "Too many open files")
                except OSError:
                    logging.getLogger("asyncio").error("socket.accept() out of system resource", exc_info=True)
            for _ in range(2):  # an exception from our own code: a bug, whose traceback is kept the first time
                try:
                    loads(b"{")
                except ValueError:
                    logging.getLogger("asyncio").error("Exception in callback", exc_info=True)
    finally:
        logging.getLogger("asyncio").removeFilter(faults._filter)
    records = caplog.records
    assert [r.name for r in records] == ["gpuwarden.proxy"] * 5  # asyncio's own records were taken
    assert [r.getMessage() for r in records[:3]] == [
        "proxy: request 0: body is not JSON", "proxy: over the cap",
        "proxy: 999 more bad_json refusals (400) in the last 60 s; the last: request 999: body is not JSON"]
    accept = records[3]
    assert accept.getMessage() == ("proxy: asyncio: socket.accept() out of system resource: OSError: [Errno 24] "
                                   "Too many open files")
    assert accept.exc_info is None  # asyncio's and aiohttp's own exceptions: one line, no traceback
    assert records[4].exc_info is not None and "JSONDecodeError" in records[4].getMessage()


# -- 3. memory -----------------------------------------------------------------------------------------------

def test_the_parse_cost_bounds_what_a_parse_takes():
    import tracemalloc

    for body in (b'{"a": [' + b"{}," * 100000 + b"{}]}", b'{"a": "' + "\U0001F600x".encode() * 100000 + b'"}',
                 b'{"a": [' + b"[[[[]]]]," * 50000 + b"1]}", b'{"a": [' + b'"ab",' * 100000 + b'"c"]}'):
        tracemalloc.start()
        parsed = loads(body)
        json.dumps(parsed, ensure_ascii=False).encode()
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert peak < parse_cost(body) < 60 * len(body)


def test_a_body_whose_parse_would_hold_the_loop_goes_on_unparsed():
    """Attacker 10's F2: the JSON parse holds the GIL on its worker thread, so the loop waits for it: 63 KB of gzip
    inflating to 32 MB of numbers held it half a second a body. Such a body goes on as it came, without the rules."""
    from gpuwarden.proxy.prepare import MAX_PARSE_VALUES, unparsed

    numbers = b'{"model": "m", "x": [' + b",".join([b"12345678"] * 300_000) + b"]}"
    assert f"more than {MAX_PARSE_VALUES}" in unparsed(numbers, numbers)  # plain, but 300,000 values
    padded = json.dumps({"model": "m", "pad": "x" * (4 << 20)}).encode()  # few values, 4 MB of one letter
    assert "more than 20 times" in unparsed(gzip.compress(padded), padded)  # from a few KB
    chat = json.dumps({"model": "m", "messages": [{"role": "user", "content": f"turn {i}: " + "word " * 200}
                                                  for i in range(300)]}).encode()
    assert unparsed(chat, chat) is None  # a long chat request, plain: parsed
    text = os.urandom(600 << 10).hex().encode()  # compressed within the ratio (about 2x): parsed
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": text.decode()}]}).encode()
    assert unparsed(gzip.compress(body), body) is None


def test_one_client_uses_at_most_its_share_of_the_budget_and_others_still_fit():
    """The attacker's critical finding (2026-12-02): twelve bodies of one client, each sent to its last byte and held
    open, took the whole budget and every other client's body got 503 for half an hour."""
    budget = Budget(1000, 250)
    assert budget.share == 250 and Budget(1000).share == 1000  # no share given: one client may use it all
    a1, a2 = budget.hold("10.0.0.1"), budget.hold("10.0.0.1")
    a1.take(200, "a1")
    with pytest.raises(Refusal) as share:
        a2.take(100, "a2")  # one client: 300 past its 250
    assert share.value.status == 503 and "this client's requests hold" in str(share.value)
    with pytest.raises(Refusal) as never:
        budget.hold("10.0.0.9").take(251, "alone")  # past any client's share: it never fits, 413
    assert never.value.status == 413
    others = [budget.hold(f"10.0.0.{n}") for n in (2, 3, 4)]
    for held in others:
        held.take(250, "another client's")  # each its own share, beside the first client's
    assert budget.used == 950 and budget.by_client["10.0.0.1"] == 200
    with pytest.raises(Refusal) as full:
        budget.hold("10.0.0.5").take(100, "a fifth")
    assert full.value.status == 503 and "the proxy is holding" in str(full.value)
    a1.keep(b"x" * 200)
    a1.lend()  # with the engine: a lent body is no client's share, and yields to anyone's
    a2.take(100, "a2")
    assert a1.body is None and budget.by_client["10.0.0.1"] == 100 and budget.used == 850
    for held in (a1, a2, *others):
        held.release()
    assert (budget.used, budget.lent, budget.by_client) == (0, 0, {})


def test_the_budget_refuses_what_does_not_fit_and_gives_back_what_was_held():
    budget = Budget(1000)
    a, b = budget.hold(), budget.hold()
    a.take(600, "a")
    with pytest.raises(Refusal) as busy:
        b.take(500, "b")
    assert busy.value.status == 503 and budget.used == 600
    b.take(300, "b")
    with pytest.raises(Refusal) as never:
        b.take(701, "b")  # with what it holds, more than the whole budget: never fits
    assert never.value.status == 413 and budget.used == 900
    b.release()
    a.release()
    b.take(1000, "b")
    b.release()
    assert budget.used == 0


@pytest.mark.process
def test_a_body_that_would_parse_too_big_is_never_parsed(rig):
    """8 MB of `[{},{},...]` parses to over 200 MB in CPython, and holds the loop while it parses: such a body (more
    values than a chat request has) goes on as it came, unparsed, without the rules, one fault line saying so."""
    upstream, proxy = rig("--max-body-bytes", str(8 << 20))
    body = b'{"a": [' + b"{}," * ((8 << 20) // 3 - 10) + b"{}]}"
    reply, data = send(proxy.port, "POST", "/v1/chat/completions", body)
    assert reply.status == 200 and json.loads(data)["echo_bytes"] == len(body), data[:300]
    assert last_upstream(upstream)[0] == body
    with open(f"/proc/{proxy.proc.pid}/status") as status:
        peak_kib = int(next(line for line in status if line.startswith("VmHWM:")).split()[1])
    assert peak_kib < 150 << 10, f"the proxy's peak RSS was {peak_kib >> 10} MiB"
    assert any("more than 250000" in line and "sent unchanged" in line for line in proxy.lines), proxy.lines[-5:]


@pytest.mark.process
def test_bodies_past_the_budget_get_503_with_retry_after_and_the_rest_are_served(rig):
    """A budget of 12 MiB, of which one client (this host's addresses are one) uses at most 10: the two left are
    the other clients' (the attacker's critical finding of 2026-12-02: one client held it all). A long client
    timeout: the held bodies wait for their last byte by design here, not because a client stalled."""
    upstream, proxy = rig("--max-body-bytes", str(1 << 20), "--client-timeout", "600")
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % (1 << 20)
    holding = [open_socket(proxy.port, head + b"x" * ((1 << 20) - 1)) for _ in range(10)]
    deadline = time.monotonic() + 30
    while (metric(proxy, "gpuwarden_proxy_body_bytes") or 0) < 10 * ((1 << 20) - 1) and time.monotonic() < deadline:
        time.sleep(0.05)
    reply, data = send(proxy.port, "POST", "/v1/chat/completions", json.dumps({"model": "tiny", "x": "y" * 4096}
                                                                              ).encode())
    assert reply.status == 503 and reply.getheader("Retry-After") == "1"
    assert metric(proxy, "gpuwarden_proxy_body_bytes") == 10 * ((1 << 20) - 1)
    message = json.loads(data)["error"]["message"]
    assert "retry" in message and "this client's requests hold 10 MiB" in message, message
    for sock in holding:  # the last byte: each is whole, sent on, and its share given back
        sock.sendall(b"x")
        sock.settimeout(30)
        assert sock.recv(65536).startswith(b"HTTP/1.1 200")
        sock.close()
    assert metric(proxy, "gpuwarden_proxy_body_bytes") == 0
    assert send(proxy.port, "POST", "/v1/chat/completions", b'{"model": "tiny"}')[0].status == 200


# -- 4. dumps ------------------------------------------------------------------------------------------------

def test_session_ids_become_safe_folder_names():
    names = {session_of({"metadata": {"user_id": uid}}, "anthropic", "127.0.0.1")
             for uid in ("..", ".", "../../etc", "a/b", "a_b", "a" * 300, "é", "x\x00y")}
    assert "a_b" in names and len(names) == 8
    for name in names:
        assert set(name) <= set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-") and len(name) <= 64
    assert session_of({}, "openai", "::1").startswith("openai-_1-")


@pytest.mark.process
def test_dumps_stay_within_their_bytes_across_a_restart_and_inside_the_directory(rig, tmp_path):
    dumps = tmp_path / "dumps"
    dumps.mkdir()
    big = claude_code_request(1)
    big["stream"] = False
    big["messages"][0]["content"][0]["text"] = "中" * (500 << 10)  # 1.5 MiB, twice in each dump
    for round_ in range(2):  # the second proxy finds the first one's dumps on disk
        upstream, proxy = rig("--dump-dir", str(dumps), "--dump-max-bytes", str(4 << 20), "--rules", "none")
        for _ in range(3):
            assert send(proxy.port, "POST", "/v1/messages", json.dumps(big).encode())[0].status == 200
        sizes = [f.stat().st_size for f in dumps.glob("*/*.json")]
        assert len(sizes) == 1 and sum(sizes) <= 4 << 20 and sizes[0] > 2 << 20
        proxy.stop()
        upstream.stop()
    upstream, proxy = rig("--dump-dir", str(dumps), "--dump-max-bytes", str(2 << 20))
    assert not list(dumps.glob("*/*.json"))  # over the new bound: pruned at the start, before any request
    body = claude_code_request(1)
    body["stream"], body["metadata"]["user_id"] = False, ".."
    assert send(proxy.port, "POST", "/v1/messages", json.dumps(body).encode())[0].status == 200
    assert [p.parent.parent for p in dumps.glob("*/*.json")] == [dumps]
    assert [p.name for p in tmp_path.iterdir()] == ["dumps"]
    assert send(proxy.port, "POST", "/v1/messages", json.dumps(big).encode())[0].status == 200
    assert len(list(dumps.glob("*/*.json"))) == 1  # the big one alone is over 2 MiB: not kept
    assert any("not kept: over --dump-max-bytes" in line for line in proxy.lines), proxy.lines


# -- 5. header and body fidelity -----------------------------------------------------------------------------

@pytest.mark.process
def test_compressed_bodies_reach_the_engine_decoded_on_normalized_paths_and_untouched_elsewhere(rig):
    upstream, proxy = rig("--max-body-bytes", str(1 << 20))
    raw = b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}'
    for coding, packed in (("gzip", gzip.compress(raw)), ("deflate", zlib.compress(raw))):
        reply, _ = send(proxy.port, "POST", "/v1/chat/completions", packed, {"Content-Encoding": coding})
        body, headers = last_upstream(upstream)
        assert reply.status == 200 and body == raw and "Content-Encoding" not in headers
    rules = claude_code_request(1)
    rules["stream"] = False
    send(proxy.port, "POST", "/v1/messages", gzip.compress(json.dumps(rules).encode()), {"Content-Encoding": "gzip"})
    body, headers = last_upstream(upstream)
    assert json.loads(body)["system"][0]["text"].startswith("You are Claude Code") and "Content-Encoding" not in headers
    packed = gzip.compress(raw)
    send(proxy.port, "POST", "/v1/completions", packed, {"Content-Encoding": "gzip"})
    body, headers = last_upstream(upstream)
    assert body == packed and headers["Content-Encoding"] == "gzip"  # not ours to open: passed as it came
    bomb = gzip.compress(b'{"a": "' + b"0" * (64 << 20) + b'"}')  # 64 KB that inflate to 64 MiB
    reply, data = send(proxy.port, "POST", "/v1/chat/completions", bomb, {"Content-Encoding": "gzip"})
    assert reply.status == 413 and "decompressed" in json.loads(data)["error"]["message"]
    reply, _ = send(proxy.port, "POST", "/v1/messages", raw, {"Content-Encoding": "br"})
    assert reply.status == 415


@pytest.mark.process
def test_headers_the_connection_header_names_are_not_passed_on(rig):
    upstream, proxy = rig()
    reply, _ = send(proxy.port, "POST", "/v1/completions", b"{}",
                    {"Connection": "keep-alive, X-Hop", "X-Hop": "for the proxy", "X-Keep": "for the engine",
                     "Proxy-Connection": "keep-alive", "X-Reply-Hop": "1"})
    headers = last_upstream(upstream)[1]
    assert reply.status == 200 and headers["X-Keep"] == "for the engine"
    assert "X-Hop" not in headers and "Proxy-Connection" not in headers
    assert reply.getheader("X-Engine") == "fake" and reply.getheader("X-Up-Hop") is None


@pytest.mark.process
def test_numbers_out_of_range_are_refused_not_sent_as_infinity(rig):
    upstream, proxy = rig()
    body = json.dumps(claude_code_request(1))[:-1] + ', "temperature": 1e999999}'
    reply, data = send(proxy.port, "POST", "/v1/messages", body.encode())
    assert reply.status == 400 and "1e999999 is out of range" in json.loads(data)["error"]["message"]
    reply, data = send(proxy.port, "POST", "/v1/chat/completions", b'{"model": "tiny", "temperature": NaN}')
    assert reply.status == 400 and "NaN is not a JSON number" in json.loads(data)["error"]["message"]
    assert upstream.get_json("/debug/open")["requests"] == 0


# -- 6. found by an attacker (the fixes' tests) --------------------------------------------------------------

def rss_kib(proc) -> int:
    with open(f"/proc/{proc.pid}/status") as status:
        return int(next(line for line in status if line.startswith("VmRSS:")).split()[1])


def pushed(sock, data, within_s) -> int:
    """How much of data the peer takes within within_s, without blocking on it."""
    sock.setblocking(False)
    sent, deadline = 0, time.monotonic() + within_s
    while sent < len(data) and time.monotonic() < deadline:
        try:
            sent += sock.send(data[sent:sent + (1 << 20)])
        except BlockingIOError:
            time.sleep(0.01)
        except OSError:
            break
    sock.setblocking(True)
    return sent


def stream_request(chunks) -> bytes:
    body = json.dumps({"model": "tiny", "stream": True, "chunks": chunks}).encode()
    return b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)


@pytest.mark.process
def test_requests_pipelined_behind_one_being_served_wait_past_one_head(rig):
    """aiohttp parses and queues up to 32 pipelined requests of 1 MB heads behind one being served: 20 such
    connections took the proxy from 44 MB to 1.24 GB. Past 64 KiB the proxy stops reading until it has answered;
    a few small requests pipelined are all answered, in order."""
    upstream, proxy = rig(chunk_delay=0.05)
    line = b"X-Pad-%03d: " + b"a" * 8000 + b"\r\n"
    big = b"GET /health HTTP/1.1\r\nHost: x\r\n" + b"".join(line % i for i in range(120)) + b"\r\n"
    before = rss_kib(proxy.proc)
    socks = []
    for _ in range(6):
        sock = open_socket(proxy.port, stream_request(60))  # 3 s of stream: served all along
        sock.settimeout(10)
        assert sock.recv(65536).startswith(b"HTTP/1.1 200")
        pushed(sock, big * 31, 0.5)
        socks.append(sock)
    time.sleep(0.5)
    grown = rss_kib(proxy.proc) - before
    for sock in socks:
        sock.close()
    assert grown < 64 << 10, f"the proxy grew by {grown >> 10} MiB"
    sock = open_socket(proxy.port, stream_request(3) + b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n" * 3)
    sock.settimeout(10)
    got = b""
    while got.count(b'"status": "ok"') < 3:
        data = sock.recv(65536)
        assert data, got
        got += data
    assert got.index(b"data: [DONE]") < got.index(b'"status": "ok"')
    sock.close()


@pytest.mark.process
def test_blank_lines_before_a_request_do_not_end_its_head(rig):
    """aiohttp skips blank lines before a request line: "\\r\\n\\r\\n" first must not read as the head's end."""
    upstream, proxy = rig()
    flood_head(proxy, b"\r\n\r\n")
    assert metric(proxy, 'gpuwarden_proxy_failures_total{reason="big_headers"}') == 1
    sock = open_socket(proxy.port, b"\r\n" * 40000)  # blank lines alone count against the head too
    assert closed_by_peer(sock, 10)
    sock.close()
    sock = open_socket(proxy.port, b"\r\n\r\nGET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    sock.settimeout(10)
    assert sock.recv(65536).startswith(b"HTTP/1.1 200")
    sock.close()


SLOW_ENGINE = """
import asyncio, sys
from aiohttp import web
async def answer(request):
    await request.read()
    if request.method == "POST":
        await asyncio.sleep(60)  # the body is in; the answer takes its time
    return web.json_response({"ok": 1})
app = web.Application(client_max_size=1 << 30)
app.router.add_route("*", "/{tail:.*}", answer)
web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), print=None, shutdown_timeout=0.5)
"""


@pytest.mark.process
def test_a_body_gives_its_budget_back_once_the_engine_has_it():
    """The budget was held until the engine's response headers: three bodies an engine took its time to answer
    held the whole budget, and every new request got 503."""
    from conftest import free_port, gpuwarden_cmd
    from test_proxy import Process

    up_port, proxy_port = free_port(), free_port()
    started = [Process([sys.executable, "-c", SLOW_ENGINE, str(up_port)], up_port, "/health")]
    socks = []
    try:
        started.append(Process([*gpuwarden_cmd(), "proxy", "-c", "none", "--upstream", f"http://127.0.0.1:{up_port}",
                                "--listen", f"127.0.0.1:{proxy_port}", "--max-body-bytes", str(1 << 20)], proxy_port))
        proxy = started[1]
        body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                           "pad": "x" * (900 << 10)}).encode()  # about 4.5 MiB with its parse: 3 fill 12 MiB
        for _ in range(4):  # one after another: each waits at the engine, its bytes given back
            socks.append(open_socket(proxy_port, b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body)))
            deadline = time.monotonic() + 10
            time.sleep(0.1)
            while (metric(proxy, "gpuwarden_proxy_body_bytes") or 0) > 0 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert metric(proxy, "gpuwarden_proxy_body_bytes") == 0
        for sock in socks:  # none was refused (three held the whole budget before): each waits at the engine
            sock.settimeout(0.2)
            with pytest.raises(socket.timeout):
                sock.recv(65536)
    finally:
        for sock in socks:
            sock.close()
        for p in reversed(started):
            p.stop()


@pytest.mark.process
def test_a_client_that_does_not_read_its_response_is_closed_and_the_engine_stops(rig):
    upstream, proxy = rig("--client-timeout", "1", chunk_delay=0)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", proxy.port))
    body = b'{"stream": true, "endless": true}'
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and not metric(proxy, 'gpuwarden_proxy_failures_total{reason="stalled_reader"}'):
        time.sleep(0.2)
    assert metric(proxy, 'gpuwarden_proxy_failures_total{reason="stalled_reader"}') == 1
    while upstream.get_json("/debug/open")["open"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert upstream.get_json("/debug/open")["open"] == 0
    sock.close()
    assert send(proxy.port, "GET", "/health")[0].status == 200
    assert "Traceback" not in "\n".join(proxy.lines), proxy.lines


def test_rules_pass_bodies_of_the_wrong_shape_through():
    for body in ({"messages": 5}, {"messages": {"role": "system"}}, {"messages": "system"}, {"system": 5},
                 {"messages": [5, {"role": "system", "content": 5}]}, {"tools": "x", "system": [5, {"text": 1}]}):
        for api in ("openai", "anthropic"):
            kept = json.loads(json.dumps(body))
            assert not apply(kept, api, Rules(date_line=True)) and kept == body


def test_a_rule_that_fails_sends_the_body_unchanged_and_its_dump_is_not_left_behind(tmp_path, monkeypatch):
    from gpuwarden.proxy import prepare, server
    from gpuwarden.proxy.dump import Dumper

    def broken(body, api, rules):
        raise TypeError("a shape no rule expected")

    monkeypatch.setattr(prepare, "apply", broken)
    dumper = Dumper(tmp_path / "d", keep=10, max_bytes=1 << 20)
    proxy = server.Proxy("http://127.0.0.1:1", Rules(), server.ProxyMetrics((None, None)), dumper=dumper)
    raw = b'{"model": "m", "messages": 5}'
    held = proxy.budget.hold()
    assert proxy.prepare("openai", bytearray(raw), "", held, "127.0.0.1", "/v1/chat/completions") == raw
    assert not list((tmp_path / "d").glob("*/*")) and dumper._bytes == 0


@pytest.mark.process
def test_a_body_of_the_wrong_shape_goes_through_and_its_dump_is_counted(rig, tmp_path):
    upstream, proxy = rig("--dump-dir", str(tmp_path / "d"), "--dump-max-bytes", str(1 << 20))
    raw = json.dumps({"model": "m", "messages": 5, "pad": "x" * (300 << 10)}).encode()
    for _ in range(6):  # 600 KiB a dump: never more than one kept within 1 MiB
        reply, _ = send(proxy.port, "POST", "/v1/chat/completions", raw)
        assert reply.status == 200 and last_upstream(upstream)[0] == raw
    assert sum(f.stat().st_size for f in (tmp_path / "d").glob("*/*.json")) <= 1 << 20
    assert "Traceback" not in "\n".join(proxy.lines), proxy.lines


def test_no_session_folder_reads_as_an_option():
    for uid in ("-rf", "--help", "-", "-a/b", "-" * 64):
        name = session_of({"metadata": {"user_id": uid}}, "anthropic", "127.0.0.1")
        assert not name.startswith("-") and len(name) <= 64
    assert session_of({"metadata": {"user_id": "a-b"}}, "anthropic", None) == "a-b"


def test_every_gzip_member_is_decoded_and_deflate_with_trailing_bytes_is_refused():
    budget = Budget(1 << 20)
    held = budget.hold()
    assert decode(gzip.compress(b'{"a": ') + gzip.compress(b'1}'), "gzip", 1 << 10, held) == b'{"a": 1}'
    assert held.bytes == 8
    with pytest.raises(Refusal) as refused:
        decode(zlib.compress(b"{}") + zlib.compress(b"[]"), "deflate", 1 << 10, held)
    assert refused.value.status == 400
    with pytest.raises(Refusal) as refused:  # the members together past the limit
        decode(gzip.compress(b"x" * 600) + gzip.compress(b"y" * 600), "gzip", 1 << 10, held)
    assert refused.value.status == 413
