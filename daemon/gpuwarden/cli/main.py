"""Command line: check, plan, apply, run, status, profiles, doctor, bench, tune."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import sys
from pathlib import Path

from .. import __version__
from ..base import earlysignals
from ..tune import tunables
from .. import config as configmod
from ..backends import open_configured
from ..bench import command as bench_command
from ..bench import tune as tune_command
from ..proxy import command as proxy_command
from ..config import EX_CONFIG, Config
from ..gpu import errors
from ..gpu.sim.scenario import builtin_scenarios, resolve_scenario, unknown_scenario
from ..tune.originals import originals_store
from ..base.safetext import visible
from ..serving.compose.secrets import redact_argv, redact_env
from ..tune.tuning import Outcome, Plan, Tuner, make_plan
from ..base.systemd import print_error
from ..base.yamlfile import ConfigError, ConfigErrors, InvalidConfig

EX_OK, EX_FAIL, EX_UNAVAILABLE, EX_NOPERM = 0, 1, 69, 77  # sysexits.h where one fits
EX_NOT_RUNNING = 3  # as `systemctl status` says of an inactive unit

DESCRIPTION = """\
gpuwarden keeps NVIDIA inference GPUs tuned: at start it turns on persistence
mode and locks GPU/memory clocks (and optionally a power limit) through NVML,
checking every value against what the card supports, then watches the GPUs.

Exit status: 0 ok, 1 a tuning step failed, 3 no daemon running (status),
69 NVML unavailable, 77 permission denied (needs root or CAP_SYS_ADMIN),
78 configuration error."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gpuwarden", description=DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"gpuwarden {__version__}")
    # --config and --sim work before or after the command name.
    _add_common(parser, default_config=configmod.DEFAULT_PATH, default_sim=None)
    common = argparse.ArgumentParser(add_help=False)
    _add_common(common, default_config=argparse.SUPPRESS, default_sim=argparse.SUPPRESS)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("check", parents=[common], help="validate the config and, where GPUs are reachable, "
                       "the tuning values against the cards; exit 0 or 78")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--deep", action="store_true", help="also lint the serving command and run the engine's own "
                   "argument parser on it (vLLM's serve args, SGLang's ServerArgs), in the engine's interpreter "
                   "(takes as long as importing it)")
    p = sub.add_parser("plan", parents=[common], help="print what tuning would change on each GPU; touches nothing")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    sub.add_parser("apply", parents=[common], help="apply the tuning once, verify it, and exit (for boot-time "
                   "tuning without the daemon)")
    sub.add_parser("cleanup", parents=[common], help="for the unit's ExecStopPost: after a stop, end the "
                   "serving children the daemon left (after a crash they are kept for the restarted daemon to adopt)")
    p = sub.add_parser("run", parents=[common], help="the daemon: apply the tuning, then monitor every "
                       "poll_interval_s and serve metrics until SIGTERM/SIGINT (SIGHUP reloads the config)")
    p.add_argument("--read-only", action="store_true", help="never touch the GPUs (same as tuning.apply: false)")
    p.add_argument("--duration", type=float, metavar="SECONDS", help="stop by itself after SECONDS")
    p.add_argument("-v", "--verbose", action="store_true", help="log every sample, not one per log_interval_s")
    p = sub.add_parser("profiles", parents=[common], help="the serving profiles of every engine: `profiles list`, "
                       "`profiles show NAME` (the final command, env and lint)")
    p.add_argument("action", choices=("list", "show"))
    p.add_argument("name", nargs="?", help="the profile to show (default: serve.profile, auto-selected)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p = sub.add_parser("doctor", parents=[common], help="one-shot, read-only preflight: persistence, clocks and "
                       "throttle reasons, power limit, driver, and the serving setup; exit 0 ok, 1 warnings, 2 errors")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--no-deep", action="store_true",
                   help="skip running the engine's own flag parser (slow: imports the engine)")
    p = sub.add_parser("status", parents=[common], help="show the running daemon's view: clocks, power, "
                       "reasons and firing alerts per GPU (exit 3 if no daemon answers)")
    p.add_argument("--json", action="store_true", help="the daemon's raw /status JSON")
    p.add_argument("--user", metavar="NAME", help="basic auth user when metrics.web_config asks for one (the "
                   "password comes from $GPUWARDEN_PASSWORD)")
    bench_command.add_parser(sub, common)
    tune_command.add_parser(sub, common)
    proxy_command.add_parser(sub, common)
    return parser


def _add_common(parser: argparse.ArgumentParser, default_config, default_sim) -> None:
    parser.add_argument("-c", "--config", type=Path, default=default_config,
                        help=f"config file; conf.d/*.yaml beside it is merged in (default: {configmod.DEFAULT_PATH})")
    parser.add_argument("--sim", metavar="SCENARIO", default=default_sim,
                        help="use the simulated GPUs of SCENARIO instead of NVML (built-in: "
                             + ", ".join(builtin_scenarios()) + ", or a scenario file)")


def open_standard_fds() -> None:
    """Started with stdin, stdout or stderr closed, the next open() would take that number, and the signal
    pipe or a socket would receive our prints. Point any closed one of fds 0-2 at /dev/null first."""
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            null = os.open(os.devnull, os.O_RDWR)
            if null != fd:
                os.dup2(null, fd)
                os.close(null)


def main(argv: list[str] | None = None) -> int:
    open_standard_fds()
    args = build_parser().parse_args(argv)
    if args.command != "run":  # only the daemon's loop takes the signals held since start (earlysignals.py)
        earlysignals.release()
    try:
        return COMMANDS[args.command](args)
    except InvalidConfig as exc:
        return _config_failure(exc, getattr(args, "json", False))
    except errors.GpuError as exc:
        print_error(f"gpuwarden: {exc}")
        return EX_UNAVAILABLE if isinstance(exc, errors.Unavailable) else EX_FAIL
    except KeyboardInterrupt:
        print_error("gpuwarden: interrupted")
        return 130
    except BrokenPipeError:
        return EX_FAIL  # e.g. `gpuwarden plan | head`


def _config_failure(exc: InvalidConfig, as_json: bool) -> int:
    problems = exc.errors
    if as_json:
        print(json.dumps({"ok": False, "errors": [p.as_dict() for p in problems]}, indent=2))
    else:
        for problem in problems:
            print_error(str(problem))
    return EX_CONFIG


def load_config(args: argparse.Namespace, config: Config | None = None) -> Config:
    """The config file (or config, the defaults instead of a file), with the command line's overrides."""
    config = configmod.load(args.config) if config is None else config
    if args.sim:
        path = resolve_scenario(args.sim, Path.cwd())
        if path is None:
            raise ConfigError("(command line)", 0, "--sim", *unknown_scenario(args.sim))
        gpu = dataclasses.replace(config.gpu, backend="sim", scenario=args.sim, base_dir=Path.cwd())
        config = dataclasses.replace(config, gpu=gpu)
    if getattr(args, "read_only", False):
        config = dataclasses.replace(config, tuning=dataclasses.replace(config.tuning, apply=False))
    if getattr(args, "verbose", False):
        config = dataclasses.replace(config, log_interval_s=0.0)
    return config


def cmd_check(args: argparse.Namespace) -> int:
    config = load_config(args)
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
                          "gpu_checks_skipped": skipped, "serve": serving}, indent=2))
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
            print(f"{engine.title} {version} accepts: {argv}")
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
            print(f"{p.name:34s} {p.engine:7s} cc {ccs:9s} {count:>5s} GPU(s)  {p.description}")
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
    print(render_profile(profile, composed))
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
    lines.extend(f"  {f}" for f in findings)
    if composed.outcomes:
        clear = [o for o in composed.outcomes if o.status == "clear"]
        lines.append(f"rules ({len(composed.outcomes)}; {len(clear)} matched nothing):")
        lines.extend(f"  {o.line()}" for o in composed.outcomes if o.status != "clear")
    for text, source in profile.notes:
        lines.append(f"note: {text} [source: {source}]")
    return "\n".join(lines)


def cmd_plan(args: argparse.Namespace) -> int:
    config = load_config(args)
    backend = open_configured(config)
    try:
        plan = make_plan(backend, config)
    finally:
        backend.close()
    if args.json:
        print(json.dumps({"apply": config.tuning.apply, **plan.as_dict()}, indent=2))
        return EX_OK
    print(render_plan(plan, config))
    return EX_OK


def render_plan(plan: Plan, config: Config) -> str:
    lines = [f"note: {note}" for note in plan.notes]
    if any(tunables.BY_KEY[a.setting].lock_of for a in plan.actions):
        lines.append("note: NVML cannot read a clock lock back, so locks are set on every apply "
                     "and verified by reading the clock")
    for gpu in plan.gpus:
        lines.append(f"GPU {gpu.index}  {gpu.name}  {gpu.uuid}")
        lines.extend(f"  {a.describe()}" for a in gpu.actions)
        if not gpu.actions:
            lines.append("  nothing to do")
    if not config.tuning.apply:
        lines.append("tuning.apply is false: `gpuwarden run` will only monitor, and `apply` refuses")
    return "\n".join(lines)


def cmd_apply(args: argparse.Namespace) -> int:
    config = load_config(args)
    if not config.tuning.apply:
        where = config.error(("tuning", "apply"), "")  # only for its file and line
        print_error(f"gpuwarden: nothing applied: tuning.apply is false ({where.file}:{where.line})")
        return EX_FAIL
    backend = open_configured(config)
    try:
        plan = make_plan(backend, config)
        tuner = Tuner(backend, originals_store(config))
        applied = tuner.apply(plan)
        verified = tuner.verify(plan) if all(o.ok for o in applied) else []
    finally:
        backend.close()
    for outcome in applied:
        print(f"applied {outcome.describe()}")
    for outcome in verified:
        print(f"verified {outcome.describe()}")
    return apply_status(applied + verified)


def apply_status(outcomes: list[Outcome]) -> int:
    if any(o.error is errors.NoPermission for o in outcomes):
        return EX_NOPERM
    return EX_OK if all(o.ok for o in outcomes) else EX_FAIL


def cmd_run(args: argparse.Namespace) -> int:
    from ..service.daemon import HANDOVER_ENV, LEFT_SERVING, Daemon, StartupError, reexec, run
    from ..base.systemd import setup_logging

    try:
        config = load_config(args)
    except InvalidConfig:
        # A re-exec: the old image checked this config with its own loader, and this release's refuses it. The
        # children it handed over serve on for the next daemon (Daemon.leave_children), not for cleanup's kill.
        if HANDOVER_ENV in os.environ and os.environ.get("STATE_DIRECTORY"):
            from ..serving.run import handover
            from ..base.statedir import state_dir

            if (running := handover.keep(state_dir())) is not None:
                print_error("gpuwarden: " + LEFT_SERVING % running)
        raise
    logs = setup_logging()
    backend = open_configured(config)
    daemon = None
    try:
        daemon = Daemon(config, backend, reload=lambda: load_config(args))
        run(daemon, duration_s=args.duration)
    except StartupError as exc:
        logs.close()
        print_error(f"gpuwarden: {exc}")
        return EX_FAIL
    finally:
        backend.close()
        logs.close()
    if daemon is not None and daemon.handing_over:
        reexec()  # does not return
    return EX_OK


def cmd_cleanup(args: argparse.Namespace) -> int:
    """ExecStopPost: systemd says how the daemon ended ($SERVICE_RESULT). A crash (a signal, a core dump, the
    watchdog, an exit status systemd restarts on) leaves the children for the restarted daemon to adopt,
    unless it was stopping them; so does a start that failed with children to adopt (the record's keep: a
    config the new image refused after a handover, exit 78, which the unit does not restart); any other end
    (a stop, a stop that timed out) ends what is left."""
    import time

    from ..serving.run import handover
    from ..serving.run.processes import STRAY_GRACE_S, Strays, find_strays
    from ..base.statedir import state_dir

    folder = state_dir()
    record = handover.load(folder)
    result = os.environ.get("SERVICE_RESULT", "success")
    crashed = result in ("signal", "core-dump", "watchdog") or (
        result == "exit-code" and os.environ.get("EXIT_STATUS") not in ("0", str(EX_CONFIG)))
    if record is None or not record.children:
        return EX_OK
    if crashed and not record.stopping:
        print(f"gpuwarden: the daemon ended with {result}: keeping {len(record.children)} child(ren) for the "
              "restarted daemon to adopt")
        return EX_OK
    if record.keep and not record.stopping:
        print(f"gpuwarden: the daemon could not start: keeping {len(record.children)} child(ren) serving, "
              "unsupervised, for the next daemon to adopt")
        return EX_OK
    handover.end_leftovers(record, f"the daemon stopped ({result})")
    # What left the children's groups (setsid) is found in the unit's cgroup (ExecStopPost runs there too).
    uids = {c.uid for c in record.children}
    strays = Strays()
    strays.end(find_strays(uids, ()), uids, (), time.monotonic(), STRAY_GRACE_S)
    strays.wait(time.monotonic)
    handover.clear(folder)
    return EX_OK


def cmd_doctor(args: argparse.Namespace) -> int:
    from ..watch.doctor import diagnose, exit_status

    config = load_config(args)
    backend = open_configured(config)
    try:
        findings = diagnose(config, backend, deep=not args.no_deep)
    finally:
        backend.close()
    if args.json:
        print(json.dumps({"exit_status": exit_status(findings), "findings": [f.as_dict() for f in findings]},
                         indent=2))
    else:
        print("\n".join(str(f) for f in findings))
    return exit_status(findings)


def cmd_status(args: argparse.Namespace) -> int:
    from ..web.status import StatusError, fetch_status, render_status, running_elsewhere

    config = load_config(args)
    if config.metrics.url is None:
        print_error("gpuwarden: metrics.listen is none, so the daemon serves no /status to read")
        return EX_NOT_RUNNING
    auth = (args.user, os.environ.get("GPUWARDEN_PASSWORD", "")) if args.user else None
    try:
        state = fetch_status(config.metrics, auth)
        moved = running_elsewhere(config.metrics) if state is None else None
        if moved is not None:
            state = fetch_status(moved, auth)
            if state is not None:
                print_error(f"gpuwarden: note: the daemon serves {moved.url}, not metrics.listen "
                            f"{config.metrics.url}: the listen address changes on restart")
    except StatusError as exc:
        print_error(f"gpuwarden: {exc}")
        return EX_NOT_RUNNING
    if state is None:
        print(f"gpuwarden is not running (nothing answers on {config.metrics.url})")
        return EX_NOT_RUNNING
    try:
        print(json.dumps(state, indent=2) if args.json else render_status(state))
    except (TypeError, ValueError, KeyError, AttributeError):  # "gpus": 5, a string as a power reading
        print_error(f"gpuwarden: {config.metrics.url}/status is not shaped as this gpuwarden's /status")
        return EX_NOT_RUNNING
    return EX_OK


def cmd_bench(args: argparse.Namespace) -> int:
    # With --url (or --compare), bench needs no config file: the default one is read only where it exists, and
    # -c none reads none (the defaults). argparse converts only what was typed: an unnamed -c is DEFAULT_PATH.
    absent = args.config is configmod.DEFAULT_PATH and not os.path.exists(args.config)
    if str(args.config).lower() == "none" or ((args.url or args.compare) and absent):
        return bench_command.cmd_bench(args, load_config(args, Config()))
    return bench_command.cmd_bench(args, load_config(args))


def cmd_tune(args: argparse.Namespace) -> int:
    return tune_command.cmd_tune(args, load_config(args))


def cmd_proxy(args: argparse.Namespace) -> int:
    return proxy_command.cmd_proxy(args, load_config)


COMMANDS = {"cleanup": cmd_cleanup, "bench": cmd_bench, "tune": cmd_tune, "proxy": cmd_proxy, "check": cmd_check, "plan": cmd_plan, "apply": cmd_apply,
            "run": cmd_run, "status": cmd_status, "profiles": cmd_profiles, "doctor": cmd_doctor}


if __name__ == "__main__":
    sys.exit(main())
