"""A request's tokens, from its answer (proxy/joules.py weighs it by them): its `usage`, read only where the engine
puts it, up to TOKENS_MAX: the engine's own count of the work it did. Where it is more than the bytes could carry
(more prompt tokens than the body could hold, more output tokens than bytes sent back) it is still taken, and said:
an image's tokens, or a reasoning model's thinking not sent back (`include_reasoning: false`), are true and larger
than their bytes, and the proxy cannot tell them from an engine's miscount (attacker 51: the byte estimate in their
place gave an 8,000-token answer a fourteenth of its neighbour's joules). Never a search of the answer's bytes:
the responses API echoes the client's `tools` raw, and a usage written there was read (the re-check's N1). Where
there is none, the estimate: the body's bytes over 4 as prompt tokens, a stream's events (or a body's bytes over 4)
as output tokens. Pure: bytes in, figures out."""

from __future__ import annotations

import json
import re

TOKENS_MAX = 10_000_000  # a count past this is no count
SLACK_TOKENS = 8192  # a chat template's tokens beyond the body's text
TEXT_USAGE = re.compile(r'"usage"\s*:\s*\{')
_DECODER = json.JSONDecoder()
USAGE_LAST = 2  # the last usages of an answer's end looked at: an engine that fills its tail with usages costs no more


def _count(value) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= TOKENS_MAX else None


OUTPUT_KEYS = ("completion_tokens", "output_tokens")


def _figures(usage) -> tuple[int | None, int | None]:
    """(prompt, output) of a usage object: OpenAI's names, or Anthropic's and the responses API's. One with no output
    figure at all (a rerank's or a score's: total_tokens, sometimes prompt_tokens) made no output: its prompt, 0."""
    if not isinstance(usage, dict):
        return None, None
    if not any(key in usage for key in OUTPUT_KEYS):
        return _count(usage.get("prompt_tokens", usage.get("input_tokens", usage.get("total_tokens")))), 0
    prompt = usage.get("prompt_tokens", usage.get("input_tokens"))
    return _count(prompt), _count(usage.get(OUTPUT_KEYS[0], usage.get(OUTPUT_KEYS[1])))


def _stream_usage(head: bytes, tail: bytes, cut: bool) -> tuple[int | None, int | None]:
    """A stream's usage, from its events whole (each a JSON object on its `data:` line) and only where the engine
    puts it: the event's own `usage` (OpenAI's last chunk, Anthropic's message_delta), `response.usage` (the
    responses API's response.completed) or `message.usage` (Anthropic's message_start); a later event's figure over
    an earlier one's. Never a search of the bytes: the responses API echoes the client's `tools` into its events,
    and a usage written there was read (attacker 51's re-check, N1). cut: the tail may begin mid-event."""
    found: list[tuple[int | None, int | None]] = []  # each usage's figures, in the stream's order
    for text, partial in ((head, False), (tail, cut)):
        lines = text.split(b"\n")  # an event's JSON has no raw newline: each line is one, or the cut end of one
        if partial and not lines[0].startswith(b"data:"):  # the end of an event over 8 KiB: the responses API's
            # response.completed, with the whole answer and the client's tools in it, ends with response.usage
            found.append(_closing_usage(lines[0].decode("utf-8", "replace"), 2))
        for line in lines:
            if not line.startswith(b"data:") or b'"usage"' not in line:
                continue
            try:
                event = json.loads(line[5:])
            except (ValueError, RecursionError):  # cut at the kept bytes' end, or not JSON
                continue
            if isinstance(event, dict):
                inner = [event[key] for key in ("response", "message") if isinstance(event.get(key), dict)]
                found += [_figures(holder.get("usage")) for holder in (event, *inner)]
    prompt = next((p for p, _ in reversed(found) if p is not None), None)
    return prompt, next((o for _, o in reversed(found) if o is not None), None)


def _rest_of_object(text: str) -> int | None:
    """The length of text's start that is the rest of an object (its other members, then its `}`); None: not so."""
    if text.startswith("}"):
        return 1
    if not text.startswith(","):
        return None
    try:  # the same text with its comma made a brace: it parses as one object where the rest is one object's
        return _DECODER.raw_decode("{" + text[1:])[1]
    except (ValueError, RecursionError):
        return None


def _closing_usage(text: str, levels: int) -> tuple[int | None, int | None]:
    """The usage of a JSON text's end that is a member of the object `levels` deep from the end, and of no object
    nested deeper (the responses API echoes the client's `tools` and more): a `"usage": {...}` among the last
    USAGE_LAST whose object is followed only by the rest of `levels` objects, then the text's end."""
    for match in [m for m in TEXT_USAGE.finditer(text)][:-USAGE_LAST - 1:-1]:
        try:
            usage, end = _DECODER.raw_decode(text, match.end() - 1)
        except (ValueError, RecursionError):
            continue
        rest = text[end:].strip()
        for _ in range(levels):
            closed = _rest_of_object(rest)
            if closed is None:
                break
            rest = rest[closed:].strip()
        else:
            if not rest:
                return _figures(usage)
    return None, None


def _body_usage(tail: bytes) -> tuple[int | None, int | None]:
    """An answer's usage where it is a member of the answer's own object (past the kept end, an answer larger than
    TAIL_MAX whose usage is not near its end: none)."""
    return _closing_usage(tail.decode("utf-8", "replace"), 1)


def tokens_of(tail: bytes, streaming: bool, events: int, sent: int, body: int,
              head: bytes = b"") -> tuple[int, int, bool, bool]:
    """(prompt tokens, output tokens, estimated, past its bytes) of an answer: its usage where it has one within
    TOKENS_MAX (head: a stream's first bytes, where its first event may say its prompt's), else the estimate; past
    its bytes: the usage says more than the body and the answer's bytes could carry."""
    if streaming:
        prompt, output = _stream_usage(head, tail, sent > len(tail))
    else:
        prompt, output = _body_usage(tail)
    if prompt is None or output is None:
        return body // 4, max(0, events - 1) if streaming else sent // 4, True, False
    return prompt, output, False, prompt > body + SLACK_TOKENS or output > sent
