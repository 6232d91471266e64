"""`check --deep`: run the engine's own argument parser, inside its interpreter, on our final flags.

The probe is the engine's (Engine.flag_probe). It runs as a subprocess because
the engine is not (and should not be) importable from gpuwarden's own
interpreter, and as serve.user, because it imports code from the engine's install.
An engine from a container image (serve.container) has its parser in the image: the probe runs in a short-lived
container of it (container.in_image), and its answer is kept per image ID and command, so that a restart of the
same image and flags does not pay the engine's import again.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import subprocess
import threading
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
    ran: bool = True  # False: the parser was not asked (no interpreter, no runtime, no answer in time): no verdict


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
                spawn: Callable[..., subprocess.Popen] = popen, cancel: threading.Event | None = None) -> FlagCheck:
    """Run the engine's parser on the command's flags, started exactly as the child is (identity.popen:
    serve.user, no capabilities, no_new_privs, the child's environment; spawn: popen's stand-in, the daemon's
    ProcessOps.helper from a worker thread), within timeout_s and run_bounded's bounds on its output. A container
    engine's: in its image (check_in_image; cancel set: its container is removed and the answer is a timeout's)."""
    if serve.container is not None:
        return check_in_image(serve, command, identity, timeout_s, cancel)
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
    return _judged(title, done.stdout, done.stderr, python)


def _judged(title: str, out: str, err: str, python: str) -> FlagCheck:
    """The probe's output read: its answer, the parser's one-line reason where it refused, or why it did not run."""
    result = _answer(out)
    if result is None:
        last = (err.strip().splitlines() or ["no output"])[-1]
        return FlagCheck(False, f"{title}'s flag check failed to run: {_cut(last)}", None, python, ran=False)
    ok, error = result.get("ok") is True, result.get("error")
    if not ok and not isinstance(error, str):
        error = next((line.split("error: ", 1)[1] for line in reversed(err.splitlines())
                      if "error: " in line), f"{title}'s parser rejected the arguments")
    version = result.get("version")
    return FlagCheck(ok, _cut(error) if isinstance(error, str) else None,
                     _cut(version, 64) if isinstance(version, str) else None, python)


IMAGE_ANSWERS_MAX = 32  # the parser's answers kept per image ID and command (each a few hundred bytes)
_image_answers: dict[str, FlagCheck] = {}  # digest of (image ID, argv, environment, mounts, uid:gid): its answer
_answers_lock = threading.Lock()  # DeepCheck's worker and a start's check may keep answers at once
IMAGE_PYTHON = "python3"  # the image's interpreter where serve.python names none (the installed-versions probe's too)


def image_python(serve: ServeConfig, prefix: Sequence[str]) -> str:
    """The engine's interpreter inside its image: serve.python, the command itself where it is Python, else
    python3 (a script's #! line is in the image, not on this host)."""
    if serve.python:
        return serve.python
    if prefix and re.match(r"python[0-9.]*$", Path(prefix[0]).name):
        return prefix[0]
    return IMAGE_PYTHON


def check_in_image(serve: ServeConfig, command: ServeCommand, identity: Identity, timeout_s: float = TIMEOUT_S,
                   cancel: threading.Event | None = None) -> FlagCheck:
    """The engine's parser on the command's flags in a container of serve.container's image, made from the image's
    ID (container.in_image: serve.user's uid:gid, no network, no capability, no GPU; the parser needs none), with the
    files the engine sees (the mounts and the model's directory, read-only: vLLM's validation opens a chat template
    or a --config file there) and the engine's environment as the container gets it, less its secrets (the parser
    needs none; in the create request, never on a command line). The parser's own word (accepts, or argparse
    refuses) is kept for the image's ID, the command and the mounts: a re-tagged image is asked anew. An exception
    in the engine's code (an import that failed) is answered, not kept. A probe that could not run or did not answer
    is no verdict (ran False). One deadline holds it all: timeout_s for the probe, a minute more for the runtime's
    calls around it."""
    from ...base.containerapi import RuntimeFault  # noqa: PLC0415 (docker-py: only for a container)
    from .container import image_runtime, in_image, inside_env, probe_mounts, within  # noqa: PLC0415
    from .secrets import SECRET_NAME  # noqa: PLC0415

    container, title = serve.container, command.engine.title
    python = image_python(serve, command.argv[:command.prefix])
    where = f"{python} in {container.image}"
    env = {k: v for k, v in inside_env(command.env).items() if not SECRET_NAME.search(k)}
    argv = (python, "-c", command.engine.flag_probe, json.dumps(command.flags))
    mounts = probe_mounts(container, serve.model)

    def no_verdict(why: str) -> FlagCheck:
        return FlagCheck(False, f"{title}'s flag check {why}", None, where, ran=False)

    def ask() -> FlagCheck:
        try:
            with image_runtime(container) as (runtime, image_id):
                key = hashlib.sha256(json.dumps([image_id, argv, sorted(env.items()), [m.text() for m in mounts],
                                                 identity.uid, identity.gid]).encode()).hexdigest()
                with _answers_lock:
                    if key in _image_answers:
                        return _image_answers[key]
                status, out = in_image(runtime, container, identity.uid, identity.gid, argv, env, timeout_s,
                                       cancel=cancel, image_id=image_id, mounts=mounts)
        except RuntimeFault as exc:
            return no_verdict(f"could not run in {container.image}: {exc}")
        if status is None:
            return no_verdict(f"did not finish within {timeout_s:g} s")
        found = _judged(title, out, out, where)
        result = _answer(out)
        if result is not None and (result.get("ok") is True or result.get("error") is None):  # the parser's word
            with _answers_lock:
                while len(_image_answers) >= IMAGE_ANSWERS_MAX:
                    _image_answers.pop(next(iter(_image_answers)))
                _image_answers[key] = found
        return found

    deadline_s = timeout_s + 60
    try:
        done = within(deadline_s, "image-flagcheck", ask)
    except Exception as exc:  # a bug's: no verdict, said, never a check that seems to wait for the runtime
        return no_verdict(f"failed: {type(exc).__name__}: {exc}")
    return done or no_verdict(f"had no answer from {container.runtime} within {deadline_s:g} s")


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
