"""Text from outside (a request path, a header, an engine's output, a server's error body, a process name) made
safe for one log line, STATUS= or a terminal.

journald ends a record at NUL and reads a leading `<N>` as its priority; CR and LF start a new record (or a
new line in STATUS=, where `STOPPING=1` would be read as a command); ESC starts a terminal's control sequence
(clear the screen, OSC 52 writes the clipboard). Every control character (C0, DEL, C1) and the Unicode line and
paragraph separators are written visibly instead: `\\x00`, `\\r`, `\\x1b`, `\\u2028`. A backslash stays itself, so
the escaped text stays readable; it is never parsed back.
"""

from __future__ import annotations

import re

_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}
_UNSAFE = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")


def _escape(match: re.Match) -> str:
    char = match.group()
    if char in _NAMED:
        return _NAMED[char]
    code = ord(char)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def visible(text: str) -> str:
    """text with every control character written as an escape: one line, nothing a terminal or journald acts on."""
    return _UNSAFE.sub(_escape, text)


def visible_lines(text: str) -> str:
    """A report of several lines that quotes outside text: each line made visible, its line ends kept."""
    return "\n".join(visible(line) for line in text.split("\n"))
