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
from typing import TYPE_CHECKING

from .states import FATAL, HELD, RUNNING, STOPPED, STOPPING

if TYPE_CHECKING:
    from .supervisor import Program

log = logging.getLogger("gpuwarden")


def waiting_for(gpu: int, why: str) -> str:
    """A held child's problem, from the events' "what: action" (eventwatch.EventBook.needs_reset), e.g. "waiting for
    GPU0's action: reset the GPU (double-bit ECC error)"; gpu -1: a GPU that could not be named."""
    what, _, action = why.rpartition(": ")
    who = f"GPU{gpu}'s" if gpu >= 0 else "an unnamed GPU's"
    return f"waiting for {who} action: {action} ({what})" if what else f"waiting for {who} action: {why}"


class Holding:
    """Program's hold and release: it owns the reason of a hold whose drain runs; it never restarts a child but at
    release(), and moves the program only through its enter() and within()."""

    def __init__(self, program: Program):
        self.program = program
        self.held_for: str | None = None  # a hold's drain runs: HELD with this reason once the child has stopped

    def hold(self, now: float, reason: str, drain: bool = False) -> None:
        """End the child (drain: a planned stop first, when it serves and its engine drains) and wait in HELD
        with reason as its problem (the STATUS line and /status say it), until release() or SIGHUP (reset)."""
        p = self.program
        if p.state == HELD:
            if reason != p.problem:
                p.within(problem=reason)
            return
        if p.state in (FATAL, STOPPED, STOPPING):
            return  # FATAL: its own fault, said already; a planned stop (or this hold's drain) runs
        if drain and p.state == RUNNING and p.spec.drain_s:
            log.warning("%s held: %s; draining it first (up to %g s)", p.title, reason, p.spec.drain_s)
            p.stop(now)
            self.held_for = reason
            return
        if p.child is not None:  # in BACKOFF there is none: the HELD line says it all
            p.end_child(f"{p.title} stopped: {reason}")
        self._enter(reason)

    def forget(self) -> None:
        """A stop asked for now: it ends in STOPPED, not in a hold."""
        self.held_for = None

    def stopped(self) -> None:
        """The child stopped: HELD if a hold's drain stopped it (a stop asked since cleared held_for)."""
        reason, self.held_for = self.held_for, None
        if reason is not None:
            self._enter(reason)

    def _enter(self, reason: str) -> None:
        p = self.program
        p.enter(HELD, f"{p.title} held, not restarting: {reason}", logging.WARNING, problem=reason)

    def release(self, now: float, why: str) -> bool:
        """The GPU is back: start again from scratch, the restart budget whole. False: it was not held."""
        p = self.program
        if p.state != HELD:
            return False
        p.backoff.reset()
        p.enter(STOPPED, f"{p.title} released: {why}; starting it again", logging.WARNING)
        p.start(now)
        return True
