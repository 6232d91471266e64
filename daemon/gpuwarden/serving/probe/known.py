"""The known-answer check: does the engine compute what it computed when it was first healthy?

A GPU fault can leave an engine that answers /health and every request, with wrong numbers (double-bit ECC, a
GPU fallen off the bus and back). After a recovery (the engine restarted once its GPU was reset), a fixed prompt
at temperature 0 must give the same tokens as the engine gave at its first healthy start with the same model and
flags. Greedy decoding of one prompt alone in the batch is deterministic for one model, build and set of flags;
a change of any of those is a new record, never a mismatch.

The engine is a server we call: the answer is bounded in bytes (ANSWER_MAX_BYTES) and in time (TIMEOUT_S, the
whole request), and it authenticates as clients do (a probe is a client).
"""

from __future__ import annotations

import json

from ...base import httpget
from ...base.safetext import visible

PROMPT = "The quick brown fox jumps over the lazy dog. The"
TOKENS = 8  # a few: enough that a wrong matmul shows, short enough for a CPU engine to answer in seconds
ANSWER_MAX_BYTES = 64 * 1024  # the whole HTTP body: a JSON answer of 8 tokens is well under 2 KiB
TEXT_MAX_CHARS = 1024  # the text kept and compared (and logged, escaped)
TIMEOUT_S = 30.0  # the whole request, connection to last byte


class NoAnswer(httpget.HttpError):
    """The engine gave no usable answer (an error code, a body that is not a completion): no verdict."""


def ask(url: str, model: str, key: str | None = None, timeout_s: float = TIMEOUT_S, owner: int | None = None) -> str:
    """The engine's completion of PROMPT at temperature 0 (TOKENS tokens), as text, asked only of a socket of owner
    (the engine's uid: httpget.request); NoAnswer or httpget.HttpError (no answer in time, or too big) otherwise."""
    body = json.dumps({"model": model, "prompt": PROMPT, "max_tokens": TOKENS, "temperature": 0}).encode()
    headers = {"Authorization": f"Bearer {key}"} if key else None
    reply = httpget.post_json(url, body, timeout_s, ANSWER_MAX_BYTES, headers, owner)
    if reply.code != 200:
        raise NoAnswer(f"{url} answered {reply.code}")
    try:
        text = json.loads(reply.body)["choices"][0]["text"]
    except (ValueError, KeyError, IndexError, TypeError, RecursionError) as exc:
        raise NoAnswer(f"{url} answered no completion ({type(exc).__name__})") from None
    if not isinstance(text, str):
        raise NoAnswer(f"{url} answered a completion without text")
    return text[:TEXT_MAX_CHARS]


def compare(first: str, now: str) -> str | None:
    """None when they match, else one line that shows both (escaped: the engine's text is outside text)."""
    if first == now:
        return None
    return f'the known-answer check gave "{visible(now)}", the first healthy start gave "{visible(first)}"'
