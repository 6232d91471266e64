"""`gpuwarden apply`: the tuning once, verified, for boot-time tuning without the daemon."""

from __future__ import annotations

import argparse

from ..backends import open_configured
from ..base.systemd import print_error
from ..gpu import errors
from ..tune.originals import originals_store
from ..tune.tuning import Outcome, Tuner, make_plan
from ..base.exits import EX_CONFIG, EX_FAIL, EX_NOPERM, EX_OK, EX_UNAVAILABLE
from .common import load_config
from .registry import Command


def cmd_apply(args: argparse.Namespace) -> int:
    config = load_config(args)
    if not config.tuning.apply:
        where = config.error(("tuning", "apply"), "")  # only for its file and line
        print_error(f"gpuwarden: nothing applied: tuning.apply is false ({where.file}:{where.line})")
        return EX_FAIL
    backend = open_configured(config)
    try:
        plan = make_plan(backend, config)
        tuner = Tuner(backend, originals_store(config))
        applied = tuner.apply(plan)
        verified = tuner.verify(plan) if all(o.ok for o in applied) else []
    finally:
        backend.close()
    for outcome in applied:
        print(f"applied {outcome.describe()}")
    for outcome in verified:
        print(f"verified {outcome.describe()}")
    return apply_status(applied + verified)


def apply_status(outcomes: list[Outcome]) -> int:
    if any(o.error is errors.NoPermission for o in outcomes):
        return EX_NOPERM
    return EX_OK if all(o.ok for o in outcomes) else EX_FAIL


COMMAND = Command("apply", help="apply the tuning once, verify it, and exit (for boot-time tuning without the daemon)",
                  run=cmd_apply, order=30,
                  exits=((EX_OK, "every setting applied and read back"), (EX_FAIL, "a tuning step failed"),
                         (EX_UNAVAILABLE, "NVML unavailable"),
                         (EX_NOPERM, "permission denied (needs root or CAP_SYS_ADMIN)"),
                         (EX_CONFIG, "configuration error")))
