"""The body the proxy sends upstream for a normalized path (server.NORMALIZED): decoded, parsed within the body
budget (body.py), the rules applied (normalize.py), each change counted, and the turn dumped (dump.py)."""

from __future__ import annotations

import json

from prometheus_client import Counter

from ..base.faultlog import FaultLog
from .body import Held, Refusal, decode, loads, parse_cost
from .dump import Dumper, session_of
from .normalize import PATTERNS_LATE, PATTERNS_S, PATTERNS_TEXT_MAX, Rules, apply


# The parse runs on a worker thread, but CPython's JSON scanner holds the GIL for all of it, so the event loop waits
# for every parse: 63 KB of gzip inflating to 32 MB of numbers (3.6 million values) held it half a second, and a
# client sending those at 90 KB/s stopped it 57 % of the time (attacker 10's F2). A body whose parse would cost more
# than its bytes justify goes on unparsed: one with more values than a chat request ever has, or a compressed one
# that inflates past a ratio a chat request never does. Both only lose the rules, never the request.
MAX_PARSE_VALUES = 250_000  # commas, quotes and brackets: a 200K-token agent session has tens of thousands
MAX_RATIO = 20  # a compressed body past 1 MiB decoded, inflated more than this many times
RATIO_FLOOR = 1 << 20


def unparsed(body: bytes | bytearray, plain: bytes | bytearray) -> str | None:
    """Why the body is not parsed (nor the rules applied), or None."""
    values = plain.count(b",") + plain.count(b'"') + plain.count(b"{") + plain.count(b"[")
    if values > MAX_PARSE_VALUES:
        return f"{values} JSON values and separators, more than {MAX_PARSE_VALUES}"
    if plain is not body and len(plain) > RATIO_FLOOR and len(plain) > MAX_RATIO * len(body):
        return f"{len(body)} compressed bytes inflated to {len(plain)}, more than {MAX_RATIO} times"
    return None


class Prepare:
    def __init__(self, rules: Rules, normalized: Counter, dumper: Dumper | None, faults: FaultLog,
                 max_body_bytes: int):
        """normalized: the changes each rule made, by rule."""
        self.rules, self.normalized, self.dumper, self.faults = rules, normalized, dumper, faults
        self.max_body_bytes = max_body_bytes

    def __call__(self, api: str, body: bytearray, coding: str, held: Held, peer: str | None,
                 path: str) -> bytes | bytearray:
        """The body to send upstream: decoded, parsed, the rules applied, counted and dumped; or Refusal."""
        plain = decode(body, coding, self.max_body_bytes, held)
        why = unparsed(body, plain)
        if why is not None:  # sent on as it came (decompressed), unchanged: the rules are not worth the loop
            self.faults.note("bodies sent without the rules", f"{path} from {peer}: {why}; sent unchanged")
            return plain
        held.take(parse_cost(plain, self.dumper is not None), "parsing this body")
        try:
            parsed = loads(plain)
        except (ValueError, RecursionError) as exc:  # RecursionError: nesting deeper than Python's limit
            raise Refusal(400, "bad_json", f"body is not JSON: {str(exc)[:200]}") from None
        if not isinstance(parsed, dict):
            raise Refusal(400, "bad_json", "body is JSON but not an object")
        turn = self.dumper.open(session_of(parsed, api, peer), path) if self.dumper is not None else None
        applied: dict = {}
        try:  # the dump is closed (kept within its budget, or removed) on every path
            if turn is not None:
                turn.part("received", parsed)  # before the rules change it in place
            try:
                applied = apply(parsed, api, self.rules)
            except Exception as exc:  # a shape no rule expected: the body goes on as it came
                self.faults.note("bodies the rules could not read", f"{path} from {peer}: a rule failed on the "
                                 f"body ({type(exc).__name__}: {str(exc)[:200]}); sent unchanged")
                if turn is not None:
                    turn.failed = "a rule failed on the body"
                return plain
            late = applied.pop(PATTERNS_LATE, 0)
            if late:
                self.faults.note("system texts the patterns ran out of time on", f"{path} from {peer}: "
                                 f"serve.proxy.remove_patterns took more than {PATTERNS_S:g} s, or met a system text "
                                 f"over {PATTERNS_TEXT_MAX >> 10} KiB, on {late} system text(s) of this request (a "
                                 "pattern slower than linear on what this client sent?); those were sent as they came")
            for rule, n in applied.items():
                self.normalized.labels(rule).inc(n)
            if applied:
                try:
                    plain = json.dumps(parsed, ensure_ascii=False, separators=(",", ":")).encode()
                except UnicodeEncodeError:  # a lone surrogate from a \ud800 escape: keep it escaped
                    plain = json.dumps(parsed, separators=(",", ":")).encode()
            if turn is not None:
                turn.part("sent", parsed)
            return plain
        finally:
            if turn is not None:
                turn.close(dict(applied))
