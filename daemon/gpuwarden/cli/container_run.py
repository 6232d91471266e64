"""`gpuwarden container-run`: the engine's child when serve.container is set. The daemon starts it as it starts a
process engine (its own session, output pipe, SIGTERM for a planned stop); it runs the engine's container through
the runtime's API and stands for it (design/container-engine.md):

- a container of the same name that an earlier shim left (one SIGKILLed with its daemon's stop) is removed first;
- the container is created (serving/compose/container.py) and started; its output comes out here, where the
  daemon reads it as any child's;
- SIGTERM (or SIGINT) is the runtime's stop with the drain's timeout, then the container is removed, and this exits
  with the container's status; a container that ends by itself is removed too, and its status is this one's.

It runs as root without capabilities (serving/compose/identity.shim_identity): root's uid reaches the runtime's
root-only socket, and nothing else is needed. Its argv is the launch without the environment's values, which come
from its own environment, each name behind ENV_PREFIX (the engine's PATH is not the shim's)."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading

from .registry import Command
from ..base.exits import EX_CONFIG, EX_UNAVAILABLE

LEFT_OVER = 125  # podman's and Docker's own status for "the runtime failed": the container never ran


def cmd_container_run(args: argparse.Namespace) -> int:
    from ..base.containerapi import Runtime, RuntimeFault
    from ..serving.compose.container import ENV_PREFIX, LABEL_OWNER, ContainerLaunch, create, owned

    try:
        launch = ContainerLaunch.from_json(args.launch)
    except (ValueError, TypeError, KeyError) as exc:
        print(f"gpuwarden container-run: the launch is not one this version reads ({exc})", file=sys.stderr)
        return EX_CONFIG
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    env = {name: os.environ[ENV_PREFIX + name] for name in launch.env_names if ENV_PREFIX + name in os.environ}
    try:
        runtime = Runtime(launch.runtime, launch.socket)
    except RuntimeFault as exc:
        print(f"gpuwarden container-run: {exc}", file=sys.stderr)
        return EX_UNAVAILABLE
    cid = None
    try:
        for found in owned(runtime, dict(launch.labels).get(LABEL_OWNER)):
            if found.name == launch.name:
                runtime.remove(found.id)
                print(f"gpuwarden container-run: removed container {found.id[:12]} ({found.name}, {found.state}), "
                      "left by an earlier run", flush=True)
        if runtime.image_id(launch.image) is None:
            if not launch.pull:
                print(f"gpuwarden container-run: {launch.runtime} has no image {launch.image} (pull it, "
                      "or set serve.container.pull: true)", file=sys.stderr)
                return EX_CONFIG
            print(f"gpuwarden container-run: pulling {launch.image}", flush=True)
            runtime.pull(launch.image)
        if stop.is_set():
            return 0
        cid = create(runtime, launch, env)
        runtime.start(cid)
        print(f"gpuwarden container-run: container {cid[:12]} ({launch.name}) of {launch.image} started", flush=True)
        return _follow(runtime, cid, launch.stop_timeout_s, stop)
    except RuntimeFault as exc:
        print(f"gpuwarden container-run: {exc}", file=sys.stderr)
        return LEFT_OVER
    finally:
        if cid is not None:
            try:
                runtime.remove(cid)
            except RuntimeFault as exc:
                print(f"gpuwarden container-run: {exc} (the daemon's sweep removes it)", file=sys.stderr)


def _follow(runtime, cid: str, stop_timeout_s: int, stop: threading.Event) -> int:
    """The container's output to ours until it ends; a stop asked meanwhile is the runtime's, with the drain's
    timeout. Its exit status."""
    from ..base.containerapi import RuntimeFault

    stream = runtime.logs(cid)
    out = threading.Thread(target=_copy, args=(stream,), daemon=True, name="container-output")
    out.start()
    ended = threading.Event()
    status: list[int | RuntimeFault] = []

    def wait() -> None:
        try:
            status.append(runtime.wait(cid))
        except RuntimeFault as exc:
            status.append(exc)
        ended.set()

    threading.Thread(target=wait, daemon=True, name="container-wait").start()
    while not ended.is_set() and not stop.is_set():
        ended.wait(0.5)  # signals arrive between waits (the main thread runs their handlers)
    if not ended.is_set():
        print(f"gpuwarden container-run: stopping container {cid[:12]} (SIGTERM, SIGKILL after {stop_timeout_s} s)",
              flush=True)
        runtime.stop(cid, stop_timeout_s)
        ended.wait(30)
    out.join(5)  # the rest of its output, which the runtime sends before the stream ends
    stream.close()
    result = status[0] if status else RuntimeFault("the container's end was not reported")
    if isinstance(result, RuntimeFault):
        raise result
    return result


def _copy(stream) -> None:
    """The runtime's frames as they come (podman writes a line a frame; the daemon splits lines anyway)."""
    try:
        for chunk in stream:
            os.write(1, chunk)
    except (OSError, ValueError):
        return  # closed, or our stdout is gone: the daemon reads nothing any more either


def arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("launch", help="the container, as the daemon wrote it (JSON; the environment's values come "
                        "from this command's environment)")


COMMAND = Command("container-run", help="(the daemon's) run the engine's container and stand for it: the engine's "
                  "child when serve.container is set", run=cmd_container_run, arguments=arguments, order=45,
                  exits=((0, "the container ended with status 0, or was stopped"),
                         (EX_CONFIG, "the launch cannot be read, or the image is missing and pull is off"),
                         (EX_UNAVAILABLE, "the runtime does not answer on its socket, or docker-py is missing"),
                         (LEFT_OVER, "the runtime refused a call (create, start, wait, stop)"),
                         (1, "or any other status: the container's own")))
