"""The checks every engine shares. The rules themselves are data (serving/lint/rules/builtin.yaml,
serving/lint/rules.py). A rule that cannot be said as data names a check: a function of the LintContext that returns
the values its message needs, or None when it does not fire. Engines register their own (Engine.checks); the ones here
apply to any engine.
"""

from __future__ import annotations

import re
from typing import Any

from ...gpu.base import OFF_PCIE, PEER_PATHS
from ...gpu.iommu import iommu_state
from . import facts as F
from .findings import version_in


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
