"""Run vLLM as a well-behaved child: explicit states, health checks, backoff, no orphans.

Modelled on supervisor's process.py: states STOPPED, STARTING, RUNNING,
BACKOFF, STOPPING, EXITED and FATAL, "died while starting" told apart from
"died later", and every OS call behind one seam (ProcessOps) that tests
replace. The child runs in its own session, so its process group holds the
API server and every engine/worker process it forks; that group is what gets
SIGTERM, then SIGKILL, and what must be empty before the next start.
"""

from __future__ import annotations

import contextlib
import grp
import logging
import os
import pwd
import re
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..config import ServeConfig
from ..gpu.base import Gpu
from .command import ServeCommand, gpu_memory_utilization

log = logging.getLogger("gpuwarden")

STOPPED, STARTING, RUNNING, BACKOFF, STOPPING, EXITED, FATAL = (
    "STOPPED", "STARTING", "RUNNING", "BACKOFF", "STOPPING", "EXITED", "FATAL")
STATES = (STOPPED, STARTING, RUNNING, BACKOFF, STOPPING, EXITED, FATAL)
DEVICE_GROUPS = ("video", "render")  # /dev/nvidia* and /dev/dri access; the only extra groups the child gets
VLLM_LEVEL = re.compile(r"^(?:\(\w+ pid=\d+\)\s*)?(DEBUG|INFO|WARNING|ERROR|CRITICAL)\b")
PREFLIGHT_RETRY_S = 5.0


@dataclass
class Child:
    pid: int
    pgid: int
    process: subprocess.Popen | None = None


class ProcessOps:
    """Every OS call the supervisor makes. Tests pass a fake."""

    def child_identity(self, user: str) -> tuple[str | None, int | None]:
        """(user to drop to, or None to stay ourselves; the child's uid, or None if the user does not exist).
        Only root can drop privileges, so anyone else runs vLLM as themselves."""
        if os.geteuid() != 0:
            me = pwd.getpwuid(os.geteuid()).pw_name
            if me != user:
                log.info("not running as root, so vLLM runs as %s rather than serve.user %s", me, user)
            return None, os.geteuid()
        try:
            return user, pwd.getpwnam(user).pw_uid
        except KeyError:
            return user, None

    def spawn(self, argv: tuple[str, ...], env: dict[str, str], user: str | None,
              on_line: Callable[[str], None]) -> Child:
        kwargs: dict = {}
        if user is None:  # we stay ourselves
            me = pwd.getpwuid(os.geteuid())
            env = {"HOME": me.pw_dir, "USER": me.pw_name, "LOGNAME": me.pw_name, **env}
        else:
            entry = pwd.getpwnam(user)
            groups = [g.gr_gid for g in grp.getgrall() if g.gr_name in DEVICE_GROUPS]
            kwargs = {"user": entry.pw_uid, "group": entry.pw_gid, "extra_groups": groups}
            env = {"HOME": entry.pw_dir, "USER": user, "LOGNAME": user, **env}  # serve.env may override
        process = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, start_new_session=True, close_fds=True,
                                   cwd="/", **kwargs)
        threading.Thread(target=_forward, args=(process.stdout, on_line), daemon=True,
                         name=f"vllm-output-{process.pid}").start()
        return Child(process.pid, process.pid, process)

    def poll(self, child: Child) -> int | None:
        return child.process.poll() if child.process else None

    def killpg(self, pgid: int, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):  # already gone
            os.killpg(pgid, sig)

    def kill(self, pid: int, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)

    def group_pids(self, pgid: int) -> list[int]:
        """Live processes in a process group, orphans re-parented to init included."""
        pids = []
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == pgid and fields[0] != "Z":  # pgrp, and not a zombie
                pids.append(int(stat.parent.name))
        return pids

    def uid_of(self, pid: int) -> int | None:
        try:
            return Path(f"/proc/{pid}").stat().st_uid
        except OSError:
            return None

    def healthy(self, url: str, timeout: float = 2.0) -> bool:
        try:
            with urllib.request.urlopen(url, timeout=timeout) as reply:
                return reply.status == 200
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            return False

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)


def _forward(stream, on_line: Callable[[str], None]) -> None:
    for raw in iter(stream.readline, b""):
        on_line(raw.decode("utf-8", "replace").rstrip())
    stream.close()


@dataclass(frozen=True)
class ServingView:
    """The supervisor as the snapshot, the metrics and `gpuwarden status` see it."""

    state: str
    model: str
    profile: str
    pid: int | None
    restarts: int
    last_exit_code: int | None
    time_to_healthy_s: float | None
    problem: str | None  # why it is not serving, when it is not
    blocked: bool = False  # waiting for the GPUs to be free before a start


class Supervisor:
    def __init__(self, serve: ServeConfig, command: ServeCommand, gpus: list[Gpu],
                 ops: ProcessOps | None = None, clock: Callable[[], float] = time.monotonic):
        self.serve = serve
        self.command = command
        self.gpus = gpus
        self.ops = ops or ProcessOps()
        self.clock = clock
        self.state = STOPPED
        self.child: Child | None = None
        self.user, self.uid = self.ops.child_identity(serve.user)
        self.restarts = 0
        self.last_exit_code: int | None = None
        self.time_to_healthy_s: float | None = None
        self.problem: str | None = None
        self.blocked = False
        self._failures: deque[float] = deque()
        self._consecutive = 0
        self._started_at = 0.0
        self._running_since = 0.0
        self._retry_at = 0.0
        self._next_probe = 0.0
        self._probe_failures = 0
        self._last_level = logging.INFO
        self.error_lines: deque[str] = deque(maxlen=10)

    # -- the child's output ---------------------------------------------------------
    def on_line(self, line: str) -> None:
        match = VLLM_LEVEL.match(line)
        if match:
            self._last_level = getattr(logging, match.group(1))
        # Lines without a level (traceback bodies) keep the level of the line they follow.
        log.log(self._last_level, "vllm: %s", line)
        if self._last_level >= logging.WARNING or re.search(r"Error|Exception", line):
            self.error_lines.append(line)

    # -- life cycle -------------------------------------------------------------------
    def start(self, now: float) -> None:
        if self.state in (STARTING, RUNNING, STOPPING):
            return
        if self.uid is None:
            self._fatal(f"user {self.user} does not exist (create it, or set serve.user)")
            return
        blocked = self._preflight()
        self.blocked = blocked is not None
        if blocked:
            self.problem = blocked
            self.state, self._retry_at = BACKOFF, now + PREFLIGHT_RETRY_S
            log.warning("vLLM start waits: %s", blocked)
            return
        self.error_lines.clear()
        self.child = self.ops.spawn(self.command.argv, self.command.env, self.user, self.on_line)
        self.state, self._started_at, self.problem = STARTING, now, None
        log.info("vLLM starting (pid %d, profile %s): %s", self.child.pid, self.command.profile.name,
                 " ".join(self.command.argv))

    def _preflight(self) -> str | None:
        """None if the GPUs are free for a new child; else why not (after killing our own leftovers)."""
        uid = self.uid
        for gpu in self.gpus:
            for pid, _ in gpu.compute_processes():
                if self.ops.uid_of(pid) == uid:
                    log.warning("GPU%d: killing leftover vLLM process %d of user %s", gpu.index, pid,
                                self.user or "self")
                    self.ops.kill(pid, signal.SIGKILL)
        want = gpu_memory_utilization(self.command.argv)
        for gpu in self.gpus:
            s = gpu.sample()
            others = [pid for pid, _ in gpu.compute_processes() if self.ops.uid_of(pid) != uid]
            if others:
                return f"GPU{gpu.index} runs other compute processes {others}"
            if s.memory_total_bytes and s.memory_used_bytes is not None:
                free = s.memory_total_bytes - s.memory_used_bytes
                if free < want * s.memory_total_bytes:
                    return (f"GPU{gpu.index} has {free / 2**30:.1f} GiB free, less than "
                            f"--gpu-memory-utilization {want:g} of {s.memory_total_bytes / 2**30:.1f} GiB")
        return None

    def tick(self, now: float) -> None:
        if self.state == BACKOFF and now >= self._retry_at:
            self.start(now)
        elif self.state in (STARTING, RUNNING):
            code = self.ops.poll(self.child)
            if code is not None:
                died = "died while starting" if self.state == STARTING else "exited"
                self._failed(now, f"vLLM {died} with {_describe_exit(code)}", code)
            elif self.state == STARTING:
                self._starting(now)
            else:
                self._running(now)

    def _starting(self, now: float) -> None:
        if self.ops.healthy(self.serve.url + "/health"):
            self.state, self._running_since = RUNNING, now
            self.time_to_healthy_s = now - self._started_at
            self._next_probe, self._probe_failures = now + self.serve.liveness_interval_s, 0
            log.info("vLLM healthy after %.1f s on %s", self.time_to_healthy_s, self.serve.url)
        elif now - self._started_at > self.serve.startup_timeout_s:
            self._failed(now, f"vLLM not healthy within startup_timeout_s {self.serve.startup_timeout_s:g} s")

    def _running(self, now: float) -> None:
        if self._consecutive and now - self._running_since >= self.serve.stable_after_s:
            self._consecutive = 0  # a stable run resets the backoff
        if now < self._next_probe:
            return
        self._next_probe = now + self.serve.liveness_interval_s
        if self.ops.healthy(self.serve.url + "/health"):
            self._probe_failures = 0
            return
        self._probe_failures += 1
        log.warning("vLLM liveness probe failed (%d of %d)", self._probe_failures, self.serve.liveness_failures)
        if self._probe_failures >= self.serve.liveness_failures:
            self._failed(now, f"vLLM failed {self._probe_failures} liveness probes in a row")

    def _failed(self, now: float, reason: str, code: int | None = None) -> None:
        self.state = EXITED
        self.last_exit_code = code
        left = self._kill_group()
        log.error("%s; %s", reason, f"killed {left} leftover processes of its group" if left else "no process left")
        self._failures.append(now)
        while self._failures and now - self._failures[0] > self.serve.crash_loop_window_s:
            self._failures.popleft()
        if len(self._failures) >= self.serve.crash_loop_failures:
            self._fatal(f"{len(self._failures)} failures within {self.serve.crash_loop_window_s:g} s; "
                        f"last: {reason}")
            return
        self._consecutive += 1
        delay = min(self.serve.backoff_max_s, 2.0 ** (self._consecutive - 1))
        self.restarts += 1
        self.state, self._retry_at, self.problem = BACKOFF, now + delay, reason
        log.warning("vLLM restarts in %g s (restart %d)", delay, self.restarts)

    def _fatal(self, reason: str) -> None:
        self.state, self.problem = FATAL, reason
        last = " | ".join(self.error_lines) or "none captured"
        log.critical("vLLM FATAL, not restarting until SIGHUP: %s; its last error lines: %s", reason, last)

    def _kill_group(self, grace_s: float = 0.0) -> int:
        """SIGTERM (then after grace_s SIGKILL) the child's group; wait until it is empty. Returns how many
        processes were still alive when we began."""
        if self.child is None:
            return 0
        pgid = self.child.pgid
        alive = self.ops.group_pids(pgid)
        if alive:
            self.ops.killpg(pgid, signal.SIGTERM if grace_s else signal.SIGKILL)
            deadline = self.clock() + grace_s
            while self.ops.group_pids(pgid) and self.clock() < deadline:
                self.ops.sleep(0.1)
            self.ops.killpg(pgid, signal.SIGKILL)
            for _ in range(100):  # SIGKILL is quick; verify rather than assume
                if not self.ops.group_pids(pgid):
                    break
                self.ops.sleep(0.05)
            else:
                log.error("processes %s of vLLM's group survived SIGKILL", self.ops.group_pids(pgid))
        self.ops.poll(self.child)  # reap the leader
        self.child = None
        return len(alive)

    def stop(self) -> None:
        """SIGTERM to the group, stop_timeout_s to drain, then SIGKILL; nothing of it remains."""
        if self.child is None:
            self.state = STOPPED
            return
        self.state = STOPPING
        left = self._kill_group(grace_s=self.serve.stop_timeout_s)
        self.state = STOPPED
        log.info("vLLM stopped (%d processes in its group at the stop)", left)

    def reset(self, now: float) -> None:
        """SIGHUP: leave FATAL and try again from scratch."""
        if self.state == FATAL:
            self._failures.clear()
            self._consecutive = 0
            self.state = STOPPED
            self.start(now)

    def view(self) -> ServingView:
        return ServingView(self.state, self.serve.model, self.command.profile.name,
                           self.child.pid if self.child else None, self.restarts, self.last_exit_code,
                           self.time_to_healthy_s, self.problem, self.blocked)


def _describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"exit status {code}"
