"""Read the child's /metrics and derive what operators ask first: tok/s, queue, KV cache.

vLLM renamed gauges across versions (vllm:gpu_cache_usage_perc became
vllm:kv_cache_usage_perc); both are read. Rates come from two scrapes'
counters, so the first scrape after a (re)start reports no rate yet.
"""

from __future__ import annotations

import urllib.error
import urllib.request
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

GENERATION = "vllm:generation_tokens_total"
PROMPT = "vllm:prompt_tokens_total"
RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
KV_CACHE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")  # new name first


@dataclass(frozen=True)
class VllmStats:
    generation_tokens_per_s: float | None = None
    prompt_tokens_per_s: float | None = None
    requests_running: float | None = None
    requests_waiting: float | None = None
    kv_cache_usage_ratio: float | None = None  # 0-1


def parse(text: str) -> dict[str, float]:
    """Sample name -> value, summed over label sets (engines, models)."""
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
    return totals


class VllmMetricsReader:
    def __init__(self, url: str, timeout_s: float = 2.0):
        self.url = url
        self.timeout_s = timeout_s
        self._last: tuple[float, dict[str, float]] | None = None

    def reset(self) -> None:
        """A new child: its counters start from zero, so forget the old ones."""
        self._last = None

    def read(self, now: float) -> VllmStats | None:
        try:
            with urllib.request.urlopen(self.url, timeout=self.timeout_s) as reply:
                values = parse(reply.read().decode("utf-8", "replace"))
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError, ValueError):
            return None
        previous, self._last = self._last, (now, values)
        kv = next((values[name] for name in KV_CACHE if name in values), None)
        return VllmStats(
            generation_tokens_per_s=_rate(previous, now, values, GENERATION),
            prompt_tokens_per_s=_rate(previous, now, values, PROMPT),
            requests_running=values.get(RUNNING),
            requests_waiting=values.get(WAITING),
            kv_cache_usage_ratio=kv,
        )


def _rate(previous: tuple[float, dict[str, float]] | None, now: float, values: dict[str, float],
          name: str) -> float | None:
    if previous is None or name not in values or name not in previous[1] or now <= previous[0]:
        return None
    delta = values[name] - previous[1][name]
    return max(delta, 0.0) / (now - previous[0])  # a counter reset reads as 0, not negative
