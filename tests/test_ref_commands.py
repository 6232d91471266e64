"""The commands reference (docs/reference/commands.md) and gpuwarden(8) (packaging/man/gpuwarden.8): committed as
docs/gen/commands_ref.py writes them, with an entry for every command and flag the parser has, and a man page
groff renders without a warning."""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "docs" / "gen"))

import commands_ref  # noqa: E402
from gpuwarden.cli.registry import build_parser, find_commands  # noqa: E402

PAGE = ROOT / commands_ref.PAGE
MAN = ROOT / commands_ref.MAN
REGENERATE = "run python3 docs/gen/commands_ref.py and commit what it writes"


def test_committed_pages_are_what_the_generator_writes():
    ref = commands_ref.Reference.read()
    assert PAGE.read_text() == commands_ref.markdown(ref), f"{PAGE.relative_to(ROOT)} is stale: {REGENERATE}"
    assert MAN.read_text() == commands_ref.man_page(ref, ROOT), f"{MAN.relative_to(ROOT)} is stale: {REGENERATE}"


def parser_walk() -> dict[str, list[str]]:
    """Every command and the names of its flags, read from argparse itself (not through the generator)."""
    parser = build_parser(find_commands())
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return {name: [n for a in p._actions if not isinstance(a, argparse._HelpAction)
                   for n in (a.option_strings or [a.dest])]
            for name, p in sub.choices.items()}


def split_sections(text: str, heading: str) -> dict[str, str]:
    """The text under each heading (a line matching heading, its name the group), by name."""
    parts = re.split(heading, text, flags=re.M)
    return {parts[i].strip('"'): parts[i + 1] for i in range(1, len(parts) - 1, 2)}


def man_section(man: str, title: str) -> str:
    return man.split(f'.SH "{title}"\n')[1].split("\n.SH ")[0]


def test_every_command_and_flag_has_an_entry():
    walked = parser_walk()
    assert {"check", "plan", "apply", "run", "status", "profiles", "cleanup", "doctor", "bench", "tune",
            "proxy"} <= set(walked)
    page = split_sections(PAGE.read_text(), r"^## (\S+).*$")  # and "Options" (of every command)
    man = MAN.read_text().replace("\\%", "").replace("\\-", "-")  # \% only keeps groff from hyphenating a word
    man_commands = split_sections(man_section(man, "COMMANDS"), r"^\.SS (\S+)$")
    man_options, man_exits = man_section(man, "OPTIONS"), man_section(man, "EXIT STATUS")
    missing = []
    for command, flags in walked.items():
        if command not in page or command not in man_commands:
            missing.append(f"{command}: no section ({REGENERATE})")
            continue
        for flag in flags:
            if f"`{flag}`" not in page[command] and f"`{flag}`" not in page["Options"]:
                missing.append(f"{command} {flag}: not in {PAGE.relative_to(ROOT)}")
            roff = "\\fB" + flag + "\\fR"  # the man page's \- read as - above
            if roff not in man_commands[command] and roff not in man_options:
                missing.append(f"{command} {flag}: not in {MAN.relative_to(ROOT)}")
        if f"\\fB{command}\\fR" not in man_exits:
            missing.append(f"{command}: no exit statuses in {MAN.relative_to(ROOT)}")
    assert not missing, "\n".join(missing)


def test_every_command_declares_its_exit_statuses():
    for command in find_commands().values():
        statuses = [status for status, _ in command.exits]
        assert 0 in statuses and len(set(statuses)) == len(statuses), (command.name, command.exits)
        assert all(meaning.strip() for _, meaning in command.exits), command.name


@pytest.mark.process
@pytest.mark.parametrize("device", ["utf8", "ascii"])
def test_groff_renders_the_man_page_without_warnings(device):
    if shutil.which("groff") is None:
        if os.environ.get("CI") == "true" or os.geteuid() == 0:
            pytest.fail("groff is missing: tests/run installs groff-base")
        pytest.skip("groff is missing (Debian: groff-base)")
    proc = subprocess.run(["groff", "-man", f"-T{device}", "-ww", str(MAN)], capture_output=True, text=True,
                          env={**os.environ, "LC_ALL": "C.UTF-8"})
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    text = re.sub(r".\x08", "", proc.stdout)  # the overstrikes that make bold and underline
    assert text.startswith("GPUWARDEN(8)")
    for command in ("tune", "doctor", "bench", "proxy", "cleanup"):
        assert re.search(rf"^ +{command}$", text, re.M), f"no {command} section in the rendered page"
        assert f"gpuwarden {command}" in text
    assert "gpuwarden.yaml(5)" in text
