"""A bounded HTTP request: a total deadline and a size cap, whatever the other side does.

urllib's timeout applies to each socket read, and read() has no limit, so a
server that trickles one byte a second, or sends a gigabyte, holds the caller
for as long as it likes. Everything we read from another process (the engine's
/health and /metrics, the stall probe's one-token completion, the daemon's
/status) goes through here instead.
"""

from __future__ import annotations

import pwd
import re
import socket
import ssl
import time
from dataclasses import dataclass
from urllib.parse import urlsplit

from . import httphead, sockowner, unixsock

MAX_HEADER_BYTES = 64 * 1024
MAX_LENGTH_DIGITS = 18  # a Content-Length of more digits is past any cap here (an exabyte)
CHUNK_SIZE = re.compile(rb"[0-9a-fA-F]{1,16}")


class HttpError(Exception):
    """The read failed or broke a limit; the message is one line."""


class Unasked(HttpError):
    """Nothing was written: the socket that took the connection is not the owner's, or is closed already (a server
    that answers before it is asked, as the proxy's connection cap does, and closes, leaves no owner to name). What
    it wrote before its end, complete, is the reply (None: nothing complete); the caller decides whether an answer
    nobody asked for means anything (serving/run/health.py takes the cap's fixed 503 from the kept listener)."""

    def __init__(self, message: str, reply: Reply | None):
        super().__init__(message)
        self.reply = reply


@dataclass(frozen=True)
class Reply:
    code: int  # the HTTP status code
    body: bytes
    local_port: int  # our end of the connection, to find the peer in /proc/net/tcp


def get(url: str, deadline_s: float, max_bytes: int, headers: dict[str, str] | None = None,
        context: ssl.SSLContext | None = None, owner: int | tuple[int, ...] | None = None) -> Reply:
    """GET url, done within deadline_s seconds in total and at most max_bytes of body; else HttpError.
    https:// needs the context to verify the server with; owner: as request()'s."""
    return request("GET", url, deadline_s, max_bytes, headers, context, owner=owner)


def post_json(url: str, body: bytes, deadline_s: float, max_bytes: int,
              headers: dict[str, str] | None = None, owner: int | None = None) -> Reply:
    """POST a JSON body to a plain-http url, with get()'s total deadline and size cap; owner: as request()'s."""
    return request("POST", url, deadline_s, max_bytes, {"Content-Type": "application/json", **(headers or {})},
                   None, body, owner)


def request(method: str, url: str, deadline_s: float, max_bytes: int, headers: dict[str, str] | None = None,
            context: ssl.SSLContext | None = None, body: bytes = b"", owner: int | tuple[int, ...] | None = None
            ) -> Reply:
    """owner: a uid (or uids); nothing is written unless the socket that took the connection is one of its on this
    host (base/sockowner.py: a local user who binds the engine's port while it restarts gets no API key)."""
    parts = urlsplit(url)
    unix = unixsock.path_of(url)
    if unix is None and (parts.scheme not in ("http", "https") or not parts.hostname
                         or (parts.scheme == "https") != bool(context)):
        raise HttpError(f"cannot read {url!r} (http://, http+unix:// or https:// with a TLS context)")
    host, port = ("localhost", None) if unix else (parts.hostname, parts.port or (443 if context else 80))
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    end = time.monotonic() + deadline_s
    shown = unixsock.shown(url)

    def remaining() -> float:
        left = end - time.monotonic()
        if left <= 0:
            raise HttpError(f"no complete answer from {shown} within {deadline_s:g} s")
        return left

    try:
        with _connect(unix, host, port, remaining(), owner) as raw:
            why = None if owner is None else sockowner.why_not(raw, owner)
            if why is not None:
                reply = _written_before_asked(raw, max_bytes, shown)
                sockowner.reset_on_close(raw)
                raise Unasked(f"{shown}: {why}", reply)
            sock = context.wrap_socket(raw, server_hostname=host) if context else raw
            local_port = 0 if unix else sock.getsockname()[1]
            name = f"[{host}]" if ":" in host else host
            name = name if unix else f"{name}:{port}"
            extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
            if body:
                extra += f"Content-Length: {len(body)}\r\n"
            head = f"{method} {path} HTTP/1.1\r\nHost: {name}\r\nConnection: close\r\n" \
                   f"Accept-Encoding: identity\r\n{extra}\r\n"
            sock.settimeout(remaining())
            sock.sendall(_encode_head(head) + body)
            data = bytearray()
            limit = MAX_HEADER_BYTES + max_bytes
            head_end, length = -1, None  # the head is parsed once, not on every chunk
            while True:
                sock.settimeout(remaining())
                chunk = sock.recv(min(65536, limit + 1 - len(data)))
                if not chunk:
                    break
                searched = max(0, len(data) - 3)
                data += chunk
                if len(data) > limit:
                    raise HttpError(f"the answer from {shown} is larger than {max_bytes} bytes")
                if head_end < 0:
                    head_end = data.find(httphead.END, searched)
                    if head_end < 0:
                        continue
                    length = _content_length(_response(bytes(data[:head_end]), shown)[1])
                    if length is not None and length > max_bytes:
                        raise HttpError(f"the answer from {shown} is larger than {max_bytes} bytes ({length})")
                if length is not None and len(data) - head_end - 4 >= length:
                    break
    except HttpError:
        raise
    except (OSError, ValueError) as exc:  # refused, reset, timed out, unresolvable
        raise HttpError(f"{shown}: {exc.strerror if isinstance(exc, OSError) and exc.strerror else exc}") from None
    status, body = _parse(bytes(data), shown, max_bytes)
    return Reply(status, body, local_port)


def _written_before_asked(sock: socket.socket, max_bytes: int, shown: str) -> Reply | None:
    """What the far end wrote and then closed on, already in our receive queue: read without waiting and without a
    byte written; None unless it is a whole answer followed by the end."""
    data = bytearray()
    try:
        while len(data) <= MAX_HEADER_BYTES + max_bytes:
            chunk = sock.recv(65536, socket.MSG_DONTWAIT)
            if not chunk:  # the end: what came before it is all there is
                status, body = _parse(bytes(data), shown, max_bytes)
                return Reply(status, body, sock.getsockname()[1] if sock.family != socket.AF_UNIX else 0)
            data += chunk
    except (OSError, HttpError):  # nothing more yet (EAGAIN), reset, or not a whole answer
        return None
    return None


def _connect(unix: str | None, host: str, port: int | None, timeout: float,
             owner: int | tuple[int, ...] | None) -> socket.socket:
    """A connection to the server: over TCP, or to the Unix socket at unix as its owner (the first uid of owner,
    with that user's group: base/unixsock.py; the socket and its directory are the owner's)."""
    if unix is None:
        return socket.create_connection((host, port), timeout=timeout)
    uid = owner if isinstance(owner, int) or owner is None else owner[0]
    return unixsock.connect(unix, timeout, uid, _group_of(uid))


def _group_of(uid: int | None) -> int | None:
    if uid is None:
        return None
    try:
        return pwd.getpwuid(uid).pw_gid
    except KeyError:
        return None


async def read_capped(content, max_bytes: int, what: str) -> bytes:
    """An aiohttp response body (response.content) read to its end, at most max_bytes; else HttpError. The
    deadline is the caller's ClientTimeout: this is the size cap that aiohttp's read() and json() lack."""
    chunks, size = [], 0
    async for chunk in content.iter_chunked(1 << 16):
        size += len(chunk)
        if size > max_bytes:
            raise HttpError(f"{what} sent more than {max_bytes} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def _encode_head(head: str) -> bytes:
    """HTTP header values are Latin-1 (how Starlette, vLLM's server, decodes them); a key beyond it goes as UTF-8
    (the server then refuses it, which proves it alive): never an encoding error counted as a dead engine."""
    try:
        return head.encode("latin-1")
    except UnicodeEncodeError:
        return head.encode("utf-8")


def _response(head: bytes, url: str) -> tuple[int, dict[str, str]]:
    try:
        return httphead.response(head, MAX_HEADER_BYTES)
    except httphead.BadHead as exc:
        raise HttpError(f"{url} {exc}") from None


def _content_length(headers: dict[str, str]) -> int | None:
    """The declared body length; None when absent or not a number. ASCII digits only (latin-1's "\u00b2" is
    isdigit() but not int()), and a number past MAX_LENGTH_DIGITS digits (int() refuses 4,300) reads as
    10**MAX_LENGTH_DIGITS: larger than any cap."""
    value = headers.get("content-length", "")
    if not (value.isascii() and value.isdigit()):
        return None
    return int(value) if len(value) <= MAX_LENGTH_DIGITS else 10**MAX_LENGTH_DIGITS


def _parse(data: bytes, url: str, max_bytes: int) -> tuple[int, bytes]:
    split = httphead.split(data)
    if split is None:
        if len(data) > MAX_HEADER_BYTES:
            raise HttpError(f"the headers from {url} are larger than {MAX_HEADER_BYTES} bytes")
        raise HttpError(f"{url} closed the connection before a complete answer")
    head, body = split
    status, headers = _response(head, url)
    if headers.get("transfer-encoding", "").lower() == "chunked":
        body = _dechunk(body, url)
    elif (length := _content_length(headers)) is not None:
        if len(body) < length:
            raise HttpError(f"{url} closed the connection after {len(body)} of {length} bytes")
        body = body[:length]
    if len(body) > max_bytes:
        raise HttpError(f"the answer from {url} is larger than {max_bytes} bytes")
    return status, body


def _dechunk(body: bytes, url: str) -> bytes:
    out, rest = bytearray(), body
    while True:
        size_line, sep, rest = rest.partition(b"\r\n")
        digits = size_line.split(b";")[0].strip(b" \t")
        if not sep or not CHUNK_SIZE.fullmatch(digits):  # int(x, 16) also takes "-0", "+1" and "1_0"
            raise HttpError(f"{url} sent a malformed chunked body")
        size = int(digits, 16)
        if size == 0:
            return bytes(out)
        if len(rest) < size + 2:
            raise HttpError(f"{url} closed the connection inside a chunk")
        out += rest[:size]
        rest = rest[size + 2:]
