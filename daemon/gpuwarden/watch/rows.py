"""Metric rows as data: a family's name, help, type and labels, and a function that gives its samples from the
snapshot. Each signal (watch/signals/) lists its own rows; web/exposition.py walks them and builds the families,
so a new reading's metric is a row in its signal's file, not code in the web wing.

Kept from dcgm-exporter's counters-as-data: the row is the whole contract of a metric (its name, HELP and labels
are public: rules and dashboards use them).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from operator import attrgetter
from typing import Any

GAUGE, COUNTER = "gauge", "counter"
Sample = tuple[tuple[str, ...], float]  # the label values, in the row's label order, and the value


# A row reads the snapshot (monitor.Snapshot) and its GPUs' views (monitor.GpuView); named loosely here, since the
# monitor imports the signals that import this.
Snapshot = GpuView = Any


def _always(_snap: Snapshot) -> bool:
    return True


@dataclass(frozen=True)
class Row:
    name: str  # a counter's without _total (prometheus_client adds it)
    help: str
    labels: tuple[str, ...]
    samples: Callable[[Snapshot], Iterable[Sample]]
    kind: str = GAUGE
    shown: Callable[[Snapshot], bool] = _always  # False: the family is left off the page, HELP and all


def gpu_row(name: str, help: str, value: Callable[[GpuView], float | None] | str, kind: str = GAUGE) -> Row:
    """One value for each GPU that answered the poll; None: this GPU does not report it (no sample). value: a
    function of the GPU's view, or the dotted name of a reading in it ("sample.power_w")."""
    if isinstance(value, str):
        value = attrgetter(value)
    return per_gpu_row(name, help, (), lambda view: (((), v),) if (v := value(view)) is not None else (), kind)


def per_gpu_row(name: str, help: str, labels: tuple[str, ...], each: Callable[[GpuView], Iterable[Sample]],
                kind: str = GAUGE) -> Row:
    """Samples for each GPU that answered the poll: each(view) gives (the label values after gpu, value)."""
    def samples(snap: Snapshot) -> Iterator[Sample]:
        for view in snap.gpus:
            if view.sample.up:
                gpu = str(view.sample.index)
                yield from (((gpu, *more), value) for more, value in each(view))
    return Row(name, help, ("gpu", *labels), samples, kind)


def flag(value: bool | None) -> int | None:
    return None if value is None else int(value)


def hz(mhz: float | None) -> float | None:
    return None if mhz is None else mhz * 1e6
