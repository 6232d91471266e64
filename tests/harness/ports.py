"""Ports for the servers the tests start: each pytest worker hands out ports from a block of its own, below the
kernel's ephemeral range, and never the same port twice while a block lasts.

A port the kernel picks (bind to port 0) is free when it is picked, and free again as soon as the test that got it
stops its server: with four xdist workers, another worker's test can then be given it and start its own server
there, and a proxy still pointed at the stopped engine reaches a stranger's. Blocks per worker keep the workers
apart; never handing a port out twice keeps a worker's tests apart; staying below the ephemeral range keeps the
ports the kernel picks for outgoing connections (and for servers bound to port 0) out of the way. A port something
else holds is skipped (the bind check), as is one in TIME_WAIT; another test run at the same time starts elsewhere
in the block.
"""

from __future__ import annotations

import os
import random
import socket
import threading

# Below: services a test box runs (Prometheus's 9090, Alertmanager's 9093-9094, Ray's client server 10001) and
# Ray's worker ports (10002-19999 by default): Ray refuses a head whose port lies among them.
LOWEST = 20000


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def block(worker: str | None, workers: str | None, low: int = LOWEST, high: int | None = None) -> range:
    """The ports of one worker: gwN of `workers` (PYTEST_XDIST_WORKER, PYTEST_XDIST_WORKER_COUNT), or the whole
    range for a run without xdist."""
    high = _ephemeral_low() if high is None else high
    try:
        index, count = int((worker or "gw0").removeprefix("gw")), max(1, int(workers or 1))
    except ValueError:
        index, count = 0, 1
    size = (high - low) // count
    start = low + (index % count) * size
    return range(start, start + size)


class Ports:
    """Hands out the ports of one block in turn from `first` (an index into it), each checked free by a bind;
    after the last, the first again."""

    def __init__(self, ports: range, first: int = 0, free=None):
        self.ports, self.next, self.lock = ports, first, threading.Lock()
        self.free = free or _free  # whether a port is free now: a test gives its own answer

    def take(self) -> int:
        with self.lock:
            for _ in range(len(self.ports)):
                port = self.ports[self.next % len(self.ports)]
                self.next += 1
                if self.free(port):
                    return port
        raise RuntimeError(f"no free port in {self.ports.start}-{self.ports.stop - 1}")


def _free(port: int) -> bool:
    with socket.socket() as s:  # no SO_REUSEADDR: a port in TIME_WAIT counts as taken
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


_PORTS: Ports | None = None


def free_port() -> int:
    """A port no other test of this run was given, and free now."""
    global _PORTS
    if _PORTS is None:
        ports = block(os.environ.get("PYTEST_XDIST_WORKER"), os.environ.get("PYTEST_XDIST_WORKER_COUNT"))
        # Two test runs at once (a developer's, a benchmark's) would walk the same block in the same order from its
        # start: each run starts at a random place in it.
        _PORTS = Ports(ports, random.randrange(len(ports)))
    return _PORTS.take()
