"""`gpuwarden tune`: its help and options; the sweep and the knee are bench/tune.py."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..bench import tune as bench_tune
from .common import load_config
from .registry import Command
from ..base.exits import EX_CONFIG, EX_FAIL, EX_INTERRUPTED, EX_NOPERM, EX_OK, EX_UNAVAILABLE

HELP = """\
Finds the power limit (or locked SM clock) that serves the most tokens per joule while keeping a share of the
peak throughput, measured on your own engine and traffic shape: the knee depends on the model and the workload
(memory-bound decode keeps its speed at a lower limit than compute-bound prefill).

Runs bench's workload (the same --concurrency, --input-len, --output-len and --api) for --duration seconds at each
setting, from the highest down, and prints per step: tok/s, TTFT and ITL p50/p99, the GPUs' watts and tokens per
joule (with and without the idle draw measured before the first step). The knee is the setting with the best
tok/J that keeps --keep (0.95) of the peak tok/s; tune prints the config lines that keep it, and with --apply
writes them to conf.d/50-tune.yaml beside the config and reloads the daemon (it says so).

The running daemon sets each step (it owns the GPUs, and would undo a change made behind its back), through its
root-only control socket (/run/gpuwarden/control.sock), under a lease that tune renews: however the sweep ends
(done, Ctrl-C, tune killed, the connection lost, or no word for --lease seconds) the daemon puts the configured
setting back; a daemon killed mid-sweep puts it back when it starts again.

A sweep is refused while other processes than the engine the daemon runs use the GPUs: their load would skew
every step. --force sweeps anyway (e.g. a second engine you mean to measure with).

Exit status: 0 done, 1 the daemon refused the sweep or a step (or the lease was lost), 69 no daemon or server, 77 not root, 78 bad arguments, 130 interrupted
(the setting is back; the steps done are printed)."""


def arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--clocks", action="store_true", help="sweep locked SM clocks instead of power limits")
    p.add_argument("--steps", type=int, default=6, help="settings, evenly spaced from the card's max down to its "
                   "min (default: 6)")
    p.add_argument("--values", help="the settings instead, comma-separated (W, or MHz with --clocks)")
    p.add_argument("--gpus", help="the GPUs, comma-separated indices (default: all)")
    p.add_argument("--keep", type=float, default=0.95, help="the share of peak tok/s the knee keeps (default: 0.95)")
    p.add_argument("--url", help="the server (default: serve.host and serve.port)")
    p.add_argument("--model", help="the model name (default: the first /v1/models lists)")
    p.add_argument("--concurrency", type=int, default=8, help="requests in flight in each step (default: 8)")
    p.add_argument("--duration", type=float, default=30.0, metavar="SECONDS", help="each step's length (default: 30)")
    p.add_argument("--input-len", type=int, default=512, help="prompt tokens per request (default: 512)")
    p.add_argument("--output-len", type=int, default=128, help="output tokens per request (default: 128)")
    p.add_argument("--api", choices=("completions", "chat"), default="completions",
                   help="/v1/completions or /v1/chat/completions (default: completions)")
    p.add_argument("--warmup", type=int, default=2, help="requests before the first step (default: 2)")
    p.add_argument("--idle", type=float, default=3.0, metavar="SECONDS",
                   help="measure the idle draw this long first (default: 3)")
    p.add_argument("--lease", type=float, default=15.0, metavar="SECONDS",
                   help="the daemon puts the setting back after this long without word from tune (default: 15)")
    p.add_argument("--force", action="store_true", help="sweep even while other processes use the GPUs")
    p.add_argument("--plot", type=Path, metavar="FILE", help="draw tok/s and tok/J against the setting (matplotlib)")
    p.add_argument("--apply", action="store_true", help="write the knee to conf.d/50-tune.yaml and reload the daemon")
    p.add_argument("--json", action="store_true", help="the result as JSON")


def cmd_tune(args: argparse.Namespace) -> int:
    return bench_tune.cmd_tune(args, load_config(args))


EXITS = ((EX_OK, "done"), (EX_FAIL, "the daemon refused the sweep or a step, or the lease was lost"),
         (EX_UNAVAILABLE, "no daemon or server to ask"), (EX_NOPERM, "not root"), (EX_CONFIG, "bad arguments"),
         (EX_INTERRUPTED, "interrupted (the setting is back; the steps done are printed)"))
COMMAND = Command("tune", help="sweep power limits or SM clocks under bench's workload and find the most tokens "
                  "per joule", run=cmd_tune, arguments=arguments, description=HELP, order=100, exits=EXITS)
