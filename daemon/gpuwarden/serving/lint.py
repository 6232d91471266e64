"""Lint the final vLLM argv and environment against what SM120/SM121 users reported.

Each finding says how bad it is, why, and where the claim comes from. Errors
block the start unless serve.allow_lint_errors is true; warnings are logged.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from .command import flag_value, gpu_memory_utilization, has_flag, tensor_parallel_size
from .profiles import Profile

ERROR, WARNING = "error", "warning"

FORUM_4000 = "vLLM forum: a day optimizing vLLM on 2x RTX PRO 4000 Blackwell (SM120)"
REPORT_GLM = "vLLM SM120 NVFP4 working-state report, 4x RTX PRO 6000, GLM-4.7-NVFP4 (2026-02-20)"
THREAD_DSV4 = "Hugging Face discussion #28 'Running models with vLLM on the RTX Pro 6000 - SM120'"
PS_SOURCE = "ps(1) shows every process's full command line to every local user"
SMALL_MODEL_B = 8.0  # billions of parameters at or below which ngram speculation costs more than it gains


@dataclass(frozen=True)
class Finding:
    severity: str
    rule: str
    message: str
    source: str

    def __str__(self) -> str:
        return f"{self.severity}: {self.rule}: {self.message} [source: {self.source}]"

    def as_dict(self) -> dict:
        return {"severity": self.severity, "rule": self.rule, "message": self.message, "source": self.source}


def _sm12x(ccs: Sequence[str]) -> bool:
    return any(cc.startswith("12.") for cc in ccs)


def _model_billions(model: str) -> float | None:
    match = re.search(r"(\d+(?:\.\d+)?)[bB](?![a-zA-Z])", model.rsplit("/", 1)[-1])
    return float(match.group(1)) if match else None


def lint(argv: Sequence[str], env: Mapping[str, str], profile: Profile, compute_capabilities: Sequence[str],
         model: str, vllm_version: str | None = None) -> list[Finding]:
    found: list[Finding] = []
    sm120 = _sm12x(compute_capabilities)
    seqs = flag_value(argv, "--max-num-seqs")
    kv = flag_value(argv, "--kv-cache-dtype")
    backend = flag_value(argv, "--attention-backend") or env.get("VLLM_ATTENTION_BACKEND")

    if sm120 and kv == "fp8_e5m2" and (seqs is None or (seqs.isdigit() and int(seqs) <= 16)):
        found.append(Finding(WARNING, "kv-cache-fp8-e5m2", "--kv-cache-dtype fp8_e5m2 costs 10-15 % at low batch "
                             "on SM120 (dequant overhead, no gain); use --kv-cache-dtype auto", FORUM_4000))
    if has_flag(argv, "--enable-chunked-prefill") and seqs == "1":
        found.append(Finding(WARNING, "chunked-prefill-single-seq", "--enable-chunked-prefill with --max-num-seqs 1 "
                             "is 10-20 % slower for single requests; drop it", FORUM_4000))
    spec = flag_value(argv, "--speculative-config") or ""
    size = _model_billions(model)
    if "ngram" in spec and (size is None or size <= SMALL_MODEL_B):
        found.append(Finding(WARNING, "ngram-small-model", f"ngram speculation costs 5-8 % on small models "
                             f"({model}); drop --speculative-config", FORUM_4000))
    if has_flag(argv, "--enforce-eager"):
        found.append(Finding(WARNING, "enforce-eager", "--enforce-eager disables CUDA graphs and costs 50-70 % "
                             "throughput; CUDA graphs work on SM120 with driver 580+", FORUM_4000))
    if backend is not None and backend.upper() != backend:
        fixed = "TRITON_ATTN" if backend.lower() in ("triton", "triton_attn") else backend.upper()
        found.append(Finding(ERROR, "attention-backend-case", f"attention backend '{backend}' must be upper case: "
                             f"use {fixed} (vLLM: Unknown attention backend)", REPORT_GLM))
    elif sm120 and backend is not None and backend.upper().startswith("FLASHINFER"):
        found.append(Finding(ERROR, "flashinfer-sm120", "the flashinfer attention backend crashes at "
                             "prefill_wrapper.plan() on SM120; use --attention-backend TRITON_ATTN", REPORT_GLM))
    if sm120 and tensor_parallel_size(argv) >= 4 and gpu_memory_utilization(argv) > 0.85:
        found.append(Finding(WARNING, "gpu-memory-utilization-tp4", f"--gpu-memory-utilization "
                             f"{gpu_memory_utilization(argv):g} with tensor parallelism >= 4 OOMed at sampler "
                             "warm-up on SM120 (needs ~1.74 GiB more); use 0.80", REPORT_GLM))
    if sm120 and env.get("VLLM_USE_DEEP_GEMM", "") not in ("", "0"):
        found.append(Finding(ERROR, "deep-gemm-sm120", "DeepGEMM is not built for SM120; set VLLM_USE_DEEP_GEMM=0",
                             THREAD_DSV4))
    if re.search(r"deepseek[-_]?v4", model, re.I) and env.get("VLLM_TRITON_MLA_SPARSE_ALLOW_CUDAGRAPH") != "1":
        found.append(Finding(WARNING, "dsv4-sparse-mla-cudagraph", "DeepSeek-V4 sparse MLA without "
                             "VLLM_TRITON_MLA_SPARSE_ALLOW_CUDAGRAPH=1 ran at 5 instead of 30 tok/s", THREAD_DSV4))
    bad = profile.bad_version(vllm_version)
    if bad is not None:
        found.append(Finding(ERROR, "vllm-known-bad", f"vLLM {vllm_version} is on profile {profile.name}'s "
                             f"known-bad list: {bad.reason}", profile.notes[0][1] if profile.notes else profile.file))
    if has_flag(argv, "--api-key"):
        found.append(Finding(ERROR, "api-key-on-command-line", "--api-key on the command line shows in ps; put "
                             "VLLM_API_KEY=... in /etc/gpuwarden/credentials/vllm.env (root-only) instead", PS_SOURCE))
    return found
