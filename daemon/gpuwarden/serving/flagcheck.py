"""`check --deep`: run vLLM's own serve-args parser, inside vLLM's interpreter, on our final flags.

vLLM moved the parser between releases, so the probe tries both places. It runs
as a subprocess because vLLM is not (and should not be) importable from
gpuwarden's own interpreter.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from ..config import ServeConfig
from .identity import Identity, popen

MARK = "GPUWARDEN-FLAGCHECK "
PROBE = r"""
import json, sys
out = {"ok": True, "error": None, "vllm_version": None}
try:
    import vllm
    out["vllm_version"] = getattr(vllm, "__version__", None)
    try:
        from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    except ImportError:
        from vllm.entrypoints.openai.cli_args import make_arg_parser, validate_parsed_serve_args
    try:
        from vllm.utils.argparse_utils import FlexibleArgumentParser
    except ImportError:
        from vllm.utils import FlexibleArgumentParser
    parser = make_arg_parser(FlexibleArgumentParser(prog="vllm serve"))
    validate_parsed_serve_args(parser.parse_args(json.loads(sys.argv[1])))
except SystemExit:
    out["ok"] = False  # argparse printed its one-line reason on stderr
except Exception as exc:
    out["ok"], out["error"] = False, f"{type(exc).__name__}: {exc}"
print("GPUWARDEN-FLAGCHECK " + json.dumps(out), flush=True)
"""


@dataclass(frozen=True)
class FlagCheck:
    ok: bool
    error: str | None
    vllm_version: str | None
    python: str


def vllm_python(serve: ServeConfig) -> str | None:
    """vLLM's interpreter: serve.python, the command itself if it is Python, or the script's #! line."""
    if serve.python:
        return serve.python
    first = shutil.which(serve.command[0]) or serve.command[0]
    if re.match(r"python[0-9.]*$", Path(first).name):
        return first
    try:
        with open(first, "rb") as script:
            line = script.readline().decode("utf-8", "replace")
    except OSError:
        return None
    if line.startswith("#!"):
        parts = line[2:].split()
        if parts and Path(parts[0]).name == "env" and len(parts) > 1:
            return shutil.which(parts[1])
        return parts[0] if parts else None
    return None


def check_flags(serve: ServeConfig, flags: list[str], identity: Identity, env: Mapping[str, str],
                timeout_s: float = 600) -> FlagCheck:
    """Run vLLM's parser on flags, started exactly as the child is (identity.popen: serve.user, no
    capabilities, no_new_privs, the child's environment): it imports code from vLLM's install."""
    python = vllm_python(serve)
    if python is None:
        return FlagCheck(False, f"cannot find vLLM's Python from serve.command {list(serve.command)} "
                                "(set serve.python)", None, "")
    try:
        proc = popen(identity, [python, "-c", PROBE, json.dumps(flags)], env, stdout=subprocess.PIPE,
                     stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True, errors="replace")
    except FileNotFoundError:
        return FlagCheck(False, f"vLLM's Python {python} does not exist (set serve.python)", None, python)
    except (OSError, ValueError, subprocess.SubprocessError) as exc:
        return FlagCheck(False, f"vLLM's flag check could not start {python}: {exc}", None, python)
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        return FlagCheck(False, f"vLLM's flag check did not finish within {timeout_s:g} s", None, python)
    result = next((json.loads(line[len(MARK):]) for line in out.splitlines() if line.startswith(MARK)), None)
    if result is None:
        last = (err.strip().splitlines() or ["no output"])[-1]
        return FlagCheck(False, f"vLLM's flag check failed to run: {last}", None, python)
    error = result["error"]
    if not result["ok"] and error is None:
        error = next((line.split("error: ", 1)[1] for line in reversed(err.splitlines())
                      if "error: " in line), "vLLM's parser rejected the arguments")
    return FlagCheck(bool(result["ok"]), error, result["vllm_version"], python)
