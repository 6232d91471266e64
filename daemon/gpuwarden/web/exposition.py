"""The /metrics body from the latest snapshot (the /status JSON is the snapshot's own; web/server.py serves both).
The metrics themselves are rows of data, each in its signal's file (watch/signals/); this walks them.

Following client_python's guidance for exporters: our own CollectorRegistry and
a collector that builds fresh metric families on each scrape, in base units. A
scrape only reads the snapshot; it never calls NVML.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from .. import __version__
from ..watch import alerts
from ..watch.monitor import Snapshot
from ..watch.rows import GAUGE, Row
from ..watch.signals import SERVING_ROWS

log = logging.getLogger("gpuwarden")


class SnapshotCollector:
    def __init__(self, snapshot: Callable[[], Snapshot | None]):
        self.snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        build = GaugeMetricFamily("gpuwarden_build_info", "gpuwarden version", labels=["version"])
        build.add_metric([__version__], 1)
        yield build
        snap = self.snapshot()
        if snap is None:  # before the first tick
            return
        yield from _rows(snap.rows + alerts.ROWS, snap)  # the GPU signals' rows, as the monitor read them
        yield from _rows(SERVING_ROWS, snap)
        yield GaugeMetricFamily("gpuwarden_sample_duration_seconds",
                                "Time the last poll took to sample every GPU", value=snap.sample_duration_s)
        yield GaugeMetricFamily("gpuwarden_loop_lag_seconds",
                                "How late the last poll started against its schedule", value=snap.loop_lag_s)
        yield GaugeMetricFamily("gpuwarden_last_sample_timestamp_seconds",
                                "Unix time of the last poll", value=snap.taken_at)


def _family(row: Row, snap: Snapshot) -> Metric:
    kind = GaugeMetricFamily if row.kind == GAUGE else CounterMetricFamily
    family = kind(row.name, row.help, labels=list(row.labels))
    for labels, value in row.samples(snap):
        family.add_metric(list(labels), value)
    return family


def _rows(rows: tuple[Row, ...], snap: Snapshot) -> Iterator[Metric]:
    """Each row's family, in the rows' order; a row not shown is left off, HELP and all."""
    return (_family(row, snap) for row in rows if row.shown(snap))


def make_registry(snapshot: Callable[[], Snapshot | None]) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SnapshotCollector(snapshot))
    return registry


class Exposition:
    """The /metrics body, rendered once per published snapshot on its own thread, served as cached bytes.

    A scrape then costs a copy, not a render (about 30 ms for 64 GPUs on two cores), and the main
    loop never renders either. The snapshot's age is the one live line, appended per scrape, so a
    frozen daemon shows as a growing age instead of as fresh-looking numbers.
    """

    def __init__(self, snapshot: Callable[[], Snapshot | None], clock: Callable[[], float]):
        self.snapshot = snapshot
        self.clock = clock
        self.registry = make_registry(snapshot)
        self._rendered: tuple[Snapshot | None, bytes] = (None, generate_latest(self.registry))
        self._wake = threading.Event()
        self._closed = False
        self._last_error = ""
        self._thread = threading.Thread(target=self._render_loop, name="metrics-render", daemon=True)
        self._thread.start()

    def published(self) -> None:
        """Called by the loop after each snapshot; the render happens on the render thread."""
        self._wake.set()

    def _render_loop(self) -> None:
        while not self._closed:
            self._wake.wait()
            self._wake.clear()
            snap = self.snapshot()
            if snap is not self._rendered[0]:
                try:
                    self._rendered = (snap, generate_latest(self.registry))
                except Exception as exc:  # keep serving the last good body; say why once per new error
                    error = f"{type(exc).__name__}: {exc}"
                    if error != self._last_error:
                        self._last_error = error
                        log.error("metrics: rendering failed, serving the previous poll: %s", error)

    def body(self) -> bytes:
        snap, rendered = self._rendered
        if snap is None:
            return rendered
        age = max(0.0, self.clock() - snap.published_at)
        return rendered + (b"# HELP gpuwarden_snapshot_age_seconds Seconds since the daemon last published a "
                           b"poll; grows when the main loop is stuck\n# TYPE gpuwarden_snapshot_age_seconds gauge\n"
                           b"gpuwarden_snapshot_age_seconds %.3f\n" % age)

    def close(self) -> None:
        self._closed = True
        self._wake.set()
