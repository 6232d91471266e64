"""What every command shares: the --config and --sim options, the config they load, the exit statuses."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from .. import config as configmod
from ..base.yamlfile import ConfigError
from ..config import Config
from ..gpu.sim.scenario import builtin_scenarios, resolve_scenario, unknown_scenario



def add_common(parser: argparse.ArgumentParser, default_config, default_sim) -> None:
    parser.add_argument("-c", "--config", type=Path, default=default_config,
                        help=f"config file; conf.d/*.yaml beside it is merged in (default: {configmod.DEFAULT_PATH})")
    parser.add_argument("--sim", metavar="SCENARIO", default=default_sim,
                        help="use the simulated GPUs of SCENARIO instead of NVML (built-in: "
                             + ", ".join(builtin_scenarios()) + ", or a scenario file)")


def load_config(args: argparse.Namespace, config: Config | None = None) -> Config:
    """The config file (or config, the defaults instead of a file), with the command line's overrides."""
    config = configmod.load(args.config) if config is None else config
    if args.sim:
        path = resolve_scenario(args.sim, Path.cwd())
        if path is None:
            raise ConfigError("(command line)", 0, "--sim", *unknown_scenario(args.sim))
        gpu = dataclasses.replace(config.gpu, backend="sim", scenario=args.sim, base_dir=Path.cwd())
        config = dataclasses.replace(config, gpu=gpu)
    if getattr(args, "read_only", False):
        config = dataclasses.replace(config, tuning=dataclasses.replace(config.tuning, apply=False))
    if getattr(args, "verbose", False):
        config = dataclasses.replace(config, log_interval_s=0.0)
    return config
