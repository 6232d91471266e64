"""The vLLM child's final argv and environment, built from config and profile."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ..config import Config, ServeConfig
from ..gpu.base import GpuSample
from ..yamlfile import ConfigError
from .profiles import Profile

# Never inherited by anything we start: they belong to our unit, not to vLLM.
UNIT_ENV = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID", "JOURNAL_STREAM", "LISTEN_FDS", "LISTEN_PID",
            "LISTEN_FDNAMES")
# Not inherited by the vLLM child either: they describe our user, and the child runs as serve.user.
STRIPPED_ENV = UNIT_ENV + ("HOME", "USER", "LOGNAME")
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9  # vLLM's own default


@dataclass(frozen=True)
class ServeCommand:
    argv: tuple[str, ...]
    env: dict[str, str]
    profile: Profile
    gpus: tuple[GpuSample, ...]

    @property
    def flags(self) -> list[str]:
        """The arguments after the command prefix: what vLLM's serve parser reads."""
        return list(self.argv[self.argv.index("--model"):])


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


def build_command(serve: ServeConfig, profile: Profile, gpus: Sequence[GpuSample],
                  base_env: Mapping[str, str] = os.environ) -> ServeCommand:
    # Later flags win in argparse, so the user's args override the profile's.
    argv = (*serve.command, "--model", serve.model, *profile.args, *serve.args,
            "--host", serve.host, "--port", str(serve.port))
    env = {k: v for k, v in base_env.items() if k not in STRIPPED_ENV}
    env.update(dict(profile.env))
    env.update(dict(serve.env))
    env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"  # so CUDA's indices are ours
    env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g.index) for g in gpus)
    return ServeCommand(argv, env, profile, tuple(gpus))


def flag_value(argv: Sequence[str], *names: str) -> str | None:
    """The last value given for any of names (`--x v` or `--x=v`), or None."""
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


def gpu_memory_utilization(argv: Sequence[str]) -> float:
    value = flag_value(argv, "--gpu-memory-utilization")
    try:
        return float(value) if value is not None else DEFAULT_GPU_MEMORY_UTILIZATION
    except ValueError:
        return DEFAULT_GPU_MEMORY_UTILIZATION


def tensor_parallel_size(argv: Sequence[str]) -> int:
    value = flag_value(argv, "--tensor-parallel-size", "-tp")
    return int(value) if value is not None and value.isdigit() else 1


def profile_error(config: Config, wanted: str, known: Sequence[str]) -> ConfigError:
    return config.error(("serve", "profile"), f"no profile named '{wanted}'",
                        "auto, or one of: " + ", ".join(sorted(known)))
