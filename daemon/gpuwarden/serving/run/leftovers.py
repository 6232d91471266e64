"""What an earlier daemon left running that this one does not run: the recorded children this config does not
name (stopped as a stop would: SIGTERM, SIGKILL after the grace, never waiting), and strays found in the unit's
cgroup as the users that ran our children (processes.find_strays). The serving runtime holds one Leftovers."""

from __future__ import annotations

import dataclasses
import logging
import signal
from collections.abc import Iterable
from dataclasses import dataclass

from . import handover
from .processes import KILL_WAIT_S, STRAY_GRACE_S, Child, ProcessOps, Strays, find_strays

log = logging.getLogger("gpuwarden")


@dataclass
class _Unnamed:
    """A child the daemon before this one recorded and this one's config does not name (the proxy turned off
    between a crash and the restart): stopping, and in the record until its group is gone, so that a crash
    meanwhile still knows it and `gpuwarden cleanup` still ends it."""

    entry: handover.Recorded  # as recorded, with the output pipe this daemon reads now
    child: Child
    kill_at: float  # SIGKILL then; once killed, when to give up on survivors
    killed: bool = False


class Leftovers:
    def __init__(self, ops: ProcessOps):
        self.ops = ops
        self.unnamed: list[_Unnamed] = []  # recorded children this config does not name, being stopped
        # Leftovers found in the unit's cgroup (processes.find_strays) as the users that ran our children, being
        # stopped; looked for at a start with a record, and whenever nothing runs any more (sweep).
        self.strays = Strays()
        self.uids: set[int] = set()
        self._grace = STRAY_GRACE_S

    @property
    def recorded(self) -> list[handover.Recorded]:
        """The unnamed children still stopping: not adopted, but ours to end until gone."""
        return [leaving.entry for leaving in self.unnamed]

    def sweep(self, record: handover.Record | None, grace: float | None, now: float, live: Iterable[int]) -> None:
        """Stop what is left of our children outside every running child's group (live: their leaders): after a
        crash (a record), a process that left an engine's group had init for its parent, not this daemon
        (escaped() misses it)."""
        if record is not None:
            self.uids.update(c.uid for c in record.children)
        if grace is not None:
            self._grace = grace
        live = [*live, *(leaving.child.pid for leaving in self.unnamed)]
        self.strays.end(find_strays(self.uids, live), self.uids, live, now, self._grace)

    def stop(self, entry: handover.Recorded, fd: int | None, now: float, grace: float, why: str) -> None:
        """A recorded child no program of this daemon takes over: stopped as a stop would (SIGTERM to its group
        now, SIGKILL after grace, in tick), if it is provably the recorded process (ops.adopt proves it; a
        recycled PID is never signalled). Its output is read meanwhile, so that its last lines are logged."""
        child = self.ops.adopt(entry, fd, lambda line: log.info("%s: %s", entry.name, line))
        if child is None:
            return
        self.ops.killpg(child.pgid, signal.SIGTERM)
        log.warning("%s pid %d: recorded by the daemon before, %s: stopping it (SIGTERM to its process group, "
                    "SIGKILL after %g s)", entry.name, entry.pid, why, grace)
        self.unnamed.append(_Unnamed(dataclasses.replace(entry, fd=child.output_fd), child, now + grace))

    def tick(self, now: float) -> None:
        """Advance the stops of unnamed children (never waiting): SIGKILL once the grace is over; gone once
        their group is empty."""
        for leaving in list(self.unnamed):
            self.ops.poll(leaving.child)  # reap the leader (a re-exec's own child)
            alive = self.ops.group_pids(leaving.child.pgid)  # a group's ID is not reused while it has members
            if alive and now < leaving.kill_at:
                continue
            if alive and not leaving.killed:
                log.warning("%s pid %d did not stop within its grace: SIGKILL to its %d processes",
                            leaving.entry.name, leaving.entry.pid, len(alive))
                self.ops.killpg(leaving.child.pgid, signal.SIGKILL)
                leaving.killed, leaving.kill_at = True, now + KILL_WAIT_S
                continue
            if alive:
                log.error("processes %s of the recorded %s's group survived SIGKILL for %g s", alive,
                          leaving.entry.name, KILL_WAIT_S)
            self.unnamed.remove(leaving)

    def kill_now(self, now: float) -> None:
        """A second stop request: no more grace."""
        for leaving in self.unnamed:
            if not leaving.killed:
                leaving.kill_at = now
        self.tick(now)
        self.strays.hurry(now)
