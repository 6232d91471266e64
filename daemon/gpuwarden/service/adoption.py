"""The children an earlier daemon left running, at this daemon's start: after a handover (the same process
re-executed as the installed code: HANDOVER_ENV) their output pipes were inherited; after a crash systemd's fd
store kept them. They are taken over, or stopped where they should not run; a start that fails leaves them
serving, unsupervised, for the next daemon (serving/run/handover.py keeps the record).
"""

from __future__ import annotations

import logging
import os

from ..serving.run import handover
from ..serving.run.runtime import ServingRuntime

log = logging.getLogger("gpuwarden")

HANDOVER_ENV = "GPUWARDEN_HANDOVER"  # set across a re-exec: the children's pipes were inherited
LEFT_SERVING = ("this daemon could not start: %s keeps serving unsupervised (no health checks, no restarts) until "
                "what stopped the start is fixed and the daemon started again; the next daemon adopts it")


def engine_survives(serving: ServingRuntime, engine: str) -> bool:
    """The record an earlier daemon left names an engine that still runs, provably ours (to be adopted)."""
    record = handover.load(serving.state_dir)
    if record is None or record.stopping:
        return False
    return any(handover.proven(child) is None for child in record.children if child.name == engine)


def leave_children(serving: ServingRuntime, adopting: bool) -> None:
    """The start failed with children to adopt: they serve on, unsupervised, for the next daemon to adopt.
    The record is kept as it is, marked keep, so that cleanup (ExecStopPost) does not end them after an
    exit it would otherwise read as a stop (78, a config error, which the unit does not restart)."""
    running = handover.keep(serving.state_dir) if adopting else None
    if running is not None:
        log.critical(LEFT_SERVING, running)


def start_serving(serving: ServingRuntime, launch, now: float, stored: dict[str, int], stop_timeout_s: float) -> None:
    """Start the children (launch None: serving is off), or take over those an earlier daemon left running:
    after a re-exec (an upgrade) their output pipes were inherited; after a crash systemd's fd store kept
    them."""
    record = handover.load(serving.state_dir)
    reexec = os.environ.pop(HANDOVER_ENV, None) is not None
    if reexec and record is not None:  # this process's own fds, kept open across execv
        fds = {f"child-{c.name}": c.fd for c in record.children if c.fd is not None}
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
