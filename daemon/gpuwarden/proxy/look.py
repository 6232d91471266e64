"""The engine's /health, looked at for every asker of the proxy at once: a request that found the engine refusing
(hold.py: is it down?), a connection that broke mid-answer (relay.py, server.py: did the engine end?), the book of
ends (ends.py). One look at a time, at most one a tick (HEALTH_EVERY_S) whatever the crowd, shielded so that a client
that leaves cancels it for nobody; `since` asks for a look begun then or later (an answer from before a connection
broke says nothing of the engine's end)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

HEALTH_EVERY_S = 0.5


class HealthLook:
    def __init__(self, engine_answers: Callable[[], Awaitable[bool | None]], clock=time.monotonic):
        """engine_answers: whether the engine's /health says it is up now, within a short deadline (None: it did
        not answer in time; server.answers)."""
        self.engine_answers, self.clock = engine_answers, clock
        self._probe: asyncio.Future | None = None  # the look under way or last, shared by every asker
        self._probed_at = 0.0

    async def look(self, since: float | None = None) -> bool | None:
        """True, False, or None for no answer in time. since: only a look begun then or later; None: a look of
        this tick, or one under way."""
        while True:
            now, probe = self.clock(), self._probe
            if probe is not None and (self._probed_at >= since if since is not None
                                      else not probe.done() or now - self._probed_at < HEALTH_EVERY_S):
                return await asyncio.shield(probe)  # a client that leaves does not cancel it for the others
            if probe is not None and not probe.done():  # begun before `since`: then the next look, shared too
                await asyncio.wait([probe])
                continue
            self._probe, self._probed_at = asyncio.ensure_future(self.engine_answers()), now

    async def ended(self, since: float) -> bool:
        """Whether the engine is gone (an end, for the book of ends: casualties.py): a look begun at since or later
        was refused, closed unanswered, or answered 5xx (vLLM's /health says 503 once its engine died).
        A look with no answer in time is no verdict, and no end: an engine busy with a crowd, or a pool of
        connections to it that clients fill, must not make the proxy count ends that never were (ends from
        timed-out looks would put the brake on for everyone)."""
        return await self.look(since) is False
