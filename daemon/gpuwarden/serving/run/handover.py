"""Children that outlive the daemon's process image: an upgrade (the daemon re-executes itself, same PID) or a
daemon crash (systemd starts a new one). Either way the new daemon finds the record of its running children
and takes them back instead of killing a healthy engine that took minutes to load.

The record (children.json in the state directory) is rewritten whenever a child starts or ends. A process
is adopted only when it is provably the one recorded: the same PID *and* the same start time (/proc's
starttime, in clock ticks since boot: a recycled PID has another), the same user, and the same command
line; and only when the new config asks for that same command. Anything else that matches is a leftover,
which the usual start path kills.

A child's output pipe must outlive the old image too, or the engine's next log line meets a closed pipe:
on re-exec its read end is inherited (its fd number is in the record); after a crash, systemd's file
descriptor store kept it (FDSTORE=1, FDNAME=child-NAME) and hands it back as LISTEN_FDS.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import signal
import stat
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from ...base import smallfile

log = logging.getLogger("gpuwarden")

RECORD = "children.json"
MAX_RECORD_BYTES = 64 * 1024
SD_LISTEN_FDS_START = 3


@dataclass(frozen=True)
class Recorded:
    name: str  # the program's name ("vllm", "proxy")
    pid: int  # the group leader; pgid == pid (each child starts its own session)
    start_ticks: int  # /proc/PID/stat field 22
    uid: int
    argv_sha256: str  # of the NUL-joined argv, as /proc/PID/cmdline shows it
    fd: int | None = None  # the output pipe's read end in the process that wrote the record (re-exec only)
    # Not healthy yet when recorded (STARTING): the daemon that adopts it waits for its health from its start on,
    # as the one that started it did. None: not known (an older daemon's record), so its health is awaited too.
    starting: bool | None = None
    # Of the environment it was started with (env_digest): a handover whose config gives the child another one
    # (serve.env, serve.gpus' CUDA_VISIBLE_DEVICES, the credentials) replaces it. None: not recorded (an older
    # daemon's record), not compared.
    env_sha256: str | None = None
    word_fd: int | None = None  # a front's word pipe's read end (serving/run/word.py), as fd above (re-exec only)


@dataclass(frozen=True)
class Record:
    children: tuple[Recorded, ...]
    stopping: bool = False  # the daemon was stopping: anything left after it is a leftover, not to adopt
    # A daemon that had these to adopt failed to start (a config the new image refuses): they serve on,
    # unsupervised, and cleanup (ExecStopPost) leaves them to the next daemon, whatever the exit status.
    keep: bool = False


def argv_digest(argv: Sequence[str]) -> str:
    return hashlib.sha256("\0".join(argv).encode("utf-8", "surrogateescape")).hexdigest()


def env_digest(env: Mapping[str, str]) -> str:
    """Of an environment, in any order (the record is root's, 0600: a secret's value is in it only digested)."""
    return hashlib.sha256("\0".join(f"{k}={v}" for k, v in sorted(env.items())).encode("utf-8", "surrogateescape")
                          ).hexdigest()


def start_ticks(pid: int) -> int | None:
    """The process's start time in clock ticks since boot, or None when it is gone (or a zombie)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if fields[0] == b"Z" else int(fields[19])


def started_wall(ticks: int) -> float:
    """A start time in clock ticks since boot as seconds since the epoch."""
    with open("/proc/stat", "rb") as f:
        btime = next(int(line.split()[1]) for line in f if line.startswith(b"btime "))
    return btime + ticks / os.sysconf("SC_CLK_TCK")


def cmdline_digest(pid: int) -> str | None:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None
    return hashlib.sha256(raw.rstrip(b"\0")).hexdigest()


def cgroup_of(pid: int | str) -> bytes | None:
    try:
        return Path(f"/proc/{pid}/cgroup").read_bytes()
    except OSError:
        return None


def proven(entry: Recorded) -> str | None:
    """None when the running process is provably the recorded child; else why not (in words). Its PID, start
    time, user and command line anyone can read in /proc: it must also be in this daemon's own cgroup (the
    unit's), which a process started elsewhere is not."""
    if entry.pid <= 1:
        return f"pid {entry.pid} is not a child"
    ticks = start_ticks(entry.pid)
    if ticks is None:
        return f"pid {entry.pid} is gone"
    if ticks != entry.start_ticks:
        return f"pid {entry.pid} started at another time (a recycled PID)"
    try:
        uid = Path(f"/proc/{entry.pid}").stat().st_uid
    except OSError:
        return f"pid {entry.pid} is gone"
    if uid != entry.uid:
        return f"pid {entry.pid} runs as uid {uid}, not {entry.uid}"
    if cmdline_digest(entry.pid) != entry.argv_sha256:
        return f"pid {entry.pid} runs another command line"
    if cgroup_of(entry.pid) != cgroup_of("self"):
        return f"pid {entry.pid} is in another cgroup than this daemon"
    return None


def end_leftovers(record: Record | None, why: str) -> int:
    """SIGKILL the process groups of recorded children that are provably ours but must not be adopted (the
    daemon before was stopping them, or serving is off now); the record goes. Returns how many groups."""
    if record is None:
        return 0
    ended = 0
    for entry in record.children:
        if proven(entry) is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(entry.pid, signal.SIGKILL)
                ended += 1
                log.warning("killed the leftover %s (pid %d and its group): %s", entry.name, entry.pid, why)
    return ended


def save(state_dir: Path | None, record: Record) -> None:
    """Write the record atomically (best effort: without a state directory nothing can be adopted)."""
    if state_dir is None:
        return
    path = state_dir / RECORD
    data = json.dumps({"children": [asdict(c) for c in record.children], "stopping": record.stopping,
                       "keep": record.keep})
    try:
        state_dir.mkdir(parents=True, exist_ok=True)
        smallfile.write_atomic(path, data.encode())
    except OSError as exc:
        log.warning("the record of the children was not saved to %s: %s", path, exc.strerror or exc)


class Recorder:
    """The record on disk kept true to what runs: rewritten when the running children change (a start, an end, a
    child that turns healthy), and their output pipes kept in systemd's fd store (keep_fd), so that a daemon
    started after this one (re-exec or crash) can take them over. It owns the file and the pipes' place in the
    store; it never signals or judges a child."""

    def __init__(self, state_dir: Path | None, keep_fd: Callable[[str, int | None], None] | None):
        self.state_dir = state_dir  # where the record lives (None: no adoption)
        self.keep_fd = keep_fd  # hands a child's output pipe to systemd's fd store (None: drop it)
        self.recorded: Record | None = None  # what the record on disk says now

    def update(self, running: Sequence[Recorded], stopping: bool) -> None:
        record = Record(tuple(running), stopping)
        if record == self.recorded:
            return
        if self.recorded is None and record == Record(()) and not self.on_disk():
            self.recorded = record  # nothing runs and nothing was recorded (serving off): no file to write
            return
        old = {c.name: c for c in (self.recorded.children if self.recorded else ())}
        if self.keep_fd is not None:
            for entry in record.children:
                if old.get(entry.name) != entry:
                    for kind, fd in (("child", entry.fd), ("word", entry.word_fd)):
                        if fd is not None:
                            self.keep_fd(f"{kind}-{entry.name}", fd)
            for name in set(old) - {c.name for c in record.children}:
                self.keep_fd(f"child-{name}", None)
                if old[name].word_fd is not None:
                    self.keep_fd(f"word-{name}", None)
        save(self.state_dir, record)
        self.recorded = record

    def on_disk(self) -> bool:
        """A record is there (even one not read: a stale one is replaced by what runs now)."""
        return self.state_dir is not None and os.path.lexists(self.state_dir / RECORD)

    def for_exec(self) -> Record:
        """The record as it stands, its pipes made inheritable: what a re-executed image needs."""
        for entry in self.recorded.children:
            for fd in (entry.fd, entry.word_fd):
                if fd is not None:
                    os.set_inheritable(fd, True)
        return self.recorded


def keep(state_dir: Path | None) -> str | None:
    """A start failed with children to adopt: mark the record keep, so that cleanup (ExecStopPost) leaves them
    serving for the next daemon after an exit it would otherwise read as a stop (78). Returns the children, in
    words, for the log line; None where there is nothing to keep (no record, a stop's, or no child)."""
    record = load(state_dir)
    if record is None or record.stopping or not record.children:
        return None
    save(state_dir, Record(record.children, record.stopping, keep=True))
    return ", ".join(f"{c.name} pid {c.pid}" for c in record.children)


def load(state_dir: Path | None) -> Record | None:
    """The record, or None when there is none or it cannot be read (said once; nothing is adopted then)."""
    if state_dir is None:
        return None
    path = state_dir / RECORD
    try:
        raw = smallfile.read(path, MAX_RECORD_BYTES)
        if raw is None:
            return None
        doc = json.loads(raw)
        children = tuple(Recorded(str(c["name"]), int(c["pid"]), int(c["start_ticks"]), int(c["uid"]),
                                  str(c["argv_sha256"]), None if c.get("fd") is None else int(c["fd"]),
                                  c.get("starting") if isinstance(c.get("starting"), bool) else None,
                                  c["env_sha256"] if isinstance(c.get("env_sha256"), str) else None,
                                  None if c.get("word_fd") is None else int(c["word_fd"]))
                         for c in doc["children"])
        return Record(children, bool(doc.get("stopping", False)), bool(doc.get("keep", False)))
    except smallfile.Unreadable as exc:
        if exc.errno is not None:  # it could not be opened, or read
            log.warning("children's record %s cannot be read (%s): adopting nothing", path, exc)
        else:
            log.warning("children's record %s is not one gpuwarden wrote (%s): adopting nothing", path,
                        f"larger than {MAX_RECORD_BYTES} bytes" if stat.S_ISREG(exc.st.st_mode) else exc)
        return None
    except (ValueError, KeyError, TypeError, OverflowError, RecursionError) as exc:
        log.warning("children's record %s is not one gpuwarden wrote (%s): adopting nothing", path,
                    type(exc).__name__ if isinstance(exc, RecursionError) else exc)
        return None


def clear(state_dir: Path | None) -> None:
    if state_dir is not None:
        with contextlib.suppress(OSError):
            (state_dir / RECORD).unlink()


def stored_fds(environ: Mapping[str, str] = os.environ) -> dict[str, int]:
    """The file descriptors systemd handed back from its store (LISTEN_FDS, LISTEN_FDNAMES), by name, when
    they are meant for this process; the variables are removed so that no child inherits them."""
    pid, count, names = environ.get("LISTEN_PID"), environ.get("LISTEN_FDS", ""), environ.get("LISTEN_FDNAMES", "")
    if pid != str(os.getpid()) or not count.isdigit():
        return {}
    if environ is os.environ:
        for key in ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES"):
            os.environ.pop(key, None)
    fds = range(SD_LISTEN_FDS_START, SD_LISTEN_FDS_START + int(count))
    return {name: fd for name, fd in zip(names.split(":"), fds) if name}
