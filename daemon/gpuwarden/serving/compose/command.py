"""The serving child's final argv and environment, built from config, engine and profile."""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ...config import Config, ServeConfig
from ...gpu.base import GpuSample
from ...base.yamlfile import ConfigError
from .drain import Drain
from .engines import Engine, engine_for
from .nodes import Role
from ..lint.rules import Composed
from .profiles import Profile

# What the child inherits from our environment: the locale and the CUDA/NCCL/NVIDIA settings, nothing else
# (not our credentials, our unit's notify socket, our PATH with /root in it, or a secret in the unit's env).
INHERITED_ENV = ("LANG", "LANGUAGE", "TZ")
INHERITED_PREFIXES = ("LC_", "CUDA_", "NCCL_", "NVIDIA_")
CHILD_PATH = "/usr/local/bin:/usr/bin:/bin"  # after the directory of the child's own executable


@dataclass(frozen=True)
class ServeCommand(Composed):
    gpus: tuple[GpuSample, ...]
    engine: Engine
    prefix: int  # how many leading words of argv are the engine's entry point (entry_length of the command)
    role: Role | None = None  # this node's part of a multi-node engine (None: one host)
    drain: Drain = Drain(0)  # how a SIGTERM lets its requests in flight finish (serving/compose/drain.py)

    @property
    def flags(self) -> list[str]:
        """The arguments after the entry point, those in serve.command included: what the engine's own parser
        reads, so what its flag check and the lint see."""
        return list(self.argv[self.prefix:])

    @property
    def memory_fraction(self) -> float:
        return self.engine.memory_fraction(self.argv)


PYTHON_RE = re.compile(r"python[0-9.]*$")
PYTHON_VALUED = ("-W", "-X", "--check-hash-based-pycs")  # the interpreter's options that take the next word


def entry_length(command: Sequence[str]) -> int:
    """How many leading words of a command are the engine's entry point; the words after it are flags the engine
    parses. A Python interpreter: through `-m MODULE`, `-c CODE` or the script, its own options before them
    included (python3 -u -m vllm.entrypoints.openai.api_server), and the subcommands after a script
    (python3 vllm_cli.py serve); any other program: itself and the words up to the first that starts with -
    (vllm serve; /opt/e/bin/serve.py)."""
    if not command:
        return 0
    i = 1
    if PYTHON_RE.match(os.path.basename(command[0])):
        while i < len(command):
            word = command[i]
            if word in ("-m", "-c"):
                return min(i + 2, len(command))
            if word.startswith(("-m", "-c")) or word == "-":
                return i + 1  # -mMODULE, or stdin
            if not word.startswith("-"):
                break  # the script: it and its subcommands, as for any program
            i += 2 if word in PYTHON_VALUED else 1
        else:
            return len(command)
    while i < len(command) and not command[i].startswith("-"):
        i += 1
    return i


def engine_of(config: Config) -> Engine:
    """serve.engine's Engine; ConfigError at serve.engine when this install has none by that name."""
    from .engines import names

    engine = engine_for(config.serve.engine)
    if engine is None:
        raise config.error(("serve", "engine"), f"no serving engine named '{config.serve.engine}'",
                           "one of: " + ", ".join(names()))
    return engine


def chosen_gpus(config: Config, samples: Sequence[GpuSample]) -> list[GpuSample]:
    """serve.gpus resolved to GPUs in PCI order; ConfigError naming the entry that matches none."""
    wanted = config.serve.gpus
    if wanted is None:
        return list(samples)
    chosen = []
    for i, key in enumerate(wanted):
        match = [s for s in samples if key in (str(s.index), s.uuid)]
        if not match:
            raise config.error(("serve", "gpus", str(i)), f"no GPU '{key}' on this host",
                               f"indices 0-{len(samples) - 1} or their UUIDs")
        chosen.extend(m for m in match if m not in chosen)
    return sorted(chosen, key=lambda s: s.index)


def child_env(base_env: Mapping[str, str], program: str) -> dict[str, str]:
    """The allow-listed part of our environment, plus a PATH made for the child."""
    env = {k: v for k, v in base_env.items() if k in INHERITED_ENV or k.startswith(INHERITED_PREFIXES)}
    found = program if "/" in program else shutil.which(program, path=base_env.get("PATH", os.defpath))
    first = os.path.dirname(os.path.abspath(found)) if found else None
    env["PATH"] = ":".join(p for p in (first, CHILD_PATH) if p)
    return env


def build_command(serve: ServeConfig, profile: Profile, gpus: Sequence[GpuSample],
                  base_env: Mapping[str, str] = os.environ, secrets: Mapping[str, str] | None = None,
                  home: Mapping[str, str] | None = None, engine: Engine | None = None,
                  role: Role | None = None) -> ServeCommand:
    """argv and env for the child. env: the allow-list of base_env, a home made for the child when its own
    cannot be written (serving/compose/homes.py), then the profile's, the node role's (the collectives'
    interface: serve.nodes.interface), serve.env, and the secrets (from a root-only
    file or a credential), in that order; HOME, USER and LOGNAME otherwise come at spawn."""
    engine = engine or engine_for(serve.engine)
    command = engine.command(serve)
    argv = engine.argv(serve, profile, role)
    env = child_env(base_env, command[0])
    env.update(home or {})
    env.update(dict(profile.env))
    env.update(role.env() if role is not None else {})
    env.update(dict(serve.env))
    env.update(secrets or {})
    env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"  # so CUDA's indices are ours
    env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g.index) for g in gpus)
    return ServeCommand(argv, env, profile, tuple(gpus), engine, entry_length(command), role)


def profile_error(config: Config, wanted: str, known: Sequence[str]) -> ConfigError:
    return config.error(("serve", "profile"), f"no profile named '{wanted}'",
                        "auto, or one of: " + ", ".join(sorted(known)))
