"""The container engine on the supervisor (issue 53; design/container-engine.md): its spec, whose child is the shim
(`gpuwarden container-run`, run as root without capabilities) on the engine's command and environment, and its
policy, which removes the containers an earlier engine of this gpuwarden left."""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
import time
from collections.abc import Mapping

from ...base.background import Background
from ...base.containerapi import Runtime
from ...config import ContainerConfig, Mount
from ..compose.command import CHILD_PATH
from ..compose.container import ENV_PREFIX, LABEL_OWNER, ContainerLaunch, inside_env, launch_of, owned
from ..compose.drain import DRAIN_MARGIN_S
from ..compose.identity import shim_identity
from .policy import Policy
from .spec import ChildSpec

log = logging.getLogger(__name__)


class ContainerPolicy(Policy):
    """The container engine's part in its Program (serving/run/policy.py).

    - The first such policy of this daemon removes, off the loop, the containers labelled as its own (this host,
      this state directory) under another name than its engine's: an earlier config's, which nothing adopts.
    - Before a start whose port is taken, the container of the engine's own name that an earlier shim left (a shim
      SIGKILLed, a daemon that crashed and could not adopt) is removed the same way, and the start waits for that:
      it holds the port (and GPU memory). Where the port is free the shim removes such a container itself.
    A runtime that cannot be asked holds no start: the shim then says why it cannot run. Each removal is a line."""

    swept_others = False  # the daemon's first container policy sweeps the other names, once

    def __init__(self, program) -> None:
        self.program = program
        self.swept = False  # the container of the engine's name was looked for since the last spawn
        self._own = Background(f"container-sweep-{program.spec.name}", time.monotonic)
        self._others = Background(f"container-sweep-others-{program.spec.name}", time.monotonic)
        launch = launch_in(program.spec.argv)
        if launch is not None and not ContainerPolicy.swept_others:
            ContainerPolicy.swept_others = True
            self._others.start(sweep, launch, False)  # the start does not wait for it: none of these is in its way

    def blocks(self, now: float) -> str | None:
        spec = self.program.spec
        for work in (self._others, self._own):
            outcome = work.take()
            if outcome is not None and outcome.error is not None:
                log.warning("%s: the containers an earlier engine left were not looked for: %s", spec.title,
                            outcome.error)
        launch = launch_in(spec.argv)
        # on its socket nothing is in the way: the preflight removes a stale one, the shim the container of its name
        if launch is None or spec.socket or self.program.ops.port_free(spec.host, spec.port):
            return None
        if not self._own.busy:
            if self.swept:
                return None  # swept once for this start: whoever still holds the port is named by the preflight
            self.swept = True
            self._own.start(sweep, launch, True)
        return f"removing the container {launch.name} an earlier engine left (port {spec.port} is taken)"

    def spawned(self) -> None:
        self.swept = False


def sweep(launch: ContainerLaunch, own_name: bool) -> int:
    """Remove the containers labelled as this daemon's: the one of launch's name (own_name), or every other; how
    many. Raises RuntimeFault."""
    runtime = Runtime(launch.runtime, launch.socket)
    owner = dict(launch.labels).get(LABEL_OWNER)
    try:
        removed = 0
        for found in owned(runtime, owner):
            if (found.name == launch.name) != own_name:
                continue
            runtime.remove(found.id)
            log.warning("removed container %s (%s, %s): an earlier engine of this gpuwarden left it", found.id[:12],
                        found.name, found.state)
            removed += 1
        return removed
    finally:
        runtime.close()


SHIM = ("-m", "gpuwarden", "container-run")


def shim_argv(launch: ContainerLaunch) -> tuple[str, ...]:
    """The engine's child for a container engine: this interpreter running the shim on the launch."""
    return (sys.executable, *SHIM, launch.to_json())


def launch_in(argv: tuple[str, ...]) -> ContainerLaunch | None:
    """The launch a shim's argv carries; None: not a shim's."""
    if len(argv) != len(SHIM) + 2 or tuple(argv[1:-1]) != SHIM:
        return None
    try:
        return ContainerLaunch.from_json(argv[-1])
    except (ValueError, TypeError, KeyError):
        return None


SHIM_MARGIN_S = 15.0  # past the runtime's own stop: its API round trips and the removal


def container_spec(spec: ChildSpec, container: ContainerConfig, simulated: bool, port: int,
                   environ: Mapping[str, str] = os.environ) -> ChildSpec:
    """The engine's spec with its command run in a container: the child is the shim, run as root without
    capabilities, on the engine's command and environment (their values in the shim's environment, never its
    argv); the engine's port, or its socket, stays serve.user's. Behind the proxy the engine listens on its Unix
    socket as a process engine does (serving/compose/enginesock.py): the socket's folder (root's and serve.user's
    group's, 0770) is mounted at its own path, and nothing listens on TCP, so no local user reaches the engine past
    the proxy's key. The container is named by serve.port (port), which names the socket too. The runtime's stop
    waits for the drain and its margin before its SIGKILL, and the supervisor's SIGKILL of the shim comes after
    that. On the simulator no GPU is given to the container (there is none)."""
    identity = spec.identity
    stop_s = int(spec.drain_s + DRAIN_MARGIN_S) if spec.drain_s else int(spec.timing.stop_timeout_s)
    gpus = () if simulated else tuple(str(g.index) for g in spec.gpus)
    env = inside_env(spec.env)
    if spec.socket:
        folder = os.path.dirname(spec.socket)
        container = dataclasses.replace(container, mounts=(*container.mounts, Mount(folder, folder, False)))
    launch = launch_of(container, spec.name, port, spec.argv, env, identity.uid, identity.gid,
                       identity.groups, spec.model, gpus, stop_s)
    shim_env = {"PATH": CHILD_PATH, **{ENV_PREFIX + k: v for k, v in env.items()}}
    for name in ("PYTHONPATH", "LANG"):  # the daemon's own (PYTHONPATH where it runs from a checkout)
        if environ.get(name):
            shim_env[name] = environ[name]
    timing = dataclasses.replace(spec.timing, stop_timeout_s=max(spec.timing.stop_timeout_s, stop_s + SHIM_MARGIN_S))
    return dataclasses.replace(spec, argv=shim_argv(launch), env=shim_env, launcher=shim_identity(), timing=timing,
                               policy=ContainerPolicy)
