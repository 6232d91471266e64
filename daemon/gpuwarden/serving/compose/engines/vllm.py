"""vLLM: `vllm serve`, its /health and vllm: metrics, its log format, its serve-args parser and its lint."""

from __future__ import annotations

import logging
import re
from typing import Any

from ..flags import flag_value
from ..lint import model_billions
from . import Engine, MetricNames, flag_probe

SMALL_MODEL_B = 8.0  # billions of parameters at or below which ngram speculation costs more than it gains
# "INFO 05-01 ...", or "(EngineCore_DP0 pid=12) INFO ..." from its worker processes.
LEVEL = re.compile(r"^(?:\(\w+ pid=\d+\)\s*)?(DEBUG|INFO|WARNING|ERROR|CRITICAL)\b")

# vLLM moved its serve parser between releases, so the probe tries both places.
PROBE = flag_probe("""
import vllm
out["version"] = getattr(vllm, "__version__", None)
try:
    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
except ImportError:
    from vllm.entrypoints.openai.cli_args import make_arg_parser, validate_parsed_serve_args
try:
    from vllm.utils.argparse_utils import FlexibleArgumentParser
except ImportError:
    from vllm.utils import FlexibleArgumentParser
parser = make_arg_parser(FlexibleArgumentParser(prog="vllm serve"))
validate_parsed_serve_args(parser.parse_args(json.loads(sys.argv[1])))
""")


# -- checks for the rules that are not plain data (serving/compose/rules/builtin.yaml names them) ----------------------

def kv_cache_fp8_e5m2(ctx: Any) -> dict | None:
    seqs = flag_value(ctx.argv, "--max-num-seqs")
    low_batch = seqs is None or (seqs.isdigit() and int(seqs) <= 16)
    return {} if flag_value(ctx.argv, "--kv-cache-dtype") == "fp8_e5m2" and low_batch else None


def ngram_small_model(ctx: Any) -> dict | None:
    size = model_billions(ctx.model)
    small = size is None or size <= SMALL_MODEL_B
    return {"model": ctx.model} if "ngram" in (flag_value(ctx.argv, "--speculative-config") or "") and small else None


def memory_above_tp4(ctx: Any) -> dict | None:
    fraction = ctx.engine.memory_fraction(ctx.argv)
    return {"fraction": f"{fraction:g}"} if fraction > 0.85 else None


def ignored_vllm_env(ctx: Any) -> dict | None:
    """VLLM_* variables the installed vLLM's envs.py does not define: nothing reads them."""
    if ctx.installed.env_names is None:
        return None
    names = sorted(n for n in ctx.env if n.startswith("VLLM_") and n not in ctx.installed.env_names
                   and n != "VLLM_API_KEY")  # read by the API server's argument defaults, not envs.py
    if not names:
        return None
    return {"names": ", ".join(names), "them": "them" if len(names) > 1 else "it",
            "version": ctx.installed.version("vllm")}


class Vllm(Engine):
    name, title = "vllm", "vLLM"
    default_command = ("vllm", "serve")
    model_flag = "--model"
    memory_flag, default_memory_fraction = "--gpu-memory-utilization", 0.9  # vLLM's own default
    tp_flags = ("--tensor-parallel-size", "-tp")
    # vLLM renamed gpu_cache_usage_perc to kv_cache_usage_perc; both are read, the new name first.
    metric_names = MetricNames("vllm:generation_tokens_total", "vllm:prompt_tokens_total",
                               "vllm:num_requests_running", "vllm:num_requests_waiting",
                               ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
                               "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total")
    api_key_env = "VLLM_API_KEY"  # the flag wins (vllm/entrypoints/serve/middleware/register.py, 0.32)
    flag_probe = PROBE
    checks = {"kv_cache_fp8_e5m2": kv_cache_fp8_e5m2, "ngram_small_model": ngram_small_model,
              "memory_above_tp4": memory_above_tp4, "ignored_vllm_env": ignored_vllm_env}

    def log_level(self, line: str) -> int | None:
        match = LEVEL.match(line)
        return getattr(logging, match.group(1)) if match else None


ENGINE = Vllm()
