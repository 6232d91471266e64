"""vLLM: `vllm serve`, its /health and vllm: metrics, its log format, its serve-args parser and its lint."""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping, Sequence

from ..flags import flag_value, has_flag
from ..lint import ERROR, WARNING, LintFinding, model_billions, sm12x
from ..profiles import Profile
from . import Engine, MetricNames, flag_probe

FORUM_4000 = "vLLM forum: a day optimizing vLLM on 2x RTX PRO 4000 Blackwell (SM120)"
REPORT_GLM = "vLLM SM120 NVFP4 working-state report, 4x RTX PRO 6000, GLM-4.7-NVFP4 (2026-02-20)"
THREAD_DSV4 = "Hugging Face discussion #28 'Running models with vLLM on the RTX Pro 6000 - SM120'"
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


class Vllm(Engine):
    name, title = "vllm", "vLLM"
    default_command = ("vllm", "serve")
    model_flag = "--model"
    memory_flag, default_memory_fraction = "--gpu-memory-utilization", 0.9  # vLLM's own default
    tp_flags = ("--tensor-parallel-size", "-tp")
    api_key_env = "VLLM_API_KEY"
    # vLLM renamed gpu_cache_usage_perc to kv_cache_usage_perc; both are read, the new name first.
    metric_names = MetricNames("vllm:generation_tokens_total", "vllm:prompt_tokens_total",
                               "vllm:num_requests_running", "vllm:num_requests_waiting",
                               ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"))
    flag_probe = PROBE

    def log_level(self, line: str) -> int | None:
        match = LEVEL.match(line)
        return getattr(logging, match.group(1)) if match else None

    def lint(self, argv: Sequence[str], env: Mapping[str, str], profile: Profile, compute_capabilities: Sequence[str],
             model: str) -> list[LintFinding]:
        found: list[LintFinding] = []
        sm120 = sm12x(compute_capabilities)
        seqs = flag_value(argv, "--max-num-seqs")
        kv = flag_value(argv, "--kv-cache-dtype")
        backend = flag_value(argv, "--attention-backend") or env.get("VLLM_ATTENTION_BACKEND")
        memory = self.memory_fraction(argv)

        if sm120 and kv == "fp8_e5m2" and (seqs is None or (seqs.isdigit() and int(seqs) <= 16)):
            found.append(LintFinding(WARNING, "kv-cache-fp8-e5m2", "--kv-cache-dtype fp8_e5m2 costs 10-15 % at low "
                                     "batch on SM120 (dequant overhead, no gain); use --kv-cache-dtype auto",
                                     FORUM_4000))
        if has_flag(argv, "--enable-chunked-prefill") and seqs == "1":
            found.append(LintFinding(WARNING, "chunked-prefill-single-seq", "--enable-chunked-prefill with "
                                     "--max-num-seqs 1 is 10-20 % slower for single requests; drop it", FORUM_4000))
        spec = flag_value(argv, "--speculative-config") or ""
        size = model_billions(model)
        if "ngram" in spec and (size is None or size <= SMALL_MODEL_B):
            found.append(LintFinding(WARNING, "ngram-small-model", f"ngram speculation costs 5-8 % on small models "
                                     f"({model}); drop --speculative-config", FORUM_4000))
        if has_flag(argv, "--enforce-eager"):
            found.append(LintFinding(WARNING, "enforce-eager", "--enforce-eager disables CUDA graphs and costs "
                                     "50-70 % throughput; CUDA graphs work on SM120 with driver 580+", FORUM_4000))
        if backend is not None and backend.upper() != backend:
            fixed = "TRITON_ATTN" if backend.lower() in ("triton", "triton_attn") else backend.upper()
            found.append(LintFinding(ERROR, "attention-backend-case", f"attention backend '{backend}' must be upper "
                                     f"case: use {fixed} (vLLM: Unknown attention backend)", REPORT_GLM))
        elif sm120 and backend is not None and backend.upper().startswith("FLASHINFER"):
            found.append(LintFinding(ERROR, "flashinfer-sm120", "the flashinfer attention backend crashes at "
                                     "prefill_wrapper.plan() on SM120; use --attention-backend TRITON_ATTN",
                                     REPORT_GLM))
        if sm120 and self.tensor_parallel_size(argv) >= 4 and memory > 0.85:
            found.append(LintFinding(WARNING, "gpu-memory-utilization-tp4", f"--gpu-memory-utilization {memory:g} "
                                     "with tensor parallelism >= 4 OOMed at sampler warm-up on SM120 (needs "
                                     "~1.74 GiB more); use 0.80", REPORT_GLM))
        if sm120 and env.get("VLLM_USE_DEEP_GEMM", "") not in ("", "0"):
            found.append(LintFinding(ERROR, "deep-gemm-sm120", "DeepGEMM is not built for SM120; set "
                                     "VLLM_USE_DEEP_GEMM=0", THREAD_DSV4))
        if re.search(r"deepseek[-_]?v4", model, re.I) and env.get("VLLM_TRITON_MLA_SPARSE_ALLOW_CUDAGRAPH") != "1":
            found.append(LintFinding(WARNING, "dsv4-sparse-mla-cudagraph", "DeepSeek-V4 sparse MLA without "
                                     "VLLM_TRITON_MLA_SPARSE_ALLOW_CUDAGRAPH=1 ran at 5 instead of 30 tok/s",
                                     THREAD_DSV4))
        return found


ENGINE = Vllm()
