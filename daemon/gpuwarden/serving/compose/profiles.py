"""Serving profiles: data (YAML), for one engine, matched to the GPUs by compute capability, count and memory.

Built-in profiles live in serving/compose/profiles/*.yaml; files in profiles.d/ beside
the config override them by name. A profile names its engine (default vllm);
`versions:` lists that engine's known-good and known-bad releases (`vllm:` is
the older name of the same key, still read).
"""

from __future__ import annotations

import fnmatch
import functools
from dataclasses import dataclass
from pathlib import Path

from packaging.specifiers import SpecifierSet

from ...base import yamlfile
from ...gpu.base import GpuSample
from ...base.schema import MISSING, Reader, type_name
from ...base.yamlfile import ConfigError, ConfigErrors, InvalidConfig
from ..lint.findings import read_specifier

BUILTIN_DIR = Path(__file__).resolve().parent / "profiles"
GIB = 1024 ** 3


@dataclass(frozen=True)
class KnownBad:
    version: str  # exact, or a glob such as "0.18.*"
    reason: str


@dataclass(frozen=True)
class Profile:
    name: str
    description: str
    file: str
    engine: str  # serve.engine this profile is for
    compute_capabilities: tuple[str, ...]  # empty: any
    gpu_count: tuple[int, int]
    min_memory_gib: float
    known_good: tuple[str, ...]
    known_bad: tuple[KnownBad, ...]
    args: tuple[str, ...]
    env: tuple[tuple[str, str], ...]
    tuning_hints: tuple[tuple[str, str], ...]
    notes: tuple[tuple[str, str], ...]  # (text, source)
    tested: SpecifierSet | None = None  # the engine releases it was tested on (lint rule profile-untested)

    def matches(self, gpus: list[GpuSample]) -> bool:
        low, high = self.gpu_count
        if not low <= len(gpus) <= high:
            return False
        if self.compute_capabilities and any(g.compute_capability not in self.compute_capabilities for g in gpus):
            return False
        # Memory NVML cannot report (GB10's unified memory) does not disqualify.
        return all(g.memory_total_bytes is None or g.memory_total_bytes >= self.min_memory_gib * GIB for g in gpus)

    def specificity(self) -> int:
        return (2 if self.compute_capabilities else 0) + (1 if self.gpu_count[0] == self.gpu_count[1] else 0)

    def bad_version(self, version: str | None) -> KnownBad | None:
        if version is None:
            return None
        return next((bad for bad in self.known_bad if fnmatch.fnmatchcase(version, bad.version)), None)

    def as_dict(self) -> dict:
        return {"name": self.name, "description": self.description, "file": self.file, "engine": self.engine,
                "match": {"compute_capabilities": list(self.compute_capabilities),
                          "gpu_count": list(self.gpu_count), "min_memory_gib": self.min_memory_gib},
                "versions": {"tested": str(self.tested) if self.tested is not None else None,
                             "known_good": list(self.known_good),
                         "known_bad": [{"version": b.version, "reason": b.reason} for b in self.known_bad]},
                "args": list(self.args), "env": dict(self.env), "tuning_hints": dict(self.tuning_hints),
                "notes": [{"text": t, "source": s} for t, s in self.notes]}


def load_profile(file: Path, budget: yamlfile.DirBudget | None = None) -> Profile:
    doc = budget.load(file) if budget is not None else yamlfile.load(file)
    if not isinstance(doc.value, dict):
        raise ConfigError(doc.file, 1, "(top level)", f"expected a profile mapping, got {type_name(doc.value)}")
    r = Reader(doc)
    r.mapping((), ("name", "description", "engine", "match", "versions", "vllm", "args", "env", "tuning_hints",
                   "notes"), required=("name",))
    r.mapping(("match",), ("compute_capabilities", "gpu_count", "min_memory_gib"))
    versions = "vllm" if r.get(("vllm",)) is not MISSING else "versions"
    if versions == "vllm" and r.get(("versions",)) is not MISSING:
        r.fail(("vllm",), "both vllm: and versions: are set", "versions: only (vllm: is its older name)")
    r.mapping((versions,), ("tested", "known_good", "known_bad"))
    tested = read_specifier(r, (versions, "tested")) if r.get((versions, "tested")) is not MISSING else None
    count = r.get(("match", "gpu_count"))
    if count is MISSING:
        count = [1, 64]
    if not (isinstance(count, list) and len(count) == 2 and all(isinstance(c, int) and c > 0 for c in count)
            and count[0] <= count[1]):
        r.fail(("match", "gpu_count"), f"expected [MIN, MAX] GPU counts, got {count!r}")
        count = [1, 64]
    known_bad = []
    for i, _ in enumerate(r.sequence((versions, "known_bad"))):
        path = (versions, "known_bad", str(i))
        r.mapping(path, ("version", "reason"), required=("version", "reason"))
        known_bad.append(KnownBad(str(r.string(path + ("version",), "")), r.string(path + ("reason",), "")))
    notes = []
    for i, _ in enumerate(r.sequence(("notes",))):
        path = ("notes", str(i))
        r.mapping(path, ("text", "source"), required=("text", "source"))
        notes.append((r.string(path + ("text",), ""), r.string(path + ("source",), "")))
    profile = Profile(
        name=r.string(("name",), file.stem),
        description=r.string(("description",), ""),
        file=str(file),
        engine=r.string(("engine",), "vllm"),
        compute_capabilities=tuple(_strings(r, ("match", "compute_capabilities"))),
        gpu_count=(count[0], count[1]),
        min_memory_gib=float(r.number(("match", "min_memory_gib"), 0, 0, 100_000, unit=" GiB")),
        known_good=tuple(_strings(r, (versions, "known_good"))),
        known_bad=tuple(known_bad),
        args=tuple(_strings(r, ("args",))),
        env=tuple(_string_map(r, ("env",)).items()),
        tuning_hints=tuple(_string_map(r, ("tuning_hints",)).items()),
        notes=tuple(notes),
        tested=tested,
    )
    r.raise_if_errors()
    return profile


def _strings(r: Reader, path: tuple[str, ...]) -> list[str]:
    items = r.sequence(path)
    for i, item in enumerate(items):
        if not isinstance(item, str):
            r.fail(path + (str(i),), f"expected a string, got {type_name(item)} {item!r}", 'quote numbers: "8"')
    return [str(item) for item in items]


def _string_map(r: Reader, path: tuple[str, ...]) -> dict[str, str]:
    mapping = r.mapping(path, None)
    for key, value in mapping.items():
        if not isinstance(value, str):
            r.fail(path + (key,), f"expected a string, got {type_name(value)} {value!r}", 'quote values: "1"')
    return {k: str(v) for k, v in mapping.items()}


@functools.cache
def _builtin(file: Path) -> Profile:
    """A shipped profile, parsed once per process (a Profile is frozen; `profiles show` and compose() each ask)."""
    return load_profile(file)


def load_profiles(user_dir: Path | None) -> dict[str, Profile]:
    """Built-in profiles, then user profiles overriding them by name. Raises ConfigErrors."""
    files = sorted(BUILTIN_DIR.glob("*.yaml"))
    budget = yamlfile.DirBudget(user_dir, "profile") if user_dir is not None and user_dir.is_dir() else None
    files += budget.files() if budget is not None else []
    profiles: dict[str, Profile] = {}
    problems: list[ConfigError] = []
    for file in files:
        try:
            profile = _builtin(file) if file.parent == BUILTIN_DIR else load_profile(file, budget)
        except InvalidConfig as exc:
            problems.extend(exc.errors)
            continue
        profiles[profile.name] = profile
    if problems:
        raise ConfigErrors(problems)
    return profiles


def select_profile(profiles: dict[str, Profile], wanted: str, gpus: list[GpuSample],
                   engine: str = "vllm") -> Profile | None:
    """The named profile, or for "auto" the most specific one of engine's matching the GPUs (None if none)."""
    if wanted != "auto":
        return profiles.get(wanted)
    matching = [p for p in profiles.values() if p.engine == engine and p.matches(gpus)]
    return max(matching, key=lambda p: (p.specificity(), "generic" not in p.name), default=None)
