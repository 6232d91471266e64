"""What a lint finding is: its severity, rule, message, source and fix, and the facts it matched on. Errors block
the start unless serve.allow_lint_errors is true; warnings are logged; info says what the lint could not judge
(unknown_facts), and never blocks nor warns.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import InvalidVersion, Version

from ...base.schema import Reader

ERROR, WARNING, INFO = "error", "warning", "info"


@dataclass(frozen=True)
class LintFinding:
    severity: str
    rule: str
    message: str
    source: str
    fix: str = ""
    link: str = ""  # where the source can be read
    facts: tuple[str, ...] = ()  # what it matched on, in words: "driver 580.95.05 supports CUDA 13.0"
    traps: tuple[str, ...] = ()  # the community registry's trap ids (model-serving-minefield)

    def __str__(self) -> str:
        fix = f"; fix: {self.fix}" if self.fix else ""
        link = f" {self.link}" if self.link else ""
        facts = f" (matched: {'; '.join(self.facts)})" if self.facts else ""
        return f"{self.severity}: {self.rule}: {self.message}{fix} [source: {self.source}{link}]{facts}"

    def as_dict(self) -> dict:
        return {"severity": self.severity, "rule": self.rule, "message": self.message, "fix": self.fix,
                "source": self.source, "link": self.link, "facts": list(self.facts), "traps": list(self.traps)}


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


# Where an unknown fact's finding says how to make it known, by what the fact is (facts.Unknown's words).
UNKNOWN_FIXES = (
    ("the model's", "give serve.model as the model's folder, or have the id in the serving user's Hugging Face "
                    "cache (the engine's first start downloads it; check again after)"),
    ("the parameter count", "a model folder with its *.safetensors files"),
    ("the engine's", "an engine interpreter that answers (serve.python), as serve.user"),
    ("the driver", "check on the GPU host"), ("the CUDA", "check on the GPU host"),
    ("the GPUs'", "check on the GPU host"),
)


def unknown_facts(outcomes: Sequence[Any]) -> list[LintFinding]:
    """One finding at info level per fact that rules were skipped for, naming the fact, where it was looked for,
    and the rules: a launch whose rules could not all be judged is never shown as clean."""
    skipped: dict[str, list[str]] = {}
    for outcome in outcomes:
        if outcome.status == "skipped" and outcome.unknown:
            skipped.setdefault(outcome.unknown, []).append(outcome.rule.id)
    out = []
    for fact, rules in skipped.items():
        shown = ", ".join(rules[:8]) + (f" and {len(rules) - 8} more" if len(rules) > 8 else "")
        fix = next((text for start, text in UNKNOWN_FIXES if fact.startswith(start)), "")
        out.append(LintFinding(INFO, "fact-unknown", f"{len(rules)} rule(s) not judged ({shown}), for want of {fact}",
                               "gpuwarden's lint", fix))
    return out


