"""The proxy's fault log (base/faultlog.py): faults that come once per request (a bad body, a slow client, an
engine that is down) logged once per kind per minute, with a count, and what aiohttp and asyncio log themselves
about clients counted the same way (quiet(LOUD_LOGGERS))."""

from __future__ import annotations

import logging
import time

from ..base.faultlog import PERIOD_S, FaultLog

log = logging.getLogger("gpuwarden.proxy")
# Where aiohttp and asyncio log what clients do to them.
LOUD_LOGGERS = ("aiohttp.server", "aiohttp.web", "aiohttp.access", "aiohttp.internal", "asyncio")
FIRST = "proxy: {last}"
MORE = "proxy: {count} more {kind} in the last {period:g} s; the last: {last}"


def proxy_faults(period_s: float = PERIOD_S, clock=time.monotonic) -> FaultLog:
    """The proxy's: a period for each kind of fault, its first told as its own message."""
    return FaultLog(log, FIRST, MORE, period_s, clock)
