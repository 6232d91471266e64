"""The engine's prefix-cache counters beside the proxy's own: its /metrics read every SCRAPE_EVERY_S, every
SCRAPE_RETRY_S while it cannot be read (starting, restarting), so its counters appear soon after it does; within a
deadline and a size cap, parsed off the loop (server.ProxyMetrics serves them)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import aiohttp

from ..base.httpget import HttpError, read_capped
from ..serving.probe.metrics import parse

log = logging.getLogger("gpuwarden.proxy")
SCRAPE_EVERY_S, SCRAPE_RETRY_S, SCRAPE_DEADLINE_S, SCRAPE_MAX_BYTES = 15.0, 2.0, 5.0, 8 << 20


async def scrape_forever(session: aiohttp.ClientSession, upstream: str, path: str, metrics,
                         planned: Callable[[], bool] = lambda: False) -> None:
    """planned: the engine is away by the daemon's word (a planned stop, a rest): losing its counters is said at
    info, not as a fault."""
    while True:
        await scrape_once(session, upstream, path, metrics, planned)
        await asyncio.sleep(SCRAPE_EVERY_S if metrics.engine_up else SCRAPE_RETRY_S)


async def scrape_once(session: aiohttp.ClientSession, upstream: str, path: str, metrics,
                      planned: Callable[[], bool] = lambda: False) -> None:
    try:
        async with session.get(upstream + path, timeout=aiohttp.ClientTimeout(total=SCRAPE_DEADLINE_S)) as reply:
            if reply.status != 200:
                raise ValueError(f"answered {reply.status}")
            body = await read_capped(reply.content, SCRAPE_MAX_BYTES, path)
        text = body.decode("utf-8", "replace")
        # Parsing 50 KB takes milliseconds: off the loop, so no stream waits for it.
        # Only the two counters it serves are parsed: the engine is serve.user's, and a /metrics of 8 MiB of distinct
        # names cost a parse seconds and 200 MB (attacker 8's finding 6).
        wanted = {name for name in metrics.prefix_names if name}
        metrics.engine = await asyncio.get_running_loop().run_in_executor(None, parse, text, wanted)
        if not metrics.engine_up:
            log.info("proxy: reading the engine's prefix-cache counters from %s", upstream + path)
        metrics.engine_up = 1
    except (aiohttp.ClientError, asyncio.TimeoutError, HttpError, ValueError, OSError) as exc:
        if metrics.engine_up:  # once per outage, not once per retry
            log.log(logging.INFO if planned() else logging.WARNING, "proxy: the engine's %s cannot be read: %s", path,
                    exc or type(exc).__name__)
        metrics.engine_up, metrics.engine = 0, None
