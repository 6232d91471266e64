"""`check --deep`: run the engine's own argument parser, inside its interpreter, on our final flags.

The probe is the engine's (Engine.flag_probe). It runs as a subprocess because
the engine is not (and should not be) importable from gpuwarden's own
interpreter, and as serve.user, because it imports code from the engine's install.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from ...base import smallfile
from ...config import ServeConfig
from .command import ServeCommand
from .engines import FLAGCHECK_MARK
from .identity import Identity, popen, run_bounded

MARK = FLAGCHECK_MARK
TIMEOUT_S = 600.0  # the engine's import, on a busy host: a minute and more; then the check is killed, its group whole
ERROR_MAX = 1000  # characters of the parser's reason kept: it reaches a log line, and serve.user's code wrote it


@dataclass(frozen=True)
class FlagCheck:
    ok: bool
    error: str | None
    version: str | None  # the engine's, as it reports it
    python: str


SHEBANG_MAX = 4096  # of the engine script's first line


def engine_python(serve: ServeConfig, command: Sequence[str]) -> str | None:
    """The engine's interpreter: serve.python, the command itself if it is Python, or the script's #! line."""
    if serve.python:
        return serve.python
    first = shutil.which(command[0]) or command[0]
    if re.match(r"python[0-9.]*$", Path(first).name):
        return first
    # The script is serve.user's (its venv): read as root, never waiting (a FIFO), a regular file only (a link
    # to /dev/zero), the first line within a cap (the kernel's own for #! is 256 bytes).
    try:
        head = smallfile.read(first, SHEBANG_MAX, follow=True, head=True) or b""
    except smallfile.Unreadable:
        return None
    line = head.split(b"\n", 1)[0].decode("utf-8", "replace")
    if line.startswith("#!"):
        parts = line[2:].split()
        if parts and Path(parts[0]).name == "env" and len(parts) > 1:
            return shutil.which(parts[1])
        return parts[0] if parts else None
    return None


def check_flags(serve: ServeConfig, command: ServeCommand, identity: Identity, timeout_s: float = TIMEOUT_S,
                spawn: Callable[..., subprocess.Popen] = popen) -> FlagCheck:
    """Run the engine's parser on the command's flags, started exactly as the child is (identity.popen:
    serve.user, no capabilities, no_new_privs, the child's environment; spawn: popen's stand-in, the daemon's
    ProcessOps.helper from a worker thread), within timeout_s and run_bounded's bounds on its output."""
    engine, prefix = command.engine, command.argv[:command.prefix]
    title, env = engine.title, command.env
    python = engine_python(serve, prefix)
    if python is None:
        return FlagCheck(False, f"cannot find {title}'s Python from the command {list(prefix)} "
                                "(set serve.python)", None, "")
    try:
        done = run_bounded(identity, [python, "-c", engine.flag_probe, json.dumps(command.flags)], env, timeout_s,
                           spawn)
    except FileNotFoundError:
        return FlagCheck(False, f"{title}'s Python {python} does not exist (set serve.python)", None, python)
    except (OSError, ValueError, subprocess.SubprocessError) as exc:
        return FlagCheck(False, f"{title}'s flag check could not start {python}: {exc}", None, python)
    if done.stopped is not None:
        return FlagCheck(False, f"{title}'s flag check stopped: {done.stopped}", None, python)
    if done.returncode is None:
        return FlagCheck(False, f"{title}'s flag check did not finish within {timeout_s:g} s", None, python)
    out, err = done.stdout, done.stderr
    result = _answer(out)
    if result is None:
        last = (err.strip().splitlines() or ["no output"])[-1]
        return FlagCheck(False, f"{title}'s flag check failed to run: {_cut(last)}", None, python)
    ok, error = result.get("ok") is True, result.get("error")
    if not ok and not isinstance(error, str):
        error = next((line.split("error: ", 1)[1] for line in reversed(err.splitlines())
                      if "error: " in line), f"{title}'s parser rejected the arguments")
    version = result.get("version")
    return FlagCheck(ok, _cut(error) if isinstance(error, str) else None,
                     _cut(version, 64) if isinstance(version, str) else None, python)


def _answer(out: str) -> dict | None:
    """The probe's answer: its first line that starts with the mark and holds a JSON object; None where none does
    (serve.user's interpreter printed something else, or a forged line)."""
    for line in out.splitlines():
        if line.startswith(MARK):
            try:
                found = json.loads(line[len(MARK):])
            except ValueError:
                continue
            if isinstance(found, dict):
                return found
    return None


def _cut(text: str, limit: int = ERROR_MAX) -> str:
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text) - limit} more characters)"
