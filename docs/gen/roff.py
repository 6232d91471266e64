"""A small man(7) writer: the roff both generated man pages share (gpuwarden(8), gpuwarden.yaml(5)).

Text given as a plain str is escaped; text already made roff (bold(), italic(), Roff(...)) is kept as is,
so a line mixes the two: page.paragraph("Run ", bold("gpuwarden check"), " first.").

Why each escape:
- a backslash starts a roff escape, so a literal one is \\e;
- "-" is a hyphen to groff (U+2010 under -Tutf8): options and keys must stay copy-pasteable, so every
  hyphen-minus is \\- (an ASCII minus), and a word holding one starts with \\% (groff hyphenates it no further);
- a line starting with "." or "'" is a request, so such a line is guarded with \\&;
- characters outside ASCII become \\[uXXXX], so the page reads the same whatever encoding groff assumes;
- a blank line in filled text warns under man --warnings (lintian), so paragraphs are split into .PP
  and a blank line in a code block is \\&.
"""

from __future__ import annotations

import email.utils
import re
from pathlib import Path


class Roff(str):
    """Text that is roff already: not escaped again."""


def escape(text: str) -> Roff:
    if isinstance(text, Roff):
        return text
    out = []
    for ch in text:
        if ch == "\\":
            out.append("\\e")
        elif ch == "-":
            out.append("\\-")
        elif ch == "\t":
            out.append("    ")
        elif ord(ch) > 126:
            out.append(f"\\[u{ord(ch):04X}]")
        else:
            out.append(ch)
    return Roff("".join(out))


def join(*parts: str) -> Roff:
    """Plain parts escaped, roff parts kept, all on one line."""
    return Roff("".join(escape(p) for p in parts))


def bold(*parts: str) -> Roff:
    return Roff(f"\\fB{join(*parts)}\\fR")


def italic(*parts: str) -> Roff:
    return Roff(f"\\fI{join(*parts)}\\fR")


def _guard(line: str) -> str:
    """A text line as written: one that starts with a control character would be read as a request, and a word
    with a minus in it (an option, a scenario, a key) gets \\% in front, so groff does not hyphenate it."""
    line = re.sub(r"(?<!\S)(?=\S*\\-)", r"\\%", line)
    return "\\&" + line if line.startswith((".", "'")) else line


def _quoted(arg: str) -> str:
    """One argument of a request, in double quotes (a quote inside is \\(dq)."""
    return '"' + join(arg).replace('"', "\\(dq") + '"'


def _text_lines(text: Roff) -> list[str]:
    """Filled text: each source line stripped (leading spaces would break the line), none blank."""
    return [_guard(line.strip()) for line in text.splitlines() if line.strip()]


class ManPage:
    """The lines of one page, in order; text() is the file."""

    def __init__(self, name: str, section: str, date: str, source: str, manual: str):
        self.lines = [f".TH {_quoted(name.upper())} {section} {_quoted(date)} {_quoted(source)} {_quoted(manual)}"]

    def section(self, title: str) -> None:
        self.lines.append(f".SH {_quoted(title.upper())}")

    def subsection(self, title: str) -> None:
        self.lines.append(f".SS {_quoted(title)}")

    def synopsis(self, command: str, *arguments: str) -> None:
        """One usage (.SY/.YS): the command in bold, its arguments wrapping under the first, not under it."""
        self.lines += [f".SY {_quoted(command)}", *_text_lines(join(*arguments)), ".YS"]

    def paragraph(self, *parts: str) -> None:
        """One or more paragraphs: a blank line in the text starts the next."""
        for chunk in join(*parts).split("\n\n"):
            lines = _text_lines(Roff(chunk))
            if lines:
                self.lines += [*self._new_paragraph(), *lines]

    def _new_paragraph(self) -> list[str]:
        """.PP, but not straight after a heading, which starts a paragraph already (mandoc -T lint warns)."""
        return [] if self.lines[-1].startswith((".SH", ".SS")) else [".PP"]

    def tagged(self, tag: str | Roff, *body: str) -> None:
        """A .TP item: the tag on its own line, the body indented under it."""
        self.lines += [".TP", _guard(join(tag))]
        chunks = [c for c in join(*body).split("\n\n") if c.strip()]
        for i, chunk in enumerate(chunks):
            if i:
                self.lines.append(".IP")  # the next paragraph of the same item, still indented
            self.lines += _text_lines(Roff(chunk))

    def code(self, text: str) -> None:
        """A block printed as written (no fill, no adjust), indented, in the fixed-width sense of man(7)."""
        self.lines += [*self._new_paragraph(), ".RS 4", ".nf"]
        for line in text.rstrip("\n").splitlines():
            escaped = join(line).replace("'", "\\(aq")  # a straight quote, not a typographic one
            self.lines.append(_guard(escaped) if escaped.strip() else "\\&")
        self.lines += [".fi", ".RE"]

    def raw(self, *lines: str) -> None:
        """Requests or text already in roff, added as they are."""
        self.lines += lines

    def text(self) -> str:
        return "\n".join(self.lines) + "\n"


def release(root: Path) -> tuple[str, str]:
    """The .TH source and date of every page: the newest entry of the Debian changelog, the release the pages
    ship in (a date taken from the clock would make each generation differ)."""
    head = (root / "packaging" / "debian" / "changelog").read_text().splitlines()
    version = re.match(r"\S+ \(([^)-]+)", head[0]).group(1)
    signed = next(line for line in head if line.startswith(" -- "))
    date = email.utils.parsedate_to_datetime(signed.split(">", 1)[1].strip())
    return f"gpuwarden {version}", date.strftime("%Y-%m-%d")
