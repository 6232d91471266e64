"""The engine's own parser on the command a reload or a handover would start, before anything that serves is stopped:
`check --deep`'s flag check (compose/flagcheck.check_flags), as serve.user, run off the main loop.

The loop asks for the answer (answer()) on each pass and never waits for it: the first ask starts the check on a
worker thread, a later one takes its answer. The check has flagcheck's bounds: TIMEOUT_S, then its process group is
SIGKILLed; its output read into capped files (identity.run_bounded). One check runs at a time. Asked about another
command while one runs (the config changed again: a reload storm), the running check is ended (its group SIGKILLed)
and the new one starts on the first ask after it has ended, so a check that hangs never holds up a fixed config. An
answer is kept for its command until forget() (a new SIGHUP or SIGUSR2 asks anew); the daemon's stop ends a running
check with every other helper (ProcessOps.end_helpers). A container engine's check runs in a container of its image
(flagcheck.check_in_image): ended, its container is removed within a wait's slice, and one a killed daemon left is
removed by the next start's sweep.
"""

from __future__ import annotations

import errno
import logging
import subprocess
import threading
from dataclasses import dataclass

from ...base.yamlfile import ConfigErrors
from ..compose.flagcheck import TIMEOUT_S, FlagCheck, check_flags
from ..compose.prepare import flag_problem
from .processes import ProcessOps

log = logging.getLogger("gpuwarden")


@dataclass(frozen=True)
class _Key:
    """What the parser's answer depends on: the command, its environment, who runs it, serve.python, and a container
    engine's image (its parser is the image's)."""

    argv: tuple[str, ...]
    env: tuple[tuple[str, str], ...]
    identity: object
    python: str | None
    container: object = None


def _key(launch) -> _Key:
    command = launch.command
    return _Key(tuple(command.argv), tuple(sorted(command.env.items())), launch.engine.identity,
                launch.config.serve.python, launch.config.serve.container)


def due(launch, runtime, upgraded: bool = False) -> bool:
    """Whether the engine's own parser must accept launch's flags before launch replaces what the runtime runs: its
    engine has a parser to run, and its command, environment or user differ from the engine that runs (or is about to
    start: a replacement under way), or another version is installed under it. Nothing runs: due, as at a start."""
    if launch is None or launch.command.engine.flag_probe is None:
        return False
    if upgraded:
        return True
    specs = [p.spec for p in (runtime.engine,) if p is not None] + \
            [pending.engine for pending in (runtime.pending,) if pending is not None]
    return all(_same(spec) != _same(launch.engine) for spec in specs)


def _same(spec) -> tuple:
    return tuple(spec.argv), dict(spec.env), spec.identity


class DeepCheck:
    def __init__(self, ops: ProcessOps, timeout_s: float = TIMEOUT_S):
        self.ops = ops
        self.timeout_s = timeout_s
        self._work = ops.background("flagcheck")
        self._running: _Key | None = None  # the command of the check started last
        self._cancel = threading.Event()  # set: the check started last is for a command no one waits for now
        self._process: subprocess.Popen | None = None  # its process, once started (from the worker thread)
        self._answer: tuple[_Key, FlagCheck] | None = None
        self._title = ""

    @property
    def busy(self) -> bool:
        return self._work.busy

    def forget(self) -> None:
        """A new request (SIGHUP, SIGUSR2) asks the parser anew; a check running for the same command is joined."""
        self._answer = None

    def accepted(self, launch) -> bool:
        """True: the engine's parser accepts launch's flags; False: its check runs (ask again on a later pass).
        Raises ConfigErrors where it refuses them: one error at what set them, naming the parser's reason."""
        flags = self.answer(launch)
        if flags is None:
            return False
        problem = flag_problem(launch.config, launch.command, flags)
        if problem is not None:
            raise ConfigErrors([problem])
        return True

    def unasked(self) -> None:
        """Nothing waits for an answer any more (a later reload needs none, a refusal, the stop): a running check is
        ended, not left to run to its deadline."""
        if self._work.busy and not self._cancel.is_set():
            log.info("%s's flag check ended: no reload or handover waits for it any more", self._title)
            self._end()

    def answer(self, launch) -> FlagCheck | None:
        """The parser's answer on launch's command; None while it runs (started here where it is not)."""
        key = _key(launch)
        self._collect()
        if self._answer is not None and self._answer[0] == key:
            return self._answer[1]
        if self._work.busy:
            if self._running != key and not self._cancel.is_set():
                log.info("%s's flag check of an earlier config ended: the config changed, the new one is checked",
                         launch.command.engine.title)
                self._end()
            return None
        self._start(launch, key)
        return None

    def _collect(self) -> None:
        done = self._work.take()
        if done is None:
            return
        key, cancel, flags = done.value
        if cancel.is_set():
            return  # ended on purpose: its answer is about a config no one waits for
        self._answer = (key, flags)
        if flags.ok:
            log.info("%s %s accepts the flags (checked with %s)", self._title, flags.version, flags.python)

    def _start(self, launch, key: _Key) -> None:
        cancel = self._cancel = threading.Event()
        self._running, self._process = key, None
        self._title = launch.command.engine.title

        def spawn(*args, **kwargs) -> subprocess.Popen:
            if cancel.is_set():
                raise OSError(errno.ECANCELED, "ended before it started")
            process = self.ops.helper(*args, **kwargs)
            self._process = process
            if cancel.is_set():  # ended while it was being started
                process.kill()
            return process

        def run() -> tuple[_Key, threading.Event, FlagCheck]:
            try:
                flags = check_flags(launch.config.serve, launch.command, launch.engine.identity, self.timeout_s,
                                    spawn, cancel)
            except Exception as exc:  # a bug's last net: an answer, never a check that seems to run for ever
                flags = FlagCheck(False, f"the flag check failed: {type(exc).__name__}: {exc}", None, "")
            return key, cancel, flags

        self._work.start(run)

    def _end(self) -> None:
        self._cancel.set()
        process = self._process
        if process is not None:
            process.kill()  # its group whole (ProcessOps.helper's _Group); the worker thread then ends
