"""A query of death (issue 51): a request that crashes the engine is never sent to the next engine, and a FATAL engine
is answered 503 at once. The proxy's choice after a failed try and its book of the engine's ends with their clients
(proxy/casualties.py), an answer that failed just before an end counted as in flight at it (proxy/ends.py), the hold
told the engine is not restarting (proxy/hold.py), the daemon's word of it (serving/run/fronts.py); then the daemon,
the fake engine (tests/harness/fakechild.py, killer and crash modes) and the real proxy as processes."""

import asyncio
import http.client
import json
import shutil
import socket
import struct
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from conftest import free_port
from gpuwarden.base.peers import THIS_HOST
from gpuwarden.proxy.body import Refusal
from gpuwarden.proxy import ends as ends_module
from gpuwarden.proxy.casualties import (ANSWERS_MAX, BROKE, END_AFTER_5XX_S, ENDED, HOLD, NO_ADDRESS, RESEND,
                                        TAIL_BYTES, UNREACHABLE, Casualties, after_failure, client_of, failed, tail_of)
from gpuwarden.proxy.ends import Ends
from gpuwarden.proxy.refusals import error_body, error_response
from gpuwarden.proxy.hold import NOT_RESTARTING_RETRY_S, Hold
from gpuwarden.serving.run.spec import DOWN_SIGNAL, UP_SIGNAL
from gpuwarden.serving.run.supervisor import FATAL, HELD, RUNNING
from test_faults import fake, fault_config, no_fakes_left  # noqa: F401 (fixtures)
from test_planned_restart import engine_and_proxy
from harness.book import CHAT, Clock, FakeHold, Peer, refusal

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


# -- a client in flight at N of the engine's ends is refused for the rest of the window (no process) ---------------

def test_a_client_in_flight_at_n_ends_is_refused_with_retry_after_until_the_window_lets_it_go(caplog):
    clock = Clock()
    book = Casualties(clock, window_s=600, refuse_after=2, wall=lambda: 0.0)
    assert book.ended("10.0.0.7", sent_at=990) is None  # its first end, and another client's
    book.note("10.0.0.8", sent_at=995, what="POST /v1/messages")
    assert refusal(book, "10.0.0.7") is None and refusal(book, "10.0.0.8") is None
    clock.now = 1100.0
    with caplog.at_level("WARNING", logger="gpuwarden.proxy"):
        book.note("10.0.0.7", sent_at=1090, what="POST /v1/chat/completions")  # its second: refused from now on
        book.note("10.0.0.7", sent_at=1091, what="POST /v1/chat/completions")  # the same end: no line more
    refused = refusal(book, "10.0.0.7")
    assert refused.status == 429 and refused.reason == "client_refused"
    assert refused.retry_after == 501  # its oldest counted end (1000) leaves the window at 1600
    assert book.until("10.0.0.7") == 1600.0
    assert "in flight at 2 of the engine's ends in the last 600 s" in str(refused)
    assert refusal(book, "10.0.0.8") is None  # in flight at one end only: served
    lines = [r.getMessage() for r in caplog.records if "refusing client" in r.getMessage()]
    assert len(lines) == 1 and lines[0].startswith("proxy: refusing client 10.0.0.7 for 500 s, until 1970-"), lines
    assert "2 of the engine's ends in the last 600 s" in lines[0]
    clock.now = 1599.5
    assert refusal(book, "10.0.0.7").retry_after == 1
    clock.now = 1600.0
    assert refusal(book, "10.0.0.7").retry_after == 1  # still in the window at its very edge
    clock.now = 1600.5  # the end of 1000 has left the window: served again, at one end
    assert refusal(book, "10.0.0.7") is None
    caplog.clear()
    clock.now = 1700.0  # one more end: two within the window (1100, 1700) again, a new refusal and its own line
    with caplog.at_level("WARNING", logger="gpuwarden.proxy"):
        book.note("10.0.0.7", sent_at=1690, what="POST /v1/chat/completions")
    assert refusal(book, "10.0.0.7").retry_after == 1  # until 1100 + 600 = 1700
    assert sum("refusing client 10.0.0.7" in r.getMessage() for r in caplog.records) == 1


def test_a_later_end_while_refused_makes_it_longer_without_a_second_line(caplog):
    clock = Clock()
    book = Casualties(clock, window_s=600, refuse_after=2)
    with caplog.at_level("WARNING", logger="gpuwarden.proxy"):
        for at in (1000.0, 1100.0, 1200.0):  # a stream still running when it was refused, caught by a third end
            clock.now = at
            book.note("10.0.0.7", sent_at=at - 1, what="POST /v1/messages")
    assert refusal(book, "10.0.0.7").retry_after == 501  # until the second newest (1100) leaves: 1700
    assert sum("refusing client" in r.getMessage() for r in caplog.records) == 1


def test_refuse_after_one_and_zero():
    clock = Clock()
    once = Casualties(clock, window_s=600, refuse_after=1)
    never = Casualties(clock, window_s=600, refuse_after=0)
    for n in range(10):
        clock.now += 10
        for book in (once, never):
            book.ended("10.0.0.7", sent_at=clock.now - 1)
        assert refusal(once, "10.0.0.7").retry_after == 601
        assert refusal(never, "10.0.0.7") is None  # 0: never, however many ends
    clock.now += 10
    assert never.ended("10.0.0.7", sent_at=clock.now - 1) == (11, 11)  # still named in the journal


def test_the_refused_are_bounded_with_the_book():
    clock = Clock()
    book = Casualties(clock, window_s=600, max_clients=4, refuse_after=2)
    for clients in (range(10), range(6, 10)):  # ten at the first end, the four the book kept at the second too
        clock.now += 10
        for c in clients:
            book.ended(f"10.0.0.{c}", sent_at=clock.now - 1)
    assert len(book._clients) == 4
    everyone = [f"10.0.0.{c}" for c in range(10)]
    assert [c for c in everyone if refusal(book, c)] == everyone[6:]  # at two ends: refused
    for c in range(4):  # four others at an end push the refused out: one client with many addresses is not stopped
        book.ended(f"10.0.2.{c}", sent_at=clock.now - 1)
    assert len(book._clients) == 4 and not any(refusal(book, c) for c in everyone)
    clock.now += 601
    book.ended("10.0.1.1", sent_at=clock.now - 1)  # an end forgets what left the window
    assert list(book._clients) == ["10.0.1.1"]


def test_the_client_is_the_peer_address_never_a_header():
    class Peer:
        def __init__(self, remote):
            self.remote, self.headers = remote, {"X-Forwarded-For": "10.9.9.9", "X-Real-IP": "10.9.9.8"}

    assert client_of(Peer("10.0.0.7")) == "10.0.0.7" and client_of(Peer("::ffff:10.0.0.7")) == "10.0.0.7"
    # one client would be many: an IPv6 host's /64, and a local user's addresses (all of this host's: peers.host_of)
    assert client_of(Peer("2001:db8:1:2::7")) == client_of(Peer("2001:db8:1:2:ffff::1")) == "2001:db8:1:2::/64"
    assert client_of(Peer("127.0.0.3")) == client_of(Peer("127.9.9.9")) == client_of(Peer("127.0.0.1")) == THIS_HOST
    assert client_of(Peer("")) == client_of(Peer(None)) == NO_ADDRESS  # a Unix socket: one client, all of them


# -- an answer that failed just before the engine ended: in flight at that end (no process) --------------------------
# vLLM 0.32 answers the requests in flight when its EngineCore dies 500 (a stream: an error event, then [DONE]), and
# only then ends: the killer's client gets an answer, never a cut.

CHAT_500 = ("POST " + CHAT, 500)
VLLM_ERROR_EVENT = (b'data: {"error": {"message": "EngineCore encountered an issue. See stack trace (above) for the '
                    b'root cause.", "type": "InternalServerError", "param": null, "code": 500}}\n\n')


def test_a_5xx_answer_followed_by_an_end_within_the_bound_is_in_flight_at_it(caplog):
    clock = Clock()
    book = Casualties(clock, window_s=600, refuse_after=2, wall=lambda: 0.0)
    assert book.answered("10.0.0.7", 999.0, *CHAT_500) and book.answers_pending
    assert not book.end_open
    clock.now += END_AFTER_5XX_S  # seen down at the bound's very edge: counted
    assert book.engine_seen_down() == 1 and book.end_open and not book.answers_pending
    assert [end for end, _ in book._clients["10.0.0.7"].ends] == [1] and refusal(book, "10.0.0.7") is None
    assert book.engine_seen_down() == 0  # counted once: its answer is gone from the book
    book.engine_seen_up()
    assert not book.end_open
    clock.now = 1100.0  # the next engine answers its next request 500 (a stream's error event) and is seen down
    assert book.answered("10.0.0.7", 1099.0, "POST /v1/messages", 200, b"event: message_start\ndata: {}\n\n"
                         b'event: error\ndata: {"type":"error","error":{"type":"internal_error","message":"x"}}\n\n')
    clock.now = 1100.5
    with caplog.at_level("WARNING", logger="gpuwarden.proxy"):
        assert book.engine_seen_down() == 1
    refused = refusal(book, "10.0.0.7")
    assert refused.status == 429 and refused.retry_after == 510  # its first end (seen at 1010) leaves at 1610
    lines = [r.getMessage() for r in caplog.records]
    assert any("client 10.0.0.7 had requests in flight at 2 of the engine's 2 ends" in line
               and "POST /v1/messages" in line for line in lines), lines
    assert sum("refusing client 10.0.0.7" in line for line in lines) == 1


def test_a_5xx_answer_the_engine_outlived_past_the_bound_counts_nobody():
    clock = Clock()
    book = Casualties(clock, window_s=600, refuse_after=1)
    book.answered("10.0.0.7", 999.0, *CHAT_500)
    clock.now += END_AFTER_5XX_S + 0.5  # the engine still answered its /health meanwhile, or was not looked at
    assert not book.answers_pending
    assert book.engine_seen_down() == 0 and "10.0.0.7" not in book._clients and refusal(book, "10.0.0.7") is None
    assert not book.end_open  # no end counted nobody: none opened either


def test_an_answer_that_did_not_fail_is_never_in_flight_at_an_end():
    clock = Clock()
    book = Casualties(clock, window_s=600, refuse_after=1)
    events = b'data: {"choices": [{"index": 0, "delta": {"content": "Hel"}}]}\n\ndata: [DONE]\n\n'
    # the model's text quoting an error event: JSON-escaped within a data line, never an event of its own
    quoted = (b'data: {"choices": [{"index": 0, "delta": {"content": "data: {\\"error\\": {\\"code\\": 500}}\\n'
              b'event: error"}}]}\n\ndata: [DONE]\n\n')
    for status, tail in ((200, b""), (200, events), (200, quoted), (201, b""), (404, b""), (429, b""),
                         (503, b""),  # an engine starting, draining or busy: the hold's, not an end's
                         (200, b'data: {"error": {"message": "bad", "type": "BadRequestError", "code": 400}}\n\n')):
        assert not book.answered("10.0.0.7", 999.0, "POST " + CHAT, status, tail), (status, tail)
    assert not book.answers_pending and book.engine_seen_down() == 0 and not book._clients
    assert failed(500) and failed(502) and failed(504) and failed(200, VLLM_ERROR_EVENT + b"data: [DONE]\n\n")


def test_the_book_of_failed_answers_is_capped():
    clock = Clock()
    book = Casualties(clock, window_s=600, refuse_after=2)
    for n in range(ANSWERS_MAX + 10):
        book.answered(f"10.{n // 256}.{n % 256}.1", 999.0, *CHAT_500)
    assert len(book._answers) == ANSWERS_MAX
    assert book.engine_seen_down() == ANSWERS_MAX
    assert "10.0.0.1" not in book._clients and "10.0.10.1" in book._clients  # the oldest ten went first


def test_a_streams_tail_is_bounded_and_finds_the_error_at_its_end_however_it_is_cut():
    event = b'data: {"choices": [{"index": 0, "delta": {"content": "' + b"x" * 300 + b'"}}]}\n\n'
    tail = b""
    for _ in range(2000):  # 700 KB of stream: only the last TAIL_BYTES or fewer kept
        tail = tail_of(tail, event)
        assert len(tail) <= TAIL_BYTES
    assert not failed(200, tail)
    ending = VLLM_ERROR_EVENT + b"data: [DONE]\n\n"
    for cut in (1, 7, 50, len(ending) - 3):  # the error event split across chunks anywhere
        cut_tail = tail_of(tail_of(tail, ending[:cut]), ending[cut:])
        assert failed(200, cut_tail) and len(cut_tail) <= TAIL_BYTES
    assert failed(200, tail_of(tail, event * 20 + ending))  # in a chunk larger than the tail


def test_after_a_failed_answer_the_end_is_looked_for_and_after_an_end_a_request_waits_for_health(monkeypatch):
    monkeypatch.setattr(ends_module, "HEALTH_EVERY_S", 0)  # the looks' pace is the hold's; here, one after another

    async def scenario():
        clock = Clock()
        book = Casualties(clock, window_s=600, refuse_after=2)
        hold = FakeHold([True, True, False], clock)  # healthy twice after the 500, then down: an end
        ends = Ends(book, hold)
        assert await ends.may_send() and hold.asked == 0  # no end seen: sent without a look
        ends.answered(Peer("10.0.0.7"), 999.0, 200)  # a 200 is nothing to look for
        assert ends._watcher is None
        ends.answered(Peer("10.0.0.7"), 999.0, 500)
        await ends._watcher
        assert hold.asked == 3 and book.end_open and [e for e, _ in book._clients["10.0.0.7"].ends] == [1]
        # an end is open: the dying server would answer a retry 500 (and count it at a second end of one death);
        # it waits for /health: down, then up
        hold.looks, hold.asked = [False, True], 0
        assert not await ends.may_send() and book.end_open
        assert await ends.may_send() and not book.end_open and hold.asked == 2
        assert await ends.may_send() and hold.asked == 2  # seen up: no look more
        # told of a planned stop meanwhile: a 500 then (vLLM draining) is nobody's, nor an end seen after it
        hold.planned = True
        ends.answered(Peer("10.0.0.8"), 1000.0, 500)
        assert ends._watcher.done() and not book.answers_pending
        hold.planned, hold.looks = False, [False]
        ends.answered(Peer("10.0.0.8"), 1000.0, 500)
        hold.planned = True  # the word comes while the look is under way
        await ends._watcher
        assert "10.0.0.8" not in book._clients and not book.answers_pending
        await ends.stop()

    asyncio.run(scenario())


def test_a_refusal_is_answered_in_the_apis_own_error_shape_with_retry_after():
    anthropic = error_body("anthropic", 429, "refused")
    assert anthropic == {"type": "error", "error": {"type": "rate_limit_error", "message": "refused"}}
    assert error_body("openai", 429, "refused") == {"error": {"message": "refused", "type": "proxy_error",
                                                             "code": 429}}
    assert error_body("anthropic", 502, "x")["error"]["type"] == "api_error"
    assert error_body("anthropic", 413, "x")["error"]["type"] == "invalid_request_error"
    assert error_response("openai", 429, "refused", 412).headers["Retry-After"] == "412"
    assert error_response("other", 503, "x", 30).headers["Retry-After"] == "30"
    assert "Retry-After" not in error_response("openai", 502, "x").headers


def test_refuse_after_ends_reaches_the_proxy_child_with_the_crash_loop_window_and_is_checked(tmp_path, cli):
    from gpuwarden.base.yamlfile import InvalidConfig
    from gpuwarden.config import parse_text
    from gpuwarden.proxy.child import proxy_argv

    def option(argv, name):
        return argv[argv.index(name) + 1]

    argv = proxy_argv(parse_text("serve:\n  crash_loop_window_s: 1800\n  proxy: {refuse_after_ends: 3}\n",
                                 str(tmp_path / "g.yaml")))
    assert option(argv, "--refuse-after-ends") == "3" and option(argv, "--ends-window-s") == "1800"
    default = proxy_argv(parse_text("serve: {}\n", str(tmp_path / "g.yaml")))
    assert option(default, "--refuse-after-ends") == "2" and option(default, "--ends-window-s") == "600"
    with pytest.raises(InvalidConfig) as caught:
        parse_text("serve:\n  proxy:\n    refuse_after_ends: -1\n", str(tmp_path / "g.yaml"))
    text = "\n".join(str(e) for e in caught.value.errors)
    assert len(caught.value.errors) == 1 and "g.yaml:3: serve.proxy.refuse_after_ends" in text, text
    for args in (("--refuse-after-ends", "-1"), ("--refuse-after-ends", "1001"), ("--ends-window-s", "0")):
        status, out, err = cli("proxy", "-c", "none", *args)
        assert status == 78 and err.count("\n") == 1 and "--refuse-after-ends must be 0 to 1000" in err, err


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

# Behind the proxy the engine listens on a Unix socket (serving/compose/enginesock.py); a test that then calls the
# engine itself from this host, which the proxy refuses once it is one client of the engine's ends, asks for TCP.
ENGINE_ON_TCP = "  engine_listen: tcp\n"


def served_config(write, fake, mode, serve_extra="", hold_s=300, proxy_extra="", gate=None):
    path, base, port = fault_config(write, fake, mode, serve_extra=serve_extra)
    if gate is not None:
        path.write_text(path.read_text().replace(f'--mode, "{mode}"]',
                                                 f'--mode, "{mode}", --start-gate, "{gate.path}"]'))
    proxy_port = free_port()
    path.write_text(path.read_text() + f"  proxy: {{enabled: true, listen: '127.0.0.1:{proxy_port}', "
                                       f"hold_s: {hold_s}{proxy_extra}}}\n")
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


class Gate:
    """The fake engine's --start-gate: while closed, a new engine process does not listen. The proxy judges an end by
    looking at the engine's /health; an engine the daemon restarted before that look (a busy box runs the proxy late,
    and the fake restarts in well under a second) hides the end, and the killer's client goes uncounted. A test that
    counts ends closes the gate before each killer and opens it once the proxy has counted the end (judged())."""

    def __init__(self):
        self.folder = Path(tempfile.mkdtemp(prefix="gpuwarden-gate-"))
        self.folder.chmod(0o755)  # serve.user looks for the file
        self.path = self.folder / "closed"

    def close(self):
        self.path.touch()

    def open(self):
        self.path.unlink(missing_ok=True)

    def remove(self):
        shutil.rmtree(self.folder, ignore_errors=True)


@pytest.fixture
def gate():
    g = Gate()
    yield g
    g.remove()


def judged(d, proxy_port, ends, healthy_lines):
    """The proxy has counted `ends` of the engine's ends with requests in flight, while the gate held the next engine
    back: no engine became healthy since (healthy_lines of them before). A bound for a hang, not a speed."""
    wait = time.monotonic() + 60
    while proxy_metric(proxy_port, "gpuwarden_proxy_engine_ends_total") < ends and time.monotonic() < wait:
        time.sleep(0.1)
    assert proxy_metric(proxy_port, "gpuwarden_proxy_engine_ends_total") == ends, d.log
    assert sum("vLLM healthy after" in line for line in d.lines) == healthy_lines, d.log  # the gate held


def serving_behind_the_proxy(write, fake, daemons, proxy_daemon, mode="killer", serve_extra="", gate=None):
    """A daemon serving the fake engine in mode behind its proxy, an ordinary request answered 200 through it:
    (the daemon, its first healthy line's index, its config, the engine's port, the proxy's port). gate: the fake's
    --start-gate (Gate), open."""
    path, _, port, proxy_port = served_config(write, fake, mode, serve_extra=serve_extra, gate=gate)
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


def settled(d, proxy_port, crashes, engine_port=None):
    """The engine is back after `crashes` ends in all: healthy again, an ordinary request answered 200, nothing held
    now (a killer held for the next engine would be), and no end more. engine_port: the ordinary request goes to the
    engine itself, not through the proxy (which refuses this host: every local address is one client)."""
    wait = time.monotonic() + 60
    while exits(d) < crashes and time.monotonic() < wait:
        time.sleep(0.1)
    assert exits(d) == crashes, d.log
    healthy(d, max(i for i, line in enumerate(d.lines) if "with exit status 4" in line))
    status, _, data, error = Call(engine_port or proxy_port, "fine, thanks").result()
    assert status == 200, (status, data, error)
    time.sleep(1.5)  # three of the hold's looks at /health: a held request would have gone to this engine by now
    assert proxy_metric(proxy_port, "gpuwarden_proxy_held_requests") == 0 and exits(d) == crashes, d.log


@pytest.mark.process
def test_a_query_of_death_crashes_the_engine_once_and_its_client_gets_502_at_once(write, fake, daemons, proxy_daemon,
                                                                                   no_fakes_left, gate):
    """The killer's request is answered 502 as soon as the engine ends, never held for the next engine (hold_s is
    300 s): the engine is restarted once and serves the next request. The same client's second killer ends the
    second engine, and the journal names the client by its address, never the prompt nor the API key."""
    d, first, path, port, proxy_port = serving_behind_the_proxy(write, fake, daemons, proxy_daemon, gate=gate)
    gate.close()
    killer = Call(proxy_port, "please QOD-NOW now")
    status, _, data, error = killer.result()
    assert status == 502, (status, data, error)
    assert "the engine ended while serving this request" in json.loads(data)["error"]["message"]
    assert killer.took < 60  # not held: its hold_s is 300 s (a bound a busy box cannot cross the wrong way)
    judged(d, proxy_port, 1, 1)
    gate.open()
    second = healthy(d, first + 1)  # restarted, once
    status, _, data, error = Call(proxy_port, "fine, thanks").result()
    assert status == 200 and json.loads(data)["choices"][0]["message"]["content"] == "fine", (status, data, error)
    assert proxy_metric(proxy_port, "gpuwarden_proxy_held_seconds_count") == 0  # the killer was never held
    log = "\n".join(d.lines)
    assert exits(d) == 1, log
    # the same client, again: the second engine ends, the client is named (and refused from now on:
    # test_a_client_whose_requests_end_the_engine_again_and_again_is_refused_429_and_serving_never_goes_fatal)
    gate.close()
    status, _, data, error = Call(proxy_port, "and QOD-NOW again").result()
    assert status == 502, (status, data, error)
    judged(d, proxy_port, 2, 2)
    gate.open()
    d.wait_for("client this host had requests in flight at 2 of the engine's 2 ends", timeout=30)
    healthy(d, second + 1)
    status, _, data, error = Call(proxy_port, "fine, thanks", source="127.0.0.2").result()
    assert status == 429, (status, data, error)  # another local address: the same client, this host
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
    # the rule that nothing the engine had is sent again, alone: one client sends every killer here, and is not
    # refused for its ends (refuse_after_ends 0)
    path, base, port, proxy_port = served_config(write, fake, "killer", serve_extra="  crash_loop_failures: 20\n",
                                                 proxy_extra=", refuse_after_ends: 0")
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


def refused_count(port):
    """The proxy's requests refused for their client's ends (gpuwarden_proxy_failures_total{reason=client_refused})."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith('gpuwarden_proxy_failures_total{reason="client_refused"}'))


@pytest.mark.process
def test_a_client_whose_requests_end_the_engine_again_and_again_is_refused_429_and_serving_never_goes_fatal(
        write, fake, daemons, proxy_daemon, no_fakes_left, gate):
    """The attack: one client sends its query of death again and again, a new request each time (the rule that a
    request the engine had is never sent again does not stop that), toward the daemon's crash loop (5 ends within
    600 s: FATAL for everyone). With refuse_after_ends 2 it ends the engine twice; from then on each of its requests,
    killer or not, gets 429 at once with Retry-After, and no byte of it reaches the engine (the engine never ends a
    third time); the daemon never reaches FATAL; the journal says the refusal once, by the client, never the prompt
    nor the key. Every address of this host's own is one client ("this host"): another local address is refused too
    (the known limit, docs/proxy.md; a remote client's is its own, test_query_of_death_suspects.py)."""
    # The engine on TCP: the ordinary request at the end goes to it straight, the proxy refusing this host.
    d, first, path, port, proxy_port = serving_behind_the_proxy(write, fake, daemons, proxy_daemon,
                                                                serve_extra=ENGINE_ON_TCP, gate=gate)
    # the killer from 127.0.0.3; 127.0.0.1 is the same client (a local user may take any address of this host's)
    killer, other, tries = "127.0.0.3", "127.0.0.1", 6  # six tries: past the daemon's five, were they all let through
    answers, ends = [], 0
    for n in range(tries):
        gate.close()
        call = Call(proxy_port, f"try {n}: QOD-NOW", source=killer)
        answers.append(call.result() + (call.took,))
        if answers[-1][0] == 502:  # an engine ended on it: the next one goes to the next engine (held meanwhile)
            ends += 1
            judged(d, proxy_port, ends, ends)
            assert exits(d) <= 2, d.log
        gate.open()
        if answers[-1][0] == 502:  # the next engine past the gate before it closes again
            wait = time.monotonic() + 60  # a bound on a hang: the daemon logs the end a poll or two after the proxy
            while exits(d) < ends and time.monotonic() < wait:
                time.sleep(0.1)
            assert exits(d) == ends, d.log
            healthy(d, max(i for i, line in enumerate(d.lines) if "with exit status 4" in line))
    statuses = [status for status, *_ in answers]
    assert statuses == [502, 502] + [429] * (tries - 2), answers
    for status, retry_after, data, error, took in answers[2:]:
        message = json.loads(data)["error"]["message"]
        assert "in flight at 2 of the engine's ends in the last 600 s" in message, message
        assert 1 <= int(retry_after) <= 601, retry_after
        assert took < 30, took  # at once: not held for an engine (hold_s is 300 s); a bound on a hang, not a speed
    # any request of the killer's is refused, not only its killer; one from another client is served, by an engine
    # that the refused requests never reached
    status, retry_after, data, error = Call(proxy_port, "fine, thanks", source=killer).result()
    assert status == 429 and int(retry_after) >= 1, (status, data, error)
    settled(d, proxy_port, 2, engine_port=port)  # the engine serves, nothing held, no third end
    status, _, data, error = Call(proxy_port, "fine, thanks", source=other).result()
    assert status == 429, (status, data, error)
    assert refused_count(proxy_port) == tries - 2 + 2
    log = d.log
    assert exits(d) == 2 and "FATAL" not in log, log
    named = [i for i, line in enumerate(d.lines) if "proxy: refusing client this host for " in line]
    assert len(named) == 1 and "in flight at 2 of the engine's ends in the last 600 s" in d.lines[named[0]], log
    assert "QOD" not in log and SECRET not in log  # no prompt, no header in the journal
    assert d.stop() == 0


@pytest.mark.process
def test_a_killer_that_the_engine_answers_500_before_it_ends_is_refused_429_and_serving_never_goes_fatal(
        write, fake, daemons, proxy_daemon, no_fakes_left, gate):
    """vLLM 0.32 does not cut the connection when its EngineCore dies: it answers the request in flight 500 (a stream:
    its error event, then [DONE]), says 503 at /health, and ends a moment later (the fake's QOD-500 and QOD-500-STREAM
    do the same). The killer's client got an answer, never a cut, so it was never counted and drove the engine to
    FATAL. Now: its killer ends the engine once as a plain request, once more as a stream after the engine is back,
    and from then on each of its requests gets 429 at once and reaches no engine (no third end); the daemon never
    reaches FATAL; another local address is the same client, refused too."""
    d, first, path, port, proxy_port = serving_behind_the_proxy(write, fake, daemons, proxy_daemon, gate=gate)
    killer, other = "127.0.0.3", "127.0.0.1"
    gate.close()
    status, _, data, error = Call(proxy_port, "QOD-500 once", source=killer).result()
    assert status == 500, (status, data, error)
    assert json.loads(data)["error"]["type"] == "InternalServerError"  # vLLM's own answer, passed on as it is
    judged(d, proxy_port, 1, 1)
    gate.open()
    second = healthy(d, first + 1)  # it ended, and is back
    assert exits(d) == 1, d.log
    # the engine back: the killer again, as a stream, the first to reach this engine (the proxy sends a request after
    # an end only once /health answers, so this one went to the new engine, not to the dying one)
    gate.close()
    status, _, data, error = Call(proxy_port, "QOD-500-STREAM twice", source=killer, stream=True).result()
    assert status == 200 and b'"code": 500' in data and data.endswith(b"data: [DONE]\n\n"), (status, data, error)
    judged(d, proxy_port, 2, 2)
    gate.open()
    healthy(d, second + 1)
    assert exits(d) == 2, d.log
    d.wait_for("proxy: refusing client this host for ", timeout=30)
    answers = [Call(proxy_port, prompt, source=killer, stream=stream).result()
               for prompt, stream in (("QOD-500 again", False), ("QOD-500-STREAM again", True),
                                      ("fine, thanks", False))]  # any request of the killer's, not only its killer
    for status, retry_after, data, error in answers:
        assert status == 429 and 1 <= int(retry_after) <= 601, (status, retry_after, data, error)
        assert "in flight at 2 of the engine's ends in the last 600 s" in json.loads(data)["error"]["message"]
    status, _, data, error = Call(proxy_port, "fine, thanks", source=other).result()
    assert status == 429, (status, data, error)
    assert refused_count(proxy_port) == 4
    log = d.log
    assert exits(d) == 2 and "FATAL" not in log, log  # the refused never reached an engine: no third end
    assert sum("proxy: refusing client this host for " in line for line in d.lines) == 1, log
    assert "QOD" not in log and SECRET not in log  # no prompt, no header in the journal
    assert d.stop() == 0


# -- the attacks that went around the refusal (a client that left at once, QOD-SLOW, several local addresses) -------

def send_and_leave(proxy_port, prompt, source="127.0.0.1", reached=None):
    """A killer sent whole, then the connection reset (SO_LINGER 0) once reached() says the engine has it (at once
    without reached): the client never reads a byte. A client that leaves before the proxy forwards its request
    ends it unsent (listener.Connection.connection_lost), so the attack waits for the engine to have it, as an
    attacker would."""
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": prompt}]}).encode()
    sock = socket.socket()
    sock.bind((source, 0))
    sock.connect(("127.0.0.1", proxy_port))
    sock.sendall(b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" % (CHAT.encode(), len(body), body))
    deadline = time.monotonic() + 60  # a bound on a hang
    while reached is not None and not reached() and time.monotonic() < deadline:
        time.sleep(0.01)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


def engine_answered_its_killer(d):
    """reached() for send_and_leave: the fake engine's line as a killer reaches it, counted from now."""
    before = sum("a request ended my engine" in line for line in d.lines)
    return lambda: sum("a request ended my engine" in line for line in d.lines) > before


def until_refused(d, proxy_port, kill, sources, gate, tries=6):
    """Each try: an ordinary request from the next of sources first (429: refused, the end of it), then kill(source)
    and the engine's end it makes, waited for, the next engine held back by the gate until the proxy has counted the
    end; the statuses of the ordinary requests, in order. The engine ends at most refuse_after_ends (2) times,
    whatever the way the killer fails."""
    statuses = []
    for n in range(tries):
        source = sources[n % len(sources)]
        status, _, data, error = Call(proxy_port, "fine, thanks", source=source).result()
        statuses.append(status)
        if status == 429:
            break
        assert status == 200, (status, data, error)
        before = exits(d)
        gate.close()
        kill(source)
        wait = time.monotonic() + 60  # a bound on a hang: the end it makes is waited for
        while exits(d) == before and time.monotonic() < wait:
            time.sleep(0.1)
        assert exits(d) == before + 1 and exits(d) <= 2, d.log
        judged(d, proxy_port, before + 1, before + 1)
        gate.open()
        healthy(d, max(i for i, line in enumerate(d.lines) if "with exit status 4" in line))
    return statuses


@pytest.mark.process
@pytest.mark.parametrize("attack", ["stream-500-and-leave", "slow", "from-127.0.0.1-and-127.0.0.2"])
def test_a_killer_that_fails_any_way_or_from_any_local_address_is_refused_before_fatal(
        attack, write, fake, daemons, proxy_daemon, no_fakes_left, gate):
    """The attacker's findings 1-3: a streaming killer (vLLM's 500 error event) whose client resets at once, so the
    proxy never reads the event; QOD-SLOW, closed unanswered while /health still answers and the engine dead 2 s
    later (after_failure's BROKE); QOD-NOW from 127.0.0.1 and 127.0.0.2 in turn. Each is a suspect counted at the end
    that follows (or one client, this host): the engine ends twice (refuse_after_ends 2), the killer then gets 429,
    and the daemon never reaches FATAL (5 ends)."""
    d, first, path, port, proxy_port = serving_behind_the_proxy(write, fake, daemons, proxy_daemon,
                                                                serve_extra=ENGINE_ON_TCP, gate=gate)  # as above
    if attack == "stream-500-and-leave":
        statuses = until_refused(d, proxy_port, lambda src: send_and_leave(proxy_port, "QOD-500-STREAM", src,
                                                                           engine_answered_its_killer(d)),
                                 ["127.0.0.1"], gate)
    elif attack == "slow":
        statuses = until_refused(d, proxy_port, lambda src: Call(proxy_port, "QOD-SLOW", source=src).result(),
                                 ["127.0.0.1"], gate)
    else:
        statuses = until_refused(d, proxy_port, lambda src: Call(proxy_port, "QOD-NOW", source=src).result(),
                                 ["127.0.0.1", "127.0.0.2"], gate)
    assert statuses == [200, 200, 429], (statuses, d.log)
    for source in ("127.0.0.1", "127.0.0.2", "127.0.0.9"):  # every local address: one client, this host
        status, retry_after, data, error = Call(proxy_port, "QOD-NOW", source=source).result()
        assert status == 429 and 1 <= int(retry_after) <= 601, (source, status, data, error)
    settled(d, proxy_port, 2, engine_port=port)  # the engine serves, nothing held, no third end
    log = d.log
    assert exits(d) == 2 and "FATAL" not in log, log
    assert sum("proxy: refusing client this host for " in line for line in d.lines) == 1, log
    assert "QOD" not in log and SECRET not in log
    assert d.stop() == 0
