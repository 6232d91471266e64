"""A query of death (issue 51): a request that crashes the engine is never sent to the next engine, and a FATAL engine
is answered 503 at once. The proxy's choice after a failed try and its book of the engine's ends with their clients
(proxy/casualties.py), the hold told the engine is not restarting (proxy/hold.py), the daemon's word of it
(serving/run/fronts.py); then the daemon, the fake engine (tests/harness/fakechild.py, killer and crash modes) and the
real proxy as processes."""

import asyncio
import http.client
import json
import socket
import threading
import time
import urllib.request

import pytest

from conftest import free_port
from gpuwarden.proxy.body import Refusal
from gpuwarden.proxy.casualties import BROKE, ENDED, HOLD, RESEND, UNREACHABLE, Casualties, after_failure
from gpuwarden.proxy.hold import NOT_RESTARTING_RETRY_S, Hold
from gpuwarden.serving.run.spec import DOWN_SIGNAL, UP_SIGNAL
from gpuwarden.serving.run.supervisor import FATAL, HELD, RUNNING
from test_faults import fake, fault_config, no_fakes_left  # noqa: F401 (fixtures)
from test_planned_restart import engine_and_proxy

CHAT = "/v1/chat/completions"
SECRET = "sk-test-4f1d2b0e9c"  # an API key the journal must never show


# -- the proxy's choice after a try that failed before its answer began (no process) ------------------------------

def test_a_request_the_engine_may_have_seen_is_never_held_for_the_next_engine():
    def verdict(connected, seen=False, reused=False, resent=False, engine_down=True, hold_on=True):
        return after_failure(connected=connected, seen=seen, reused=reused, resent=resent, engine_down=engine_down,
                             hold_on=hold_on)

    # refused at connect, never seen: held for the next engine (or 502 without a hold)
    assert verdict(False) == HOLD and verdict(False, hold_on=False) == UNREACHABLE
    # the connection was open and the engine is gone: it ended while serving this request
    for reused in (False, True):
        for hold_on in (False, True):
            assert verdict(True, reused=reused, hold_on=hold_on) == ENDED
    # refused now, after an earlier try had reached it: never held either
    assert verdict(False, seen=True, resent=True) == ENDED
    assert verdict(False, seen=True, resent=True, engine_down=False) == BROKE
    # closed unanswered while its /health answers: once more at once only on a pooled connection (its keep-alive
    # timer), never twice, never on a fresh connection
    assert verdict(True, reused=True, engine_down=False) == RESEND
    assert verdict(True, engine_down=False) == BROKE
    assert verdict(True, seen=True, reused=True, resent=True, engine_down=False) == BROKE


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def test_a_client_in_flight_at_two_of_the_engines_ends_is_named_once_per_end():
    clock = Clock()
    book = Casualties(clock, window_s=600)
    # the first end: two requests of one client and one of another in flight; nobody named yet
    assert book.ended("10.0.0.7", sent_at=990) is None
    assert book.ended("10.0.0.7", sent_at=995) is None  # the same end: sent before it was seen
    assert book.ended("10.0.0.8", sent_at=999) is None
    clock.now = 1100.0  # the second end: a request sent after the first end was seen
    named = book.ended("10.0.0.7", sent_at=1090)
    assert named == (2, 2)  # this client at 2 of the 2 ends
    assert book.ended("10.0.0.7", sent_at=1091) is None  # named once per end
    assert book.ended("10.0.0.9", sent_at=1095) is None  # another client's first
    clock.now = 1650.0  # the first end is past the window: this client's ends are the second and this one
    assert book.ended("10.0.0.7", sent_at=1640) == (2, 2)
    clock.now = 2400.0  # all forgotten: a first end again
    assert book.ended("10.0.0.7", sent_at=2390) is None


def test_the_book_of_clients_is_bounded():
    clock = Clock()
    book = Casualties(clock, window_s=600, max_clients=4)
    for n in range(3):
        clock.now += 10
        for c in range(10):
            book.ended(f"10.0.{n}.{c}", sent_at=clock.now - 1)
    assert len(book._clients) <= 4 and len(book._ends) == 3


class Histogram:
    def observe(self, value):
        pass


class Request:
    transport = object()  # a client still there


def test_told_the_engine_is_not_restarting_the_held_and_the_new_get_503_with_retry_after_at_once():
    async def scenario():
        async def never():
            return False

        clock = Clock()
        hold = Hold(300, 10, never, Histogram(), clock=clock)
        held = asyncio.ensure_future(hold.wait(Request(), clock.now))
        await asyncio.sleep(0)  # it waits
        assert len(hold.waiting) == 1 and not held.done()
        hold.engine_not_restarting()
        with pytest.raises(Refusal) as caught:
            await held
        assert caught.value.status == 503 and caught.value.retry_after == NOT_RESTARTING_RETRY_S
        with pytest.raises(Refusal) as caught:  # a new one: at once, clock unmoved
            await hold.wait(Request(), clock.now)
        assert caught.value.reason == "engine_not_restarting"
        hold.engine_up()  # an engine is healthy again: requests wait for it once more
        again = asyncio.ensure_future(hold.wait(Request(), clock.now))
        await asyncio.sleep(0)
        assert not again.done() and len(hold.waiting) == 1
        again.cancel()
        await asyncio.gather(again, return_exceptions=True)
        await hold.stop()

    asyncio.run(scenario())


def test_the_daemon_tells_the_proxy_when_the_engine_is_fatal_or_held_and_when_it_is_back(tmp_path):
    both, engine, proxy, ops, clock = engine_and_proxy(tmp_path)

    def words():
        return [sig for _, pid, sig in ops.sent if pid == proxy.child.pid]

    both.tick(clock.now)
    assert words() == [UP_SIGNAL] * 2
    for _ in range(8):  # the engine dies at each start: FATAL (its crash loop)
        if engine.child is not None:
            ops.exit[engine.child.pid] = 1
            ops.groups[engine.child.pid] = []
        clock.advance(2)
        both.tick(clock.now)
    assert engine.state == FATAL
    both.tick(clock.now)
    both.tick(clock.now)
    assert words() == [UP_SIGNAL] * 2 + [DOWN_SIGNAL] * 2  # told twice, a tick apart, then no more
    engine.reset(clock.now)  # SIGHUP: it starts again, and is healthy
    ops.exit.clear()
    for _ in range(3):
        clock.advance(1)
        both.tick(clock.now)
    assert engine.state == RUNNING and words()[-2:] == [UP_SIGNAL] * 2
    engine.hold(clock.now, "waiting for GPU0's action: reset the GPU (double-bit ECC error)")
    both.tick(clock.now)
    both.tick(clock.now)
    assert engine.state == HELD and words()[-2:] == [DOWN_SIGNAL] * 2


# -- the daemon, the fake engine and the real proxy ------------------------------------------------------------

def served_config(write, fake, mode, serve_extra="", hold_s=300):
    path, base, port = fault_config(write, fake, mode, serve_extra=serve_extra)
    proxy_port = free_port()
    path.write_text(path.read_text() + f"  proxy: {{enabled: true, listen: '127.0.0.1:{proxy_port}', "
                                       f"hold_s: {hold_s}}}\n")
    return path, base, port, proxy_port


class Call(threading.Thread):
    """One chat request through the proxy, in a thread, from a given loopback address: its status, Retry-After and
    body, or the error it ended with, and how long it took."""

    def __init__(self, port, prompt, source="127.0.0.1", stream=False, timeout=120):
        super().__init__(daemon=True)
        self.port, self.source, self.timeout = port, source, timeout
        self.body = json.dumps({"model": "m", "stream": stream, "messages": [{"role": "user", "content": prompt}]})
        self.status = self.retry_after = self.data = self.error = self.took = None
        self.start()

    def run(self):
        began = time.monotonic()
        try:
            conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=self.timeout,
                                              source_address=(self.source, 0))
            conn.request("POST", CHAT, body=self.body, headers={"Authorization": f"Bearer {SECRET}",
                                                                "Content-Type": "application/json"})
            reply = conn.getresponse()
            self.status, self.retry_after = reply.status, reply.getheader("Retry-After")
            self.data = reply.read()
            conn.close()
        except Exception as exc:  # noqa: BLE001 - kept for the assertion
            self.error = exc
        self.took = time.monotonic() - began

    def result(self):
        self.join(self.timeout + 10)
        return self.status, self.retry_after, self.data, self.error


def proxy_metric(port, name):
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " ")
               or line.startswith(name + "{"))


def healthy(d, after=0):
    """The index of the next "vLLM healthy after" line from after on (a bound for a hang, not a speed)."""
    return d.wait_index("vLLM healthy after", timeout=60, after=after)


def serving_behind_the_proxy(write, fake, daemons, proxy_daemon, mode="killer"):
    """A daemon serving the fake engine in mode behind its proxy, an ordinary request answered 200 through it:
    (the daemon, its first healthy line's index, its config, the engine's port, the proxy's port)."""
    path, _, port, proxy_port = served_config(write, fake, mode)
    command, env = proxy_daemon
    d = daemons(path, command=command, env=env)
    first = healthy(d)
    d.wait_for("the proxy healthy after", timeout=60)
    status, _, data, error = Call(proxy_port, "fine, thanks").result()
    assert status == 200, (status, data, error)
    return d, first, path, port, proxy_port


def exits(d) -> int:
    """The engine's ends by a query of death, healthy or still starting (the proxy may see it healthy first)."""
    return sum(("vLLM exited with exit status 4" in line or "vLLM died while starting with exit status 4" in line)
               for line in d.lines)


def settled(d, proxy_port, crashes):
    """The engine is back after `crashes` ends in all: healthy again, an ordinary request answered 200, nothing held
    now (a killer held for the next engine would be), and no end more."""
    wait = time.monotonic() + 60
    while exits(d) < crashes and time.monotonic() < wait:
        time.sleep(0.1)
    assert exits(d) == crashes, d.log
    healthy(d, max(i for i, line in enumerate(d.lines) if "with exit status 4" in line))
    status, _, data, error = Call(proxy_port, "fine, thanks").result()
    assert status == 200, (status, data, error)
    time.sleep(1.5)  # three of the hold's looks at /health: a held request would have gone to this engine by now
    assert proxy_metric(proxy_port, "gpuwarden_proxy_held_requests") == 0 and exits(d) == crashes, d.log


@pytest.mark.process
def test_a_query_of_death_crashes_the_engine_once_and_its_client_gets_502_at_once(write, fake, daemons, proxy_daemon,
                                                                                   no_fakes_left):
    """The killer's request is answered 502 as soon as the engine ends, never held for the next engine (hold_s is
    300 s): the engine is restarted once and serves the next request. The same client's second killer ends the
    second engine, and the journal names the client by its address, never the prompt nor the API key."""
    d, first, path, port, proxy_port = serving_behind_the_proxy(write, fake, daemons, proxy_daemon)
    killer = Call(proxy_port, "please QOD-NOW now")
    status, _, data, error = killer.result()
    assert status == 502, (status, data, error)
    assert "the engine ended while serving this request" in json.loads(data)["error"]["message"]
    assert killer.took < 60  # not held: its hold_s is 300 s (a bound a busy box cannot cross the wrong way)
    second = healthy(d, first + 1)  # restarted, once
    status, _, data, error = Call(proxy_port, "fine, thanks").result()
    assert status == 200 and json.loads(data)["choices"][0]["message"]["content"] == "fine", (status, data, error)
    assert proxy_metric(proxy_port, "gpuwarden_proxy_held_seconds_count") == 0  # the killer was never held
    log = "\n".join(d.lines)
    assert exits(d) == 1, log
    # the same client, again: the second engine ends, the client is named
    status, _, data, error = Call(proxy_port, "and QOD-NOW again").result()
    assert status == 502, (status, data, error)
    d.wait_for("client 127.0.0.1 had requests in flight at 2 of the engine's 2 ends", timeout=30)
    healthy(d, second + 1)
    status, _, data, error = Call(proxy_port, "fine, thanks").result()
    assert status == 200, (status, data, error)
    log = "\n".join(d.lines)
    assert exits(d) == 2 and "FATAL" not in log, log
    assert "QOD" not in log and SECRET not in log  # no prompt, no header in the journal
    assert d.stop() == 0


@pytest.mark.process
def test_after_fatal_the_proxy_answers_503_with_retry_after_at_once_not_after_hold_s(write, fake, daemons,
                                                                                      proxy_daemon, no_fakes_left):
    """An engine that dies at each start ends FATAL; a request held meanwhile and a new one after it are answered
    503 with Retry-After long before the proxy's hold_s (300 s)."""
    path, base, port, proxy_port = served_config(write, fake, "crash", serve_extra="  crash_loop_failures: 3\n")
    command, env = proxy_daemon
    d = daemons(path, command=command, env=env)
    d.wait_for("the proxy healthy after", timeout=60)
    held = Call(proxy_port, "fine, thanks")  # the engine is down: held (or refused at once, if FATAL came first)
    d.wait_for("vLLM FATAL, not restarting until SIGHUP", timeout=60)
    status, retry_after, data, error = held.result()
    assert status == 503 and retry_after and held.took < 120, (status, retry_after, data, error, held.took)
    late = Call(proxy_port, "fine, thanks")
    status, retry_after, data, error = late.result()
    assert status == 503 and int(retry_after) >= 1 and late.took < 60, (status, retry_after, data, error)
    assert "not restarting" in json.loads(data)["error"]["message"]
    assert d.stop() == 0


@pytest.mark.process
def test_no_killer_is_sent_again_mid_stream_slow_bodiless_gone_or_from_two_clients(write, fake, daemons,
                                                                                     proxy_daemon, no_fakes_left):
    """The attacks on the rule: a killer that crashes the engine after its stream began, one whose engine dies 2 s
    after closing the connection, a GET with no body (aiohttp resends those by itself), one whose client left at once,
    and two killers from two clients at once: each crashes at most one engine, and none is held for the next."""
    path, base, port, proxy_port = served_config(write, fake, "killer", serve_extra="  crash_loop_failures: 20\n")
    command, env = proxy_daemon
    d = daemons(path, command=command, env=env)
    healthy(d)
    d.wait_for("the proxy healthy after", timeout=60)
    # mid-stream: the stream is cut where it is, never finished, never sent again
    conn = http.client.HTTPConnection("127.0.0.1", proxy_port, timeout=60)
    conn.request("POST", CHAT, body=json.dumps({"stream": True, "messages": [{"role": "user",
                                                                              "content": "QOD-MIDSTREAM"}]}))
    reply = conn.getresponse()
    assert reply.status == 200 and reply.readline().startswith(b"data: ")
    with pytest.raises(http.client.IncompleteRead):
        reply.read()
    conn.close()
    settled(d, proxy_port, 1)
    # its engine dies 2 s after closing the connection, its /health up meanwhile: 502 at once, never sent again
    slow = Call(proxy_port, "QOD-SLOW")
    status, _, data, error = slow.result()
    assert status == 502 and slow.took < 60, (status, data, error)
    settled(d, proxy_port, 2)
    # a GET, no body
    conn = http.client.HTTPConnection("127.0.0.1", proxy_port, timeout=60)
    conn.request("GET", "/v1/models?QOD-NOW")
    reply = conn.getresponse()
    assert reply.status == 502 and b"the engine ended while serving this request" in reply.read()
    conn.close()
    settled(d, proxy_port, 3)
    # its client leaves as soon as it sent it
    body = json.dumps({"messages": [{"role": "user", "content": "QOD-NOW"}]}).encode()
    sock = socket.create_connection(("127.0.0.1", proxy_port))
    sock.sendall(b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" % (CHAT.encode(), len(body), body))
    sock.close()
    wait = time.monotonic() + 10  # it reaches the engine and ends it (aiohttp 3.9+ ends the handler), or is dropped
    while exits(d) == 3 and time.monotonic() < wait:
        time.sleep(0.1)
    settled(d, proxy_port, exits(d))  # not held, whichever
    assert exits(d) in (3, 4)
    before = exits(d)
    # two clients, two killers at once: each ends at most one engine (one that came while the engine was down was
    # never seen by it, and goes to the next)
    killers = [Call(proxy_port, "QOD-NOW", source=source) for source in ("127.0.0.2", "127.0.0.3")]
    for killer in killers:
        status, _, data, error = killer.result()
        assert status == 502 and killer.took < 60, (status, data, error)
    wait = time.monotonic() + 30  # the daemon sees an exit a poll or two after the proxy answered
    while exits(d) == before and time.monotonic() < wait:
        time.sleep(0.1)
    time.sleep(1.0)  # both answered, so each engine they ended has ended: its exit is logged by now
    settled(d, proxy_port, exits(d))
    assert exits(d) - before in (1, 2), d.log
    assert "FATAL" not in d.log and "QOD" not in d.log
    assert d.stop() == 0
