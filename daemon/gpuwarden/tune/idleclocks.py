"""serve.idle's `clocks` (design/idle-engine.md): while the engine rests, its GPUs at their lowest supported SM
clock, put back before the proxy sends the next request.

An engine at rest still holds its CUDA context, and a context at rest holds the card at its boost clock: on an H200
116.2 W at 1980 MHz against 76.9 W bare, whatever the memory it holds. CUDA_DISABLE_PERF_BOOST=1 kept the same
context at 76.6 W, and slowed every first burst; a lock at the lowest clock for the rest only aims at that draw
without the cost (not measured: the lent H200s are read-only, so no lock could be set there).

The rest holds the one lease on the GPUs' settings (sweeps.py): a tune sweep waits for its end and a rest for a
sweep's; the tuning re-applies nothing over it and its clock alerts are a sweep's, silent (a choice, not a fault);
its marker is on disk before the lock, so a daemon killed during a rest puts the clocks back at its next start
(Sweeps.recover); the wake puts back what the config locks, else what the card had before gpuwarden (Sweeps.end).
"""

from __future__ import annotations

import math

from .sweeps import Lease, Sweeps
from .tuning import Action, GpuPlan, Plan

REST = "serve.idle's rest"  # the peer and owner of a rest's lease: no connection of tune's is it
SETTING = "gpu_clocks"


class IdleClocks:
    def __init__(self, sweeps: Sweeps):
        self.sweeps = sweeps
        self._locks: dict[int, tuple] = {}  # the tuning's locks of the rested GPUs, shown again at the wake
        self._rested: list[int] = []  # the GPUs of the rest under way (its lease may have been ended by another)
        self._engine: tuple[int, ...] = ()  # the engine's pids of that rest: its processes are not another's

    @property
    def resting(self) -> bool:
        lease = self.sweeps.lease
        return lease is not None and lease.owner is REST

    def rest(self, gpus: list[int], engine: tuple[int, ...] = ()) -> str | None:
        """These GPUs (the engine's) at their lowest supported SM clock, read back. None when done; else why not,
        in a line, with nothing left changed. engine: its processes' pids (sweeps.other_processes)."""
        sweeps, tuning = self.sweeps, self.sweeps.tuning
        if sweeps.lease is not None:
            return f"a sweep of {sweeps.lease.setting} holds the GPUs ({sweeps.lease.peer})"
        if not tuning.config.tuning.apply:
            return "this daemon is read-only (tuning.apply: false)"
        lows = {}
        for gpu in tuning.backend.gpus():
            if gpu.index in gpus:
                clocks = gpu.capabilities().graphics_clocks_mhz
                if not clocks:
                    return f"GPU {gpu.index} reports no supported graphics clocks"
                lows[gpu.index] = (gpu, min(clocks))
        if not lows:
            return "the engine names no GPU"
        self._engine = engine
        if others := sweeps.other_processes(sorted(lows), engine):  # a sweep refuses them too: their work is not ours to slow
            return f"other processes than the engine use its GPUs ({', '.join(map(str, others))})"
        try:  # no marker, no rest: a daemon killed during it would leave the cards slow for good
            sweeps.take(Lease(SETTING, sorted(lows), math.inf, math.inf, REST, REST, kind="rest"))
        except OSError as exc:
            return f"its marker cannot be saved to {sweeps.marker} ({exc.strerror or exc})"
        self._locks = {i: tuning.locks[i] for i in lows if i in tuning.locks}
        try:
            plan = Plan(tuple(GpuPlan(i, g.uuid, "", (Action(i, g.uuid, SETTING, g.sample().sm_clock_mhz,
                                                              (low, low), True, "rest"),))
                              for i, (g, low) in sorted(lows.items())))
            failed = [o.describe() for o in tuning.tuner.apply(plan) if not o.ok]
            failed += [o.describe("verified") for o in tuning.tuner.verify(plan) if not o.ok]
        except Exception as exc:  # a GPU that vanished meanwhile, a bug: the lease must not outlive the rest
            failed = [f"{type(exc).__name__}: {exc}"]
        if failed:
            self.wake("the rest's lock failed")
            return "; ".join(failed)
        self._rested = sorted(lows)
        for i, (_, low) in lows.items():  # shown as the lock in force (gpuwarden_gpu_sm_clock_lock_hertz)
            tuning.locks[i] = ((low, low), tuning.locks.get(i, (None, None))[1])
        return None

    def others(self) -> list[int]:
        """Processes not the daemon's that compute on the rested GPUs now (a rest ends for them: they would run at
        the lowest clock)."""
        return self.sweeps.other_processes(self._rested, self._engine) if self._rested else []

    def wake(self, why: str) -> list[str] | None:
        """The rest's clocks put back and read back (what each GPU got, a line each; none where its lease was ended
        already: a tune sweep's begin, the daemon's stop); None: no rest was under way."""
        if not self._rested and not self.resting:
            return None
        gpus, tuning = self._rested or list(self.sweeps.lease.gpus), self.sweeps.tuning
        self._rested = []
        try:
            done = self.sweeps.end(why) if self.resting else []
        except Exception as exc:  # the lease is gone; its marker stays, and the next start puts the cards back
            done = [f"putting the clocks back FAILED: {type(exc).__name__}: {exc}"]
        for i in gpus:  # the tuning's own locks shown again
            if i in self._locks:
                tuning.locks[i] = self._locks[i]
            else:
                tuning.locks.pop(i, None)
        return done
