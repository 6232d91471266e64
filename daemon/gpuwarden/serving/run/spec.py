"""What a supervised child is, apart from how it is run: its argv and environment, who it runs as, where it
listens and answers /health, its timeouts and backoff, and the GPUs it holds.

As supervisor's process.py keeps a program's configuration (its `ProcessConfig`) apart from the process's
runtime state, a ChildSpec is only data: the engine builds one (engine_spec), the proxy builds one
(proxy/child.py), and `Program` runs any of them. A new kind of child is one more function that returns a
ChildSpec, and one entry in the registry of kinds (serving/run/kinds.py).
"""

from __future__ import annotations

import dataclasses
import logging
import signal
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from ...base import unixsock
from ...config import ServeConfig
from ...gpu.base import Gpu
from ..compose.command import ServeCommand
from ..compose.drain import DRAIN_MARGIN_S
from ..compose.enginesock import engine_socket
from ..compose.flagcheck import engine_python
from ..compose.identity import Identity
from .policy import Policy
from .ranks import RankWatch


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


# What a child in front of the engine (ChildSpec.fronts_engine: the proxy) is sent, as a signal to its process: the
# engine begins a planned stop (it drains: its /health still answers, and vLLM answers 500 to new requests), and an
# engine is healthy. Sent only to a front that is RUNNING and handles it (serving/run/supervisor.py).
STOPPING_SIGNAL, UP_SIGNAL = signal.SIGUSR1, signal.SIGUSR2
# ... and that the engine is down and not restarted until someone acts (FATAL: SIGHUP; HELD: its GPU's action): the
# proxy answers new and held requests 503 with Retry-After at once, and sends nothing, until told an engine is healthy.
DOWN_SIGNAL = signal.SIGRTMIN
# ... and that the engine rests (serve.idle: stopped while no request comes): the proxy holds every new request,
# however long the rest, and says on its word pipe that one came (word.WAKE), which starts the engine again.
REST_SIGNAL = signal.SIGRTMIN + 1
# A front answers STOPPING_SIGNAL on its word pipe (serving/run/word.py), not in its output.


@dataclass(frozen=True)
class ChildSpec:
    name: str  # its name among the supervisor's programs, and the `child` label
    title: str  # in messages: "vLLM", "the proxy"
    argv: tuple[str, ...]
    env: Mapping[str, str]
    identity: Identity
    host: str  # where it listens; the port must be free before a start, and its group must own it
    port: int  # 0: it listens nowhere (a headless node of a multi-node engine)
    health_path: str  # "": no HTTP health; its liveness is that peer answers
    timing: Timing
    log_level: Callable[[str], int | None]  # the level of a line of its output; None: a continuation
    gpus: tuple[Gpu, ...] = ()  # held while it runs: a start waits until they are free
    memory_flag: str = ""  # what sets the share of each GPU's memory it takes (in messages)
    memory_fraction: float = 0.0
    model: str = ""  # what it serves, for the view (empty: no model, e.g. the proxy)
    profile: str = ""  # the profile it was composed from, for the view and its start line
    version: str = ""  # the engine's installed version where it is known (a fleet compares it across hosts)
    # A node of a multi-node engine that serves no API: the head's rendezvous (host, port). A start waits until it
    # accepts a connection ("waiting for rank 0", no failure counted), and while running, its answer is the
    # liveness probe: a head that went away ends this part, which waits for the head again.
    peer: tuple[str, int] | None = None
    role: str = ""  # "head" or "worker" in a multi-node engine, "" on one host
    rank: int | None = None
    nodes: int = 1  # how many nodes the engine spans
    head: str = ""  # the head's rendezvous HOST:PORT: what names the engine across the nodes' metrics
    rendezvous: int = 0  # the rendezvous port whose connections (one per rank) are watched while it runs
    hosts: tuple[str, ...] = ()  # every node's address by rank, where known: names a rank that was lost
    # What its kind plugs into the Program that runs it (serving/run/policy.py), given that Program; None: nothing.
    # A part of a multi-node engine plugs in the rank watch (serving/run/ranks.py).
    policy: Callable[[object], Policy] | None = None
    # An engine's drain: how long a planned stop's SIGTERM lets its requests in flight finish (0: they are aborted),
    # said and counted at each stop (serving/run/supervisor.py); None: a child without requests (the proxy, Ray).
    drain_s: float | None = None
    # A child in front of the engine (the proxy): a whole stop stops it once the engine has stopped, so that the
    # engine's drain reaches clients through it; while it runs, it is told of the engine's planned stops
    # (STOPPING_SIGNAL: hold new requests, the engine drains) and of each engine that is healthy (UP_SIGNAL).
    fronts_engine: bool = False
    # The name of a listener the daemon binds and keeps (base/keptlistener.py: the proxy's), passed to each child
    # as an inherited fd (its number in the environment, keptlistener.CHILD_ENV): the port is never free between two
    # children. "": it binds its own.
    listener: str = ""
    # The Unix socket it listens on instead of host:port (the engine behind the proxy: serving/compose/enginesock.py;
    # port is then 0, and nothing listens on TCP); "": none.
    socket: str = ""
    # The engine behind the proxy: each start waits while its flags give vLLM an API key (--api-key, or its --config
    # file, which vLLM reads again at each start and an edit may change without a reload): the proxy asks the key
    # of the engine's environment alone (serving/compose/apikey.flags_key_problem).
    keyless_flags: bool = False
    # Who the process runs as where that is not identity (the container engine's shim: root without capabilities,
    # serving/compose/identity.shim_identity); identity is then the user its port and sockets belong to (the engine
    # inside the container runs as serve.user). None: identity.
    launcher: Identity | None = None

    @property
    def runs_as(self) -> Identity:
        return self.launcher or self.identity

    @property
    def url(self) -> str:
        if self.socket:
            return unixsock.url(self.socket)
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    @property
    def listens(self) -> bool:
        """Whether it serves HTTP anywhere (a headless node of a multi-node engine does not)."""
        return bool(self.port or self.socket)

    @property
    def where(self) -> str:
        """Where it listens, in messages: unix:PATH or port P on HOST."""
        return f"unix:{self.socket}" if self.socket else f"port {self.port} on {self.host}"


def engine_spec(serve: ServeConfig, command: ServeCommand, identity: Identity, gpus: Sequence[Gpu],
                version: str | None = None) -> ChildSpec:
    """The serving engine's child: the composed command, on its GPUs, with serve.*'s timing. On a node past
    the head of a multi-node engine it serves no API: it listens nowhere, and its health is the head's."""
    engine, role = command.engine, command.role
    title, port, health, peer = engine.title, serve.port, engine.health_path, None
    socket = engine_socket(serve, engine) if role is None else None
    port = 0 if socket else port
    drain = command.drain.seconds
    if role is not None:
        title = f"{engine.title} rank {role.rank} of {role.nodes.count}"
        if not role.head:
            port, health, peer = 0, "", (role.nodes.head, role.nodes.port)
    return ChildSpec(engine.name, title, command.argv, dict(command.env), identity, serve.host, port,
                     health, _timing(serve, drain), engine.log_level, tuple(gpus), engine.memory_flag,
                     command.memory_fraction, serve.model, command.profile.name, version or "", peer,
                     role.name if role else "", role.rank if role else None, role.nodes.count if role else 1,
                     role.nodes.address if role else "", role.nodes.port if role and role.nodes.backend == "mp" else 0,
                     role.nodes.hosts if role else (), RankWatch if role else None, drain, socket=socket or "")


def _timing(serve: ServeConfig, drain: float) -> Timing:
    """SIGKILL waits for the drain and the engine's teardown after it, and never comes before serve.stop_timeout_s."""
    return Timing.of(serve, stop_timeout_s=max(serve.stop_timeout_s, drain + DRAIN_MARGIN_S if drain else 0))


def other_drain(spec: ChildSpec, command: ServeCommand, serve: ServeConfig) -> ChildSpec | None:
    """The engine's spec as the other answer about its drain flag makes it: told to drain (the flag last, as compose
    adds it) where this one is not because its version is unknown here (an adopting start reads the installed
    versions from the cache only, which a pip install under the engine made stale), or not told where this one is
    (an engine a gpuwarden without drains started). None: no flag gpuwarden adds, or drain_s 0."""
    flag, added = command.engine.drain_flag, command.drain.args
    if flag is None or not serve.drain_s or (command.drain.seconds and not added):  # none, or the user's own
        return None
    if added:
        return dataclasses.replace(spec, argv=spec.argv[:-len(added)], drain_s=0, timing=_timing(serve, 0))
    return dataclasses.replace(spec, argv=(*spec.argv, flag, str(serve.drain_s)), drain_s=serve.drain_s,
                               timing=_timing(serve, serve.drain_s))


def ray_spec(serve: ServeConfig, command: ServeCommand, identity: Identity) -> ChildSpec:
    """This node's Ray node as a child, `ray start --block` from the engine's own environment (the `ray`
    beside its Python): the head's (its GCS on serve.nodes.port; health: that port accepts) or a worker's
    joining it (it waits for the head's GCS, and its liveness is the head answering, as a headless vLLM
    part's). Flags as in ray/scripts/scripts.py of ray 2.60 (--head, --port, --address, --node-ip-address,
    --block, --disable-usage-stats, --include-dashboard)."""
    role = command.role
    nodes = role.nodes
    python = engine_python(serve, command.argv[:command.prefix]) or "python3"
    ray = str(Path(python).parent / "ray")
    own = ("--node-ip-address", role.address) if role.address else ()
    if role.head:
        argv = (ray, "start", "--head", "--port", str(nodes.port), *own, "--include-dashboard", "false",
                "--disable-usage-stats", "--block")
        title, port, peer = "Ray head", nodes.port, None
    else:
        argv = (ray, "start", "--address", nodes.address, *own, "--disable-usage-stats", "--block")
        title, port, peer = f"Ray rank {role.rank} of {nodes.count}", 0, (nodes.head, nodes.port)
    return ChildSpec("ray", title, argv, dict(command.env), identity, nodes.head, port, "", Timing.of(serve),
                     _ray_level, peer=peer, role=role.name, rank=role.rank, nodes=nodes.count, head=nodes.address,
                     hosts=nodes.hosts, policy=RankWatch)


def _ray_level(line: str) -> int | None:
    """Ray's CLI prints plain lines; its errors say so."""
    return logging.ERROR if "Error" in line or "error:" in line else logging.INFO
