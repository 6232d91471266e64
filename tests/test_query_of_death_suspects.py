"""The proxy's suspects (proxy/casualties.py, proxy/ends.py): a request that did not end cleanly (its client left
before the error event was read, the engine broke it off or closed it unanswered while /health still answered) counts
at an end seen shortly after, whatever the way it failed; every address of this host's own is one client
(base/peers.host_of); and the brake: once the window holds crash_loop_failures - 1 ends, a client in flight at any of
them is refused. No process: a driven clock; the processes are in test_query_of_death.py."""

import asyncio
import socket

import pytest

from gpuwarden.base import peers
from gpuwarden.base.peers import THIS_HOST, host_of, own_address
from gpuwarden.proxy import ends as ends_module
from gpuwarden.proxy.casualties import ANSWERS_MAX, END_AFTER_5XX_S, Casualties
from gpuwarden.proxy.ends import Ends
from harness.book import Clock, FakeHold, Peer, refusal

CHAT = "POST /v1/chat/completions"


def test_a_suspect_whatever_its_status_counts_at_an_end_seen_within_the_bound_and_only_then():
    clock = Clock()
    book = Casualties(clock, window_s=600, refuse_after=2)
    # a stream of status 200 whose client left before its error event was read: no tail, yet a suspect
    assert not book.answered("10.0.0.7", 999.0, CHAT, 200, b"")
    assert book.answered("10.0.0.7", 999.0, CHAT, 200, b"", suspect=True) and book.answers_pending
    clock.now += END_AFTER_5XX_S
    assert book.engine_seen_down() == 1 and [e for e, _ in book._clients["10.0.0.7"].ends] == [1]
    book.engine_seen_up()
    clock.now = 1100.0  # BROKE: closed unanswered (no status) while /health answered; the engine ends a moment later
    assert book.answered("10.0.0.7", 1099.0, CHAT, 0, suspect=True)
    clock.now = 1101.0
    assert book.engine_seen_down() == 1 and refusal(book, "10.0.0.7").status == 429
    # a suspect the engine outlived past the bound counts nobody
    book.answered("10.0.0.8", 1101.0, CHAT, 0, suspect=True)
    clock.now += END_AFTER_5XX_S + 0.5
    assert not book.answers_pending and book.engine_seen_down() == 0 and "10.0.0.8" not in book._clients


def test_the_suspects_share_the_capped_book_of_failed_answers():
    book = Casualties(Clock(), window_s=600, refuse_after=2)
    for n in range(ANSWERS_MAX + 5):
        book.answered(f"10.0.{n // 256}.{n % 256}", 999.0, CHAT, 200, suspect=True)
    assert len(book._answers) == ANSWERS_MAX and all(len(entry) == 4 for entry in book._answers)


def test_a_suspect_starts_the_watcher_that_finds_the_end_a_moment_later(monkeypatch):
    monkeypatch.setattr(ends_module, "HEALTH_EVERY_S", 0)

    async def scenario():
        clock = Clock()
        book = Casualties(clock, window_s=600, refuse_after=2)
        hold = FakeHold([True, False], clock)  # /health still answers just after the close (BROKE), then down
        ends = Ends(book, hold)
        ends.suspect(Peer("10.0.0.7"), 999.0)
        await ends._watcher
        assert hold.asked == 2 and [e for e, _ in book._clients["10.0.0.7"].ends] == [1]
        hold.planned = True  # a planned stop's end is nobody's, suspects included
        ends.suspect(Peer("10.0.0.9"), 1000.0)
        assert ends._watcher.done() and "10.0.0.9" not in book._clients
        await ends.stop()

    asyncio.run(scenario())


def test_once_the_window_holds_failures_less_one_ends_every_client_is_refused_until_the_oldest_leaves(caplog):
    """A client at one of the ends and a client at none of them alike (the attacker's F1: a killer from a fresh
    address made the fifth end, FATAL): 429 for a client at its own refuse_after ends, 503 for everyone else."""
    clock = Clock()
    book = Casualties(clock, window_s=600, refuse_after=2, failures=5, wall=lambda: 0.0)
    with caplog.at_level("WARNING", logger="gpuwarden.proxy"):
        for n, client in enumerate(("10.0.0.1", "10.0.0.2", "10.0.0.3")):
            clock.now = 1000.0 + 10 * n
            book.note(client, clock.now - 1, CHAT)
            assert refusal(book, client) is None  # one end each, 3 in the window: not yet
        clock.now = 1030.0
        book.note("10.0.0.4", 1029.0, CHAT)  # the 4th: one more is FATAL
    for client in ("10.0.0.1", "10.0.0.2", "10.0.0.3", "10.0.0.4", "10.0.0.5", "2001:db8:9::/64"):
        refused = refusal(book, client)  # at one end each, or at none (.5 and the /64): all alike
        assert refused.status == 503 and refused.reason == "serving_braked", (client, refused)
        assert "one fewer than the daemon stops it for good" in str(refused)
        assert refused.retry_after == 571  # until the 4th newest end (at 1000) leaves the window, at 1600
    said = [r.getMessage() for r in caplog.records if "one fewer than the daemon stops it for good" in r.getMessage()]
    assert len(said) == 1 and "every request is refused" in said[0] and "in 570 s" in said[0], said
    assert not [r for r in caplog.records if "refusing client" in r.getMessage()]  # no client's own refusal
    clock.now = 1600.5  # the first end left the window: 3 ends, the brake is off
    assert refusal(book, "10.0.0.4") is None and refusal(book, "10.0.0.5") is None


def test_a_client_at_its_own_ends_during_the_brake_gets_429_until_the_later_of_both():
    clock = Clock()
    book = Casualties(clock, window_s=600, refuse_after=2, failures=5, wall=lambda: 0.0)
    for n, client in enumerate(("10.0.0.2", "10.0.0.1", "10.0.0.1", "10.0.0.3")):
        clock.now = 1000.0 + 100 * n
        book.note(client, clock.now - 1, CHAT)
    refused = refusal(book, "10.0.0.1")  # its own 2 ends (1100, 1200): until 1700; the brake's until 1600
    assert refused.status == 429 and refused.reason == "client_refused" and refused.retry_after == 401
    assert refusal(book, "10.0.0.9").status == 503 and refusal(book, "10.0.0.9").retry_after == 301
    clock.now = 1600.5  # the brake is off; 10.0.0.1's own refusal holds
    assert refusal(book, "10.0.0.9") is None and refusal(book, "10.0.0.1").status == 429


def test_no_brake_where_refusals_are_off_or_the_daemon_stops_at_the_first_failure():
    for refuse_after, failures in ((0, 5), (1, 1)):
        clock = Clock()
        book = Casualties(clock, window_s=600, refuse_after=refuse_after, failures=failures)
        assert book.brake == 0
    clock = Clock()
    book = Casualties(clock, window_s=600, refuse_after=0, failures=5)
    for n in range(6):
        clock.now += 10
        book.note(f"10.0.0.{n}", clock.now - 1, CHAT)
    assert all(refusal(book, f"10.0.0.{n}") is None for n in range(6))


def test_every_address_of_this_host_is_one_client_and_the_answers_are_bounded(monkeypatch):
    assert host_of("127.0.0.1") == host_of("127.0.0.2") == host_of("127.255.0.9") == host_of("::1") == THIS_HOST
    assert host_of("::ffff:127.0.0.5") == THIS_HOST
    assert host_of("192.0.2.77") == "192.0.2.77"  # TEST-NET: no host's own
    assert host_of("2001:db8:1:2::7") == "2001:db8:1:2::/64"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("192.0.2.1", 9))  # no packet: the route's source address, an interface's own
            own = probe.getsockname()[0]
        except OSError:
            own = None
    if own is not None and not own.startswith("127."):
        assert host_of(own) == THIS_HOST  # e.g. eth0's: a local user may bind it as its source
    monkeypatch.setattr(peers, "_OWN_MAX", 4)
    monkeypatch.setattr(peers, "_own", {})
    for n in range(20):
        own_address(f"192.0.2.{n}")
        assert len(peers._own) <= 4
    clock = Clock()
    assert not own_address("192.0.2.200", clock)
    peers._own["192.0.2.200"] = (True, clock.now)  # as if an interface had it when last asked
    assert own_address("192.0.2.200", clock)
    clock.now += peers._OWN_FOR_S + 1  # asked again after the bound: the host's word now
    assert not own_address("192.0.2.200", clock)


FIB_TRIE = """Main:
  +-- 0.0.0.0/0 3 0 5
     |-- 0.0.0.0
        /0 universe UNICAST
     +-- 127.0.0.0/8 2 0 2
        +-- 127.0.0.0/31 1 0 0
           |-- 127.0.0.0
              /8 host LOCAL
        |-- 127.255.255.255
           /32 link BROADCAST
     +-- 10.1.0.0/24 2 0 2
           |-- 10.1.0.0
              /24 link UNICAST
           |-- 10.1.0.7
              /32 host LOCAL
        |-- 10.1.0.255
           /32 link BROADCAST
"""
IF_INET6 = """00000000000000000000000000000001 01 80 10 80       lo
20010db8000000010000000000000005 04 40 00 82     eth0
"""


def test_this_hosts_addresses_are_the_kernels_local_routes_whatever_a_bind_would_say(tmp_path, monkeypatch):
    """With net.ipv4.ip_nonlocal_bind (keepalived's hosts) any address can be bound, and the bind test made every
    remote client 'this host' (the attacker's note of 2026-12-02): the local routes are asked first."""
    (tmp_path / "fib").write_text(FIB_TRIE)
    (tmp_path / "inet6").write_text(IF_INET6)
    found = peers.local_networks(str(tmp_path / "fib"), str(tmp_path / "inet6"))
    assert [str(n) for n in found] == ["127.0.0.0/8", "10.1.0.7/32", "::1/128", "2001:db8:0:1::5/128"]
    monkeypatch.setattr(peers, "_own", {})
    monkeypatch.setattr(peers, "_bound", lambda ip: True)  # as on a host that lets any address be bound
    assert own_address("10.1.0.7", networks=lambda: found) and own_address("2001:db8:0:1::5", networks=lambda: found)
    assert not own_address("10.1.0.8", networks=lambda: found)  # the bind would pass: a remote client all the same
    assert not own_address("2001:db8:0:1::6", networks=lambda: found)
    assert not own_address("10.1.0.255", networks=lambda: found)  # broadcast is no host's own
    monkeypatch.setattr(peers, "_own", {})
    assert own_address("10.1.0.8", networks=lambda: None)  # no tables to read: the bind test, as before
    (tmp_path / "big").write_bytes(b"x" * (peers._TABLE_MAX + 1))
    assert peers.local_networks(str(tmp_path / "big"), str(tmp_path / "inet6")) is None
    assert peers.local_networks(str(tmp_path / "missing"), str(tmp_path / "inet6")) is None


@pytest.mark.parametrize("peer", ["not-an-address", ""])
def test_what_is_no_address_is_itself(peer):
    assert host_of(peer) == peer


def test_a_look_with_no_answer_in_time_is_no_end_however_often(monkeypatch):
    """The attacker's F1 (2026-12-02): looks at /health that waited for a pool of connections the clients had filled
    timed out, and each was taken for an end of the engine; four such put the brake on for everyone while the engine
    never ended. A look with no answer in time is no verdict: the watch goes on until the suspects are too old to
    count, and only a look that is refused, closed or answered other than 200 is an end."""
    monkeypatch.setattr(ends_module, "HEALTH_EVERY_S", 0)

    async def scenario():
        clock = Clock()
        book = Casualties(clock, window_s=600, refuse_after=2)
        hold = FakeHold([None] * 1000, clock, step=1.0)  # each look: no answer, a second later
        ends = Ends(book, hold)
        for round in range(4):
            ends.suspect(Peer("10.0.0.7"), clock.now)
            ends.suspect(Peer("10.0.0.8"), clock.now)
            await ends._watcher
            assert not book.answers_pending, round  # watched until the suspects are past END_AFTER_5XX_S
        assert book.count == 0 and not book.braking and hold.asked >= 4 * END_AFTER_5XX_S
        assert refusal(book, "10.0.0.7") is None and refusal(book, "10.0.0.9") is None
        hold.looks = [False]  # the engine's /health refused or said 503: that is an end, as before
        ends.suspect(Peer("10.0.0.7"), clock.now)
        await ends._watcher
        assert book.count == 1 and [e for e, _ in book._clients["10.0.0.7"].ends] == [1]
        await ends.stop()

    asyncio.run(scenario())


def test_the_hold_takes_no_answer_in_time_as_down_for_a_request_and_as_no_end_for_the_book():
    from prometheus_client import CollectorRegistry, Histogram

    from gpuwarden.proxy.hold import Hold

    async def scenario():
        answers = [None, False, True, None]

        async def engine_answers():
            return answers.pop(0)

        clock = Clock()
        hold = Hold(300, 10, engine_answers, Histogram("held", "held", registry=CollectorRegistry()), clock=clock)
        assert not await hold.health.ended(since=clock())  # no answer in time: no end
        clock.now += 1
        assert await hold.health.ended(since=clock())  # refused, closed or not 200: an end
        clock.now += 1
        assert not await hold.engine_down(since=clock())  # 200: a request goes to it
        clock.now += 1
        assert await hold.engine_down(since=clock())  # no answer in time: a request waits for it
        assert answers == []

    asyncio.run(scenario())


def test_a_planned_stops_hold_ends_only_once_the_engine_was_seen_down_never_on_a_look_with_no_answer(monkeypatch):
    """Told of a planned stop (SIGUSR1), the proxy holds until the engine has been seen down and answers again. A look
    with no answer in time (None: a busy box) is no verdict: before, it counted as down, and the draining engine's
    next 200 ended the hold, sending the held requests to the engine that was stopping (fresh19's flake of
    test_proxy_hold::test_the_proxy_answers_a_stops_word_once_on_its_word_pipe: no RELEASED, the plan already over)."""
    from prometheus_client import CollectorRegistry, Histogram

    from gpuwarden.proxy import hold as hold_module
    from gpuwarden.proxy.hold import Hold

    monkeypatch.setattr(hold_module, "HEALTH_EVERY_S", 0)

    async def scenario():
        looks = [True, None, True, None, True, False, True]
        seen = []

        async def engine_answers():
            if looks:
                seen.append(looks[0])
                return looks.pop(0)
            await asyncio.sleep(3600)  # a look past the last: the hold did not end at it

        clock = Clock()
        hold = Hold(300, 10, engine_answers, Histogram("held", "held", registry=CollectorRegistry()), clock=clock)
        hold.engine_stopping()
        assert hold.planned and hold.down_since is not None
        for _ in range(200):
            await asyncio.sleep(0)
            if hold.down_since is None:
                break
        assert hold.down_since is None and not hold.planned, "ended once the engine was seen down and back"
        assert seen == [True, None, True, None, True, False, True], seen  # not before the refusal, whatever the Nones
        hold.close()

    asyncio.run(scenario())


def test_a_look_at_health_answers_true_false_or_none_for_no_answer_in_time(monkeypatch):
    """server.answers on real sockets of this process: a listener that never answers is None within LOOK_S, a port
    nobody listens on is False, a 200 or a 4xx is True, a 5xx False."""
    from aiohttp import web

    from gpuwarden.proxy import server

    monkeypatch.setattr(server, "LOOK_S", 0.3)

    async def scenario():
        mute = socket.socket()
        mute.bind(("127.0.0.1", 0))
        mute.listen(8)  # connects, never accepted: no answer
        closed = socket.socket()
        closed.bind(("127.0.0.1", 0))  # bound, not listening: refused
        async def health(request):
            return web.Response(text="", status=int(request.query.get("status", "200")))

        app = web.Application()
        app.router.add_get("/health", health)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.SockSite(runner, socket.create_server(("127.0.0.1", 0)))
        await site.start()
        port = site._sock.getsockname()[1]
        session = server.engine_session(2, 600.0, None)
        try:
            assert await server.answers(session, f"http://127.0.0.1:{mute.getsockname()[1]}/health") is None
            assert await server.answers(session, f"http://127.0.0.1:{closed.getsockname()[1]}/health") is False
            assert await server.answers(session, f"http://127.0.0.1:{port}/health") is True
            # a 4xx answers: a server with no /health of its own (404), or one behind a key (401); a 5xx is down
            assert await server.answers(session, f"http://127.0.0.1:{port}/nothing") is True
            assert await server.answers(session, f"http://127.0.0.1:{port}/health?status=401") is True
            for status in (500, 503):
                assert await server.answers(session, f"http://127.0.0.1:{port}/health?status={status}") is False
        finally:
            await session.close()
            await runner.cleanup()
            mute.close()
            closed.close()

    asyncio.run(scenario())
