"""The proxy itself: aiohttp in front of the engine. /v1/messages and /v1/chat/completions are normalized
(normalize.py); every other path goes through untouched; /health and /metrics are the proxy's own.

Why aiohttp: the same maintained asyncio library `gpuwarden bench` uses, with a server and a client in one
package that Debian 12 ships (python3-aiohttp 3.8), streaming both ways without buffering. Bodies pass as
bytes: a request no rule changes goes upstream byte for byte, and responses are never parsed, so SSE events,
tool-call deltas, errors and status codes reach the client as the engine sent them, chunk by chunk. A compressed
body to a normalized path goes upstream decompressed, without its Content-Encoding, whether or not a rule changed
it (so the engine sees the same kind of body either way); to any other path it goes as it came.

The body of a normalized path is prepared in prepare.py. The limits on what clients send: listener.py (connections
and their deadlines), body.py (body size, the memory of bodies and parses at once), faults.py (one line a minute for
each kind of fault). While the engine is down, requests the engine never saw wait in hold.py, within limits of their
own; one in flight when the engine ended is answered at once and never sent again, and a client whose requests were
in flight at refuse_after_ends of its ends is refused, 429 at once, for the rest of the window (casualties.py; an
answer that failed just before an end counts as in flight at it, and after an end a request waits for the engine's
/health: ends.py). The answers the proxy gives itself take each API's error shape (refusals.py).
"""

from __future__ import annotations

import asyncio
import errno
import functools
import logging
import os
import time
from dataclasses import dataclass

import aiohttp
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from multidict import CIMultiDict
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from ..base import unixsock
from ..base.faultlog import FaultLog
from ..serving.run import word
from .body import Budget, Held, Refusal, read
from .casualties import (CRASH_LOOP_FAILURES, ENDED, HOLD, REFUSE_AFTER_ENDS, RESEND, WINDOW_S, Casualties,
                         after_failure, client_of)
from .dump import Dumper
from .ends import Ends
from .faults import proxy_faults
from .hold import Hold
from .joules import Joules, counted
from .keys import KEYED, KEYLESS, ApiKey
from .listener import Connections
from .normalize import Rules
from .prepare import Prepare
from .quiet import Quiet
from .refusals import error_response
from .relay import Relay, forwarded
from .scrape import scrape_forever
from .upstream import EngineConnector, EngineUnixConnector

log = logging.getLogger("gpuwarden.proxy")

NORMALIZED = {"/v1/messages": "anthropic", "/v1/chat/completions": "openai"}
# The memory of bodies and their parses at once, in maximum-size bodies: one of BMP text (CJK: 1 + 7 x its size,
# 9 x dumped; body.parse_cost) or two of ASCII (1 + 4 x) fit; the worst case stays under 512 MiB at 32 MiB.
BUDGET_BODIES = 12
RESERVE_BODIES = 2  # of them, always left to the other clients: one client's requests use at most the rest
OFF_LOOP_BYTES = 256 << 10
LOOK_S = 2.0  # a look at the engine's /health: an answer within this, or none (answers)
LOOKS_AT_ONCE = 2  # the looks' own connections: one look at a time (look.HealthLook), and one closing
OWN_LACK = {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM}  # a look that failed for the proxy's want


def off_loop(size: int, coding: str, dumping: bool, patterns: bool = False) -> bool:
    """Whether a body is made ready on a worker thread, so that the streams in flight do not wait for it: a big one
    (a long session is megabytes of JSON), a dump to disk, or any compressed one (32 KB of gzip is up to
    --max-body-bytes once inflated: twelve such clients would hold every stream 2.4 s on the loop), or
    any where the operator's patterns run (up to normalize.PATTERNS_S each, the GIL let go meanwhile)."""
    return size > OFF_LOOP_BYTES or dumping or patterns or coding.strip().lower() not in ("", "identity")

SELF = -1  # Proxy(engine_uid=SELF): the proxy's own uid
ENDED_MESSAGE = ("the engine ended while serving this request; it is not sent again (a request in flight when the "
                 "engine ends may be what ended it)")


class ProxyMetrics:
    def __init__(self, prefix_names: tuple[str | None, str | None]):
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("gpuwarden_proxy_requests", "Requests answered, by API and status code",
                                ["api", "code"], registry=r)
        self.streams = Counter("gpuwarden_proxy_streams", "Responses streamed as server-sent events", ["api"],
                               registry=r)
        self.chunks = Counter("gpuwarden_proxy_stream_chunks", "Response chunks passed on", registry=r)
        self.bytes_in = Counter("gpuwarden_proxy_request_bytes", "Request body bytes sent upstream", registry=r)
        self.bytes_out = Counter("gpuwarden_proxy_response_bytes", "Response body bytes passed to clients",
                                 registry=r)
        self.upstream = Histogram("gpuwarden_proxy_upstream_seconds", "Request received to upstream response "
                                  "headers", ["api"], registry=r,
                                  buckets=(.005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60, 300))
        self.normalized = Counter("gpuwarden_proxy_normalizations", "Changes made by each normalization rule",
                                  ["rule"], registry=r)
        self.failures = Counter("gpuwarden_proxy_failures", "Requests the proxy refused or could not finish",
                                ["reason"], registry=r)
        self.held = Histogram("gpuwarden_proxy_held_seconds", "Seconds a request waited for the engine to come "
                              "back, each time it was held", registry=r,
                              buckets=(.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800))
        self.prefix_names = prefix_names
        self.engine: dict[str, float] | None = None  # the upstream's latest /metrics, parsed
        self.engine_up: int | None = None  # 1 read at the last scrape, 0 not, None no scrape yet
        self.now: dict[str, tuple[str, object]] = {}  # name -> (help, a function of no arguments): gauges
        self.counts: dict[str, tuple[str, object]] = {}  # the same, counters read from another's book
        r.register(self)

    def read_state(self, hold, budget, conns, casualties) -> None:
        """The proxy's parts read at each scrape: the hold's requests, the body budget, the client connections (None:
        no cap) and the book of the engine's ends."""
        self.now["gpuwarden_proxy_held_requests"] = ("Requests waiting now for the engine to come back",
                                                     lambda: len(hold.waiting))
        self.now["gpuwarden_proxy_body_bytes"] = ("Bytes of request bodies and their parses held now, of the budget",
                                                  lambda: budget.used)
        self.now["gpuwarden_proxy_body_budget_bytes"] = ("At most this many bytes of request bodies and their "
                                                         "parses at once", lambda: budget.limit)
        if conns is not None:
            self.now["gpuwarden_proxy_connections"] = ("Client connections open now", lambda: len(conns.open))
            self.now["gpuwarden_proxy_connections_max"] = ("At most this many client connections at once",
                                                           lambda: conns.cap)
        self.counts["gpuwarden_proxy_engine_ends"] = ("The engine's ends that the proxy saw with requests in flight, "
                                                      "each counted against their clients "
                                                      "(serve.proxy.refuse_after_ends)", lambda: casualties.count)

    def collect(self):
        up = GaugeMetricFamily("gpuwarden_proxy_upstream_up", "Whether the upstream's /metrics was read at the "
                               "last scrape")
        up.add_metric([], self.engine_up or 0)
        yield up
        for name, (help_, read_now) in self.now.items():
            yield GaugeMetricFamily(name, help_, value=read_now())
        for name, (help_, read_now) in self.counts.items():
            yield CounterMetricFamily(name, help_, value=read_now())
        queries, hits = self.prefix_names
        if self.engine is None or not queries or not hits:
            return
        for name, what, help_ in ((queries, "queries", "Prompt tokens looked up in the engine's prefix cache"),
                                  (hits, "hits", "Prompt tokens the engine's prefix cache served")):
            family = CounterMetricFamily(f"gpuwarden_proxy_engine_prefix_cache_{what}_tokens",
                                         f"{help_} ({name}, as last read from the engine)")
            if name in self.engine:
                family.add_metric([], self.engine[name])
                yield family

    def describe(self):
        return []


async def _sent(held: Held, lend: bool):
    """The body for the upstream request, one piece: aiohttp asks for the next only once this one is written
    (handed to the socket, waiting for it to drain), and then the body's share of the budget is given back, or,
    while requests may be held, lent (body.py: kept for a retry until the engine answers, unless room is needed)."""
    yield held.body
    if lend:
        held.lend()
    else:
        held.release()


@dataclass
class Tries:
    """One request's tries at the engine."""

    seen: bool = False  # a try's connection was open: the engine may have read it, so it is never held from then on
    resent: bool = False  # sent once more at once already (casualties.RESEND)
    opened: bool = False  # the latest try had a connection open, whatever ended it (the session's trace says so)
    reused: bool = False  # ... a pooled one
    sent_at: float = 0.0  # when the latest try began, on the hold's clock
    rid: int = 0  # its number in the joules' ledger (joules.py); 0: not counted there
    answered: bool = False  # an answer was relayed: its joules come at the relay's end
    body_bytes: int = 0  # the body sent: its prompt tokens' estimate where the answer gives no usage


async def _opened(session, context, params) -> None:
    """The session's trace: a try got a connection, new or pooled (aiohttp 3.9 and later resend a request with no
    body by themselves once when its connection breaks, so a refused connect can follow a try the engine saw)."""
    if isinstance(context.trace_request_ctx, Tries):
        context.trace_request_ctx.opened = True
        context.trace_request_ctx.reused |= isinstance(params, aiohttp.TraceConnectionReuseconnParams)


def engine_session(limit: int, read_timeout_s: float, uid: int | None,
                   faults: FaultLog | None = None, socket: str | None = None) -> aiohttp.ClientSession:
    """The session to the engine: no automatic headers and no decompression, so what the client and the engine send
    passes as it is; limit connections at once (0: no limit); only to a socket of uid (upstream.py; None: any);
    each try's connection traced (Tries), and no resend of aiohttp's own (3.9 and later resend a request without a
    body once): casualties.py decides. socket: the engine's Unix socket, where it listens on one."""
    trace = aiohttp.TraceConfig()
    trace.on_connection_reuseconn.append(_opened)
    trace.on_connection_create_end.append(_opened)
    connector = EngineUnixConnector(socket, uid=uid, faults=faults, limit=limit) if socket else \
        EngineConnector(uid=uid, faults=faults, limit=limit)
    session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, connect=10, sock_read=read_timeout_s),
                                    auto_decompress=False, connector=connector,
                                    trace_configs=[trace],
                                    skip_auto_headers=("User-Agent", "Accept", "Accept-Encoding", "Content-Type"))
    if hasattr(session, "_retry_connection"):
        session._retry_connection = False
    return session


async def answers(session: aiohttp.ClientSession, url: str) -> bool | None:
    """Whether the engine's /health says it is up now (hold.py's one watcher asks, every half second): True; False:
    it answered 5xx (vLLM's 503 once its engine died), or refused or closed the connection; None: no answer within
    LOOK_S (a busy engine, or a frozen one: the daemon's stall check judges those), which is no end of it
    (look.HealthLook.ended). A 4xx is up: the server answers, and has no /health of its own (404: an
    OpenAI-compatible server that is not vLLM, such as Ollama) or keeps it behind a key (401); taken as down, one
    client that left mid-answer made an end of it, and every later request was held for hold_s."""
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=LOOK_S)) as reply:
            return reply.status < 500
    except asyncio.TimeoutError:  # before ClientError: aiohttp's timeouts are both
        return None
    except (aiohttp.ClientError, OSError) as exc:
        # The proxy's own lack of descriptors or memory says nothing of the engine: a proxy at its fd limit must not
        # count each failed look as an end.
        cause = getattr(exc, "os_error", exc)
        return None if getattr(cause, "errno", None) in OWN_LACK else False


def at_rest(request: web.Request) -> web.Response:
    """What needs no key, answered while the engine rests by choice (serve.idle), waking nothing: /ping 200 (the next
    request will be served), a CORS preflight allowed for what it asks, so that a browser sends its keyed request,
    which wakes the engine (attacker 18: the preflight got 503, and a browser client never woke it); the engine's own
    CORS headers on that answer decide what the browser may read. Anything else 503 with Retry-After."""
    if request.method == "OPTIONS" and "Access-Control-Request-Method" in request.headers:
        asked = request.headers
        return web.Response(status=200, headers={
            "Access-Control-Allow-Origin": asked.get("Origin", "*"), "Vary": "Origin",
            "Access-Control-Allow-Methods": asked["Access-Control-Request-Method"],
            "Access-Control-Allow-Headers": asked.get("Access-Control-Request-Headers", ""),
            "Access-Control-Max-Age": "0"})  # not kept: once the engine is up its own answer counts
    if request.path == "/ping":
        return web.Response(status=200)
    return error_response("other", 503, "the engine rests (serve.idle): a request with the engine's API key wakes it",
                          5)


class Proxy:
    def __init__(self, upstream: str, rules: Rules, metrics: ProxyMetrics, dumper: Dumper | None = None,
                 max_body_bytes: int = 32 << 20, read_timeout_s: float = 600.0, metrics_path: str = "/metrics",
                 faults: FaultLog | None = None, conns: Connections | None = None, hold_s: float = 0.0,
                 hold_max: int = 256, health_path: str = "/health", engine_uid: int | None = SELF,
                 ends: tuple[int, float] | tuple[int, float, int] = (REFUSE_AFTER_ENDS, WINDOW_S),
                 api_key: str | None = None, idle_after_s: float = 0.0):
        """engine_uid: the engine's user, the only one whose socket is sent a byte (SELF: the proxy's own; None:
        anyone's, an engine on another host); ends: a client in flight at this many of the engine's ends (0: never)
        within this many seconds is refused, and optionally the daemon's crash_loop_failures, for the brake
        (casualties.py); api_key: the engine's key, which every request but KEYLESS_PATHS must carry (keys.py);
        idle_after_s: no request for this long, none in flight, says the engine is idle (quiet.py; 0: never)."""
        # An engine on a Unix socket (an http+unix URL: base/unixsock.py) is asked by plain http:// paths over it.
        self.socket, self.shown = unixsock.path_of(upstream), unixsock.shown(upstream.rstrip("/"))
        self.upstream = "http://localhost" if self.socket else upstream.rstrip("/")
        self.engine_uid = os.geteuid() if engine_uid == SELF else engine_uid
        self.rules, self.metrics, self.dumper = rules, metrics, dumper
        self.max_body_bytes, self.read_timeout_s, self.metrics_path = max_body_bytes, read_timeout_s, metrics_path
        self.faults, self.conns = faults or proxy_faults(), conns
        self.budget = Budget(BUDGET_BODIES * max_body_bytes, (BUDGET_BODIES - RESERVE_BODIES) * max_body_bytes)
        self.prepare = Prepare(rules, metrics.normalized, dumper, self.faults, max_body_bytes)
        self.health_path = health_path
        self.key = ApiKey(api_key) if api_key else None
        self.quiet = Quiet(idle_after_s, lambda: word.say(word.IDLE))
        # Held requests keep their client connections: at most half the cap, so that /health, /metrics and new
        # requests still get in (and are answered 503 at once past hold_max).
        half = max(1, conns.cap // 2) if conns is not None else None
        hold_max = min(hold_max, half) if half is not None else hold_max
        # The looks at /health go on a session of their own: the clients' pool full (streams, or requests whose
        # clients left while the engine answers them) would otherwise make a look wait for a slot and time out.
        self.hold = Hold(hold_s, hold_max, lambda: answers(self.looks, self.upstream + self.health_path),
                         metrics.held)
        self.hold.in_flight, self.hold.rest_max = (lambda: self.quiet.in_flight), half
        self.casualties = Casualties(self.hold.clock, window_s=ends[1], refuse_after=ends[0],
                                     failures=ends[2] if len(ends) > 2 else CRASH_LOOP_FAILURES)
        self.ends = Ends(self.casualties, self.hold)
        metrics.read_state(self.hold, self.budget, conns, self.casualties)
        self.joules = Joules(None, "unnamed", metrics.registry, self.hold.clock)  # command.serve names its file
        self.relay = Relay(self.metrics, self.ends, self.hold, self.faults, self.joules)
        self.session: aiohttp.ClientSession | None = None
        self.looks: aiohttp.ClientSession | None = None  # the hold's and the ends' looks at /health, apart
        self._scraper: asyncio.Task | None = None
        self._quieter: asyncio.Task | None = None
        self._joules: asyncio.Task | None = None

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.max_body_bytes,
                              middlewares=[self.conns.middleware] if self.conns else [])
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.own_metrics)
        app.router.add_route("*", "/{tail:.*}", self.forward)
        app.on_startup.append(self._start)
        app.on_shutdown.append(self._closing)
        app.on_cleanup.append(self._stop)
        return app

    async def _start(self, app) -> None:
        # At most one upstream connection per client connection (and the scrape's): the fd limit counts both.
        self.session = engine_session(self.conns.cap + 4 if self.conns else 0, self.read_timeout_s, self.engine_uid,
                                      self.faults, self.socket)
        self.looks = engine_session(LOOKS_AT_ONCE, LOOK_S, self.engine_uid, self.faults, self.socket)
        self._scraper = asyncio.get_running_loop().create_task(scrape_forever(
            self.session, self.upstream, self.metrics_path, self.metrics, lambda: self.hold.planned))
        if self.quiet.after_s:
            self._quieter = asyncio.get_running_loop().create_task(self._listen_for_quiet())
        if self.joules.path is not None:
            self._joules = asyncio.get_running_loop().create_task(self.joules.forever())

    async def _listen_for_quiet(self) -> None:
        """serve.idle: the word that the engine is idle, when it is due (quiet.py), looked at once a second."""
        while True:
            await asyncio.sleep(min(1.0, self.quiet.due_in() or 1.0))
            if not self.hold.resting:  # at rest it is idle by the daemon's word: an idle said then could meet a wake
                self.quiet.tick()

    async def _closing(self, app) -> None:
        self.hold.close()  # held requests get their 503 while the connections are still open

    async def _stop(self, app) -> None:
        await self.hold.stop()
        await self.ends.stop()
        for task in (self._scraper, self._quieter, self._joules):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        for session in (self.session, self.looks):
            if session is not None:
                await session.close()

    async def health(self, request: web.Request) -> web.Response:
        """The proxy's own liveness, for the supervisor: 200 while it answers, whether or not the engine does
        (a restart of the proxy would not bring the engine back); the engine's state is in the body."""
        upstream = {1: "up", 0: "down", None: "not read yet"}[self.metrics.engine_up]
        return web.json_response({"status": "ok", "upstream": upstream})

    async def own_metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.metrics.registry),
                            headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})

    # -- the proxy ---------------------------------------------------------------------------------------
    async def forward(self, request: web.Request) -> web.StreamResponse:
        began = time.monotonic()
        api = NORMALIZED.get(request.path) if request.method == "POST" else None
        label = api or "other"
        let_in = self.key.lets_in(request.method, request.path, request.headers) if self.key is not None else KEYED
        if let_in is None:
            return self._refuse(request, label, 401, "unauthorized", "the engine's API key is needed (Authorization: "
                                "Bearer KEY)")
        # A balancer's look, and whatever needs no key, is not work for the engine: it neither keeps it awake nor
        # wakes it (attacker 18: keyless /version every few seconds kept it awake)
        liveness = let_in == KEYLESS or (not request.can_read_body and (request.path == "/ping" or (
            request.method == "OPTIONS" and "Access-Control-Request-Method" in request.headers)))
        if liveness and self.hold.resting:  # at rest by choice, and the next request wakes it: the service is up
            return at_rest(request)
        held, tries = self.budget.hold(client_of(request)), Tries()
        quiet = self.quiet if not liveness else None
        if quiet is not None:
            quiet.began()  # a request for the engine: it is not idle until this one has ended (quiet.py)
        try:
            try:
                self.casualties.refuse(held.client)  # before a byte of its body is read
                body = await self._read(request, held)
                headers = forwarded(request.headers)
                if api is not None:
                    coding = ",".join(headers.popall("Content-Encoding", ()))
                    prepare = functools.partial(self.prepare, api, body, coding, held, request.remote,
                                                request.path)
                    if off_loop(len(body), coding, self.dumper is not None, bool(self.rules.remove_patterns)):
                        body = await asyncio.get_running_loop().run_in_executor(None, prepare)
                    else:
                        body = prepare()
                    del prepare  # the body as received goes with it
                    held.give(max(0, held.bytes - len(body)))  # the parse is done: only the bytes to send stay held
            except Refusal as exc:
                return self._refuse(request, label, exc.status, exc.reason, str(exc), exc.retry_after)
            except (ConnectionError, HttpProcessingError) as exc:  # the client left, or broke, mid-body
                self.metrics.failures.labels("client_gone").inc()
                self.faults.note("bodies cut short by the client", f"{request.method} {request.path} from "
                                 f"{request.remote}: the body stopped: {exc}", logging.INFO)
                return web.Response(status=400)  # for a client still there; aiohttp closes the connection
            self.metrics.bytes_in.inc(len(body))
            if body:  # sent as a stream of one piece, so its share is given back once the engine has it
                headers["Content-Length"] = str(len(body))
                held.keep(body)
            body = None
            return await self._send(request, headers, held, label, began, tries, holds=let_in != KEYLESS)
        finally:
            self.joules.gone(tries)
            held.release()
            if quiet is not None:
                quiet.ended()

    async def _send(self, request: web.Request, headers: CIMultiDict, held: Held, label: str,
                    began: float, tries: Tries, holds: bool = True) -> web.StreamResponse:
        """Send the request upstream and relay the answer; while the engine is down (it refused the connection, or
        answered 503; any 5xx while it drains for a planned stop) and it never had the request, hold it (hold.py) and
        send it again once the engine is back, while its body is still here (body.py may have given it up). A request
        in flight when the engine ended is answered 502 at once, never sent again (casualties.py), and before each
        try a client refused meanwhile gets 429. While the engine drains for a planned stop, a request is held unsent;
        while the daemon says it is not restarting, 503; after an end, until the engine's /health answers, held unsent
        (ends.py), or 502 without a hold."""
        first_held = None
        while True:
            try:
                self.casualties.refuse(client_of(request))
                self.hold.refuse_if_not_restarting()
            except Refusal as exc:
                return self._refuse(request, label, exc.status, exc.reason, str(exc), exc.retry_after)
            if not self.hold.planned:
                if await self.ends.may_send():
                    response = await self._send_once(request, headers, held, label, began, tries)
                    if response is RESEND:  # at once, whatever the word: it is never held (it was seen)
                        tries.resent = True
                        response = await self._send_once(request, headers, held, label, began, tries)
                    if response is not None:
                        return response
                elif not self.hold.on:
                    return self._refuse(request, label, 502, "upstream_down", f"upstream {self.shown} is down: "
                                        "the engine ended and its /health does not answer yet")
            if not holds:  # a request without the key takes no place of the hold (keys.ApiKey.lets_in)
                return self._refuse(request, label, 503, "not_held_keyless", "the engine is not up; a request "
                                    "without the engine's API key is not held: retry later")
            first_held = time.monotonic() if first_held is None else first_held
            self.joules.held(tries)  # the engine never had it: the outage's energy is not its
            try:
                await self.hold.wait(request, first_held)
            except Refusal as exc:
                return self._refuse(request, label, exc.status, exc.reason, str(exc), exc.retry_after)
            except asyncio.CancelledError:  # the handler of a client that left is cancelled (listener.Connection)
                self.metrics.failures.labels("client_gone").inc()
                raise
            except ConnectionResetError:
                self.metrics.failures.labels("client_gone").inc()
                return web.Response(status=400)  # nobody reads it: the connection is closed

    async def _send_once(self, request: web.Request, headers: CIMultiDict, held: Held, label: str,
                         began: float, tries: Tries) -> web.StreamResponse | str | None:
        """One try: the answer relayed, or a refusal; None: the engine is down and never had the request, which is
        to be held; RESEND: a pooled connection closed unanswered while the engine is healthy, to be sent once more
        at once (casualties.after_failure decides)."""
        tries.opened, tries.reused, tries.sent_at = False, False, self.hold.clock()
        if counted(request.method, request.path):  # a request that makes tokens: in flight for the joules from now
            tries.body_bytes = int(headers.get("Content-Length") or 0)
            self.joules.sent(tries)
        try:
            data = _sent(held, self.hold.on) if held.body is not None else None
            async with self.session.request(request.method, self.upstream + request.path_qs, data=data,
                                            headers=headers, allow_redirects=False, trace_request_ctx=tries) as up:
                # vLLM answers a request that reached it after its planned stop began 500 ("cannot schedule new
                # futures after shutdown"): while the daemon says it drains, any 5xx holds. The engine answered, so
                # it did not end on this request; one that an engine may have ended on (seen) is never held.
                failed = up.status == 503 or (up.status >= 500 and self.hold.planned)
                down = failed and self.hold.on and not tries.seen and await self.hold.engine_down()
                if not (down and held.reclaim()):
                    held.release()  # from here on, never sent again
                    self.metrics.upstream.labels(label).observe(time.monotonic() - began)
                    return await self.relay.answer(request, up, label, tries)
        except asyncio.CancelledError:  # the client left (aiohttp cancels its handler where told to)
            if tries.opened or tries.seen:
                self.ends.suspect(request, tries.sent_at)
            raise
        except asyncio.TimeoutError:
            if not tries.opened:  # no connection within the connect timeout: every one to the engine is busy
                held.release()  # never sent: the client may send it again
                return self._refuse(request, label, 503, "upstream_busy", f"every connection to upstream "
                                    f"{self.shown} is busy ({self.session.connector.limit} at once): retry later")
            self.ends.suspect(request, tries.sent_at)
            return self._refuse(request, label, 504, "upstream_timeout",
                                f"upstream {self.shown} sent nothing for {self.read_timeout_s:g} s")
        except aiohttp.ClientConnectionError as exc:
            # Refused at connect: the engine never saw it. Any other failure came with the connection open: the
            # engine may have read the request, and if it then ended, the request may be what ended it.
            connected = tries.opened or not isinstance(exc, aiohttp.ClientConnectorError)
            asked = connected or tries.seen  # a refused connect of a request never seen is held, however the engine is
            down = asked and await self.hold.health.ended(since=self.hold.clock())
            verdict = after_failure(connected=connected, seen=tries.seen, reused=tries.reused, resent=tries.resent,
                                    engine_down=down, hold_on=self.hold.on)
            tries.seen = asked
            if verdict in (HOLD, RESEND) and held.reclaim():
                return None if verdict == HOLD else RESEND
            held.release()  # never sent again
            if verdict == ENDED:
                self.ends.cut(request, tries.sent_at)
                return self._refuse(request, label, 502, "engine_ended", ENDED_MESSAGE)
            if not connected:
                return self._refuse(request, label, 502, "upstream_down",
                                    f"upstream {self.shown} unreachable: {exc}")
            self.ends.suspect(request, tries.sent_at)  # BROKE: the engine may end a moment later (a query of death)
            return self._refuse(request, label, 502, "upstream_error", f"upstream {self.shown}: {exc}")
        except aiohttp.ClientError as exc:
            self.ends.suspect(request, tries.sent_at)
            return self._refuse(request, label, 502, "upstream_error", f"upstream {self.shown}: {exc}")
        return None

    async def _read(self, request: web.Request, held: Held) -> bytearray:
        """The whole body, within --max-body-bytes and the budget; then the request is whole (listener.py)."""
        if request.content_length is not None and request.content_length > self.max_body_bytes:
            raise Refusal(413, "too_large", f"request body over {self.max_body_bytes} bytes (the proxy's "
                          "--max-body-bytes)")  # refused before a byte of it is read
        progress = (lambda n: self.conns.body_read(request, n)) if self.conns is not None else None
        body = await read(request, self.max_body_bytes, held, progress)
        if self.conns is not None:
            self.conns.serving(request)
        return body

    def _refuse(self, request: web.Request, label: str, status: int, reason: str, message: str,
                retry_after: int = 1) -> web.Response:
        self.metrics.failures.labels(reason).inc()
        self.metrics.requests.labels(label, str(status)).inc()
        self.faults.note(f"{reason} refusals ({status})", f"{request.method} {request.path} from {request.remote}: "
                         f"{status} {message}")
        response = error_response(label, status, message, retry_after)
        if not request.content.is_eof():
            response.force_close()  # the rest of the body is not read: the connection cannot carry another request
        return response
