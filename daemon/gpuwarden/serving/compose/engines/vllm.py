"""vLLM: `vllm serve`, its /health and vllm: metrics, its log format, its serve-args parser and its lint."""

from __future__ import annotations

import logging
import re
from typing import Any

from packaging.specifiers import SpecifierSet

from ...lint import facts as F
from ...lint.facts import as_bool, as_number, show
from ...lint.flags import flag_value, has_flag, switch
from ...lint.checks import model_size
from ...lint.findings import version_in
from . import Engine, MetricNames, flag_probe

SMALL_MODEL_B = 8.0  # billions of parameters at or below which ngram speculation costs more than it gains
SPEC_METHOD = "--speculative-config.method"
SPEC_TOKENS = "--speculative-config.num_speculative_tokens"
MTP = re.compile(r"(?i).*mtp.*")  # mtp, deepseek_mtp, qwen3_next_mtp, ...: the model's own draft layers
# Model families by name, for a model whose config.json cannot be read here (a remote id).
HYBRID_NAME = re.compile(r"(?i)qwen3(?:[._][5-8](?!\d)|[._-]?next)|nemotron[-_ ]?(h|3)\b|jamba|"
                         r"granite[-_]?4[-_.\w]*?[-_]h\b|falcon[-_]?h1|mamba|bamba|zamba")
QWEN_GDN_NAME = re.compile(r"(?i)qwen3(?:[._][5-8](?!\d)|[._-]?next)")  # gated delta net hybrids: Qwen3-Next, 3.5 on
NEMOTRON3_NAME = re.compile(r"(?i)nemotron[-_ ]?3[-_ ]?(nano|super)")  # their reasoning parser ships in the repo
NEMOTRON3_SUPER_NAME = re.compile(r"(?i)nemotron[-_ ]?3[-_ ]?super")  # one MTP layer, three draft tokens
QWEN_TOOL_PARSERS = ("qwen3_coder", "qwen3_xml")  # the two parser families Qwen3.5 and later ship templates for
# Trained versus advertised context where the config cannot be read: DeepSeek-V4-Flash's rope scaling extends
# 64K of training to a 1M window (minefield trap 61 re-derives it from its public config.json).
DSV4_NAME = re.compile(r"(?i)deepseek[-_]?v4")
TRAINED_CONTEXT_BY_NAME = ((DSV4_NAME, 65536, 1048576),)
INDEXER_BLOCK = 64  # tokens per block of the DSA indexer's block table (minefield trap 120: 200,000 = 3,125 blocks)
CAPTURE_LADDER_END = 256  # vLLM captures 1, 2, 4, then every 8 to 256, then every 16
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


# -- checks for the rules that are not plain data (serving/lint/rules/builtin.yaml names them) ----------------------

def kv_cache_fp8_e5m2(ctx: Any) -> dict | None:
    seqs = flag_value(ctx.argv, "--max-num-seqs")
    low_batch = seqs is None or (seqs.isdigit() and int(seqs) <= 16)
    return {} if flag_value(ctx.argv, "--kv-cache-dtype") == "fp8_e5m2" and low_batch else None


def _spec(ctx: Any) -> tuple[str, str]:
    """(the speculative method, in words) or ("", "") without speculative decoding."""
    method, text = ctx.fact(SPEC_METHOD)
    return (str(method), text) if method else ("", "")


def ngram_small_model(ctx: Any) -> dict | None:
    method, text = _spec(ctx)
    size, how = model_size(ctx)
    if "ngram" not in method.lower() or size is None or size > SMALL_MODEL_B:
        return None
    return {"model": ctx.model, "facts": [text, how]}


def memory_above_tp4(ctx: Any) -> dict | None:
    fraction = ctx.engine.memory_fraction(ctx.argv)
    return {"fraction": f"{fraction:g}"} if fraction > 0.85 else None


def capture_clamp(ctx: Any) -> dict | None:
    """The largest CUDA-graph capture below --max-num-seqs x (speculative tokens + 1): the full decode batch
    runs eager (minefield trap 130). vLLM clamps a maximum to its own ladder of sizes."""
    seqs = as_number(flag_value(ctx.flags, "--max-num-seqs"))
    if seqs is None:
        return None  # the default depends on the release and the GPU: not guessed
    tokens = as_number(ctx.fact(SPEC_TOKENS)[0]) or 0
    sizes = ctx.fact("--compilation-config.cudagraph_capture_sizes")[0] or flag_value(ctx.flags, "--cuda-graph-sizes")
    limit = as_number(flag_value(ctx.flags, "--max-cudagraph-capture-size")) or \
        as_number(ctx.fact("--compilation-config.max_cudagraph_capture_size")[0])
    if isinstance(sizes, list) and sizes and all(as_number(x) for x in sizes):
        captured, how = int(max(as_number(x) for x in sizes)), f"cudagraph_capture_sizes {show(sizes)}"
    elif limit:
        if tokens and limit <= seqs:
            # Pinned to the sequence count under speculation: trap 62's documented known-good lane does this on
            # purpose (full graphs garbled drafts and wedged decode there), as --enforce-eager does under MTP. A
            # deliberate trade, not a capture that meant to cover the decode step and was clamped short of it.
            return None
        ladder = [1, 2, 4, *range(8, CAPTURE_LADDER_END, 8), *range(CAPTURE_LADDER_END, int(limit) + 1, 16)]
        captured = max(x for x in ladder if x <= limit)
        how = f"--max-cudagraph-capture-size {int(limit)} captures up to {captured}"
    else:
        return None
    wanted = int(seqs * (tokens + 1))
    if captured >= wanted:
        return None
    return {"captured": captured, "wanted": wanted,
            "facts": [how, f"--max-num-seqs {int(seqs)} x ({int(tokens)} speculative tokens + 1) = {wanted}"]}


def fuse_gemm_comms(ctx: Any, forced: bool) -> dict | None:
    """fuse_gemm_comms asked for and either forced on across hosts (it needs one host's symmetric memory) or,
    not forced, quietly declined by vLLM's sequence-parallel heuristic (minefield trap 117)."""
    asked, text = ctx.fact("--compilation-config.pass_config.fuse_gemm_comms")
    if not as_bool(asked):
        return None
    force = ctx.fact("--compilation-config.pass_config.sp_min_token_num")[0] or \
        ctx.fact("--compilation-config.sp_min_token_num")[0]
    nodes, nodes_text = ctx.fact("host.nodes")
    if forced:
        return {"facts": [text, "sp_min_token_num set", nodes_text]} if force is not None and nodes > 1 else None
    if force is not None and nodes > 1:
        return None  # the error rule says it
    why = []
    if nodes > 1:
        why.append(f"the group spans {nodes} hosts, and symmetric memory cannot")
    ccs = sorted({cc for cc in ctx.compute_capabilities if cc and cc not in ("9.0", "10.0")})
    if ccs:
        why.append(f"compute capability {', '.join(ccs)} is not in vLLM's sequence-parallel table (9.0, 10.0)")
    hidden = ctx.model_facts.hidden_size if ctx.model_facts.known else None
    if hidden is not None and hidden < 8192:
        why.append(f"hidden_size {hidden} is under the 8192 floor")
    if not why:
        return None
    return {"why": "; ".join(why), "facts": [text, nodes_text] + [f"compute capability {cc}" for cc in ccs]}


def fuse_gemm_comms_declined(ctx: Any) -> dict | None:
    return fuse_gemm_comms(ctx, forced=False)


def fuse_gemm_comms_across_hosts(ctx: Any) -> dict | None:
    return fuse_gemm_comms(ctx, forced=True)


def _by_config_or_name(ctx: Any, from_config, name: re.Pattern) -> tuple[bool, str]:
    """(whether the model is of a kind, and how that is known): its config.json where it is local, else its name."""
    mf = ctx.model_facts
    if mf.known:
        return from_config(mf)
    return bool(name.search(ctx.model)), f"{ctx.model} by its name (config.json not read: {mf.why})"


def hybrid_prefix_cache(ctx: Any) -> dict | None:
    if not switch(ctx.flags, "--enable-prefix-caching"):  # asked for (a profile's, unless serve.args say no)
        return None
    hybrid, how = _by_config_or_name(ctx, lambda mf: (bool(mf.hybrid), f"config.json {mf.model_type}: recurrent "
                                                                        "layers beside attention"), HYBRID_NAME)
    return {"facts": ["--enable-prefix-caching", how]} if hybrid else None


def hybrid_fp4_ignore_list(ctx: Any) -> dict | None:
    """A 4-bit quant of a gated-delta-net hybrid whose ignore list does not name the fused linear-attention
    projections (in_proj_qkvz, in_proj_ba): they get quantized, and the output is garbage (minefield trap 27)."""
    mf = ctx.model_facts
    if mf.known:
        gdn = mf.hybrid and (mf.model_type or "").startswith(("qwen3_next", "qwen3_5"))
        fp4 = mf.quant_bits == 4 or "fp4" in (mf.quant_method or "")
        named = any(re.search(r"in_proj_qkvz|in_proj_ba", entry) for entry in mf.quant_ignore)
        if not (gdn and fp4) or named:
            return None
        return {"facts": [f"config.json {mf.model_type}, {mf.quant_method} {mf.quant_bits or ''}-bit",
                          f"its ignore list ({len(mf.quant_ignore)} entries) names no in_proj_qkvz or in_proj_ba"]}
    if QWEN_GDN_NAME.search(ctx.model) and re.search(r"(?i)fp4", ctx.model):
        return {"facts": [f"{ctx.model} by its name (config.json not read: {mf.why})"]}
    return None


def _beyond_trained_context(ctx: Any, dsv4: bool) -> dict | None:
    """--max-model-len (or the advertised window it defaults to) past the length the model was trained at,
    under a rope-scaling factor: on DeepSeek-V4 (dsv4, minefield trap 61's lane) or on any other rope-extended
    model whose config.json says so (trap 55). One of the two rules fires on a launch, never both."""
    mf = ctx.model_facts
    is_dsv4 = bool(DSV4_NAME.search(ctx.model)) or (mf.known and (mf.model_type or "").startswith("deepseek_v4"))
    if is_dsv4 != dsv4:
        return None
    asked = as_number(flag_value(ctx.flags, "--max-model-len"))
    if mf.known:
        trained, advertised = mf.original_max_position_embeddings, mf.max_position_embeddings
        if not trained or not (mf.rope_factor or 1) > 1:
            return None
        how = f"config.json rope scaling {mf.rope_factor:g} x {trained} trained"
    else:
        known = next(((t, a) for name, t, a in TRAINED_CONTEXT_BY_NAME if name.search(ctx.model)), None)
        if known is None:
            return None
        (trained, advertised), how = known, f"{ctx.model} by its name: trained {known[0]}, advertised {known[1]}"
    length = int(asked) if asked else advertised
    if not length or length <= trained:
        return None
    given = f"--max-model-len {length}" if asked else f"no --max-model-len: the advertised {length}"
    return {"length": length, "trained": trained, "facts": [given, how]}


def beyond_trained_context(ctx: Any) -> dict | None:
    return _beyond_trained_context(ctx, dsv4=True)


def rope_extended_context(ctx: Any) -> dict | None:
    return _beyond_trained_context(ctx, dsv4=False)


def indexer_spec_overhang(ctx: Any) -> dict | None:
    """MTP on a model with a sparse-attention indexer whose block table is sized from --max-model-len alone:
    the speculative overhang (max_model_len + num_speculative_tokens) addresses one 64-token block more than
    the table holds (minefield trap 120: 200,000 = 3,125 blocks exactly, + 3 draft tokens reaches the 3,126th)."""
    method, text = _spec(ctx)
    tokens = as_number(ctx.fact(SPEC_TOKENS)[0])
    mf = ctx.model_facts
    if not MTP.fullmatch(method) or not tokens or not mf.known or not mf.indexer:
        return None
    asked = as_number(flag_value(ctx.flags, "--max-model-len"))
    length = int(asked) if asked else mf.max_position_embeddings
    if not length:
        return None
    table, needed = -(-length // INDEXER_BLOCK), -(-(length + int(tokens)) // INDEXER_BLOCK)
    if needed <= table:
        return None
    given = f"--max-model-len {length}" if asked else f"no --max-model-len: max_position_embeddings {length}"
    topk = f" (index_topk {mf.index_topk})" if mf.index_topk else ""
    return {"length": length, "tokens": int(tokens), "table": table, "needed": needed,
            "facts": [text, f"num_speculative_tokens {int(tokens)}", given,
                      f"config.json: a sparse-attention indexer{topk}"]}


DSV4_LANE_BUILDS = "<0.24"  # before the FlashInfer SM12x sparse-MLA path for DeepSeek-V4 (#43477, vLLM 0.24)


def dsv4_mtp_sm12x_hang(ctx: Any) -> dict | None:
    """DeepSeek-V4 with MTP on SM12x: vllm#51593 hangs on the FlashInfer sparse-MLA path upstream vLLM carries
    from 0.24 (#43477); before it only preview builds served DeepSeek-V4 on SM12x, and those stopped answering
    with VLLM_TRITON_MLA_SPARSE_ALLOW_CUDAGRAPH=1 (#47169). A preview build without that variable is what
    minefield trap 62's known-good GB10 lane runs (vLLM 0.21.1rc1, MTP 3, served since 2026-07-22): quiet."""
    version = ctx.installed.version("vllm") if ctx.installed.known else None
    preview = version is not None and version_in(SpecifierSet(DSV4_LANE_BUILDS), version)
    if preview and ctx.env.get("VLLM_TRITON_MLA_SPARSE_ALLOW_CUDAGRAPH") != "1":
        return None
    why = ("VLLM_TRITON_MLA_SPARSE_ALLOW_CUDAGRAPH=1 on a pre-0.24 build" if preview else
           f"vLLM {version}" if version else "vLLM version unknown")
    return {"facts": [why]}


def checkpoint_reasoning_parser(ctx: Any) -> dict | None:
    if has_flag(ctx.flags, "--reasoning-parser-plugin"):
        return None
    mf = ctx.model_facts
    if mf.known and mf.reasoning_parsers:
        shipped = ", ".join(mf.reasoning_parsers)
        return {"file": shipped, "facts": [f"the checkpoint ships {shipped}", "no --reasoning-parser-plugin"]}
    if not mf.known and NEMOTRON3_NAME.search(ctx.model):
        return {"file": "its *reasoning_parser.py", "facts": [f"{ctx.model} by its name",
                                                              "no --reasoning-parser-plugin"]}
    return None


def mtp_one_draft(ctx: Any) -> dict | None:
    """num_speculative_tokens 1 read off num_nextn_predict_layers 1 (minefield trap 71)."""
    method, text = _spec(ctx)
    tokens = as_number(ctx.fact(SPEC_TOKENS)[0])
    if not MTP.fullmatch(method) or tokens != 1:
        return None
    one, how = _by_config_or_name(ctx, lambda mf: (mf.nextn_layers == 1, f"config.json num_nextn_predict_layers "
                                                                         f"{mf.nextn_layers}"), NEMOTRON3_SUPER_NAME)
    return {"facts": [text, "num_speculative_tokens 1", how]} if one else None


def mtp_excluded_from_quant(ctx: Any) -> dict | None:
    """MTP drafting while the quantization left the MTP layers out (minefield trap 109)."""
    method, text = _spec(ctx)
    if not MTP.fullmatch(method):
        return None
    mf = ctx.model_facts
    if mf.known:
        left = [entry for entry in mf.quant_ignore if re.search(r"(?i)mtp", entry)]
        return {"facts": [text, f"the quantization ignores {', '.join(left[:3])}"]} if left else None
    if re.search(r"(?i)deepseek[-_]?v4", ctx.model) and re.search(r"(?i)nvfp4", ctx.model):
        return {"facts": [text, f"{ctx.model} by its name (config.json not read: {mf.why})"]}
    return None


def tool_parser_family(ctx: Any) -> dict | None:
    """Qwen3.5 and later ship templates for the qwen3_coder and qwen3_xml tool parsers (minefield trap 19)."""
    if not QWEN_GDN_NAME.search(ctx.model) or "next" in ctx.model.lower():
        return None
    parser = flag_value(ctx.flags, "--tool-call-parser")
    if parser is None or parser in QWEN_TOOL_PARSERS:
        return None  # no tools served (vLLM itself refuses --enable-auto-tool-choice without a parser)
    return {"parser": parser, "facts": [f"model {ctx.model}", f"--tool-call-parser {parser}"]}


SLEEP_WHEN_IDLE = "VLLM_SLEEP_WHEN_IDLE"
OWN_RULE = {SLEEP_WHEN_IDLE}  # variables a rule of their own says more of than engine-ignores-env


def sleep_when_idle_gone(ctx: Any) -> dict | None:
    """VLLM_SLEEP_WHEN_IDLE set on a vLLM whose envs.py no longer defines it (vllm#28053 removed it; its message
    queue readers now block after a second idle by themselves): it saves nothing, and nothing else in the image is
    idling the GPUs either. facts.Unknown where the installed vLLM's envs.py was not read."""
    if not ctx.env.get(SLEEP_WHEN_IDLE):
        return None
    if not ctx.installed.known or ctx.installed.env_names is None:
        raise F.Unknown(f"whether the installed vLLM reads {SLEEP_WHEN_IDLE} (its envs.py was not read)")
    if SLEEP_WHEN_IDLE in ctx.installed.env_names:
        return None
    version = ctx.installed.version("vllm")
    return {"version": version, "facts": [f"{SLEEP_WHEN_IDLE}={ctx.env[SLEEP_WHEN_IDLE]}",
                                          f"vLLM {version}'s envs.py does not define it"]}


def ignored_vllm_env(ctx: Any) -> dict | None:
    """VLLM_* variables the installed vLLM's envs.py does not define: nothing reads them."""
    if ctx.installed.env_names is None:
        return None
    names = sorted(n for n in ctx.env if n.startswith("VLLM_") and n not in ctx.installed.env_names
                   and n != "VLLM_API_KEY"  # read by the API server's argument defaults, not envs.py
                   and n not in OWN_RULE)
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
    # --uds PATH: it binds that Unix socket and ignores --host and --port (0.32: FrontendArgs.uds in
    # vllm/entrypoints/launchers/cli_args.py; launcher.setup_server binds it with create_server_unix_socket)
    uds_flag = "--uds"
    # vLLM renamed gpu_cache_usage_perc to kv_cache_usage_perc; both are read, the new name first.
    metric_names = MetricNames("vllm:generation_tokens_total", "vllm:prompt_tokens_total",
                               "vllm:num_requests_running", "vllm:num_requests_waiting",
                               ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
                               "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
                               "vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds")
    api_key_env = "VLLM_API_KEY"  # the flag wins (vllm/entrypoints/serve/middleware/register.py, 0.32)
    flag_probe = PROBE
    # vllm/engine/arg_utils.py (0.32): "--shutdown-timeout", 0 (its default) aborts the requests in flight at
    # SIGTERM, N rejects new ones and lets those finish within N s (v1/engine/core.py _handle_shutdown). Since 0.18:
    # vllm-project/vllm#34730, reverted and re-applied as #36666.
    drain_flag, drain_versions = "--shutdown-timeout", ">=0.18.0"
    checks = {"kv_cache_fp8_e5m2": kv_cache_fp8_e5m2, "ngram_small_model": ngram_small_model,
              "memory_above_tp4": memory_above_tp4, "ignored_vllm_env": ignored_vllm_env,
              "capture_clamp": capture_clamp, "fuse_gemm_comms_declined": fuse_gemm_comms_declined,
              "fuse_gemm_comms_across_hosts": fuse_gemm_comms_across_hosts, "hybrid_prefix_cache": hybrid_prefix_cache,
              "hybrid_fp4_ignore_list": hybrid_fp4_ignore_list, "beyond_trained_context": beyond_trained_context,
              "checkpoint_reasoning_parser": checkpoint_reasoning_parser, "mtp_one_draft": mtp_one_draft,
              "mtp_excluded_from_quant": mtp_excluded_from_quant, "tool_parser_family": tool_parser_family,
              "rope_extended_context": rope_extended_context, "indexer_spec_overhang": indexer_spec_overhang,
              "dsv4_mtp_sm12x_hang": dsv4_mtp_sm12x_hang, "sleep_when_idle_gone": sleep_when_idle_gone}

    def node_args(self, role: Any) -> list[str]:
        """vLLM's own multi-node mode on its multiprocessing executor (vllm/engine/arg_utils.py:1143-1146:
        --master-addr, --master-port, --nnodes, --node-rank; the nodes past the first run `vllm serve
        --headless`, vllm/entrypoints/launchers/cli_args.py:435, started by vllm/entrypoints/cli/serve.py:150,
        run_headless), or Ray's executor on the head alone (the other nodes run `ray start`, not vLLM)."""
        nodes = role.nodes
        if nodes.backend == "ray":
            return ["--distributed-executor-backend", "ray"]
        args = ["--distributed-executor-backend", "mp", "--nnodes", str(nodes.count), "--node-rank",
                str(role.rank), "--master-addr", nodes.head, "--master-port", str(nodes.port)]
        return args if role.head else [*args, "--headless"]

    def log_level(self, line: str) -> int | None:
        match = LEVEL.match(line)
        return getattr(logging, match.group(1)) if match else None


ENGINE = Vllm()
