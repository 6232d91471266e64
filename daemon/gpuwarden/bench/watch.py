"""What the GPUs and the engine did during a step, from the same seconds as the requests.

A thread polls, every interval: the GPUs (from the running daemon's /status, which also knows the clock
locks, or from NVML directly when no daemon answers); every engine_interval_s (default 2 s), the
engine's /metrics (running and waiting requests, KV-cache usage). The engine's counters are read at the
step's start and end: tokens generated and prefix-cache hits over exactly that step.

The engine is asked less often because asking costs it: rendering vLLM's /metrics (54 KB) takes its API
server's CPU, and on the 2-core CPU test machine scraping it every 0.5 s raised the measured TTFT several
fold (benchmarks/RESULTS.md, section 9). Once every 2 s still shows the queue over any step worth timing;
--engine-interval 0 reads only the counters, at the step's start and end.
"""

from __future__ import annotations

import statistics
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from ..gpu.base import ClockEventReason
from ..base.httpget import HttpError
from ..serving.probe.metrics import fetch, read_names
from ..web.status import StatusError, is_share, shown
from ..gpu.throttle import HELD_DOWN, LOCK_TOLERANCE_MHZ
from .bound import FIELDS

HELD_DOWN_NAMES = set(ClockEventReason(HELD_DOWN).names())
GpuReader = Callable[[], "list[dict] | None"]  # the GPUs as /status reports them (GpuSample.as_dict + locks)

# What bench reads of each GPU in a daemon's /status, and what each must be: whatever answers on the metrics port
# is read (it may not be the daemon), and every poll of a step is kept until the step's end.
MAX_GPUS = 64  # GPU indices 0..63: more than any host has
NUMBER_MAX = 1e15  # clocks, watts, percent, bytes per second (HBM: ~1e13): a step's sum of them stays finite
NUMBERS = ("sm_clock_mhz", "memory_clock_mhz", "power_w", "power_limit_w", "utilization_pct",
           "memory_bandwidth_bytes_per_s", "memory_bus_width_bits")
NAME_MAX = 256
REASONS_MAX = 64  # clock-event reason names (the daemon's are a fixed set of about a dozen)


def checked_gpus(gpus, url: str) -> list[dict] | None:
    """/status's "gpus", each GPU kept as only the fields bench reads, each checked: numbers finite and 0..NUMBER_MAX,
    GPM's shares 0..1, names and reason names strings. None where /status has no "gpus" (a poll fewer); StatusError,
    one line naming the GPU, the field and the value, for anything else (a 400-digit integer, "x", NaN, 1e308 and
    nested lists raised out of bench's poll thread; a list of 100,000 GPUs filled its memory poll by poll)."""
    def refuse(what: str, value, expected: str):
        return StatusError(f"{url}/status: {what} is {shown(value)}, not {expected}")

    if gpus is None:
        return None
    if not isinstance(gpus, list):
        raise refuse("gpus", gpus, "a list of GPUs")
    if len(gpus) > MAX_GPUS:
        raise StatusError(f"{url}/status lists {len(gpus)} GPUs: more than {MAX_GPUS} GPUs is no daemon's")
    out = []
    for gpu in gpus:
        if not isinstance(gpu, dict):
            raise refuse("an entry of gpus", gpu, "a GPU (an object)")
        index = gpu.get("index")
        if type(index) is not int or not 0 <= index < MAX_GPUS:
            raise refuse("a GPU's index", index, f"0-{MAX_GPUS - 1}")
        kept = {"index": index}
        for name in NUMBERS + FIELDS:
            value = gpu.get(name)
            if value is None:
                pass
            elif name in FIELDS and not is_share(value):
                raise refuse(f"GPU {index}'s {name}", value, "a share 0..1")
            elif name in NUMBERS and not (type(value) in (int, float) and 0 <= value <= NUMBER_MAX):
                raise refuse(f"GPU {index}'s {name}", value, f"a number 0-{NUMBER_MAX:g}")
            kept[name] = value
        name, reasons, lock = gpu.get("name"), gpu.get("clock_event_reasons"), gpu.get("sm_lock_mhz")
        if name is not None and not isinstance(name, str):
            raise refuse(f"GPU {index}'s name", name, "a string")
        if reasons is not None and not (isinstance(reasons, list) and len(reasons) <= REASONS_MAX
                                        and all(isinstance(r, str) and len(r) <= NAME_MAX for r in reasons)):
            raise refuse(f"GPU {index}'s clock_event_reasons", reasons, "a list of reason names")
        if lock is not None and not (isinstance(lock, list) and len(lock) == 2 and all(
                type(v) in (int, float) and 0 <= v <= NUMBER_MAX for v in lock)):
            raise refuse(f"GPU {index}'s sm_lock_mhz", lock, "[low, high] MHz")
        kept.update(name=None if name is None else name[:NAME_MAX], clock_event_reasons=reasons, sm_lock_mhz=lock)
        out.append(kept)
    return out


@dataclass
class Polls:
    gpus: dict[int, list[dict]] = field(default_factory=dict)
    engine: list[dict[str, float]] = field(default_factory=list)


class Watch:
    def __init__(self, read_gpus: GpuReader | None, metrics_url: str | None, names,
                 interval_s: float = 0.5, engine_interval_s: float = 2.0):
        self.read_gpus = read_gpus
        self.metrics_url, self.names, self.interval_s = metrics_url, names, interval_s
        # GPU polls per engine scrape (0: never during the step)
        self.engine_every = max(1, round(engine_interval_s / interval_s)) if engine_interval_s > 0 else 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._polls = Polls()
        self._start_counters: dict[str, float] | None = None
        self._count = 0
        self._wanted = read_names(names)
        self._asked = 0  # answers asked of read_gpus over the whole run, and those it refused (a StatusError)
        self._refused = 0
        self._first_refusal: str | None = None

    def _scrape(self) -> dict[str, float] | None:
        """The names summarize_engine reads, and no others: a scrape is kept until the step's end, and 8 MiB of
        distinct names (fetch's cap) parse to 850,000 of them, about 100 MB a scrape."""
        if self.metrics_url is None:
            return None
        try:
            return fetch(self.metrics_url, wanted=self._wanted)
        except (HttpError, OSError, ValueError):  # restarting, or not ours to read: the step says "not reported"
            return None

    def _poll(self) -> None:
        # Polls fall inside the step: the first one an interval after it began, none after it ended.
        while not self._stop.wait(self.interval_s):
            self._poll_once()

    def _poll_once(self) -> None:
        if self.read_gpus is not None:
            self._asked += 1
            try:
                gpus = self.read_gpus()
            except StatusError as exc:  # not the daemon's answer (checked_gpus, fetch_status): a poll fewer, said
                gpus = None
                self._refused += 1
                self._first_refusal = self._first_refusal or str(exc)
            except (HttpError, OSError, ValueError):  # the daemon restarting: a poll fewer
                gpus = None
            for gpu in gpus or []:
                self._polls.gpus.setdefault(gpu["index"], []).append(gpu)
        self._count += 1
        if self.engine_every and self._count % self.engine_every == 0:
            scraped = self._scrape()
            if scraped is not None:
                self._polls.engine.append(scraped)

    def refusals(self) -> list[str]:
        """One note for the run's answers read_gpus refused, or none."""
        if not self._refused:
            return []
        return [f"the GPU view refused {self._refused} of {self._asked} answers from the daemon's /status, the "
                f"first: {self._first_refusal}"]

    def begin(self) -> None:
        self._polls, self._count = Polls(), self.engine_every // 2  # the first scrape half an interval in
        self._start_counters = self._scrape()
        self._stop.clear()
        self._thread = threading.Thread(target=self._poll, name="bench-watch", daemon=True)
        self._thread.start()

    def end(self) -> tuple[list[dict], dict]:
        """Stop polling; (per-GPU summary, engine summary) of the step."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if not self._polls.gpus and self.read_gpus is not None:  # a step shorter than one interval: one look
            self._poll_once()
        end = self._scrape()
        return ([summarize_gpu(index, polls) for index, polls in sorted(self._polls.gpus.items())],
                summarize_engine(self.names, self._start_counters, end, self._polls.engine))


def _mean(values: list[float]) -> float | None:
    return statistics.fmean(values) if values else None


def summarize_gpu(index: int, polls: list[dict]) -> dict:
    sm = [p["sm_clock_mhz"] for p in polls if p.get("sm_clock_mhz") is not None]
    mem = [p["memory_clock_mhz"] for p in polls if p.get("memory_clock_mhz") is not None]
    power = [p["power_w"] for p in polls if p.get("power_w") is not None]
    util = [p["utilization_pct"] for p in polls if p.get("utilization_pct") is not None]
    bandwidth = [p["memory_bandwidth_bytes_per_s"] for p in polls if p.get("memory_bandwidth_bytes_per_s")]
    # GPM's shares (GpuSample's *_ratio; absent from an older daemon's /status, None where the GPU has no GPM)
    activity = {f"{key}_mean": _mean([p[key] for p in polls if p.get(key) is not None]) for key in FIELDS}
    reasons: list[str] = []
    for p in polls:
        for name in p.get("clock_event_reasons") or []:
            if name not in reasons:
                reasons.append(name)
    lock = next((p["sm_lock_mhz"] for p in reversed(polls) if p.get("sm_lock_mhz")), None)
    busy = [p for p in polls if (p.get("utilization_pct") or 0) >= 50]
    below = [p for p in busy if lock and p.get("sm_clock_mhz") is not None
             and p["sm_clock_mhz"] < lock[0] - LOCK_TOLERANCE_MHZ]
    limits = [p["power_limit_w"] for p in polls if p.get("power_limit_w") is not None]
    return {"index": index, "name": polls[-1].get("name"), "polls": len(polls),
            "sm_mhz_min": min(sm) if sm else None, "sm_mhz_mean": _mean(sm),
            "memory_mhz_min": min(mem) if mem else None, "memory_mhz_mean": _mean(mem),
            "power_w_mean": _mean(power), "power_w_max": max(power) if power else None,
            "power_limit_w": limits[-1] if limits else None, "utilization_pct_mean": _mean(util),
            "bandwidth_bytes_per_s_mean": _mean(bandwidth), **activity,
            "memory_bus_width_bits": polls[-1].get("memory_bus_width_bits"),
            "reasons_seen": reasons, "held_down_by": [r for r in reasons if r in HELD_DOWN_NAMES],
            "sm_lock_mhz": list(lock) if lock else None, "polls_below_lock": len(below), "busy_polls": len(busy)}


def summarize_engine(names, start: dict | None, end: dict | None, polls: list[dict]) -> dict:
    if names is None or (start is None and not polls):
        return {"reported": False}

    def delta(name: str | None) -> float | None:
        if name is None or start is None or end is None or name not in start or name not in end:
            return None
        return end[name] - start[name]

    def series(name: str) -> list[float]:
        return [p[name] for p in polls if name in p]

    kv = next((series(n) for n in names.kv_cache_usage if series(n)), [])
    hits, queries = delta(names.prefix_cache_hits), delta(names.prefix_cache_queries)

    def histogram_mean(name: str | None) -> float | None:
        """A histogram's mean over the step: its sum's growth over its count's."""
        grew, count = (delta(f"{name}_{part}") if name else None for part in ("sum", "count"))
        return grew / count if grew is not None and count else None

    running, waiting = series(names.requests_running), series(names.requests_waiting)
    return {"reported": True, "generation_tokens": delta(names.generation_tokens),
            "prompt_tokens": delta(names.prompt_tokens),
            "running_mean": _mean(running), "running_max": max(running) if running else None,
            "waiting_mean": _mean(waiting), "waiting_max": max(waiting) if waiting else None,
            "kv_cache_usage_max": max(kv) if kv else None,
            "prefix_cache_hit_rate": hits / queries if hits is not None and queries else None,
            # the engine's own means over the step, from a request's arrival in it: the client's less the way
            # to and from the engine
            "ttft_mean_s": histogram_mean(names.ttft_histogram),
            "latency_mean_s": histogram_mean(names.latency_histogram)}


def step_flags(gpus: list[dict], gpu_note: str | None) -> list[str]:
    """What makes a step's numbers not the card's best: a clock held down, or below its lock while busy."""
    flags = []
    for g in gpus:
        if g["held_down_by"]:
            flags.append(f"GPU{g['index']} throttled: {', '.join(g['held_down_by'])}")
        if g["polls_below_lock"]:
            flags.append(f"GPU{g['index']} below its {g['sm_lock_mhz'][0]} MHz lock in {g['polls_below_lock']} of "
                         f"{g['busy_polls']} busy polls (SM min {g['sm_mhz_min']} MHz)")
    if gpu_note:
        flags.append(gpu_note)
    return flags
