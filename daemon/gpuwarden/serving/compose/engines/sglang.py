"""SGLang: `python3 -m sglang.launch_server`, its /health and sglang: metrics, its log format, its
ServerArgs parser and its lint.

Sources: SGLang's production metrics page (docs/references/production_metrics.md:
sglang:generation_tokens_total, sglang:num_running_reqs, sglang:num_queue_reqs,
sglang:token_usage, served only with --enable-metrics), its configure_logger
(`[%(asctime)s{prefix}] %(message)s`, no level) and uvicorn format (`[time]
INFO: ...`), and ServerArgs.add_cli_args, which is run for the flag check.
"""

from __future__ import annotations

import logging
import re
from typing import Any

from ...lint.flags import flag_value
from . import Engine, MetricNames, flag_probe

LONG_CONTEXT = 65536  # decode fell to 3-5 tok/s from 64K of context with the SM120 sparse-decode patch
STAMP = re.compile(r"^\[\d{2,4}-\d{2}[^\]]*\]\s*")  # "[2026-05-01 12:00:00 TP0] " or "[05-01 12:00:00] "
LEVEL = re.compile(r"^(DEBUG|INFO|WARNING|ERROR|CRITICAL)\b:?")
FAILURE = re.compile(r"Traceback \(most recent call last\)|\b\w*(Error|Exception):")

# ServerArgs.add_cli_args is SGLang's own parser; the version comes from the package metadata, since
# `import sglang` pulls in far more of its dependencies than the parser needs.
PROBE = flag_probe("""
import argparse
from importlib.metadata import version
out["version"] = version("sglang")
from sglang.srt.server_args import ServerArgs
parser = argparse.ArgumentParser(prog="sglang.launch_server")
ServerArgs.add_cli_args(parser)
parser.parse_args(json.loads(sys.argv[1]))
""")


# -- checks for the rules that are not plain data (serving/lint/rules/builtin.yaml names them) ----------------------

def sglang_triton_backends(ctx: Any) -> dict | None:
    missing = [f for f in ("--fp8-gemm-backend", "--moe-runner-backend") if flag_value(ctx.argv, f) != "triton"]
    return {"flags": " triton and ".join(missing)} if missing else None


def sglang_long_context(ctx: Any) -> dict | None:
    context = flag_value(ctx.argv, "--context-length")
    if context is not None and context.isdigit() and int(context) > LONG_CONTEXT:
        return {"context": context}
    return None


class Sglang(Engine):
    name, title = "sglang", "SGLang"
    default_command = ("python3", "-m", "sglang.launch_server")
    model_flag = "--model-path"
    # SGLang sizes its static memory from the GPU when the flag is absent; 0.85 is the report's value and
    # is what the start-up check assumes then.
    memory_flag, default_memory_fraction = "--mem-fraction-static", 0.85
    tp_flags = ("--tensor-parallel-size", "--tp-size", "--tp")
    required_args = ("--enable-metrics",)  # else /metrics is not served
    metric_names = MetricNames("sglang:generation_tokens_total", "sglang:prompt_tokens_total",
                               "sglang:num_running_reqs", "sglang:num_queue_reqs", ("sglang:token_usage",))
    flag_probe = PROBE
    # SIGTERM makes it drain by itself: TokenizerManager.sigterm_watchdog (0.5.23) waits, with no flag and no bound
    # of its own, for the requests in flight (it looks every 5 s), its /health answering 503 meanwhile, then exits.
    drains_itself = True
    checks = {"sglang_triton_backends": sglang_triton_backends, "sglang_long_context": sglang_long_context}

    def log_level(self, line: str) -> int | None:
        stamp = STAMP.match(line)
        if stamp is None:
            return logging.ERROR if FAILURE.search(line) else None  # a traceback's body keeps its level
        rest = line[stamp.end():]
        level = LEVEL.match(rest)
        if level:  # uvicorn's lines carry one
            return getattr(logging, level.group(1))
        if FAILURE.search(rest):
            return logging.ERROR
        return logging.WARNING if re.search(r"\bwarning\b", rest, re.I) else logging.INFO


ENGINE = Sglang()
