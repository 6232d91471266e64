"""A child's planned stop, a timed state: SIGTERM (to its group; an engine that drains, to its leader alone, the
group once the leader exited), then SIGKILL once stop_timeout_s has passed, advanced by each tick so that nothing
blocks the loop; a second stop request kills at once. A mixin of Program (serving/run/supervisor.py): every state
change goes through its _transition."""

from __future__ import annotations

import logging
import signal

from .processes import KILL_WAIT_S, Child, ProcessOps
from .states import RUNNING, STOPPED, STOPPING

log = logging.getLogger("gpuwarden")


class Stopping:
    """Program's stop (serving/run/supervisor.py)."""

    def stop(self, now: float) -> None:
        """Begin a planned stop: SIGTERM now (to the group; an engine that drains, to its leader), SIGKILL once
        stop_timeout_s (for an engine that drains, at least its drain and a margin: serving/run/spec.py) has
        passed (in tick)."""
        self._held_for = None  # a stop asked for now is a stop, not the end of a hold's drain
        if self.state == STOPPING:
            return
        child = self.child
        if child is None:
            self._transition(STOPPED)
            return
        count, serving = len(self.ops.group_pids(child.pgid)), self.state == RUNNING
        # An engine that drains gets SIGTERM at its leader (the API server) alone, which ends its processes after the
        # drain: vLLM 0.32's worker signalled itself exits at once, and the requests in flight die (EngineDeadError).
        leader_only = bool(self.spec.drain_s)
        _sigterm(self.ops, child, leader_only)
        timeout = self.spec.timing.stop_timeout_s
        to = "its leader (its drain)" if leader_only else f"its {count} processes"
        self._transition(STOPPING, f"{self.title} stopping: SIGTERM to {to}, SIGKILL after {timeout:g} s", since=now,
                         child=child, kill_at=now + timeout, stop_count=count, started_wall=self.phase.started_wall,
                         leader_only=leader_only)
        self.drain.began(serving)

    def kill_now(self, now: float) -> None:
        """A second stop request: do not wait for the drain."""
        if self.state == STOPPING and not self.phase.killed:
            log.warning("%s stop: asked again, SIGKILL now", self.title)
            self._within(kill_at=now, cut=True)
            self._stopping(now)

    @property
    def stopped(self) -> bool:
        return self.state == STOPPED

    def _stopping(self, now: float) -> None:
        phase = self.phase
        self.ops.poll(phase.child)  # reap the leader
        alive = self.ops.group_pids(phase.child.pgid)
        if alive and phase.leader_only and phase.child.pid not in alive:  # the leader is done: the rest follow it
            self.ops.killpg(phase.child.pgid, signal.SIGTERM)
            self._within(leader_only=False)
        if alive and now < phase.kill_at:
            return
        if alive and not phase.killed:
            log.warning("%s did not stop within %g s: SIGKILL to %d processes", self.title, now - phase.since,
                        len(alive))
            self.ops.killpg(phase.child.pgid, signal.SIGKILL)
            self._within(killed=True, kill_at=now + KILL_WAIT_S)
            self.drain.killed(phase.cut)
            return
        if alive:
            log.error("processes %s of %s's group survived SIGKILL for %g s", alive, self.title, KILL_WAIT_S)
            self.remains.dying.update(alive)
        self.ops.poll(phase.child)
        self.remains.kill_escaped()
        self.drain.ended(now - phase.since, phase.killed)
        self._transition(STOPPED, f"{self.title} stopped after {now - phase.since:.1f} s ({phase.stop_count} "
                                  "processes in its group at the stop)")
        self._stopped_for_hold()


def _sigterm(ops: ProcessOps, child: Child, leader_only: bool) -> None:
    if leader_only:
        ops.kill(child.pid, signal.SIGTERM)
    else:
        ops.killpg(child.pgid, signal.SIGTERM)
