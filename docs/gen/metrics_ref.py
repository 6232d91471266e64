"""docs/reference/metrics.md from the exporter's own code: the rows each signal declares (watch/signals/, grouped
by signal, introduced by its docstring), the alert rows (watch/alerts.py), the families web/exposition.py adds
itself (read from what it renders, so they need no list here), and the proxy's own /metrics (proxy/server.py,
rendered the same way).

    PYTHONPATH=daemon .venv/bin/python docs/gen/metrics_ref.py     # writes the page

tests/test_ref_metrics_alerts.py checks the committed page against this and against a real /metrics body.
"""

from __future__ import annotations

import inspect
import sys
import time
from dataclasses import dataclass
from pathlib import Path

PAGE = Path("docs") / "reference" / "metrics.md"


@dataclass(frozen=True)
class Entry:
    name: str  # as scraped: a counter's with _total
    kind: str  # gauge, counter, histogram
    labels: tuple[str, ...]
    help: str


def exposed_name(family: str, kind: str) -> str:
    """The name a query uses: prometheus_client writes a counter family's samples with _total."""
    return family + "_total" if kind == "counter" and not family.endswith("_total") else family


def _row_entry(row) -> Entry:
    return Entry(exposed_name(row.name, row.kind), row.kind, tuple(row.labels), row.help)


def _parsed(body: str) -> list[Entry]:
    """Each family of a rendered /metrics body, but the _created gauges prometheus_client adds beside its own
    counters and histograms; labels from its samples (a histogram's le is its buckets')."""
    from prometheus_client.parser import text_string_to_metric_families

    families = list(text_string_to_metric_families(body))
    kinds = {family.name: family.type for family in families}
    out = []
    for family in families:
        if family.name.endswith("_created") and kinds.get(family.name.removesuffix("_created")) in ("counter",
                                                                                                   "histogram"):
            continue  # prometheus_client's creation time beside a counter or histogram: said once, in the page
        labels: list[str] = []
        for sample in family.samples:
            labels += [k for k in sample.labels if k not in labels and k != "le"]
        out.append(Entry(exposed_name(family.name, family.type), family.type, tuple(labels), family.documentation))
    return out


def _empty_snapshot():
    from gpuwarden.watch.monitor import Snapshot

    return Snapshot(taken_at=0.0, monotonic=0.0, gpus=(), alerts=())


def exposition_own(row_names: set[str]) -> list[Entry]:
    """What web/exposition.py adds beside the rows, as it renders them: the body of a snapshot with no GPU, and
    the per-scrape line of the snapshot's age, which comes only once a snapshot was rendered."""
    from gpuwarden.web.exposition import Exposition

    snapshot = _empty_snapshot()
    exposition = Exposition(lambda: snapshot, clock=lambda: 0.0)
    try:
        exposition.published()
        deadline = time.monotonic() + 10
        while b"gpuwarden_snapshot_age_seconds" not in (body := exposition.body()):
            if time.monotonic() > deadline:
                raise RuntimeError("the exposition rendered no snapshot age within 10 s")
            time.sleep(0.01)
    finally:
        exposition.close()
    return [entry for entry in _parsed(body.decode()) if entry.name not in row_names]


def proxy_body() -> str:
    """The proxy's /metrics as its code renders it (Proxy.own_metrics), with every family it can show: the
    connection gauges (a proxy with its listener's Connections) and the engine's prefix-cache counters (vLLM's
    names, as last read)."""
    from gpuwarden.proxy.faults import proxy_faults
    from gpuwarden.proxy.listener import Connections
    from gpuwarden.proxy.normalize import Rules
    from gpuwarden.proxy.server import Proxy, ProxyMetrics
    from gpuwarden.serving.compose.engines import engine_for
    from prometheus_client import generate_latest

    names = engine_for("vllm").metric_names
    metrics = ProxyMetrics((names.prefix_cache_queries, names.prefix_cache_hits))
    Proxy("http://127.0.0.1:1", Rules(), metrics, conns=Connections(1, 1.0, proxy_faults()))
    metrics.engine = {names.prefix_cache_queries: 0.0, names.prefix_cache_hits: 0.0}
    return generate_latest(metrics.registry).decode()


def proxy_entries() -> list[Entry]:
    """The proxy's families; a labelled counter shows no sample before its first count, so its label names come
    from the collector (prometheus_client keeps them in _labelnames)."""
    from gpuwarden.proxy.server import ProxyMetrics
    from prometheus_client.metrics import MetricWrapperBase

    declared = {}
    metrics = ProxyMetrics((None, None))
    for value in vars(metrics).values():
        if isinstance(value, MetricWrapperBase):
            declared[value._name] = tuple(value._labelnames)
    out = []
    for entry in _parsed(proxy_body()):
        family = entry.name.removesuffix("_total") if entry.kind == "counter" else entry.name
        labels = entry.labels or declared.get(family, ())
        out.append(Entry(entry.name, entry.kind, labels, entry.help))
    return out


def _intro(module) -> str:
    return " ".join(inspect.getdoc(module).split())


def sections() -> list[tuple[str, str, list[Entry]]]:
    """(heading, introduction, entries), in the order of /metrics."""
    from gpuwarden.watch import alerts, signals
    from gpuwarden.watch.signals import serving

    out = []
    for signal in signals.SIGNALS + ((serving,) if serving not in signals.SIGNALS else ()):
        if signal is serving:  # /metrics has the alerts' rows between the GPUs' and the engine's
            out.append(("Alerts", "From `watch/alerts.py`: every daemon alert's state; a host-wide alert carries "
                        "`gpu=\"all\"`. What each alert means: [the alerts reference](alerts.md).",
                        [_row_entry(row) for row in alerts.ROWS]))
        short = signal.__name__.rsplit(".", 1)[1]
        out.append((f"`{short}`", f"From `watch/signals/{short}.py`: {_intro(signal)}",
                    [_row_entry(row) for row in signal.ROWS]))
    row_names = {entry.name for _, _, entries in out for entry in entries}
    out.append(("The daemon itself", "What `web/exposition.py` adds: the build, the last poll's timing, and the "
                "snapshot's age, which each scrape computes anew (a frozen daemon shows as a growing age).",
                exposition_own(row_names)))
    return out


def _entry_line(entry: Entry) -> str:
    labels = ", ".join(f"`{label}`" for label in entry.labels) if entry.labels else "no labels"
    help_ = entry.help.rstrip(".")
    more = " (series `_bucket`, `_sum`, `_count`)" if entry.kind == "histogram" else ""
    return f"- **`{entry.name}`** · {entry.kind}{more} · {labels}  \n  {help_}."


def render(root: Path | None = None) -> str:
    """The page; root is unused (the metrics come from the code alone), for the same call as alerts_ref."""
    lines = ["# Metrics reference", "",
             "<!-- Generated by docs/gen/metrics_ref.py from the code; do not edit by hand. -->", "",
             "Every metric the daemon serves on `/metrics` (`metrics.listen`, default `127.0.0.1:9847`), with its "
             "type, labels and help text, grouped by the signal that declares it, in the order /metrics lists them. A "
             "counter is listed under the name a query uses, with `_total`. Most GPU metrics carry `gpu`, the "
             "NVML index; a reading the GPU does not report has no sample. The proxy's own `/metrics` is "
             "[its own section](#the-proxy). What the metrics are for: [Metrics](../metrics.md).", ""]
    for heading, intro, entries in sections():
        lines += [f"## {heading}", "", intro, ""]
        lines += [_entry_line(entry) for entry in entries]
        lines.append("")
    lines += ["## The proxy", "",
              "`gpuwarden proxy` (and the daemon's `serve.proxy` child) serves its own `/metrics` on its listen "
              "address (`serve.proxy.listen`, default `127.0.0.1:8001`), apart from the daemon's. The engine's "
              "prefix-cache counters appear once the engine's `/metrics` was read; their help names the engine's "
              "own counter (vLLM's here). Beside each of its counters and its histogram, prometheus_client "
              "serves a `_created` gauge (when the series began).", ""]
    lines += [_entry_line(entry) for entry in proxy_entries()]
    lines.append("")
    return "\n".join(lines)


def write(root: Path) -> Path:
    path = Path(root) / PAGE
    path.write_text(render())
    return path


if __name__ == "__main__":
    root = Path(__file__).resolve().parents[2]
    sys.path.insert(0, str(root / "daemon"))
    print(write(root))
