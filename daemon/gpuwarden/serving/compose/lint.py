"""What a lint finding is, and the checks every engine shares.

The rules themselves are data (serving/compose/rules/builtin.yaml, serving/compose/rules.py). A rule that cannot be said
as data names a check: a function of the LintContext that returns the values its message needs, or None
when it does not fire. Engines register their own (Engine.checks); the ones here apply to any engine.
Errors block the start unless serve.allow_lint_errors is true; warnings are logged.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from collections.abc import Sequence
from typing import Any

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import InvalidVersion, Version

from ...gpu.base import OFF_PCIE, PEER_PATHS
from ...gpu.iommu import iommu_state
from ...base.schema import Reader
from . import facts as F

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


def model_billions(model: str) -> float | None:
    match = re.search(r"(\d+(?:\.\d+)?)[bB](?![a-zA-Z])", model.rsplit("/", 1)[-1])
    return float(match.group(1)) if match else None


def model_size(ctx: Any) -> tuple[float | None, str]:
    """(billions of parameters, from where): the safetensors headers of a local model, else the name's "27B"."""
    mf = ctx.model_facts
    if mf.known and mf.params_b is not None:
        return mf.params_b, f"{mf.params_b:.1f}B parameters ({mf.params_note})"
    size = model_billions(ctx.model)
    return size, (f"{size:g}B by its name" if size is not None else "size unknown")


# Where an unknown fact's finding says how to make it known, by what the fact is (facts.Unknown's words).
UNKNOWN_FIXES = (
    ("the model's", "give serve.model as the model's folder, or have the id in the serving user's Hugging Face "
                    "cache (the engine's first start downloads it; check again after)"),
    ("the parameter count", "a model folder with its *.safetensors files"),
    ("the engine's", "an engine interpreter that answers (serve.python), as serve.user"),
    ("the driver", "check on the GPU host"), ("the CUDA", "check on the GPU host"), ("the GPUs'", "check on the GPU host"),
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
    """The IOMMU translates DMA and some pair of the engine's GPUs talks over PCIe (or a path NVML could not
    say): NVLink, NVSwitch and C2C traffic never crosses the IOMMU, and the advice (P2P off, custom all-reduce
    off) would take NVLink away from the engine."""
    iommu = ctx.iommu if ctx.iommu is not None else iommu_state()
    if iommu != "translating":
        return None
    crossing = [(a, b, kind) for a, b, kind in ctx.peer_paths if kind not in OFF_PCIE]
    if ctx.peer_paths and not crossing:
        return None
    paths = [f"GPU{a}-GPU{b} over {PEER_PATHS.get(kind, 'a path NVML did not say')}" for a, b, kind in crossing]
    more = [f"{len(paths) - 3} more pairs"] if len(paths) > 3 else []
    return {"tp": ctx.tp_size, "facts": ["the IOMMU translates DMA", *paths[:3], *more]}


def cuda_beyond_driver(ctx: Any) -> dict | None:
    """The CUDA torch was built for, or a toolkit in the engine's environment, newer than the driver runs.
    ctx.fact raises facts.Unknown (the rule is skipped) where the driver or the installed versions are unknown."""
    driver_cuda, driver_text = ctx.fact("host.driver_cuda")
    newest = F.cuda_tuple(driver_cuda)
    worst = None
    for name in ("engine.torch_cuda", "engine.cuda_toolkit"):
        value, text = ctx.fact(name)
        built = F.cuda_tuple(value)
        if built and newest and built > newest and (worst is None or built > worst[0]):
            worst = (built, value, text)
    if worst is None:
        return None
    built, value, text = worst
    return {"built": f"{built[0]}.{built[1]}", "driver_cuda": driver_cuda, "driver": ctx.driver,
            "what": text, "facts": [driver_text, text]}


def cuda_major_beyond_driver(ctx: Any) -> dict | None:
    """As cuda_beyond_driver, for a newer major version: CUDA's minor-version compatibility does not cover it."""
    found = cuda_beyond_driver(ctx)
    if found is None or found["built"].split(".")[0] == found["driver_cuda"].split(".")[0]:
        return None
    return found


def cuda_minor_beyond_driver(ctx: Any) -> dict | None:
    found = cuda_beyond_driver(ctx)
    if found is None or found["built"].split(".")[0] != found["driver_cuda"].split(".")[0]:
        return None
    return found


def sliding_window_resolves_full(ctx: Any) -> dict | None:
    """A Qwen2/Qwen3-style config that declares a sliding window its own gates then turn off: use_sliding_window
    absent (it defaults to false), or max_window_layers at or past the last layer (minefield trap 143)."""
    ctx.fact("model.sliding_window")  # facts.Unknown without a readable config.json: skipped, said why
    mf = ctx.model_facts
    window, kind = mf.sliding_window, mf.model_type or ""
    if not window or not kind.startswith(("qwen2", "qwen3")) or mf.use_sliding_window is False:
        return None  # an explicit false is a decision, not a slip (Qwen2.5 ships it so)
    if mf.layer_types is not None:
        if any("sliding" in t for t in mf.layer_types):
            return None
        why = "layer_types lists no sliding_attention layer"
    elif mf.use_sliding_window is None:
        why = "use_sliding_window is not set, and it defaults to false"
    else:
        first = mf.max_window_layers if mf.max_window_layers is not None else 28  # transformers' default
        if mf.num_hidden_layers is None or first < mf.num_hidden_layers:
            return None
        why = f"max_window_layers {first} is at or past the last of {mf.num_hidden_layers} layers"
    return {"window": window, "why": why, "facts": [f"config.json {kind} sliding_window {window}", why]}


CHECKS = {"known_bad": known_bad, "profile_untested": profile_untested, "iommu_translating": iommu_translating,
          "cuda_major_beyond_driver": cuda_major_beyond_driver, "cuda_minor_beyond_driver": cuda_minor_beyond_driver,
          "sliding_window_resolves_full": sliding_window_resolves_full}
