"""`gpuwarden status`: the running daemon's view, from its /status."""

from __future__ import annotations

import argparse
import json
import os

from ..base.systemd import print_error
from .common import load_config
from .registry import Command
from ..base.exits import EX_CONFIG, EX_NOT_RUNNING, EX_OK


def arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="the daemon's raw /status JSON")
    p.add_argument("--user", metavar="NAME", help="basic auth user when metrics.web_config asks for one (the "
                   "password comes from $GPUWARDEN_PASSWORD)")


def cmd_status(args: argparse.Namespace) -> int:
    from ..web.status import NotShaped, StatusError, fetch_status, render_status, running_elsewhere

    config = load_config(args)
    if config.metrics.url is None:
        print_error("gpuwarden: metrics.listen is none, so the daemon serves no /status to read")
        return EX_NOT_RUNNING
    auth = (args.user, os.environ.get("GPUWARDEN_PASSWORD", "")) if args.user else None
    try:
        state = fetch_status(config.metrics, auth)
        moved = running_elsewhere(config.metrics) if state is None else None
        if moved is not None:
            state = fetch_status(moved, auth)
            if state is not None:
                print_error(f"gpuwarden: note: the daemon serves {moved.url}, not metrics.listen "
                            f"{config.metrics.url}: the listen address changes on restart")
    except StatusError as exc:
        print_error(f"gpuwarden: {exc}")
        return EX_NOT_RUNNING
    if state is None:
        print(f"gpuwarden is not running (nothing answers on {config.metrics.url})")
        return EX_NOT_RUNNING
    try:
        print(json.dumps(state, indent=2) if args.json else render_status(state))
    # "gpus": 5, a string as a power reading, a 400-digit integer as one (OverflowError)
    except (TypeError, ValueError, KeyError, AttributeError, OverflowError) as exc:
        what = f" ({exc})" if isinstance(exc, NotShaped) else ""
        print_error(f"gpuwarden: {config.metrics.url}/status is not shaped as this gpuwarden's /status{what}")
        return EX_NOT_RUNNING
    return EX_OK


COMMAND = Command("status", help="show the running daemon's view: clocks, power, utilization beside GPM's SM, tensor "
                  "and DRAM activity, reasons and firing alerts per GPU (exit 3 if no daemon answers)", run=cmd_status,
                  arguments=arguments, order=80,
                  exits=((EX_OK, "the daemon answered"), (EX_NOT_RUNNING, "no daemon answers"),
                         (EX_CONFIG, "configuration error")))
