"""The tests' port handout (tests/harness/ports.py): workers never share a port, and a worker never hands one out
twice while its block lasts, so a test's stopped server's port is never another test's."""

import socket

import pytest

from harness.ports import Ports, block


def test_the_workers_blocks_are_disjoint_and_below_the_ephemeral_range_and_above_rays_worker_ports():
    assert block(None, None).start == 20000  # Ray's workers take 10002-19999
    blocks = [block(f"gw{i}", "4", 10000, 32768) for i in range(4)]
    assert [b.start for b in blocks] == [10000, 15692, 21384, 27076] and all(len(b) == 5692 for b in blocks)
    assert blocks[-1].stop <= 32768
    assert block(None, None, 10000, 32768) == range(10000, 32768)  # no xdist: one worker
    assert block("gw1", "x", 10000, 32768) == range(10000, 32768)  # unreadable: as one worker


def test_a_port_is_never_handed_out_twice_and_a_taken_one_is_skipped():
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        taken = held.getsockname()[1]
        ports = Ports(range(taken - 2, taken + 3))
        given = [ports.take() for _ in range(4)]
        assert taken not in given and len(set(given)) == 4
        assert ports.take() == given[0]  # the block is used up: it starts again


def test_a_block_with_no_free_port_says_so():
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        port = held.getsockname()[1]
        with pytest.raises(RuntimeError, match=f"no free port in {port}-{port}"):
            Ports(range(port, port + 1)).take()


def test_a_run_starts_where_it_is_told_and_wraps_around():
    ports = Ports(range(40000, 40004), first=2)
    assert [ports.take() for _ in range(4)] == [40002, 40003, 40000, 40001] or not all(
        _bindable(p) for p in range(40000, 40004))


def _bindable(port):
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True
