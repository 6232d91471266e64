"""Requests in flight when the engine ended (issue 51). A query of death, a request that crashes the engine, held and
sent to each new engine, crashed every one of them until the daemon gave up (FATAL): one client's request took
serving down for everyone. So only a request the engine never saw may wait for the next engine (hold.py): one whose
connection to the engine was open when the engine ended is answered at once (502, or its stream cut where it is) and
never sent again; after_failure() is that choice.

The journal names the client whose requests were in flight at two or more of the engine's ends within WINDOW_S (the
daemon's crash_loop_window_s by default): its address, the request's method and path, never its body nor its headers
(prompts, API keys). Casualties keeps that book: ends told apart by when each request was sent (one sent after an end
was seen went to a later engine), a line per end and client at most, MAX_CLIENTS clients at most.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict, deque

log = logging.getLogger("gpuwarden.proxy")

WINDOW_S = 600.0
MAX_CLIENTS = 1024
MAX_ENDS = 1024  # ends remembered within the window (the daemon restarts an engine a few times a window at most)

# What becomes of a request whose try failed before a byte of its answer reached the client:
HOLD = "hold"  # the engine never saw it (refused at connect): held for the engine's return
UNREACHABLE = "unreachable"  # the same without a hold: 502 at once
ENDED = "ended"  # in flight when the engine ended (or refused after a try that reached it): 502, never sent again
RESEND = "resend"  # a pooled connection closed unanswered while the engine answers: once more at once, to it
BROKE = "broke"  # closed unanswered by an engine that answers: 502, never sent again


def after_failure(*, connected: bool, seen: bool, reused: bool, resent: bool, engine_down: bool,
                  hold_on: bool) -> str:
    """connected: this try's connection to the engine was open (anything but a refused connect), so the engine may
    have read the request; seen: an earlier try's was; reused: this try went on a pooled keep-alive connection;
    resent: this is the one resend already; engine_down: the engine's /health, asked after the failure, does not
    answer."""
    if not connected and not seen:
        return HOLD if hold_on else UNREACHABLE
    if engine_down:
        return ENDED
    # A pooled connection the engine closed as it was reused (its keep-alive timer: one stream in CI's loaded 5-reload
    # run) says nothing of the request; a fresh connection closed unanswered does, and is never tried again.
    if connected and reused and not seen and not resent:
        return RESEND
    return BROKE


class Casualties:
    def __init__(self, clock=time.monotonic, window_s: float = WINDOW_S, max_clients: int = MAX_CLIENTS):
        self.clock, self.window_s, self.max_clients = clock, window_s, max_clients
        self.count = 0  # the engine's ends seen with a request in flight, since the proxy started
        self._ends: deque[tuple[int, float]] = deque(maxlen=MAX_ENDS)  # (number, when seen) within the window
        self._clients: OrderedDict[str, deque[tuple[int, float]]] = OrderedDict()  # client -> its ends (number, when)

    def ended(self, client: str, sent_at: float) -> tuple[int, int] | None:
        """A request of client's, sent at sent_at (the clock's), was in flight when the engine ended. (the client's
        ends, all ends) within the window when this makes the client's second or later end: name it, once per end;
        else None."""
        now = self.clock()
        self._forget(now)
        if not self._ends or sent_at > self._ends[-1][1]:  # sent after the last end was seen: a new end
            self.count += 1
            self._ends.append((self.count, now))
        end = self._ends[-1][0]
        mine = self._clients.pop(client, None) or deque(maxlen=MAX_ENDS)
        self._clients[client] = mine  # the newest last: the oldest is the first to go
        while len(self._clients) > self.max_clients:
            self._clients.popitem(last=False)
        if mine and mine[-1][0] == end:
            return None  # another of its requests at the same end: said already
        mine.append((end, now))
        return (len(mine), len(self._ends)) if len(mine) >= 2 else None

    def note(self, client: str, sent_at: float, what: str) -> None:
        """ended(), and the line that names the client where it is its second or later end: what is the request's
        method and path."""
        named = self.ended(client, sent_at)
        if named is not None:
            log.warning("proxy: client %s had requests in flight at %d of the engine's %d ends in the last %g s (the "
                        "latest: %s): its requests may be what ends the engine (a query of death); none was sent "
                        "again", client, *named, self.window_s, what)

    def _forget(self, now: float) -> None:
        while self._ends and now - self._ends[0][1] > self.window_s:
            self._ends.popleft()
        for client in [c for c, ends in self._clients.items() if not ends or now - ends[-1][1] > self.window_s]:
            del self._clients[client]
        for ends in self._clients.values():
            while ends and now - ends[0][1] > self.window_s:
                ends.popleft()
