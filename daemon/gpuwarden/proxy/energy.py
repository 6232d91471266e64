"""Joules per request (design/joules-per-request.md): the ledger that splits each interval's energy, as the daemon
measured it per GPU in whole millijoules, over the requests in flight in it, by the tokens each puts there; what no
request's tokens claim is idle. Integers throughout, so that per GPU the shares plus the idle plus the unattributed
are the energy measured, exactly: the conservation law, and its test.

The model: a request's prompt tokens spread evenly over its prefill (sent to the engine, to its first byte back), its
output tokens over its decode (first byte to end); a prefill or decode of no length puts its tokens at its instant.
An answer not streamed has its first byte at its end, so its prompt and output tokens together spread over its span.
An interval's split waits until every request that may overlap it has ended (its tokens are known only then), LATE_S
at most: then a request still in flight weighs by its tokens so far (its estimated prompt, its stream's events), so
that one long request holds back nobody's joules; a request's joules are final once the intervals up to its end have
settled. Pure: no clock, no I/O; the proxy's
wiring (proxy/joules.py) feeds it."""

from __future__ import annotations

import heapq
from collections import Counter, deque
from dataclasses import dataclass, field

MAX_OPEN = 4096  # intervals waiting for their requests: over an hour of 1 s polls
MAX_DONE = 16384  # ended requests waiting for the intervals up to their end
# An interval waits this long for the requests in flight in it to end (their tokens known), then settles with them
# weighed by their tokens so far; an ended request that no interval reached for GONE_S (the daemon sends none) is
# final with what it has
LATE_S, GONE_S = 10.0, 60.0
SCALE = 1_000_000  # weights in millionths of a token: the split is integer arithmetic, exact and repeatable


@dataclass(frozen=True)
class Interval:
    t0: float  # the interval's bounds on CLOCK_MONOTONIC, the one clock of every process of the host
    t1: float
    mj: dict[str, int]  # gpu -> its energy over the interval, whole millijoules
    source: str = "counter"  # or "power": the trapezoid of the power readings (no counter, or one that went back)


@dataclass
class Request:
    rid: int
    sent: float
    first: float = 0.0  # its first byte back
    end: float = 0.0
    prompt: int = 0
    output: int = 0
    estimated: bool = False  # its tokens are the proxy's estimate (no usage, or one that could not be true)
    partial: bool = False  # part of its span had no measured energy to share (a gap, a bound crossed)
    whole: bool = False  # an answer not streamed: its first byte is its end, so all its tokens spread over its span
    past_bytes: bool = False  # its usage says more tokens than its body and answer's bytes could carry (joules.py)
    # weighed over its span like any, but its share is nobody's and it is no sample: an error answer, a stream that
    # ended in an error event, one whose client left before any answer (the engine ran it: its neighbours must not pay)
    unsampled: bool = False
    what: str = ""  # for its log line: method, path, status
    mj: Counter = field(default_factory=Counter)  # gpu -> its share so far

    @property
    def joules(self) -> float:
        return sum(self.mj.values()) / 1000.0

    def weight(self, a: float, b: float) -> int:
        """Its tokens in [a, b), in millionths of a token."""
        if self.whole:  # when its decode began is unknown: prompt and output together over its whole span
            return round(SCALE * (self.prompt + self.output) * _part(self.sent, self.end, a, b))
        return round(SCALE * (self.prompt * _part(self.sent, self.first, a, b)
                              + self.output * _part(self.first, self.end, a, b)))


def _part(s: float, e: float, a: float, b: float) -> float:
    """The part of the span [s, e) inside [a, b); a span of no length: 1 if its instant is in [a, b)."""
    if e <= s:
        return 1.0 if a <= s < b else 0.0
    return max(0.0, min(e, b) - max(s, a)) / (e - s)


def split(total: int, weights: list[int]) -> list[int]:
    """total (an integer) over positive integer weights by the largest remainder: the parts sum to total exactly;
    a tie in the remainder goes to the earlier."""
    whole = sum(weights)
    parts = [total * w // whole for w in weights]
    rest = sorted(range(len(weights)), key=lambda i: (-(total * weights[i] % whole), i))
    for i in rest[:total - sum(parts)]:
        parts[i] += 1
    return parts


class Ledger:
    """The intervals not yet settled, the requests in flight and those ended but not final, and per GPU the
    energy measured, apportioned, idle and unattributed (each a Counter of whole mJ)."""

    def __init__(self):
        self.open: deque[Interval] = deque()
        self.flight: dict[int, Request] = {}  # in flight: its tokens so far (the estimate of its prompt, its events)
        self.done: dict[int, Request] = {}  # ended, not final
        self._ends: list[tuple[float, int]] = []  # (end, rid) of each in done, a heap: the first to be final on top
        self.settled_t = float("-inf")  # the end of the last interval settled
        self.measured, self.apportioned, self.idle, self.unattributed = Counter(), Counter(), Counter(), Counter()
        self.rejected = 0  # intervals refused: backwards, overlapping the settled, or not well formed
        # Output tokens a second of one request, over its life, as the ended ones with their usage went (a moving
        # mean): what a request in flight with no byte back yet is weighed by past LATE_S (a whole answer being
        # made, not streamed, whose tokens come only at its end: the re-check's N2)
        self.rate = 0.0

    def begin(self, rid: int, now: float, prompt: int = 0) -> None:
        """A request sent to the engine (again, for a try sent anew: what it was given stays its own); prompt: its
        prompt tokens as estimated until its answer says."""
        was = self.flight.get(rid)
        self.flight[rid] = Request(rid, now, prompt=prompt, estimated=True, mj=was.mj if was else Counter())

    def progress(self, rid: int, first: float, output: int) -> None:
        """A request's first byte came at first, and it has sent output tokens so far (a stream's events)."""
        request = self.flight.get(rid)
        if request is not None:
            request.first, request.output = request.first or first, output

    def forget(self, rid: int) -> None:
        """A request that ended with no answer (refused, held and given up): no joules of its own; what it was given
        while in flight (LATE_S) is nobody's, so that the requests' book is what the requests' joules sum to."""
        was = self.flight.pop(rid, None)
        for gpu, mj in (was.mj if was else {}).items():
            self.apportioned[gpu] -= mj
            self.unattributed[gpu] += mj

    def disown(self, request: Request) -> None:
        """A final request that is no sample (Request.unsampled): its share is nobody's."""
        for gpu, mj in request.mj.items():
            self.apportioned[gpu] -= mj
            self.unattributed[gpu] += mj

    def end(self, request: Request) -> list[Request]:
        """A request ended, its tokens known (request.sent as begin() was told); the requests now final. What it was
        given while in flight (LATE_S) stays its own."""
        was = self.flight.pop(request.rid, None)
        if was is None:
            return self._settle()
        request.first = min(max(request.first, request.sent), request.end)
        request.mj.update(was.mj)
        if not request.estimated and request.end > request.sent:
            life = request.output / (request.end - request.sent)
            self.rate = life if not self.rate else 0.9 * self.rate + 0.1 * life
        request.estimated = request.estimated or bool(was.mj)  # part of it weighed by its tokens so far
        self.done[request.rid] = request
        heapq.heappush(self._ends, (request.end, request.rid))
        finals = self._settle()
        while len(self.done) > MAX_DONE:  # bounded: the oldest final with what it has
            oldest = self._pop_ended(float("inf"))
            oldest.partial = True
            finals.append(oldest)
        return finals

    def _pop_ended(self, upto: float) -> Request | None:
        """The ended request that ended first, if it ended at upto or before, taken out of done; None. A heap, not a
        scan: with the bound's 16,384 waiting (a feed stalled), a scan at every end cost the loop 0.9 ms an end (the
        re-check's N8). An entry whose request went otherwise (or whose rid ended again) is dropped as it surfaces."""
        while self._ends and self._ends[0][0] <= upto:
            end, rid = heapq.heappop(self._ends)
            request = self.done.get(rid)
            if request is not None and request.end == end:
                del self.done[rid]
                return request
        return None

    def add(self, interval: Interval, now: float = float("-inf")) -> list[Request]:
        """The daemon's energy over an interval; the requests now final. An interval that ends before it starts,
        begins before the last one taken ended, or has a negative energy is refused (counted)."""
        last = self.open[-1].t1 if self.open else self.settled_t
        if not interval.t1 > interval.t0 or interval.t0 < last or any(mj < 0 for mj in interval.mj.values()):
            self.rejected += 1
            return []
        self.open.append(interval)
        if len(self.open) > MAX_OPEN:  # the daemon's intervals faster than they settle: the oldest is nobody's
            self._unattributed(self.open.popleft())
        return self._settle(now)

    def expire(self, now: float) -> list[Request]:
        """The bounds in time: an interval LATE_S old settles with the requests still in flight weighed by their
        tokens so far (a long request holds back nobody's joules); a request ended GONE_S ago that no interval
        reached (the daemon sends none) is final with what it has."""
        finals = self._settle(now)
        while (request := self._pop_ended(now - GONE_S)) is not None:  # none at or before settled_t is left here
            request.partial = True
            finals.append(request)
        return finals

    def _settle(self, now: float = float("-inf")) -> list[Request]:
        while self.open:
            interval = self.open[0]
            if any(r.sent < interval.t1 for r in self.flight.values()) and now - interval.t1 <= LATE_S:
                break  # a request in flight may weigh in it: wait for its tokens, LATE_S at most
            self.open.popleft()
            self._split(interval, now)
        finals = []
        while (request := self._pop_ended(self.settled_t)) is not None:
            finals.append(request)
        return finals

    def _split(self, interval: Interval, now: float) -> None:
        a, b = interval.t0, interval.t1
        weighed = [(r, w) for r in self.done.values() if (w := r.weight(a, b)) > 0]
        weighed += [(r, w) for r in self.flight.values() if r.sent < b and (w := _so_far(r, a, b, now, self.rate)) > 0]
        for gpu, mj in interval.mj.items():
            self.measured[gpu] += mj
            if not weighed:
                self.idle[gpu] += mj
                continue
            for (request, _), part in zip(weighed, split(mj, [w for _, w in weighed]), strict=True):
                request.mj[gpu] += part
            self.apportioned[gpu] += mj
        self.settled_t = b

    def _unattributed(self, interval: Interval) -> None:
        for gpu, mj in interval.mj.items():
            self.measured[gpu] += mj
            self.unattributed[gpu] += mj
        for request in self.done.values():
            if request.sent < interval.t1 and request.end > interval.t0:
                request.partial = True
        self.settled_t = interval.t1


def _so_far(r: Request, a: float, b: float, now: float, rate: float = 0.0) -> int:
    """A request in flight's tokens in [a, b) as known now: its estimated prompt over its prefill so far (to its first
    byte, else to now), its output so far over its decode so far; with no byte back yet, also `rate` output tokens a
    second over its time so far (an answer made whole before its first byte, or a prefill that waits its turn)."""
    prefill_end = r.first or now
    w = r.prompt * _part(r.sent, prefill_end, a, b)
    if r.first:
        w += r.output * _part(r.first, max(now, r.first), a, b)
    else:
        w += rate * max(0.0, min(b, now) - max(a, r.sent))
    return round(SCALE * w)
