"""Issue 35's fixes attacked again as a local user (nobody), the daemon under the unit's capabilities."""

import asyncio

from gpuwarden.web import server


def test_a_local_crowd_on_fresh_loopback_addresses_leaves_a_scraper_from_another_address_a_place():
    """Any local user has all of 127.0.0.0/8: a crowd guessing from a fresh 127.x.y.z each time was 16 sources
    that never failed, the line was full, and a scraper from another address never let in before got 503 on 30
    of 30 scrapes (/tmp/atk35/f4_many_sources.py: 32 guessers as nobody, bcrypt cost 12). 127/8 beside
    127.0.0.1 is one source, as an IPv6 /64 is; 127.0.0.1, where a local Prometheus comes from, is its own."""
    assert server.source_of("127.1.2.3") == server.source_of("127.0.0.2") == server.source_of("::ffff:127.9.9.9")
    assert server.source_of("127.0.0.1") == server.source_of("::ffff:127.0.0.1") == "127.0.0.1"
    assert server.source_of("192.0.2.2") == "192.0.2.2"

    async def scenario():
        line = server.AuthLine()
        verdicts, gates = {}, {}

        async def ask(source: str, tag: str, ok: bool):
            async def check():
                gates[tag] = asyncio.Event()
                await gates[tag].wait()
                return ok
            verdicts[tag] = await line.check(server.source_of(source), check)

        tasks = [asyncio.create_task(ask(f"127.{n // 250 + 1}.{n % 250 + 1}.9", f"guess{n}", False))
                 for n in range(4 * server.AUTH_WAITING)]
        for _ in range(5):
            await asyncio.sleep(0)
        tasks.append(asyncio.create_task(ask("192.0.2.2", "scraper", True)))
        tasks.append(asyncio.create_task(ask("127.0.0.1", "local-scraper", True)))
        for _ in range(5):
            await asyncio.sleep(0)
        assert "scraper" not in verdicts and "local-scraper" not in verdicts, \
            f"a scraper from another address found no place beside a loopback crowd: {verdicts}"
        assert line.held.total() <= server.AUTH_PER_SOURCE + 2
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    asyncio.run(scenario())


def test_a_start_that_loses_its_port_to_a_local_user_waits_and_never_counts_to_fatal():
    """A local user who binds the engine's own address and port at each start, after our preflight found it
    free and before the engine binds (seconds of imports for vLLM), answering /health or not: each start was a
    failure, and a healthy engine was FATAL 10 s after a start (/tmp/atk35/f1_race.sh: 5 starts, 0 healthy,
    FATAL). Such a start now waits for the port, as a preflight that finds it taken does."""
    from test_serving import supervisor
    from gpuwarden.serving.run.supervisor import BACKOFF, FATAL, PREFLIGHT_RETRY_S, RUNNING

    sup, ops, clock = supervisor(crash_loop_failures=2)
    for attempt in range(4):
        sup.start(clock.now)
        child = sup.child
        if attempt % 2:  # it answers /health on our address before the engine binds
            ops.health_ok, ops.squatters = True, set(ops.groups[child.pid])
        else:  # it only holds the port: the engine cannot bind and exits
            sup.on_line("OSError: [Errno 98] Address already in use")
            ops.exit[child.pid] = 1
        sup.tick(clock.now)
        assert sup.state == BACKOFF and sup.blocked, (attempt, sup.state, sup.problem)
        assert sup.state != FATAL and sup.restarts == 0
        ops.health_ok, ops.squatters = False, set()
        clock.advance(PREFLIGHT_RETRY_S)
    sup.start(clock.now)  # the user gave up: the engine starts and serves
    ops.health_ok = True
    sup.tick(clock.now)
    assert sup.state == RUNNING
    # A crash that is not about the port still counts.
    ops.exit[sup.child.pid] = 1
    sup.tick(clock.now)
    assert sup.restarts == 1 and not sup.blocked
