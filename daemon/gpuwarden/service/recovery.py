"""What the daemon does by itself when a GPU must not serve (config health:), beyond stopping the engine.

By default an engine on a GPU that needs a reset or a reboot waits in HELD (serving/run/holding.py) and starts again
once that GPU is back: the monitor sees it answer again, re-applies its tuning and clears the wait (the events'
needs_reset; a reload clears it too; so does the recovery-action field that asked for a reset reading none again:
a reset between two polls, EventBook.reset_unseen). Each further step is the operator's to turn on:
- drain_before_stop: where the GPU still answers, the engine's stop is a planned one (serve.drain_s).
- reset_gpu: a GPU whose action is a reset, that no process uses any more (ours stopped, nobody else's there), is
  reset with `nvidia-smi --gpu-reset -i N` (NVML's API has no reset call: only its clocks' and NvLink counters'
  resets), on a worker thread with a time limit; a reset that fails is said once, and the GPU stays waiting.
- known_answer: the engine's answer to a fixed prompt at its first healthy start (per model and flags) must come
  back the same after a recovery (serving/probe/known.py); a mismatch holds the engine until a reload.
The daemon never reboots by itself.
"""

from __future__ import annotations

import contextlib
import logging
import os
import resource
import signal
import subprocess
import tempfile
from collections.abc import Callable, Mapping

from ..base.background import Background
from ..base.safetext import visible
from ..base.systemd import NOTICE
from ..config import HealthPolicy
from ..gpu.base import GpuBackend
from ..gpu.errors import GpuError
from ..serving.probe import known
from ..serving.run.handover import argv_digest
from ..serving.run.runtime import ServingRuntime
from ..serving.run.states import FATAL, HELD, RESTING, RUNNING, STOPPED
from ..tune.tuning import TuningLife
from ..watch import xids

log = logging.getLogger("gpuwarden")

RESET_TIMEOUT_S = 60.0  # nvidia-smi --gpu-reset takes seconds; past this it is killed and the reset counts as failed
RESET_OUTPUT_MAX = 4096  # the last bytes of its output kept for the log line
# A GPU that flaps (lost and back every poll) must not restart the engine at each return: an engine held again
# within FLAP_S of its release starts again only once its GPUs have answered for SETTLE_S, doubled at each such
# hold up to SETTLE_MAX_S (a reload, or a hold after FLAP_S of serving, starts from 0 again).
FLAP_S = 300.0
SETTLE_S, SETTLE_MAX_S = 10.0, 600.0
RESET_WRITE_MAX = 64 * 1024 * 1024  # the largest file it may write (RLIMIT_FSIZE): its output file stops there


def nvidia_smi_reset(index: int) -> list[str]:
    return ["nvidia-smi", "--gpu-reset", "-i", str(index)]


class ResetFailed(RuntimeError):
    pass


def run_reset(argv: list[str], timeout_s: float = RESET_TIMEOUT_S) -> str:
    """Run a reset command in its own session, its output to a file of which the last RESET_OUTPUT_MAX bytes are
    read; its last line (escaped) on exit status 0, else ResetFailed. Past timeout_s its group is killed."""
    with tempfile.TemporaryFile() as out:
        try:
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True, preexec_fn=_write_limit(RESET_WRITE_MAX))
        except OSError as exc:
            raise ResetFailed(f"{argv[0]} could not be started: {exc.strerror or exc}") from None
        try:
            code = proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            code = None
        # Its session's group, in either case: what it left behind (a helper in the background) ends with it,
        # and a command that exited just at the limit leaves no group to kill (ESRCH is no failure).
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        if code is None:
            proc.wait()
            raise ResetFailed(f"no end within {timeout_s:g} s: killed") from None
        out.seek(max(0, out.tell() - RESET_OUTPUT_MAX))
        lines = [line for line in out.read(RESET_OUTPUT_MAX).decode(errors="replace").splitlines() if line.strip()]
    last = visible(lines[-1].strip())[:300] if lines else "no output"
    if code != 0:
        raise ResetFailed(f"exit status {code}: {last}")
    return last


def _write_limit(most: int) -> Callable[[], None]:
    """Between fork and exec: no file the command writes (its output file in /tmp) grows past most bytes (soft and
    hard, never above our own hard limit): 60 s of output without end would fill the disk."""
    hard = resource.getrlimit(resource.RLIMIT_FSIZE)[1]
    limit = most if hard == resource.RLIM_INFINITY else min(most, hard)
    return lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))


class Recovery:
    """What the daemon does by itself for a GPU that must not serve: hold the engine on it (a drain first where the
    GPU still answers), a reset where the policy allows and nothing else runs on the card, the engine started
    again once the GPU is back, and the known-answer check after. It owns the resets under way and the known
    answer; it never resets a GPU the policy does not allow, and never waits on the loop (a reset runs on a worker
    thread, with a deadline)."""

    def __init__(self, serving: ServingRuntime, tuning: TuningLife, backend: GpuBackend, clock: Callable[[], float],
                 policy: HealthPolicy = HealthPolicy(), reset_argv: Callable[[int], list[str]] = nvidia_smi_reset,
                 reset_timeout_s: float = RESET_TIMEOUT_S):
        self.serving, self.tuning, self.backend, self.clock = serving, tuning, backend, clock
        self.policy = policy
        self.reset_argv, self.reset_timeout_s = reset_argv, reset_timeout_s  # tests inject their own command
        self._reset = Background("gpu-reset", clock)
        self._resetting: int | None = None  # the GPU the running reset is for
        self._tried: set[int] = set()  # reset once for this wait (done or failed): not again until it is cleared
        self._said: dict[int, str] = {}  # gpu -> why its reset waits, said once
        self._check = Background("known-answer", clock)
        self._asked: tuple[tuple[str, str], bool] | None = None  # the running check: (its key, after a recovery)
        self.answers: dict[tuple[str, str], str] = {}  # (model, argv digest) -> the first healthy start's answer
        self.mismatch: str | None = None  # a known answer that came back different: held until a reload
        self._recovering = False  # the engine was released: its next healthy start is checked
        self._released_at: float | None = None  # the engine's last release
        self._settle_s = 0.0  # how long its GPUs must answer before the next release (FLAP_S)
        self._back_since: float | None = None  # since when none of the held engine's GPUs waits
        self._held = False  # the engine was HELD at the last tick
        self._was_running = False

    def configure(self, policy: HealthPolicy) -> None:
        """The config's health: section (start and each reload); a reload also says the operator looked: a
        mismatch and the failed resets are forgotten."""
        self.policy = policy
        self.mismatch = None
        self._settle_s = 0.0
        self._tried.clear()
        self._said.clear()

    # -- holding and releasing the engine -------------------------------------------------
    def hold(self, now: float, holds: list[tuple[int, str]]) -> None:
        """GPUs that need a reset or a reboot: the engine on them waits (drained first where the policy says and
        the GPU still answers)."""
        engine = self.serving.engine
        serving = engine is not None and engine.state == RUNNING  # else there is nothing to drain: no GPU read
        drain = frozenset(g for g, _ in holds if self.policy.drain_before_stop and serving and self._answers(g))
        self.serving.hold(now, holds, drain)

    def _answers(self, index: int) -> bool:
        gpu = next((g for g in self.backend.gpus() if g.index == index), None)
        try:
            return gpu is not None and gpu.sample(False).up
        except GpuError:
            return False

    def tick(self, now: float, waiting: Mapping[int, str], stopping: bool = False) -> None:
        """After each poll (which re-applied the tuning of a GPU that came back and cleared its wait): reset what
        the policy lets, release an engine none of whose GPUs waits any more, judge the known answer. Nothing while
        the daemon stops."""
        if stopping:
            return
        self._resets(waiting)
        engine = self.serving.engine
        held = engine is not None and engine.state == HELD
        if held and not self._held:  # a new hold: one soon after the last release is a flapping GPU
            flaps = self._released_at is not None and now - self._released_at < FLAP_S
            self._settle_s = min(max(2 * self._settle_s, SETTLE_S), SETTLE_MAX_S) if flaps else 0.0
            if flaps:
                log.warning("%s held again %.0f s after its release: its GPU flaps; it starts again once its GPUs "
                            "have answered for %g s", engine.title, now - self._released_at, self._settle_s)
        self._held = held
        if held and self.mismatch is None and not self._reset.busy:
            mine = {g.index for g in engine.gpus}
            if any(g in mine or g < 0 for g in waiting):
                self._back_since = None
            else:
                self._back_since = now if self._back_since is None else self._back_since
                if now - self._back_since >= self._settle_s:
                    self._recovering = self.serving.release(now, "its GPUs answer again, their tuning applied")
                    self._released_at, self._back_since = now, None
        self._known_answer(now)

    # -- the reset ------------------------------------------------------------------------
    def _resets(self, waiting: Mapping[int, str]) -> None:
        done = self._reset.take()
        if done is not None:
            self._reset_ended(done)
        self._tried &= set(waiting)  # a GPU cleared since (back after its reset, a reload) may be reset again later
        if not self.policy.reset_gpu or self._reset.busy:
            return
        engine = self.serving.engine
        for index, why in sorted(waiting.items()):
            if index < 0 or index in self._tried or not why.endswith(xids.RESET_GPU):
                continue  # a reboot is never ours to do
            if engine is not None and engine.state not in (HELD, STOPPED, FATAL, RESTING) \
                    and index in {g.index for g in engine.gpus}:
                continue  # our engine still stops (its drain)
            users = self._users(index)
            if users:
                self._say(index, f"GPU{index} needs a reset (health.reset_gpu), but {users} use it: not resetting "
                                 "it while they do")
                continue
            argv = self.reset_argv(index)
            log.log(NOTICE, "GPU%d: resetting it (health.reset_gpu; %s): %s", index, why, " ".join(argv))
            self._resetting = index
            self._tried.add(index)
            self._reset.start(run_reset, argv, self.reset_timeout_s)
            return

    def _users(self, index: int) -> str:
        """The processes on the GPU, e.g. "pid 4242, pid 4243"; "" when none."""
        gpu = next((g for g in self.backend.gpus() if g.index == index), None)
        if gpu is None:
            return "nothing that can be named (the GPU is gone)"
        try:
            return ", ".join(f"pid {pid}" for pid, _ in gpu.compute_processes())
        except GpuError as exc:
            return f"processes that cannot be listed ({exc})"

    def _say(self, index: int, message: str) -> None:
        if self._said.get(index) != message:
            self._said[index] = message
            log.warning("%s", message)

    def _reset_ended(self, done) -> None:
        index, self._resetting = self._resetting, None
        took = done.finished_at - done.started_at
        if done.error is not None:
            log.error("GPU%d reset failed after %.1f s: %s; it stays unhealthy and the engine on it stopped: reset "
                      "it by hand or reboot, then `systemctl reload gpuwarden`", index, took, done.error)
            return
        log.log(NOTICE, "GPU%d reset in %.1f s (%s); its tuning is applied again at the next poll", index, took,
                done.value)
        self.tuning.gpu_was_reset(index)

    # -- the known answer -----------------------------------------------------------------
    def _known_answer(self, now: float) -> None:
        engine, launch = self.serving.engine, self.serving.launch
        running = engine is not None and engine.state == RUNNING
        turned, self._was_running = running and not self._was_running, running
        done = self._check.take()
        if done is not None and self._asked is not None:
            self._judge(now, done, *self._asked)
        if not (turned and self.policy.known_answer and launch is not None and engine.spec.listens):
            return
        key = (engine.spec.model, argv_digest(engine.spec.argv))
        recovering, self._recovering = self._recovering, False
        if key in self.answers and not recovering:
            return  # a restart that was no recovery (a crash, a reload): nothing to compare
        kind, serve, command = launch.command.engine, launch.config.serve, launch.command
        if self._check.start(known.ask, engine.spec.url + kind.completions_path, kind.served_model(serve, command.argv),
                             kind.api_key(command.argv, command.env), known.TIMEOUT_S, engine.spec.identity.uid):
            self._asked = (key, recovering)
        else:  # an earlier engine's check still runs: its answer is not this one's; asked again at the next tick
            self._recovering, self._was_running = recovering, False

    def _judge(self, now: float, done, key: tuple[str, str], recovering: bool) -> None:
        self._asked = None
        if done.error is not None:
            log.warning("the known-answer check got no answer (%s: %s): no verdict", type(done.error).__name__,
                        done.error)
            return
        first = self.answers.get(key)
        if first is None:
            self.answers[key] = done.value
            log.info('known answer recorded at the first healthy start: "%s"', visible(done.value))
            return
        if not recovering:
            return
        differs = known.compare(first, done.value)
        if differs is None:
            log.log(NOTICE, "the known-answer check passed after the recovery: the same %d characters as at the "
                            "first healthy start", len(first))
            return
        self.mismatch = differs
        engine = self.serving.engine
        if engine is not None:
            engine.hold(now, f"{differs}: the GPU stays unhealthy; inspect it, then `systemctl reload gpuwarden`")
