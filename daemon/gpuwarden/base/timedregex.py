"""The operator's regular expressions that run on what clients send (`serve.proxy.remove_patterns`), compiled with
the `regex` module (Debian: python3-regex): its matching takes a time limit and, run on a worker thread, lets other
threads run meanwhile. Python's own `re` has neither, and an innocent-looking pattern can be quadratic or worse: the
attacker's F2 of 2026-12-02 sent `\\s+$` a system text of 150,000 spaces and an x, which held the proxy's loop (and
the GIL, off the loop too) for about 45 s; three such requests and the daemon killed the proxy, five and it was
FATAL for everyone. One home for compiling them (config, `gpuwarden proxy`) and for running them (proxy/normalize)."""

from __future__ import annotations

import re

import regex

Pattern = regex.Pattern
MAX_CHARS = 1000  # a pattern's length
# The largest product of counted repeats nested in one another ({m}, {m,n}, {m,}): `regex` compiles a counted repeat
# by copying what it repeats, about 230 bytes a copy, so (?:a{100000}){100000} in a drop-in took the daemon to 9.1 GB
# in 20 s at a reload (the attacker's finding 2 of 2026-12-02, after F2's fix). 100,000: 23 MiB at most.
MAX_REPEATS = 100_000
_COUNT = re.compile(r"\{(\d+)(,(\d*))?\}")


def compile_pattern(text: str) -> regex.Pattern:
    """text as a pattern, each line of a text its own (MULTILINE), as Python's `re` would read it; ValueError with
    the reason where it is no regular expression (a{4294967295}, 1,000 nested groups included), is longer than
    MAX_CHARS, or repeats more than MAX_REPEATS times (repeats())."""
    if len(text) > MAX_CHARS:
        raise ValueError(f"{len(text)} characters, more than the {MAX_CHARS} a pattern may have")
    copies = repeats(text)
    if copies > MAX_REPEATS:
        raise ValueError(f"its counted repeats nest to {copies:,} copies, more than the {MAX_REPEATS:,} a pattern may "
                         "make (each is compiled as a copy)")
    try:
        return regex.compile(text, regex.MULTILINE | regex.VERSION0)
    except (regex.error, OverflowError, RecursionError, ValueError, MemoryError) as exc:
        raise ValueError(str(exc) or type(exc).__name__) from None


def repeats(text: str) -> int:
    """The largest product of counted repeats nested in one another, read from the pattern's text: a{3} is 3,
    (?:a{3}b){4} is 12, {m,} counts m. An escape, a class ([...]) and anything else is one item that repeats once."""
    stack = [1]  # per open group: the largest product of an item within it
    last, i = 1, 0  # the product of the item just read
    while i < len(text):
        c = text[i]
        count = _COUNT.match(text, i) if c == "{" else None
        if c == "\\":
            i, last = i + 2, 1
        elif c == "[":
            j = i + 1 + (text[i + 1:i + 2] == "^")
            j += text[j:j + 1] == "]"  # a ] first is a member
            while j < len(text) and text[j] != "]":
                j += 2 if text[j] == "\\" else 1
            i, last = j + 1, 1
        elif c == "(":
            stack.append(1)
            i, last = i + 1, 1
            continue
        elif c == ")" and len(stack) > 1:
            last = stack.pop()
            i += 1
        elif count is not None:
            low, high = int(count[1]), count[3]
            last *= max(low, int(high) if high else low, 1)
            i = count.end()
            if last > MAX_REPEATS * MAX_REPEATS:  # enough to refuse it; no need to count on
                return last
        else:
            i, last = i + 1, 1
        stack[-1] = max(stack[-1], last)
    return max(stack)


def remove_within(pattern: regex.Pattern, text: str, seconds: float) -> tuple[str, int] | None:
    """text with every match of pattern removed, and how many; None when that took more than seconds (text is then
    to be kept as it was)."""
    if seconds <= 0:
        return None
    try:
        return pattern.subn("", text, timeout=seconds, concurrent=True)
    except TimeoutError:
        return None
