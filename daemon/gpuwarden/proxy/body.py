"""Request bodies in the proxy's memory: read within a size cap, decoded, parsed, all within one budget.

The budget is what every body being read or parsed may cost at once, in bytes; a request whose bytes or parse
do not fit now is answered 503 with Retry-After, and one that would not fit even in an empty budget is refused
(413). What a request took is given back when its body has gone upstream; while the proxy holds requests for an
engine that is down (hold.py), a body sent upstream is only lent: kept for a retry until the engine answers (a
draining engine answers 503), but given up, and its place with it, as soon as a new body needs the room.

A parse costs far more than its body: CPython's json makes a 64-byte dict of each `{}`, so 31 MB of
`[{},{},...]` took 846 MB. `parse_cost` bounds it from the body's own bytes before a byte is parsed.
"""

from __future__ import annotations

import json
import math
import re
import threading
import zlib
from collections import OrderedDict
from collections.abc import Callable

from aiohttp import web

# What parsing costs, at most, per byte of body and per JSON token (CPython 3.11, measured with tracemalloc on
# 4 MB bodies of each shape; tests/test_proxy_limits.py checks the bound). Text: the decoded document, its string
# values and the re-encoded text, each 1, 2 or 4 bytes a character (the widest character in it decides), plus the
# re-encoded bytes: 1 + 3 * width. A container: a dict or list object, 56-64 bytes plus a slot (`[[[[]]]],` measured 38
# bytes a byte). A comma or a quote: an element's slot, a number or a string object (`"ab",` measured 14).
PER_CONTAINER, PER_ELEMENT = 80, 48
DUMP_PER_BYTE = 2  # a dump part's text and its UTF-8 bytes, for the largest string, while the request is held
FOUR_BYTE_LEADS = (b"\xf0", b"\xf1", b"\xf2", b"\xf3", b"\xf4")  # UTF-8 of a character past U+FFFF
WIDE_ESCAPE = re.compile(rb"\\u[dD][89abAB]")  # an escaped surrogate pair: the same, in ASCII text


class Refusal(Exception):
    """A request the proxy answers itself: status, a metrics reason and a one-line message; a 503's Retry-After."""

    def __init__(self, status: int, reason: str, message: str, retry_after: int = 1):
        super().__init__(message)
        self.status, self.reason, self.retry_after = status, reason, retry_after


class Budget:
    """Bytes of request bodies and their parses that may be in memory at once (thread-safe: parses run on the
    executor). `used` is what requests hold; `lent` what bodies already sent keep for a retry, given up first.
    One client (casualties.client_of: an address, an IPv6 /64, this host's own addresses as one) uses at most
    `share` of it, so that others always find room: twelve bodies sent to their last byte and then held open by one
    client took all of it, and every other client's body got 503 for as long as they stayed (listener.py closes a
    stalled body now, too)."""

    def __init__(self, limit: int, share: int | None = None):
        self.limit, self.used, self.lent = limit, 0, 0
        self.share = min(limit, share) if share is not None else limit
        self.lock = threading.Lock()
        self.lenders: OrderedDict[Held, None] = OrderedDict()  # the oldest lent first
        self.by_client: dict[str, int] = {}  # what each client's requests use now (not lent)

    def hold(self, client: str = "") -> Held:
        return Held(self, client)

    def take(self, held: Held, n: int) -> str | None:
        """None: taken; else why not ("all": the budget is full; "client": held's client has its share)."""
        with self.lock:
            mine = self.by_client.get(held.client, 0)
            if held.client and mine + n > self.share:
                return "client"
            while self.used + self.lent + n > self.limit and self.lenders:
                self.drop(next(iter(self.lenders)))  # a retry that may never be needed yields to a new body
            if self.used + self.lent + n > self.limit:
                return "all"
            self.used += n
            held.bytes += n
            self.charge(held, n)
            return None

    def charge(self, held: Held, n: int) -> None:
        """Under the lock: n more (or fewer) bytes used by held's client."""
        if not held.client:
            return
        left = self.by_client.get(held.client, 0) + n
        if left > 0:
            self.by_client[held.client] = left
        else:
            self.by_client.pop(held.client, None)

    def drop(self, held: Held) -> None:
        """Under the lock: a lent body given up (its request can no longer be retried) and its bytes freed."""
        del self.lenders[held]
        self.lent -= held.bytes
        held.bytes, held.body, held.dropped = 0, None, True


def _size(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"


class Held:
    """One request's share of the budget, and its body while it may be sent again."""

    def __init__(self, budget: Budget, client: str = ""):
        self.budget, self.bytes, self.client = budget, 0, client
        self.body: bytes | bytearray | None = None  # kept (keep()) for a retry; None once given up
        self.dropped = False  # released, or its kept body given up for a new one's room: no retry

    def take(self, n: int, what: str) -> None:
        most = self.budget.share if self.client else self.budget.limit
        if self.bytes + n > most:  # this request alone would never fit
            raise Refusal(413, "too_costly", f"{what} would take {_size(self.bytes + n)} of memory; the proxy "
                          f"holds at most {_size(most)} of one client's request bodies and their parses at once")
        why = self.budget.take(self, n)
        if why == "client":
            raise Refusal(503, "busy", f"this client's requests hold {_size(self.budget.share)} of request bodies "
                          f"now, the most one client may of the proxy's {_size(self.budget.limit)}; {what} does not "
                          "fit: retry")
        if why is not None:
            raise Refusal(503, "busy", f"the proxy is holding {self.budget.limit >> 20} MiB of request bodies now; "
                          f"{what} does not fit: retry")

    def give(self, n: int) -> None:
        with self.budget.lock:
            if self in self.budget.lenders:
                return  # lent: given up through release() or drop() only
            n = min(n, self.bytes)
            self.bytes -= n
            self.budget.used -= n
            self.budget.charge(self, -n)

    def keep(self, body: bytes | bytearray) -> None:
        """Keep the body to send (its share is the bytes still held) until the engine has answered."""
        self.body = body

    def lend(self) -> None:
        """The body is with the engine: its share stays, lent, until the engine answers or a new body needs it."""
        with self.budget.lock:
            if self.body is not None and self not in self.budget.lenders:
                self.budget.lenders[self] = None
                self.budget.used -= self.bytes
                self.budget.lent += self.bytes
                self.budget.charge(self, -self.bytes)  # lent bytes yield to anyone's: no client's share

    def reclaim(self) -> bool:
        """Held again for a retry: whether the body is still here (False: it was given up, no retry)."""
        with self.budget.lock:
            if self in self.budget.lenders:
                del self.budget.lenders[self]
                self.budget.lent -= self.bytes
                self.budget.used += self.bytes
                self.budget.charge(self, self.bytes)
            return not self.dropped

    def release(self) -> None:
        """All given back, the body too: the request is never sent again."""
        with self.budget.lock:
            if self in self.budget.lenders:
                self.budget.drop(self)
            self.budget.used -= self.bytes
            self.budget.charge(self, -self.bytes)
            self.bytes, self.body, self.dropped = 0, None, True


async def read(request: web.BaseRequest, limit: int, held: Held,
               progress: Callable[[int], None] | None = None) -> bytearray:
    """The whole body, each piece taken from the budget as it arrives (and told to progress: the listener's
    deadline counts the body's own bytes); Refusal past limit or the budget."""
    body = bytearray()
    while True:
        if request.transport is None:  # gone before we read (newer aiohttp then raises a bare RuntimeError)
            raise ConnectionResetError("the client left")
        chunk = await request.content.readany()
        if not chunk:
            return body
        if len(body) + len(chunk) > limit:
            raise Refusal(413, "too_large", f"request body over {limit} bytes (the proxy's --max-body-bytes)")
        held.take(len(chunk), "this body")
        body += chunk
        if progress is not None:
            progress(len(chunk))


def decode(body: bytes, coding: str, limit: int, held: Held) -> bytes:
    """The body with its Content-Encoding undone (gzip or deflate, at most limit bytes out)."""
    coding = coding.strip().lower()
    if coding in ("", "identity"):
        return body
    if coding not in ("gzip", "x-gzip", "deflate"):
        raise Refusal(415, "bad_encoding", f"Content-Encoding {coding!r}: the proxy reads gzip, deflate or none")
    held.take(limit, "the decompressed body")  # the most it may be, taken before it is made
    pieces, size, rest = [], 0, body
    while True:  # gzip may be several members one after another (RFC 1952 2.2): each is decoded
        try:
            inflate = zlib.decompressobj(wbits=47)  # a zlib or gzip header, found from the data
            piece = inflate.decompress(rest, limit + 1 - size)  # never past limit + 1 bytes, whatever the ratio
        except zlib.error as exc:
            raise Refusal(400, "bad_encoding", f"the body is not valid {coding}: {exc}") from None
        size += len(piece)
        pieces.append(piece)
        if size > limit:
            raise Refusal(413, "too_large", f"request body over {limit} bytes once decompressed (--max-body-bytes)")
        if not inflate.eof:
            raise Refusal(400, "bad_encoding", f"the {coding} body is cut short")
        rest = inflate.unused_data
        if not rest:
            break
        if coding == "deflate":
            raise Refusal(400, "bad_encoding", f"the deflate body has {len(rest)} bytes after its end")
    if len(pieces) == 1:
        held.give(limit - size)
        return pieces[0]
    held.take(size, "joining the decompressed body")  # the pieces and their join, for a moment
    plain = b"".join(pieces)
    pieces = None
    held.give(limit)
    return plain


def parse_cost(body: bytes, dumped: bool = False) -> int:
    """At most what parsing this JSON body, applying the rules, re-encoding it and dumping it take, in bytes."""
    if body.isascii() and b"\\u" not in body:
        width = 1
    elif any(lead in body for lead in FOUR_BYTE_LEADS) or WIDE_ESCAPE.search(body):
        width = 4
    else:
        width = 2
    tokens = body.count(b",") + body.count(b'"')
    containers = body.count(b"{") + body.count(b"[")
    text = 1 + 3 * width + (DUMP_PER_BYTE if dumped else 0)
    return len(body) * text + PER_CONTAINER * containers + PER_ELEMENT * tokens


def loads(body: bytes):
    """json.loads, but numbers that are not finite are refused: Python reads 1e999999 as inf and would write it
    back as Infinity, which the engine's JSON parser rejects."""
    return json.loads(body, parse_float=_finite, parse_constant=_no_constant)


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"the number {text[:40]} is out of range")
    return value


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")
