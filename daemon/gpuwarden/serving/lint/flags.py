"""Reading flags out of an argv as the engines' parsers do: `--x v` or `--x=v`, the last one winning, and
`--x_y` the same flag as `--x-y` (vLLM's FlexibleArgumentParser turns underscores into dashes; a spelling an
engine does not take never gets past its own parser, so reading it as the dashed flag costs nothing).

argparse also takes any unique prefix of a long flag (`--api-ke KEY`). Which prefixes are unique depends on
every flag the parser has, which only the engine's own parser knows, so prefixes are read only where taking
too much is safe: for secrets (is_secret_flag, below), a word that could be a prefix is treated as one.
"""

from __future__ import annotations

import re
from collections.abc import Sequence


def canonical(arg: str) -> str:
    """A long flag with dashes for underscores in its name (the value after = untouched); other words as they are."""
    if not arg.startswith("--"):
        return arg
    name, eq, value = arg.partition("=")
    return "--" + name[2:].replace("_", "-") + eq + value


def names_flag(arg: str, name: str, prefix: bool = False) -> bool:
    """Whether the word arg (without any =value, and without a .field: vLLM's `--flag.field v` sets a field of
    that flag) names the flag name; with prefix, also as argparse's abbreviation of it (at least one letter after
    the dashes)."""
    word = canonical(arg).partition("=")[0]
    if word.startswith("--"):
        word = word.partition(".")[0]
    return word == name or (prefix and len(word) > 2 and word.startswith("--") and name.startswith(word))


def flag_value(argv: Sequence[str], *names: str, prefix: bool = False) -> str | None:
    """The last value given for any of names (the first word of it, for a flag that takes several), or None."""
    found = None
    for i, arg in enumerate(argv):
        if not any(names_flag(arg, name, prefix) for name in names):
            continue
        if "=" in arg:
            found = arg.split("=", 1)[1]
        elif i + 1 < len(argv):
            found = argv[i + 1]
    return found


def has_flag(argv: Sequence[str], *names: str, prefix: bool = False) -> bool:
    return any(names_flag(arg, name, prefix) for arg in argv for name in names)


def switch(argv: Sequence[str], name: str) -> bool | None:
    """A boolean flag's last word: True for --name, False for --no-name (argparse's BooleanOptionalAction),
    None when neither is given."""
    negative = "--no-" + name[2:]
    found = None
    for arg in argv:
        word = canonical(arg).partition("=")[0]
        if word in (name, negative):
            found = word == name
    return found


# Secret-looking names and flags: the lint's rules on them, and the redaction of what gpuwarden prints
# (compose/secrets.py), read them the same way.
SECRET_NAME = re.compile(r"KEY|TOKEN|SECRET|PASSW|CREDENTIAL|AUTH", re.I)
SECRET_FLAGS = ("--api-key", "--hf-token", "--ssl-keyfile-password")
NOT_SECRET = ("--ssl-keyfile",)  # a flag of its own (a path), also a prefix of --ssl-keyfile-password


def is_secret(name: str) -> bool:
    return bool(SECRET_NAME.search(name))


def is_secret_flag(arg: str) -> bool:
    """Whether the word arg names a secret flag in any spelling the engines' parsers take: --api_key,
    --api-key=X, or a prefix argparse would complete (--api-ke); serving/lint/flags.py says why prefixes count here."""
    return (arg.startswith("--") and not any(names_flag(arg, flag) for flag in NOT_SECRET)
            and any(names_flag(arg, flag, prefix=True) for flag in SECRET_FLAGS))
