"""The tests' port handout (tests/harness/ports.py): workers never share a port, and a worker never hands one out
twice while its block lasts, so a test's stopped server's port is never another test's."""

import socket

import pytest

from harness.ports import Ports, block
from harness.ports import _free as ports_free


def test_the_workers_blocks_are_disjoint_and_below_the_ephemeral_range_and_above_rays_worker_ports():
    assert block(None, None).start == 20000  # Ray's workers take 10002-19999
    blocks = [block(f"gw{i}", "4", 10000, 32768) for i in range(4)]
    assert [b.start for b in blocks] == [10000, 15692, 21384, 27076] and all(len(b) == 5692 for b in blocks)
    assert blocks[-1].stop <= 32768
    assert block(None, None, 10000, 32768) == range(10000, 32768)  # no xdist: one worker
    assert block("gw1", "x", 10000, 32768) == range(10000, 32768)  # unreadable: as one worker


def test_a_port_is_never_handed_out_twice_and_a_taken_one_is_skipped():
    taken = {40002}
    ports = Ports(range(40000, 40005), free=lambda port: port not in taken)
    given = [ports.take() for _ in range(4)]
    assert given == [40000, 40001, 40003, 40004]
    assert ports.take() == 40000  # the block is used up: it starts again


def test_a_run_starts_where_it_is_told_and_wraps_around():
    ports = Ports(range(40000, 40004), first=2, free=lambda port: True)
    assert [ports.take() for _ in range(4)] == [40002, 40003, 40000, 40001]


def test_a_block_with_no_free_port_says_so():
    with pytest.raises(RuntimeError, match="no free port in 40000-40002"):
        Ports(range(40000, 40003), free=lambda port: False).take()


def test_a_port_a_socket_holds_is_not_free():
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        assert not ports_free(held.getsockname()[1])
