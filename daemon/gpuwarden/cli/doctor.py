"""`gpuwarden doctor`: the one-shot, read-only preflight (watch/doctor.py)."""

from __future__ import annotations

import argparse
import json

from ..backends import open_configured
from .common import load_config
from .registry import Command
from ..base.exits import EX_CONFIG


def arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--no-deep", action="store_true",
                   help="skip running the engine's own flag parser (slow: imports the engine)")


def cmd_doctor(args: argparse.Namespace) -> int:
    from ..watch.doctor import diagnose, exit_status

    config = load_config(args)
    backend = open_configured(config)
    try:
        findings = diagnose(config, backend, deep=not args.no_deep)
    finally:
        backend.close()
    if args.json:
        print(json.dumps({"exit_status": exit_status(findings), "findings": [f.as_dict() for f in findings]},
                         indent=2))
    else:
        print("\n".join(str(f) for f in findings))
    return exit_status(findings)


COMMAND = Command("doctor", help="one-shot, read-only preflight: persistence, clocks and throttle reasons, power "
                  "limit, driver, whether GPM works, and the serving setup; exit 0 ok, 1 warnings, 2 errors",
                  run=cmd_doctor, arguments=arguments, order=70,
                  exits=((0, "no finding worse than information"), (1, "warnings"), (2, "errors"),
                         (EX_CONFIG, "configuration error")))
