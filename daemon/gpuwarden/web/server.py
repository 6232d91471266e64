"""The one HTTP server of /metrics and /status: an event loop with a connection cap, deadlines on the request head
and the reply, TLS and basic auth from the web config, client faults logged as counts; it serves bytes that
web/exposition.py and the snapshot already made."""

from __future__ import annotations


import asyncio
import contextlib
import json
import logging
import socket
import ssl
import threading
from collections import Counter, deque
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from http import HTTPStatus

from prometheus_client import CONTENT_TYPE_LATEST

from ..base import httphead
from ..base.conncap import to_close
from ..base.faultlog import FaultLog
from ..base.peers import source_of
from ..base.webconfig import REALM, WebConfig
from .exposition import Exposition

log = logging.getLogger("gpuwarden")


MAX_CONNECTIONS = 64  # open at once (fds stay well under 1024); past it, one waiting on its client goes
REQUEST_DEADLINE_S = 10.0  # from accept to the end of the request head, TLS handshake included (Prometheus: 10 s)
RESPONSE_DEADLINE_S = 10.0  # to hand over the whole reply and close
MAX_REQUEST_HEAD = 16 * 1024  # request line and headers, read at once; a scrape sends about 200 bytes
AUTH_WAITING = 16  # password checks running (one at a time: at most a core) or waiting, from every source
AUTH_PER_SOURCE = 2  # of those, from one source (an address; an IPv6 /64); past it, that source gets 503
FAILED_SOURCES = 1024  # sources whose last password check failed, kept to serve them after the others
LISTEN_BACKLOG = 128
ACCEPT_BATCH = 16  # connections taken per wake-up: a burst holds at most this many fds over the cap at once
FAULT_LOG_INTERVAL_S = 60.0
# Client faults: the first after a quiet minute at once, those after it as one line when the minute ends.
CLIENT_FAULTS = "metrics endpoint: client faults: {counts} (the last from {last})"


@dataclass
class _Connection:
    peer: str
    # "request": its client is to send the request; "answer": the server's turn; "reply": its client is to
    # take the reply and hang up. All but "answer" wait on the client, and may go to make room.
    phase: str = "request"


def take_listener(fd: int, listen: tuple[str, int] | None) -> socket.socket | None:
    """The metrics socket the daemon before this one passed on as fd (inherited across a re-exec, or from
    systemd's fd store), when it listens on listen: close-on-exec again, so nothing started from here
    inherits it. One bound elsewhere (metrics.listen changed, or is none now) is closed; an fd that is no TCP
    listener at all is not ours to close. None: bind anew."""
    try:
        sock = socket.socket(fileno=fd)
    except OSError as exc:
        log.warning("metrics: fd %d passed on is no socket (%s): binding anew", fd, exc.strerror or exc)
        return None
    if (sock.family not in (socket.AF_INET, socket.AF_INET6) or sock.type != socket.SOCK_STREAM
            or not sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)):
        sock.detach()
        log.warning("metrics: fd %d passed on is no listening TCP socket: left alone, binding anew", fd)
        return None
    if listen is not None and sock.getsockname()[:2] in _addresses(listen, sock.family):
        sock.set_inheritable(False)
        return sock
    log.info("metrics: the socket passed on listens on %s port %d, not on metrics.listen now: closed",
             *sock.getsockname()[:2])
    sock.close()
    return None


def _addresses(listen: tuple[str, int], family: int) -> set[tuple[str, int]]:
    """(address, port) as getsockname() gives them for a socket of family bound to listen (a name resolved)."""
    host, port = listen
    try:
        return {info[4][:2] for info in socket.getaddrinfo(host, port, family, socket.SOCK_STREAM, 0,
                                                           socket.AI_PASSIVE)}
    except (socket.gaierror, UnicodeError):
        return set()


class AuthLine:
    """Password checks, one at a time (at most a core), in turns by source (source_of), so that a crowd
    guessing passwords from one place cannot keep out a scraper whose password is not remembered yet:
    Prometheus started during the attack, or a scraper checked anew after a change of web.yml.

    One line for everyone is full whenever a crowd is: a scraper not yet remembered would get 503 on every try.
    So:
    - a source has at most AUTH_PER_SOURCE checks running or waiting; past it, *that source* gets 503 at once;
    - the sources take turns (round-robin), a check each;
    - a source whose last check failed waits behind every source that has not failed (new ones, and those
      that passed since): a scraper with the right password from its own address waits for the check under
      way and its own, however large the crowd. A pass clears the mark; FAILED_SOURCES marks are kept, the
      oldest forgotten first;
    - AUTH_WAITING checks in all, so waiting checks (whose connections are never dropped to make room) leave
      most of MAX_CONNECTIONS free, and so the sources in the line are bounded too. In a full line, a source
      that has not failed takes the place of the last waiting check of the failed source that holds most
      (which gets 503); a failed source gets 503.
    What no choice by address can beat: a crowd from the scraper's own address (it shares that source's
    places and turns; a remembered scraper skips the line), and one with many addresses that are not one
    source (127.0.0.0/8 beside 127.0.0.1 is one, see source_of, and an IPv6 /64 is one; a crowd with many
    remote IPv4 addresses is not), each address a source that has not failed until its first check. Then
    the bounds still hold (one core, AUTH_WAITING connections, a
    wait of at most AUTH_WAITING checks once in: 5 s at cost 12), and each address costs the crowd a check
    run before it is marked; a new scraper competes with the crowd's fresh addresses for a free place.
    """

    def __init__(self):
        self.waiting: dict[str, deque[asyncio.Future]] = {}  # by source, in turn order
        self.held: Counter[str] = Counter()  # checks running or waiting, by source
        self.failed: dict[str, None] = {}  # sources whose last check failed, oldest first
        self.running = False

    async def check(self, source: str, run: Callable[[], Awaitable[bool]]) -> bool | None:
        """run()'s verdict, run in source's turn; None when the line has no place for it (503)."""
        turn = self._enter(source)
        if turn is None:
            return None
        verdict = None
        try:
            if not await turn:  # a newcomer that never failed took its place
                return None
            verdict = await run()
            return verdict
        finally:
            if turn.cancelled():  # its connection went while it waited
                self._leave(source, turn)
            elif turn.result():
                self._done(source, verdict)

    def _enter(self, source: str) -> asyncio.Future | None:
        if self.held[source] >= AUTH_PER_SOURCE:
            return None
        if self.held.total() >= AUTH_WAITING and not self._make_room(source):
            return None
        turn = asyncio.get_running_loop().create_future()
        self.waiting.setdefault(source, deque()).append(turn)
        self.held[source] += 1
        self._next()
        return turn

    def _make_room(self, newcomer: str) -> bool:
        if newcomer in self.failed:
            return False
        failed = [source for source in self.waiting if source in self.failed]
        if not failed:
            return False
        source = max(failed, key=lambda s: len(self.waiting[s]))
        self._leave(source, self.waiting[source][-1])
        return True

    def _leave(self, source: str, turn: asyncio.Future) -> None:
        """A waiting check leaves the line (its connection went, or a newcomer took its place)."""
        queue = self.waiting.get(source)
        if queue is not None and turn in queue:
            queue.remove(turn)
            if not queue:
                del self.waiting[source]
        if not turn.done():
            turn.set_result(False)
        self._release(source)

    def _done(self, source: str, verdict: bool | None) -> None:
        """The running check ended: passed, failed, or (None) its connection went."""
        self.running = False
        if verdict is not None:
            self.failed.pop(source, None)
        if verdict is False:
            self.failed[source] = None
            if len(self.failed) > FAILED_SOURCES:
                del self.failed[next(iter(self.failed))]
        self._release(source)
        self._next()

    def _release(self, source: str) -> None:
        self.held[source] -= 1
        if self.held[source] <= 0:
            del self.held[source]

    def _next(self) -> None:
        """Give the next check its turn, unless one runs."""
        if self.running:
            return
        while self.waiting:
            source = next((s for s in self.waiting if s not in self.failed), next(iter(self.waiting)))
            queue = self.waiting.pop(source)
            turn = queue.popleft()
            if queue:
                self.waiting[source] = queue  # to the end of the turns
            if not turn.done():  # (done: cancelled, its connection gone; check() gives its place back)
                self.running = True
                turn.set_result(True)
                return


def family_of(host: str) -> socket.AddressFamily:
    """The address family metrics.listen's host is bound in: IPv6 for an address with a colon, else IPv4 (a name is
    resolved to its IPv4 addresses only). The one rule for the bind here and for a handover's check of it
    (service/metrics_port.bind_refusal): a name with only IPv6 addresses passed the check and ended the new image."""
    return socket.AF_INET6 if ":" in host else socket.AF_INET


class MetricsServer:
    """`/metrics` for Prometheus and `/status` for `gpuwarden status`, from an event loop on its own thread.

    A slow client costs a coroutine, not a thread, and has REQUEST_DEADLINE_S for the TLS handshake and the
    whole request head together, however it spaces its bytes. When MAX_CONNECTIONS are open, a new one
    pushes out the oldest connection that waits on its client, from the address that holds the most, so a
    crowd cannot hold every slot; only when the server is busy with all of them is the new one refused
    (the short line of password checks keeps that from happening). Password checks (bcrypt) run one at a
    time on a worker thread, taken in turns by source (AuthLine); a request the line has no place for gets
    503 at once; a scraper whose password passed once is remembered and skips the line.
    """

    def __init__(self, listen: tuple[str, int], exposition: Exposition, status: Callable[[], dict],
                 web: WebConfig | None = None, listener: socket.socket | None = None):
        """listener: the listening socket the daemon before this one passed on (take_listener), else listen is
        bound here: a port in use is an OSError at start-up, before anything is tuned."""
        host, port = listen
        self.tls = web.ssl_context() if web is not None and web.tls else None
        self.listener = listener or socket.create_server((host, port), backlog=LISTEN_BACKLOG, family=family_of(host))
        self.listener.setblocking(False)
        self._keep_listener = False  # stop(keep_listener=True): a handover, the socket goes on to the new image
        self.exposition = exposition
        self.status = status
        self.web = web
        self.faults = FaultLog(log, CLIENT_FAULTS, CLIENT_FAULTS, FAULT_LOG_INTERVAL_S, level=logging.INFO,
                               by_kind=False)
        self.connections: dict[asyncio.Task, _Connection] = {}  # oldest first
        self.line = AuthLine()  # password checks waiting for their turn
        self.checks = ThreadPoolExecutor(1, thread_name_prefix="metrics-auth")
        self.loop = asyncio.new_event_loop()
        self._main: asyncio.Task | None = None
        self._thread = threading.Thread(target=self._run, name="metrics", daemon=True)

    def start(self) -> None:
        self._main = self.loop.create_task(self._serve())  # the loop runs it once the thread starts
        self._thread.start()

    def stop(self, keep_listener: bool = False) -> int | None:
        """Stop serving and close the listener; with keep_listener (a handover) leave it open, still
        listening (connections wait in its queue for the new image), and return its fd."""
        self._keep_listener = keep_listener
        if self._thread.is_alive():
            self.loop.call_soon_threadsafe(self._main.cancel)
            self._thread.join(5)
        else:
            self._close_listener()
            self.loop.close()
        self.checks.shutdown(wait=False, cancel_futures=True)
        self.exposition.close()
        return self.listener.detach() if keep_listener else None

    def _close_listener(self) -> None:
        if not self._keep_listener:
            self.listener.close()

    def _run(self) -> None:
        try:
            self.loop.run_until_complete(self._main)
        finally:
            self.loop.close()

    async def _serve(self) -> None:
        self.loop.set_exception_handler(self._loop_error)
        self.loop.add_reader(self.listener.fileno(), self._accept)
        try:
            while True:  # until stop() cancels
                await asyncio.sleep(1.0)
                self.faults.flush()
        except asyncio.CancelledError:
            pass
        finally:
            self.loop.remove_reader(self.listener.fileno())
            others = asyncio.all_tasks() - {asyncio.current_task()}  # the connections, dropped ones too
            for task in others:
                task.cancel()
            await asyncio.gather(*others, return_exceptions=True)
            self._close_listener()

    def _accept(self) -> None:
        """Take the connections in the listen queue, a batch on each turn of the loop (one a turn let the
        queue fill: then new connections, a good scraper's among them, sit out TCP's retransmission timers)."""
        for _ in range(ACCEPT_BATCH):
            try:
                sock, address = self.listener.accept()
            except BlockingIOError:
                return
            except OSError as exc:  # out of fds: stop taking connections for a moment instead of spinning
                self.faults.note(f"not accepted ({exc.strerror})", "-")
                self.loop.remove_reader(self.listener.fileno())
                self.loop.call_later(0.1, self.loop.add_reader, self.listener.fileno(), self._accept)
                return
            sock.setblocking(False)
            self._admit(sock, address[0])

    def _admit(self, sock: socket.socket, peer: str) -> None:
        if len(self.connections) >= MAX_CONNECTIONS and not self._drop_one_waiting():
            self.faults.note("refused: every connection busy", peer)
            sock.close()
            return
        connection = _Connection(peer)
        task = self.loop.create_task(self._connection(sock, connection))
        task.add_done_callback(lambda _: sock.close())  # also when it was dropped before it ever ran
        self.connections[task] = connection

    def _drop_one_waiting(self) -> bool:
        """Drop a connection that waits on its client, as base/conncap.to_close chooses (the proxy's rule too)."""
        waiting = [(task, c) for task, c in self.connections.items() if c.phase != "answer"]
        found = to_close((source_of(c.peer) for c in self.connections.values()), waiting,
                         lambda item: source_of(item[1].peer), lambda item: item[1].phase == "reply")
        if found is None:
            return False
        task, connection = found
        del self.connections[task]
        task.cancel()
        self.faults.note("dropped to make room", connection.peer)
        return True

    async def _connection(self, sock: socket.socket, connection: _Connection) -> None:
        transport = None
        head_read = False
        try:
            reader = asyncio.StreamReader(limit=MAX_REQUEST_HEAD)
            protocol = asyncio.StreamReaderProtocol(reader)
            # asyncio sets this only where the socket's proto is IPPROTO_TCP, and create_server's is 0: without
            # it, Nagle holds a TLS reply's last record for the client's delayed ACK (40 ms a scrape).
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            try:
                async with asyncio.timeout(REQUEST_DEADLINE_S):
                    transport, _ = await self.loop.connect_accepted_socket(lambda: protocol, sock, ssl=self.tls)
                    head = await reader.readuntil(httphead.END)
            except asyncio.LimitOverrunError:
                head = None
            head_read, connection.phase = True, "answer"
            reply = await self._answer(head, connection.peer)
            connection.phase = "reply"
            async with asyncio.timeout(RESPONSE_DEADLINE_S):
                writer = asyncio.StreamWriter(transport, protocol, reader, self.loop)
                writer.write(reply)
                await writer.drain()
                writer.close()
                with contextlib.suppress(OSError):  # the reply is out: a client may hang up as it likes (TLS: reset)
                    await writer.wait_closed()
        except Exception as exc:  # the ways a client fails: counted by kind, never a traceback each
            self.faults.note(_fault(exc, head_read), connection.peer)
        finally:
            self.connections.pop(asyncio.current_task(), None)
            if transport is not None:
                transport.abort()  # nothing left to send by now, or too late to send it

    async def _answer(self, head: bytes | None, peer: str) -> bytes:
        if head is None:
            self.faults.note(f"request head over {MAX_REQUEST_HEAD // 1024} KiB", peer)
            return _reply(431, b"request header fields too large\n")
        try:
            method, target, headers = httphead.request(head, MAX_REQUEST_HEAD)
        except httphead.BadHead:
            self.faults.note("not an HTTP/1 request", peer)
            return _reply(400, b"bad request\n")
        if method != "GET":
            return _reply(405, b"only GET\n", extra=("Allow: GET",))
        refusal = await self._refusal(headers.get("authorization"), peer)
        if refusal is not None:
            return refusal
        path = target.split("?", 1)[0]
        if path == "/metrics":
            return _reply(200, self.exposition.body(), CONTENT_TYPE_LATEST)
        if path == "/status":
            return _reply(200, json.dumps(self.status(), allow_nan=False).encode(), "application/json")
        if path == "/":
            return _reply(200, b"gpuwarden: /metrics for Prometheus, /status for `gpuwarden status`\n")
        return _reply(404, b"not found\n")

    async def _refusal(self, header: str | None, peer: str) -> bytes | None:
        """None when basic auth lets the request through, else the reply: 401, or 503 when the line of
        password checks has no place for it (AuthLine: a crowd of wrong passwords then costs one core at
        most, a remembered scraper skips the line, and one never checked yet goes before the crowd)."""
        if self.web is None:
            return None
        verdict = self.web.remembered(header)
        if verdict is None:
            verdict = await self.line.check(source_of(peer), lambda: self.loop.run_in_executor(
                self.checks, self.web.authorized, header))
            if verdict is None:
                self.faults.note("refused: password checks queued", peer)
                return _reply(503, b"too many password checks at once\n", extra=("Retry-After: 1",))
        if verdict:
            return None
        self.faults.note("unauthorized", peer)
        return _reply(401, b"unauthorized\n", extra=(f'WWW-Authenticate: Basic realm="{REALM}"',))

    def _loop_error(self, loop: asyncio.AbstractEventLoop, context: dict) -> None:
        """What asyncio would log with a traceback (a transport's fatal error, mostly): counted instead."""
        exc = context.get("exception")
        self.faults.note(f"{context.get('message', 'error')}: {type(exc).__name__}"[:120], "-")


def _fault(exc: Exception, head_read: bool) -> str:
    if isinstance(exc, TimeoutError):
        return (f"reply not taken within {RESPONSE_DEADLINE_S:g} s" if head_read
                else f"no whole request within {REQUEST_DEADLINE_S:g} s")
    if isinstance(exc, ssl.SSLError):
        return "TLS error"
    if isinstance(exc, (OSError, EOFError)):  # reset, or closed before the request ended
        return "hung up"
    return f"server error: {type(exc).__name__}: {exc}"[:120]


def _reply(code: int, body: bytes, content_type: str = "text/plain; charset=utf-8", extra: tuple[str, ...] = ()
           ) -> bytes:
    head = [f"HTTP/1.1 {code} {HTTPStatus(code).phrase}", f"Content-Type: {content_type}",
            f"Content-Length: {len(body)}", "Connection: close", *extra]
    return ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body
