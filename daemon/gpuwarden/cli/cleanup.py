"""`gpuwarden cleanup`: the unit's ExecStopPost, which ends the serving children a stopped daemon left."""

from __future__ import annotations

import argparse
import os

from .registry import Command
from ..base.exits import EX_CONFIG, EX_OK


def cmd_cleanup(args: argparse.Namespace) -> int:
    """ExecStopPost: systemd says how the daemon ended ($SERVICE_RESULT). A crash (a signal, a core dump, the
    watchdog, an exit status systemd restarts on) leaves the children for the restarted daemon to adopt,
    unless it was stopping them; so does a start that failed with children to adopt (the record's keep: a
    config the new image refused after a handover, exit 78, which the unit does not restart); any other end
    (a stop, a stop that timed out) ends what is left."""
    import time

    from ..serving.run import handover
    from ..serving.run.processes import STRAY_GRACE_S, Strays, find_strays
    from ..base.statedir import state_dir

    folder = state_dir()
    record = handover.load(folder)
    result = os.environ.get("SERVICE_RESULT", "success")
    crashed = result in ("signal", "core-dump", "watchdog") or (
        result == "exit-code" and os.environ.get("EXIT_STATUS") not in ("0", str(EX_CONFIG)))
    if record is None or not record.children:
        return EX_OK
    if crashed and not record.stopping:
        print(f"gpuwarden: the daemon ended with {result}: keeping {len(record.children)} child(ren) for the "
              "restarted daemon to adopt")
        return EX_OK
    if record.keep and not record.stopping:
        print(f"gpuwarden: the daemon could not start: keeping {len(record.children)} child(ren) serving, "
              "unsupervised, for the next daemon to adopt")
        return EX_OK
    handover.end_leftovers(record, f"the daemon stopped ({result})")
    # What left the children's groups (setsid) is found in the unit's cgroup (ExecStopPost runs there too).
    uids = {c.uid for c in record.children}
    strays = Strays()
    strays.end(find_strays(uids, ()), uids, (), time.monotonic(), STRAY_GRACE_S)
    strays.wait(time.monotonic)
    handover.clear(folder)
    return EX_OK


COMMAND = Command("cleanup", help="for the unit's ExecStopPost: after a stop, end the serving children the daemon left "
                  "(after a crash they are kept for the restarted daemon to adopt)", run=cmd_cleanup, order=40,
                  exits=((EX_OK, "always: what it ended or kept is logged"),))
