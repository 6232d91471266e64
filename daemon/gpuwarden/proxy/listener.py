"""The proxy's listening socket and its connections: how many may be open, how long each phase of a request may
take, and the stop on SIGTERM.

aiohttp alone keeps a connection for as long as its client likes: any number of them, no deadline on a
request's headers or body, minutes of keep-alive. Under the unit's 1024-fd limit, 1,100 half-sent bodies left no
descriptor for /health, the engine or accept(). Here:
- at most `cap` client connections are open, half of what RLIMIT_NOFILE leaves after a reserve, since each may
  hold an upstream connection too (the client session is capped at the same number);
- a connection waits, sends its headers and sends its body within deadlines (`timeout_s`; for the body, every
  `timeout_s` must bring MIN_BODY_RATE x `timeout_s` bytes or its end), else it is closed;
- a request's head is at most MAX_HEAD_BYTES, blank lines before it included; what arrives while a request is
  served (pipelined requests) is read up to MAX_HEAD_BYTES, then reading waits until the response is done;
- a response the client does not read (the socket's buffer full, so a write cannot drain) for `timeout_s`
  closes the connection, and with it the upstream request;
- at the cap, a new connection closes one that waits on its client (a keep-alive, headers or a body still
  coming), as base/conncap.to_close chooses for the metrics server too: from the place that holds the most, a
  served keep-alive first, else the one waiting longest: a crowd that holds connections open only pushes out its
  own, while a request that arrives whole is served. When every open connection is being served, the new one gets
  a fixed 503 and is closed, without reading.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import resource
import signal
import time
from collections.abc import Callable

from aiohttp import web

from ..base.conncap import to_close
from ..base.faultlog import FaultLog
from ..base.peers import source_of
from ..base.keptlistener import CAP_REFUSED

BACKLOG = 64  # also how many connections asyncio accepts in one pass of the loop
# Descriptors kept for everything that is not a client or upstream connection: stdio, the listener, epoll, dump
# files, logging (64), and sockets in flight: accepted but not yet handed to us (two passes' worth), and closed
# at the cap but not yet released (the close lands on the next pass).
RESERVE_FDS = 64 + 3 * BACKLOG
MAX_CONNECTIONS = 4096  # each costs memory too: the cap does not grow with a huge fd limit
MIN_BODY_RATE = 16 << 10  # bytes a second a body must bring, over each timeout_s
# A request's headers, all together: aiohttp alone allows 128 lines of 8 KiB (32,768 in 3.8), and 380 connections
# sending 100 such lines held 500 MB. Clients send a few KiB.
MAX_HEAD_BYTES = 64 << 10
WAITING, HEADERS, BODY, SERVING = "waiting", "headers", "body", "serving"
REFUSED = CAP_REFUSED  # the daemon's liveness probe takes this 503 as alive (serving/run/health.py)
REFUSAL = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: text/plain\r\nRetry-After: 1\r\nConnection: close\r\n"
           b"Content-Length: %d\r\n\r\n%s" % (len(REFUSED), REFUSED))


def connection_cap(nofile: int | None = None) -> int:
    """Client connections the fd limit allows: each may hold one upstream connection beside it."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0] if nofile is None else nofile
    if soft == resource.RLIM_INFINITY:
        soft = 2 * MAX_CONNECTIONS + RESERVE_FDS
    return max(8, min(MAX_CONNECTIONS, (soft - RESERVE_FDS) // 2))


class Connection(asyncio.Protocol):
    """One client connection: aiohttp's handler behind it, and the phase its current request is in. Passes every
    transport event on to the handler; it only watches."""

    def __init__(self, conns: Connections, handler: asyncio.Protocol):
        self.conns, self.handler = conns, handler
        self.transport: asyncio.Transport | None = None
        self.phase, self.since, self.received, self.served = WAITING, conns.clock(), 0, 0
        # The body's current window: since when, and its bytes so far. Each window of timeout_s must bring
        # MIN_BODY_RATE x timeout_s bytes (or the body's end); once it has, the next begins.
        self.window, self.window_bytes = self.since, 0
        self.closing = False
        self.source = ""  # whom it counts for at the cap (base/conncap.py), once connected
        self.tail = b""  # the last bytes of the headers so far, to find their end across reads
        self.begun = False  # a byte of the head other than the blank lines before it (aiohttp skips those)
        self.paused = False  # reading paused by us: a pipelined request past MAX_HEAD_BYTES while serving

    def connection_made(self, transport) -> None:
        self.transport = transport
        peer = transport.get_extra_info("peername")
        self.source = source_of(peer[0]) if isinstance(peer, tuple) and peer else "unknown"
        self.handler.connection_made(transport)
        if self.closing:  # closed at the cap before asyncio handed it over
            transport.abort()

    def data_received(self, data: bytes) -> None:
        if self.phase in (WAITING, HEADERS) and not self._headers(data):
            return
        if self.phase in (BODY, SERVING):
            self.received += len(data)
        if self.phase == SERVING and self.received > MAX_HEAD_BYTES and not self.paused:
            # What a client sends while its request is served is the next request (pipelined): aiohttp would
            # parse and queue up to 32 of them, heads and all. Past one head's worth, the rest waits in the
            # kernel until the response is done (reading goes on after it: the client can still be seen leave).
            self.paused = True
            self.transport.pause_reading()
        self.handler.data_received(data)

    def body_read(self, n: int) -> None:
        """n bytes of the body itself came (the handler's read, decoded): what the window counts. Bytes on the
        wire are not the body: a chunked body's framing (a chunk-size line of endless zeros, an extension) met
        every window's quota with no byte of body (attacker 10's F1)."""
        self.window_bytes += n
        if self.window_bytes >= MIN_BODY_RATE * self.conns.timeout_s:
            self.window, self.window_bytes = self.conns.clock(), 0

    def resume(self) -> None:
        if self.paused:
            self.paused = False
            if self.transport is not None and not self.closing:
                self.transport.resume_reading()

    def _headers(self, data: bytes) -> bool:
        """Count the bytes of a request's headers until their end; False (and closed) past MAX_HEAD_BYTES."""
        if self.phase == WAITING:
            self.conns.enter(self, HEADERS)
        self.received += len(data)  # the blank lines before a head count too
        seen = self.tail + data
        if not self.begun:
            seen = seen.lstrip(b"\r\n")  # as aiohttp does: blank lines before the request line are skipped
            self.begun = bool(seen)
        if self.begun and b"\r\n\r\n" in seen:  # the body's clock starts (and again when the handler runs)
            self.conns.enter(self, BODY)
            return True
        self.tail = seen[-3:]
        if self.received <= MAX_HEAD_BYTES:
            return True
        self.conns.fault(self, "big_headers", f"its request's headers passed {MAX_HEAD_BYTES >> 10} KiB")
        return False

    def eof_received(self):
        return self.handler.eof_received()

    def connection_lost(self, exc) -> None:
        """The client left: its request ends with it. aiohttp's task serving this connection is cancelled, so the
        request's connection to the engine closes and the engine stops working for nobody (aiohttp 3.8 never
        cancels it, 3.9 and later only where told). Without it, requests sent whole by clients that closed at once
        would hold connections to the engine past the connection cap, which counts client connections only (390
        connections to the engine for 1 client connection: the pool full, new requests waited 10 s for a 504)."""
        self.conns.closed(self)
        task = getattr(self.handler, "_task_handler", None)  # aiohttp's own attribute, in 3.8 as in 3.14
        self.handler.connection_lost(exc)
        if isinstance(task, asyncio.Task) and not task.done():
            task.cancel()

    def pause_writing(self) -> None:
        self.conns.stalled[self] = self.conns.clock()  # the client is not reading what it is sent
        self.handler.pause_writing()

    def resume_writing(self) -> None:
        self.conns.stalled.pop(self, None)
        self.handler.resume_writing()

    def deadline(self, timeout_s: float) -> float | None:
        if self.phase == BODY:  # a rate in every window, not on average since the start: bytes sent before earn
            # no pause (a burst, then a byte every 10 s, held the body budget for half an hour, twice over)
            return self.window + timeout_s
        return None if self.phase == SERVING else self.since + timeout_s


class Refused(asyncio.Protocol):
    """A connection past the cap: a fixed 503, closed at once, nothing read."""

    def connection_made(self, transport) -> None:
        transport.write(REFUSAL)
        transport.close()


class Connections:
    def __init__(self, cap: int, timeout_s: float, faults: FaultLog, count=None, clock=time.monotonic):
        self.cap, self.timeout_s, self.faults, self.clock = cap, timeout_s, faults, clock
        self.count = count or (lambda reason: None)  # a connection closed by us, in the proxy's failure metrics
        self.open: dict[asyncio.Protocol, Connection] = {}  # by aiohttp handler, for request.protocol
        # Connections not being served, the longest waiting first: the ones the cap and the deadlines close.
        self.idle: collections.OrderedDict[Connection, None] = collections.OrderedDict()
        # Connections whose writes wait for the client to read (the transport's buffer is full), and since when:
        # closed when a write cannot drain within timeout_s, whatever the phase.
        self.stalled: dict[Connection, float] = {}
        self._ticker: asyncio.TimerHandle | None = None

    # -- accepting ---------------------------------------------------------------------------------------
    def protocol(self, server: web.Server) -> asyncio.Protocol:
        """The listener's protocol factory: a watched aiohttp handler, or a refusal past the cap."""
        if len(self.open) >= self.cap:
            if not self.idle:
                self.faults.note("connections refused at the cap", f"{self.cap} connections open, all being served: "
                                 "a new one refused with 503 (the cap is half the fd limit left after a reserve)")
                self.count("too_many_connections")
                return Refused()
            closed = to_close((conn.source for conn in self.open.values()), list(self.idle), lambda c: c.source,
                              lambda c: c.phase == WAITING and c.served > 0)
            self.faults.note("connections closed at the cap", f"{self.cap} connections open: closed one that waited "
                             f"on its client, from the place with the most ({closed.phase}, "
                             f"{self.clock() - closed.since:.1f} s)", logging.INFO)
            self.count("evicted")
            self._close(closed)
        # Counted from here, not from connection_made: asyncio calls that a loop pass later, and a burst of
        # accepts in between must see every connection made so far.
        conn = Connection(self, server())
        self.open[conn.handler] = conn
        self.idle[conn] = None
        return conn

    def closed(self, conn: Connection) -> None:
        self.open.pop(conn.handler, None)
        self.idle.pop(conn, None)
        self.stalled.pop(conn, None)

    def _close(self, conn: Connection) -> None:
        # Out of the books now, not when the loop gets to connection_lost: a burst of accepts in one loop pass
        # must not count (or pick) the same connection twice. abort(): nothing waits for a client that does not
        # read.
        self.closed(conn)
        conn.closing = True
        if conn.transport is not None:
            conn.transport.abort()

    # -- the phases of a request -------------------------------------------------------------------------
    def enter(self, conn: Connection, phase: str) -> None:
        conn.phase, conn.since, conn.received, conn.tail, conn.begun = phase, self.clock(), 0, b"", False
        conn.window, conn.window_bytes = conn.since, 0
        if phase != SERVING:
            conn.resume()
        self.idle.pop(conn, None)
        if phase != SERVING and conn.handler in self.open:
            self.idle[conn] = None  # at the end: the order stays "longest waiting first"

    def of(self, request: web.BaseRequest) -> Connection | None:
        return self.open.get(request.protocol)

    def body_read(self, request: web.BaseRequest, n: int) -> None:
        """n bytes of request's body read by its handler (Connection.body_read)."""
        conn = self.of(request)
        if conn is not None:
            conn.body_read(n)

    def serving(self, request: web.BaseRequest) -> None:
        """The request is whole (headers and body): no deadline of ours from here on, and never closed at the
        cap; the engine's own timeout applies."""
        conn = self.of(request)
        if conn is not None:
            self.enter(conn, SERVING)

    @web.middleware
    async def middleware(self, request: web.Request, handler):
        conn = self.of(request)
        if conn is None:
            return await handler(request)
        self.enter(conn, BODY)  # aiohttp calls the handler once the headers are in
        try:
            return await handler(request)
        finally:
            conn.served += 1
            self.enter(conn, WAITING)

    # -- the deadlines, every second -----------------------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._ticker = loop.call_later(1.0, self._tick, loop)

    def stop(self) -> None:
        if self._ticker is not None:
            self._ticker.cancel()

    def _tick(self, loop: asyncio.AbstractEventLoop) -> None:
        self.sweep()
        self.faults.flush()
        self._ticker = loop.call_later(1.0, self._tick, loop)

    def sweep(self) -> None:
        now, t = self.clock(), self.timeout_s
        for conn, since in list(self.stalled.items()):
            if now - since >= t:
                self.fault(conn, "stalled_reader", f"it read nothing of its response in {t:g} s")
        for conn in list(self.idle):
            deadline = conn.deadline(t)
            if deadline is None or now < deadline:
                continue
            if conn.phase == WAITING and conn.served:
                self._close(conn)  # a keep-alive that idled out: no fault
            elif conn.phase == HEADERS:
                self.fault(conn, "slow_headers", f"its request's headers took over {t:g} s")
            elif conn.phase == BODY:
                self.fault(conn, "slow_body", f"its body came slower than {MIN_BODY_RATE >> 10} KiB/s over {t:g} s "
                                              f"({conn.window_bytes} bytes in the last {now - conn.window:.0f} s, "
                                              f"{conn.received} in {now - conn.since:.0f} s)")
            else:
                self.fault(conn, "idle", f"it sent nothing in {t:g} s")

    def fault(self, conn: Connection, reason: str, what: str) -> None:
        """Close a connection for what its client did: counted, and said once a minute."""
        peer = conn.transport.get_extra_info("peername") if conn.transport else None
        self._close(conn)
        self.count(reason)
        self.faults.note(f"connections closed ({reason})", f"closed a connection from {peer}: {what}", logging.INFO)


async def run(app: web.Application, host: str, port: int, conns: Connections, shutdown_s: float = 2.0,
              signals: dict[int, Callable[[], None]] | None = None, sock=None) -> None:
    """Serve app on host:port (or on sock, a listening socket passed in: the daemon's) until SIGTERM or SIGINT;
    then streams still open after shutdown_s are cut. signals: other signals' handlers, in place before the first
    connection. OSError when the address cannot be bound."""
    # auto_decompress off: a compressed body reaches the proxy as sent (server.py decides, with a size cap).
    # aiohttp's own keep-alive timer only backs ours up (ours closes first, and counts why).
    runner = web.AppRunner(app, access_log=None, keepalive_timeout=conns.timeout_s + 5, auto_decompress=False)
    await runner.setup()
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    for sig, handler in (signals or {}).items():
        loop.add_signal_handler(sig, handler)
    server = runner.server
    try:
        where = {"sock": sock} if sock is not None else {"host": host, "port": port}
        listener = await loop.create_server(lambda: conns.protocol(server), backlog=BACKLOG, **where)
    except OSError:
        await runner.cleanup()
        raise
    conns.start(loop)
    try:
        await stop.wait()
    finally:
        listener.close()
        conns.stop()
        await runner.shutdown()
        await server.shutdown(shutdown_s)
        await runner.cleanup()
