"""The sweep: find the model, calibrate the prompt length, warm up, then one step per concurrency.

A step keeps C requests in flight until it has sent its count (or its duration is up) and is timed from its
first request to its last token, as vLLM's benchmark times a run. The Watch records the GPUs and the engine
over the same seconds. Ctrl-C (or any cancellation) ends the step in flight: its requests are cancelled, the
session and its sockets closed, and what finished is kept as a partial step.

No server holds a step, or bench, open: every request ends within --request-timeout, and with --duration a
step ends at most --grace after its duration, the requests still streaming then cut (counted apart from the
server's errors).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import aiohttp

from ..base import unixsock
from ..base.httpget import HttpError, read_capped
from ..base.exits import EX_CONFIG, EX_FAIL, EX_UNAVAILABLE
from .bound import step_activity
from .client import RequestResult, stream
from . import joules
from .energy import gpu_watts, step_energy
from .watch import Watch, step_flags
from .workload import CALIBRATION_WORDS, MARK_WORDS, WORDS, Workload

CONNECT_TIMEOUT_S = 10.0
# /v1/models and /tokenize: small answers, each whole within a total deadline and a size cap
SMALL_READ, MAX_SMALL_BYTES = aiohttp.ClientTimeout(total=30), 4 << 20
WORD_SIZES_DEADLINE_S = 60.0  # all the /tokenize calls together: each word's size, then the calibration


class BenchError(Exception):
    """One line for the user, and the exit status: the server is down or not OpenAI-compatible (69), the model
    unknown (78), or the first request failed (1)."""

    def __init__(self, message: str, exit_code: int = EX_UNAVAILABLE):
        super().__init__(message)
        self.exit_code = exit_code


@dataclass
class Settings:
    base_url: str  # http://host:port, without /v1
    workload: Workload
    concurrency: list[int]
    requests: int | None  # per step; None: 4 x C (at least 8), or duration_s when that is given
    duration_s: float | None
    warmup: int = 2
    request_timeout_s: float = 600.0  # any one request, start to end of stream
    grace_s: float = 30.0  # with duration_s: how long the requests in flight at its end may still take
    idle_s: float = 0.0  # the GPUs' idle draw is measured this long before the first step (0: not measured)

    def limit(self, now: float = 0.0, step_end: float | None = None) -> tuple[float, str]:
        """(seconds, what cuts it) for a request that starts at now: its own deadline, or the step's end."""
        if step_end is not None and step_end + self.grace_s - now < self.request_timeout_s:
            return (step_end + self.grace_s - now,
                    f"still streaming {self.grace_s:g} s after the step's {self.duration_s:g} s (--grace)")
        return self.request_timeout_s, f"no end of stream within {self.request_timeout_s:g} s (--request-timeout)"


@dataclass
class Sweep:
    """Filled in as it runs, so that an interrupted sweep still has everything that finished."""

    settings: Settings
    model: str | None = None
    notes: list[str] = field(default_factory=list)
    steps: list[dict] = field(default_factory=list)
    interrupted: bool = False
    idle_w: float | None = None  # the GPUs' summed draw before the first step, no request in flight


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def summarize_step(concurrency: int, results: list[RequestResult], duration_s: float, interrupted: bool) -> dict:
    ok = [r for r in results if r.ok]
    cut = [r for r in results if r.cut]
    errors = [r for r in results if not r.ok and not r.cut]
    tokens = sum(r.output_tokens for r in ok)
    speeds = [s for r in ok if (s := r.decode_tokens_per_s) is not None]
    # The mean over requests as one rate (tokens over decode seconds): a request whose chunks came in one burst
    # has a near-zero decode time, and its own rate would swamp a plain mean of rates.
    decoding = [r for r in ok if r.decode_tokens_per_s is not None]
    decode_s = sum(r.latency_s - r.ttft_s for r in decoding)
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    itl = [gap for r in ok for gap in r.itl_s]
    prompts = [r.prompt_tokens for r in ok if r.prompt_tokens is not None]
    return {"concurrency": concurrency, "requests": len(results), "ok": len(ok), "errors": len(errors),
            "first_error": errors[0].error if errors else None, "cut": len(cut),
            "first_cut": cut[0].error if cut else None, "interrupted": interrupted,
            "duration_s": duration_s, "output_tokens": tokens,
            "input_tokens_mean": statistics.fmean(prompts) if prompts else None,
            "system_tokens_per_s": tokens / duration_s if duration_s > 0 and ok else None,
            "per_request_tokens_per_s_mean": (sum(r.output_tokens - 1 for r in decoding) / decode_s
                                              if decode_s else None),
            "per_request_tokens_per_s_p50": percentile(speeds, 0.5),
            "ttft_mean_s": statistics.fmean(ttft) if ttft else None,
            "ttft_p50_s": percentile(ttft, 0.5), "ttft_p99_s": percentile(ttft, 0.99),
            "itl_p50_s": percentile(itl, 0.5), "itl_p99_s": percentile(itl, 0.99),
            "latency_mean_s": statistics.fmean([r.latency_s for r in ok]) if ok else None}


async def _models(session: aiohttp.ClientSession, base: str) -> list[str]:
    try:
        async with session.get(f"{base}/v1/models", timeout=SMALL_READ) as reply:
            if reply.status != 200:
                raise BenchError(f"{base}/v1/models answered HTTP {reply.status}: is this an OpenAI-compatible server?")
            body = json.loads(await read_capped(reply.content, MAX_SMALL_BYTES, "/v1/models"))
    except (aiohttp.ClientError, asyncio.TimeoutError, HttpError, OSError) as exc:
        raise BenchError(f"cannot reach {base} ({type(exc).__name__}: {exc}); is the engine running? "
                         "(`gpuwarden status` says)") from None
    except (ValueError, RecursionError):  # RecursionError: JSON nested too deep
        raise BenchError(f"{base}/v1/models did not answer JSON: is this an OpenAI-compatible server?") from None
    data = body.get("data") if isinstance(body, dict) else None
    if not isinstance(data, list):
        raise BenchError(f"{base}/v1/models did not answer a list of models: is this an OpenAI-compatible server?")
    return [m["id"] for m in data if isinstance(m, dict) and isinstance(m.get("id"), str) and m["id"]]


async def _calibrate(session: aiohttp.ClientSession, url: str, workload: Workload, settings: Settings,
                     notes: list[str]) -> Workload:
    """How many tokens the server counts per prompt word; whether it takes ignore_eos. The calibration prompt
    is a quarter of --input-len in words, so that a short context still holds it. Then, where the server
    tokenizes for us, each word's exact size (workload.py)."""
    words = max(8, min(CALIBRATION_WORDS, workload.input_len // 4))
    first = await stream(session, url, workload.payload(-1, max_tokens=1, words=words), *settings.limit())
    if not first.ok and workload.ignore_eos and "ignore_eos" in (first.error or ""):
        workload = replace(workload, ignore_eos=False)
        notes.append("the server rejects ignore_eos: outputs may end before --output-len")
        first = await stream(session, url, workload.payload(-1, max_tokens=1, words=words), *settings.limit())
    if not first.ok:
        raise BenchError(f"the first request failed: {first.error}", exit_code=EX_FAIL)
    if first.prompt_tokens:
        workload = replace(workload, tokens_per_word=first.prompt_tokens / (words + MARK_WORDS))
        exact = await _word_sizes(session, url.rsplit("/v1/", 1)[0], workload, first.prompt_tokens, words)
        if exact is not None:
            return exact
        notes.append("prompt lengths are estimated (the server has no /tokenize that matches its counts)")
        return workload
    notes.append("the server reports no usage: prompts are sized at one token per word")
    return workload


async def _word_sizes(session: aiohttp.ClientSession, base: str, workload: Workload, counted: int,
                      words: int) -> Workload | None:
    """The workload with each word's size in tokens from the server's /tokenize, if the sizes add up to what it
    counted for the calibration prompt; else None."""

    async def size(text: str) -> int:
        async with session.post(base + "/tokenize", json={"model": workload.model, "prompt": text,
                                                          "add_special_tokens": False}, timeout=SMALL_READ) as reply:
            if reply.status != 200:
                raise ValueError(f"HTTP {reply.status}")
            count = json.loads(await read_capped(reply.content, MAX_SMALL_BYTES, "/tokenize")).get("count")
            if not isinstance(count, int) or count < 0:
                raise ValueError("no count")
            return count

    async def all_sizes() -> tuple[tuple[int, ...], int]:
        return tuple([await size(" " + word) for word in WORDS]), await size(workload.prompt(-1, words))

    try:
        # One deadline for all of them: 33 calls of SMALL_READ each could hold the sweep for a quarter of an hour.
        sizes, whole = await asyncio.wait_for(all_sizes(), WORD_SIZES_DEADLINE_S)
        calibration = workload.prompt(-1, words)
        by_word = dict(zip(WORDS, sizes))
        if min(sizes) < 1 or whole > counted or whole != sum(by_word[w] for w in calibration.split()):
            return None  # the tokenizer merges across spaces: sizes do not add up
    except (aiohttp.ClientError, asyncio.TimeoutError, HttpError, ValueError, AttributeError, OSError,
            RecursionError):
        return None  # AttributeError: an answer that is not a JSON object; RecursionError: one nested too deep
    return replace(workload, word_tokens=sizes, special_tokens=counted - whole)  # counted - whole: BOS and such


async def _step(session: aiohttp.ClientSession, url: str, settings: Settings, workload: Workload, concurrency: int,
                ids: itertools.count, progress: Callable[[int, int | None, float], None]) -> tuple[list, float, bool]:
    results: list[RequestResult] = []
    remaining = settings.requests or max(8, 4 * concurrency)
    start = time.perf_counter()
    deadline = start + settings.duration_s if settings.duration_s else None

    async def worker() -> None:
        nonlocal remaining
        while True:
            now = time.perf_counter()
            if deadline is not None:
                if now >= deadline:
                    return
            elif remaining <= 0:
                return
            else:
                remaining -= 1
            results.append(await stream(session, url, workload.payload(next(ids)), *settings.limit(now, deadline)))
            progress(len(results), None if deadline else settings.requests or max(8, 4 * concurrency),
                     time.perf_counter() - start)

    tasks = [asyncio.create_task(worker()) for _ in range(concurrency)]
    interrupted = False
    try:
        await asyncio.gather(*tasks)
    except asyncio.CancelledError:
        interrupted = True
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return results, time.perf_counter() - start, interrupted


async def _idle_draw(watch: Watch, seconds: float) -> float | None:
    """The GPUs' summed mean power over seconds with nothing sent."""
    watch.begin()
    try:
        await asyncio.sleep(seconds)
    finally:
        gpus, _ = watch.end()
    return gpu_watts(gpus)


async def run(sweep: Sweep, watch: Watch, progress: Callable[[int, int, int | None, float], None],
              before_step: Callable[[int], None] | None = None) -> Sweep:
    """before_step(i), when given, runs before step i is timed (tune sets the GPUs' setting there)."""
    settings = sweep.settings
    # no pool cap: a thousand streams need a thousand connections; an engine on a Unix socket (an http+unix URL:
    # serving/compose/enginesock.py) is asked by plain http:// paths over it
    unix = unixsock.path_of(settings.base_url)
    connector = aiohttp.UnixConnector(unix, limit=0) if unix else aiohttp.TCPConnector(limit=0)
    # Each request's total deadline is stream()'s (Settings.limit); the session times only the connect.
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=CONNECT_TIMEOUT_S)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        base = "http://localhost" if unix else settings.base_url.rstrip("/")
        served = await _models(session, base)
        wanted = settings.workload.model
        if wanted and wanted not in served:
            raise BenchError(f"model {wanted!r} is not served at {base}; it serves: {', '.join(served) or 'nothing'}",
                             exit_code=EX_CONFIG)
        if not served:
            raise BenchError(f"{base}/v1/models lists no model")
        sweep.model = wanted or served[0]
        workload = replace(settings.workload, model=sweep.model)
        url = base + workload.path
        try:
            if settings.idle_s > 0:
                sweep.idle_w = await _idle_draw(watch, settings.idle_s)
            workload = await _calibrate(session, url, workload, settings, sweep.notes)
            ids = itertools.count()
            for _ in range(settings.warmup):
                await stream(session, url, workload.payload(next(ids)), *settings.limit())
            through = await joules.read(session, base) is not None  # gpuwarden's proxy: joules per request
            if not through:
                sweep.notes.append(joules.NOT_THROUGH)
            for index, concurrency in enumerate(settings.concurrency):
                if before_step is not None:
                    before_step(index)
                watch.begin()
                before = await joules.settled(session, base) if through else None  # the warm-up's final too
                results, duration, interrupted = await _step(
                    session, url, settings, workload, concurrency, ids,
                    lambda done, total, elapsed, c=concurrency: progress(c, done, total, elapsed))
                gpus, engine = watch.end()
                step = summarize_step(concurrency, results, duration, interrupted)
                step.update(gpus=gpus, engine=engine, flags=step_flags(gpus, None),
                            activity=step_activity(gpus, step["ok"]))
                step.update(step_energy(step, sweep.idle_w))
                if before is not None:  # the step's requests, once the proxy has settled their joules
                    after = await joules.settled(session, base)
                    step.update(joules.step_joules(before, after))
                    sweep.notes += joules.doubts(step, after)
                sweep.steps.append(step)
                if interrupted:
                    sweep.interrupted = True
                    break
        except asyncio.CancelledError:  # between steps (calibration, warm-up)
            sweep.interrupted = True
        finally:
            sweep.notes += watch.refusals()  # answers of /status that were not the daemon's, said once
        sweep.settings = replace(settings, workload=workload)
    return sweep
