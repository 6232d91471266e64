"""A child held for its GPU: a GPU it runs on must not serve until its action is done (a reset, a reboot), so the
child is stopped and waits in HELD. Not FATAL: the fault is the GPU's, not the engine's (vllm_fatal, whose fix
blames the engine's error lines, stays quiet), and not BACKOFF: a restart into the same fault would only spend the
restart budget and end in FATAL with no useful word. release() starts it again once the GPU is back.

Where the GPU still answers, the stop may drain (health.drain_before_stop): the same planned stop a reload makes,
SIGTERM to the engine's leader and serve.drain_s for the requests in flight, then HELD; where it is lost, nothing
in flight can finish, and the group is killed at once.
"""

from __future__ import annotations

import logging

from .states import FATAL, HELD, RUNNING, STOPPED, STOPPING

log = logging.getLogger("gpuwarden")


def waiting_for(gpu: int, why: str) -> str:
    """A held child's problem, from the events' "what: action" (eventwatch.EventBook.needs_reset), e.g. "waiting for
    GPU0's action: reset the GPU (double-bit ECC error)"; gpu -1: a GPU that could not be named."""
    what, _, action = why.rpartition(": ")
    who = f"GPU{gpu}'s" if gpu >= 0 else "an unnamed GPU's"
    return f"waiting for {who} action: {action} ({what})" if what else f"waiting for {who} action: {why}"


class Holding:
    """Program's hold and release (serving/run/supervisor.py); every state change goes through its _transition."""

    _held_for: str | None = None  # a hold's drain runs: HELD with this reason once the child has stopped

    def hold(self, now: float, reason: str, drain: bool = False) -> None:
        """End the child (drain: a planned stop first, when it serves and its engine drains) and wait in HELD
        with reason as its problem (the STATUS line and /status say it), until release() or SIGHUP (reset)."""
        if self.state == HELD:
            if reason != self.problem:
                self._within(problem=reason)
            return
        if self.state in (FATAL, STOPPED, STOPPING):
            return  # FATAL: its own fault, said already; a planned stop (or this hold's drain) runs
        if drain and self.state == RUNNING and self.spec.drain_s:
            log.warning("%s held: %s; draining it first (up to %g s)", self.title, reason, self.spec.drain_s)
            self.stop(now)
            self._held_for = reason
            return
        if self.child is not None:  # in BACKOFF there is none: the HELD line says it all
            self._end_child(f"{self.title} stopped: {reason}")
        self._enter_hold(reason)

    def _stopped_for_hold(self) -> None:
        """The child stopped: HELD if a hold's drain stopped it (a stop asked since cleared _held_for)."""
        reason, self._held_for = self._held_for, None
        if reason is not None:
            self._enter_hold(reason)

    def _enter_hold(self, reason: str) -> None:
        self._transition(HELD, f"{self.title} held, not restarting: {reason}", logging.WARNING, problem=reason)

    def release(self, now: float, why: str) -> bool:
        """The GPU is back: start again from scratch, the restart budget whole. False: it was not held."""
        if self.state != HELD:
            return False
        self.backoff.reset()
        self._transition(STOPPED, f"{self.title} released: {why}; starting it again", logging.WARNING)
        self.start(now)
        return True
