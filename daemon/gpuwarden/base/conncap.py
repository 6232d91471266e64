"""The one rule both servers close a connection by at their cap (web/server.MetricsServer, proxy/listener.Connections):
of the connections that wait on their clients (not those being answered), one from the source that holds the most
connections (base/peers.source_of: an address, an IPv6 /64, the rest of 127.0.0.0/8 beside 127.0.0.1 as one); of
those, one whose client already has its reply if there is one, else the one that has waited longest. A crowd from
one place makes room for everyone else, whether it trickles requests or lets replies sit, and a request under way
is the last thing it loses.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from typing import TypeVar

T = TypeVar("T")


def to_close(sources: Iterable[str], waiting: Sequence[T], source: Callable[[T], str],
             replied: Callable[[T], bool]) -> T | None:
    """sources: the source of every open connection; waiting: those that wait on their clients, the longest waiting
    first. The one to close, or None where none waits."""
    held = Counter(sources)
    best, best_key = None, None
    for age, conn in enumerate(waiting):
        key = (held[source(conn)], replied(conn), -age)
        if best_key is None or key > best_key:
            best, best_key = conn, key
    return best
