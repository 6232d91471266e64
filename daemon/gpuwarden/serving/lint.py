"""What a lint finding is, and the helpers the engines' rules share.

Each engine keeps its own rules (Engine.lint, from what SM120/SM121 users
reported); engines.lint() runs them with the rules every engine shares. Errors
block the start unless serve.allow_lint_errors is true; warnings are logged.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

ERROR, WARNING = "error", "warning"


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
