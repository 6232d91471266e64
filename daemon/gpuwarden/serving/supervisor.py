"""Run the serving engine (and any other child) as well-behaved children: explicit states, health checks,
backoff, no orphans.

Modelled on supervisor's process.py: each Program is one child with its own
state machine (STOPPED, STARTING, RUNNING, BACKOFF, STOPPING, EXITED and FATAL),
"died while starting" told apart from "died later", and every OS call behind
one seam (processes.ProcessOps) that tests replace. Every state change goes
through _transition(), which checks it against ALLOWED_FROM, logs it and counts
it (the count is published in the view and exported). Nothing here blocks the
loop: STOPPING is a timed state that tick() advances (SIGTERM, stop_timeout_s,
then SIGKILL), and /health is read on a worker thread with a total deadline.
The Supervisor runs one or more Programs side by side.

The child runs in its own session, so its process group holds the API server
and every engine/worker process it forks; that group is what gets SIGTERM,
then SIGKILL, and what must be empty before the next start. A process that
left the group (setsid, double fork) is found through the subreaper and killed
with it.
"""

from __future__ import annotations

import logging
import re
import signal
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..config import ServeConfig
from ..gpu.base import Gpu
from .command import ServeCommand
from .identity import Identity
from .processes import Child, ProcessOps
from .secrets import redact_argv

log = logging.getLogger("gpuwarden")

STOPPED, STARTING, RUNNING, BACKOFF, STOPPING, EXITED, FATAL = (
    "STOPPED", "STARTING", "RUNNING", "BACKOFF", "STOPPING", "EXITED", "FATAL")
STATES = (STOPPED, STARTING, RUNNING, BACKOFF, STOPPING, EXITED, FATAL)
# new state -> the states it may be entered from
ALLOWED_FROM = {
    STARTING: (STOPPED, BACKOFF),
    RUNNING: (STARTING,),
    EXITED: (STARTING, RUNNING),
    BACKOFF: (STOPPED, BACKOFF, EXITED),
    STOPPING: (STARTING, RUNNING),
    STOPPED: (STOPPED, STOPPING, BACKOFF, EXITED, FATAL),
    FATAL: (STOPPED, BACKOFF, EXITED),
}
PREFLIGHT_RETRY_S = 5.0
KILL_WAIT_S = 5.0  # after SIGKILL, how long a stop waits for the kernel before giving up on survivors


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


class Program:
    """One supervised child: the serving engine's command, run as identity on gpus."""

    def __init__(self, serve: ServeConfig, command: ServeCommand, identity: Identity, gpus: list[Gpu],
                 ops: ProcessOps | None = None, clock: Callable[[], float] = time.monotonic):
        self.serve = serve
        self.command = command
        self.engine = command.engine
        self.name = command.engine.name
        self.title = command.engine.title
        self.identity = identity
        self.gpus = gpus
        self.ops = ops or ProcessOps()
        self.clock = clock
        self.state = STOPPED
        self.child: Child | None = None
        self.restarts = 0
        self.last_exit_code: int | None = None
        self.time_to_healthy_s: float | None = None
        self.problem: str | None = None
        self.blocked = False
        self.stalled: str | None = None
        self.stalls = 0
        self.transitions: Counter = Counter()  # (from, to) -> count
        self.error_lines: deque[str] = deque(maxlen=10)
        self._probe = self.ops.background(f"{self.name}-health")
        self._failures: deque[float] = deque()
        self._consecutive = 0
        self._started_at = 0.0
        self._running_since = 0.0
        self._retry_at = 0.0
        self._next_probe = 0.0
        self._probe_failures = 0
        self._last_level = logging.INFO
        self._dying: set[int] = set()  # pids of killed groups that may not have exited yet
        self._kill_at = 0.0
        self._killed = False
        self._stop_began = 0.0
        self._stop_count = 0

    # -- the one way to change state ---------------------------------------------------
    def _transition(self, new: str, message: str | None = None, level: int = logging.INFO) -> None:
        old = self.state
        if old not in ALLOWED_FROM[new]:
            raise TransitionError(f"{self.title} supervisor: {old} -> {new} is not allowed")
        self.state = new
        self.transitions[(old, new)] += 1
        if message:
            log.log(level, "%s", message)

    # -- the child's output ---------------------------------------------------------
    def on_line(self, line: str) -> None:
        level = self.engine.log_level(line)
        if level is not None:
            self._last_level = level
        # Lines without a level (traceback bodies) keep the level of the line they follow.
        log.log(self._last_level, "%s: %s", self.name, line)
        if self._last_level >= logging.WARNING or re.search(r"Error|Exception", line):
            self.error_lines.append(line[:1000])

    # -- life cycle -------------------------------------------------------------------
    def start(self, now: float) -> None:
        if self.state not in ALLOWED_FROM[STARTING]:
            return
        blocked = self._preflight()
        if blocked:
            if blocked != self.problem:  # the alert vllm_start_blocked warns, with reminders; this is the detail
                log.info("%s start waits: %s", self.title, blocked)
            self.blocked, self.problem, self._retry_at = True, blocked, now + PREFLIGHT_RETRY_S
            self._transition(BACKOFF)
            return
        self.blocked = False
        self.error_lines.clear()
        try:
            self.child = self.ops.spawn(self.command.argv, self.command.env, self.identity, self.on_line)
        except (OSError, ValueError, TypeError) as exc:  # missing binary, unreadable venv, NUL byte, ...
            self._failed(now, f"{self.title} could not be started: {_describe_error(exc)}")
            return
        self._started_at, self.problem = now, None
        self._probe.discard()
        self._transition(STARTING, f"{self.title} starting (pid {self.child.pid}, profile {self.command.profile.name}, "
                                   f"user {self.identity.name}): " + " ".join(redact_argv(self.command.argv)))

    def _preflight(self) -> str | None:
        """None if the GPUs and the port are free for a new child; else why not (after killing our own
        leftovers: the previous group, processes that escaped it, our user's processes on the GPUs)."""
        self._kill_escaped()
        self._confirm_gone()
        if self._dying:  # still exiting: SIGKILL again, and wait for them
            survivors = sorted(self.ops.alive(self._dying))
            for pid in survivors:
                self.ops.kill(pid, signal.SIGKILL)
            return f"processes {survivors} of the previous {self.title} are still exiting"
        uid = self.identity.uid
        for gpu in self.gpus:
            for pid, _ in gpu.compute_processes():
                if self.ops.uid_of(pid) == uid:
                    log.warning("GPU%d: killing leftover %s process %d of user %s", gpu.index, self.title, pid,
                                self.identity.name)
                    self.ops.kill(pid, signal.SIGKILL)
        if not self.ops.port_free(self.serve.host, self.serve.port):
            return (f"port {self.serve.port} on {self.serve.host} is in use by "
                    f"{self.ops.who_listens(self.serve.port)}; {self.title} needs it")
        want = self.command.memory_fraction
        for gpu in self.gpus:
            s = gpu.sample()
            others = [pid for pid, _ in gpu.compute_processes() if self.ops.uid_of(pid) != uid]
            if others:
                return f"GPU{gpu.index} runs other compute processes {others}"
            if s.memory_total_bytes and s.memory_used_bytes is not None:
                free = s.memory_total_bytes - s.memory_used_bytes - (s.memory_reserved_bytes or 0)
                if free < want * s.memory_total_bytes:
                    return (f"GPU{gpu.index} has {free / 2**30:.1f} GiB free, less than "
                            f"{self.engine.memory_flag} {want:g} of {s.memory_total_bytes / 2**30:.1f} GiB")
        return None

    def tick(self, now: float) -> None:
        if self.state != STOPPING:
            self._confirm_gone()
        if self.state == BACKOFF and now >= self._retry_at:
            self.start(now)
        elif self.state == STOPPING:
            self._stopping(now)
        elif self.state in (STARTING, RUNNING):
            code = self.ops.poll(self.child)
            if code is not None:
                died = "died while starting" if self.state == STARTING else "exited"
                self._failed(now, f"{self.title} {died} with {_describe_exit(code)}", code)
            elif self.state == STARTING:
                self._starting(now)
            else:
                self._running(now)

    def _health(self) -> tuple[bool | None, str]:
        """(True healthy / False not / None no answer yet, why): the latest /health answer about this child."""
        self._probe.start(self.ops.health, self.serve.url + self.engine.health_path)
        outcome = self._probe.take()
        if outcome is None or outcome.started_at < self._started_at:
            return None, ""
        if outcome.error is not None:
            return False, str(outcome.error)
        if outcome.value.code != 200:
            return False, f"/health answered {outcome.value.code}"
        group = self.ops.group_pids(self.child.pgid)
        if not self.ops.owns_port(self.serve.port, group, self.identity.uid):
            return False, (f"port {self.serve.port} is answered by {self.ops.who_listens(self.serve.port)}, "
                           f"not by {self.title}'s process group")
        return True, ""

    def _starting(self, now: float) -> None:
        healthy, why = self._health()
        if healthy:
            self._running_since = now
            self.time_to_healthy_s = now - self._started_at
            self._next_probe, self._probe_failures = now + self.serve.liveness_interval_s, 0
            self.stalled = None  # a stall ends with a healthy new child
            self._transition(RUNNING, f"{self.title} healthy after {self.time_to_healthy_s:.1f} s on "
                                      f"{self.serve.url}")
        elif healthy is False and f"not by {self.title}'s process group" in why:
            self._failed(now, f"{self.title} not trusted: {why}")
        elif now - self._started_at > self.serve.startup_timeout_s:
            self._failed(now, f"{self.title} not healthy within startup_timeout_s {self.serve.startup_timeout_s:g} s")

    def _running(self, now: float) -> None:
        if self._consecutive and now - self._running_since >= self.serve.stable_after_s:
            self._consecutive = 0  # a stable run resets the backoff
        if now < self._next_probe:
            return
        healthy, why = self._health()
        if healthy is None:
            return  # still waiting for this probe's answer
        self._next_probe = now + self.serve.liveness_interval_s
        if healthy:
            self._probe_failures = 0
            return
        self._probe_failures += 1
        log.warning("%s liveness probe failed (%d of %d): %s", self.title, self._probe_failures,
                    self.serve.liveness_failures, why)
        if self._probe_failures >= self.serve.liveness_failures:
            self._failed(now, f"{self.title} failed {self._probe_failures} liveness probes in a row")

    def note_stall(self, now: float, reason: str | None, restart: bool) -> None:
        """The engine's progress as serving/stall.py judges it: a new stall is counted and, with restart, ends
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

    def hold(self, now: float, reason: str) -> None:
        """A GPU it runs on needs a reset or a reboot: end the child and stay down (FATAL, with the reason on
        the STATUS line) rather than loop-restart it on a broken GPU; SIGHUP tries again."""
        if self.state in (FATAL, STOPPING, STOPPED):
            return  # already down, or stopping; a start later is held on the next check
        if self.child is not None:  # in BACKOFF there is none: the FATAL line says it all
            self._end_child(f"{self.title} stopped: {reason}")
        self._fatal(reason)

    def _failed(self, now: float, reason: str, code: int | None = None) -> None:
        """The child is gone or must go: kill its group, then BACKOFF or FATAL, whatever a step raises."""
        self.last_exit_code = code
        try:
            self._end_child(reason)
        finally:
            self._failures.append(now)
            while self._failures and now - self._failures[0] > self.serve.crash_loop_window_s:
                self._failures.popleft()
            if len(self._failures) >= self.serve.crash_loop_failures:
                self._fatal(f"{len(self._failures)} failures within {self.serve.crash_loop_window_s:g} s; "
                            f"last: {reason}")
            else:
                self._consecutive += 1
                delay = min(self.serve.backoff_max_s, 2.0 ** (self._consecutive - 1))
                self.restarts += 1
                self._retry_at, self.problem = now + delay, reason
                self._transition(BACKOFF, f"{self.title} restarts in {delay:g} s (restart {self.restarts})",
                                 logging.WARNING)

    def _end_child(self, reason: str) -> None:
        """Log why, and if a child is there: EXITED, and its group killed."""
        if self.child is None:
            log.error("%s", reason)
            return
        self._transition(EXITED)
        left = self._kill_group()
        log.error("%s; %s", reason, f"killed {left} leftover processes of its group" if left else "no process left")

    def _fatal(self, reason: str) -> None:
        self.problem = reason
        last = " | ".join(self.error_lines) or "none captured"
        # The detail, at err: the alert vllm_fatal is the one crit line, with the fix.
        self._transition(FATAL, f"{self.title} FATAL, not restarting until SIGHUP: {reason}; its last error lines: "
                                f"{last}", logging.ERROR)

    def _kill_group(self) -> int:
        """SIGKILL the child's group without waiting; the next start checks that it is gone.
        Returns how many processes were alive."""
        pgid = self.child.pgid
        alive = self.ops.group_pids(pgid)
        self.ops.killpg(pgid, signal.SIGKILL)
        self.ops.poll(self.child)  # reap the leader if it is already gone
        self._dying.update(alive)
        self.child = None
        return len(alive)

    def _confirm_gone(self) -> None:
        """SIGKILL takes the kernel a moment for processes with gigabytes mapped: say when they are gone
        (checked each tick, never waited for)."""
        if not self._dying:
            return
        self.ops.reap(self._dying)
        if not self.ops.alive(self._dying):
            log.info("all %d processes of the previous %s are gone", len(self._dying), self.title)
            self._dying.clear()

    def _kill_escaped(self) -> None:
        """Kill processes that left a previous child's group (they were re-parented to us) and say so."""
        escaped = self.ops.escaped()
        if not escaped:
            return
        described = ", ".join(self.ops.describe(pid) for pid in escaped)
        for pid in escaped:
            self.ops.kill(pid, signal.SIGKILL)
        self._dying.update(escaped)
        log.warning("killed %d process(es) that had left %s's process group: %s", len(escaped), self.title,
                    described)

    # -- stopping: a timed state ------------------------------------------------------
    def stop(self, now: float) -> None:
        """Begin a stop: SIGTERM to the group now, SIGKILL once stop_timeout_s has passed (in tick)."""
        if self.state == STOPPING:
            return
        if self.child is None:
            self.blocked = False
            self._transition(STOPPED)
            return
        self._stop_count = len(self.ops.group_pids(self.child.pgid))
        self.ops.killpg(self.child.pgid, signal.SIGTERM)
        self._stop_began, self._kill_at, self._killed = now, now + self.serve.stop_timeout_s, False
        self._transition(STOPPING, f"{self.title} stopping: SIGTERM to its {self._stop_count} processes, SIGKILL after "
                                   f"{self.serve.stop_timeout_s:g} s")

    def kill_now(self, now: float) -> None:
        """A second stop request: do not wait for the drain."""
        if self.state == STOPPING and not self._killed:
            log.warning("%s stop: asked again, SIGKILL now", self.title)
            self._kill_at = now
            self._stopping(now)

    @property
    def stopped(self) -> bool:
        return self.state == STOPPED

    def _stopping(self, now: float) -> None:
        self.ops.poll(self.child)  # reap the leader
        alive = self.ops.group_pids(self.child.pgid)
        if alive and now < self._kill_at:
            return
        if alive and not self._killed:
            log.warning("%s did not stop within %g s: SIGKILL to %d processes", self.title, now - self._stop_began,
                        len(alive))
            self.ops.killpg(self.child.pgid, signal.SIGKILL)
            self._killed, self._kill_at = True, now + KILL_WAIT_S
            return
        if alive:
            log.error("processes %s of %s's group survived SIGKILL for %g s", alive, self.title, KILL_WAIT_S)
            self._dying.update(alive)
        self.ops.poll(self.child)
        self.child = None
        self._kill_escaped()
        self._transition(STOPPED, f"{self.title} stopped after {now - self._stop_began:.1f} s ({self._stop_count} "
                                  "processes in its group at the stop)")

    def reset(self, now: float) -> None:
        """SIGHUP: leave FATAL and try again from scratch."""
        if self.state == FATAL:
            self._failures.clear()
            self._consecutive = 0
            self._transition(STOPPED)
            self.start(now)

    def view(self) -> ServingView:
        return ServingView(self.state, self.serve.model, self.command.profile.name,
                           self.child.pid if self.child else None, self.restarts, self.last_exit_code,
                           self.time_to_healthy_s, self.problem, self.blocked, self.name, self.title,
                           tuple((old, new, n) for (old, new), n in sorted(self.transitions.items())),
                           self.stalled, self.stalls, tuple(g.index for g in self.gpus))


class Supervisor:
    """One or more Programs side by side, each with its own state machine. A fault in one program's tick
    is raised only after the others have ticked; stopping stops them all."""

    def __init__(self, programs: Sequence[Program]):
        if not programs:
            raise ValueError("a supervisor needs at least one program")
        self.programs = {p.name: p for p in programs}
        self._incoming: dict[str, Program | None] = {}  # a side program's replacement, once the old one stopped

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
        if self._incoming:
            self._swap(now)

    def stop(self, now: float) -> None:
        self._incoming.clear()  # stopping everything: a pending replacement never starts
        self._each(lambda p: p.stop(now))

    def kill_now(self, now: float) -> None:
        self._each(lambda p: p.kill_now(now))

    def reset(self, now: float) -> None:
        self._each(lambda p: p.reset(now))

    @property
    def stopped(self) -> bool:
        return all(p.stopped for p in self.programs.values())

    def views(self) -> tuple[ServingView, ...]:
        return tuple(p.view() for p in self.programs.values())


def _describe_exit(code: int) -> str:
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
