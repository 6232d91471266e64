"""One streamed request, timed as vLLM's own serving benchmark times it (vllm/benchmarks/lib/
endpoint_request_func.py): TTFT at the first chunk that carries a choice, one inter-token gap per later
chunk, latency at the last such chunk, output tokens from the final usage chunk.

Whatever the server does, a request ends within its total deadline (a stream that never ends, or trickles a
token every ten minutes, is cut there: result.cut), holds at most one event or one error body (MAX_EVENT_BYTES,
MAX_ERROR_BYTES) and counts at most max_chunks(max_tokens) chunks (a server that ignores max_tokens).

aiohttp is the client: Debian 12 packages it (python3-aiohttp 3.8), so the .deb can depend on it; it streams a
response line by line, and with the connection limit lifted it holds a thousand concurrent streams in one
thread (vLLM's own benchmark uses it for the same reason). The session leaves trust_env off: the benchmark
measures the server, not a proxy from http_proxy, and with it on aiohttp looks up the proxy variables and
~/.netrc in a worker thread for every request, inside the TTFT (0.6-0.8 ms on the 2-core test box,
benchmarks/RESULTS.md section 9).
"""

from __future__ import annotations

import asyncio
import json
import time
import re
from dataclasses import dataclass, field

import aiohttp

from ..base.httpget import HttpError, read_capped

MAX_EVENT_BYTES = 1024 * 1024  # an SSE event longer than this is not a token stream
MAX_ERROR_BYTES = 64 * 1024  # an error's body: room for any message, and not a 1.5 GB one
HAS_CHOICE = re.compile(rb'"choices"\s*:\s*\[\s*\{')  # a non-empty choices list: a chunk with a token


def max_chunks(max_tokens: int) -> int:
    """A stream of more chunks than this ignores max_tokens: a chunk carries a token or more, plus a role
    chunk and a finish chunk on some servers. Each chunk is one inter-token gap kept in memory."""
    return 2 * max_tokens + 16


@dataclass
class RequestResult:
    start: float
    ok: bool = False
    ttft_s: float | None = None
    latency_s: float | None = None
    output_tokens: int = 0
    prompt_tokens: int | None = None
    itl_s: list[float] = field(default_factory=list)
    error: str | None = None  # what went wrong; for a cut request, what cut it
    cut: bool = False  # ended by bench's own deadline, not by the server: neither ok nor an error of the server

    @property
    def decode_tokens_per_s(self) -> float | None:
        """This request's own generation speed after its first token: what a single user sees stream."""
        if not self.ok or self.ttft_s is None or self.latency_s is None or self.output_tokens < 2:
            return None
        decode = self.latency_s - self.ttft_s
        return (self.output_tokens - 1) / decode if decode > 0 else None


def _one_line(text: str, limit: int = 200) -> str:
    text = " ".join(text.split())
    try:  # OpenAI-style errors: {"error": {"message": ...}} or vLLM's {"message": ...}
        body = json.loads(text)
        error = body.get("error", body) if isinstance(body, dict) else body
        text = str(error.get("message", text)) if isinstance(error, dict) else text
    except (ValueError, RecursionError):
        pass
    return text[:limit]


async def stream(session: aiohttp.ClientSession, url: str, payload: dict, timeout_s: float,
                 cut_by: str) -> RequestResult:
    """POST payload to url with stream: true and time what comes back, all within timeout_s seconds; a request
    still streaming then is cut (result.cut, with cut_by as its error). Never raises but CancelledError."""
    result = RequestResult(time.perf_counter())
    deadline = asyncio.timeout(timeout_s)
    try:
        async with deadline:
            await _exchange(session, url, payload, result)
    except TimeoutError:
        pass  # only ours gets here: aiohttp's connect timeout is caught inside _exchange, as an error
    if deadline.expired():
        result.cut, result.error, result.latency_s = True, cut_by, None
    elif result.error is None and result.ttft_s is None:
        result.error = "the stream ended before any token"
    elif result.error is None:
        result.ok = True
        if not result.output_tokens:  # no usage chunk: one token per chunk, as servers without usage stream
            result.output_tokens = len(result.itl_s) + 1
    return result


async def _exchange(session: aiohttp.ClientSession, url: str, payload: dict, result: RequestResult) -> None:
    """The request and its stream, into result: ttft_s, itl_s, latency_s (to the latest chunk so far), usage, or
    an error. Raises only CancelledError (the deadline's too)."""
    chunks, limit, last = 0, max_chunks(payload["max_tokens"]), result.start
    try:
        async with session.post(url, json=payload) as response:
            if response.status != 200:
                try:
                    body = await read_capped(response.content, MAX_ERROR_BYTES, "the error body")
                    said = _one_line(body.decode(errors="replace"))
                except HttpError:  # leaving the unread rest closes the connection: nothing more is read
                    said = f"(a body of more than {MAX_ERROR_BYTES // 1024} KiB, not read)"
                result.error = f"HTTP {response.status}: {said}"
                return
            pending = b""
            async for data in response.content.iter_any():
                pending += data
                *lines, pending = pending.split(b"\n")
                if len(pending) > MAX_EVENT_BYTES:
                    result.error = f"an event of over {MAX_EVENT_BYTES // 1024} KiB without a line end"
                    return
                now = time.perf_counter()  # every chunk of one read arrived together, as vLLM's benchmark counts
                for raw in lines:
                    line = raw.strip()
                    if not line.startswith(b"data:"):
                        continue  # blank lines and SSE comments (pings)
                    event = line[5:].strip()
                    if event == b"[DONE]":
                        break
                    # A token is timed without parsing it: on a small box the client's CPU is the server's,
                    # and JSON per token adds up. Only the other events (usage, errors) are parsed.
                    if HAS_CHOICE.search(event):
                        if chunks == 0:
                            result.ttft_s = now - result.start
                        else:
                            result.itl_s.append(now - last)
                        last, chunks = now, chunks + 1
                        result.latency_s = last - result.start
                        if chunks > limit:
                            result.error = f"more than {limit} chunks for max_tokens {payload['max_tokens']}"
                            return
                        continue
                    message = json.loads(event)
                    if not isinstance(message, dict):
                        raise ValueError(f"an event that is not a JSON object: {event[:60].decode(errors='replace')}")
                    usage = message.get("usage")
                    if isinstance(usage, dict) and usage:
                        result.output_tokens = int(usage.get("completion_tokens") or 0)
                        prompt = usage.get("prompt_tokens")
                        result.prompt_tokens = None if prompt is None else int(prompt)
                    elif message.get("error"):
                        result.error = _one_line(json.dumps(message))
                        return
    except asyncio.CancelledError:
        raise
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, TypeError, RecursionError, OverflowError,
            OSError) as exc:
        # TypeError, RecursionError, OverflowError: an event's JSON of the wrong shape (a list as a count), nested
        # too deep, or a count of 1e999
        result.error = f"{type(exc).__name__}: {exc}".strip().rstrip(":")
