"""What the config wants tuned: the `tuning:` section (a value for every setting of the table, per-GPU overrides),
read here so that the tuning needs nothing of the config module, and what the tuning reads of a whole config."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Protocol

from ..base.schema import Reader, type_name
from ..base.yamlfile import ConfigError, Path_
from . import tunables

UUID_RE = re.compile(r"^(GPU|MIG)-[0-9A-Za-z-]+$")
MAX_BUDGET_W = 100_000  # 16 cards of 1,200 W and room to spare
MAX_SHARE = 1_000


@dataclass(frozen=True)
class GpuTuning:
    """What to set on one GPU: a wanted value for every setting of tunables.TUNABLES, by key
    (tuning.gpu_clocks reads as an attribute)."""

    wanted: tuple[tuple[str, Any], ...] = field(
        default_factory=lambda: tuple((t.key, t.default) for t in tunables.TUNABLES))

    def __getattr__(self, key: str) -> Any:
        for name, value in object.__getattribute__(self, "wanted"):
            if name == key:
                return value
        raise AttributeError(key)

    def updated(self, changes: dict[str, Any]) -> GpuTuning:
        return GpuTuning(tuple((key, changes.get(key, value)) for key, value in self.wanted))


@dataclass(frozen=True)
class TuningConfig:
    apply: bool = True
    restore_on_stop: bool = False
    default: GpuTuning = field(default_factory=GpuTuning)
    # Per-GPU partial overrides, keyed by index ("0") or UUID, as (key, ((setting, value), ...)).
    overrides: tuple[tuple[str, tuple[tuple[str, Any], ...]], ...] = ()
    # The most the GPUs together may draw (tune/budget.py splits it by demand); None: no budget.
    power_budget_w: float | None = None
    # Each GPU's weight in the split, keyed as overrides are; a GPU not named weighs 1.
    power_shares: tuple[tuple[str, float], ...] = ()

    def power_share(self, index: int, uuid: str) -> float:
        by_key = dict(self.power_shares)
        return by_key.get(uuid, by_key.get(str(index), 1.0))

    def for_gpu(self, index: int, uuid: str) -> GpuTuning:
        by_key = dict(self.overrides)
        tuning = self.default
        for key in (str(index), uuid):  # a UUID is more specific, so it wins
            if key in by_key:
                tuning = tuning.updated(dict(by_key[key]))
        return tuning

    def override_source(self, index: int, uuid: str, setting: str) -> Path_:
        """The config key path a GPU's effective setting came from."""
        by_key = dict(self.overrides)
        for key in (uuid, str(index)):
            if key in by_key and setting in dict(by_key[key]):
                return ("tuning", "gpus", key, setting)
        return ("tuning", setting)


class Configured(Protocol):
    """What the tuning reads of a config (config.Config is one): the tuning section, how soon a drifted setting
    may be set again, and an error pointing at the line that set a key."""

    @property
    def tuning(self) -> TuningConfig: ...

    @property
    def reapply_min_interval_s(self) -> float: ...

    def error(self, path: Path_, message: str, allowed: str | None = None) -> ConfigError: ...


def parse_tuning(r: Reader) -> TuningConfig:
    """The `tuning:` section: apply, restore_on_stop, a value for each setting of the table, per-GPU overrides."""
    base = ("tuning",)
    d = TuningConfig()
    r.mapping(base, ("apply", "restore_on_stop", "gpus", "power_budget_w", "power_shares") + tunables.keys())
    default = GpuTuning(tuple((t.key, t.parse(r, base + (t.key,), t.default)) for t in tunables.TUNABLES))
    overrides = []
    for key, value in r.mapping(base + ("gpus",), None).items():
        path = base + ("gpus", key)
        if not (gpu_index(key) or UUID_RE.match(key)):
            r.fail(path, "not a GPU index or UUID", "an index such as \"0\" or a UUID such as GPU-5c1e...")
            continue
        if not isinstance(value, dict):
            r.fail(path, f"expected a mapping of per-GPU settings, got {type_name(value)}",
                   "keys: " + ", ".join(tunables.keys()))
            continue
        r.mapping(path, tunables.keys())
        overrides.append((key, tuple((t.key, t.parse(r, path + (t.key,), t.default))
                                     for t in tunables.TUNABLES if t.key in value)))
    budget = r.optional_number(base + ("power_budget_w",), None, 1, MAX_BUDGET_W, unit=" W")
    if budget is not None and default.power_limit_w is not None:
        # Both would set the limits, and each would undo the other's on every move.
        r.fail(base + ("power_limit_w",), "cannot be set with tuning.power_budget_w: the budget sets the limits",
               "none, or remove tuning.power_budget_w")
    for key, settings in overrides:
        if budget is not None and "power_limit_w" in dict(settings):
            r.fail(base + ("gpus", key, "power_limit_w"), "cannot be set with tuning.power_budget_w: the budget "
                   "sets the limits", "remove it, or weigh the GPU with tuning.power_shares")
    return TuningConfig(
        power_budget_w=budget, power_shares=_power_shares(r, base + ("power_shares",)),
        apply=r.boolean(base + ("apply",), d.apply),
        restore_on_stop=r.boolean(base + ("restore_on_stop",), d.restore_on_stop),
        default=default,
        overrides=tuple(overrides),
    )


def gpu_index(key: str) -> bool:
    """An index as str(index) spells it: "٠" (an Arabic-Indic zero) and "00" passed isdigit() and matched no GPU."""
    return key.isascii() and key.isdigit() and str(int(key)) == key


def _power_shares(r: Reader, path: Path_) -> tuple[tuple[str, float], ...]:
    """tuning.power_shares: GPU index or UUID -> its weight in the budget's split (a number above 0)."""
    shares = []
    for key in r.mapping(path, None):
        if not (gpu_index(key) or UUID_RE.match(key)):
            r.fail(path + (key,), "not a GPU index or UUID", "an index such as \"0\" or a UUID such as GPU-5c1e...")
            continue
        weight = r.number(path + (key,), None, 0.01, MAX_SHARE)
        if weight is not None:
            shares.append((key, float(weight)))
    return tuple(shares)
