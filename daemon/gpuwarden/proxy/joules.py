"""Joules per request, the proxy's side (design/joules-per-request.md): the daemon's energy sums read from their file
(serving/run/energyfeed.py) twice a second, each new reading the interval since the last, into the ledger
(proxy/energy.py); each request's times and tokens from the relay; what the ledger settles to the metrics and one
log line a request.

A request's tokens are its answer's usage where the engine gives one, else the proxy's estimate (proxy/usage.py).

An answer that is no success (not 2xx, no bytes, a stream that ended in an error event) and a request whose client
left before any answer are weighed over their span like any (the engine ran them: their neighbours must not pay for
them), but their share is nobody's and they are no sample of what serving costs."""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import math
import time
from pathlib import Path

from collections import Counter

from prometheus_client import Counter as Counted, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from ..base import smallfile
from ..base.safetext import visible
from .casualties import failed
from .energy import Interval, Ledger, Request
from .usage import tokens_of

log = logging.getLogger("gpuwarden")
READ_EVERY_S = 0.5
FEED_MAX = 16 * 1024
TAIL_MAX = 8 * 1024  # what of an answer's end is kept to find its usage
LINES_A_SECOND = 10  # the per-request lines; past that, counted and said with the next
HEAD_MAX = 4 * 1024  # a stream's first bytes: Anthropic's message_start carries its input_tokens
EVENT = b"data: {"
# No GPU draws this much: a step past it over its interval is no reading (a forged file; a GPU's absence as one step)
MAX_WATTS = 5000
UNREAD_SAY_S = 10.0  # the daemon's file unreadable this long: said once (the unit's umask once made it so, silently)
BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000, 10_000, 25_000, 100_000)


# The paths whose answers are tokens the engine computed: vLLM's and SGLang's OpenAI, Anthropic and native APIs
# (vLLM's /invocations runs a completion or a chat by its body: keys.py); anything else (/v1/models, /health,
# /tokenize) is no work to weigh. POST, and PUT: SGLang serves /generate, /encode and /classify on both
# (sglang/srt/entrypoints/http_server.py), and a request not counted took its neighbours' joules (attacker 51).
COUNTED = frozenset(("/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/responses", "/v1/embeddings",
                     "/v1/rerank", "/rerank", "/v1/score", "/score", "/pooling", "/classify", "/generate", "/encode",
                     "/v1/audio/transcriptions", "/v1/audio/translations", "/inference/v1/generate",
                     "/invocations", "/v2/rerank"))
METHODS = frozenset(("POST", "PUT"))


def counted(method: str, path: str) -> bool:
    return method in METHODS and path in COUNTED


def read_feed(path: Path) -> tuple[str, float, dict[str, int], bool] | None:
    """(epoch, t, gpu -> mJ, any from the power readings) of the daemon's file; None: none, or not well formed."""
    try:
        data = smallfile.read(path, FEED_MAX)
        feed = json.loads(data) if data else None
    except (OSError, ValueError, RecursionError, smallfile.Unreadable):
        return None
    if not isinstance(feed, dict) or feed.get("v") != 1:
        return None
    epoch, t, gpus, power = feed.get("epoch"), feed.get("t"), feed.get("gpus"), feed.get("power")
    if not (isinstance(epoch, str) and len(epoch) <= 64 and isinstance(t, (int, float)) and not isinstance(t, bool)
            and math.isfinite(t) and isinstance(gpus, dict) and len(gpus) <= 64):
        return None
    sums = {g: mj for g, mj in gpus.items() if isinstance(g, str) and g.isdigit() and len(g) <= 2
            and isinstance(mj, int) and not isinstance(mj, bool) and 0 <= mj < 1 << 62}
    return (epoch, float(t), sums, bool(power)) if len(sums) == len(gpus) else None


class Joules:
    """One proxy's joules per request: the ledger, the feed it reads, and the metrics it adds to the registry."""

    def __init__(self, path: Path | None, model: str, registry, clock=time.monotonic):
        self.path, self.model, self.clock = path, model, clock
        self.ledger = Ledger()
        self.ids = itertools.count(1)
        self.last: tuple[str, float, dict[str, int]] | None = None  # the last reading: (epoch, t, sums)
        self.unread = 0  # reads that found no reading or a bad one (none yet is no fault)
        self.first: dict[str, int] = {}  # the sums of the daemon's first reading this proxy took, of its epoch
        self.unmeasured = 0  # requests no reading reached (the daemon stopped writing): no joules
        self.joules = Histogram("gpuwarden_proxy_request_joules", "Joules of the engine's GPUs each request drew, "
                                "its share of each poll interval's energy by its tokens in it (NVML's counter steps "
                                "every 20-100 ms: a request shorter than a step gets a share its neighbours set)",
                                ["model"], registry=registry, buckets=BUCKETS)
        self.tokens = Counted("gpuwarden_proxy_tokens", "Tokens of the requests given joules, by kind (prompt, "
                              "output): gpuwarden_proxy_request_joules_sum over the output ones is joules per output "
                              "token", ["model", "kind"], registry=registry)
        self.estimated = Counted("gpuwarden_proxy_requests_estimated", "Requests given joules by the proxy's estimate "
                                 "of their tokens (no usage in the answer, or one past 10 million tokens)", ["model"],
                                 registry=registry)
        self.unchecked = Counted("gpuwarden_proxy_requests_usage_past_bytes", "Requests given joules by a usage that "
                                 "says more tokens than their body and answer's bytes could carry: an image's tokens, "
                                 "a reasoning model's thinking not sent back, or an engine that miscounts", ["model"],
                                 registry=registry)
        registry.register(self)
        self._unread_since: float | None = None  # the first of the reads that found no reading, since the last one did
        self._unread_said = False
        self._said = (0.0, 0)  # (the second of the last per-request lines, lines said in it)
        self._unsaid = 0

    def collect(self):
        ledger = self.ledger
        family = CounterMetricFamily("gpuwarden_proxy_gpu_energy_joules", "The engine's GPUs' energy as the daemon "
                                     "measured it since this proxy's first reading, settled, by where it went: "
                                     "requests (their shares), idle (nothing in flight), nobody (a request past its "
                                     "bound); with gpuwarden_proxy_gpu_energy_waiting_joules, what the GPU drew",
                                     labels=["gpu", "to"])
        for gpu in sorted(ledger.measured, key=int):
            for to, book in (("requests", ledger.apportioned), ("idle", ledger.idle), ("nobody", ledger.unattributed)):
                family.add_metric([gpu, to], book[gpu] / 1000.0)
        yield family
        waiting = Counter()
        for interval in ledger.open:
            waiting.update(interval.mj)
        gauge = GaugeMetricFamily("gpuwarden_proxy_gpu_energy_waiting_joules", "The engine's GPUs' energy read but not "
                                  "yet settled: its intervals wait for requests in flight to end", labels=["gpu"])
        for gpu in sorted(set(ledger.measured) | set(waiting), key=int):
            gauge.add_metric([gpu], waiting[gpu] / 1000.0)
        yield gauge
        yield CounterMetricFamily("gpuwarden_proxy_energy_unread", "Reads of the daemon's energy file that found no "
                                  "reading: none yet, gone, or not as the daemon writes it (a broken feed counts no "
                                  "joules)", value=self.unread)
        yield CounterMetricFamily("gpuwarden_proxy_requests_unmeasured", "Counted requests that no energy reading "
                                  "reached (the daemon's feed stopped): given no joules, not in the histogram",
                                  value=self.unmeasured)
        yield CounterMetricFamily("gpuwarden_proxy_energy_intervals_refused", "Intervals of the daemon's readings the "
                                  "ledger refused: back in time, overlapping, or a negative energy",
                                  value=ledger.rejected)
        yield GaugeMetricFamily("gpuwarden_proxy_joules_pending_requests", "Counted requests whose joules are not yet "
                                "final: in flight, or ended and waiting for the intervals up to their end",
                                value=len(ledger.flight) + len(ledger.done))

    # -- a request's life, told by the server and the relay --------------------------------------------------
    def sent(self, tries) -> None:
        """A try sent to the engine (tries.sent_at): it is in flight from then. Not before the daemon's first
        reading (no feed: no joules, and no request kept for them)."""
        if self.last is None:
            return
        if tries.rid == 0:
            tries.rid = next(self.ids)
        self.ledger.begin(tries.rid, tries.sent_at, tries.body_bytes // 4)

    def progress(self, tries, first_at: float, events: int) -> None:
        """A counted answer's bytes so far: its first byte's time, its stream's events (its output tokens so far)."""
        if tries.rid:
            self.ledger.progress(tries.rid, first_at, max(0, events - 1))

    def gone(self, tries) -> None:
        """The request's end without an answer relayed: one at the engine when its client left is weighed over its
        span, its prompt estimated, and its share is nobody's (Request.unsampled); one held or refused is in flight
        no more (held) and is nothing."""
        if tries.rid and not tries.answered:
            end = self.clock()
            if tries.rid in self.ledger.flight:  # its output so far at the rate ended requests had (the re-check's R2:
                # its prompt alone, its decode was its neighbours' to pay); high or low, its share is nobody's
                output = round(self.ledger.rate * max(0.0, end - tries.sent_at))
                self._final(self.ledger.end(Request(tries.rid, tries.sent_at, end, end, tries.body_bytes // 4,
                                                    output, True, whole=True, unsampled=True)))
            self._final(self.ledger.expire(end))

    def held(self, tries) -> None:
        """A try the engine never had (refused at connect, or answered 503 while it was down), held for the engine's
        return: out of flight until it is sent again, so that the outage's energy is idle, not its (attacker 51: a
        request held through a 30 s restart took the restart's 8,447 J against 402 J with the engine up)."""
        if tries.rid:
            self.ledger.forget(tries.rid)

    def ended(self, request, tries, first_at: float | None, tail: bytes, streaming: bool, events: int, sent: int,
              status: int, head: bytes = b"") -> None:
        tries.answered = True
        if not tries.rid:
            return
        end = self.clock()
        sample = 200 <= status < 300 and sent > 0 and not failed(status, tail)  # a 200 stream's error event: failed
        prompt, output, estimated, past = tokens_of(tail, streaming, events, sent, tries.body_bytes, head)
        record = Request(tries.rid, tries.sent_at, first_at if first_at is not None else end, end, prompt, output,
                         estimated, what=f"{visible(request.method[:16])} {visible(request.path[:200])} {status}",
                         whole=not streaming, past_bytes=past, unsampled=not sample)
        self._final(self.ledger.end(record))

    # -- the daemon's readings ---------------------------------------------------------------------------------
    async def forever(self) -> None:
        while True:
            await asyncio.sleep(READ_EVERY_S)
            self.read()

    def read(self) -> None:
        reading = read_feed(self.path) if self.path is not None else None
        if reading is None:
            self.unread += 1
            self._unreadable()
        else:
            if self._unread_said:
                log.info("proxy: joules per request: the daemon's energy file %s is read again", self.path)
            self._unread_since, self._unread_said = None, False
            epoch, t, sums, power = reading
            last, self.last = self.last, (epoch, t, sums)
            if last is None or last[0] != epoch:  # a new daemon: its sums begin anew, from this reading
                if last is not None:  # what ran since the old one's last reading had no energy read: partial
                    for r in (*self.ledger.flight.values(), *self.ledger.done.values()):
                        r.partial = True
                self.first = sums
                log.info("proxy: joules per request: the engine's GPUs' energy read from %s (the daemon's epoch %s; "
                         "sums=%s mJ)", self.path, visible(epoch), json.dumps(sums, sort_keys=True))
            elif t > last[1]:
                steps = {g: mj - last[2].get(g, 0) for g, mj in sums.items()}
                if any(mj > MAX_WATTS * (t - last[1]) * 1000 for mj in steps.values()):
                    self.ledger.rejected += 1  # no GPU draws that: the interval is no reading
                else:
                    self._final(self.ledger.add(Interval(last[1], t, steps, "power" if power else "counter"),
                                                self.clock()))
        self._final(self.ledger.expire(self.clock()))

    def _unreadable(self) -> None:
        """A read that found no reading: said once when the file stays unreadable UNREAD_SAY_S, with why."""
        now = self.clock()
        if self.path is None or self._unread_said:
            return
        if self._unread_since is None:
            self._unread_since = now
        elif now - self._unread_since >= UNREAD_SAY_S:
            try:
                why = "no such file" if smallfile.read(self.path, FEED_MAX) is None else "not as the daemon writes it"
            except (OSError, smallfile.Unreadable) as exc:  # Unreadable: a permission denied is said in its words
                why = str(exc)
            log.warning("proxy: joules per request: the daemon's energy file %s has not been readable for %.0f s "
                        "(%s): no joules until it is", self.path, now - self._unread_since, why)
            self._unread_said = True

    def _final(self, finals: list[Request]) -> None:
        for r in finals:
            if r.unsampled:  # weighed, its share nobody's (Request.unsampled)
                self.ledger.disown(r)
                continue
            if r.partial and not r.mj:  # the daemon sent nothing over its life: no figure, not a zero
                self.unmeasured += 1
                continue
            self.joules.labels(self.model).observe(r.joules)
            self.tokens.labels(self.model, "prompt").inc(r.prompt)
            self.tokens.labels(self.model, "output").inc(r.output)
            if r.estimated:
                self.estimated.labels(self.model).inc()
            if r.past_bytes:
                self.unchecked.labels(self.model).inc()
            self._line(r)

    def _line(self, r: Request) -> None:
        second, said = self._said
        now = int(self.clock())
        if now == second and said >= LINES_A_SECOND:
            self._unsaid += 1
            return
        self._said = (now, said + 1 if now == second else 1)
        notes = [n for n, on in (("tokens estimated", r.estimated), ("partial", r.partial),
                                 ("usage past its bytes", r.past_bytes)) if on]
        more = f" (+{self._unsaid} requests not logged)" if self._unsaid else ""
        self._unsaid = 0
        log.info("proxy: %s: %d prompt + %d output tokens, joules=%.2f%s%s", r.what or "a request",
                 r.prompt, r.output, r.joules, f" ({', '.join(notes)})" if notes else "", more)
