"""`gpuwarden plan`: what tuning would change on each GPU; touches nothing."""

from __future__ import annotations

import argparse
import json

from ..backends import open_configured
from ..config import Config
from ..tune import tunables
from ..tune.tuning import Plan, make_plan
from .common import load_config
from .registry import Command
from ..base.exits import EX_CONFIG, EX_OK, EX_UNAVAILABLE


def arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="machine-readable output")


def cmd_plan(args: argparse.Namespace) -> int:
    config = load_config(args)
    backend = open_configured(config)
    try:
        plan = make_plan(backend, config)
    finally:
        backend.close()
    if args.json:
        print(json.dumps({"apply": config.tuning.apply, **plan.as_dict()}, indent=2))
        return EX_OK
    print(render_plan(plan, config))
    return EX_OK


def render_plan(plan: Plan, config: Config) -> str:
    lines = [f"note: {note}" for note in plan.notes]
    if any(tunables.BY_KEY[a.setting].lock_of for a in plan.actions):
        lines.append("note: NVML cannot read a clock lock back, so locks are set on every apply "
                     "and verified by reading the clock")
    for gpu in plan.gpus:
        lines.append(f"GPU {gpu.index}  {gpu.name}  {gpu.uuid}")
        lines.extend(f"  {a.describe()}" for a in gpu.actions)
        if not gpu.actions:
            lines.append("  nothing to do")
    if not config.tuning.apply:
        lines.append("tuning.apply is false: `gpuwarden run` will only monitor, and `apply` refuses")
    return "\n".join(lines)


COMMAND = Command("plan", help="print what tuning would change on each GPU; touches nothing", run=cmd_plan,
                  arguments=arguments, order=20,
                  exits=((EX_OK, "the plan is printed"), (EX_UNAVAILABLE, "NVML unavailable"),
                         (EX_CONFIG, "configuration error")))
