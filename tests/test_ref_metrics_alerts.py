"""The metrics and alerts references (docs/reference/metrics.md, alerts.md): the committed pages are what
docs/gen/ writes from the code now, and every metric a real /metrics serves and every alert the daemon or the
shipped rules raise has an entry. The second check does not walk the code as the generator does: it reads what is
served (the saved body of every simulated scenario, the exposition's per-scrape line, the proxy's own /metrics as
its handler answers) and the rule registry and files, so a metric or an alert added without its entry fails."""

import asyncio
import re
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "docs" / "gen"))

import alerts_ref
import metrics_ref

GOLDEN = ROOT / "tests" / "exposition" / "metrics.prom"
REGENERATE = "PYTHONPATH=daemon .venv/bin/python docs/gen/{}.py"


def test_committed_pages_are_what_the_code_generates():
    assert (ROOT / metrics_ref.PAGE).read_text() == metrics_ref.render(), REGENERATE.format("metrics_ref")
    assert (ROOT / alerts_ref.PAGE).read_text() == alerts_ref.render(ROOT), REGENERATE.format("alerts_ref")


def test_write_writes_the_page(tmp_path):
    (tmp_path / "docs" / "reference").mkdir(parents=True)
    assert metrics_ref.write(tmp_path).read_text() == (ROOT / metrics_ref.PAGE).read_text()


def families(body: str) -> set[str]:
    """The names a query uses for each family of a /metrics body (a counter's with _total), without the _created
    gauges prometheus_client serves beside its own counters and histograms."""
    kinds = dict(re.findall(r"^# TYPE (\S+) (\S+)$", body, re.M))
    names = set()
    for name, kind in kinds.items():
        base = name.removesuffix("_created")
        if name != base and {kinds.get(base), kinds.get(base + "_total")} & {"counter", "histogram"}:
            continue
        names.add(name + "_total" if kind == "counter" and not name.endswith("_total") else name)
    return names


def documented(page: Path) -> set[str]:
    return set(re.findall(r"^- \*\*`([a-z0-9_:]+)`\*\*", page.read_text(), re.M))


def daemon_body() -> str:
    """The saved body of every scenario, and a scrape of the real exposition (its per-scrape snapshot age)."""
    from gpuwarden.watch.monitor import Snapshot
    from gpuwarden.web.exposition import Exposition

    snapshot = Snapshot(taken_at=0.0, monotonic=0.0, gpus=(), alerts=())
    exposition = Exposition(lambda: snapshot, clock=lambda: 1.0)
    try:
        exposition.published()
        deadline = time.monotonic() + 10
        while b"snapshot_age" not in (scraped := exposition.body()) and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        exposition.close()
    return GOLDEN.read_text() + scraped.decode()


def proxy_body() -> str:
    """The proxy's /metrics as its handler answers, built as `gpuwarden proxy` builds it, after one engine read."""
    from gpuwarden.proxy.faults import proxy_faults
    from gpuwarden.proxy.listener import Connections
    from gpuwarden.proxy.normalize import Rules
    from gpuwarden.proxy.server import Proxy, ProxyMetrics
    from gpuwarden.serving.compose.engines import engine_for

    names = engine_for("vllm").metric_names
    metrics = ProxyMetrics((names.prefix_cache_queries, names.prefix_cache_hits))
    proxy = Proxy("http://127.0.0.1:1", Rules(), metrics, conns=Connections(4, 1.0, proxy_faults()))
    metrics.engine_up, metrics.engine = 1, {names.prefix_cache_queries: 10.0, names.prefix_cache_hits: 5.0}
    metrics.requests.labels("openai", "200").inc()
    metrics.upstream.labels("openai").observe(0.1)
    return asyncio.run(proxy.own_metrics(None)).body.decode()


def test_every_metric_served_has_an_entry():
    served = families(daemon_body())
    assert {"gpuwarden_gpu_power_watts", "gpuwarden_snapshot_age_seconds", "gpuwarden_build_info",
            "gpuwarden_gpu_energy_joules_total", "gpuwarden_serving_info"} <= served  # the bodies are whole
    missing = served - documented(ROOT / metrics_ref.PAGE)
    assert not missing, f"no entry in {metrics_ref.PAGE}: {sorted(missing)}"


def test_every_proxy_metric_has_an_entry():
    served = families(proxy_body())
    assert {"gpuwarden_proxy_requests_total", "gpuwarden_proxy_upstream_seconds",
            "gpuwarden_proxy_connections", "gpuwarden_proxy_engine_prefix_cache_hits_tokens_total"} <= served
    section = (ROOT / metrics_ref.PAGE).read_text().split("## The proxy", 1)[1]
    missing = {name for name in served if not re.search(rf"^- \*\*`{name}`\*\*", section, re.M)}
    assert not missing, f"no entry in the proxy's section of {metrics_ref.PAGE}: {sorted(missing)}"


def headings(page: Path) -> set[str]:
    return set(re.findall(r"^#+ `([\w:]+)`$", page.read_text(), re.M))


def test_every_alert_has_an_entry():
    from gpuwarden.watch.signals import RULES_BY_NAME

    page = ROOT / alerts_ref.PAGE
    shipped = [rule for path in (ROOT / "etc" / "prometheus").glob("*.yml")
               for group in yaml.safe_load(path.read_text())["groups"] for rule in group["rules"]]
    alerts = {rule["alert"] for rule in shipped if "alert" in rule}
    assert {"ServingNodeDown", "GpuwardenDown", "GpuPowerCapped"} <= alerts and "power_capped" in RULES_BY_NAME
    missing = (set(RULES_BY_NAME) | alerts) - headings(page)
    assert not missing, f"no entry in {alerts_ref.PAGE}: {sorted(missing)}"
    records = {rule["record"] for rule in shipped if "record" in rule}
    assert records and records <= documented(page)


def test_alert_text_is_readable():
    """The annotations' Go templates are said in words: none is left on the page, and a fix that depends on a
    label or a query says each case."""
    text = (ROOT / alerts_ref.PAGE).read_text()
    assert "{{" not in text and "$labels" not in text
    power = text.split("### `GpuPowerCapped`", 1)[1].split("###", 1)[0]
    assert "`systemctl reload gpuwarden` sets the chosen limit again" in power
    assert "set alerts.warn_at_design_power: false" in power and "Otherwise: set tuning.power_limit_w" in power
    node_down = text.split("### `ServingNodeDown`", 1)[1].split("###", 1)[0]
    assert "**critical**" in node_down and "- **Fix:** `journalctl -u gpuwarden` on {instance}" in node_down
