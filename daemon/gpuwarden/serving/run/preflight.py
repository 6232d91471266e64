"""Before a child starts: what is left of the one before it is ended (its killed group's processes that have not
exited yet, processes that escaped the group, our user's processes on its GPUs), and whether its port and GPUs are
free for it. Program (serving/run/supervisor.py) asks; a start that must wait says why, and no failure is counted.
"""

from __future__ import annotations

import errno
import logging
import signal
from collections.abc import Sequence

from ...gpu.base import Gpu
from ..compose.apikey import flags_key_problem
from ..compose.enginesock import clear_stale
from .containers import launch_in
from .policy import Policy
from .processes import Child, ProcessOps
from .spec import ChildSpec

log = logging.getLogger("gpuwarden")


class Remains:
    """The processes of a child's earlier groups that were killed and may not have exited yet (by PID)."""

    def __init__(self, ops: ProcessOps, title: str):
        self.ops, self.title = ops, title
        self.dying: set[int] = set()  # pids of killed groups that may not have exited yet

    def kill_group(self, child: Child) -> int:
        """SIGKILL the child's group without waiting; the next start checks that it is gone.
        Returns how many processes were alive."""
        alive = self.ops.group_pids(child.pgid)
        self.ops.killpg(child.pgid, signal.SIGKILL)
        self.ops.poll(child)  # reap the leader if it is already gone
        self.dying.update(alive)
        return len(alive)

    def confirm_gone(self) -> None:
        """SIGKILL takes the kernel a moment for processes with gigabytes mapped: say when they are gone
        (checked each tick, never waited for)."""
        if not self.dying:
            return
        self.ops.reap(self.dying)
        if not self.ops.alive(self.dying):
            log.info("all %d processes of the previous %s are gone", len(self.dying), self.title)
            self.dying.clear()

    def kill_escaped(self) -> None:
        """Kill processes that left a previous child's group (they were re-parented to us) and say so."""
        escaped = self.ops.escaped()
        if not escaped:
            return
        described = ", ".join(self.ops.describe(pid) for pid in escaped)
        for pid in escaped:
            self.ops.kill(pid, signal.SIGKILL)
        self.dying.update(escaped)
        log.warning("killed %d process(es) that had left %s's process group: %s", len(escaped), self.title,
                    described)

    def still_exiting(self) -> str | None:
        """After killing what escaped: why a start must wait for the previous child's processes (SIGKILLed
        again), or None once they are gone."""
        self.kill_escaped()
        self.confirm_gone()
        if not self.dying:
            return None
        survivors = sorted(self.ops.alive(self.dying))
        for pid in survivors:
            self.ops.kill(pid, signal.SIGKILL)
        return f"processes {survivors} of the previous {self.title} are still exiting"


def preflight(spec: ChildSpec, gpus: Sequence[Gpu], ops: ProcessOps, remains: Remains, policy: Policy,
              now: float) -> str | None:
    """None if the GPUs and the port are free for a new child; else why not (after killing our own leftovers:
    the previous group, processes that escaped it, our user's processes on the GPUs). The child's policy may
    hold the start too (a worker waits for its head)."""
    exiting = remains.still_exiting()
    if exiting:  # still exiting: SIGKILLed again, and waited for
        return exiting
    kill_leftovers_on(gpus, spec, ops)
    return policy.blocks(now) or keyed_flags(spec) or taken(gpus, spec, ops)


def keyed_flags(spec: ChildSpec) -> str | None:
    """Why an engine behind the proxy must not start with its flags as they are now: they give vLLM an API key the
    proxy does not ask (its --config file edited since the start or the reload checked it); None: they give none.
    The start waits, and the next try after the file is mended goes on."""
    if not spec.keyless_flags:
        return None
    launch = launch_in(spec.argv)  # a container's engine: the shim's argv carries the engine's (attacker 16)
    keyed = flags_key_problem(launch.argv if launch is not None else spec.argv)
    return f"{keyed[0]}: {keyed[1]}, and reload" if keyed else None


def kill_leftovers_on(gpus: Sequence[Gpu], spec: ChildSpec, ops: ProcessOps) -> None:
    """Our user's compute processes still on the child's GPUs (an earlier child's): killed."""
    uid = spec.identity.uid
    for gpu in gpus:
        for pid, _ in gpu.compute_processes():
            if ops.uid_of(pid) == uid:
                log.warning("GPU%d: killing leftover %s process %d of user %s", gpu.index, spec.title, pid,
                            spec.identity.name)
                ops.kill(pid, signal.SIGKILL)


def taken(gpus: Sequence[Gpu], spec: ChildSpec, ops: ProcessOps) -> str | None:
    """Why the child's port or GPUs are not free for it (another listener, another user's compute processes,
    too little free memory for its share); None: they are."""
    if spec.listener:  # the daemon's own socket, kept: bound here the first time, ours from then on
        try:
            ops.listen(spec.listener, spec.host, spec.port)
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE:
                return f"{spec.title} cannot listen on {spec.host}:{spec.port}: {exc.strerror or exc}"
            return (f"port {spec.port} on {spec.host} is in use by "
                    f"{ops.who_listens(spec.host, spec.port)}; {spec.title} needs it")
    elif spec.socket:  # no port to take: its folder is root's and serve.user's group's; a crash's socket removed
        why = clear_stale(spec.socket)
        if why is not None:
            return f"{why}; {spec.title} needs it"
    elif spec.port and not ops.port_free(spec.host, spec.port):
        return (f"port {spec.port} on {spec.host} is in use by "
                f"{ops.who_listens(spec.host, spec.port)}; {spec.title} needs it")
    want = spec.memory_fraction
    for gpu in gpus:
        s = gpu.sample()
        others = [pid for pid, _ in gpu.compute_processes() if ops.uid_of(pid) != spec.identity.uid]
        if others:
            return f"GPU{gpu.index} runs other compute processes {others}"
        if s.memory_total_bytes and s.memory_used_bytes is not None:
            free = s.memory_total_bytes - s.memory_used_bytes - (s.memory_reserved_bytes or 0)
            if free < want * s.memory_total_bytes:
                return (f"GPU{gpu.index} has {free / 2**30:.1f} GiB free, less than "
                        f"{spec.memory_flag} {want:g} of {s.memory_total_bytes / 2**30:.1f} GiB")
    return None
