"""Run the serving engine (and any other child) as well-behaved children: explicit states, health checks,
backoff, no orphans.

Modelled on supervisor's process.py: each Program is one child with its own
state machine (STOPPED, STARTING, RUNNING, BACKOFF, STOPPING, EXITED, FATAL and HELD),
"died while starting" told apart from "died later", and every OS call behind
one seam (processes.ProcessOps) that tests replace. Every state change goes
through enter(), which checks it against ALLOWED_FROM, logs it and counts
it (the count is published in the view and exported). Nothing here blocks the
loop: STOPPING is a timed state that tick() advances (SIGTERM, stop_timeout_s,
then SIGKILL), and /health is read on a worker thread with a total deadline.
The Supervisor runs one or more Programs side by side. Policy stays out of the state
machine: what a kind needs beyond it (the multi-node rank watch) plugs in as its spec's
policy (serving/run/policy.py, ranks.py), and changes state only through enter().

The child runs in its own session, so its process group holds the API server
and every engine/worker process it forks; that group is what gets SIGTERM
(an engine that drains: its leader first, the group once the leader exited),
then SIGKILL, and what must be empty before the next start. A process that
left the group (setsid, double fork) is found through the subreaper and killed
with it.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import signal
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ...base import unixsock
from ...base.keptlistener import CHILD_ENV
from ..compose.secrets import redact_argv
from .backoff import Backoff
from .drains import DrainLog
from .health import judge
from .output import ChildOutput
from .policy import PREFLIGHT_RETRY_S, Policy
from .preflight import Remains, preflight
from .processes import UNSEEN_EXIT, Child, ProcessOps
from .fronts import HEAR_S, FrontWord
from .holding import Holding
from .resting import Resting
from .word import WORD_ENV, WordReader, make_pipe
from .stopping import Stopping
from .spec import ChildSpec
from .states import (BACKOFF, EXITED, FATAL, HELD, RESTING, RUNNING, STARTING, STATES,  # noqa: F401 (theirs)
                     STOPPED, STOPPING)

log = logging.getLogger("gpuwarden")

# new state -> the states it may be entered from
ALLOWED_FROM = {
    STARTING: (STOPPED, BACKOFF),
    RUNNING: (STARTING,),
    EXITED: (STARTING, RUNNING),
    BACKOFF: (STOPPED, BACKOFF, EXITED),
    STOPPING: (STARTING, RUNNING),
    STOPPED: (STOPPED, STOPPING, BACKOFF, EXITED, FATAL, HELD, RESTING),
    FATAL: (STOPPED, BACKOFF, EXITED),
    HELD: (STOPPED, BACKOFF, EXITED, RESTING),  # its GPU must not serve (holding.py): released through STOPPED
    RESTING: (STOPPED,),  # stopped while no request comes (resting.py): woken through STOPPED
}
# What a child that could not bind its port says, as vLLM's OSError and uvicorn's own line write it.
PORT_TAKEN = re.compile(r"address already in use", re.IGNORECASE)


class TransitionError(RuntimeError):
    """A state change the table does not allow: a bug in the supervisor, never user input."""


@dataclass(frozen=True)
class ServingView:
    """One supervised child as the snapshot, the metrics and `gpuwarden status` see it."""

    state: str
    model: str
    profile: str
    pid: int | None
    restarts: int
    last_exit_code: int | None
    time_to_healthy_s: float | None
    problem: str | None  # why it is not serving, when it is not
    blocked: bool = False  # waiting for the GPUs or the port to be free before a start
    engine: str = "vllm"  # the engine's name: the metrics' engine label
    title: str = "vLLM"  # the engine's name in messages
    transitions: tuple[tuple[str, str, int], ...] = ()  # (from, to, count) since the daemon started
    stalled: str | None = None  # why it counts as stalled, until it runs healthy again
    stalls: int = 0
    gpus: tuple[int, ...] = ()  # the GPUs it runs on
    started_at: float | None = None  # when its process started (seconds since the epoch), adopted ones too
    version: str = ""  # the engine's installed version, where known
    role: str = ""  # "head" or "worker" of a multi-node engine; "" on one host
    rank: int | None = None
    nodes: int = 1
    head: str = ""  # the head's rendezvous HOST:PORT
    head_up: bool | None = None  # a worker: the head's rendezvous answered when last asked (None: not a worker)
    probes: int = 0  # liveness probes answered since it last turned RUNNING
    drains: tuple[tuple[str, int], ...] = ()  # (outcome, count) of the engine's planned stops (serving/run/drains.py)
    rests: int = 0  # rests begun while no request came (serve.idle: serving/run/resting.py)
    wake_s: float | None = None  # the last wake's seconds from the request that woke it to healthy
    clocks_rest: bool = False  # running, its GPUs at their lowest clock while no request comes (serve.idle's clocks)

    @classmethod
    def of(cls, program: Program) -> ServingView:
        spec, phase = program.spec, program.phase
        return cls(phase.state, spec.model, spec.profile, phase.child.pid if phase.child else None,
                   program.restarts, program.last_exit_code, program.time_to_healthy_s, phase.problem, phase.blocked,
                   program.name, program.title,
                   tuple((old, new, n) for (old, new), n in sorted(program.transitions.items())),
                   program.stalled, program.stalls, tuple(g.index for g in program.gpus), phase.started_wall,
                   spec.version, spec.role, spec.rank, spec.nodes, spec.head,
                   program.policy.head_up(phase.state == RUNNING, phase.probe_failures), phase.probes,
                   program.drain.view(), program.resting.rests, program.resting.wake_s, program.resting.clocks)


@dataclass(frozen=True)
class Phase:
    """The state and everything that lives and dies with it. Only enter() makes a new Phase; within a
    state, within() changes the fields that state owns (a probe failure counted, the next probe's time)."""

    state: str
    since: float = 0.0
    child: Child | None = None  # STARTING, RUNNING, STOPPING: the running process group
    started_wall: float | None = None  # STARTING, RUNNING, STOPPING: when its process started (epoch seconds)
    started: float = 0.0  # STARTING, RUNNING: when it was spawned (a /health answer from before is stale)
    problem: str | None = None  # BACKOFF, FATAL: why it is not serving; STARTING: the ranks a head waits for
    blocked: bool = False  # BACKOFF: waiting for the GPUs or the port, not after a failure
    retry_at: float = 0.0  # BACKOFF: when the next start is tried
    next_probe: float = 0.0  # RUNNING: when /health is asked next
    probe_failures: int = 0  # RUNNING: liveness probes failed in a row
    probes: int = 0  # RUNNING: liveness probes answered, passed or failed (in /status: an event a test can wait on)
    kill_at: float = 0.0  # STOPPING: SIGKILL then (or, once killed, give up on survivors then)
    killed: bool = False  # STOPPING: SIGKILL sent
    stop_count: int = 0  # STOPPING: processes in the group when the stop began
    cut: bool = False  # STOPPING: a second stop asked for SIGKILL now, cutting the drain short
    leader_only: bool = False  # STOPPING: SIGTERM went to the leader alone (a drain); the group's comes once it exits


def _of_phase(name: str) -> property:
    """A field of the program's current phase, read-only: only enter and within change the phase."""
    return property(lambda program: getattr(program.phase, name))


class Program:
    """One supervised child: runs a ChildSpec (serving/run/spec.py), whatever kind of child it describes; a
    kind that needs more than the states (the multi-node rank watch) plugs its policy in (serving/run/policy.py)."""

    def __init__(self, spec: ChildSpec, ops: ProcessOps | None = None, clock: Callable[[], float] = time.monotonic,
                 drains: Counter | None = None):
        self.spec = spec
        self.name, self.title = spec.name, spec.title
        self.identity = spec.identity
        self.gpus = list(spec.gpus)
        self.ops = ops or ProcessOps()
        self.clock = clock
        self.phase = Phase(STOPPED)
        self.restarts = 0
        self.last_exit_code: int | None = None
        self.time_to_healthy_s: float | None = None
        self.stalled: str | None = None
        self.stalls = 0
        self.transitions: Counter = Counter()  # (from, to) -> count
        self.output = ChildOutput(self.name, spec.log_level)  # logged at its levels; its last error lines kept
        self.on_line, self.error_lines = self.output.on_line, self.output.error_lines
        self._probe = self.ops.background(f"{self.name}-health")
        self.backoff = Backoff()  # the restart budget (serving/run/backoff.py)
        self.remains = Remains(self.ops, self.title)  # what is left of the groups before: a start waits for it
        self.policy: Policy = spec.policy(self) if spec.policy is not None else Policy()
        self.drain = DrainLog(self.title, spec.drain_s, drains)  # what a planned stop let finish (drains.py)
        self.stopping = Stopping(self)  # its planned stop, a timed state (stopping.py)
        self.holding = Holding(self)  # its hold for a GPU's action, and the release (holding.py)
        self.resting = Resting(self)  # its rest while no request comes, and the wake (resting.py)
        self.word: WordReader | None = None  # a front's word back (its answers to the engine's stop: word.py)

    # -- the state, read through the phase ----------------------------------------------
    state = _of_phase("state")  # str
    child = _of_phase("child")  # Child | None
    problem = _of_phase("problem")  # str | None
    blocked = _of_phase("blocked")  # bool

    @property
    def _links_probe(self):  # the rank watch's reader of the rendezvous connections (a test slows it down)
        return self.policy.links

    @_links_probe.setter
    def _links_probe(self, background) -> None:
        self.policy.links = background

    # -- the one way to change state ---------------------------------------------------
    def enter(self, new: str, message: str | None = None, level: int = logging.INFO, **fields) -> None:
        """Enter state new with the fields it owns (every other field of the old phase ends with it)."""
        old = self.state
        if old not in ALLOWED_FROM[new]:
            raise TransitionError(f"{self.title} supervisor: {old} -> {new} is not allowed")
        fields.setdefault("since", self.clock())
        self.phase = Phase(new, **fields)
        self.transitions[(old, new)] += 1
        if message:
            log.log(level, "%s", message)

    def within(self, **fields) -> None:
        """Change fields the current state owns, staying in it."""
        self.phase = dataclasses.replace(self.phase, **fields)

    # -- what a policy may do (serving/run/policy.py) -----------------------------------
    def note_problem(self, problem: str | None) -> None:
        """Why a child that starts is not healthy yet (a head's missing ranks), staying in its state."""
        self.within(problem=problem)

    def end_part(self, now: float, reason: str, problem: str, wait: float, blocked: bool = True,
                 message: str | None = None) -> None:
        """End the child for a cause outside it (its port taken, a rank or the head lost) and start again after
        wait: no failure is counted, no restart budget spent."""
        try:
            self.end_child(reason)
        finally:
            self.enter(BACKOFF, message, logging.WARNING, since=now, problem=problem, blocked=blocked,
                             retry_at=now + wait)

    # -- life cycle -------------------------------------------------------------------
    def start(self, now: float) -> None:
        if self.state not in ALLOWED_FROM[STARTING]:
            return
        blocked = preflight(self.spec, self.gpus, self.ops, self.remains, self.policy, self.clock())
        if blocked:
            if blocked != self.problem:  # the alert vllm_start_blocked warns, with reminders; this is the detail
                log.info("%s start waits: %s", self.title, blocked)
            self.enter(BACKOFF, since=now, problem=blocked, blocked=True, retry_at=now + PREFLIGHT_RETRY_S)
            return
        self.error_lines.clear()
        spec = self.spec
        try:
            child, word_fd = _spawn(spec, self.ops, spec.runs_as, self.on_line)
        except (OSError, ValueError, TypeError) as exc:  # missing binary, unreadable venv, NUL byte, ...
            self._failed(now, f"{self.title} could not be started: {_describe_error(exc)}")
            return
        self.listen_to(child, word_fd)
        self._probe.discard()
        self.policy.spawned()
        profile = f", profile {spec.profile}" if spec.profile else ""
        self.enter(STARTING, f"{self.title} starting (pid {child.pid}{profile}, user {self.identity.name}{_launcher(spec)}): "
                                   + " ".join(redact_argv(spec.argv)), since=now, child=child, started=now,
                         started_wall=time.time())

    def listen_to(self, child: Child, word_fd: int | None) -> None:
        """The child's word pipe (word.py), read each tick from now on; None: it has none (not a front, or adopted
        without one kept: its answers are not heard, and a stop waits HEAR_S for it)."""
        if self.word is not None:
            self.word.close()
        child.word_fd = word_fd
        self.word = WordReader(word_fd) if word_fd is not None else None

    def adopt(self, child: Child, now: float, started_wall: float, how: str, starting: bool | None = False) -> None:
        """Take over a running child an earlier daemon started (serving/run/handover.py proved it ours). One that
        was RUNNING is RUNNING at once, its liveness probe due now, so its health, metrics and stalls are watched
        from this poll on. One that was still STARTING (a model loading) stays STARTING: its health is awaited
        and startup_timeout_s counts from its own start, as for the daemon that started it; liveness probes
        would kill it before it could load. One whose state was not recorded (starting None: an older daemon's
        record) is STARTING too, startup_timeout_s counted from now: a serving one is RUNNING at its first
        answer, a loading one is not cut short. One line says so, with its PID and uptime."""
        up = max(0.0, time.time() - started_wall)
        if starting is not False:
            state = "still starting" if starting else "its state not recorded (an older gpuwarden's record)"
            self.enter(STARTING, f"{self.title} adopted after {how}: pid {child.pid}, up {_duration(up)}, "
                                       f"{state}: waiting for its health", since=now, child=child,
                             started=now - up if starting else now, started_wall=started_wall)
            return
        # Through STARTING, as every child: it was started, only not by this daemon.
        self.enter(STARTING, since=now, child=child, started=now, started_wall=started_wall)
        self.enter(RUNNING, f"{self.title} adopted after {how}: pid {child.pid}, up {_duration(up)}, "
                                  "still serving", since=now, child=child, started=now, started_wall=started_wall,
                         next_probe=now)

    def tick(self, now: float) -> None:
        if self.word is not None:
            self.word.read()
        if self.state != STOPPING:
            self.remains.confirm_gone()
        if self.state == BACKOFF and now >= self.phase.retry_at:
            self.start(now)
        elif self.state == STOPPING:
            self.stopping.tick(now)
        elif self.state in (STARTING, RUNNING):
            code = self.ops.poll(self.child)
            if code is not None:
                died = "died while starting" if self.state == STARTING else "exited"
                reason = f"{self.title} {died} with {_describe_exit(code)}"
                if self.state == STARTING and self.spec.listens and any(map(PORT_TAKEN.search, self.error_lines)):
                    self._lost_port(now, f"{reason}: {self.spec.where} was taken by "
                                         "another process after our check, before it could bind")
                else:
                    self._failed(now, reason, code)
            elif self.state == STARTING:
                self._starting(now)
            else:
                self._running(now)

    def _health(self) -> tuple[bool | None, str]:
        """The latest answer of this child's probe (serving/run/health.py)."""
        return judge(self.spec, self._probe, self.ops, self.child, self.phase.started, self.policy.waiting)

    def _starting(self, now: float) -> None:
        healthy, why = self._health()
        timing = self.spec.timing
        started = self.phase.started
        if healthy:
            self.time_to_healthy_s = now - started
            self.stalled = None  # a stall ends with a healthy new child
            where = unixsock.shown(self.spec.url) if self.spec.listens else "its node, the head answering"
            self.enter(RUNNING, f"{self.title} healthy after {self.time_to_healthy_s:.1f} s on "
                                      f"{where}", since=now, child=self.child, started=started,
                             started_wall=self.phase.started_wall, next_probe=now + timing.liveness_interval_s)
            self.resting.healthy()
        elif healthy is False and f"not by {self.title}'s process group" in why:
            self._lost_port(now, f"{self.title} not trusted: {why}")
        elif now - started > timing.startup_timeout_s:
            self._failed(now, f"{self.title} not healthy within startup_timeout_s {timing.startup_timeout_s:g} s")
        else:
            self.policy.watch(now, starting=True)

    def _running(self, now: float) -> None:
        timing = self.spec.timing
        self.backoff.running(now, self.phase.since, timing)
        if self.policy.watch(now, starting=False) or now < self.phase.next_probe:
            return
        healthy, why = self._health()
        if healthy is None:
            return  # still waiting for this probe's answer
        if healthy:
            self.within(next_probe=now + timing.liveness_interval_s, probe_failures=0, probes=self.phase.probes + 1)
            return
        failures = self.phase.probe_failures + 1
        self.within(next_probe=now + timing.liveness_interval_s, probe_failures=failures,
                     probes=self.phase.probes + 1)
        log.warning("%s liveness probe failed (%d of %d): %s", self.title, failures, timing.liveness_failures, why)
        if failures >= timing.liveness_failures and not self.policy.liveness_lost(now, why):
            self._failed(now, f"{self.title} failed {failures} liveness probes in a row")

    def note_stall(self, now: float, reason: str | None, restart: bool) -> None:
        """The engine's progress as serving/watch/stall.py judges it: a new stall is counted and, with restart, ends
        the child as a crash does (group kill, backoff). It stays stalled until a child runs healthy again."""
        if reason is None:
            if self.state == RUNNING:
                self.stalled = None  # the counters moved again
            return
        if self.stalled is None:
            self.stalls += 1
            log.error("%s stalled: %s", self.title, reason)
        self.stalled = reason
        if restart and self.state == RUNNING:
            self._failed(now, f"{self.title} stalled, restarting it: {reason}")

    def _failed(self, now: float, reason: str, code: int | None = None) -> None:
        """The child is gone or must go: kill its group, then BACKOFF or FATAL, whatever a step raises."""
        self.last_exit_code = code
        timing = self.spec.timing
        self.policy.failed(now)
        try:
            self.end_child(reason)
        finally:
            delay = self.backoff.failed(now, timing)
            if delay is None:
                self._fatal(f"{len(self.backoff.failures)} failures within {timing.crash_loop_window_s:g} s; "
                            f"last: {reason}")
            else:
                self.restarts += 1
                self.enter(BACKOFF, f"{self.title} restarts in {delay:g} s (restart {self.restarts})",
                                 logging.WARNING, since=now, problem=reason, retry_at=now + delay)

    def _lost_port(self, now: float, reason: str) -> None:
        """Another process holds the child's own address and port: the start waits for it, as a preflight that
        finds the port taken does, and no failure is counted. A local user who takes the port at each start,
        between our preflight and the engine's bind (seconds of imports for vLLM), answering /health or not,
        drove a healthy engine to FATAL within 10 s of a start: a crash, a reload, a boot."""
        self.end_part(now, reason, reason, PREFLIGHT_RETRY_S)

    def end_child(self, reason: str) -> None:
        """Log why, and if a child is there: EXITED, and its group killed."""
        if self.child is None:
            log.error("%s", reason)
            return
        child = self.child
        self.enter(EXITED)  # first: a kill that raises must still end in BACKOFF, never stay RUNNING
        left = self.remains.kill_group(child)
        log.error("%s; %s", reason, f"killed {left} leftover processes of its group" if left else "no process left")

    def _fatal(self, reason: str) -> None:
        last = " | ".join(self.error_lines) or "none captured"
        # The detail, at err: the alert vllm_fatal is the one crit line, with the fix.
        self.enter(FATAL, f"{self.title} FATAL, not restarting until SIGHUP: {reason}; its last error lines: "
                                f"{last}", logging.ERROR, problem=reason)

    # -- stopping and holding: its parts (stopping.py, holding.py) ---------------------------------------
    def stop(self, now: float) -> None:
        """Begin a planned stop (Stopping.begin): SIGTERM now, SIGKILL once stop_timeout_s has passed (in tick)."""
        self.stopping.begin(now)

    def kill_now(self, now: float) -> None:
        """A second stop request: do not wait for the drain."""
        self.stopping.kill_now(now)

    @property
    def stopped(self) -> bool:
        return self.state == STOPPED

    def hold(self, now: float, reason: str, drain: bool = False) -> None:
        """End the child and wait in HELD for its GPU (Holding.hold)."""
        self.holding.hold(now, reason, drain)

    def release(self, now: float, why: str) -> bool:
        """The GPU is back: start again (Holding.release); False: it was not held."""
        return self.holding.release(now, why)

    def reset(self, now: float) -> None:
        """SIGHUP: leave FATAL (or HELD: the operator says the GPU is done) and try again from scratch."""
        if self.state in (FATAL, HELD):
            self.backoff.reset()
            self.enter(STOPPED)
            self.start(now)

    def view(self) -> ServingView:
        return ServingView.of(self)


class Supervisor:
    """One or more Programs side by side, each with its own state machine. A fault in one program's tick
    is raised only after the others have ticked; stopping stops them all."""

    def __init__(self, programs: Sequence[Program]):
        if not programs:
            raise ValueError("a supervisor needs at least one program")
        self.programs = {p.name: p for p in programs}
        self._incoming: dict[str, Program | None] = {}  # a side program's replacement, once the old one stopped
        self.kept: frozenset[str] = frozenset()  # programs a stop left running, for the next supervisor (a reload)
        self._fronts_stop = False  # a whole stop: the fronts stop once the engine has stopped
        self.word = FrontWord()  # to the fronts of the engine (the proxy): its planned stop, its health

    def replace(self, name: str, program: Program | None, now: float) -> None:
        """Swap one side program (the proxy) and leave the others running: the old one is stopped, and the new
        one (None: none) starts on the tick after it has."""
        if name == self.main.name:
            raise ValueError("the main program is replaced with the whole supervisor")
        old = self.programs.get(name)
        if old is not None:
            old.stop(now)
        self._incoming[name] = program
        self._swap(now)

    def _swap(self, now: float) -> None:
        for name, program in list(self._incoming.items()):
            old = self.programs.get(name)
            if old is not None and not old.stopped:
                continue
            del self._incoming[name]
            self.programs.pop(name, None)
            if program is not None:
                self.programs[name] = program
                program.start(now)

    @property
    def main(self) -> Program:
        """The first program: the serving engine, whose state gates READY."""
        return next(iter(self.programs.values()))

    def _each(self, step: Callable[[Program], None]) -> None:
        failure = None
        for program in self.programs.values():
            try:
                step(program)
            except Exception as exc:
                failure = failure or exc
        if failure is not None:
            raise failure

    def start(self, now: float) -> None:
        self._each(lambda p: p.start(now))

    def tick(self, now: float) -> None:
        self._each(lambda p: p.tick(now))
        # The engine's SIGTERM once the fronts hold new requests (or are gone); at once if it is no longer RUNNING
        # (it ended while waiting: no restart in the middle of a stop).
        if self.word.waiting and (self.main.state != RUNNING or self.word.heard(self._fronts(), now)):
            self.word.stop_waiting()
            if self.main.state != RUNNING and self.main.resting.rest_for is not None:
                self.main.resting.forget()  # it ended before its rest began: its own restart (or hold) stands
            else:
                self.main.stop(now)
        if self._incoming:
            self._swap(now)
        if self._fronts_stop and self.main.stopped:
            self._fronts_stop = False
            self._each(lambda p: p.stop(now) if p in self._fronts() else None)
        self.tell_fronts()

    def stop(self, now: float, keep: frozenset[str] = frozenset()) -> float | None:
        """Stop them all but keep (programs the next supervisor runs on: a reload keeps an unchanged proxy); a
        front of the engine stops once the engine has. The longest wait for the last SIGKILL (a drain's included,
        and a front's after it), None: none."""
        self._incoming.clear()  # stopping everything: a pending replacement never starts
        self.kept = keep
        self.main.resting.forget()  # a rest's drain under way ends in STOPPED: this is a stop
        fronts = [p for p in self._fronts() if p.name not in keep]
        self._fronts_stop = bool(fronts) and not self.main.stopped
        # The fronts first: they hold new requests before the engine refuses them, its SIGTERM waiting (in tick)
        # for their answer (serving/run/fronts.py).
        if self.main.state == RUNNING and not self.word.waiting:
            self.word.stopping(self._fronts(), now)
        later = self.main if self.word.waiting else None
        self._each(lambda p: None if p.name in keep or (self._fronts_stop and p in fronts) or p is later
                   else p.stop(now))
        waits = [p.spec.timing.stop_timeout_s + (HEAR_S if p is later else 0.0) for p in self.programs.values()
                 if not p.stopped and p.name not in keep and p not in fronts]
        after = max((p.spec.timing.stop_timeout_s for p in fronts if not p.stopped), default=0.0)
        return max(waits, default=0.0) + after if waits or after else None

    def kill_now(self, now: float) -> None:
        if self.word.waiting:  # a second stop: the engine does not wait for its fronts' answer either
            self.word.stop_waiting()
            self.main.stop(now)
        if self._fronts_stop:  # a second stop: the fronts do not wait for the engine either
            self._fronts_stop = False
            self._each(lambda p: p.stop(now) if p in self._fronts() else None)
        self._each(lambda p: p.kill_now(now))

    def _fronts(self) -> list[Program]:
        return [p for p in self.programs.values() if p.spec.fronts_engine and p is not self.main]

    def tell_fronts(self) -> None:
        """The standing word to the fronts: at rest by serve.idle's clocks the engine runs, and the word is REST."""
        main, clocks = self.main, self.main.resting.clocks
        self.word.update(main.state == RUNNING and not clocks, main.state == STOPPING, self._fronts(),
                         down=main.state in (FATAL, HELD), resting=main.state == RESTING or clocks)

    @property
    def may_rest(self) -> bool:
        """No stop's word waits for the fronts, no swap of children or stop of the fronts is under way."""
        return not (self.word.waiting or self._incoming or self._fronts_stop)

    def rest(self, now: float, reason: str) -> bool:
        """The engine rests (serve.idle): stopped as a reload stops it, its fronts told first (they hold new
        requests), then RESTING (resting.py); False: it does not serve now, or a stop or a swap is under way."""
        main = self.main
        if not self.may_rest or not main.resting.rest(reason):
            return False
        if not self.word.stopping(self._fronts(), now):  # no front to tell: the SIGTERM at once
            main.stop(now)
        return True

    def wake(self, now: float, why: str) -> bool:
        """A request came for the resting engine: start it (resting.py); False: it was not at rest."""
        return self.main.resting.wake(now, why)

    def reset(self, now: float) -> None:
        self._each(lambda p: p.reset(now))

    @property
    def stopped(self) -> bool:
        """Every program stopped, but those a stop kept running for the next supervisor."""
        return all(p.stopped for p in self.programs.values() if p.name not in self.kept)

    def views(self) -> tuple[ServingView, ...]:
        return tuple(p.view() for p in self.programs.values())


def _launcher(spec: ChildSpec) -> str:
    """Who runs it where that is not the user its port belongs to: the container engine's shim."""
    return "" if spec.launcher is None else f", run by {spec.launcher.name} without capabilities"


def _spawn(spec: ChildSpec, ops: ProcessOps, identity, on_line) -> tuple[Child, int | None]:
    """Start spec's child: (the child, its word pipe's read end or None). Numbers go in the environment, not the
    argv: the argv stays the spec's, which the record for adoption holds. Raises what ops.spawn raises, nothing left
    open."""
    env, fds, ends = dict(spec.env), (), None
    if spec.listener:  # the daemon's kept socket (bound by preflight): the child serves on it
        fd = ops.listen(spec.listener, spec.host, spec.port)
        env[CHILD_ENV], fds = str(fd), (fd,)
    if spec.fronts_engine:  # its word back to the daemon, on a pipe of its own (word.py)
        ends = make_pipe()
        env[WORD_ENV], fds = str(ends[1]), (*fds, ends[1])
    try:
        child = ops.spawn(spec.argv, env, identity, on_line, pass_fds=fds)
    except BaseException:
        if ends is not None:
            os.close(ends[0])
        raise
    finally:
        if ends is not None:
            os.close(ends[1])  # the child's end: the daemon keeps only the one it reads
    return child, ends[0] if ends is not None else None


def _duration(seconds: float) -> str:
    """3 s, 12 min, 5.2 h, 3.1 days."""
    for unit, size in (("days", 86400), ("h", 3600), ("min", 60)):
        if seconds >= 2 * size:
            return f"{seconds / size:.1f} {unit}" if unit in ("days", "h") else f"{seconds / size:.0f} {unit}"
    return f"{seconds:.0f} s"


def _describe_exit(code: int) -> str:
    if code == UNSEEN_EXIT:
        return "an exit status nobody could see (it was adopted, and systemd reaped it)"
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"exit status {code}"


def _describe_error(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.strerror:
        return f"{exc.strerror}: {exc.filename}" if exc.filename else exc.strerror
    return str(exc)
