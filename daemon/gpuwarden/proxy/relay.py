"""The engine's answer relayed to the client: status, headers (hop-by-hop ones dropped both ways) and body, chunk by
chunk as it comes, never parsed. A client that leaves mid-answer closes the request to the engine, so the engine stops
generating for nobody; an engine that breaks off mid-answer cuts the client's connection (a cut stream, never a
finished one), and what a stream said last goes to the book of the engine's ends (ends.py).
"""

from __future__ import annotations

import asyncio
import logging

import aiohttp
from aiohttp import web
from multidict import CIMultiDict

from .casualties import tail_of
from .joules import EVENT, HEAD_MAX, TAIL_MAX

HOP_BY_HOP = {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
              "transfer-encoding", "upgrade", "proxy-connection", "host", "content-length"}


def forwarded(headers) -> CIMultiDict:
    """The end-to-end headers: without the hop-by-hop ones, nor those the Connection header names as such."""
    named = {token.strip().lower() for value in headers.getall("Connection", ()) for token in value.split(",")}
    return CIMultiDict((k, v) for k, v in headers.items() if k.lower() not in HOP_BY_HOP and k.lower() not in named)


class Relay:
    """Answers relayed for one proxy: its metrics, its book of the engine's ends, its hold (the clock and whether
    the engine ended) and its fault lines."""

    def __init__(self, metrics, ends, hold, faults, joules=None):
        self.metrics, self.ends, self.hold, self.faults, self.joules = metrics, ends, hold, faults, joules

    async def answer(self, request: web.Request, up: aiohttp.ClientResponse, label: str,
                     tries) -> web.StreamResponse:
        """The engine's answer to request, chunk by chunk as it comes (a stream's last bytes kept for ends.py); a client
        that leaves closes the upstream request, so the engine stops; an engine that breaks off cuts the client's
        connection, and its end is told to the book of ends."""
        response = web.StreamResponse(status=up.status, reason=up.reason)
        response.headers.extend(forwarded(up.headers))
        if up.content_length is not None:
            response.content_length = up.content_length
        streaming = up.headers.get("Content-Type", "").startswith("text/event-stream")
        self.metrics.requests.labels(label, str(up.status)).inc()
        if streaming:
            self.metrics.streams.labels(label).inc()
        else:  # a stream's answer is told at its end, where an error event may be (ends.py)
            self.ends.answered(request, tries.sent_at, up.status)
        sent, tail, clean = 0, b"", False
        first_at, head, end, events = None, b"", b"", 0  # for the joules (joules.py): the first byte, the usage, events
        try:
            await response.prepare(request)
            async for chunk in up.content.iter_any():
                first_at = self.hold.clock() if first_at is None else first_at
                await response.write(chunk)
                sent += len(chunk)
                self.metrics.chunks.inc()
                if streaming:
                    tail = tail_of(tail, chunk)
                    events += chunk.count(EVENT)
                end = (end + chunk)[-TAIL_MAX:]
                head += chunk[:HEAD_MAX - len(head)] if streaming and len(head) < HEAD_MAX else b""
                if self.joules is not None:  # its tokens so far, should its interval settle before it ends
                    self.joules.progress(tries, first_at, events)
            await response.write_eof()
            clean = True
        except (ConnectionResetError, asyncio.CancelledError) as exc:
            # The client went away: leaving the `async with` closes the upstream connection, so the engine
            # sees the disconnect and stops generating.
            self.metrics.failures.labels("client_gone").inc()
            self.faults.note("clients gone mid-response", f"client {request.remote} left {request.method} "
                             f"{request.path} after {sent} bytes", logging.INFO)
            if isinstance(exc, asyncio.CancelledError):
                raise
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:  # caught here: the response has begun
            broke_at = self.hold.clock()
            self.metrics.failures.labels("upstream_broke").inc()
            self.faults.note("responses cut by the engine", f"upstream broke off {request.method} {request.path} "
                             f"from {request.remote} after {sent} bytes: {exc or type(exc).__name__}")
            if request.transport is not None:
                request.transport.close()  # the client must see a cut stream, not a finished one
            if isinstance(exc, aiohttp.ClientError) and await self.hold.health.ended(since=broke_at):
                self.ends.cut(request, tries.sent_at)
        finally:
            self.metrics.bytes_out.inc(sent)
            # Ended, cut or left: what a stream said last (no more of it is kept). One that did not end cleanly is a
            # suspect whatever it said: a client that left at once never let the error event reach the tail.
            if streaming or not clean:
                self.ends.answered(request, tries.sent_at, up.status, tail, suspect=not clean)
            if self.joules is not None:  # a client gone mid-stream: what the engine made until then
                # an answer neither a stream nor JSON (a transcription as text) is the model's words: no usage in it
                end = end if streaming or "json" in up.content_type else b""
                self.joules.ended(request, tries, first_at, end, streaming, events, sent, up.status, head)
        return response
