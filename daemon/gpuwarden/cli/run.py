"""`gpuwarden run`: the daemon."""

from __future__ import annotations

import argparse
import os

from ..backends import open_configured
from ..base.systemd import print_error
from ..base.yamlfile import InvalidConfig
from ..gpu.errors import GpuError
from .common import load_config
from .registry import Command
from ..base.exits import EX_CONFIG, EX_FAIL, EX_OK, EX_UNAVAILABLE


def arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--read-only", action="store_true", help="never touch the GPUs (same as tuning.apply: false)")
    p.add_argument("--duration", type=float, metavar="SECONDS", help="stop by itself after SECONDS")
    p.add_argument("-v", "--verbose", action="store_true", help="log every sample, not one per log_interval_s")


def cmd_run(args: argparse.Namespace) -> int:
    from ..service.adoption import HANDOVER_ENV, LEFT_SERVING
    from ..service.daemon import Daemon, reexec, run
    from ..service.metrics_port import StartupError
    from ..base.systemd import setup_logging

    try:
        config = load_config(args)
    except InvalidConfig:
        _keep_handed_over(HANDOVER_ENV, LEFT_SERVING)
        raise
    logs = setup_logging()
    try:
        backend = open_configured(config)
    except (InvalidConfig, GpuError):
        logs.close()
        _keep_handed_over(HANDOVER_ENV, LEFT_SERVING)
        raise
    daemon = None
    try:
        daemon = Daemon(config, backend, reload=lambda: load_config(args))
        run(daemon, duration_s=args.duration)
    except StartupError as exc:
        logs.close()
        print_error(f"gpuwarden: {exc}")
        return EX_FAIL
    finally:
        backend.close()
        logs.close()
    if daemon is not None and daemon.changes.handing_over:
        reexec()  # does not return
    return EX_OK


def _keep_handed_over(handover_env: str, left_serving: str) -> None:
    """A re-exec whose start ends before the daemon exists: the old image checked this config with its own loader and
    opened its backend in a new process (changes.Changes.check_handover), and this release refuses it, or its GPUs
    went away since. The children it handed over serve on for the next daemon (Daemon.leave_children), not for
    cleanup's kill."""
    if handover_env in os.environ and os.environ.get("STATE_DIRECTORY"):
        from ..serving.run import handover
        from ..base.statedir import state_dir

        if (running := handover.keep(state_dir())) is not None:
            print_error("gpuwarden: " + left_serving % running)


COMMAND = Command("run", help="the daemon: apply the tuning, then monitor every poll_interval_s and serve metrics "
                  "until SIGTERM/SIGINT (SIGHUP reloads the config)", run=cmd_run, arguments=arguments, order=50,
                  keeps_held_signals=True,
                  exits=((EX_OK, "stopped by SIGTERM or SIGINT, or --duration ran out"),
                         (EX_FAIL, "the start failed (e.g. a metrics address this host cannot bind, or a tuning step failed)"),
                         (EX_UNAVAILABLE, "NVML unavailable"),
                         (EX_CONFIG, "configuration error (the unit does not restart on it)")))
