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
    (a stop, a stop that timed out) ends what is left, containers of serve.container included."""
    import time

    from ..serving.run import handover
    from ..serving.run.processes import STRAY_GRACE_S, Strays, find_strays
    from ..base.statedir import state_dir

    folder = state_dir()
    record = handover.load(folder)
    result = os.environ.get("SERVICE_RESULT", "success")
    crashed = result in ("signal", "core-dump", "watchdog") or (
        result == "exit-code" and os.environ.get("EXIT_STATUS") not in ("0", str(EX_CONFIG)))
    children = record.children if record is not None else ()
    if children and crashed and not record.stopping:
        print(f"gpuwarden: the daemon ended with {result}: keeping {len(children)} child(ren) for the "
              "restarted daemon to adopt")
        return EX_OK
    if children and record.keep and not record.stopping:
        print(f"gpuwarden: the daemon could not start: keeping {len(children)} child(ren) serving, "
              "unsupervised, for the next daemon to adopt")
        return EX_OK
    if children:
        handover.end_leftovers(record, f"the daemon stopped ({result})")
        # What left the children's groups (setsid) is found in the unit's cgroup (ExecStopPost runs there too).
        uids = {c.uid for c in children}
        strays = Strays()
        strays.end(find_strays(uids, ()), uids, (), time.monotonic(), STRAY_GRACE_S)
        strays.wait(time.monotonic)
        handover.clear(folder)
    if not (crashed and not (record is not None and record.stopping)):
        remove_containers(args)
    return EX_OK


def remove_containers(args: argparse.Namespace) -> None:
    """serve.container: the containers of this gpuwarden (this host, this state directory) that a stop left (a shim
    killed at its stop timeout, a runtime that did not answer in time), removed, one line each. A config that cannot
    be read, or a runtime that cannot be asked, is one line too: cleanup never fails the unit's stop."""
    from ..base.containerapi import Runtime, RuntimeFault
    from ..base.yamlfile import InvalidConfig
    from ..config import load
    from ..serving.compose.container import owned

    try:
        container = load(args.config).serve.container
    except (InvalidConfig, OSError) as exc:
        print(f"gpuwarden: cleanup: the config was not read, no container looked for: {exc}")
        return
    if container is None:
        return
    try:
        runtime = Runtime(container.runtime, container.api_socket)
        try:
            for found in owned(runtime):
                runtime.remove(found.id)
                print(f"gpuwarden: removed container {found.id[:12]} ({found.name}, {found.state}) the stop left")
        finally:
            runtime.close()
    except RuntimeFault as exc:
        print(f"gpuwarden: cleanup: the containers were not looked for: {exc}")


COMMAND = Command("cleanup", help="for the unit's ExecStopPost: after a stop, end the serving children the daemon left "
                  "(after a crash they are kept for the restarted daemon to adopt)", run=cmd_cleanup, order=40,
                  exits=((EX_OK, "always: what it ended or kept is logged"),))
