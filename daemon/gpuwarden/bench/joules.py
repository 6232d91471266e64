"""Each step's joules per request (docs/serving/joules.md): where bench runs through gpuwarden's proxy, its own
/metrics has the histogram of each request's joules (proxy/joules.py); bench reads it before and after each step,
and the step's median, p90 and p99 come from the difference, as Prometheus's histogram_quantile reads buckets (a
straight line within a bucket). A request's joules come a poll or two after it ends (its intervals must settle), so
bench waits, SETTLE_S at most, for the proxy to have none pending (gpuwarden_proxy_joules_pending_requests 0) before
and after each step. Straight to the engine there is no such
histogram: no figure, said once."""

from __future__ import annotations

import asyncio
import math
import re

import aiohttp

HISTOGRAM = "gpuwarden_proxy_request_joules"
SETTLE_S = 15.0  # a poll or two in the usual case; a busy proxy or daemon may take longer
READ_MAX = 4 << 20  # the proxy's /metrics is some KiB
LINE = re.compile(r'^gpuwarden_proxy_request_joules_(bucket|sum|count)\{([^}]*)\} (\S+)$')
PENDING = re.compile(r'^gpuwarden_proxy_joules_pending_requests (\S+)$', re.M)
NOT_THROUGH = ("no joules per request: bench did not run through gpuwarden's proxy (the server's /metrics has no "
               "gpuwarden_proxy_request_joules); point --url at the proxy for them")


def parse(text: str) -> dict | None:
    """The histogram summed over its models: {"buckets": {upper bound: cumulative count}, "sum", "count"}; None: the
    page has none."""
    found, buckets, total, count = False, {}, 0.0, 0.0
    for line in text.splitlines():
        found = found or line == f"# TYPE {HISTOGRAM} histogram"  # before its first request: no sample yet
        match = LINE.match(line)
        if not match:
            continue
        found = True
        kind, labels, value = match.group(1), match.group(2), float(match.group(3))
        if kind == "bucket":
            le = re.search(r'le="([^"]*)"', labels)
            bound = math.inf if le is None or le.group(1) == "+Inf" else float(le.group(1))
            buckets[bound] = buckets.get(bound, 0.0) + value
        elif kind == "sum":
            total += value
        else:
            count += value
    pending = PENDING.search(text)
    return {"buckets": buckets, "sum": total, "count": count,
            "pending": float(pending.group(1)) if pending else 0.0} if found else None


def quantile(buckets: dict[float, float], q: float) -> float | None:
    """histogram_quantile over cumulative buckets; None with no observation."""
    bounds = sorted(buckets)
    if not bounds or buckets[bounds[-1]] <= 0:
        return None
    rank, lower, below = q * buckets[bounds[-1]], 0.0, 0.0
    for bound in bounds:
        if buckets[bound] >= rank:
            if math.isinf(bound):
                return lower  # past the last finite bucket: its bound, as Prometheus says
            within = buckets[bound] - below
            return lower + (bound - lower) * ((rank - below) / within if within else 1.0)
        lower, below = bound, buckets[bound]
    return None


def step_joules(before: dict | None, after: dict | None) -> dict:
    """The step's figures from two readings: its requests counted, their mean, p50, p90 and p99 joules."""
    if before is None or after is None:
        return {}
    count = after["count"] - before["count"]
    if count <= 0:
        return {"joules_requests": 0}
    buckets = {b: after["buckets"].get(b, 0.0) - before["buckets"].get(b, 0.0) for b in after["buckets"]}
    return {"joules_requests": int(count), "joules_per_request_mean": (after["sum"] - before["sum"]) / count,
            **{f"joules_per_request_p{round(q * 100)}": quantile(buckets, q) for q in (0.5, 0.9, 0.99)}}


def doubts(step: dict, after: dict | None) -> list[str]:
    """What makes a step's joules per request not bench's alone, said with the step (attacker 51): the proxy's
    histogram is the whole proxy's, so another client's requests in the step count in it; a request still pending
    at SETTLE_S is missing from it."""
    said, where = [], f"step at concurrency {step['concurrency']}"
    if after is not None and after["pending"] > 0:
        said.append(f"{where}: the proxy still had {after['pending']:g} requests without their final joules after "
                    f"{SETTLE_S:g} s; the step's joules per request leave them out")
    counted = step.get("joules_requests")
    if counted is not None and counted != step["ok"]:
        said.append(f"{where}: the proxy gave joules to {counted} requests, {step['ok']} of bench's succeeded: "
                    "another client's requests share the proxy, or some had no energy reading; the step's joules "
                    "per request are the proxy's, not bench's alone")
    return said


async def read(session: aiohttp.ClientSession, base: str) -> dict | None:
    """The proxy's histogram now; None where the server has none (or its /metrics does not answer)."""
    try:
        async with session.get(base + "/metrics", timeout=aiohttp.ClientTimeout(total=10)) as reply:
            if reply.status != 200:
                return None
            body = await reply.content.read(READ_MAX)
    except (aiohttp.ClientError, asyncio.TimeoutError):
        return None
    return parse(body.decode("utf-8", "replace"))


async def settled(session: aiohttp.ClientSession, base: str) -> dict | None:
    """The histogram once no counted request is pending at the proxy (every one before now final), SETTLE_S at
    most; None: the server has none."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + SETTLE_S
    while True:
        now = await read(session, base)
        if now is None or now["pending"] <= 0 or loop.time() >= deadline:
            return now
        await asyncio.sleep(0.25)
