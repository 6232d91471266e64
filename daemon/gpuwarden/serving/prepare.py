"""From config and GPUs to a checked vLLM command: profile, argv/env, lint, and vLLM's own parser."""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping
from dataclasses import dataclass

from ..config import Config
from ..gpu.base import GpuBackend
from ..yamlfile import ConfigError, ConfigErrors
from .command import ServeCommand, build_command, chosen_gpus, profile_error
from .flagcheck import FlagCheck, check_flags
from .homes import HomeError, child_home
from .identity import Identity, IdentityError, resolve
from .lint import ERROR, Finding, lint
from .profiles import load_profiles, select_profile
from .secrets import SecretFileError, credentials_file, read_env_file


@dataclass(frozen=True)
class PreparedServe:
    command: ServeCommand
    identity: Identity
    findings: tuple[Finding, ...]
    flags: FlagCheck | None  # None when the deep check was not run
    home_note: str | None = None  # why vLLM gets a home under the state directory, when it does

    def blocking(self, config: Config) -> list[ConfigError]:
        """What stops the start: lint errors (unless allowed) and vLLM's parser rejecting the flags."""
        where = ("serve", "args") if config.serve.args else ("serve", "profile")
        problems = []
        if not config.serve.allow_lint_errors:
            problems += [config.error(where, f"lint {f.rule}: {f.message}",
                                      "fix it, or set serve.allow_lint_errors: true")
                         for f in self.findings if f.severity == ERROR]
        if self.flags is not None and not self.flags.ok:
            problems.append(config.error(where, f"vLLM rejects the flags: {self.flags.error}"))
        missing = executable_problem(self.command.argv[0], self.command.env.get("PATH", os.defpath))
        if missing:
            problems.append(config.error(("serve", "command"), missing,
                                         "an absolute path to vLLM's executable or Python"))
        return problems


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
    """serve.user, resolved and checked; ConfigError when it must not run vLLM."""
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


def prepare_serve(config: Config, backend: GpuBackend, deep: bool, create_home: bool = False) -> PreparedServe:
    """Raises ConfigError(s) for an unknown profile, GPU, profile file, serve.user or secrets file; never
    starts anything. create_home: make the home the child gets when its own cannot be written (the daemon)."""
    identity = child_identity(config)
    secrets = child_secrets(config)
    try:
        home, home_note = child_home(identity, create=create_home)
    except HomeError as exc:
        raise config.error(("serve", "user"), str(exc)) from None
    samples = [gpu.sample() for gpu in backend.gpus()]
    gpus = chosen_gpus(config, samples)
    profiles = load_profiles(config.serve.profiles_dir)
    profile = select_profile(profiles, config.serve.profile, gpus)
    if profile is None:
        if config.serve.profile != "auto":
            raise profile_error(config, config.serve.profile, list(profiles))
        raise ConfigErrors([config.error(("serve", "profile"), "no profile matches these GPUs",
                                         "name one, or add one to profiles.d")])
    command = build_command(config.serve, profile, gpus, secrets=secrets, home=home)
    ccs = [g.compute_capability or "" for g in gpus]
    prepared = PreparedServe(command, identity, tuple(lint(command.argv, command.env, profile, ccs,
                                                           config.serve.model)), None, home_note)
    if not deep or prepared.blocking(config):
        return prepared  # lint already blocks: no need to wait for vLLM's import
    flags = check_flags(config.serve, command.flags, identity, command.env)
    findings = lint(command.argv, command.env, profile, ccs, config.serve.model, flags.vllm_version)
    return PreparedServe(command, identity, tuple(findings), flags, home_note)
