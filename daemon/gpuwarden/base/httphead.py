"""The head of an HTTP/1 message, a request's or a response's: its first line and its headers, within a size cap.

The metrics server reads request heads with it (web/server.py), and base/httpget.py the heads of the answers it
reads. The caps stay each reader's own (a request head 16 KiB, an answer's 64 KiB): this refuses a head past the
cap it is given, a header line without a colon, and a first line that is not HTTP/1's. Header names are
lower-cased and values stripped; a name sent twice counts with its first value.
"""

from __future__ import annotations

import re

END = b"\r\n\r\n"  # the blank line that ends a head
STATUS_CODE = re.compile(r"[0-9]{3}")


class BadHead(ValueError):
    """Not an HTTP/1 head, or one over its cap; in words that follow the sender's name ("... did not answer with
    HTTP")."""


def split(data: bytes) -> tuple[bytes, bytes] | None:
    """(head, what follows its blank line); None while the blank line has not come."""
    head, sep, rest = data.partition(END)
    return (head, rest) if sep else None


def parse(head: bytes, max_bytes: int) -> tuple[str, dict[str, str]]:
    """The first line and the headers of a head (with or without the blank line that ends it)."""
    head = head.removesuffix(END)
    if len(head) > max_bytes:
        raise BadHead(f"sent a head larger than {max_bytes} bytes")
    first, *lines = head.decode("latin-1").split("\r\n")
    headers: dict[str, str] = {}
    for line in filter(None, lines):
        name, colon, value = line.partition(":")
        if not colon:
            raise BadHead("sent a header line without a colon")
        headers.setdefault(name.strip().lower(), value.strip())
    return first, headers


def request(head: bytes, max_bytes: int) -> tuple[str, str, dict[str, str]]:
    """Method, target and headers of a request head; BadHead unless it is HTTP/1."""
    first, headers = parse(head, max_bytes)
    words = first.split(" ")
    if len(words) != 3 or not words[2].startswith("HTTP/1."):
        raise BadHead("sent no HTTP/1 request line")
    method, target, _ = words
    return method, target, headers


def response(head: bytes, max_bytes: int) -> tuple[int, dict[str, str]]:
    """Status code and headers of a response head; BadHead unless it is HTTP with a three-digit code."""
    first, headers = parse(head, max_bytes)
    words = first.split()
    if len(words) < 2 or not words[0].startswith("HTTP/"):
        raise BadHead("did not answer with HTTP")
    if not STATUS_CODE.fullmatch(words[1]):  # 5,000 digits: int() would raise past 4,300
        raise BadHead("answered with a status code that is not three digits")
    return int(words[1]), headers
