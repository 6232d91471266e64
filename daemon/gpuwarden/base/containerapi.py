"""A container runtime's REST API (podman's or dockerd's, over its root-owned Unix socket), through docker-py
(Debian: python3-docker; PyPI: docker): create, start, follow, wait, stop, remove, list by label, inspect an image.
Nothing of gpuwarden's: what a container is comes from serving/compose/container.py. Every call has a timeout, but
the log stream, which its reader ends by closing it. Errors come out as RuntimeFault: one line, naming the runtime
and what failed."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from .safetext import visible

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
    state: str  # running, exited, created...
    labels: Mapping[str, str]


def not_roots(path: str, found: os.stat_result, folder: os.stat_result) -> str | None:
    """Why a runtime's API socket is not one to send the engine's environment to, secrets included (None: it is):
    root's, in a folder only root may change (or a sticky one). A socket a local user made got every create request
    of the shim, the engine's API key and Hugging Face token in them (attacker 19's F2)."""
    if found.st_uid != 0:
        return (f"{path} is not root's (its owner is uid {found.st_uid}): the engine's secrets go to the runtime's "
                "socket, so only root's is asked (a rootful podman's or docker's)")
    if folder.st_uid != 0 or (folder.st_mode & 0o022 and not folder.st_mode & stat.S_ISVTX):
        return (f"{os.path.dirname(path) or '/'} may be changed by a user other than root: {path} there could be "
                "replaced by another's socket; keep the runtime's socket in a folder of root's")
    return None


def product_of(version: Mapping) -> str:
    """Which runtime answers, from its GET /version: podman names a component "Podman Engine"."""
    components = version.get("Components") if isinstance(version, Mapping) else None
    names = [str(c.get("Name", "")) for c in components or () if isinstance(c, Mapping)]
    return "podman" if any(name.lower().startswith("podman") for name in names) else "docker"


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
            found, folder = os.stat(socket_path), os.stat(os.path.dirname(socket_path) or "/")
        except OSError as exc:
            raise RuntimeFault(f"{runtime}'s API socket {socket_path}: {exc.strerror}; "
                               f"{start_hint(runtime)}") from None
        if not stat.S_ISSOCK(found.st_mode):
            raise RuntimeFault(f"{socket_path} is not a socket ({runtime}'s API socket is expected there)")
        why = not_roots(socket_path, found, folder)
        if why:
            raise RuntimeFault(why)
        try:
            self.api = docker.APIClient(base_url=f"unix://{socket_path}", version="auto", timeout=timeout_s)
            answers = product_of(self.api.version(api_version=False))
        except self._errors as exc:
            raise RuntimeFault(f"{runtime} does not answer on {socket_path}: {one_line(exc)}; "
                               f"{start_hint(runtime)}") from None
        if answers == "podman" and runtime != "podman":
            # podman's Docker API takes docker's create and runs it under podman's own wide seccomp profile; the
            # profile is narrowed for podman only (serving/compose/sandbox.py): attacker 19's F1, a user namespace
            # with every capability, keyctl and AF_VSOCK in the engine's container, and `check` said OK
            raise RuntimeFault(f"{socket_path} is podman's API (serve.container.runtime says {runtime}): set runtime: "
                               "podman, so that the engine runs under the unit's system-call rules")

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

    def create_libpod(self, body: Mapping) -> str:
        """podman's libpod create (a SpecGenerator: the only create of podman 4.3.1 that takes CDI devices); the
        container's ID."""
        try:
            reply = self.api.post(self.api.base_url + LIBPOD + "/containers/create", json=dict(body),
                                  timeout=CALL_TIMEOUT_S)
            if reply.status_code >= 400:
                raise RuntimeFault(f"podman refused to create {body.get('name', 'a container')}: {api_message(reply)}")
            return reply.json()["Id"]
        except RuntimeFault:
            raise
        except (*self._errors, KeyError, ValueError) as exc:
            raise self._fault(f"creating {body.get('name', 'a container')}", exc) from None

    def create_docker(self, kwargs: Mapping) -> str:
        """docker-py's create_container with these keywords (host_config: create_host_config's); the ID."""
        kwargs = dict(kwargs)
        try:
            kwargs["host_config"] = self.api.create_host_config(**kwargs.get("host_config", {}))
            return self.api.create_container(**kwargs)["Id"]
        except (*self._errors, KeyError, TypeError, ValueError) as exc:
            raise self._fault(f"creating {kwargs.get('name', 'a container')}", exc) from None

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

    def wait(self, cid: str, timeout_s: float | None = None) -> int:
        """Its exit status, once it has ended (None: waits as long as it runs). RuntimeFault past timeout_s."""
        try:
            return int(self.api.wait(cid, timeout=timeout_s)["StatusCode"])
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

    def output(self, cid: str, max_bytes: int) -> bytes:
        """What it has written so far (a probe's answer, once it ended), max_bytes at most: read as a stream and
        closed there (docker-py's plain read takes the whole log into memory first)."""
        got = bytearray()
        try:
            stream = self.api.logs(cid, stdout=True, stderr=True, stream=True, follow=False)
            try:
                for chunk in stream:
                    got += chunk[:max_bytes - len(got)]
                    if len(got) >= max_bytes:
                        break
            finally:
                stream.close()
        except self._errors as exc:
            raise self._fault(f"reading the output of {cid[:12]}", exc) from None
        return bytes(got)

    def labelled(self, label: str, value: str) -> list[Found]:
        """Every container whose label is value, running or not."""
        try:
            found = self.api.containers(all=True, filters={"label": [f"{label}={value}"]})
        except self._errors as exc:
            raise self._fault(f"listing the containers labelled {label}", exc) from None
        out = []
        for c in found:
            labels = c.get("Labels") or {}
            if labels.get(label) != value:  # the filter is the runtime's: read it back
                continue
            names = c.get("Names") or [""]
            out.append(Found(str(c.get("Id", "")), str(names[0]).lstrip("/"), str(c.get("State", "")),
                             {str(k): str(v) for k, v in labels.items()}))
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
