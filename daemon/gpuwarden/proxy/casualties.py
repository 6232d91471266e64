"""Requests in flight when the engine ended. A query of death, a request that crashes the engine, held and sent to
each new engine, would crash every one of them until the daemon gave up (FATAL): one client's request would take
serving down for everyone. So only a request the engine never saw may wait for the next engine (hold.py): one whose
connection to the engine was open when the engine ended is answered at once (502, or its stream cut where it is) and
never sent again; after_failure() is that choice.

The journal names the client whose requests were in flight at two or more of the engine's ends within WINDOW_S (the
daemon's crash_loop_window_s by default): its address, the request's method and path, never its body nor its headers
(prompts, API keys). Casualties keeps that book: ends told apart by when each request was sent (one sent after an end
was seen went to a later engine), a line per end and client at most, MAX_CLIENTS clients at most.

Naming alone left the killer free: a new request each time is no request sent again, and five crashes within the
daemon's window are FATAL for everyone. So a client whose requests were in flight at refuse_after ends within the
window (serve.proxy.refuse_after_ends, 2: below the daemon's crash_loop_failures, 5) is refused for the rest of it:
429 at once, with Retry-After the seconds until it is at fewer ends again, nothing sent to the engine (refuse(),
asked before a request's body is read and before each try, a held request's included). One line names the refusal,
once per client and window. The client is the TCP peer's address, grouped as the metrics server groups password
checks (client_of: an IPv6 /64 is one client, and so is 127.0.0.0/8 beside 127.0.0.1, where a local user has 2**24
addresses); X-Forwarded-For is anyone's to write and is never read. A request without a peer address (a Unix
socket; the proxy listens on TCP only today) is the client NO_ADDRESS, all such requests together: refusing them all
for a window costs less than FATAL for everyone until an operator acts.

A request the engine answered with a 5xx is in flight at an end too where the engine is seen down within
END_AFTER_5XX_S of that answer (answered(), engine_seen_down()): vLLM 0.32 does not cut the connection when its
EngineCore dies, its API server answers the requests in flight 500 (a stream: an error event, then [DONE]) and then
ends, so the killer's client got an answer, never a cut, and was never counted. The book keeps (client, when sent,
method and path, when answered) for the latest ANSWERS_MAX such answers, never a body or a header. vLLM's server goes
on answering 500 to new requests for a moment after its engine died, so from an end until the engine is seen healthy
again (end_open) the proxy sends a request only after a look at /health answers (proxy/ends.py): a retry is held for
the next engine rather than answered 500 by the dying one and counted at a second end of the same death.
"""

from __future__ import annotations

import logging
import re
import time
from collections import OrderedDict, deque

from ..base.peers import host_of
from .body import Refusal

log = logging.getLogger("gpuwarden.proxy")

WINDOW_S = 600.0
MAX_CLIENTS = 1024
MAX_ENDS = 1024  # ends remembered within the window (the daemon restarts an engine a few times a window at most)
CRASH_LOOP_FAILURES = 5  # the daemon's serve.crash_loop_failures: the brake's (Casualties.until)
REFUSE_AFTER_ENDS = 2  # serve.proxy.refuse_after_ends: below the daemon's crash_loop_failures (5)
NO_ADDRESS = "(no peer address)"  # the client of a request whose connection has no peer address (a Unix socket)
# How long after a 5xx answer the engine may be seen down for the answer to count as in flight at that end. vLLM 0.32's
# API server, its EngineCore dead, answers /health 503 at once (entrypoints/serve/instrumentator/health.py), answers
# the requests in flight 500 and then ends: at once after a plain 500 (terminate_if_errored in its exception handler),
# within its watchdog's 5 s after a stream's error event (entrypoints/launchers/launcher.py, watchdog_loop). 10 s is
# that watchdog twice over, for a loaded box; an engine that ends later than that after a 5xx is not taken to have
# ended on the request it answered (a healthy engine that answers some request 500 and ends minutes later for another
# reason counts nobody for it).
END_AFTER_5XX_S = 10.0
ANSWERS_MAX = 1024  # 5xx answers remembered: (client, sent, method and path, answered), never a body nor a header
# What marks a stream that vLLM ended with an error (its status 200 was sent before the engine died): OpenAI's shape
# with a 5xx code (chat_completion/serving.py: create_streaming_error_response) or, on /v1/messages, Anthropic's error
# event (anthropic/serving.py: internal_error). The model's text cannot forge either: it is JSON-escaped within a data
# line, so a line never begins with it, nor does '{"' follow 'data: ' inside it.
STREAM_ERROR = re.compile(rb'^(?:data: ?\{"error": ?\{[^\n]*"code": ?5\d\d\b'
                          rb'|event: ?error\r?\ndata: ?\{[^\n]*"(?:internal_error|api_error)")', re.MULTILINE)
TAIL_BYTES = 4096  # the end of a stream looked at for that error: one event's worth, the rest never kept

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


def failed(status: int, tail: bytes = b"") -> bool:
    """Whether the engine's answer is one a dying engine gives: a 5xx other than 503 (an engine starting, draining or
    busy says 503, and is held for: hold.py), or a stream whose tail (its last TAIL_BYTES, tail_of) holds an error."""
    return (status >= 500 and status != 503) or STREAM_ERROR.search(tail) is not None


def tail_of(tail: bytes, chunk: bytes) -> bytes:
    """A stream's last TAIL_BYTES or fewer once chunk is added, from a line's start: a tail cut mid-line loses that
    partial line (STREAM_ERROR matches at a line's start, and a string's start is one)."""
    tail = tail + chunk[-TAIL_BYTES:]
    if len(tail) > TAIL_BYTES:
        tail = tail[-TAIL_BYTES:]
        cut = tail.find(b"\n")
        tail = tail[cut + 1:] if cut >= 0 else b""
    return tail


def client_of(request) -> str:
    """The client a request counts for: its TCP peer's address (an aiohttp request's remote), an IPv6 one by its /64,
    and every address of this host's own (127.0.0.0/8, ::1, an interface's) as one, "this host" (base/peers.host_of:
    one local user would be many clients otherwise); never a header."""
    return host_of(request.remote) if request.remote else NO_ADDRESS


class Client:
    """One client's ends within the window: (the end's number, when it was seen), oldest first; and until when its
    refusal was told (the clock's)."""

    __slots__ = ("ends", "told_until")

    def __init__(self):
        self.ends: deque[tuple[int, float]] = deque(maxlen=MAX_ENDS)
        self.told_until = float("-inf")


class Casualties:
    def __init__(self, clock=time.monotonic, window_s: float = WINDOW_S, max_clients: int = MAX_CLIENTS,
                 refuse_after: int = REFUSE_AFTER_ENDS, wall=time.time, failures: int = CRASH_LOOP_FAILURES):
        """refuse_after: a client at this many ends within window_s is refused until it is at fewer (0: never);
        wall: the time of day, for the line's "until"; failures: the daemon's crash_loop_failures, for the brake
        (once failures - 1 ends are within the window, a client at any of them is refused: the last end before
        FATAL never comes from a known suspect; none below 2, nor where refuse_after is 0)."""
        self.clock, self.window_s, self.max_clients = clock, window_s, max_clients
        self.refuse_after, self.wall = refuse_after, wall
        self.brake = failures - 1 if refuse_after and failures >= 2 else 0
        self.count = 0  # the engine's ends seen with a request in flight, since the proxy started
        self._ends: deque[tuple[int, float]] = deque(maxlen=MAX_ENDS)  # (number, when seen) within the window
        self._clients: OrderedDict[str, Client] = OrderedDict()  # the newest end last
        self._answers: deque[tuple[str, float, str, float]] = deque(maxlen=ANSWERS_MAX)  # answered(): 5xx
        self.end_open = False  # an end was seen, and the engine not seen healthy since (engine_seen_up)

    def ended(self, client: str, sent_at: float) -> tuple[int, int] | None:
        """A request of client's, sent at sent_at (the clock's), was in flight when the engine ended. (the client's
        ends, all ends) within the window when this makes the client's second or later end: name it, once per end;
        else None."""
        now = self.clock()
        self._forget(now)
        self.end_open = True
        if not self._ends or sent_at > self._ends[-1][1]:  # sent after the last end was seen: a new end
            self.count += 1
            self._ends.append((self.count, now))
        end = self._ends[-1][0]
        mine = self._clients.pop(client, None) or Client()
        self._clients[client] = mine  # the newest last: the oldest is the first to go
        while len(self._clients) > self.max_clients:
            self._clients.popitem(last=False)
        if mine.ends and mine.ends[-1][0] == end:
            return None  # another of its requests at the same end: said already
        mine.ends.append((end, now))
        return (len(mine.ends), len(self._ends)) if len(mine.ends) >= 2 else None

    @property
    def braking(self) -> bool:
        """Whether the brake holds now: failures - 1 ends within the window (until())."""
        return bool(self.brake) and len(self._ends) >= self.brake and \
            self.clock() - self._ends[-self.brake][1] <= self.window_s

    def note(self, client: str, sent_at: float, what: str) -> None:
        """ended(), and the line that names the client where it is its second or later end: what is the request's
        method and path; and the line that says it is refused from now on, where this end begins its refusal."""
        braking = self.braking
        named = self.ended(client, sent_at)
        if self.braking and not braking:
            log.warning("proxy: the engine's ends with requests in flight in the last %g s are %d, one fewer than the "
                        "daemon stops it for good at: every request is refused (503, or 429 for a client at its own "
                        "ends) until they are fewer, in %.0f s", self.window_s, len(self._ends),
                        self.brake_until() - self.clock())
        if named is not None:
            log.warning("proxy: client %s had requests in flight at %d of the engine's %d ends in the last %g s (the "
                        "latest: %s): its requests may be what ends the engine (a query of death); none was sent "
                        "again", client, *named, self.window_s, what)
        self._tell(client)

    def answered(self, client: str, sent_at: float, what: str, status: int, tail: bytes = b"",
                 suspect: bool = False) -> bool:
        """The engine answered a request of client's, sent at sent_at: with status, and for a stream its tail
        (tail_of). Whether it failed (failed()) and is kept, to count as in flight at an end seen within
        END_AFTER_5XX_S of now (engine_seen_down): what is its method and path. suspect: the request did not end
        cleanly whatever its status and tail (its client left, the engine broke it off or closed it unanswered while
        it still answered /health: after_failure's BROKE): kept the same."""
        if not suspect and not failed(status, tail):
            return False
        self._answers.append((client, sent_at, what, self.clock()))
        return True

    @property
    def answers_pending(self) -> bool:
        """Whether a failed answer is recent enough that an end seen now would count it."""
        return bool(self._answers) and self.clock() - self._answers[-1][3] <= END_AFTER_5XX_S

    def engine_seen_down(self) -> int:
        """The engine's /health did not answer after a failed answer: an end. Each failed answer of the last
        END_AFTER_5XX_S counts as a request in flight at it (note(): named, and refused, as a request cut by it); the
        older ones are forgotten. How many counted."""
        now, counted = self.clock(), 0
        answers, self._answers = self._answers, deque(maxlen=ANSWERS_MAX)
        for client, sent_at, what, answered_at in answers:
            if now - answered_at <= END_AFTER_5XX_S:
                self.note(client, sent_at, what)
                counted += 1
        return counted

    def engine_seen_up(self) -> None:
        """The engine's /health answered 200: a request sent from now on goes to an engine that serves, and an end
        it meets is a new one."""
        self.end_open = False

    def forget_answers(self) -> None:
        """A planned stop begins: its end is nobody's, whatever the engine answered before it."""
        self._answers.clear()

    def own_until(self, client: str) -> float | None:
        """When (the clock's) the client is at fewer than refuse_after ends within the window again; None: it is
        not refused for its own ends now."""
        mine = self._clients.get(client)
        if not self.refuse_after or mine is None or len(mine.ends) < self.refuse_after:
            return None
        until = mine.ends[-self.refuse_after][1] + self.window_s  # its Nth newest end leaves the window then
        return until if self.clock() <= until else None

    def brake_until(self) -> float | None:
        """While the brake holds (failures - 1 ends within the window: one more is FATAL), when the oldest of them
        leaves it; else None. Every client is refused meanwhile, one at none of the ends too: a killer from a
        fresh address (an IPv6 /64 is one client, and a home line has 256 of them) would otherwise end the engine
        the last time (two ends each from two addresses, then one from a third: FATAL). A pause that ends by itself within the window, against FATAL until an operator acts."""
        if not self.braking:
            return None
        return self._ends[-self.brake][1] + self.window_s

    def until(self, client: str) -> float | None:
        """When (the clock's) the client is served again; None: it is not refused now. Asked of every request."""
        found = [t for t in (self.own_until(client), self.brake_until()) if t is not None]
        return max(found) if found else None

    def refuse(self, client: str) -> None:
        """Refusal where the client is refused now, Retry-After the whole seconds until it is served again: 429 for
        its own ends, else 503 while the brake holds."""
        until = self.until(client)
        if until is None:
            return
        after = int(until - self.clock()) + 1
        if self.own_until(client) is not None:
            raise Refusal(429, "client_refused", f"refused: this client's requests were in flight at "
                          f"{self.refuse_after} of the engine's ends in the last {self.window_s:g} s (a request that "
                          "ends the engine, sent again and again, would take serving down for everyone); nothing was "
                          "sent to the engine", after)
        raise Refusal(503, "serving_braked", f"serving is paused: the engine ended {self.brake} times in the last "
                      f"{self.window_s:g} s with requests in flight, one fewer than the daemon stops it for good at; "
                      "no request is sent to it until the oldest of those ends leaves that window", after)

    def _tell(self, client: str) -> None:
        """The refusal's line, once per client and window: when its end makes it refused, unless said already."""
        until, mine = self.own_until(client), self._clients.get(client)  # the brake has its own line (note)
        if until is None or mine is None or until <= mine.told_until:
            return
        if self.clock() > mine.told_until:  # a new refusal, not one that a later end made longer
            left = until - self.clock()
            log.warning("proxy: refusing client %s for %.0f s, until %s: its requests were in flight at %d of the "
                        "engine's ends in the last %g s (refuse_after_ends %d); each of its requests gets 429 at "
                        "once, nothing sent to the engine", client, left,
                        time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.wall() + left)), self.refuse_after,
                        self.window_s, self.refuse_after)
        mine.told_until = until

    def _forget(self, now: float) -> None:
        while self._ends and now - self._ends[0][1] > self.window_s:
            self._ends.popleft()
        for client in [c for c, mine in self._clients.items()
                       if not mine.ends or now - mine.ends[-1][1] > self.window_s]:
            del self._clients[client]
        for mine in self._clients.values():
            while mine.ends and now - mine.ends[0][1] > self.window_s:
                mine.ends.popleft()
