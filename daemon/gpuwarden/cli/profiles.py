"""`gpuwarden profiles list|show`: the serving profiles of every engine, and the final command of one."""

from __future__ import annotations

import argparse
import dataclasses
import json
import shlex

from ..backends import open_configured
from ..base.safetext import visible, visible_lines
from ..config import Config
from ..gpu import errors
from ..serving.compose.secrets import redact_argv, redact_env
from .common import load_config
from .registry import Command
from ..base.exits import EX_CONFIG, EX_OK


def arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("action", choices=("list", "show"))
    p.add_argument("name", nargs="?", help="the profile to show (default: serve.profile, auto-selected)")
    p.add_argument("--json", action="store_true", help="machine-readable output")


def cmd_profiles(args: argparse.Namespace) -> int:
    from ..serving.compose.command import chosen_gpus
    from ..serving.compose.prepare import compose
    from ..serving.compose.profiles import load_profiles

    config = load_config(args)
    profiles = load_profiles(config.serve.profiles_dir)
    if args.action == "list":
        if args.json:
            print(json.dumps([p.as_dict() for p in profiles.values()], indent=2))
        for p in ([] if args.json else sorted(profiles.values(), key=lambda p: (p.engine, p.name))):
            ccs = ",".join(p.compute_capabilities) or "any"
            count = f"{p.gpu_count[0]}" if p.gpu_count[0] == p.gpu_count[1] else f"{p.gpu_count[0]}-{p.gpu_count[1]}"
            print(visible(f"{p.name:34s} {p.engine:7s} cc {ccs:9s} {count:>5s} GPU(s)  {p.description}"))
        return EX_OK
    gpus = _gpus_for_profiles(config)
    wanted = args.name or config.serve.profile
    if args.name and args.name in profiles:  # showing a named profile: for its own engine
        serve = dataclasses.replace(config.serve, engine=profiles[args.name].engine)
        config = dataclasses.replace(config, serve=serve)
    if not gpus:  # no GPUs readable here: show the command for the profile's own minimum
        named = profiles.get(wanted)
        gpus = [_placeholder_gpu(i, named) for i in range(named.gpu_count[0] if named else 1)]
    elif config.serve.gpus:
        gpus = chosen_gpus(config, gpus)
    # Only what gpuwarden adds to the environment, not this shell's.
    composed = compose(config, gpus, wanted, base_env={})
    command, findings = composed.command, list(composed.findings)
    profile = command.profile
    if args.json:
        print(json.dumps({**profile.as_dict(), "final_argv": redact_argv(command.argv),
                          "final_env": redact_env(command.env), "lint": [f.as_dict() for f in findings],
                          "installed": composed.installed.as_dict() if composed.installed else None,
                          "rules": [{"id": o.rule.id, "status": o.status, "reason": o.reason}
                                    for o in composed.outcomes]}, indent=2))
        return EX_OK
    # the findings quote serve.user's files and links (a model's, its cache's): escaped, as `check` prints them
    print(visible_lines(render_profile(profile, composed)))
    return EX_OK


def _gpus_for_profiles(config: Config) -> list:
    try:
        backend = open_configured(config)
    except errors.Unavailable:
        return []
    try:
        return [g.sample() for g in backend.gpus()]
    finally:
        backend.close()


def _placeholder_gpu(index: int, profile):
    from ..gpu.base import GpuSample

    cc = profile.compute_capabilities[0] if profile and profile.compute_capabilities else None
    return GpuSample(index, f"GPU-{index}", "(no GPU readable here)", "", cc)


def render_profile(profile, composed) -> str:
    command, findings = composed.command, composed.findings
    title = command.engine.title
    lines = [f"profile {profile.name}: {profile.description}", f"  from {profile.file}"]
    ccs = ", ".join(profile.compute_capabilities) or "any"
    lines.append(f"  match: compute capability {ccs}; {profile.gpu_count[0]}-{profile.gpu_count[1]} GPUs; "
                 f">= {profile.min_memory_gib:g} GiB each")
    good = ", ".join(profile.known_good) or "none listed"
    bad = "; ".join(f"{b.version} ({b.reason})" for b in profile.known_bad) or "none listed"
    tested = f"tested on {profile.tested}; " if profile.tested is not None else "tested range not stated; "
    lines.append(f"  engine {profile.engine}; {title} {tested}known good: {good}; known bad: {bad}")
    if composed.installed is not None:
        lines.append(f"  installed: {composed.installed.describe()}")
    if profile.tuning_hints:
        lines.append("  tuning hints: " + ", ".join(f"{k}: {v}" for k, v in profile.tuning_hints))
    lines.append("command (env from the profile, serve.env and the GPU selection):")
    env = " ".join(f"{k}={shlex.quote(v)}" for k, v in redact_env(command.env).items())
    lines.append(f"  {env} {shlex.join(redact_argv(command.argv))}")
    lines.append("lint:" if findings else "lint: no findings")
    lines.extend(f"  {visible(str(f))}" for f in findings)  # one line each, whatever a file's name holds
    if composed.outcomes:
        clear = [o for o in composed.outcomes if o.status == "clear"]
        lines.append(f"rules ({len(composed.outcomes)}; {len(clear)} matched nothing):")
        lines.extend(f"  {visible(o.line())}" for o in composed.outcomes if o.status != "clear")
    for text, source in profile.notes:
        lines.append(f"note: {text} [source: {source}]")
    return "\n".join(lines)


COMMAND = Command("profiles", help="the serving profiles of every engine: `profiles list`, `profiles show NAME` (the "
                  "final command, env and lint)", run=cmd_profiles, arguments=arguments, order=60,
                  exits=((EX_OK, "listed or shown"), (EX_CONFIG, "configuration error, or no profile of that name")))
