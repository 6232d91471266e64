"""The commands reference, docs/reference/commands.md, and the man page gpuwarden(8), packaging/man/gpuwarden.8:
both from the parser the CLI registry builds (daemon/gpuwarden/cli/), so neither can drift from --help.

    python3 docs/gen/commands_ref.py     # rewrite both; tests/test_ref_commands.py fails while they differ

Each command's name, help and description, each flag's names, argument, default, choices and help come from
argparse; the exit statuses from each Command's exits. Only FILES and SEE ALSO are written here.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT / "daemon") not in sys.path:
    sys.path.insert(0, str(ROOT / "daemon"))

from gpuwarden import config as configmod  # noqa: E402
from gpuwarden.base import statedir  # noqa: E402
from gpuwarden.cli.registry import Command, build_parser, find_commands  # noqa: E402
from gpuwarden.tune.channel import socket_path  # noqa: E402
from roff import ManPage, Roff, bold, italic, join, release  # noqa: E402

PAGE = Path("docs/reference/commands.md")
MAN = Path("packaging/man/gpuwarden.8")
NAME_LINE = "keep NVIDIA inference GPUs tuned, watched and serving"

# What the package installs that a command reads or writes, for FILES: (path, what it is).
FILES = (
    (str(configmod.DEFAULT_PATH), "The configuration; conf.d/*.yaml beside it is merged in, in lexical order, and "
                                  "profiles.d/*.yaml overrides the built-in serving profiles by name. "
                                  "See gpuwarden.yaml(5)."),
    (str(statedir.DEFAULT), "The state: the settings found before tuning (restored on stop), bench's saved runs, "
                            "the serving children handed over across an upgrade."),
    (str(socket_path({})), "The running daemon's root-only control socket, through which tune sets each step."),
    ("/usr/share/gpuwarden/prometheus/gpuwarden-rules.yml", "Prometheus alerting and recording rules."),
    ("/usr/share/gpuwarden/grafana/", "Grafana dashboards: one host, and the fleet."),
)
SEE_ALSO = (("gpuwarden.yaml", "5"), ("systemctl", "1"), ("journalctl", "1"), ("nvidia-smi", "1"))


@dataclass(frozen=True)
class Flag:
    names: tuple[str, ...]  # its option strings, or a positional's name
    argument: str  # what follows it, as --help writes it ("" for a switch)
    default: str  # "" where none is worth saying (None, False, not given)
    choices: tuple[str, ...]
    help: str
    positional: bool
    repeatable: bool


def flag_of(action: argparse.Action, formatter: argparse.HelpFormatter) -> Flag:
    positional = not action.option_strings
    if positional:
        argument = formatter._format_args(action, formatter._get_default_metavar_for_positional(action))
    else:
        argument = formatter._format_args(action, formatter._get_default_metavar_for_optional(action))
    default = action.default
    shown = "" if default in (None, False, argparse.SUPPRESS) or action.nargs == 0 else str(default)
    return Flag(names=tuple(action.option_strings) or (action.dest,), argument=argument, default=shown,
                choices=tuple(str(c) for c in action.choices or ()), help=formatter._expand_help(action) if action.help else "",
                positional=positional, repeatable=isinstance(action, argparse._AppendAction))


def flags(parser: argparse.ArgumentParser, leave_out: set[str] = frozenset()) -> list[Flag]:
    """Its options and arguments in --help's order, less -h and those named in leave_out."""
    formatter = parser._get_formatter()
    return [flag_of(a, formatter) for a in parser._actions
            if not isinstance(a, (argparse._HelpAction, argparse._SubParsersAction))
            and not set(a.option_strings) & leave_out]


def command_parsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(sub.choices)


def synopsis(flag: Flag) -> list[tuple[str, bool]]:
    """The flag as usage writes it, in pieces: (text, is it to be typed as written)."""
    if flag.positional:
        optional = flag.argument.startswith("[")
        return [("[" if optional else "", True), (flag.argument.strip("[]"), False), ("]" if optional else "", True)]
    name = max(flag.names, key=len)
    return [("[", True), (name, True), *([(" ", True), (flag.argument, False)] if flag.argument else []),
            ("]", True)]


def paragraphs(text: str | None) -> list[str]:
    """A RawDescription text's paragraphs, each on one line."""
    return [" ".join(p.split()) for p in (text or "").split("\n\n") if p.strip()]


@dataclass(frozen=True)
class Reference:
    """What both pages say, read once from the parser."""

    description: list[str]  # the top level's paragraphs, less its exit status (the commands' own say it)
    options: list[Flag]  # of every command, before or after its name
    commands: list[tuple[Command, argparse.ArgumentParser, list[Flag]]]  # and each one's own flags

    @classmethod
    def read(cls) -> Reference:
        commands = find_commands()
        parser = build_parser(commands)
        options = flags(parser)
        common = {name for f in options for name in f.names}
        subs = command_parsers(parser)
        return cls(description=[p for p in paragraphs(parser.description) if not p.startswith("Exit status")],
                   options=options,
                   commands=[(c, subs[c.name], flags(subs[c.name], common)) for c in commands.values()])


# -- Markdown ---------------------------------------------------------------------------------------------------

def md(text: str, in_table: bool = False) -> str:
    """Plain text for Markdown: what would be emphasis or HTML escaped; `code spans` kept as they are."""
    pieces = text.split("`")
    for i in range(0, len(pieces), 2):  # the even pieces are outside code spans
        for ch in "\\*_<[":
            pieces[i] = pieces[i].replace(ch, "\\" + ch)
    out = "`".join(pieces)
    return out.replace("|", "\\|") if in_table else out


def code(text: str) -> str:
    return f"`{text}`" if text else ""


def markdown(ref: Reference) -> str:
    out = ["# Commands reference", "",
           "<!-- Generated by docs/gen/commands_ref.py from the CLI's parser; edit daemon/gpuwarden/cli/, "
           "then run python3 docs/gen/commands_ref.py. -->", "",
           "```", "gpuwarden [--config FILE] [--sim SCENARIO] COMMAND [options]", "```", "",
           *[line for p in ref.description for line in (md(p), "")],
           "Every command is below with each of its options and its exit statuses; `gpuwarden COMMAND --help` "
           "prints the same. The man page, gpuwarden(8), is generated from the same parser.", "",
           "| command | what it does |", "| --- | --- |",
           *[f"| [{c.name}](#{c.name}) | {md(c.help, True)} |" for c, _, _ in ref.commands], "",
           "## Options of every command", "",
           "They may come before or after the command's name.", "",
           *flag_table(ref.options)]
    for command, _, own in ref.commands:
        usage = "".join(text for f in own for text, _ in [(" ", True), *synopsis(f)])
        out += [f"## {command.name}", "", md(command.help[:1].upper() + command.help[1:]) + ".", "",
                "```", f"gpuwarden {command.name}{usage}", "```", ""]
        out += [line for p in paragraphs(command.description) for line in (md(p), "")]
        out += flag_table(own) if own else ["It takes only the options of every command.", ""]
        out += ["| exit status | meaning |", "| --- | --- |",
                *[f"| {status} | {md(meaning, True)} |" for status, meaning in command.exits], ""]
    return "\n".join(out).rstrip("\n") + "\n"


def flag_table(flags_: list[Flag]) -> list[str]:
    rows = []
    for f in flags_:
        names = ", ".join(code(n) for n in f.names)
        extra = [f"one of {', '.join(code(c) for c in f.choices)}"] if f.choices else []
        extra += ["repeatable"] if f.repeatable else []
        meaning = md(f.help, True) + (f" ({'; '.join(extra)})" if extra else "")
        rows.append(f"| {names} | {code(f.argument)} | {code(f.default)} | {meaning} |")
    return ["| option | argument | default | meaning |", "| --- | --- | --- | --- |", *rows, ""]


# -- roff --------------------------------------------------------------------------------------------------------

def spans(text: str) -> Roff:
    """Prose with its `code spans` in bold."""
    return join(*[bold(p) if i % 2 else p for i, p in enumerate(text.split("`"))])


def usage_roff(flags_: list[Flag]) -> Roff:
    return join(*[bold(text) if literal and text.strip() and text not in "[]" else
                  (text if literal else italic(text)) for f in flags_ for text, literal in [(" ", True),
                                                                                           *synopsis(f)]])


def flag_tag(f: Flag) -> Roff:
    names = join(*[part for i, n in enumerate(f.names) for part in ((", " if i else ""), bold(n))])
    return join(names, " ", italic(f.argument)) if f.argument and not f.positional else names


def flag_body(f: Flag) -> Roff:
    extra = [join("One of ", *[p for i, c in enumerate(f.choices) for p in ((", " if i else ""), bold(c))], ".")] \
        if f.choices else []
    extra += ["Repeatable."] if f.repeatable else []
    extra += [join("Default: ", bold(f.default), ".")] if f.default and "default" not in f.help else []
    return join(spans(f.help[:1].upper() + f.help[1:]), *[join(" ", e) for e in extra])


def man_page(ref: Reference, root: Path) -> str:
    source, date = release(root)
    page = ManPage("gpuwarden", "8", date, source, "System Administration")
    page.section("name")
    page.raw(Roff("gpuwarden \\- ") + join(NAME_LINE))  # "name \- what": the form whatis and lintian read
    page.section("synopsis")
    page.synopsis("gpuwarden", usage_roff(ref.options), " ", italic("COMMAND"), " [", italic("options"), "]")
    for command, _, own in ref.commands:
        page.synopsis(f"gpuwarden {command.name}", usage_roff(own))
    page.section("description")
    for p in ref.description:
        page.paragraph(spans(p))
    page.paragraph("Each command below also takes the options of every command (OPTIONS), before or after its "
                   "name; ", bold("gpuwarden ", italic("COMMAND"), " --help"), " prints the same text.")
    page.section("commands")
    for command, _, own in ref.commands:
        page.subsection(command.name)
        page.paragraph(spans(command.help[:1].upper() + command.help[1:] + "."))
        for p in paragraphs(command.description):
            if not p.startswith("Exit status"):  # EXIT STATUS says it, from exits
                page.paragraph(spans(p))
        for f in own:
            page.tagged(flag_tag(f), flag_body(f))
    page.section("options")
    for f in ref.options:
        page.tagged(flag_tag(f), flag_body(f))
    page.section("exit status")
    page.paragraph("The statuses follow sysexits.h where one fits: 69 unavailable, 71 an operating-system error, "
                   "77 permission denied, 78 a configuration error (the unit does not restart on it); 130 is an "
                   "interrupt (Ctrl-C).")
    for command, _, _ in ref.commands:
        page.tagged(bold(command.name), join(*[p for i, (status, meaning) in enumerate(command.exits)
                                               for p in (("; " if i else ""), bold(str(status)), " ", meaning)], "."))
    page.section("files")
    for path, what in FILES:
        page.tagged(italic(path), what)
    page.section("see also")
    page.raw(*[f".BR {join(name)} ({section}){',' if i < len(SEE_ALSO) - 1 else ''}"
               for i, (name, section) in enumerate(SEE_ALSO)])
    return page.text()


def write(root: Path = ROOT) -> list[Path]:
    """Rewrite both pages under root; the paths written."""
    ref = Reference.read()
    written = []
    for path, text in ((PAGE, markdown(ref)), (MAN, man_page(ref, root))):
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(text)
        written.append(root / path)
    return written


if __name__ == "__main__":
    for path in write():
        print(f"wrote {path.relative_to(ROOT)}")
