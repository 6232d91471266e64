"""The operator's regular expressions that run on what clients send (`serve.proxy.remove_patterns`), compiled with
the `regex` module (Debian: python3-regex): its matching takes a time limit and, run on a worker thread, lets other
threads run meanwhile. Python's own `re` has neither, and an innocent-looking pattern can be quadratic or worse: the
attacker's F2 of 2026-12-02 sent `\\s+$` a system text of 150,000 spaces and an x, which held the proxy's loop (and
the GIL, off the loop too) for about 45 s; three such requests and the daemon killed the proxy, five and it was
FATAL for everyone. One home for compiling them (config, `gpuwarden proxy`) and for running them (proxy/normalize)."""

from __future__ import annotations

import regex

Pattern = regex.Pattern


def compile_pattern(text: str) -> regex.Pattern:
    """text as a pattern, each line of a text its own (MULTILINE), as Python's `re` would read it; ValueError with
    the reason where it is no regular expression (a{4294967295}, 1,000 nested groups included)."""
    try:
        return regex.compile(text, regex.MULTILINE | regex.VERSION0)
    except (regex.error, OverflowError, RecursionError, ValueError) as exc:
        raise ValueError(str(exc) or type(exc).__name__) from None


def remove_within(pattern: regex.Pattern, text: str, seconds: float) -> tuple[str, int] | None:
    """text with every match of pattern removed, and how many; None when that took more than seconds (text is then
    to be kept as it was)."""
    if seconds <= 0:
        return None
    try:
        return pattern.subn("", text, timeout=seconds, concurrent=True)
    except TimeoutError:
        return None
