"""The commands: each module in cli/ that declares a COMMAND is one; this finds them and builds the parser.

A new command is one file in cli/: its name, help, arguments and the function that runs it, in one Command.
Nothing here names a command.
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass

from .. import __version__
from .. import config as configmod
from .common import add_common

DESCRIPTION = """\
gpuwarden keeps NVIDIA inference GPUs tuned: at start it turns on persistence
mode and locks GPU/memory clocks (and optionally a power limit) through NVML,
checking every value against what the card supports, then watches the GPUs.

Exit status: 0 ok, 1 a tuning step failed, 3 no daemon running (status),
69 NVML unavailable, 77 permission denied (needs root or CAP_SYS_ADMIN),
78 configuration error."""


def no_arguments(parser: argparse.ArgumentParser) -> None:
    """For a command that takes only the common options (--config, --sim)."""


@dataclass(frozen=True)
class Command:
    name: str
    help: str  # its line in `gpuwarden --help`
    run: Callable[[argparse.Namespace], int]  # the exit status
    arguments: Callable[[argparse.ArgumentParser], None] = no_arguments
    description: str | None = None  # the text of `gpuwarden NAME --help`, printed as written
    order: int = 1000  # its place in `gpuwarden --help`, lowest first (then by name)
    keeps_held_signals: bool = False  # only the daemon's loop takes the signals held since start (earlysignals.py)
    # Every status it can end with and what each means, for the man page and docs/reference/commands.md (not --help).
    # Include what main() turns an exception into (base/exits.py's EX_*) where this command can raise it.
    exits: tuple[tuple[int, str], ...] = ((0, "done"),)


def find_commands() -> dict[str, Command]:
    """Every COMMAND of a module in this package, by name, in the order `--help` lists them."""
    found = []
    package = importlib.import_module(__package__)
    for module in pkgutil.iter_modules(package.__path__):
        command = getattr(importlib.import_module(f"{__package__}.{module.name}"), "COMMAND", None)
        if isinstance(command, Command):
            found.append(command)
    return {c.name: c for c in sorted(found, key=lambda c: (c.order, c.name))}


def build_parser(commands: dict[str, Command] | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gpuwarden", description=DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"gpuwarden {__version__}")
    # --config and --sim work before or after the command name.
    add_common(parser, default_config=configmod.DEFAULT_PATH, default_sim=None)
    common = argparse.ArgumentParser(add_help=False)
    add_common(common, default_config=argparse.SUPPRESS, default_sim=argparse.SUPPRESS)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in (find_commands() if commands is None else commands).values():
        p = sub.add_parser(command.name, parents=[common], help=command.help, description=command.description,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        command.arguments(p)
    return parser
