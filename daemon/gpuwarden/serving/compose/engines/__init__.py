"""Serving engines: what gpuwarden must know about the program it serves with.

An engine is one module here that defines ENGINE, an Engine: its default
command, how its argv is built from the serve config and the profile, where its
flags start, its memory fraction and tensor-parallel size, how to read the level
of its log lines, the checks its lint rules name (serving/lint/rules/builtin.yaml),
and (optionally) its own flag parser run in its interpreter, and its health and
metrics endpoints with the names of the metrics that map to the generic serving
stats. serve.engine names the module
(default vllm); nothing outside serving/compose/engines/ depends on which engine runs,
except the vLLM-named metrics and JSON keys kept for this release
(gpuwarden_vllm_*, check --json's vllm_version), which only vLLM emits.
"""

from __future__ import annotations

import functools
import importlib
import pkgutil
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ....config import ServeConfig
from ..enginesock import listen_args
from ...lint.flags import flag_value
from ...lint.packages import UNKNOWN, Installed
from ...lint.checks import CHECKS as SHARED_CHECKS
from ...lint.findings import LintFinding
from ..profiles import Profile
from ...lint.rules import LintContext, Outcome, Rules, evaluate, load_rules

NAME_RE = re.compile(r"^[a-z][a-z0-9_]*$")
FLAGCHECK_MARK = "GPUWARDEN-FLAGCHECK "  # the line of the probe's output that carries its answer


@dataclass(frozen=True)
class MetricNames:
    """The engine's Prometheus names for what gpuwarden reads: counters of tokens, gauges of requests and the
    KV cache (several names: engines rename them across versions; the first present wins)."""

    generation_tokens: str
    prompt_tokens: str
    requests_running: str
    requests_waiting: str
    kv_cache_usage: tuple[str, ...]
    prefix_cache_queries: str | None = None  # counters in tokens, where the engine has them (`gpuwarden bench`)
    prefix_cache_hits: str | None = None
    # the engine's own time-to-first-token and request-latency histograms (their _sum and _count): `bench` sets
    # each step's client figures beside the server's, over the same interval
    ttft_histogram: str | None = None
    latency_histogram: str | None = None

    def missing(self, served: Mapping[str, float]) -> list[str]:
        """The names gpuwarden reads that a /metrics scrape lacks: a stale name fails as silently as an empty
        query, and vLLM drops hidden names two minor releases on."""
        wanted = [(self.generation_tokens,), (self.prompt_tokens,), (self.requests_running,),
                  (self.requests_waiting,), self.kv_cache_usage,
                  *((name,) for name in (self.prefix_cache_queries, self.prefix_cache_hits) if name)]
        return [" or ".join(names) for names in wanted if not any(name in served for name in names)]


class Engine:
    name: str  # serve.engine, and the `engine` label
    title: str  # in messages: "vLLM"
    default_command: tuple[str, ...]
    model_flag: str
    memory_flag: str  # the fraction of each GPU's memory it takes
    default_memory_fraction: float
    tp_flags: tuple[str, ...]
    uds_flag: str | None = None  # the flag that makes it listen on a Unix socket instead of TCP; None: it has none
    health_path = "/health"
    metrics_path = "/metrics"
    completions_path = "/v1/completions"  # OpenAI's, for the stall probe's one-token completion
    served_name_flag = "--served-model-name"  # the model name requests must use, when not the model path
    api_key_flag = "--api-key"  # the key clients must present (read as its parser does: serving/lint/flags.py)
    api_key_env: str | None = None  # the variable that gives it where the flag does not
    metric_names: MetricNames
    required_args: tuple[str, ...] = ()  # always passed, e.g. what makes it serve /metrics
    # Python run in the engine's interpreter with the flags as JSON in argv[1]; prints FLAGCHECK_MARK and
    # {"ok", "error", "version"} as JSON. None: the engine has no parser gpuwarden can run.
    flag_probe: str | None = None
    checks: Mapping = {}  # name -> check(LintContext): the rules' check: entries for this engine (serving/lint/rules.py)
    # How it lets the requests in flight finish at SIGTERM (serving/compose/drain.py): the flag that says for how
    # long, and the versions that have it (PEP 440); or it drains by itself, with no bound of its own; or neither.
    drain_flag: str | None = None
    drain_versions: str = ""
    drains_itself = False

    def command(self, serve: ServeConfig) -> tuple[str, ...]:
        return serve.command or self.default_command

    def argv(self, serve: ServeConfig, profile: Profile, role: Any = None) -> tuple[str, ...]:
        # Later flags win in argparse, so the user's args override the profile's, and a node's role
        # (serving/compose/nodes.Role) overrides both. A node that serves no API gets no --host/--port;
        # behind the proxy, the engine gets its Unix socket instead (serving/compose/enginesock.py).
        nodes = tuple(self.node_args(role)) if role is not None else ()
        listen = () if role is not None and not role.head else listen_args(serve, self)
        return (*self.command(serve), self.model_flag, serve.model, *self.required_args, *profile.args,
                *serve.args, *listen, *nodes)

    def node_args(self, role: Any) -> Sequence[str]:
        """The flags of this node's part of a multi-node engine; ValueError where the engine has no such mode."""
        raise ValueError(f"{self.title} has no multi-node mode gpuwarden can run")

    def served_model(self, serve: ServeConfig, argv: Sequence[str]) -> str:
        return flag_value(argv, self.served_name_flag) or serve.model

    def api_key(self, argv: Sequence[str], env: Mapping[str, str]) -> str | None:
        """The key a client must present to this command's server (the first, where several are given), or None
        when it asks for none. Our own probes authenticate with it, as users do."""
        key = flag_value(argv, self.api_key_flag, prefix=True)
        if key is None and self.api_key_env:
            key = env.get(self.api_key_env)
        return key or None

    def memory_fraction(self, argv: Sequence[str]) -> float:
        value = flag_value(argv, self.memory_flag)
        try:
            return float(value) if value is not None else self.default_memory_fraction
        except ValueError:
            return self.default_memory_fraction

    def tensor_parallel_size(self, argv: Sequence[str]) -> int:
        value = flag_value(argv, *self.tp_flags)
        return int(value) if value is not None and value.isdigit() else 1

    def log_level(self, line: str) -> int | None:
        """The level a line of its output was logged at; None: a continuation (it keeps the previous one)."""
        return None



@functools.cache
def names() -> list[str]:
    """The engines this install knows: the modules of this package (they do not change while it runs)."""
    return sorted(m.name for m in pkgutil.iter_modules(__path__) if NAME_RE.match(m.name))


def flag_probe(body: str) -> str:
    """The Python an engine's flag check runs: body parses json.loads(sys.argv[1]) with the engine's own parser
    and may set out["version"]; this wraps it so that the answer is always one FLAGCHECK_MARK line of JSON."""
    indented = "".join(f"    {line}\n" for line in body.strip().splitlines())
    return (f"import json, sys\nout = {{'ok': True, 'error': None, 'version': None}}\ntry:\n{indented}"
            "except SystemExit:\n    out['ok'] = False  # argparse printed its one-line reason on stderr\n"
            "except Exception as exc:\n    out['ok'], out['error'] = False, f'{type(exc).__name__}: {exc}'\n"
            f"print({FLAGCHECK_MARK!r} + json.dumps(out), flush=True)\n")


def engine_for(name: str) -> Engine | None:
    if not NAME_RE.match(name) or name not in names():
        return None
    return importlib.import_module(f"{__name__}.{name}").ENGINE


def check_names() -> dict[str, set[str]]:
    """engine -> the checks it registers, and "any" -> the shared ones: what a rule's check: may name."""
    return {"any": set(SHARED_CHECKS), **{name: set(engine_for(name).checks) for name in names()}}


def builtin_rules() -> Rules:
    return rules_for(None)


def rules_for(user_dir: Path | None) -> Rules:
    """The built-in rules (parsed once per process) and rules.d's; raises ConfigErrors (FILE:LINE) for a broken
    rules.d file."""
    return load_rules(user_dir, check_names())


def evaluate_lint(ctx: LintContext, rules: Rules | None = None) -> list[Outcome]:
    """Every rule for ctx's engine, each applied, skipped with its reason, or clear."""
    rules = rules or builtin_rules()
    return evaluate(rules.for_engine(ctx.engine.name), ctx, {**SHARED_CHECKS, **ctx.engine.checks})


def lint(argv: Sequence[str], env: Mapping[str, str], profile: Profile, compute_capabilities: Sequence[str],
         model: str, installed: Installed = UNKNOWN, engine: Engine | None = None, rules: Rules | None = None,
         prefix: int = 0) -> list[LintFinding]:
    """The findings of the rules that applied."""
    ctx = LintContext(tuple(argv), env, profile, tuple(compute_capabilities), model,
                      engine or engine_for(profile.engine), installed, prefix)
    return [o.finding for o in evaluate_lint(ctx, rules) if o.finding is not None]
