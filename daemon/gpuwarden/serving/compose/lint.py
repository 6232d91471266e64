"""What a lint finding is, and the checks every engine shares.

The rules themselves are data (serving/compose/rules/builtin.yaml, serving/compose/rules.py). A rule that cannot be said
as data names a check: a function of the LintContext that returns the values its message needs, or None
when it does not fire. Engines register their own (Engine.checks); the ones here apply to any engine.
Errors block the start unless serve.allow_lint_errors is true; warnings are logged.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import InvalidVersion, Version

from ...gpu.iommu import iommu_state
from ...schema import Reader

ERROR, WARNING = "error", "warning"


@dataclass(frozen=True)
class LintFinding:
    severity: str
    rule: str
    message: str
    source: str
    fix: str = ""

    def __str__(self) -> str:
        fix = f"; fix: {self.fix}" if self.fix else ""
        return f"{self.severity}: {self.rule}: {self.message}{fix} [source: {self.source}]"

    def as_dict(self) -> dict:
        return {"severity": self.severity, "rule": self.rule, "message": self.message, "fix": self.fix,
                "source": self.source}


def version_in(spec: SpecifierSet, version: str) -> bool:
    """Whether version is in spec, pre-releases and local builds (0.32.0+cpu) included; False if unparsable."""
    try:
        return spec.contains(Version(version), prereleases=True)
    except InvalidVersion:
        return False


def read_specifier(r: Reader, path: tuple[str, ...]) -> SpecifierSet | None:
    """A PEP 440 specifier from a rules or profile file; None, with a FILE:LINE error collected, if it is not one."""
    value = r.get(path)
    try:
        return SpecifierSet(str(value))
    except InvalidSpecifier:
        r.fail(path, f"{value!r} is not a PEP 440 version specifier", 'e.g. ">=0.21,<0.23" or "==0.24.*"')
        return None


def model_billions(model: str) -> float | None:
    match = re.search(r"(\d+(?:\.\d+)?)[bB](?![a-zA-Z])", model.rsplit("/", 1)[-1])
    return float(match.group(1)) if match else None


# -- checks for any engine (ctx: rules.LintContext) --------------------------------------------------------

def known_bad(ctx: Any) -> dict | None:
    """The profile's known-bad list against the installed engine."""
    version = ctx.installed.version(ctx.engine.name) if ctx.installed.known else None
    bad = ctx.profile.bad_version(version)
    if bad is None:
        return None
    notes = ctx.profile.notes
    return {"title": ctx.engine.title, "version": version, "profile": ctx.profile.name, "reason": bad.reason,
            "good": ", ".join(ctx.profile.known_good) or "none listed",
            "source": notes[0][1] if notes else ctx.profile.file}


def profile_untested(ctx: Any) -> dict | None:
    """The installed engine outside the range the profile states it was tested on."""
    tested = ctx.profile.tested
    version = ctx.installed.version(ctx.engine.name) if ctx.installed.known else None
    if tested is None or version is None or version_in(tested, version):
        return None
    return {"profile": ctx.profile.name, "title": ctx.engine.title, "tested": str(tested), "version": version}


def iommu_translating(ctx: Any) -> dict | None:
    return {"tp": ctx.tp_size} if iommu_state() == "translating" else None


CHECKS = {"known_bad": known_bad, "profile_untested": profile_untested, "iommu_translating": iommu_translating}
