"""From config and GPUs to a checked serving command: engine, profile, argv/env, lint, and the engine's own
parser. `run`, `check`, `doctor` and `profiles show` all come through compose()."""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import shutil
import subprocess
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from ...config import Config
from ...gpu.base import GpuBackend, GpuSample
from ...base.yamlfile import ConfigError, ConfigErrors
from .command import ServeCommand, build_command, chosen_gpus, engine_of, profile_error
from .container import image_installed, inside_env
from .flagcheck import FlagCheck, check_flags
from .enginesock import conflict_finding, engine_socket, fallback_finding, make_socket_dir, socket_dir
from .homes import HomeError, child_home
from .identity import Identity, IdentityError, popen, resolve
from ...base.statedir import state_dir
from .drain import hold_finding, plan_drain
from .engines import evaluate_lint, rules_for
from .flagcheck import engine_python
from ..lint.packages import Installed
from .installed import installed
from ..lint.findings import ERROR, LintFinding, unknown_facts
from ..lint.model import launch_facts
from .nodes import role_of
from ..lint.rules import LintContext, Outcome, Rules
from .profiles import Profile, load_profiles, select_profile
from .secrets import SecretFileError, credentials_file, read_env_file

log = logging.getLogger("gpuwarden")


@dataclass(frozen=True)
class Composed:
    """The command a config gives on some GPUs, and its lint: what `profiles show` prints."""

    command: ServeCommand
    findings: tuple[LintFinding, ...]
    outcomes: tuple[Outcome, ...] = ()  # every rule: applied, skipped (and why) or clear
    installed: Installed | None = None
    rules: Rules | None = None


@dataclass(frozen=True)
class PreparedServe:
    command: ServeCommand
    identity: Identity
    findings: tuple[LintFinding, ...]
    flags: FlagCheck | None  # None when the deep check was not run
    home_note: str | None = None  # why the child gets a home under the state directory, when it does
    installed: Installed | None = None
    rules: Rules | None = None  # what the lint ran (doctor says when they are older than the engine)

    def blocking(self, config: Config) -> list[ConfigError]:
        """What stops the start: lint errors (unless allowed) and the engine's parser rejecting the flags."""
        where = ("serve", "args") if config.serve.args else ("serve", "profile")
        title = self.command.engine.title
        problems = []
        if not config.serve.allow_lint_errors:
            problems += [config.error(where, f"lint {f.rule}: {f.message}",
                                      "fix it, or set serve.allow_lint_errors: true")
                         for f in self.findings if f.severity == ERROR]
        if self.flags is not None and not self.flags.ok:
            problems.append(flag_problem(config, self.command, self.flags))
        from .apikey import FLAGS_FIX, engine_key, flags_key_problem, proxy_asks_key  # noqa: PLC0415 (imports this)

        if proxy_asks_key(config):  # the proxy must know the engine's key
            keyed = flags_key_problem(self.command.argv)  # the profile's args and serve.command's words too
            if keyed:
                problems.append(config.error(("serve", "args"), *keyed))
            given = self.command.env.get("VLLM_API_KEY")
            if given and given != engine_key(config):  # a profile's env (attacker 16): the engine's, not the proxy's
                problems.append(config.error(("serve", "profile"), "with the proxy on, the profile's env gives vLLM "
                                             "VLLM_API_KEY, which the proxy cannot follow", FLAGS_FIX))
        # clocks keeps the engine running, its port held: only a stop frees it
        if config.serve.idle is not None and config.serve.idle.action == "stop" and \
                not on_socket(config, self.command.engine):
            problems.append(config.error(("serve", "idle"), f"serve.idle's stop needs {title} on its Unix socket "
                                         f"behind the proxy: on {config.serve.host}:{config.serve.port} the port is free for the "
                                         "whole rest, and a local user who binds it keeps the engine from waking",
                                         "serve.engine_listen: auto with vLLM (and a serve.user with a group of its "
                                         "own), action: clocks, or leave out serve.idle"))
        # a container's command is the image's, not this host's (the shim says when the image has none)
        missing = None if config.serve.container else executable_problem(self.command.argv[0],
                                                                         self.command.env.get("PATH", os.defpath))
        if missing:
            problems.append(config.error(("serve", "command"), missing,
                                         f"an absolute path to {title}'s executable or Python"))
        return problems


def on_socket(config: Config, engine) -> bool:
    """Whether the engine listens on its Unix socket (enginesock.py): an engine at rest leaves no port to take
    (attacker 18's first: a local user who bound a TCP engine's port kept every wake waiting, each request 503)."""
    try:
        return engine_socket(config.serve, engine) is not None
    except ValueError:  # engine_listen unix that cannot be had: its own line says so
        return True


def flag_problem(config: Config, command: ServeCommand, flags: FlagCheck) -> ConfigError | None:
    """The engine's parser refusing the command's flags, as a config error at what set them (serve.command where
    the parser names a flag it gives after its entry point, else serve.args, else serve.profile): what a start,
    `check --deep`, a reload and a handover say. None: it accepts them."""
    if flags.ok:
        return None
    if config.serve.container is not None and not flags.ran:  # no verdict: the image's parser was not asked
        return config.error(("serve", "container", "image"), f"{flags.error} (its flags are not checked)")
    where = ("serve", "args") if config.serve.args else ("serve", "profile")
    own = command.argv[command.prefix:len(config.serve.command)]  # the flags serve.command itself gives
    if any(word.startswith("-") and re.search(rf"(?<![\w-]){re.escape(word.split('=', 1)[0])}(?![\w-])",
                                              flags.error or "") for word in own):
        where = ("serve", "command")  # the parser names one of them
    return config.error(where, f"{command.engine.title} rejects the flags: {flags.error}")


def executable_problem(program: str, path: str) -> str | None:
    """Why program cannot be executed (as the child would find it on path), or None."""
    found = program if "/" in program else shutil.which(program, path=path)
    if found is None:
        return f"{program} is not found on the child's PATH ({path})"
    if not os.path.isfile(found):
        return f"{found} does not exist or is not a file"
    if not os.stat(found).st_mode & 0o111:
        return f"{found} is not executable"
    return None


def child_identity(config: Config) -> Identity:
    """serve.user, resolved and checked; ConfigError when it must not run the engine."""
    try:
        return resolve(config.serve.user)
    except IdentityError as exc:
        raise config.error(("serve", "user"), str(exc)) from None


def child_secrets(config: Config, environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """The credential vllm.env, then serve.env_file (which wins); ConfigError as FILE:LINE of the file."""
    out: dict[str, str] = {}
    for path, key in ((credentials_file(environ), None), (config.serve.env_file, ("serve", "env_file"))):
        if path is None:
            continue
        try:
            out.update(read_env_file(path, owner=None if os.geteuid() == 0 else os.geteuid()))
        except SecretFileError as exc:
            where = f" (named by {config.error(key, '').file}: serve.env_file)" if key else " (systemd credential)"
            raise ConfigError(str(path), exc.line, "(secrets)", exc.message + where) from None
    return out


def pick_profile(config: Config, profiles: dict[str, Profile], wanted: str, gpus: Sequence[GpuSample]) -> Profile:
    """The profile wanted names, or "auto"'s pick for the engine and GPUs; ConfigError(s) when there is none."""
    engine = config.serve.engine
    profile = select_profile(profiles, wanted, list(gpus), engine)
    if profile is None:
        if wanted != "auto":
            raise profile_error(config, wanted, list(profiles))
        raise ConfigErrors([config.error(("serve", "profile"), f"no {engine} profile matches these GPUs",
                                         "name one, or add one to profiles.d")])
    if profile.engine != engine:
        raise config.error(("serve", "profile"), f"profile {profile.name} is for engine {profile.engine}, and "
                           f"serve.engine is {engine}", f"a profile for {engine}, or serve.engine: {profile.engine}")
    return profile


def compose(config: Config, gpus: Sequence[GpuSample], profile_name: str | None = None,
            base_env: Mapping[str, str] = os.environ, secrets: Mapping[str, str] | None = None,
            home: Mapping[str, str] | None = None, found: Installed | None = None, ask: bool = True) -> Composed:
    """Engine, profile, argv/env and lint for these GPUs; raises ConfigError(s). Starts nothing but the
    installed-versions probe (serving/compose/installed.py), unless found already has its answer or ask is False;
    reads the model directory's config.json and safetensors headers (bounded), only from the cache when ask is
    False."""
    engine = engine_of(config)
    profile = pick_profile(config, load_profiles(config.serve.profiles_dir), profile_name or config.serve.profile,
                           gpus)
    rules = rules_for(config.serve.rules_dir)
    if config.serve.container is not None and config.serve.nodes is not None:
        raise config.error(("serve", "container"), "an engine in a container serves from one host (not yet with "
                           "serve.nodes)", "leave out serve.nodes, or serve.container")
    role = role_of(config)
    try:
        engine_socket(config.serve, engine)
    except ValueError as exc:
        raise config.error(("serve", "engine_listen"), str(exc), "serve.engine_listen: tcp (or auto)") from None
    try:
        command = build_command(config.serve, profile, gpus, base_env, secrets, home, engine, role)
    except ValueError as exc:  # the engine has no multi-node mode
        raise config.error(("serve", "nodes"), str(exc), "serve.engine: vllm, or no serve.nodes") from None
    if found is None:
        found = installed_for(config, command, ask)
    # The drain flag, where the installed version has it: the last flags, after the user's and the node's.
    drain = plan_drain(engine, config.serve, command.flags, found)
    command = dataclasses.replace(command, argv=(*command.argv, *drain.args), drain=drain)
    model = launch_facts(config.serve.model, command.flags, _engine_env(config, command), read=ask)
    outcomes = tuple(evaluate_lint(LintContext.of(command, config.serve.model, found, model), rules))
    findings = tuple(o.finding for o in outcomes if o.finding is not None)
    own = tuple(f for f in (drain.finding, hold_finding(config.serve, drain.seconds),
                            conflict_finding(config.serve, engine, config.serve.args),
                            fallback_finding(config.serve, engine)) if f is not None)
    return Composed(command, findings + own + tuple(unknown_facts(outcomes)), outcomes, found, rules)


def _engine_env(config: Config, command: ServeCommand) -> dict[str, str]:
    """The environment the engine will see, for where it reads its model: HOME, USER and LOGNAME come at spawn
    (serve.user's), unless the command sets them (a home made for it)."""
    try:
        base = child_identity(config).env()
    except ConfigError:
        base = {}
    return {**base, **command.env}


def installed_for(config: Config, command: ServeCommand, ask: bool = True,
                  spawn: Callable[..., subprocess.Popen] = popen) -> Installed:
    """What the engine's interpreter has installed, asked as serve.user (started with spawn; cached while it is
    unchanged; with ask False, only the cache)."""
    if config.serve.container is not None:
        try:
            identity = child_identity(config)
        except ConfigError as exc:
            return Installed(f"image {config.serve.container.image}", False, error=exc.message)
        return image_installed(config.serve.container, identity.uid, identity.gid, config.serve.python, state_dir(),
                               ask=ask, env=inside_env(command.env))
    python = engine_python(config.serve, command.argv[:command.prefix])
    try:
        identity = child_identity(config)
    except ConfigError as exc:
        return Installed(python or "", False, error=exc.message)
    env = {k: v for k, v in command.env.items() if k in ("PATH", "PYTHONPATH", "HOME", "LANG", "CUDA_HOME")}
    return installed(python, identity, env, state_dir(), ask=ask, spawn=spawn)


def _socket_dir(config: Config, identity: Identity, create: bool) -> None:
    """The engine socket's folder, where it listens on one: made at the daemon's start (create), checked else."""
    try:
        if engine_socket(config.serve, engine_of(config)) is None:
            return
        make_socket_dir(identity, create)
    except ValueError:
        return  # compose says so, at serve.engine_listen
    except OSError as exc:
        raise config.error(("serve", "engine_listen"), f"the engine's socket folder {socket_dir()}: "
                           f"{exc.strerror or exc}", "let serve.user pass the state directory (0755, as systemd makes it), "
                           "restart the daemon where it was made since, or serve.engine_listen: tcp") from None


def prepare_serve(config: Config, backend: GpuBackend, deep: bool, create_home: bool = False,
                  on_loop: bool = False, starting: bool = False) -> PreparedServe:
    """compose() for this host's GPUs as serve.user, with its secrets and home; with deep, the engine's own
    parser too. Raises ConfigError(s) for an unknown engine, profile, GPU, profile file, serve.user or secrets
    file; starts nothing but the installed-versions probe. create_home: make the home the child gets when its
    own cannot be written. on_loop: called from the daemon's main loop (a reload, SIGUSR2's check), which must
    not wait on the engine's interpreter nor on any process run as serve.user: the installed versions come from
    the cache only, and the home is only checked to be there (made at the daemon's start). starting (the daemon's
    start): a container engine's flag check that could not run (a runtime not up yet, an image `pull: true` fetches
    at the start) is said and stops nothing: the shim meets the same, and its backoff and FATAL say it."""
    identity = child_identity(config)
    secrets = child_secrets(config)
    try:
        home, home_note = child_home(identity, create=create_home, on_loop=on_loop)
    except HomeError as exc:
        raise config.error(("serve", "user"), str(exc)) from None
    _socket_dir(config, identity, create_home)
    gpus = chosen_gpus(config, [gpu.sample() for gpu in backend.gpus()])
    composed = compose(config, gpus, secrets=secrets, home=home, ask=not on_loop)
    command = composed.command
    prepared = PreparedServe(command, identity, composed.findings, None, home_note, composed.installed,
                             composed.rules)
    if not deep or command.engine.flag_probe is None or prepared.blocking(config):
        return prepared  # lint already blocks: no need to wait for the engine's import
    found = composed.installed
    if config.serve.container is not None and (found is None or found.version(command.engine.name) is None):
        return prepared  # the image cannot be read, or has no engine: check says so (container_problems), once
    flags = check_flags(config.serve, command, identity)
    if starting and config.serve.container is not None and not flags.ran:
        log.warning("%s: its flags are not checked before the start: %s", command.engine.title, flags.error)
        flags = None
    return PreparedServe(command, identity, composed.findings, flags, home_note, composed.installed, composed.rules)
