"""The multi-node rank watch: the policy (serving/run/policy.py) that a part of a multi-node engine plugs into
its Program. A node that needs a peer (a worker's head, the Ray head its engine joins) waits for it before a
start and follows it while running; a part with a rendezvous port watches the ranks' connections on it, and
ends its part when a rank is lost, so that the whole engine starts again. None of it counts as a failure of
this node: no restart budget is spent.
"""

from __future__ import annotations

import logging
from collections import deque

from ...base.faultlog import FaultLog
from . import ports
from .policy import PREFLIGHT_RETRY_S, Policy

log = logging.getLogger("gpuwarden")

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


class RankWatch(Policy):
    """The ranks' health for one Program (its `program`), whose spec names the peer and the rendezvous."""

    def __init__(self, program):
        self.program = program
        self.peer_probe = program.ops.background(f"{program.name}-peer")
        self.peer_why: str | None = "not asked yet"  # the head's rendezvous, as last asked (None: it answers)
        # A multi-node part's connections on the rendezvous (socket inode -> remote address), read off the loop:
        self.links = program.ops.background(f"{program.name}-links")
        self.links_last: dict[int, str] = {}  # as the latest read found them
        self.links_held: dict[int, str] = {}  # those found by two reads in a row: only their loss counts
        self.links_next = 0.0  # when they are read next: once a liveness period (a read scans every connection)
        self.links_suspect: dict[int, str] = {}  # held connections one read found gone: the next read decides
        self.blind = FaultLog(log, period_s=BLIND_LOG_S)  # says when the watch cannot read the tables
        self.lost_ranks: deque[float] = deque()  # when this head last ended its part for a lost rank
        self.head_seen_down = True  # a worker whose own part failed waits until the head restarted its part
        self.head_wait_until = 0.0  # ... for this long at most (the head may never have seen this rank join)

    def spawned(self) -> None:
        self.links.discard()
        self.links_last, self.links_held = {}, {}  # a new part: its connections are counted afresh
        self.links_next, self.links_suspect = 0.0, {}

    def blocks(self, now: float) -> str | None:
        spec = self.program.spec
        if spec.peer is None:
            return None
        why = self._peer_answer()
        if why is not None:
            self.head_seen_down = True
            return self.waiting(why)
        if not self.head_seen_down and self.program.clock() < self.head_wait_until:
            host, port = spec.peer
            return (f"waiting for rank 0 to restart its part: the engine cannot carry on without this rank, and "
                    f"the head's rendezvous {host}:{port} still answers")
        return None

    def _peer_answer(self) -> str | None:
        """The latest answer of the head's rendezvous port (None: it accepts), asked again off the loop; before
        the first answer, 'not asked yet'."""
        self.peer_probe.start(self.program.ops.reachable, *self.program.spec.peer)
        outcome = self.peer_probe.take()
        if outcome is not None:
            self.peer_why = str(outcome.error) if outcome.error is not None else outcome.value
        return self.peer_why

    def waiting(self, why: str) -> str:
        host, port = self.program.spec.peer
        if self.program.spec.role == "head":  # the engine on a Ray head waits for its own Ray node
            return f"waiting for the Ray head {host}:{port} to answer ({why})"
        return f"waiting for rank 0: the head's rendezvous {host}:{port} does not answer ({why})"

    def head_up(self, running: bool, probe_failures: int) -> bool | None:
        if self.program.spec.peer is None or self.program.spec.role != "worker":
            return None
        if running:
            return probe_failures == 0
        return self.peer_why is None

    def failed(self, now: float) -> None:
        spec = self.program.spec
        if spec.peer is not None and spec.rendezvous:  # the head's part must start anew: wait (bounded)
            timing = spec.timing
            self.head_seen_down = False
            self.head_wait_until = now + 2 * timing.liveness_interval_s * timing.liveness_failures \
                + 2 * PREFLIGHT_RETRY_S

    def liveness_lost(self, now: float, why: str) -> bool:
        spec = self.program.spec
        if spec.peer is None or spec.health_path:
            return False
        self._lost_head(now, why)
        return True

    def watch(self, now: float, starting: bool) -> bool:
        """While starting, too, not from healthy on: a rank that joined counts once two reads found it, so a
        loss right after the engine turned healthy (before two reads while RUNNING) is still seen. The two-node
        test lost its worker within a second of the head's healthy line: unseen when the watch began at
        RUNNING. A head that starts says which ranks it still waits for."""
        program, spec = self.program, self.program.spec
        if not spec.rendezvous:
            return False
        self._read_links(now, starting)
        links = self._links_read(now)
        if links is None or self._lost_rank(now, links):
            return links is not None
        if starting and spec.peer is None and spec.hosts:
            waiting = self._ranks_missing(links)
            if waiting != program.problem:
                if waiting:
                    log.info("%s is %s", program.title, waiting)
                program.note_problem(waiting)
        return False

    def _read_links(self, now: float, starting: bool) -> None:
        """Start a read of this part's rendezvous connections on a worker thread, once a liveness period (every
        STARTING_LINKS_READ_S while it starts): with many connections on the host (any API client can open them)
        a read takes seconds of the loop's time."""
        spec = self.program.spec
        period = spec.timing.liveness_interval_s
        if starting:
            period = min(period, STARTING_LINKS_READ_S)
        if now >= self.links_next and self.links.start(self.program.ops.peers, spec.rendezvous,
                                                       self.program.identity.uid, spec.peer is None):
            self.links_next = now + period

    def _links_read(self, now: float) -> dict[int, str] | None:
        """The latest finished read of this part's rendezvous connections (ports.peers, run off the loop: with
        many connections on the host it takes seconds); None while none finished, or it failed or gave up."""
        outcome = self.links.take()
        if outcome is None or outcome.error is not None or outcome.started_at < self.program.phase.started:
            return None
        if outcome.value is None and self.blind.admit("blind", now) is not None:
            log.warning("%s cannot watch its rendezvous connections: the host's socket tables hold more lines "
                        "than gpuwarden reads (%d, or %d on port %d); a lost rank is not seen until they shrink",
                        self.program.title, ports.MAX_LINES, ports.MAX_PORT_LINES, self.program.spec.rendezvous)
        return outcome.value

    def _ranks_missing(self, links: dict[int, str]) -> str | None:
        """The head while it starts: the ranks whose node has no connection to its rendezvous yet (by the
        addresses in serve.nodes.hosts), as 'waiting for rank 1 (10.0.0.2) to join ...'; None once all have."""
        spec = self.program.spec
        seen = set(links.values())
        missing = [f"rank {r} ({host})" for r, host in enumerate(spec.hosts) if r and host not in seen]
        return f"waiting for {', '.join(missing)} to join the rendezvous on port {spec.rendezvous}" if missing else None

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
        spec = self.program.spec
        if spec.peer is not None:  # a worker: only its own connections to the head (not to a local torch job)
            held = {inode: a for inode, a in links.items() if a == spec.peer[0]}
        else:
            held = {inode: a for inode, a in links.items()
                    if not spec.hosts or a in spec.hosts or a.startswith("127.") or a == "::1"}
        missing = {inode: a for inode, a in self.links_held.items() if inode not in held}
        # /proc/net/tcp is no snapshot: the kernel writes it in chunks, and a connection can be skipped when
        # another in its hash bucket closes between two. A healthy engine is not ended on one read: a connection
        # is lost when two reads in a row (the second started at once) find it gone.
        lost = {inode: a for inode, a in missing.items() if inode in self.links_suspect}
        if missing and not lost:
            self.links_suspect, self.links_next = missing, now
            return False
        self.links_suspect = {}
        self.links_held = {inode: a for inode, a in held.items() if inode in self.links_last}
        self.links_last = held
        if not lost:
            return False
        self.links_last, self.links_held = {}, {}
        if spec.peer is not None:
            self._lost_head(now, f"its connection to the head's rendezvous {spec.head} closed")
            return True
        names = self._ranks_at(sorted(set(lost.values())))
        reason = f"lost {names}: its connection to the rendezvous on port {spec.rendezvous} closed"
        self.lost_ranks.append(now)
        while now - self.lost_ranks[0] > LOST_RANK_WINDOW_S:
            self.lost_ranks.popleft()
        wait = 1.0
        if len(self.lost_ranks) > LOST_RANK_LIMIT:
            wait = LOST_RANK_BACKOFF_S
            reason += (f"; {len(self.lost_ranks)} such restarts within {LOST_RANK_WINDOW_S / 60:g} minutes, so the "
                       f"next waits {wait:g} s (a rank that keeps failing, or a process opening and closing "
                       f"connections to port {spec.rendezvous})")
        title = self.program.title
        self.program.end_part(now, f"{title} {reason}; restarting this part, so that the whole engine starts again",
                              reason, wait, blocked=False,
                              message=f"{title} starts its part again in {wait:g} s, for {names} to rejoin")
        return True

    def _ranks_at(self, addresses: list[str]) -> str:
        """'rank 2 (10.0.0.3)' for a lost connection from an address of serve.nodes.hosts, else 'a connection
        from 10.0.0.9': the address is what is known (a local process may connect through any of them)."""
        hosts = self.program.spec.hosts
        ranks = [f"rank {hosts.index(a)} ({a})" for a in addresses if a in hosts[1:]]
        others = [f"a connection from {a}" for a in addresses if a not in hosts[1:]]
        return ", ".join(ranks + others)

    def _lost_head(self, now: float, why: str) -> None:
        """The head went away: this part cannot carry on without it (the engine's rendezvous starts anew), so
        it ends and waits for the head again. Not a failure of this node: no restart budget is spent."""
        self.peer_why = why
        self.links_last, self.links_held = {}, {}
        title = self.program.title
        self.program.end_part(now, f"{title} lost rank 0 (the head), ending its part: {why}", why, PREFLIGHT_RETRY_S,
                              message=f"{title} starts again once the head answers")
