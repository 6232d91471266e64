"""The children an earlier daemon left running, at this daemon's start: after a handover (the same process
re-executed as the installed code: HANDOVER_ENV) their output pipes were inherited; after a crash systemd's fd
store kept them. They are taken over, or stopped where they should not run; a start that fails leaves them
serving, unsupervised, for the next daemon (serving/run/handover.py keeps the record).
"""

from __future__ import annotations

import logging
import os

from ..base import earlysignals
from ..base.systemd import Notifier
from ..base.yamlfile import ConfigErrors
from ..serving.compose.flagcheck import check_flags
from ..serving.compose.prepare import flag_problem
from ..serving.run import handover
from ..serving.run.runtime import ServingRuntime
from ..serving.run.spec import other_drain

log = logging.getLogger("gpuwarden")

HANDOVER_ENV = "GPUWARDEN_HANDOVER"  # set across a re-exec: the children's pipes were inherited
LEFT_SERVING = ("this daemon could not start: %s keeps serving unsupervised (no health checks, no restarts) until "
                "what stopped the start is fixed and the daemon started again; the next daemon adopts it")


def engine_survives(serving: ServingRuntime, engine: str) -> bool:
    """The record an earlier daemon left names an engine that still runs, provably ours (to be adopted)."""
    record = handover.load(serving.recorder.state_dir)
    if record is None or record.stopping:
        return False
    return any(handover.proven(child) is None for child in record.children if child.name == engine)


def hand_over(serving: ServingRuntime, notifier: Notifier) -> None:
    """SIGUSR2, checked: the running children's pipes made inheritable and their record written for the new image,
    said in one line, systemd told, and the signals held until the new image takes them."""
    record = serving.handover_record()
    running = ", ".join(f"{c.name} pid {c.pid}" for c in record.children) or "no child"
    log.info("SIGUSR2: handing over to the installed gpuwarden (same pid %d; %s kept running)", os.getpid(), running)
    notifier.reloading()
    # From here to the new image's earlysignals.hold(), signals wait (blocked; the mask survives execv):
    # the old image restores its default handlers as it winds down, and SIGHUP's default ends a process.
    earlysignals.block_for_exec()


def check_replacement(serving: ServingRuntime, launch, adopting: bool) -> None:
    """An adopting start after a crash of the daemon, where the config asks for another engine command or environment
    than the engine it adopts runs with (a drop-in edited without a reload): ServingRuntime.start replaces the engine as a reload
    would, so the engine's own parser checks the flags first, as a reload's does (here, before the loop runs, as at
    any start); a refusal fails the start (ConfigErrors), which leaves the engine serving for the next daemon
    (leave_children). After a handover the old image checked them (service/reload.Waiting); a start that adopts
    nothing, or the same command, runs no check here."""
    if not adopting or launch is None or HANDOVER_ENV in os.environ or launch.command.engine.flag_probe is None:
        return
    record = handover.load(serving.recorder.state_dir)
    entry = next((c for c in record.children if c.name == launch.engine.name), None) if record else None
    other = other_drain(launch.engine, launch.command, launch.config.serve)
    same = {handover.argv_digest(spec.argv) for spec in (launch.engine, other) if spec is not None}
    if entry is None or handover.proven(entry) is not None or \
            entry.argv_sha256 in same and entry.env_sha256 in (None, handover.env_digest(launch.engine.env)):
        return
    flags = check_flags(launch.config.serve, launch.command, launch.engine.identity)
    problem = flag_problem(launch.config, launch.command, flags)
    if problem is not None:
        raise ConfigErrors([problem])
    log.info("%s %s accepts the flags it is restarted with (checked with %s)", launch.command.engine.title,
             flags.version, flags.python)


def leave_children(serving: ServingRuntime, adopting: bool) -> None:
    """The start failed with children to adopt: they serve on, unsupervised, for the next daemon to adopt.
    The record is kept as it is, marked keep, so that cleanup (ExecStopPost) does not end them after an
    exit it would otherwise read as a stop (78, a config error, which the unit does not restart)."""
    running = handover.keep(serving.recorder.state_dir) if adopting else None
    if running is not None:
        log.critical(LEFT_SERVING, running)


def start_serving(serving: ServingRuntime, launch, now: float, stored: dict[str, int], stop_timeout_s: float) -> None:
    """Start the children (launch None: serving is off), or take over those an earlier daemon left running:
    after a re-exec (an upgrade) their output pipes were inherited; after a crash systemd's fd store kept
    them."""
    record = handover.load(serving.recorder.state_dir)
    reexec = os.environ.pop(HANDOVER_ENV, None) is not None
    if reexec and record is not None:  # this process's own fds, kept open across execv
        fds = {f"{kind}-{c.name}": fd for c in record.children
               for kind, fd in (("child", c.fd), ("word", c.word_fd)) if fd is not None}
    else:
        fds = stored
    if record is not None and record.stopping and not reexec:
        handover.end_leftovers(record, "the daemon before this one was stopping")
        record = None
    if launch is None:  # serving is off: what the daemon before left running is stopped
        serving.stop_unnamed(record, fds, now, stop_timeout_s, "serving is off in this config")
        return
    serving.start(launch, now, record, fds, "an upgrade (re-exec, same daemon pid)" if reexec
                  else "a restart of the daemon")
