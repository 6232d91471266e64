"""Read the engine's /metrics and derive what operators ask first: tok/s, queue, KV cache.

The engine says which of its metric names mean what (Engine.metric_names); engines
rename gauges across versions (vllm:gpu_cache_usage_perc became
vllm:kv_cache_usage_perc), so several names may be given and the first present
wins. Rates come from two scrapes' counters, so the first scrape after a
(re)start reports no rate yet.

The read runs on a worker thread with a total deadline and a size cap, so a
/metrics that trickles, sends a gigabyte or never accepts costs the loop
nothing: read() hands back the latest finished answer and starts the next.
Values that are not finite (NaN, +Inf) are dropped, as if vLLM had not sent them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from ...base import httpget
from ...base.background import Background
from ..compose.engines import MetricNames

DEADLINE_S = 2.0
MAX_BYTES = 8 * 1024 * 1024  # a real vLLM /metrics is 50-200 KB
LINE_MAX = 4096  # bytes of one sample line of a name read: a longer one is dropped unparsed
MAX_SAMPLES = 4096  # samples of the names read (one per engine, model and label set: a real one has a few dozen)


@dataclass(frozen=True)
class ServingStats:
    generation_tokens_per_s: float | None = None
    prompt_tokens_per_s: float | None = None
    requests_running: float | None = None
    requests_waiting: float | None = None
    kv_cache_usage_ratio: float | None = None  # 0-1
    tokens_total: float | None = None  # generated + prompt tokens counted so far: the engine's progress
    generation_tokens_total: float | None = None  # generated tokens counted so far (the daemon's tokens per joule)


def parse(text: str, wanted: Collection[str] | None = None) -> dict[str, float]:
    """Sample name -> value, summed over label sets (engines, models); non-finite samples are dropped. wanted: only
    these sample names are parsed (the rest of the text is skipped line by line, unparsed): the engine is serve.user's,
    and 8 MiB of distinct names cost the root daemon 3.4 s of CPU and 228 MB a read, read after read (attacker 8's
    finding 6)."""
    if wanted is not None:
        kept = [line for line in text.split("\n") if _sample_name(line) in wanted]
        if len(kept) > MAX_SAMPLES:  # the names read, under as many label sets: a flood, not a count to sum
            raise ValueError(f"{len(kept)} samples of the {len(wanted)} names read, more than {MAX_SAMPLES}")
        # prometheus_client's label parser is quadratic in one label set's length: a 1 MiB line cost 6.6 s of CPU
        # (attacker 9's F2); a real sample line is under 300 bytes
        kept = [line for line in kept if len(line) <= LINE_MAX]
        text = "\n".join(kept)
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if math.isfinite(sample.value):
                totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
    return totals


def _sample_name(line: str) -> str:
    """The metric name a sample line starts with ("" for a comment or a blank line)."""
    if not line or line[0] == "#":
        return ""
    end = len(line)
    for stop in ("{", " "):
        at = line.find(stop, 0, end)
        if at >= 0:
            end = at
    return line[:end]


def read_names(names: MetricNames | None) -> set[str]:
    """Every sample name gpuwarden reads of an engine's /metrics (the daemon, bench, the proxy's scrape)."""
    if names is None:
        return set()
    histograms = [f"{name}_{part}" for name in (names.ttft_histogram, names.latency_histogram) if name
                  for part in ("sum", "count")]
    return {names.generation_tokens, names.prompt_tokens, names.requests_running, names.requests_waiting,
            *names.kv_cache_usage, *(n for n in (names.prefix_cache_queries, names.prefix_cache_hits) if n),
            *histograms}


def fetch(url: str, owner: int | None = None, wanted: Collection[str] | None = None) -> dict[str, float]:
    """One bounded read of /metrics, parsed (on the worker thread), from a socket of owner only (the engine's uid;
    httpget.request); wanted: the only names parsed. Raises httpget.HttpError or ValueError."""
    reply = httpget.get(url, DEADLINE_S, MAX_BYTES, owner=owner)
    if reply.code != 200:
        raise httpget.HttpError(f"{url} answered {reply.code}")
    return parse(reply.body.decode("utf-8", "replace"), wanted)


class MetricsReader:
    def __init__(self, url: str, names: MetricNames, clock: Callable[[], float], background: Background | None = None,
                 owner: int | None = None):
        self.url, self.owner = url, owner
        self.names = names
        self.wanted = read_names(names)
        self.job = background or Background("serving-metrics", clock)
        self._last: tuple[float, dict[str, float]] | None = None
        self._latest: ServingStats | None = None

    def reset(self) -> None:
        """A new child: its counters start from zero, so forget the old ones."""
        self._last, self._latest = None, None
        self.job.discard()

    def read(self, now: float) -> ServingStats | None:
        """The latest stats (None while none or after a failed read); starts the next read in the background."""
        self.job.start(fetch, self.url, self.owner, self.wanted)
        outcome = self.job.take()
        if outcome is None:
            return self._latest
        if outcome.error is not None:
            self._latest = None
            return None
        values, at = outcome.value, outcome.finished_at
        previous, self._last = self._last, (at, values)
        names = self.names
        kv = next((values[name] for name in names.kv_cache_usage if name in values), None)
        self._latest = ServingStats(
            generation_tokens_per_s=_rate(previous, at, values, names.generation_tokens),
            prompt_tokens_per_s=_rate(previous, at, values, names.prompt_tokens),
            requests_running=values.get(names.requests_running),
            requests_waiting=values.get(names.requests_waiting),
            kv_cache_usage_ratio=kv,
            tokens_total=_sum(values, (names.generation_tokens, names.prompt_tokens)),
            generation_tokens_total=values.get(names.generation_tokens),
        )
        return self._latest


def _rate(previous: tuple[float, dict[str, float]] | None, now: float, values: dict[str, float],
          name: str) -> float | None:
    if previous is None or name not in values or name not in previous[1] or now <= previous[0]:
        return None
    delta = values[name] - previous[1][name]
    return max(delta, 0.0) / (now - previous[0])  # a counter reset reads as 0, not negative


def _sum(values: dict[str, float], names: tuple[str, ...]) -> float | None:
    present = [values[name] for name in names if name in values]
    return sum(present) if present else None
