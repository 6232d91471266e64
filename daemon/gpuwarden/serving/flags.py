"""Reading flags out of an argv as argparse would: `--x v` or `--x=v`, the last one winning."""

from __future__ import annotations

from collections.abc import Sequence


def flag_value(argv: Sequence[str], *names: str) -> str | None:
    """The last value given for any of names, or None."""
    found = None
    for i, arg in enumerate(argv):
        for name in names:
            if arg == name and i + 1 < len(argv):
                found = argv[i + 1]
            elif arg.startswith(name + "="):
                found = arg.split("=", 1)[1]
    return found


def has_flag(argv: Sequence[str], *names: str) -> bool:
    return any(arg in names or any(arg.startswith(n + "=") for n in names) for arg in argv)
