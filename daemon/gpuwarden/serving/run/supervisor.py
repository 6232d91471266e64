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

import dataclasses
import logging
import re
import signal
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from . import ports
from .processes import KILL_WAIT_S, UNSEEN_EXIT, Child, ProcessOps
from ..compose.secrets import redact_argv
from .spec import ChildSpec

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
# What a child that could not bind its port says, as vLLM's OSError and uvicorn's own line write it.
PORT_TAKEN = re.compile(r"address already in use", re.IGNORECASE)
# A head that lost a rank starts its part again in 1 s; more than LOST_RANK_LIMIT such restarts within
# LOST_RANK_WINDOW_S wait LOST_RANK_BACKOFF_S instead. They spend no restart budget (the rank, not this node,
# failed), so without this bound anything that can open and close connections to the rendezvous port could keep
# the head restarting forever. The wait (BACKOFF, node_up 0) outlasts ServingNodeDown's 2 minutes: it alerts.
LOST_RANK_LIMIT = 3
LOST_RANK_WINDOW_S = 600.0
LOST_RANK_BACKOFF_S = 300.0
# While a part starts, its rendezvous connections are read this often (at most; the liveness interval if
# shorter): a rank that joins and dies a few seconds later (an NCCL init that fails) is then found by two reads
# and its loss seen, rather than leaving the head waiting for it until startup_timeout_s.
STARTING_LINKS_READ_S = 1.0
# A socket table past ports' caps gives no verdict; the watch says so once per this many seconds.
BLIND_LOG_S = 600.0


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


@dataclass(frozen=True)
class Phase:
    """The state and everything that lives and dies with it. Only _transition() makes a new Phase; within a
    state, _within() changes the fields that state owns (a probe failure counted, the next probe's time)."""

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


class Program:
    """One supervised child: runs a ChildSpec (serving/run/spec.py), whatever kind of child it describes."""

    def __init__(self, spec: ChildSpec, ops: ProcessOps | None = None, clock: Callable[[], float] = time.monotonic):
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
        self.error_lines: deque[str] = deque(maxlen=10)
        self._probe = self.ops.background(f"{self.name}-health")
        self._peer_probe = self.ops.background(f"{self.name}-peer")
        self._peer_why: str | None = "not asked yet"  # the head's rendezvous, as last asked (None: it answers)
        # A multi-node part's connections on the rendezvous (socket inode -> remote address), read off the loop:
        self._links_probe = self.ops.background(f"{self.name}-links")
        self._links_last: dict[int, str] = {}  # as the latest read found them
        self._links_held: dict[int, str] = {}  # those found by two reads in a row: only their loss counts
        self._links_next = 0.0  # when they are read next: once a liveness period (a read scans every connection)
        self._links_suspect: dict[int, str] = {}  # held connections one read found gone: the next read decides
        self._blind_logged = -BLIND_LOG_S  # when the watch last said it could not read the tables
        self._lost_ranks: deque[float] = deque()  # when this head last ended its part for a lost rank
        self._head_seen_down = True  # a worker whose own part failed waits until the head restarted its part
        self._head_wait_until = 0.0  # ... for this long at most (the head may never have seen this rank join)
        self._failures: deque[float] = deque()  # when each recent failure happened (the crash-loop window)
        self._consecutive = 0  # failures since the last stable run (the backoff's exponent)
        self._last_level = logging.INFO
        self._dying: set[int] = set()  # pids of killed groups that may not have exited yet

    # -- the state, read through the phase ----------------------------------------------
    @property
    def state(self) -> str:
        return self.phase.state

    @property
    def child(self) -> Child | None:
        return self.phase.child

    @property
    def problem(self) -> str | None:
        return self.phase.problem

    @property
    def blocked(self) -> bool:
        return self.phase.blocked

    # -- the one way to change state ---------------------------------------------------
    def _transition(self, new: str, message: str | None = None, level: int = logging.INFO, **fields) -> None:
        """Enter state new with the fields it owns (every other field of the old phase ends with it)."""
        old = self.state
        if old not in ALLOWED_FROM[new]:
            raise TransitionError(f"{self.title} supervisor: {old} -> {new} is not allowed")
        fields.setdefault("since", self.clock())
        self.phase = Phase(new, **fields)
        self.transitions[(old, new)] += 1
        if message:
            log.log(level, "%s", message)

    def _within(self, **fields) -> None:
        """Change fields the current state owns, staying in it."""
        self.phase = dataclasses.replace(self.phase, **fields)

    # -- the child's output ---------------------------------------------------------
    def on_line(self, line: str) -> None:
        level = self.spec.log_level(line)
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
            self._transition(BACKOFF, since=now, problem=blocked, blocked=True, retry_at=now + PREFLIGHT_RETRY_S)
            return
        self.error_lines.clear()
        spec = self.spec
        try:
            child = self.ops.spawn(spec.argv, dict(spec.env), self.identity, self.on_line)
        except (OSError, ValueError, TypeError) as exc:  # missing binary, unreadable venv, NUL byte, ...
            self._failed(now, f"{self.title} could not be started: {_describe_error(exc)}")
            return
        self._probe.discard()
        self._links_probe.discard()
        self._links_last, self._links_held = {}, {}  # a new part: its connections are counted afresh
        self._links_next, self._links_suspect = 0.0, {}
        profile = f", profile {spec.profile}" if spec.profile else ""
        self._transition(STARTING, f"{self.title} starting (pid {child.pid}{profile}, user {self.identity.name}): "
                                   + " ".join(redact_argv(spec.argv)), since=now, child=child, started=now,
                         started_wall=time.time())

    def adopt(self, child: Child, now: float, started_wall: float, how: str) -> None:
        """Take over a running child an earlier daemon started (serving/run/handover.py proved it ours):
        RUNNING at once, its liveness probe due now, so its health, metrics and stalls are watched from this
        poll on. One line says so, with its PID and uptime."""
        up = max(0.0, time.time() - started_wall)
        # Through STARTING, as every child: it was started, only not by this daemon.
        self._transition(STARTING, since=now, child=child, started=now, started_wall=started_wall)
        self._transition(RUNNING, f"{self.title} adopted after {how}: pid {child.pid}, up {_duration(up)}, "
                                  "still serving", since=now, child=child, started=now, started_wall=started_wall,
                         next_probe=now)

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
        spec = self.spec
        if spec.peer is not None:
            why = self._peer_answer()
            if why is not None:
                self._head_seen_down = True
                return self._waiting(why)
            if not self._head_seen_down and self.clock() < self._head_wait_until:
                host, port = spec.peer
                return (f"waiting for rank 0 to restart its part: the engine cannot carry on without this rank, and "
                        f"the head's rendezvous {host}:{port} still answers")
        if spec.port and not self.ops.port_free(spec.host, spec.port):
            return (f"port {spec.port} on {spec.host} is in use by "
                    f"{self.ops.who_listens(spec.host, spec.port)}; {self.title} needs it")
        want = spec.memory_fraction
        for gpu in self.gpus:
            s = gpu.sample()
            others = [pid for pid, _ in gpu.compute_processes() if self.ops.uid_of(pid) != uid]
            if others:
                return f"GPU{gpu.index} runs other compute processes {others}"
            if s.memory_total_bytes and s.memory_used_bytes is not None:
                free = s.memory_total_bytes - s.memory_used_bytes - (s.memory_reserved_bytes or 0)
                if free < want * s.memory_total_bytes:
                    return (f"GPU{gpu.index} has {free / 2**30:.1f} GiB free, less than "
                            f"{spec.memory_flag} {want:g} of {s.memory_total_bytes / 2**30:.1f} GiB")
        return None

    def _peer_answer(self) -> str | None:
        """The latest answer of the head's rendezvous port (None: it accepts), asked again off the loop; before
        the first answer, 'not asked yet'."""
        self._peer_probe.start(self.ops.reachable, *self.spec.peer)
        outcome = self._peer_probe.take()
        if outcome is not None:
            self._peer_why = str(outcome.error) if outcome.error is not None else outcome.value
        return self._peer_why

    def _waiting(self, why: str) -> str:
        host, port = self.spec.peer
        if self.spec.role == "head":  # the engine on a Ray head waits for its own Ray node
            return f"waiting for the Ray head {host}:{port} to answer ({why})"
        return f"waiting for rank 0: the head's rendezvous {host}:{port} does not answer ({why})"

    def tick(self, now: float) -> None:
        if self.state != STOPPING:
            self._confirm_gone()
        if self.state == BACKOFF and now >= self.phase.retry_at:
            self.start(now)
        elif self.state == STOPPING:
            self._stopping(now)
        elif self.state in (STARTING, RUNNING):
            code = self.ops.poll(self.child)
            if code is not None:
                died = "died while starting" if self.state == STARTING else "exited"
                reason = f"{self.title} {died} with {_describe_exit(code)}"
                if self.state == STARTING and self.spec.port and any(map(PORT_TAKEN.search, self.error_lines)):
                    self._lost_port(now, f"{reason}: port {self.spec.port} on {self.spec.host} was taken by "
                                         "another process after our check, before it could bind")
                else:
                    self._failed(now, reason, code)
            elif self.state == STARTING:
                self._starting(now)
            else:
                self._running(now)

    def _health(self) -> tuple[bool | None, str]:
        """(True healthy / False not / None no answer yet, why): the latest /health answer about this child, or
        for a node that serves no API, whether the head's rendezvous answers."""
        spec = self.spec
        if not spec.health_path:  # no HTTP: the peer it needs (a headless part's head), or its own port, answers
            self._probe.start(self.ops.reachable, *(spec.peer or (spec.host, spec.port)))
            outcome = self._probe.take()
            if outcome is None or outcome.started_at < self.phase.started:
                return None, ""
            why = str(outcome.error) if outcome.error is not None else outcome.value
            if why is None:
                return True, ""
            return False, self._waiting(why) if spec.peer else f"port {spec.port} does not answer: {why}"
        self._probe.start(self.ops.health, spec.url + spec.health_path)
        outcome = self._probe.take()
        if outcome is None or outcome.started_at < self.phase.started:
            return None, ""
        if outcome.error is not None:
            return False, str(outcome.error)
        if outcome.value.code != 200:
            return False, f"/health answered {outcome.value.code}"
        group = self.ops.group_pids(self.child.pgid)
        if spec.port and not self.ops.owns_port(spec.host, spec.port, group, self.identity.uid):
            return False, (f"port {spec.port} is answered by {self.ops.who_listens(spec.host, spec.port)}, "
                           f"not by {self.title}'s process group")
        return True, ""

    def _starting(self, now: float) -> None:
        healthy, why = self._health()
        timing = self.spec.timing
        started = self.phase.started
        if healthy:
            self.time_to_healthy_s = now - started
            self.stalled = None  # a stall ends with a healthy new child
            where = self.spec.url if self.spec.port else "its node, the head answering"
            self._transition(RUNNING, f"{self.title} healthy after {self.time_to_healthy_s:.1f} s on "
                                      f"{where}", since=now, child=self.child, started=started,
                             started_wall=self.phase.started_wall, next_probe=now + timing.liveness_interval_s)
        elif healthy is False and f"not by {self.title}'s process group" in why:
            self._lost_port(now, f"{self.title} not trusted: {why}")
        elif now - started > timing.startup_timeout_s:
            self._failed(now, f"{self.title} not healthy within startup_timeout_s {timing.startup_timeout_s:g} s")
        elif self.spec.rendezvous:
            # Watched from the start, not from healthy on: a rank that joined counts once two reads found it, so a
            # loss right after the engine turned healthy (before two reads while RUNNING) is still seen. The
            # two-node test lost its worker within a second of the head's healthy line: unseen when the watch
            # began at RUNNING.
            self._read_links(now)
            links = self._links_read(now)
            if links is None or self._lost_rank(now, links):
                return
            if self.spec.peer is None and self.spec.hosts:
                waiting = self._ranks_missing(links)
                if waiting != self.problem:
                    if waiting:
                        log.info("%s is %s", self.title, waiting)
                    self._within(problem=waiting)

    def _read_links(self, now: float) -> None:
        """Start a read of this part's rendezvous connections on a worker thread, once a liveness period (every
        STARTING_LINKS_READ_S while it starts): with many connections on the host (any API client can open them)
        a read takes seconds of the loop's time."""
        period = self.spec.timing.liveness_interval_s
        if self.state == STARTING:
            period = min(period, STARTING_LINKS_READ_S)
        if now >= self._links_next and self._links_probe.start(self.ops.peers, self.spec.rendezvous,
                                                               self.identity.uid, self.spec.peer is None):
            self._links_next = now + period

    def _links_read(self, now: float) -> dict[int, str] | None:
        """The latest finished read of this part's rendezvous connections (ports.peers, run off the loop: with
        many connections on the host it takes seconds); None while none finished, or it failed or gave up."""
        outcome = self._links_probe.take()
        if outcome is None or outcome.error is not None or outcome.started_at < self.phase.started:
            return None
        if outcome.value is None and now - self._blind_logged >= BLIND_LOG_S:
            self._blind_logged = now
            log.warning("%s cannot watch its rendezvous connections: the host's socket tables hold more lines "
                        "than gpuwarden reads (%d, or %d on port %d); a lost rank is not seen until they shrink",
                        self.title, ports.MAX_LINES, ports.MAX_PORT_LINES, self.spec.rendezvous)
        return outcome.value

    def _ranks_missing(self, links: dict[int, str]) -> str | None:
        """The head while it starts: the ranks whose node has no connection to its rendezvous yet (by the
        addresses in serve.nodes.hosts), as 'waiting for rank 1 (10.0.0.2) to join ...'; None once all have."""
        spec = self.spec
        seen = set(links.values())
        missing = [f"rank {r} ({host})" for r, host in enumerate(spec.hosts) if r and host not in seen]
        return f"waiting for {', '.join(missing)} to join the rendezvous on port {spec.rendezvous}" if missing else None

    def _running(self, now: float) -> None:
        timing = self.spec.timing
        if self._consecutive and now - self.phase.since >= timing.stable_after_s:
            self._consecutive = 0  # a stable run resets the backoff
        if self.spec.rendezvous:
            self._read_links(now)
            links = self._links_read(now)
            if links is not None and self._lost_rank(now, links):
                return
        if now < self.phase.next_probe:
            return
        healthy, why = self._health()
        if healthy is None:
            return  # still waiting for this probe's answer
        if healthy:
            self._within(next_probe=now + timing.liveness_interval_s, probe_failures=0, probes=self.phase.probes + 1)
            return
        failures = self.phase.probe_failures + 1
        self._within(next_probe=now + timing.liveness_interval_s, probe_failures=failures,
                     probes=self.phase.probes + 1)
        log.warning("%s liveness probe failed (%d of %d): %s", self.title, failures, timing.liveness_failures, why)
        if failures >= timing.liveness_failures and self.spec.peer is not None and not self.spec.health_path:
            self._lost_head(now, why)
        elif failures >= timing.liveness_failures:
            self._failed(now, f"{self.title} failed {failures} liveness probes in a row")

    def _lost_rank(self, now: float, links: dict[int, str]) -> bool:
        """A multi-node part that starts or runs holds connections on the rendezvous: the head accepts one from each
        rank's process, a worker holds its own to the head. When one closes, a rank is gone and the engine cannot
        carry on: this part ends and starts anew (no failure of this node: no restart budget spent). True if so.

        Connections are told apart by socket inode and compared one by one (a stranger connecting as a rank
        leaves does not hide the loss). Only a connection that two reads in a row found counts: a probe's
        connect-and-close (a worker's own liveness probe, anyone's port scan) is not a rank. On the head, where
        serve.nodes.hosts names the nodes, only connections from them (or this host's loopback) count, and
        ports.peers leaves out a local connection made by another uid. A process on a listed node can still
        open a connection, hold it, and close it: the restarts that costs are bounded (LOST_RANK_LIMIT). A worker
        counts only its connections to the head's address (another job of the serving user on the same port
        number elsewhere is not the head), so only the head's end closes them: it follows its head, unbounded."""
        spec = self.spec
        if spec.peer is not None:  # a worker: only its own connections to the head (not to a local torch job)
            held = {inode: a for inode, a in links.items() if a == spec.peer[0]}
        else:
            held = {inode: a for inode, a in links.items()
                    if not spec.hosts or a in spec.hosts or a.startswith("127.") or a == "::1"}
        missing = {inode: a for inode, a in self._links_held.items() if inode not in held}
        # /proc/net/tcp is no snapshot: the kernel writes it in chunks, and a connection can be skipped when
        # another in its hash bucket closes between two. A healthy engine is not ended on one read: a connection
        # is lost when two reads in a row (the second started at once) find it gone.
        lost = {inode: a for inode, a in missing.items() if inode in self._links_suspect}
        if missing and not lost:
            self._links_suspect, self._links_next = missing, now
            return False
        self._links_suspect = {}
        self._links_held = {inode: a for inode, a in held.items() if inode in self._links_last}
        self._links_last = held
        if not lost:
            return False
        self._links_last, self._links_held = {}, {}
        if spec.peer is not None:
            self._lost_head(now, f"its connection to the head's rendezvous {spec.head} closed")
            return True
        names = self._ranks_at(sorted(set(lost.values())))
        reason = f"lost {names}: its connection to the rendezvous on port {spec.rendezvous} closed"
        self._lost_ranks.append(now)
        while now - self._lost_ranks[0] > LOST_RANK_WINDOW_S:
            self._lost_ranks.popleft()
        wait = 1.0
        if len(self._lost_ranks) > LOST_RANK_LIMIT:
            wait = LOST_RANK_BACKOFF_S
            reason += (f"; {len(self._lost_ranks)} such restarts within {LOST_RANK_WINDOW_S / 60:g} minutes, so the "
                       f"next waits {wait:g} s (a rank that keeps failing, or a process opening and closing "
                       f"connections to port {spec.rendezvous})")
        try:
            self._end_child(f"{self.title} {reason}; restarting this part, so that the whole engine starts again")
        finally:
            self._transition(BACKOFF, f"{self.title} starts its part again in {wait:g} s, for {names} to rejoin",
                             logging.WARNING,
                             since=now, problem=reason, retry_at=now + wait)
        return True

    def _ranks_at(self, addresses: list[str]) -> str:
        """'rank 2 (10.0.0.3)' for a lost connection from an address of serve.nodes.hosts, else 'a connection
        from 10.0.0.9': the address is what is known (a local process may connect through any of them)."""
        hosts = self.spec.hosts
        ranks = [f"rank {hosts.index(a)} ({a})" for a in addresses if a in hosts[1:]]
        others = [f"a connection from {a}" for a in addresses if a not in hosts[1:]]
        return ", ".join(ranks + others)

    def _lost_head(self, now: float, why: str) -> None:
        """The head went away: this part cannot carry on without it (the engine's rendezvous starts anew), so
        it ends and waits for the head again. Not a failure of this node: no restart budget is spent."""
        self._peer_why = why
        self._links_last, self._links_held = {}, {}
        try:
            self._end_child(f"{self.title} lost rank 0 (the head), ending its part: {why}")
        finally:
            self._transition(BACKOFF, f"{self.title} starts again once the head answers", logging.WARNING,
                             since=now, problem=why, blocked=True, retry_at=now + PREFLIGHT_RETRY_S)

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
        timing = self.spec.timing
        if self.spec.peer is not None and self.spec.rendezvous:  # the head's part must start anew: wait (bounded)
            self._head_seen_down = False
            self._head_wait_until = now + 2 * timing.liveness_interval_s * timing.liveness_failures \
                + 2 * PREFLIGHT_RETRY_S
        try:
            self._end_child(reason)
        finally:
            self._failures.append(now)
            while self._failures and now - self._failures[0] > timing.crash_loop_window_s:
                self._failures.popleft()
            if len(self._failures) >= timing.crash_loop_failures:
                self._fatal(f"{len(self._failures)} failures within {timing.crash_loop_window_s:g} s; "
                            f"last: {reason}")
            else:
                self._consecutive += 1
                delay = min(timing.backoff_max_s, 2.0 ** (self._consecutive - 1))
                self.restarts += 1
                self._transition(BACKOFF, f"{self.title} restarts in {delay:g} s (restart {self.restarts})",
                                 logging.WARNING, since=now, problem=reason, retry_at=now + delay)

    def _lost_port(self, now: float, reason: str) -> None:
        """Another process holds the child's own address and port: the start waits for it, as a preflight that
        finds the port taken does, and no failure is counted. A local user who takes the port at each start,
        between our preflight and the engine's bind (seconds of imports for vLLM), answering /health or not,
        drove a healthy engine to FATAL within 10 s of a start: a crash, a reload, a boot."""
        try:
            self._end_child(reason)
        finally:
            self._transition(BACKOFF, since=now, problem=reason, blocked=True, retry_at=now + PREFLIGHT_RETRY_S)

    def _end_child(self, reason: str) -> None:
        """Log why, and if a child is there: EXITED, and its group killed."""
        if self.child is None:
            log.error("%s", reason)
            return
        child = self.child
        self._transition(EXITED)  # first: a kill that raises must still end in BACKOFF, never stay RUNNING
        left = self._kill_group(child)
        log.error("%s; %s", reason, f"killed {left} leftover processes of its group" if left else "no process left")

    def _fatal(self, reason: str) -> None:
        last = " | ".join(self.error_lines) or "none captured"
        # The detail, at err: the alert vllm_fatal is the one crit line, with the fix.
        self._transition(FATAL, f"{self.title} FATAL, not restarting until SIGHUP: {reason}; its last error lines: "
                                f"{last}", logging.ERROR, problem=reason)

    def _kill_group(self, child: Child) -> int:
        """SIGKILL the child's group without waiting; the next start checks that it is gone.
        Returns how many processes were alive."""
        alive = self.ops.group_pids(child.pgid)
        self.ops.killpg(child.pgid, signal.SIGKILL)
        self.ops.poll(child)  # reap the leader if it is already gone
        self._dying.update(alive)
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
        child = self.child
        if child is None:
            self._transition(STOPPED)
            return
        count = len(self.ops.group_pids(child.pgid))
        self.ops.killpg(child.pgid, signal.SIGTERM)
        timeout = self.spec.timing.stop_timeout_s
        self._transition(STOPPING, f"{self.title} stopping: SIGTERM to its {count} processes, SIGKILL after "
                                   f"{timeout:g} s", since=now, child=child, kill_at=now + timeout, stop_count=count,
                         started_wall=self.phase.started_wall)

    def kill_now(self, now: float) -> None:
        """A second stop request: do not wait for the drain."""
        if self.state == STOPPING and not self.phase.killed:
            log.warning("%s stop: asked again, SIGKILL now", self.title)
            self._within(kill_at=now)
            self._stopping(now)

    @property
    def stopped(self) -> bool:
        return self.state == STOPPED

    def _stopping(self, now: float) -> None:
        phase = self.phase
        self.ops.poll(phase.child)  # reap the leader
        alive = self.ops.group_pids(phase.child.pgid)
        if alive and now < phase.kill_at:
            return
        if alive and not phase.killed:
            log.warning("%s did not stop within %g s: SIGKILL to %d processes", self.title, now - phase.since,
                        len(alive))
            self.ops.killpg(phase.child.pgid, signal.SIGKILL)
            self._within(killed=True, kill_at=now + KILL_WAIT_S)
            return
        if alive:
            log.error("processes %s of %s's group survived SIGKILL for %g s", alive, self.title, KILL_WAIT_S)
            self._dying.update(alive)
        self.ops.poll(phase.child)
        self._kill_escaped()
        self._transition(STOPPED, f"{self.title} stopped after {now - phase.since:.1f} s ({phase.stop_count} "
                                  "processes in its group at the stop)")

    def reset(self, now: float) -> None:
        """SIGHUP: leave FATAL and try again from scratch."""
        if self.state == FATAL:
            self._failures.clear()
            self._consecutive = 0
            self._transition(STOPPED)
            self.start(now)

    def view(self) -> ServingView:
        spec = self.spec
        return ServingView(self.state, spec.model, spec.profile, self.child.pid if self.child else None,
                           self.restarts, self.last_exit_code, self.time_to_healthy_s, self.problem, self.blocked,
                           self.name, self.title,
                           tuple((old, new, n) for (old, new), n in sorted(self.transitions.items())),
                           self.stalled, self.stalls, tuple(g.index for g in self.gpus), self.phase.started_wall,
                           spec.version, spec.role, spec.rank, spec.nodes, spec.head, self._head_up(),
                           self.phase.probes)

    def _head_up(self) -> bool | None:
        if self.spec.peer is None or self.spec.role != "worker":
            return None
        if self.state == RUNNING:
            return self.phase.probe_failures == 0
        return self._peer_why is None


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
