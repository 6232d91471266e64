"""A child's planned stop, a timed state: SIGTERM (to its group; an engine that drains, to its leader alone, the
group once the leader exited), then SIGKILL once stop_timeout_s has passed, advanced by each tick so that nothing
blocks the loop; a second stop request kills at once. A part of Program (serving/run/supervisor.py), which it
moves only through the program's enter() and within()."""

from __future__ import annotations

import logging
import signal
from typing import TYPE_CHECKING

from .processes import KILL_WAIT_S, Child, ProcessOps
from .states import RUNNING, STOPPED, STOPPING

if TYPE_CHECKING:
    from .supervisor import Program

log = logging.getLogger("gpuwarden")


class Stopping:
    """Program's stop: it owns no state of its own (the timers are the STOPPING phase's fields); it never starts a
    child and never leaves STOPPING but for STOPPED."""

    def __init__(self, program: Program):
        self.program = program

    def begin(self, now: float) -> None:
        """Begin a planned stop: SIGTERM now (to the group; an engine that drains, to its leader), SIGKILL once
        stop_timeout_s (for an engine that drains, at least its drain and a margin: serving/run/spec.py) has
        passed (in tick)."""
        p = self.program
        p.holding.forget()  # a stop asked for now is a stop, not the end of a hold's drain
        if p.state == STOPPING:
            return
        child = p.child
        if child is None:
            p.enter(STOPPED)
            return
        count, serving = len(p.ops.group_pids(child.pgid)), p.state == RUNNING
        # An engine that drains gets SIGTERM at its leader (the API server) alone, which ends its processes after the
        # drain: vLLM 0.32's worker signalled itself exits at once, and the requests in flight die (EngineDeadError).
        leader_only = bool(p.spec.drain_s)
        _sigterm(p.ops, child, leader_only)
        timeout = p.spec.timing.stop_timeout_s
        to = "its leader (its drain)" if leader_only else f"its {count} processes"
        p.enter(STOPPING, f"{p.title} stopping: SIGTERM to {to}, SIGKILL after {timeout:g} s", since=now,
                         child=child, kill_at=now + timeout, stop_count=count, started_wall=p.phase.started_wall,
                         leader_only=leader_only)
        p.drain.began(serving)

    def kill_now(self, now: float) -> None:
        """A second stop request: do not wait for the drain."""
        p = self.program
        if p.state == STOPPING and not p.phase.killed:
            log.warning("%s stop: asked again, SIGKILL now", p.title)
            p.within(kill_at=now, cut=True)
            self.tick(now)

    def tick(self, now: float) -> None:
        p = self.program
        phase = p.phase
        p.ops.poll(phase.child)  # reap the leader
        alive = p.ops.group_pids(phase.child.pgid)
        if alive and phase.leader_only and phase.child.pid not in alive:  # the leader is done: the rest follow it
            p.ops.killpg(phase.child.pgid, signal.SIGTERM)
            p.within(leader_only=False)
        if alive and now < phase.kill_at:
            return
        if alive and not phase.killed:
            log.warning("%s did not stop within %g s: SIGKILL to %d processes", p.title, now - phase.since,
                        len(alive))
            p.ops.killpg(phase.child.pgid, signal.SIGKILL)
            p.within(killed=True, kill_at=now + KILL_WAIT_S)
            p.drain.killed(phase.cut)
            return
        if alive:
            log.error("processes %s of %s's group survived SIGKILL for %g s", alive, p.title, KILL_WAIT_S)
            p.remains.dying.update(alive)
        p.ops.poll(phase.child)
        p.remains.kill_escaped()
        p.drain.ended(now - phase.since, phase.killed)
        p.enter(STOPPED, f"{p.title} stopped after {now - phase.since:.1f} s ({phase.stop_count} "
                                  "processes in its group at the stop)")
        p.holding.stopped()
        p.resting.stopped()


def _sigterm(ops: ProcessOps, child: Child, leader_only: bool) -> None:
    if leader_only:
        ops.kill(child.pid, signal.SIGTERM)
    else:
        ops.killpg(child.pgid, signal.SIGTERM)
