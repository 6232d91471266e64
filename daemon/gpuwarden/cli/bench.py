"""`gpuwarden bench`: its help and options; the sweep and its report are bench/."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from .. import config as configmod
from ..bench import command as bench_command
from ..config import Config
from ..base.exits import EX_CONFIG, EX_FAIL, EX_INTERRUPTED, EX_NOT_RUNNING, EX_OK, EX_UNAVAILABLE
from .common import load_config
from .registry import Command

HELP = """\
Runs a concurrency sweep against an OpenAI-compatible endpoint (by default the engine gpuwarden
supervises, from the config) and prints, per step: system output tok/s, per-request decode tok/s,
TTFT and inter-token latency, errors; beside them, from the same seconds, the SM and memory clocks,
power against its limit and the clock-event reasons (from the running daemon's /status, else from NVML),
the engine's running and waiting requests, KV-cache usage and prefix-cache hit rate; the SM, tensor and DRAM
activity (NVML's GPM, Hopper and newer; "-" where the GPUs give none) and the bound they name: memory, compute,
host (the SMs idle while requests ran) or mixed; and the single-stream roofline (memory bandwidth / bytes per
token) with the efficiency and the bound measured at C=1. Energy: the GPUs' idle draw is
measured before the first step (--idle seconds, nothing sent); per step the GPUs' mean watts, joules per output
token and tokens per joule, with and without the idle draw (the energy above idle is what serving cost). A step that ran throttled or
below the clock lock is flagged. Results are kept under the state directory for --compare.

No server can hold bench: every request ends within --request-timeout (600 s); with --duration, a step
sends no new request after its duration and ends at most --grace later (default: as long as the duration,
at most 30 s). A request still streaming at either deadline is cut: counted apart (the "cut" column), not
as an error of the server, and not in the step's tokens. With --url (or --compare), bench needs no config
file: the default one is read where it exists, a named one (-c) must exist, and -c none reads none.

Exit status: 0 done, 1 a step (or the first request) had only errors, 3 nothing to compare, 69 the server
cannot be reached, 78 bad arguments, config or model, 130 interrupted (the partial result is still printed and
saved)."""


def arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", help="the server, e.g. http://host:8000 (default: serve.host and serve.port)")
    p.add_argument("--model", help="the model name to request (default: the first /v1/models lists)")
    p.add_argument("--concurrency", default="1,2,4,8", help="the steps, comma-separated (default: 1,2,4,8)")
    p.add_argument("--requests", type=int, help="requests per step (default: 4 x C, at least 8)")
    p.add_argument("--duration", type=float, metavar="SECONDS", help="run each step this long instead of a count")
    p.add_argument("--grace", type=float, metavar="SECONDS", help="with --duration: how long the requests still "
                   "streaming at its end may take before they are cut (default: as long as --duration, at most 30)")
    p.add_argument("--request-timeout", type=float, default=600.0, metavar="SECONDS",
                   help="the most one request may take, from sending it to its last token; it is cut then "
                   "(default: 600)")
    p.add_argument("--warmup", type=int, default=2, help="requests before the first step (default: 2)")
    p.add_argument("--input-len", type=int, default=512, help="prompt tokens per request (default: 512)")
    p.add_argument("--output-len", type=int, default=128, help="output tokens per request (default: 128)")
    p.add_argument("--api", choices=("completions", "chat"), default="completions",
                   help="/v1/completions or /v1/chat/completions (default: completions)")
    p.add_argument("--no-ignore-eos", action="store_true", help="let requests stop at end-of-sequence")
    p.add_argument("--model-path", type=Path, help="the model directory, for the roofline (default: serve.model "
                   "when it is a directory)")
    p.add_argument("--tp", type=int, help="tensor-parallel GPUs, for the roofline (default: from the serving "
                   "command, else 1)")
    p.add_argument("--engine-interval", type=float, default=2.0, metavar="SECONDS",
                   help="how often to read the engine's running/waiting/KV gauges during a step (default: 2; "
                   "0: only its counters, at the step's start and end; rendering /metrics costs the server CPU)")
    p.add_argument("--idle", type=float, default=2.0, metavar="SECONDS",
                   help="measure the GPUs' idle draw this long before the first step (default: 2; 0: not measured)")
    p.add_argument("--label", help="a name for this run, for --compare (default: its time)")
    p.add_argument("--compare", nargs=2, metavar=("A", "B"), help="show two saved runs side by side and exit")
    p.add_argument("--plot", type=Path, metavar="FILE", help="draw tok/s and TTFT against concurrency (needs "
                   "matplotlib: Debian's python3-matplotlib)")
    p.add_argument("--json", action="store_true", help="the result as JSON")
    p.add_argument("--markdown", action="store_true", help="the result as a Markdown table, to paste in an issue")


def cmd_bench(args: argparse.Namespace) -> int:
    # With --url (or --compare), bench needs no config file: the default one is read only where it exists, and
    # -c none reads none (the defaults). argparse converts only what was typed: an unnamed -c is DEFAULT_PATH.
    absent = args.config is configmod.DEFAULT_PATH and not os.path.exists(args.config)
    if str(args.config).lower() == "none" or ((args.url or args.compare) and absent):
        return bench_command.cmd_bench(args, load_config(args, Config()))
    return bench_command.cmd_bench(args, load_config(args))


EXITS = ((EX_OK, "done"), (EX_FAIL, "a step (or the first request) had only errors"),
         (EX_NOT_RUNNING, "nothing to compare"), (EX_UNAVAILABLE, "the server cannot be reached"),
         (EX_CONFIG, "bad arguments, config or model"),
         (EX_INTERRUPTED, "interrupted (the partial result is still printed and saved)"))
COMMAND = Command("bench", help="served throughput by concurrency, with the clocks, the power and the roofline "
                  "beside it", run=cmd_bench, arguments=arguments, description=HELP, order=90, exits=EXITS)
