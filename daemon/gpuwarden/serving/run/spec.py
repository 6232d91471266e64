"""What a supervised child is, apart from how it is run: its argv and environment, who it runs as, where it
listens and answers /health, its timeouts and backoff, and the GPUs it holds.

As supervisor's process.py keeps a program's configuration (its `ProcessConfig`) apart from the process's
runtime state, a ChildSpec is only data: the engine builds one (engine_spec), the proxy builds one
(proxy/child.py), and `Program` runs any of them. A new kind of child (a multi-node worker, a Ray head) is
one more function that returns a ChildSpec.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from ...config import ServeConfig
from ...gpu.base import Gpu
from ..compose.command import ServeCommand
from ..compose.identity import Identity


@dataclass(frozen=True)
class Timing:
    """How a child is started, watched, stopped and restarted (serve.*'s supervision keys)."""

    startup_timeout_s: float
    stop_timeout_s: float
    liveness_interval_s: float
    liveness_failures: int
    stable_after_s: float  # a run this long resets the backoff
    backoff_max_s: float
    crash_loop_failures: int  # this many failures within crash_loop_window_s: FATAL
    crash_loop_window_s: float

    @classmethod
    def of(cls, serve: ServeConfig, **changes: float) -> Timing:
        values = {name: getattr(serve, name) for name in cls.__dataclass_fields__}
        return cls(**{**values, **changes})


@dataclass(frozen=True)
class ChildSpec:
    name: str  # its name among the supervisor's programs, and the `child` label
    title: str  # in messages: "vLLM", "the proxy"
    argv: tuple[str, ...]
    env: Mapping[str, str]
    identity: Identity
    host: str  # where it listens; the port must be free before a start, and its group must own it
    port: int
    health_path: str
    timing: Timing
    log_level: Callable[[str], int | None]  # the level of a line of its output; None: a continuation
    gpus: tuple[Gpu, ...] = ()  # held while it runs: a start waits until they are free
    memory_flag: str = ""  # what sets the share of each GPU's memory it takes (in messages)
    memory_fraction: float = 0.0
    model: str = ""  # what it serves, for the view (empty: no model, e.g. the proxy)
    profile: str = ""  # the profile it was composed from, for the view and its start line
    version: str = ""  # the engine's installed version where it is known (a fleet compares it across hosts)

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"


def engine_spec(serve: ServeConfig, command: ServeCommand, identity: Identity, gpus: Sequence[Gpu],
                version: str | None = None) -> ChildSpec:
    """The serving engine's child: the composed command, on its GPUs, with serve.*'s timing."""
    engine = command.engine
    return ChildSpec(engine.name, engine.title, command.argv, dict(command.env), identity, serve.host, serve.port,
                     engine.health_path, Timing.of(serve), engine.log_level, tuple(gpus), engine.memory_flag,
                     command.memory_fraction, serve.model, command.profile.name, version or "")
