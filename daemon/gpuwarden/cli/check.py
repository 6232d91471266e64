"""`gpuwarden check`: the config, and where GPUs are reachable the tuning values against the cards; with the
serving config, everything `run` would check before starting the engine."""

from __future__ import annotations

import argparse
import json
import shlex
import sys

from ..backends import open_configured
from ..base.safetext import visible
from ..base.yamlfile import ConfigErrors
from ..config import Config, config_warnings
from ..gpu import errors
from ..serving.compose.secrets import redact_argv
from ..tune.tuning import make_plan
from ..base.exits import EX_CONFIG, EX_OK
from .common import load_config
from .registry import Command


def arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--deep", action="store_true", help="also lint the serving command and run the engine's own "
                   "argument parser on it (vLLM's serve args, SGLang's ServerArgs), in the engine's interpreter "
                   "(takes as long as importing it)")


def cmd_check(args: argparse.Namespace) -> int:
    config = load_config(args)
    advice = config_warnings(config)
    if not args.json:
        for line in advice:
            print(visible(f"warning: {line}"))
    serving = None
    try:
        backend = open_configured(config)
    except errors.Unavailable as exc:
        skipped = str(exc)
        gpus = 0
    else:
        try:
            make_plan(backend, config)
            gpus, skipped = len(backend.gpus()), None
            if args.deep or config.serve.enabled:  # what `run` would refuse, `check` finds
                serving = _serve_check(config, backend, args.deep, args.json)
        finally:
            backend.close()
    if args.json:
        print(json.dumps({"ok": True, "files": list(config.files), "gpus_checked": gpus,
                          "gpu_checks_skipped": skipped, "warnings": [w.as_dict() for w in advice],
                          "serve": serving}, indent=2))
    else:
        print(f"config OK: {', '.join(config.files)}")
        print(f"GPU checks skipped: {skipped}" if skipped else f"tuning values OK on {gpus} GPU(s)")
    return EX_OK


def _serve_check(config: Config, backend, deep: bool, as_json: bool) -> dict:
    """Everything `run` checks before starting the engine: profile, GPUs, serve.user, secrets, lint, the
    executable, and with deep, its own parser (in its interpreter, as serve.user). ConfigErrors if a start is
    blocked."""
    from ..serving.compose.prepare import prepare_serve

    prepared = prepare_serve(config, backend, deep=deep)
    problems = prepared.blocking(config)
    if config.serve.container is not None:
        from ..serving.compose.container import container_problems

        problems += container_problems(config, prepared.command.engine.name, prepared.installed,
                                       config.gpu.backend == "sim")
    nodes = _nodes_check(config, prepared.command, as_json)
    problems += [config.error(("serve", "nodes", "interface"), message, fix)
                 for severity, check, message, fix in nodes if severity == "error"]
    if not as_json:
        for finding in prepared.findings:
            # a finding's note may quote the engine interpreter's own text (its installed-versions error)
            print(visible(f"lint {finding}"), file=sys.stderr if finding.severity == "error" else sys.stdout)
    if problems:
        raise ConfigErrors(problems)
    version = prepared.flags.version if prepared.flags else None
    engine = prepared.command.engine
    if not as_json:
        argv = shlex.join(redact_argv(prepared.command.argv))
        if prepared.flags is not None:
            print(visible(f"{engine.title} {version} accepts: {argv}"))  # the version is the engine's (an image's) word
        else:
            also = "(--deep also runs its parser)" if engine.flag_probe else f"({engine.title} has no parser to run)"
            print(f"{engine.title} command checked {also}: {argv}")
    out = {"engine": engine.name, "profile": prepared.command.profile.name, "argv": redact_argv(prepared.command.argv),
           "engine_version": version, "lint": [f.as_dict() for f in prepared.findings],
           "installed": prepared.installed.as_dict() if prepared.installed else None}
    if engine.name == "vllm":
        out["vllm_version"] = version  # the older key, kept this release
    if nodes:
        out["nodes"] = [dict(zip(("severity", "check", "message", "fix"), line)) for line in nodes]
    return out


def _nodes_check(config: Config, command, as_json: bool) -> list[tuple[str, str, str, str]]:
    """A node of a multi-node engine: its role, interface and the head's rendezvous (serving/compose/nodes.py),
    printed one line each; an interface that is missing or down is an error here (the collectives would fail on
    it), not in `run`, which may start before the network is up and whose engine then waits for it."""
    if command.role is None:
        return []
    from ..serving.compose.nodes import preflight

    lines = preflight(command.role, command.env)
    if not as_json:
        for severity, check, message, fix in lines:
            if severity != "error":
                print(f"{check}: {message}" + (f" -> fix: {fix}" if fix else ""))
    return lines


COMMAND = Command("check", help="validate the config and, where GPUs are reachable, the tuning values against the "
                  "cards; exit 0 or 78", run=cmd_check, arguments=arguments, order=10,
                  exits=((EX_OK, "the config is valid (GPU checks skipped where NVML is unavailable)"),
                         (EX_CONFIG, "a configuration error, each one printed with its file and line")))
