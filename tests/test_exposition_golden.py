"""The /metrics body, byte for byte: every simulated scenario played for a while (alerts firing and resolving,
events counted), and serving views of each kind, rendered and compared with a saved copy. The saved copy was made
by the code before the metric rows moved into watch/signals/, so the rows' new home renders the same text.

Regenerate (only when a metric is meant to change): GPUWARDEN_GOLDEN_WRITE=1 pytest tests/test_exposition_golden.py
"""

import dataclasses
import os
from pathlib import Path

from prometheus_client import generate_latest

from gpuwarden import config
from gpuwarden.backends import open_configured
from gpuwarden.gpu.events import GpuEvent
from gpuwarden.gpu.sim.backend import ManualClock
from gpuwarden.serving.probe.metrics import ServingStats
from gpuwarden.serving.run.supervisor import ServingView
from gpuwarden.tune.tuning import Tuner, TuningLife
from gpuwarden.watch.monitor import Monitor
from gpuwarden.web.exposition import make_registry

GOLDEN = Path(__file__).parent / "exposition" / "metrics.prom"
SCENARIOS = sorted(p.stem for p in (Path(__file__).resolve().parent.parent / "daemon" / "gpuwarden" / "gpu" /
                                    "scenarios").glob("*.yaml"))
FAST = "poll_interval_s: 0.5\ncounters_interval_s: 1\nalerts:\n  for_s: 1\n  clear_for_s: 2\n"


def render(snapshot) -> str:
    # The poll's own timings are the machine's, not the code's: fixed here.
    fixed = dataclasses.replace(snapshot, sample_duration_s=0.25, loop_lag_s=0.01, taken_at=1000.0)
    return generate_latest(make_registry(lambda: fixed)).decode()


def played(scenario: str, extra: str = "", until: float = 30.0, serving=(), stats=None, inject=()) -> list[str]:
    cfg = config.parse_text(f"gpu:\n  backend: sim\n  scenario: {scenario}\nmetrics:\n  listen: none\n{FAST}{extra}")
    clock = ManualClock()
    backend = open_configured(cfg, clock)
    tuning = TuningLife(backend, cfg, Tuner(backend))
    tuning.start(tuning.check(cfg))
    monitor = Monitor(cfg, backend, tuning, wall=lambda: 1000.0)
    events = backend.events()
    out = []
    while clock.now <= until:
        if events is not None:
            monitor.record_events(events.wait(0), clock.now)
        if clock.now == 3.0:
            monitor.record_events(list(inject), clock.now)
        snapshot = monitor.tick(clock.now, serving=serving, stats=stats, published_at=0.0)
        if clock.now in (5.0, 12.0, until):
            out.append(f"### {scenario} at {clock.now:g} s\n" + render(snapshot))
        clock.advance(0.5)
    return out


def views() -> list[tuple[str, tuple[ServingView, ...], ServingStats | None]]:
    vllm = ServingView("RUNNING", "/m/Qwen3-8B", "vllm-generic", 4242, 2, -9, 31.5, None, gpus=(0,),
                       transitions=(("STOPPED", "STARTING", 3), ("STARTING", "RUNNING", 3)), stalls=1,
                       started_at=999.0, version="0.11.0", drains=(("drained", 2), ("timed_out", 1), ("aborted", 0)))
    proxy = ServingView("RUNNING", "", "", 4343, 0, None, None, None, engine="proxy", title="proxy")
    sglang = ServingView("BACKOFF", "/m/x", "sglang-generic", None, 1, 1, None, "exited 1", engine="sglang",
                         title="SGLang")
    worker = dataclasses.replace(vllm, role="worker", rank=1, nodes=2, head="10.0.0.1:29500", head_up=False)
    head = dataclasses.replace(vllm, role="head", rank=0, nodes=2, head="10.0.0.1:29500")
    stats = ServingStats(generation_tokens_total=1e6, generation_tokens_per_s=420.0, prompt_tokens_per_s=900.0,
                         requests_running=3, requests_waiting=1, kv_cache_usage_ratio=0.25)
    return [("vllm", (vllm, proxy), stats), ("sglang", (sglang,), None), ("worker", (worker,), stats),
            ("head", (head,), None), ("fatal", (dataclasses.replace(vllm, state="FATAL", problem="bad flag"),), None)]


def everything() -> str:
    out = []
    for scenario in SCENARIOS:
        out += played(scenario)
    out += played("rtx-pro-4000-headless", "tuning:\n  apply: false\n", until=6.0)
    out += played("rtx-pro-4000-headless", "tuning:\n  power_limit_w: 120\n", until=25.0)
    out += played("rtx-pro-6000-tp4", until=12.0, inject=[
        GpuEvent(1, "xid", 79), GpuEvent(1, "xid", 13), GpuEvent(1, "xid", 13), GpuEvent(-1, "gpu_unavailable", 0),
        GpuEvent(2, "double_bit_ecc", 0), GpuEvent(0, "recovery_action", 0)])
    for name, children, stats in views():
        out += [text.replace("###", f"### serving {name}:", 1)
                for text in played("rtx-pro-6000-tp4", serving=children, stats=stats, until=12.0)]
    return "".join(out)


def _value_read(line: str) -> str:
    """A sample line with its value as the float it reads as: prometheus_client writes 3.35232e+12 in Debian 12's
    0.16 and 3.35232e+012 in newer releases, the same number."""
    if line.startswith("#") or " " not in line:
        return line
    head, _, value = line.rpartition(" ")
    return f"{head} {float(value)!r}"


def families(text: str) -> list[list[str]]:
    """Each render's metric families (a HELP line, its TYPE line and its samples, byte for byte but for how a
    value's exponent is written), in name order: the families' order on the page follows the signals
    (watch/signals/), and Prometheus reads them in any."""
    renders = []
    for render in text.split("### ")[1:]:
        title, _, body = render.partition("\n")
        blocks = ("# HELP " + block for block in body.split("# HELP ")[1:])
        renders.append([title] + sorted("\n".join(map(_value_read, b.split("\n"))) for b in blocks))
    return renders


def test_metrics_body_is_the_saved_one_byte_for_byte():
    text = everything()
    if os.environ.get("GPUWARDEN_GOLDEN_WRITE"):
        GOLDEN.write_text(text)
    assert "gpuwarden_gpu_nvlink_errors_total" in text and "gpuwarden_vllm_info" in text  # the rows are there
    assert "gpuwarden_serving_node_up" in text and 'to="firing"' in text and "gpuwarden_gpu_xid_errors_total" in text
    assert families(text) == families(GOLDEN.read_text())
    assert text.startswith("### ") and text.count("# HELP gpuwarden_build_info ") == len(families(text))


def test_an_event_counted_by_the_book_shows_in_the_body():
    cfg = config.parse_text(f"gpu:\n  backend: sim\n  scenario: rtx-pro-6000-tp4\nmetrics:\n  listen: none\n{FAST}")
    clock = ManualClock()
    backend = open_configured(cfg, clock)
    tuning = TuningLife(backend, cfg, Tuner(backend))
    monitor = Monitor(cfg, backend, tuning, wall=lambda: 1000.0)
    monitor.record_events([GpuEvent(1, "xid", 79), GpuEvent(-1, "gpu_unavailable", 0)], clock.now)
    text = render(monitor.tick(clock.now, published_at=0.0))
    assert 'gpuwarden_gpu_xid_errors_total{gpu="1",xid="79"} 1.0' in text
    assert 'gpuwarden_gpu_events_total{gpu="unknown",kind="gpu_unavailable"} 1.0' in text
    assert 'gpuwarden_alert_active{alert="gpu_needs_reset",gpu="1",severity="critical"} 1.0' in text
