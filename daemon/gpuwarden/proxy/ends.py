"""The proxy's watch over the engine's ends, for the book of them (casualties.py): which requests were in flight at
an end, and when a request may go to the engine after one.

A request cut by the engine's end is found where its try fails (server.py). One the engine answered first is found
here: vLLM 0.32 answers the requests in flight when its EngineCore dies 500 (v1/engine/async_llm.py: the output
handler hands EngineDeadError to each; the API server's handler, entrypoints/serve/exception_handling/handlers/
vllm_error.py engine_error_handler, answers it 500 and asks the server to stop), a stream that began gets an error
event and [DONE] (its watchdog stops the server within 5 s: entrypoints/launchers/launcher.py watchdog_loop), and
only then does the process end. So after a failed answer, or any request that did not end cleanly (a suspect: its
client left mid-answer, before the error event was read; the engine broke it off, or closed it unanswered while its
/health still answered, a moment before it ended) (casualties.failed: a 5xx but 503, or a stream ending in an
error) the engine's /health is looked at every HEALTH_EVERY_S, the shared look (look.py), while the answer is
within END_AFTER_5XX_S: refused, or answered 5xx (vLLM says 503 once its engine is dead), it is an end,
and the request is in flight at it. A look with no answer in time is no end (look.HealthLook.ended). The daemon does
not tell the proxy of an end it restarts from (DOWN_SIGNAL is only FATAL or HELD), so the
proxy looks itself; one watcher at a time, whatever the crowd.

From an end until the engine's /health is seen answering again (Casualties.end_open), a request is sent only after
a look at /health answers: the dying server answers a new request 500 too (add_request raises EngineDeadError), so a
client's retry would fail and count at a second end of one death. It is held for the next engine instead (502 at
once without a hold).
"""

from __future__ import annotations

import asyncio

from aiohttp import web

from .casualties import Casualties, client_of
from .hold import Hold
from .look import HEALTH_EVERY_S


class Ends:
    def __init__(self, casualties: Casualties, hold: Hold):
        self.casualties, self.hold = casualties, hold
        self._watcher: asyncio.Task | None = None

    def cut(self, request: web.BaseRequest, sent_at: float) -> None:
        """A request sent at sent_at (the hold's clock) was in flight when the engine ended: into the book, by its
        address, method and path, never what it sent. A planned stop's end is nobody's."""
        if not self.hold.planned:
            self.casualties.note(client_of(request), sent_at, f"{request.method} {request.path}")

    def answered(self, request: web.BaseRequest, sent_at: float, status: int, tail: bytes = b"",
                 suspect: bool = False) -> None:
        """The engine answered a request sent at sent_at with status (a stream: its tail, casualties.tail_of). A
        failed answer is kept, and the engine watched for its end, unless it drains for a planned stop (vLLM then
        answers new requests 500). suspect: the request did not end cleanly, whatever its answer (its client left,
        the engine broke it off or closed it unanswered): kept and watched the same."""
        if self.hold.planned:
            return
        if self.casualties.answered(client_of(request), sent_at, f"{request.method} {request.path}", status, tail,
                                    suspect):
            if self._watcher is None or self._watcher.done():
                self._watcher = asyncio.get_running_loop().create_task(self._watch())

    def suspect(self, request: web.BaseRequest, sent_at: float) -> None:
        """A request sent at sent_at that the engine may have read did not end cleanly and had no answer (closed
        unanswered while /health answered: BROKE; timed out): a suspect, watched for an end as a failed answer."""
        self.answered(request, sent_at, 0, suspect=True)

    async def may_send(self) -> bool:
        """Whether a request may go to the engine now: no end seen since it was last seen healthy, or a look at its
        /health begun now answers (the hold's shared look: a crowd costs one)."""
        if not self.casualties.end_open:
            return True
        if await self.hold.engine_down(since=self.hold.clock()):
            return False
        self.casualties.engine_seen_up()
        return True

    async def _watch(self) -> None:
        while self.casualties.answers_pending:
            answered = await self.hold.health.look(since=self.hold.clock())
            if self.hold.planned:  # the daemon's word came meanwhile: this end is a planned stop's
                self.casualties.forget_answers()
                return
            if answered is False:  # refused, closed or 5xx: an end (no answer in time is none: look.py)
                self.casualties.engine_seen_down()
                return
            if answered:
                self.casualties.engine_seen_up()
            await asyncio.sleep(HEALTH_EVERY_S)

    async def stop(self) -> None:
        if self._watcher is not None:
            self._watcher.cancel()
            await asyncio.gather(self._watcher, return_exceptions=True)
