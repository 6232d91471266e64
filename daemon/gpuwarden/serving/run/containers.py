"""The container runtime's REST API (podman's or dockerd's, over its root-owned Unix socket), through docker-py
(Debian: python3-docker; PyPI: docker): what the engine's shim (cli/container_run.py) and the daemon's sweep of
leftover containers ask it. Every call has a timeout, but the log stream, which the shim reads on a thread of its
own and ends by closing it. Errors come out as RuntimeFault: one line, naming the runtime and what failed."""

from __future__ import annotations

import dataclasses
import logging
import os
import stat
import sys
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from ...base.background import Background
from ...base.safetext import visible
from ...config import ContainerConfig
from ..compose.container import (LABEL_CHILD, LABEL_HOST, LABEL_OWNER, ContainerLaunch, docker_create, host_id, inside_env,
                                 launch_of, libpod_body)
from ..compose.drain import DRAIN_MARGIN_S
from ..compose.identity import shim_identity
from .policy import Policy
from .spec import ChildSpec

log = logging.getLogger(__name__)

CALL_TIMEOUT_S = 30.0  # any call but the log stream and the wait for the container's end
LIBPOD = "/v4.0.0/libpod"  # podman 4.3.1 answers any /vN/ prefix; its libpod create takes CDI device names
INSTALL = "apt install python3-docker (or pip install docker)"


class RuntimeFault(Exception):
    """The runtime cannot be asked, or refused; the message is one line."""


@dataclass(frozen=True)
class Found:
    """A labelled container the runtime holds."""

    id: str
    name: str
    child: str
    state: str  # running, exited, created...
    owner: str  # the state directory of the gpuwarden that made it


class Runtime:
    """A connection to the runtime's API socket."""

    def __init__(self, runtime: str, socket_path: str, timeout_s: float = CALL_TIMEOUT_S):
        self.runtime, self.socket = runtime, socket_path
        try:
            import docker  # noqa: PLC0415 (optional: only serve.container needs it)
            import docker.errors  # noqa: PLC0415
        except ImportError:
            raise RuntimeFault(f"serve.container needs docker-py, which is not installed: {INSTALL}") from None
        self._errors = (docker.errors.DockerException, OSError)
        try:
            mode = os.stat(socket_path).st_mode
        except OSError as exc:
            raise RuntimeFault(f"{runtime}'s API socket {socket_path}: {exc.strerror}; "
                               f"{start_hint(runtime)}") from None
        if not stat.S_ISSOCK(mode):
            raise RuntimeFault(f"{socket_path} is not a socket ({runtime}'s API socket is expected there)")
        try:
            self.api = docker.APIClient(base_url=f"unix://{socket_path}", version="auto", timeout=timeout_s)
        except self._errors as exc:
            raise RuntimeFault(f"{runtime} does not answer on {socket_path}: {one_line(exc)}; "
                               f"{start_hint(runtime)}") from None

    def _fault(self, what: str, exc: BaseException) -> RuntimeFault:
        return RuntimeFault(f"{self.runtime}: {what}: {one_line(exc)}")

    def image_id(self, image: str) -> str | None:
        """The image's ID (sha256:...), None where the runtime has no such image."""
        import docker.errors  # noqa: PLC0415

        try:
            return self.api.inspect_image(image)["Id"]
        except docker.errors.ImageNotFound:
            return None
        except self._errors as exc:
            raise self._fault(f"inspecting image {image}", exc) from None

    def pull(self, image: str) -> None:
        try:
            self.api.pull(image)
        except self._errors as exc:
            raise self._fault(f"pulling {image}", exc) from None

    def create(self, launch: ContainerLaunch, env: Mapping[str, str]) -> str:
        """The container's ID."""
        try:
            if self.runtime == "podman":
                reply = self.api.post(self.api.base_url + LIBPOD + "/containers/create",
                                      json=libpod_body(launch, env), timeout=CALL_TIMEOUT_S)
                if reply.status_code >= 400:
                    raise RuntimeFault(f"podman refused to create {launch.name}: {api_message(reply)}")
                return reply.json()["Id"]
            kwargs = docker_create(launch, env)
            kwargs["host_config"] = self.api.create_host_config(**kwargs["host_config"])
            return self.api.create_container(**kwargs)["Id"]
        except RuntimeFault:
            raise
        except (*self._errors, KeyError, ValueError) as exc:
            raise self._fault(f"creating {launch.name}", exc) from None

    def start(self, cid: str) -> None:
        try:
            self.api.start(cid)
        except self._errors as exc:
            raise self._fault(f"starting {cid[:12]}", exc) from None

    def logs(self, cid: str) -> Iterator[bytes]:
        """The container's output as it comes (stdout and stderr together), until it ends or close() is called on
        what this returns. The stream has no timeout (docker-py's helper turns it off)."""
        try:
            return self.api.logs(cid, stdout=True, stderr=True, stream=True, follow=True)
        except self._errors as exc:
            raise self._fault(f"reading the output of {cid[:12]}", exc) from None

    def wait(self, cid: str) -> int:
        """Its exit status, once it has ended (waits as long as it runs)."""
        try:
            return int(self.api.wait(cid, timeout=None)["StatusCode"])
        except (*self._errors, KeyError, TypeError, ValueError) as exc:
            raise self._fault(f"waiting for {cid[:12]}", exc) from None

    def stop(self, cid: str, timeout_s: int) -> None:
        """SIGTERM, then SIGKILL after timeout_s (the drain)."""
        try:
            self.api.stop(cid, timeout=timeout_s)
        except self._errors as exc:
            raise self._fault(f"stopping {cid[:12]}", exc) from None

    def remove(self, cid: str) -> None:
        """Removed, running or not; one already gone is no fault."""
        import docker.errors  # noqa: PLC0415

        try:
            self.api.remove_container(cid, force=True)
        except docker.errors.NotFound:
            return
        except self._errors as exc:
            raise self._fault(f"removing {cid[:12]}", exc) from None

    def labelled(self, host: str) -> list[Found]:
        """Every container labelled as this host's gpuwarden's, running or not."""
        try:
            found = self.api.containers(all=True, filters={"label": [f"{LABEL_HOST}={host}"]})
        except self._errors as exc:
            raise self._fault("listing gpuwarden's containers", exc) from None
        out = []
        for c in found:
            labels = c.get("Labels") or {}
            if labels.get(LABEL_HOST) != host:  # the filter is the runtime's: read it back
                continue
            names = c.get("Names") or [""]
            out.append(Found(str(c.get("Id", "")), str(names[0]).lstrip("/"), str(labels.get(LABEL_CHILD, "")),
                             str(c.get("State", "")), str(labels.get(LABEL_OWNER, ""))))
        return out

    def close(self) -> None:
        self.api.close()


def start_hint(runtime: str) -> str:
    return ("systemctl enable --now podman.socket" if runtime == "podman"
            else "systemctl enable --now docker.socket")


def api_message(reply) -> str:
    try:
        return one_line(reply.json().get("message") or reply.text)
    except ValueError:
        return one_line(reply.text)


def one_line(exc: BaseException | str) -> str:
    text = " ".join(str(exc).split())
    return visible(text[:400])


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
        if launch is None or self.program.ops.port_free(spec.host, spec.port):
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
        for found in runtime.labelled(host_id()):
            if found.owner != owner or (found.name == launch.name) != own_name:
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
SHIM_PATH = "/usr/local/bin:/usr/bin:/bin"


def container_spec(spec: ChildSpec, container: ContainerConfig, simulated: bool,
                   environ: Mapping[str, str] = os.environ) -> ChildSpec:
    """The engine's spec with its command run in a container: the child is the shim, run as root without
    capabilities, on the engine's command and environment (their values in the shim's environment, never its
    argv); the engine's port stays serve.user's. The runtime's stop waits for the drain and its margin before its
    SIGKILL, and the supervisor's SIGKILL of the shim comes after that. On the simulator no GPU is given to the
    container (there is none)."""
    identity = spec.identity
    stop_s = int(spec.drain_s + DRAIN_MARGIN_S) if spec.drain_s else int(spec.timing.stop_timeout_s)
    gpus = () if simulated else tuple(str(g.index) for g in spec.gpus)
    env = inside_env(spec.env)
    launch = launch_of(container, spec.name, spec.port, spec.argv, env, identity.uid, identity.gid,
                       identity.groups, spec.model, gpus, stop_s)
    shim_env = {**env, "PATH": SHIM_PATH}
    if environ.get("PYTHONPATH") and "PYTHONPATH" not in env:  # the daemon's own, where it runs from a checkout
        shim_env["PYTHONPATH"] = environ["PYTHONPATH"]
    timing = dataclasses.replace(spec.timing, stop_timeout_s=max(spec.timing.stop_timeout_s, stop_s + SHIM_MARGIN_S))
    return dataclasses.replace(spec, argv=shim_argv(launch), env=shim_env, launcher=shim_identity(), timing=timing,
                               policy=ContainerPolicy)
