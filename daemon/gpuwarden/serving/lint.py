"""Lint the final command and environment: what every engine shares, and the entry point.

Each engine keeps its own rules (Engine.lint, from what SM120/SM121 users
reported); here are the finding type, the rules that hold for any engine, and
the profile's known-bad versions. Errors block the start unless
serve.allow_lint_errors is true; warnings are logged.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .flags import has_flag
from .profiles import Profile

if TYPE_CHECKING:
    from .engines import Engine

ERROR, WARNING = "error", "warning"
PS_SOURCE = "ps(1) shows every process's full command line to every local user"


@dataclass(frozen=True)
class LintFinding:
    severity: str
    rule: str
    message: str
    source: str

    def __str__(self) -> str:
        return f"{self.severity}: {self.rule}: {self.message} [source: {self.source}]"

    def as_dict(self) -> dict:
        return {"severity": self.severity, "rule": self.rule, "message": self.message, "source": self.source}


def sm12x(compute_capabilities: Sequence[str]) -> bool:
    return any(cc.startswith("12.") for cc in compute_capabilities)


def model_billions(model: str) -> float | None:
    match = re.search(r"(\d+(?:\.\d+)?)[bB](?![a-zA-Z])", model.rsplit("/", 1)[-1])
    return float(match.group(1)) if match else None


def lint(argv: Sequence[str], env: Mapping[str, str], profile: Profile, compute_capabilities: Sequence[str],
         model: str, version: str | None = None, engine: Engine | None = None) -> list[LintFinding]:
    """The engine's rules, then the shared ones; with the engine's version, its known-bad check too."""
    if engine is None:
        from .engines import engine_for

        engine = engine_for(profile.engine)
    found = engine.lint(argv, env, profile, compute_capabilities, model)
    found += version_findings(profile, version, engine.title)
    if has_flag(argv, "--api-key") and engine.api_key_env:
        found.append(LintFinding(ERROR, "api-key-on-command-line", "--api-key on the command line shows in ps; put "
                                 f"{engine.api_key_env}=... in /etc/gpuwarden/credentials/vllm.env (root-only) "
                                 "instead", PS_SOURCE))
    elif has_flag(argv, "--api-key"):  # the engine reads its key from nowhere else: say what it costs
        found.append(LintFinding(WARNING, "api-key-on-command-line", f"--api-key on the command line shows in ps, "
                                 f"and {engine.title} reads it from no environment variable; keep serve.host on "
                                 "localhost so that the key is not all that guards it", PS_SOURCE))
    return found


def version_findings(profile: Profile, version: str | None, title: str) -> list[LintFinding]:
    """The profile's known-bad list against the installed version (known once the flag check ran)."""
    bad = profile.bad_version(version)
    if bad is None:
        return []
    return [LintFinding(ERROR, f"{profile.engine}-known-bad", f"{title} {version} is on profile {profile.name}'s "
                        f"known-bad list: {bad.reason}", profile.notes[0][1] if profile.notes else profile.file)]
