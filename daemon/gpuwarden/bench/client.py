"""One streamed request, timed as vLLM's own serving benchmark times it (vllm/benchmarks/lib/
endpoint_request_func.py): TTFT at the first chunk that carries a choice, one inter-token gap per later
chunk, latency at the last such chunk, output tokens from the final usage chunk.

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

MAX_EVENT_BYTES = 1024 * 1024  # an SSE event longer than this is not a token stream
HAS_CHOICE = re.compile(rb'"choices"\s*:\s*\[\s*\{')  # a non-empty choices list: a chunk with a token


@dataclass
class RequestResult:
    start: float
    ok: bool = False
    ttft_s: float | None = None
    latency_s: float | None = None
    output_tokens: int = 0
    prompt_tokens: int | None = None
    itl_s: list[float] = field(default_factory=list)
    error: str | None = None

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
    except ValueError:
        pass
    return text[:limit]


async def stream(session: aiohttp.ClientSession, url: str, payload: dict) -> RequestResult:
    """POST payload to url with stream: true and time what comes back; never raises but CancelledError."""
    result = RequestResult(time.perf_counter())
    last = result.start
    chunks = 0
    try:
        async with session.post(url, json=payload) as response:
            if response.status != 200:
                result.error = f"HTTP {response.status}: {_one_line(await response.text())}"
                return result
            pending = b""
            async for data in response.content.iter_any():
                pending += data
                *lines, pending = pending.split(b"\n")
                if len(pending) > MAX_EVENT_BYTES:
                    result.error = f"an event of over {MAX_EVENT_BYTES // 1024} KiB without a line end"
                    return result
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
                        continue
                    message = json.loads(event)
                    if message.get("usage"):
                        result.output_tokens = int(message["usage"].get("completion_tokens") or 0)
                        result.prompt_tokens = message["usage"].get("prompt_tokens")
                    elif message.get("error"):
                        result.error = _one_line(json.dumps(message))
                        return result
    except asyncio.CancelledError:
        raise
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, OSError) as exc:
        result.error = f"{type(exc).__name__}: {exc}".strip().rstrip(":")
        return result
    if chunks == 0:
        result.error = "the stream ended before any token"
        return result
    result.ok, result.latency_s = True, last - result.start
    if not result.output_tokens:  # no usage chunk: one token per chunk, as servers without usage stream
        result.output_tokens = chunks
    return result
