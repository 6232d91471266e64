"""A child at rest (serve.idle's `stop`, design/idle-engine.md): the proxy saw no request for after_s, so the engine
is stopped as a reload stops it (the proxy told first, then the drain) and waits in RESTING, neither restarted nor
FATAL, its GPUs free of its context; the proxy's word that a request came (word.WAKE) starts it again, the restart
budget untouched: a rest is no failure. A part of Program (serving/run/supervisor.py), which it moves only through
the program's enter().

serve.idle's `clocks` rests the engine's GPUs instead: the engine runs on, its GPUs at their lowest clock through
the daemon's seam (tune/idleclocks.py); the proxy is told REST all the same, and the wake puts the clocks back
before it is told UP."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from .states import RESTING, RUNNING, STOPPED

if TYPE_CHECKING:
    from .supervisor import Program

log = logging.getLogger("gpuwarden")


class Resting:
    def __init__(self, program: Program):
        self.program = program
        self.rest_for: str | None = None  # a rest's planned stop runs: RESTING with this reason once it stopped
        self.rests = 0  # rests begun, for the view
        self.waking = False  # started by a wake: its time to healthy is the wake's
        self.wake_s: float | None = None  # the last wake's, from the word to healthy (clocks: to the clocks back)
        self.clocks = False  # serve.idle's clocks: the engine runs, its GPUs' clocks at rest
        self.woke_at = float("-inf")  # the last wake: no rest within after_s of it, whatever the proxy says
        self.front_pid: int | None = None  # the proxy told of the clocks rest: one restarted since knows nothing of it
        self.refused: str | None = None  # why the last clocks rest was refused: a warning once, then at INFO

    def rest(self, reason: str) -> bool:
        """The engine rests once its planned stop (which the caller begins) has stopped it; False: it does not serve
        now (not RUNNING), so there is nothing to rest."""
        if self.program.state != RUNNING:
            return False
        self.rest_for = reason
        return True

    def forget(self) -> None:
        """A stop asked for now (the daemon's stop, a reload): it ends in STOPPED, not at rest."""
        self.rest_for = None

    def stopped(self) -> None:
        """The child stopped: RESTING if a rest's stop stopped it."""
        reason, self.rest_for = self.rest_for, None
        p = self.program
        if reason is not None and p.state == STOPPED:  # not HELD: a GPU's hold that came meanwhile stands
            self.rests += 1
            p.enter(RESTING, f"{p.title} rests: {reason}; the next request wakes it")

    def wake(self, now: float, why: str) -> bool:
        """Start it again (a request came); False: it was not at rest."""
        p = self.program
        if p.state != RESTING:
            return False
        self.waking, self.woke_at = True, now
        p.enter(STOPPED, f"{p.title} wakes: {why}", logging.INFO)
        p.start(now)
        return True

    def healthy(self) -> None:
        """Healthy again: a wake's time is said once."""
        if self.waking:
            self.waking = False
            p = self.program
            self.wake_s = p.time_to_healthy_s
            log.info("%s awake: healthy %.1f s after the request that woke it", p.title, self.wake_s or 0.0)


def each_tick(children, idle, replacing: bool, now: float, stats, clocks=None) -> None:
    """The runtime's tick, for the rest: the GPUs told whether the engine holds a context on them (Gpu.note_engine:
    the simulator draws its watts), then the proxy's words heard (hear_idle). clocks: the daemon's seam for
    serve.idle's clocks (tune/idleclocks.IdleClocks), None where there is none."""
    main = children.main
    held = main.state not in (RESTING, STOPPED) and main.child is not None
    for gpu in main.spec.gpus:
        gpu.note_engine(held)
    hear_idle(children, idle, replacing, now, stats, clocks)


def hear_idle(children, idle, replacing: bool, now: float, stats, clocks=None) -> None:
    """serve.idle (idle: its IdleConfig, None: off), each tick: the proxy's word that no request came through it for
    after_s rests the engine (Supervisor.rest; clocks: rest_clocks), unless a replacement is under way or the
    engine's own metrics (stats) show a request running or waiting (one of the daemon's probes, or one that came
    since the word: the proxy says it again after the next quiet); its word that a request came while the engine
    rests wakes it (Supervisor.wake; clocks: wake_clocks). Each word is taken once."""
    main = children.main
    front = next((p for p in children.programs.values() if p.spec.fronts_engine and p.word is not None), None)
    if main.resting.clocks:
        why = clocks_end(idle, main.state, replacing, clocks, stats, front, main.resting.front_pid)
        if why is not None:
            wake_clocks(children, clocks, why, now=now)
    if idle is None and main.state == RESTING:  # a reload took serve.idle away: what rests is woken
        children.wake(now, "serve.idle is off")
    if front is None:
        return
    idles, wakes, front.word.idles, front.word.wakes = front.word.idles, front.word.wakes, 0, 0
    if wakes and main.resting.clocks:
        wake_clocks(children, clocks, "a request came through the proxy", request=True, now=now)
    elif wakes:
        children.wake(now, "a request came through the proxy")
    # An idle heard with a wake in one tick is older than the request that woke it: no rest on it (the request is
    # held at the proxy, so the engine's metrics could not show it). Nor within after_s of the last wake: the proxy
    # is serve.user's, and its words alone must not move the GPUs' clocks more often than the setting says.
    if wakes or not idles or idle is None or replacing or main.state != RUNNING or main.resting.clocks \
            or now - main.resting.woke_at < idle.after_s:
        return
    if stats is not None and (stats.requests_running or stats.requests_waiting):
        log.info("%s not rested: the proxy saw no request for %g s, but the engine has %d running and %d waiting",
                 main.title, idle.after_s, stats.requests_running or 0, stats.requests_waiting or 0)
        return
    reason = f"no request through the proxy for {idle.after_s:g} s"
    if idle.action == "clocks":
        rest_clocks(children, clocks, reason, front)
    else:
        children.rest(now, reason)


def clocks_end(idle, state: str, replacing: bool, clocks, stats, front=None, front_pid=None) -> str | None:
    """Why a clocks rest ends now, other than a request through the proxy; None: it goes on. front: the proxy now,
    front_pid: the process told of the rest (a proxy restarted since would send requests on at the lowest clock)."""
    if idle is None or idle.action != "clocks":
        return "serve.idle's clocks is off"
    if state != RUNNING:
        return f"the engine is {state}"
    if replacing:
        return "a reload replaces the engine"
    if clocks is None or not clocks.resting:
        return "the settings lease ended (a tune sweep began, or a reload)"
    if stats is not None and (stats.requests_running or stats.requests_waiting):
        return "the engine has a request running or waiting"  # one sent before the proxy held, or not through it
    if front is None or front.child is None or front.child.pid != front_pid:
        return "the proxy restarted: it does not hold requests for the rest"
    if others := clocks.others():
        return f"other processes than the engine use its GPUs ({', '.join(map(str, others))})"
    return None


def rest_clocks(children, clocks, reason: str, front=None) -> None:
    """serve.idle's clocks: the engine's GPUs at their lowest clock (the daemon's seam), then the proxy told REST: it
    holds the next request and says wake. Not while a stop or a swap of the children is under way; where the clocks
    cannot be set, the engine serves on as it is, said."""
    main = children.main
    if not children.may_rest:
        return
    engine = (main.child.pid,) if main.child is not None else ()
    why_not = clocks.rest([gpu.index for gpu in main.spec.gpus], engine) if clocks is not None else \
        "this daemon sets no GPU clock"
    if why_not is not None:
        # a tune sweep is a choice; another process on its GPUs, once until a rest succeeds (each quiet spell asks)
        level = logging.INFO if why_not.startswith("a sweep") or main.resting.refused == why_not else logging.WARNING
        main.resting.refused = why_not
        log.log(level, "%s does not rest its clocks (%s): %s; it serves on as it is", main.title, reason, why_not)
        return
    main.resting.refused = None
    main.resting.clocks = True
    main.resting.front_pid = front.child.pid if front is not None and front.child is not None else None
    main.resting.rests += 1
    log.info("%s rests (clocks): %s; its GPUs at their lowest clock until the next request", main.title, reason)
    children.tell_fronts()


def wake_clocks(children, clocks, why: str, request: bool = False, now: float | None = None) -> None:
    """The rest's clocks put back (the daemon's seam), and only then the proxy told UP: the held requests go to an
    engine at its configured clocks. request: a request woke it, and the wake's time (the put-back's) is shown."""
    main = children.main
    main.resting.clocks = False
    began = time.monotonic()
    main.resting.woke_at = began if now is None else now
    if clocks is not None:
        clocks.wake(why)
    took = time.monotonic() - began
    if request:
        main.resting.wake_s = took
    log.info("%s awake: its clocks back in %.3f s (%s)", main.title, took, why)
    children.tell_fronts()
