"""The operator's regular expressions that run on what clients send (`serve.proxy.remove_patterns`), compiled with
the `regex` module (Debian: python3-regex): its matching takes a time limit and, run on a worker thread, lets other
threads run meanwhile. Python's own `re` has neither, and an innocent-looking pattern can be quadratic or worse:
`\\s+$` on a system text of 150,000 spaces and an x holds the loop (and the GIL, off the loop too) for about 45 s,
long enough for the daemon to take the proxy for dead. One home for compiling them (config, `gpuwarden proxy`) and for running them (proxy/normalize)."""

from __future__ import annotations

import re

import regex

Pattern = regex.Pattern
MAX_CHARS = 1000  # a pattern's length
# The copies counted repeats make ({m}, {m,n}, {m,}: repeats()), in one pattern and in all of a config's together:
# `regex` compiles a counted repeat by copying what it repeats, about 230 bytes a copy, so (?:a{100000}){100000} in a
# drop-in would take the daemon past 9 GB at a reload. 100,000: 23 MiB.
MAX_REPEATS = 100_000
_COUNT = re.compile(r"\{\s*(\d+)\s*(,\s*(\d*)\s*)?\}")  # spaces too: counted more, never less
# The verbose flag, inline ((?x), (?ix), (?x-i:...)): `regex` then takes spaces, newlines and #-comments inside a
# counted repeat's braces ("{99999 }", "{9#c\n9}"), which no reading of the text before compiling can follow (40
# patterns of "[ab]{99999 }" cost the daemon and the proxy 1.5 GB each).
_FLAGS = re.compile(r"\(\?([-A-Za-z0-9]*)[:)]")  # an inline flags group, scoped or not


def compile_patterns(texts) -> list[regex.Pattern]:
    """Each of texts compiled (compile_pattern), their copies together at most MAX_REPEATS; PatternError naming the
    first that is refused and why."""
    out, spent = [], 0
    for index, text in enumerate(texts):
        try:
            out.append(compile_pattern(text, spent))
        except ValueError as exc:
            raise PatternError(index, str(exc)) from None
        spent += repeats(text)
    return out


class PatternError(ValueError):
    def __init__(self, index: int, why: str):
        super().__init__(why)
        self.index = index


def compile_pattern(text: str, spent: int = 0) -> regex.Pattern:
    """text as a pattern, each line of a text its own (MULTILINE), as Python's `re` would read it; ValueError with
    the reason where it is no regular expression (a{4294967295}, 1,000 nested groups included), is longer than
    MAX_CHARS, or makes more than MAX_REPEATS copies with the `spent` of patterns compiled with it (repeats())."""
    if len(text) > MAX_CHARS:
        raise ValueError(f"{len(text)} characters, more than the {MAX_CHARS} a pattern may have")
    if _verbose(text):
        raise ValueError("the verbose flag (?x) is not taken here: write the pattern without it (its spaces and "
                         "comments would hide how many copies its counted repeats make)")
    if _commented(text):
        raise ValueError("an inline comment (?#...) is not taken here: write the pattern without it (where it "
                         "ends is read differently by regular-expression engines, which could hide its repeats)")
    copies = repeats(text)
    if spent + copies > MAX_REPEATS:
        before = f" (with the {spent:,} of the patterns before it)" if spent else ""
        raise ValueError(f"its counted repeats make {copies:,} copies{before}, more than the {MAX_REPEATS:,} the "
                         "patterns may make together (each is compiled as a copy)")
    try:
        return regex.compile(text, regex.MULTILINE | regex.VERSION0)
    except (regex.error, OverflowError, RecursionError, ValueError, MemoryError) as exc:
        raise ValueError(str(exc) or type(exc).__name__) from None


def repeats(text: str) -> int:
    """How many copies the pattern's counted repeats make, read from its text: each item counts its repeat's
    bound (a{3} is 3, {m,} counts m), a group the sum of its items times its own, and the pattern the sum of all:
    (a{3}b){4} is 16, a{5}b{5} is 10. An escape, a class ([...]) and any other character is one item that repeats
    once (so a group's ?: counts 2: a pattern's length bounds what such counting adds). The sum, not the deepest
    product: "[ab]{99999}" 90 times over passes a bound on the product, and three such patterns cost 7 GB."""
    stack = [0]  # per open group: the sum of its items so far
    last, i = 0, 0  # the copies of the item just read (0: none yet)
    while i < len(text):
        c = text[i]
        count = _COUNT.match(text, i) if c == "{" else None
        if count is not None:
            low, high = int(count[1]), count[3]
            times = max(low, int(high) if high else low, 1)
            stack[-1] += last * (times - 1)  # the item counted once already
            last *= times
            i = count.end()
            if stack[-1] > MAX_REPEATS * MAX_REPEATS:  # enough to refuse it; no need to count on
                return stack[-1]
            continue
        if c == "\\":
            i, last = i + 2, 1
        elif c == "[":
            i, last = _class_end(text, i), 1
        elif text.startswith("(?#", i):  # a comment: nothing in it is read, up to the first ")" (as `regex` does)
            i = _comment_end(text, i)
            continue
        elif c == "(":
            stack.append(0)
            i += 1
            continue
        elif c == ")" and len(stack) > 1:
            last = max(stack.pop(), 1)
            i += 1
        else:
            i, last = i + 1, 1
        stack[-1] += last
    return sum(stack)


def _verbose(text: str) -> bool:
    """Whether an inline flags group sets x (VERBOSE); escapes, classes and comments read as repeats() reads them."""
    i = 0
    while i < len(text):
        c = text[i]
        if c == "\\":
            i += 2
        elif c == "[":
            i = _class_end(text, i)
        elif text.startswith("(?#", i):
            i = _comment_end(text, i)
        elif c == "(" and (flags := _FLAGS.match(text, i)) is not None and "x" in flags[1].split("-")[0]:
            return True
        else:
            i += 1
    return False


def _commented(text: str) -> bool:
    """Whether an inline comment opens outside a class and an escape."""
    i = 0
    while i < len(text):
        if text[i] == "\\":
            i += 2
        elif text[i] == "[":
            i = _class_end(text, i)
        elif text.startswith("(?#", i):
            return True
        else:
            i += 1
    return False


def _comment_end(text: str, i: int) -> int:
    """Past the comment that opens at text[i] ("(?#"): its first ")" not escaped ends it, as `regex` reads one."""
    j = i + 3
    while j < len(text) and text[j] != ")":
        j += 2 if text[j] == "\\" else 1
    return min(j + 1, len(text))


def _class_end(text: str, i: int) -> int:
    """Past the class that opens at text[i] ("["): a ^ and a ] first are members, an escape is one."""
    j = i + 1 + (text[i + 1:i + 2] == "^")
    j += text[j:j + 1] == "]"
    while j < len(text) and text[j] != "]":
        j += 2 if text[j] == "\\" else 1
    return j + 1


def remove_within(pattern: regex.Pattern, text: str, seconds: float) -> tuple[str, int] | None:
    """text with every match of pattern removed, and how many; None when that took more than seconds (text is then
    to be kept as it was)."""
    if seconds <= 0:
        return None
    try:
        return pattern.subn("", text, timeout=seconds, concurrent=True)
    except TimeoutError:
        return None
