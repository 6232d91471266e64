"""The engine from a container image (serve.container): what the container is, and the create request each runtime
takes for it. Only data: the shim (`gpuwarden container-run`, cli/container_run.py) sends it through the runtime's
API (serving/run/containers.py), and the daemon runs the shim as the engine's child, so that the supervisor's
guarantees (readiness, backoff, stall, drain, adoption, output) are a process's (design/container-engine.md).

The request, whatever the runtime: the engine's command with an explicit entrypoint (the community's images change
theirs: vllm/vllm-openai went from `python3 -m vllm.entrypoints.openai.api_server` to `vllm serve`), serve.user's
uid and gid, every capability dropped, no-new-privileges, the host's network (the engine's port is judged as a
process's), the mounts read-only unless said otherwise (the model's directory always), the GPUs, a stop timeout of
the drain (podman 4.3.1's Docker-compatible create gives 0 s without one: no drain), logs in a file driver (journald's
cannot be followed), and labels naming this host and the child, by which a leftover is found and removed. The
environment's values (serve.env_file's secrets among them) never go on a command line: the shim's argv names them,
its environment holds them.

Podman goes through its libpod endpoint, the only one that takes CDI device names on 4.3.1 (its compat create drops
DeviceRequests and mangles a CDI name in Devices into a path); Docker takes `DeviceRequest`s (its `--gpus`)."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import signal
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

from ...base.statedir import state_dir
from ...config import ContainerConfig, Mount
from ..lint.packages import Installed
from . import installed as installed_mod
from .enginesock import socket_dir
from .homes import CACHES

LABEL_HOST = "io.gpuwarden.host"  # this host's machine ID: another host's containers on a shared runtime are not ours
LABEL_CHILD = "io.gpuwarden.child"  # the child's name (vllm, sglang)
# the state directory of the gpuwarden that made it: two daemons of one host (each its own port and state) never
# remove each other's
LABEL_OWNER = "io.gpuwarden.state"
CONTAINER_HOME = "/tmp"
# The runtime's log file of a container (the shim follows it): an engine printing without pause filled root's disk
# at 145 MiB/s through it (attacker 12's F2); past this the runtime starts the file anew.
LOG_MAX_BYTES = 64 << 20  # HOME inside, where the command sets none: serve.user's home is a host path
# The engine's environment in the shim's: each name behind this prefix, so that the engine's own PATH or PYTHONPATH
# (inside the image) never becomes the shim's (on this host), nor the shim's the engine's.
ENV_PREFIX = "GPUWARDEN_ENGINE_ENV_"
MACHINE_ID = "/etc/machine-id"


@functools.lru_cache(maxsize=4)
def host_id(path: str = MACHINE_ID) -> str:
    """This host's machine ID (systemd's), which labels its containers; "unknown" where it cannot be read."""
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            text = f.read(64).strip()
    except OSError:
        return "unknown"
    return text if text.isalnum() else "unknown"


@dataclass(frozen=True)
class ContainerLaunch:
    """One engine container: everything the shim needs but the environment's values."""

    runtime: str  # podman or docker
    socket: str  # the runtime's API socket
    image: str
    pull: bool
    name: str  # the container's name: gpuwarden-CHILD-PORT
    argv: tuple[str, ...]  # the command inside; argv[0] is the entrypoint
    env_names: tuple[str, ...]  # the environment's names, whose values the shim has
    user: str  # uid:gid
    groups: tuple[int, ...]  # supplementary gids (the GPU device groups)
    mounts: tuple[Mount, ...]
    gpus: tuple[str, ...]  # GPU indices, as the host's NVML counts them; () on the simulator
    labels: tuple[tuple[str, str], ...]
    stop_timeout_s: int  # the runtime's stop waits this long after SIGTERM before SIGKILL: the drain
    shm_bytes: int = 16 << 30  # /dev/shm's size inside

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> ContainerLaunch:
        """Raises ValueError (a word a shim cannot read: another version's, or no launch at all)."""
        raw = json.loads(text)
        if not isinstance(raw, dict) or set(raw) != set(cls.__dataclass_fields__):
            raise ValueError("not a container launch of this version")
        raw["mounts"] = tuple(Mount(**m) for m in raw["mounts"])
        raw["labels"] = tuple((str(k), str(v)) for k, v in raw["labels"])
        for key in ("argv", "env_names", "groups", "gpus"):
            raw[key] = tuple(raw[key])
        return cls(**raw)


def launch_of(container: ContainerConfig, child: str, port: int, argv: tuple[str, ...], env: Mapping[str, str],
              uid: int, gid: int, groups: tuple[int, ...], model: str, gpus: tuple[str, ...], stop_timeout_s: int,
              machine: str | None = None, owner: str | None = None) -> ContainerLaunch:
    """The container of an engine composed as argv and env, run as uid:gid. A model that is a directory here is
    mounted read-only at the same path (where no mount names that path already)."""
    mounts = list(container.mounts)
    if model.startswith("/") and os.path.isdir(model) and not any(m.container == model for m in mounts):
        mounts.append(Mount(model, model, True))
    labels = ((LABEL_HOST, machine or host_id()), (LABEL_CHILD, child), (LABEL_OWNER, owner or str(state_dir())))
    return ContainerLaunch(container.runtime, container.api_socket, container.image, container.pull,
                           f"gpuwarden-{child}-{port}", tuple(argv), tuple(sorted(inside_env(env))),
                           f"{uid}:{gid}", tuple(groups), tuple(mounts), tuple(gpus), labels, stop_timeout_s,
                           container.shm_gib << 30)


def inside_env(env: Mapping[str, str]) -> dict[str, str]:
    """The engine's environment as the container gets it: the host's PATH and CUDA_VISIBLE_DEVICES mean nothing
    inside (the image has its PATH; the runtime gives the container its GPUs, numbered from 0), HOME is set, and a
    home and caches the daemon made for serve.user on this host (homes.child_home) are the container's /tmp's."""
    out = {k: v for k, v in env.items() if k not in ("PATH", "CUDA_VISIBLE_DEVICES", "USER", "LOGNAME")}
    home = out.get("HOME", "")
    if home.startswith(str(state_dir() / "home") + "/"):  # homes.child_home's: a host folder the container lacks
        del out["HOME"]  # (attacker 19's F4: under /var/lib the engine's user could not make its caches there)
        for name, sub in CACHES.items():
            if out.get(name, "").startswith(home):  # its, not a cache the config points at a mount
                out[name] = f"{CONTAINER_HOME}/{sub}"
    out.setdefault("HOME", CONTAINER_HOME)
    return out


def libpod_body(launch: ContainerLaunch, env: Mapping[str, str]) -> dict:
    """podman's libpod create (`POST /v4.0.0/libpod/containers/create`: a SpecGenerator, pkg/specgen/specgen.go)."""
    return {
        "name": launch.name,
        "image": launch.image,
        "entrypoint": list(launch.argv[:1]),
        "command": list(launch.argv[1:]),
        "env": dict(env),
        "user": launch.user,
        "groups": [str(g) for g in launch.groups],
        "labels": dict(launch.labels),
        "netns": {"nsmode": "host"},
        "cap_drop": ["ALL"],
        "no_new_privileges": True,
        "privileged": False,
        "mounts": [{"destination": m.container, "source": m.host, "type": "bind",
                    "options": ["bind", "ro" if m.read_only else "rw"]} for m in launch.mounts],
        "devices": [{"path": f"nvidia.com/gpu={g}"} for g in launch.gpus],
        "stop_timeout": launch.stop_timeout_s,
        "stop_signal": int(signal.SIGTERM),  # an integer here (syscall.Signal)
        "log_configuration": {"driver": "k8s-file", "size": LOG_MAX_BYTES},
        "shm_size": launch.shm_bytes,
        "remove": False,
    }


def docker_create(launch: ContainerLaunch, env: Mapping[str, str]) -> dict:
    """The keywords of docker-py's `APIClient.create_container` (and of its `create_host_config`, under
    host_config) for dockerd: GPUs as a DeviceRequest, which dockerd's nvidia driver (or its CDI driver, from
    Docker 25) serves; podman 4.3.1 would drop it, hence libpod there."""
    host = {
        "network_mode": "host",
        "cap_drop": ["ALL"],
        "security_opt": ["no-new-privileges"],
        "privileged": False,
        "binds": [m.text() for m in launch.mounts],
        "group_add": [str(g) for g in launch.groups],
        "log_config": {"type": "json-file", "config": {"max-size": str(LOG_MAX_BYTES), "max-file": "1"}},
        "shm_size": launch.shm_bytes,
        "auto_remove": False,
    }
    if launch.gpus:
        host["device_requests"] = [{"driver": "", "count": 0, "device_ids": list(launch.gpus),
                                    "capabilities": [["gpu"]], "options": {}}]
    return {
        "image": launch.image,
        "name": launch.name,
        "entrypoint": list(launch.argv[:1]),
        "command": list(launch.argv[1:]),
        "environment": dict(env),
        "user": launch.user,
        "labels": dict(launch.labels),
        "stop_signal": "SIGTERM",
        "stop_timeout": launch.stop_timeout_s,
        "use_config_proxy": False,  # not ~/.docker/config.json's proxies: the same container wherever it starts
        "host_config": host,
    }


def owned(runtime, owner: str | None = None) -> list:
    """The containers of this gpuwarden the runtime holds (base/containerapi.Found): this host's (machine ID), of this
    state directory (owner; None: this process's). The shim's, the policy's and ExecStopPost's one test of whose a
    container is: two daemons of one host never touch each other's."""
    owner = str(state_dir()) if owner is None else owner
    return [found for found in runtime.labelled(LABEL_HOST, host_id()) if found.labels.get(LABEL_OWNER) == owner]


def create(runtime, launch: ContainerLaunch, env: Mapping[str, str], network: bool = True) -> str:
    """The container made by runtime (base/containerapi.Runtime): podman's libpod create, dockerd's create; its ID.
    network False: none at all (a probe). podman's gets its profile narrowed to the unit's rules (sandbox.py),
    written under the state directory of the gpuwarden that makes it; Docker's default profile has those rules.
    Raises RuntimeFault."""
    if launch.runtime == "podman":
        from ...base.containerapi import RuntimeFault  # noqa: PLC0415 (docker-py: only for a container)
        from .sandbox import SandboxFault, podman_profile  # noqa: PLC0415

        body = libpod_body(launch, env)
        try:
            body["seccomp_profile_path"] = podman_profile(dict(launch.labels).get(LABEL_OWNER) or str(state_dir()))
        except SandboxFault as exc:
            raise RuntimeFault(f"{exc} ({SANDBOX_FIX})") from None
        if not network:
            body["netns"] = {"nsmode": "none"}
        return runtime.create_libpod(body)
    kwargs = docker_create(launch, env)
    if not network:
        kwargs["host_config"]["network_mode"] = "none"
    return runtime.create_docker(kwargs)


PROBE_S = 60.0  # the image's versions: a short-lived container of it, its Python importing nothing of the engine
PROBE_OUTPUT_MAX = 1024 * 1024
PROBE_CHILD = "probe"
PROBE_SHM_BYTES = 64 << 20  # a probe's /dev/shm: the runtimes' own default, not the engine's 16 GiB
PROBE_ENV = ("PYTHONPATH", "HOME", "LANG", "CUDA_HOME")  # of the engine's environment, as the probe on a host gets


def image_installed(container: ContainerConfig, uid: int, gid: int, python: str | None, state: Path | None,
                    ask: bool = True, env: Mapping[str, str] | None = None, machine: str | None = None) -> Installed:
    """What the image has installed (vLLM, FlashInfer, torch and its CUDA, SGLang), read once per image ID by the
    installed-versions probe in a container of the image (serve.python inside it, else python3; the configured
    mounts, read-only: an engine's venv may be one): as uid:gid, no network, no capability, no GPU, removed after;
    cached under the image's name with its ID. ask False (the daemon's loop): the cache only, never the
    runtime (a reload reads it again off the loop first: replan.Replan.reread_installed)."""
    key = f"image {container.image}"
    cached = installed_mod.remembered(state, key)
    if not ask:  # the cache, or what the last read met (a reload refuses that: ServingRuntime.refuse_container)
        return cached or _faults.get(key) or Installed(key, False, error=f"{key} {NOT_READ}")
    found = _read_image(container, uid, gid, python, state, env, machine, key, cached)
    if found.known:
        _faults.pop(key, None)
    else:
        _faults[key] = found
    return found


NOT_READ = "is read at the next reload or restart"
_faults: dict[str, Installed] = {}  # per image name, the last read that failed (this process's)
PROBE_DEADLINE_S = PROBE_S + 60  # the probe, and every call around it: a runtime that trickles its answers
WAIT_SLICE_S = 2.0  # a probe's wait, asked in slices: one no one waits for any more (cancel) is removed at once


def _read_image(container: ContainerConfig, uid: int, gid: int, python: str | None, state: Path | None,
                env: Mapping[str, str] | None, machine: str | None, key: str, cached: Installed | None) -> Installed:
    """image_installed's read, with one deadline for all of it (a runtime answering a byte every 10 s held a start
    past 90 s, each call's timeout being per read: attacker 12's F8): past it, no answer, and the read is left to
    end on its thread (the runtime's own timeouts end it)."""
    try:
        done = within(PROBE_DEADLINE_S, "image-versions",
                      lambda: _ask_image(container, uid, gid, python, state, env, machine, key, cached))
    except Exception as exc:  # a bug's: the versions unknown, said
        return Installed(key, False, error=f"reading {container.image}'s versions failed: {type(exc).__name__}: {exc}")
    if done is None:
        return Installed(key, False, error=f"{container.runtime} did not answer within {PROBE_DEADLINE_S:g} s")
    return done


def within(deadline_s: float, name: str, work):
    """work() on a thread of its own: its answer if it came within deadline_s, else None (it ends on its thread);
    what it raised is raised here."""
    import threading  # noqa: PLC0415

    done: list = []

    def run() -> None:
        try:
            done.append((True, work()))
        except BaseException as exc:  # noqa: BLE001 (handed to the caller, who says it)
            done.append((False, exc))

    worker = threading.Thread(target=run, name=name, daemon=True)
    worker.start()
    worker.join(deadline_s)
    if not done:
        return None
    ok, value = done[0]
    if not ok:
        raise value
    return value


def _ask_image(container: ContainerConfig, uid: int, gid: int, python: str | None, state: Path | None,
               env: Mapping[str, str] | None, machine: str | None, key: str, cached: Installed | None) -> Installed:
    from ...base.containerapi import RuntimeFault  # noqa: PLC0415 (docker-py: only for a container)

    probe_env = {"HOME": CONTAINER_HOME, **{k: v for k, v in (env or {}).items() if k in PROBE_ENV}}
    try:
        with image_runtime(container) as (runtime, image_id):
            if cached is not None and cached.stamp == (image_id,):
                return cached
            status, out = in_image(runtime, container, uid, gid, (python or "python3", "-c", installed_mod.PROBE),
                                   probe_env, PROBE_S, machine, image_id=image_id)
    except RuntimeFault as exc:
        return Installed(key, False, error=str(exc))
    if status is None:
        return Installed(key, False, error=f"{key} did not answer within {PROBE_S:g} s")
    return installed_mod.answer(key, out, out, status, state, stamp=(image_id,))


@contextlib.contextmanager
def image_runtime(container: ContainerConfig):
    """(the runtime's connection, the image's ID), closed after; RuntimeFault where the runtime cannot be asked or
    has no such image."""
    from ...base.containerapi import Runtime, RuntimeFault  # noqa: PLC0415 (docker-py: only for a container)

    runtime = Runtime(container.runtime, container.api_socket)
    try:
        image_id = runtime.image_id(container.image)
        if image_id is None:
            raise RuntimeFault(f"{container.runtime} has no image {container.image} (pull it, or set "
                               "serve.container.pull: true)")
        yield runtime, image_id
    finally:
        runtime.close()


def probe_mounts(container: ContainerConfig, model: str = "") -> tuple[Mount, ...]:
    """What a probe of the image sees of this host: the configured mounts and the model's directory (as the
    engine's container gets it: launch_of), every one read-only; a missing source is check's line of its own."""
    mounts = [Mount(m.host, m.container, True) for m in container.mounts if os.path.exists(m.host)]
    if model.startswith("/") and os.path.isdir(model) and not any(m.container == model for m in mounts):
        mounts.append(Mount(model, model, True))
    return tuple(mounts)


def in_image(runtime, container: ContainerConfig, uid: int, gid: int, argv: tuple[str, ...],
             env: Mapping[str, str], wait_s: float, machine: str | None = None,
             cancel=None, image_id: str | None = None,
             mounts: tuple[Mount, ...] | None = None) -> tuple[int | None, str]:
    """argv run in a short-lived container of the image (of image_id where given: the very image its answer is kept
    for, whatever the name points at by then), as uid:gid, with mounts (None: probe_mounts without the model), no
    network, no capability, no GPU; removed after, whatever happens (a removal that fails is said, and the answer
    stands). (its exit status, what it wrote: at most PROBE_OUTPUT_MAX bytes, stdout and stderr together); status
    None: it did not end within wait_s, or cancel (a threading.Event) was set first. Raises RuntimeFault. Labelled
    as this daemon's (LABEL_CHILD probe): one a killed daemon leaves is removed at the next start
    (run/containers.sweep) or stop."""
    import logging  # noqa: PLC0415

    from ...base.containerapi import RuntimeFault  # noqa: PLC0415

    launch = ContainerLaunch(container.runtime, container.api_socket, image_id or container.image, False,
                             f"gpuwarden-{PROBE_CHILD}-{os.getpid()}-{time.monotonic_ns() % 10**9}", tuple(argv), (),
                             f"{uid}:{gid}", (), probe_mounts(container) if mounts is None else mounts,
                             (), ((LABEL_HOST, machine or host_id()), (LABEL_CHILD, PROBE_CHILD),
                                  (LABEL_OWNER, str(state_dir()))), 0, PROBE_SHM_BYTES)
    # An image built on nvidia/cuda says NVIDIA_VISIBLE_DEVICES=all, which Docker's nvidia runtime reads: none here.
    env = {**env, "NVIDIA_VISIBLE_DEVICES": "void"}
    if cancel is not None and cancel.is_set():
        return None, ""
    cid = create(runtime, launch, env, network=False)
    try:
        runtime.start(cid)
        deadline = time.monotonic() + wait_s
        status = None
        while status is None and not (cancel is not None and cancel.is_set()):
            left = deadline - time.monotonic()
            if left <= 0:
                break
            asked, slice_s = time.monotonic(), min(WAIT_SLICE_S, left)
            try:
                status = runtime.wait(cid, slice_s)
            except RuntimeFault:
                if time.monotonic() - asked < slice_s / 2:
                    raise  # refused at once (the runtime went away), not a slice's end
        if status is None:
            return None, ""
        return status, runtime.output(cid, PROBE_OUTPUT_MAX).decode("utf-8", "replace")
    finally:
        try:
            runtime.remove(cid)
        except RuntimeFault as exc:
            logging.getLogger("gpuwarden").warning("a probe container of %s was not removed (the next start or stop "
                                                   "removes it): %s", container.image, exc)


SANDBOX_FIX = "install podman's seccomp profile (Debian: golang-github-containers-common)"
CDI_DIRS = ("/etc/cdi", "/var/run/cdi")  # where podman and dockerd read CDI specs
CDI_KIND = "nvidia.com/gpu"
CDI_FIX = "nvidia-ctk cdi generate --output=/etc/cdi/nvidia.yaml (NVIDIA Container Toolkit)"


def cdi_spec(dirs: tuple[str, ...] = CDI_DIRS) -> str | None:
    """The first CDI spec for NVIDIA's GPUs (kind nvidia.com/gpu) in dirs, None where there is none."""
    from ...base import smallfile  # noqa: PLC0415

    for folder in dirs:
        try:
            names = sorted(os.listdir(folder))[:256]
        except OSError:
            continue
        for name in names:
            if not name.endswith((".yaml", ".yml", ".json")):
                continue
            try:
                data = smallfile.read(Path(folder, name), 4 * 1024 * 1024)
            except (smallfile.Unreadable, OSError):
                continue
            if data is not None and CDI_KIND in data.decode("utf-8", "replace"):
                return str(Path(folder, name))
    return None


def overlaps(path: str, other: str) -> bool:
    """Whether two absolute paths in the container are one, or one is inside the other (a mount at either would
    meet the other's: a duplicate destination, or a mount point inside a read-only mount). A mount at the engine's
    socket folder drained a healthy engine at a reload and left it FATAL (attacker 19's F3)."""
    a, b = path.rstrip("/") or "/", other.rstrip("/") or "/"
    return a == b or b.startswith(a.rstrip("/") + "/") or a.startswith(b.rstrip("/") + "/")


def container_problems(config, engine_module: str, found: Installed, simulated: bool) -> list:
    """What `check` refuses in serve.container (ConfigErrors to raise), each with its fix: a mount's source that
    does not exist, podman's seccomp profile that cannot be narrowed (sandbox.py), a runtime that cannot be asked or
    has no such image, an image without the engine, GPUs with no CDI spec for podman. `run` starts anyway: the shim
    then fails with the same reason, and FATAL says it."""
    from .sandbox import SandboxFault, base_profile, narrowed  # noqa: PLC0415

    c = config.serve.container
    problems = []
    engine_dir = str(socket_dir())
    for i, mount in enumerate(c.mounts):
        if not os.path.exists(mount.host):
            problems.append(config.error(("serve", "container", "mounts", str(i)), f"{mount.host} does not exist",
                                         "create it, or fix the path"))
        if overlaps(mount.container, engine_dir):  # the runtime refuses the engine's create, after the drain
            problems.append(config.error(("serve", "container", "mounts", str(i)), f"{mount.container} is on the "
                                         f"way to {engine_dir}, the engine's socket folder, which the engine's "
                                         "container gets at that path", "mount it at another path inside"))
    sandbox = None
    if c.runtime == "podman":
        try:
            source, profile = base_profile()
            narrowed(profile, source)
        except SandboxFault as exc:
            sandbox = str(exc)
            problems.append(config.error(("serve", "container", "runtime"), f"{exc}: the engine would run without "
                                         "the unit's system-call rules", SANDBOX_FIX))
    if sandbox is not None and sandbox in (found.error or ""):
        pass  # the image's read could not make its container for the same reason: one line says it
    elif not found.known and NOT_READ in (found.error or ""):
        pass  # on the daemon's loop, a read still to come: nothing known against it
    elif not found.known:
        problems.append(config.error(("serve", "container", "image"), found.error or "not read",
                                     "start the runtime's API socket, pull the image, or fix serve.container"))
    elif found.version(engine_module) is None:
        python = config.serve.python or "python3"
        problems.append(config.error(("serve", "container", "image"), f"{c.image} has no {engine_module} for its "
                                     f"{python}", "an image with the engine, or serve.python: the interpreter in "
                                     "the image that has it"))
    if not simulated and c.runtime == "podman" and cdi_spec() is None:
        problems.append(config.error(("serve", "container", "runtime"), "no CDI spec for NVIDIA's GPUs in "
                                     f"{' or '.join(CDI_DIRS)}: podman cannot give the container its GPUs", CDI_FIX))
    return problems
