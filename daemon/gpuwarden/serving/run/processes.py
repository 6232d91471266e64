"""Every OS call the supervisor makes, behind one seam (ProcessOps) that tests replace.

As in supervisor's process.py, a spawn that fails is an error the supervisor
turns into a child failure, never an exception in the loop. The daemon is a
child subreaper (prctl PR_SET_CHILD_SUBREAPER), so a process that leaves the
child's process group (setsid(), a double fork) is re-parented to us rather
than to init when its parent dies: we can still find it and kill it. After a crash the restarted daemon is
nobody's parent (init took them): under the unit, such leftovers are found in the unit's own cgroup
instead (find_strays), and nowhere else.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import itertools
import logging
import os
import re
import select
import signal
import stat
import subprocess
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from ...base import httpget
from ...base.background import Background
from ...base.keptlistener import LISTENERS
from . import handover, ports
from ..compose import nodes
from ..compose.identity import Identity, popen

log = logging.getLogger("gpuwarden")

MAX_LINE_BYTES = 16 * 1024  # a child's line longer than this is cut: one log record must stay small
HEALTH_DEADLINE_S = 5.0
HEALTH_MAX_BYTES = 64 * 1024
PR_SET_CHILD_SUBREAPER = 36
MAX_CGROUP_PROCS = 10_000  # cgroup.procs is read this far at most: a bounded look, whatever runs in the unit
MAX_STRAYS = 64  # leftovers held (a pidfd each) at once; any more are found by the next look
KILL_WAIT_S = 5.0  # after SIGKILL, how long a stop waits for the kernel before giving up on survivors
STRAY_GRACE_S = 5.0  # SIGTERM, then SIGKILL after this (where serve.stop_timeout_s is not known: cleanup)
# Only systemd makes a cgroup of this name (the unit's); a daemon run by hand sits in a session scope, a
# user's service or the root cgroup, where processes of serve.user's uid are not ours to end.
UNIT_CGROUP = re.compile(r"gpuwarden(@[^/]+)?\.service")


UNSEEN_EXIT = 256  # the exit status of an adopted child that is not ours to wait for (systemd reaped it)


@dataclass
class Child:
    pid: int
    pgid: int
    process: subprocess.Popen | None = None  # None: adopted from an earlier daemon (serving/run/handover.py)
    start_ticks: int | None = None  # /proc's starttime: what proves a PID is still this child
    output_fd: int | None = None  # the read end of its output pipe, kept across a handover
    word_fd: int | None = None  # a front's word pipe's read end (word.py), kept across a handover


class _Group(subprocess.Popen):
    """A process that leads its own group: a signal goes to the whole group, so that what a probe forked (a .pth
    in serve.user's venv runs code at start) ends with it. Polled first, as Popen.send_signal does: the group's
    ID is the leader's PID, which is not reused before the leader is reaped."""

    def send_signal(self, sig: int) -> None:
        self.poll()
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.pid, sig)


class ProcessOps:
    """The real OS. Tests pass a fake with the same methods."""

    def __init__(self) -> None:
        self._spawned: dict[int, subprocess.Popen] = {}  # our own children (not escaped processes)
        self._adopted: set[int] = set()  # children taken over from an earlier daemon: not escaped either
        # Short-lived processes of ours run from a worker thread (a reload's read of the installed versions): not
        # escaped either. The lock spans their start and escaped()'s look, so none is seen before it is known.
        self._helpers: dict[int, subprocess.Popen] = {}
        self._helpers_lock = threading.Lock()
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)

    def spawn(self, argv: tuple[str, ...], env: dict[str, str], identity: Identity,
              on_line: Callable[[str], None], pass_fds: tuple[int, ...] = ()) -> Child:
        """Start the child in its own session, as identity (identity.popen: serve.user, no capabilities,
        no_new_privs). Raises OSError, ValueError or SubprocessError when it cannot."""
        process = popen(identity, argv, env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                        stderr=subprocess.STDOUT, start_new_session=True, pass_fds=pass_fds)
        self._spawned[process.pid] = process
        # The descriptor is read before the reader starts: a child that writes a line and exits at once lets the
        # reader reach EOF and close the stream first ("I/O operation on closed file").
        output = process.stdout.fileno()
        threading.Thread(target=forward_lines, args=(process.stdout, on_line), daemon=True,
                         name=f"child-output-{process.pid}").start()
        return Child(process.pid, process.pid, process, handover.start_ticks(process.pid), output)

    def helper(self, identity: Identity, argv: list[str], env: dict[str, str], **kwargs) -> subprocess.Popen:
        """identity.popen for a process waited for on a worker thread, known as ours (escaped() leaves it be). It
        leads its own process group, which its kill() ends whole (_Group)."""
        with self._helpers_lock:
            process = popen(identity, argv, env, kind=_Group, start_new_session=True, **kwargs)
            self._helpers[process.pid] = process
        return process

    def end_helpers(self) -> None:
        """The daemon stops: SIGKILL every helper still running, its group with it. Its answer is of no use any more,
        and serve.user's interpreter may hang deaf to SIGTERM; no thread would be left to kill it at its deadline,
        and the unit's KillMode=process leaves it running after the daemon. What left its group (setsid) was
        re-parented to us: the engine's stop ends it (escaped())."""
        with self._helpers_lock:
            for process in self._helpers.values():
                process.kill()

    def adopt(self, entry: handover.Recorded, fd: int | None, on_line: Callable[[str], None]) -> Child | None:
        """Take back a child an earlier daemon started, if it is provably that child (else None, said once);
        its output is read again from fd (the pipe's read end that was kept), where there is one."""
        why = handover.proven(entry)
        if why is not None:
            log.warning("not adopting the recorded %s: %s", entry.name, why)
            return None
        self._adopted.add(entry.pid)
        try:
            if fd is not None and (fd <= 2 or not stat.S_ISFIFO(os.fstat(fd).st_mode)):
                raise OSError(errno.EBADF, "not a pipe")  # only a child's output pipe, never another of our fds
            stream = os.fdopen(fd, "rb", buffering=0) if fd is not None else None
        except OSError as exc:
            log.warning("%s (pid %d): its output pipe was not kept (%s): its output is lost until it restarts",
                        entry.name, entry.pid, exc.strerror)
            stream, fd = None, None
        if stream is not None:
            os.set_inheritable(fd, False)
            threading.Thread(target=forward_lines, args=(stream, on_line), daemon=True,
                             name=f"child-output-{entry.pid}").start()
        return Child(entry.pid, entry.pid, None, entry.start_ticks, fd)

    def poll(self, child: Child) -> int | None:
        if child.process is None:
            return self._poll_adopted(child)
        code = child.process.poll()
        if code is not None:
            self._spawned.pop(child.pid, None)
        return code

    def _poll_adopted(self, child: Child) -> int | None:
        """An adopted child is still ours to wait for after a re-exec (same PID), not after a crash (systemd
        became its parent): then it is gone when its PID no longer has its start time."""
        if child.start_ticks is None:
            return None  # a test's stand-in
        try:
            pid, status = os.waitpid(child.pid, os.WNOHANG)
        except ChildProcessError:
            pid, status = 0, 0
            if handover.start_ticks(child.pid) == child.start_ticks:
                return None
            self._adopted.discard(child.pid)
            return UNSEEN_EXIT
        if pid == 0:
            return None
        self._adopted.discard(child.pid)
        return os.waitstatus_to_exitcode(status)

    def killpg(self, pgid: int, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):  # already gone
            os.killpg(pgid, sig)

    def kill(self, pid: int, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)

    def group_pids(self, pgid: int) -> list[int]:
        """Live processes in a process group, orphans re-parented to init included."""
        return [pid for pid, (ppid, pgrp) in _processes().items() if pgrp == pgid]

    def escaped(self) -> list[int]:
        """Processes re-parented to us that we did not start ourselves (they left a child's group), with all their
        descendants."""
        me = os.getpid()
        with self._helpers_lock:
            # a waited-for helper is reaped (returncode set) before its PID can be reused
            self._helpers = {pid: p for pid, p in self._helpers.items() if p.returncode is None}
            found = _processes()
            helpers = set(self._helpers)
        roots = {pid for pid, (ppid, _) in found.items()
                 if ppid == me and pid not in self._spawned and pid not in self._adopted and pid not in helpers}
        # And everything below them, killed in the same pass: a stop looks once, and the children of a killed
        # escapee would be re-parented to us after that look, then to init when the daemon exits.
        return sorted(roots | {pid for pid in found if _descends(pid, roots, found)})

    def reap(self, pids: Iterable[int]) -> None:
        """Collect the exit status of killed processes, so they do not stay zombies: our own children through
        their Popen (which must see the status), re-parented ones directly."""
        for pid in pids:
            process = self._spawned.get(pid)
            if process is not None:
                if process.poll() is not None:
                    self._spawned.pop(pid, None)
                continue
            with contextlib.suppress(ChildProcessError, OSError):
                os.waitpid(pid, os.WNOHANG)

    def alive(self, pids: Iterable[int]) -> list[int]:
        """Those of pids that still run (zombies do not count)."""
        live = _processes()
        return [pid for pid in pids if pid in live]

    def uid_of(self, pid: int) -> int | None:
        try:
            return Path(f"/proc/{pid}").stat().st_uid
        except OSError:
            return None

    def catches(self, pid: int, sig: int) -> bool:
        """Whether the process has a handler for sig now (SigCgt in /proc/PID/status): a proxy of an older gpuwarden,
        adopted after an upgrade, has none for the word it is sent, whose default would end it."""
        try:
            with open(f"/proc/{pid}/status") as f:
                caught = next(int(line.split()[1], 16) for line in f if line.startswith("SigCgt:"))
        except (OSError, StopIteration, ValueError, IndexError):
            return False
        return bool(caught >> (sig - 1) & 1)

    def describe(self, pid: int) -> str:
        return ports.describe(pid)

    def background(self, name: str) -> Background:
        import time

        return Background(name, time.monotonic)

    def health(self, url: str, owner: int | tuple[int, ...] | None = None) -> httpget.Reply:
        """GET url; with owner, written only to a socket of that uid, or of one of those uids (base/sockowner.py)."""
        return httpget.get(url, HEALTH_DEADLINE_S, HEALTH_MAX_BYTES, owner=owner)

    def reachable(self, host: str, port: int) -> str | None:
        """None if host:port accepts a TCP connection (2 s at most); else why not."""
        return nodes.reachable(host, port)

    def peers(self, port: int, uid: int, accepted: bool) -> dict[int, str] | None:
        return ports.peers(port, uid, accepted=accepted)

    def port_free(self, host: str, port: int) -> bool:
        return ports.port_free(host, port)

    def owns_port(self, host: str, port: int, group: Iterable[int] | None, uid: int) -> bool:
        """True if the socket listening on host:port belongs to these processes. Only the listeners that take
        host's connections count (ports.covering): a local user may listen on the same port number on another
        address (127.0.0.2, or [::1] with IPV6_V6ONLY beside 0.0.0.0), and that is never evidence about ours.
        Under the unit, root lacks CAP_SYS_PTRACE and cannot read another uid's /proc/PID/fd: then the
        socket's owner uid (in /proc/net/tcp) must be the child's, and no other listener may take host:port. So too
        where group is None: a container's engine, whose processes are the runtime's, not in the child's group."""
        sockets = ports.listening_sockets(port, host=host)
        if not sockets:
            return False
        kept = next((k.inode() for k in LISTENERS.values() if k.holds(host, port)), None)
        if kept is not None:  # the daemon's own socket, which the child inherited: it alone takes host:port
            return set(sockets) == {kept}
        if group is not None:
            with contextlib.suppress(ports.Unseen):
                return bool(ports.holders(set(sockets), group))
        return set(sockets.values()) == {uid}

    def who_listens(self, host: str, port: int) -> str:
        return ports.who_listens(port, host=host)

    def listen(self, name: str, host: str, port: int) -> int:
        """The fd of the daemon's kept listener name on host:port (base/keptlistener.py), bound if it is not yet.
        Raises OSError (EADDRINUSE: another process holds the port)."""
        return LISTENERS[name].bind(host, port)


def cgroup2(pid: int | str, proc: str = "/proc") -> str | None:
    """The process's cgroup v2 path ("0::" in /proc/PID/cgroup), or None."""
    try:
        with open(f"{proc}/{pid}/cgroup", "rb") as f:
            raw = f.read(64 * 1024)
    except OSError:
        return None
    return next((line[3:] for line in raw.decode("utf-8", "surrogateescape").splitlines()
                 if line.startswith("0::")), None)


def unit_cgroup(proc: str = "/proc") -> Path | None:
    """The folder of this process's own cgroup (v2) when it is gpuwarden's unit's (UNIT_CGROUP); else None."""
    path = cgroup2("self", proc)
    if path is None or not UNIT_CGROUP.fullmatch(path.rpartition("/")[2]):
        return None
    try:
        mounts = Path(proc, "self", "mounts").read_text("utf-8", "surrogateescape")
    except OSError:
        return None
    for fields in (line.split() for line in mounts.splitlines()):
        if len(fields) > 2 and fields[2] == "cgroup2":  # mount points write a space etc. as octal escapes
            root = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m[1], 8)), fields[1])
            return Path(root, path.lstrip("/"))
    return None


def find_strays(uids: Iterable[int], live: Iterable[int]) -> list[int]:
    """Leftovers of ours: processes in the unit's own cgroup that run as one of uids (never root), outside every
    live child's process group and tree (live: their leaders; a child leads its group) and outside this
    process's own tree (what it runs itself, and what escaped() finds). A process that left a child's group
    before a daemon crash was re-parented to init, not to the daemon after it: this is where it is found.
    Empty outside the unit, and where the cgroup read does not list this process (not our cgroup after all)."""
    folder = unit_cgroup()
    uids = set(uids) - {0}
    if folder is None or not uids:
        return []
    try:
        with open(folder / "cgroup.procs", "rb") as f:
            pids = {int(line) for line in itertools.islice(f, MAX_CGROUP_PROCS)}
    except (OSError, ValueError):
        return []
    me = os.getpid()
    if me not in pids:
        return []
    table, live = _processes(), set(live)
    keep = {me, *live}
    found = []
    for pid in sorted(pids):
        if pid in table and table[pid][1] not in live and _uid(pid) in uids and not _descends(pid, keep, table):
            found.append(pid)
    return found[:MAX_STRAYS]


def _uid(pid: int) -> int | None:
    try:
        return os.stat(f"/proc/{pid}").st_uid
    except OSError:
        return None


def _descends(pid: int, ancestors: set[int], table: dict[int, tuple[int, int]]) -> bool:
    for _ in range(len(table)):  # bounded: a PID table has no cycles, but a snapshot is taken over time
        pid = table.get(pid, (0, 0))[0]
        if pid in ancestors:
            return True
        if pid <= 1:
            return False
    return False


@dataclass
class _Held:
    pidfd: int
    kill_at: float
    killed: bool = False


class Strays:
    """Leftovers (find_strays) ended as a stop ends a child: SIGTERM now, SIGKILL after the grace; one line names
    each. Each is held by a pidfd from before its last check on, so a PID recycled meanwhile is never
    signalled."""

    def __init__(self) -> None:
        self._held: dict[int, _Held] = {}

    def __bool__(self) -> bool:
        return bool(self._held)

    def end(self, pids: Iterable[int], uids: Iterable[int], live: Iterable[int], now: float, grace: float) -> None:
        uids, live, mine = set(uids) - {0}, set(live), cgroup2("self")
        for pid in pids:
            if pid in self._held or len(self._held) >= MAX_STRAYS:
                continue
            try:
                pidfd = os.pidfd_open(pid)
            except OSError:
                continue  # gone
            # Checked again once held: while the pidfd has not exited, these facts are its process's.
            group = (_stat(pid) or (0, 0))[1]
            if (_uid(pid) not in uids or group in live or cgroup2(pid) != mine or _exited(pidfd)
                    or not _signal(pidfd, signal.SIGTERM)):
                os.close(pidfd)
                continue
            log.warning("stopping %s: left behind in this unit's cgroup, outside every running child's process "
                        "group (SIGTERM, SIGKILL after %g s)", ports.describe(pid), grace)
            self._held[pid] = _Held(pidfd, now + grace)

    def tick(self, now: float) -> None:
        """SIGKILL those past their grace; forget those gone (never waits)."""
        for pid, held in list(self._held.items()):
            if not _exited(held.pidfd):
                if now < held.kill_at:
                    continue
                if not held.killed:
                    log.warning("pid %d did not stop within its grace: SIGKILL", pid)
                    _signal(held.pidfd, signal.SIGKILL)
                    held.killed, held.kill_at = True, now + KILL_WAIT_S
                    continue
                log.error("pid %d survived SIGKILL for %g s", pid, KILL_WAIT_S)
            os.close(held.pidfd)
            del self._held[pid]

    def hurry(self, now: float) -> None:
        """A second stop request: no more grace."""
        for held in self._held.values():
            if not held.killed:
                held.kill_at = now
        self.tick(now)

    def wait(self, clock: Callable[[], float]) -> None:
        """Until every one is gone or given up on (cleanup, which may wait): woken by their exits."""
        while self._held:
            poller = select.poll()
            for held in self._held.values():
                poller.register(held.pidfd, select.POLLIN)
            next_at = min(held.kill_at for held in self._held.values())
            poller.poll(max(0, (next_at - clock()) * 1000) + 1)
            self.tick(clock())


def _exited(pidfd: int) -> bool:
    """A pidfd reads as readable once its process has ended."""
    poller = select.poll()
    poller.register(pidfd, select.POLLIN)
    return bool(poller.poll(0))


def _signal(pidfd: int, sig: int) -> bool:
    try:
        signal.pidfd_send_signal(pidfd, sig)
    except OSError:
        return False  # gone meanwhile
    return True


def _processes() -> dict[int, tuple[int, int]]:
    """pid -> (ppid, process group) of every live, non-zombie process."""
    out = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit() and (found := _stat(int(entry.name))) is not None:
            out[int(entry.name)] = found
    return out


def _stat(pid: int) -> tuple[int, int] | None:
    """(ppid, process group) of a live, non-zombie process; None once it has ended."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except OSError:
        return None  # ended while we looked
    return None if fields[0] == b"Z" else (int(fields[1]), int(fields[2]))


# How many lines of a child's output reach the log: LINES_PER_S on average, LINES_BURST at once (a start's
# banner, a traceback). Past that its output is read a block at a time and dropped unsplit, counted, until half the
# burst has come back (or the child is quiet that long: its flood is over), and one line says how many were dropped:
# serve.user's engine printing 23,600 lines a second held 87 % of a core of the daemon and its loop 0.4 s a poll
# (attacker 11), and journald's own limit (10,000 lines in 30 s a unit) would then have dropped the daemon's alerts
# with the engine's lines. A flood costs the log a burst and a line every RESUME / LINES_PER_S seconds.
LINES_PER_S = 200.0
LINES_BURST = 2000.0
RESUME = LINES_BURST / 2
DROP_READ = 64 * 1024


def forward_lines(stream, on_line: Callable[[str], None], limit: int = MAX_LINE_BYTES,
                  clock: Callable[[], float] = time.monotonic) -> None:
    """Hand the child's output to on_line a line at a time; a line longer than limit is cut there and the
    rest of it skipped, so an endless line can neither balloon our memory nor one log record. Past the line
    budget (LINES_PER_S, LINES_BURST) lines are dropped and counted (_drop)."""
    tokens, last = LINES_BURST, clock()
    with contextlib.suppress(OSError, ValueError):
        while True:
            tokens, last = _refill(tokens, last, clock())
            if tokens < 1:
                more, tokens, last = _drop(stream, on_line, tokens, clock)
                if not more:
                    break
                continue
            raw = stream.readline(limit)
            if not raw:
                break
            tokens -= 1
            if raw.endswith(b"\n") or len(raw) < limit:
                on_line(raw.decode("utf-8", "replace").rstrip())
                continue
            skipped = 0
            while (rest := stream.readline(limit)) and not rest.endswith(b"\n"):
                skipped += len(rest)
            skipped += len(rest)
            on_line(raw.decode("utf-8", "replace") + f" [line cut: {skipped} more bytes dropped]")
    with contextlib.suppress(OSError):
        stream.close()


def _drop(stream, on_line: Callable[[str], None], tokens: float,
          clock: Callable[[], float]) -> tuple[bool, float, float]:
    """Read and count what the child writes until the budget holds RESUME lines again, or the child was quiet
    until then; one line says how many were dropped. (False at the end of its output, the budget, its time.) What
    the stream buffered comes first; then the pipe itself, each read waited for no longer than the budget's
    refill (select), so that a flood that stopped is said at once and its pipe read line by line again."""
    dropped, fd = 0, stream.fileno()
    block = getattr(stream, "read1", stream.read)(DROP_READ)  # the buffer, else what the pipe holds
    last = clock()
    while block:
        dropped += block.count(b"\n")
        tokens, last = _refill(tokens, last, clock())
        if tokens >= RESUME or not select.select([fd], [], [], (RESUME - tokens) / LINES_PER_S)[0]:
            break
        block = os.read(fd, DROP_READ)
    if dropped:
        on_line(f"[gpuwarden: {dropped} lines of output dropped: more than {LINES_PER_S:g} a second]")
    return (bool(block), *_refill(tokens, last, clock()))


def _refill(tokens: float, last: float, now: float) -> tuple[float, float]:
    """The line budget at now: LINES_PER_S more lines a second since last, LINES_BURST at most."""
    return min(LINES_BURST, tokens + (now - last) * LINES_PER_S), now

