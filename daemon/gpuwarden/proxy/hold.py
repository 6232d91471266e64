"""Requests held while the engine is down: a planned restart (a reload, a new version), a crash or a
stall takes the engine away for seconds or minutes; a request that finds it refusing connections, or answering 503
(draining, starting), before a byte of the answer reached its client, waits here and is sent again once the engine
answers its /health.

A planned stop is told by the daemon (SIGUSR1: serving/run/supervisor.py): the engine drains, its /health still
answering while it refuses new requests (vLLM 0.32 answers them 500), so from then on a new request is held without
being sent, until the daemon says an engine is healthy (SIGUSR2) or /health is seen down and then up again. An
engine that was never seen down within hold_s of the word was not restarted after all: requests go to it again.
The proxy answers the word on its word pipe (serving/run/word.py), and the daemon waits for that answer before the
engine's SIGTERM, so that no request goes to an engine already shutting down.

An engine at rest (serve.idle: stopped while no request came) is told too (REST_SIGNAL): every new request is held
unsent, however long the rest has lasted, and the first held says `wake` on the word pipe, which starts the engine;
each request still waits its own hold_s at most.

A crash the daemon does not restart from (FATAL until SIGHUP, or HELD for its GPU) is told too (DOWN_SIGNAL): every
held request and every new one is answered 503 with Retry-After (NOT_RESTARTING_RETRY_S) at once, and nothing is sent
to the engine's port (no engine of ours holds it), until the daemon says an engine is healthy again.

Only a request the engine never saw is held (server.py, casualties.py): one in flight when the engine ended may be
what ended it, and is answered at once instead.

One watcher for all held requests reads /health every HEALTH_EVERY_S (look.py) while any is held, and sees clients
that left (dropped, their budget given back, within a tick). Bounds: `hold_s` from a request's first hold, `hold_max` at
once, and the body budget (body.py), where held bodies count; past any, 503 with Retry-After at once. The journal
gets two lines an outage, not one a request.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from aiohttp import web
from prometheus_client import Histogram

from ..config import IDLE_CLOCKS_BACK_S as CLOCKS_BACK_S
from ..serving.run import word
from .body import Refusal
from .look import HEALTH_EVERY_S, HealthLook

log = logging.getLogger("gpuwarden.proxy")
# An outage no held request waits for any more ends (said once) after this long, or hold_s if longer: a client that
# comes and goes costs two lines at most this often.
QUIET_S = 10.0
UP, GONE, CLOSING, NOT_RESTARTING = "up", "gone", "closing", "not restarting"
# A client's wait after a 503 while the engine is not restarted: an operator's SIGHUP or a GPU's reset, not seconds.
NOT_RESTARTING_RETRY_S = 30
WAKE_AGAIN_S = 5.0  # a rest's word that a request came, said again at most this often while requests come
# serve.idle's clocks: CLOCKS_BACK_S is the longest a held request waits for the daemon's word that the engine's
# clocks are back (config.py says why 10 s); past it the request goes to the engine at whatever clock it has (slow
# beats failed), and the wake is said again every WAKE_AGAIN_S until the word comes (a wake the daemon lost).


class Hold:
    def __init__(self, hold_s: float, hold_max: int, engine_answers: Callable[[], Awaitable[bool | None]],
                 held_seconds: Histogram, clock=time.monotonic):
        """engine_answers: whether the engine's /health says it is up now, within a short deadline (None: it did
        not answer in time; server.answers)."""
        self.hold_s, self.hold_max, self.engine_answers = hold_s, hold_max, engine_answers
        self.held_seconds, self.clock = held_seconds, clock
        self.waiting: dict[asyncio.Future, web.BaseRequest] = {}
        self.down_since: float | None = None  # the outage's start, None while the engine answers
        self.refused = self.gone = 0  # in this outage, for its closing line
        self._watcher: asyncio.Task | None = None
        self.health = HealthLook(engine_answers, clock)  # the shared look at /health (look.py)
        self.planned_since: float | None = None  # the daemon's word that the engine stops (a drain), until it is back
        self._seen_down = False  # since that word, /health was seen down: the next answer is a new engine
        self._answered_off = False  # without a hold, the word was answered (until the word that the engine is up)
        self.closing = False  # the proxy stops: a request held now, or later, is refused at once
        self.not_restarting = False  # the daemon's word: the engine is down for good (FATAL, HELD), until it is up
        self.resting = False  # the daemon's word: the engine rests (serve.idle) until a request wakes it
        # serve.idle's clocks: the resting engine still answers /health, so only the daemon's word (engine_up) ends
        # a rest's hold, once its GPUs' clocks are back; CLOCKS_BACK_S at most (a daemon gone): sent as it is
        self.rest_ends_on_word = False
        self.rest_max: int | None = None  # the most held at once at a clocks rest (None: no bound but the caller's)
        self.in_flight: Callable[[], int] = lambda: 0  # requests at the engine now (the proxy's quiet.py count)
        self._unconfirmed = False  # a clocks rest's hold ended without the daemon's word: say the wake until it comes
        self._nagger: asyncio.Task | None = None
        self._woken_at: float | None = None  # when this rest's wake was last said

    @property
    def on(self) -> bool:
        return self.hold_s > 0

    @property
    def planned(self) -> bool:
        """The engine drains for a planned stop, or rests: a new request is held without being sent to it."""
        return self.planned_since is not None or self.resting

    def engine_stopping(self) -> None:
        """The daemon's word (SIGUSR1) that the engine begins a planned stop: hold every new request from now. The
        answer on the word pipe (serving/run/word.py) is what the daemon waits for before it sends the engine
        SIGTERM; the line logged is for people."""
        if self.resting and self.rest_ends_on_word:  # a clocks rest's engine runs, and now stops: a planned stop
            self.resting, self._woken_at, self._unconfirmed = False, None, False
        if self.closing or self.planned or self._answered_off:  # each word comes twice (serving/run/fronts.py)
            return
        if not self.on:  # no hold: the answer alone, once until the engine is back
            self._answered_off = True
            word.say(word.NO_HOLD)
            log.info("proxy: the engine stops for a planned restart: no hold (--hold-s 0), requests go on to it")
            return
        self.planned_since, self._seen_down = self.clock(), False
        word.say(word.HOLDING)
        log.info("proxy: the engine stops for a planned restart: holding new requests while it drains")
        self._begin(self.planned_since)

    def engine_up(self) -> None:
        """The daemon's word (SIGUSR2) that an engine is healthy: the held requests go to it now. A stop's word
        answered before is taken back (word.RELEASED): this word can come just before it and be handled after it,
        and the daemon then waits for the stop's word repeated (serving/run/fronts.py)."""
        if self.planned_since is not None or self._answered_off:
            word.say(word.RELEASED)
            log.info("proxy: told the engine is up: the planned stop's word ends")
        if self.not_restarting:
            log.info("proxy: told the engine is healthy again: requests go to it")
        self.planned_since, self._answered_off, self.not_restarting = None, False, False
        self.resting, self._woken_at, self._unconfirmed = False, None, False
        if self.down_since is not None:
            self._end(UP)

    def engine_not_restarting(self) -> None:
        """The daemon's word (DOWN_SIGNAL) that the engine is down and not restarted until someone acts (FATAL,
        HELD): the held requests are answered 503 now, and so is every new one until an engine is healthy."""
        if self.closing or self.not_restarting:  # each word comes twice (serving/run/fronts.py)
            return
        self.not_restarting, self.planned_since, self._answered_off = True, None, False
        self.resting, self._woken_at = False, None
        log.warning("proxy: told the engine is not restarting (FATAL, or held for its GPU): answering 503 at once, "
                    "Retry-After %d s, until it is healthy again", NOT_RESTARTING_RETRY_S)
        for future in self.waiting:
            if not future.done():
                future.set_result(NOT_RESTARTING)

    def engine_resting(self) -> None:
        """The daemon's word (REST_SIGNAL) that the engine rests (serve.idle): hold every new request unsent until
        it is up, and say on the word pipe that requests wait (word.WAKE), now if some do (they came while it
        stopped)."""
        if self.closing or self.resting:  # each word comes twice (serving/run/fronts.py)
            return
        self.resting, self._woken_at, self.planned_since, self._answered_off = True, None, None, False
        self._unconfirmed = False
        log.info("proxy: the engine rests (serve.idle): the next request is held and wakes it")
        # a clocks rest's engine may have requests still running (sent before this word): they wake it too
        if self.waiting or (self.rest_ends_on_word and self.in_flight()):
            self._wake()

    def _wake(self) -> None:
        """Say that a request waits for the resting engine: once, and again WAKE_AGAIN_S later while requests come
        (a word the daemon did not hear is said anew)."""
        now = self.clock()
        if self._woken_at is not None and now - self._woken_at < WAKE_AGAIN_S:
            return
        self._woken_at = now
        log.info("proxy: a request for the resting engine: waking it (held up to %g s)", self.hold_s)
        word.say(word.WAKE)

    def refuse_if_not_restarting(self) -> None:
        """Refusal (503, Retry-After NOT_RESTARTING_RETRY_S) while the daemon says the engine is not restarting."""
        if self.not_restarting:
            self._refuse("engine_not_restarting", "the engine is down and not restarting until its operator acts "
                         "(gpuwarden says FATAL or held): retry later", NOT_RESTARTING_RETRY_S)

    def close(self) -> None:
        """The proxy stops: every held request is answered 503 at once, and so is any held later."""
        self.closing = True
        for future in self.waiting:
            if not future.done():
                future.set_result(CLOSING)

    async def engine_down(self, since: float | None = None) -> bool:
        """An engine answered 503, or closed the connection before it answered: whether it is down (draining,
        starting, gone; hold the request) rather than answering so itself with its /health up (pass its answer on,
        or 502). Asked of /health at most once a tick, whatever the crowd: an engine that says 503, or drops every
        request, while healthy costs no outage, no lines, no loop of retries. since: only a look begun then or later
        counts (a connection that broke at `since`: an answer from before says nothing of the engine's end). A look
        with no answer in time is down here: the request waits rather than going to an engine that does not answer."""
        if self.down_since is not None:
            return True
        return not await self.health.look(since)

    async def wait(self, request: web.BaseRequest, since: float) -> None:
        """Wait until the engine answers again (then return: send the request again). Refusal (503) past hold_s
        from `since` (the request's first hold) or past hold_max held at once; ConnectionResetError when the client
        leaves meanwhile. A planned stop's word that lapses at the request's hold_s returns (it is sent) instead."""
        now = self.clock()
        if self.closing:
            self._refuse("proxy_stopping", "the proxy is stopping: retry later")
        self.refuse_if_not_restarting()
        self._begin(now)
        if now - since >= self.hold_s:
            self._refuse("held_too_long", f"the engine did not come back within {self.hold_s:g} s (the proxy's "
                         "hold_s): retry later")
        # A clocks rest's engine is up: its hold lasts until the clocks are back (CLOCKS_BACK_S at most), and a burst
        # past hold_max waits with it rather than be refused (attacker 47, F3), up to rest_max (half the proxy's
        # connection cap: /health, /metrics and a new client still get in).
        if self.resting and self.rest_ends_on_word:
            if self.rest_max is not None and len(self.waiting) >= self.rest_max:
                self._refuse("held_too_many", f"the proxy holds {self.rest_max} requests already while the engine's "
                             "clocks come back (half its connection cap): retry later")
        elif len(self.waiting) >= self.hold_max:
            self._refuse("held_too_many", f"the engine is down and the proxy holds {self.hold_max} requests already "
                         "(its hold_max): retry later")
        future = asyncio.get_running_loop().create_future()
        self.waiting[future] = request
        if self.resting:
            self._wake()
        try:
            outcome = await asyncio.wait_for(future, since + self.hold_s - now)
        except asyncio.TimeoutError:
            if self.planned_since is not None and not self._seen_down:  # the word lapses: the engine never went down
                self._lapse()
                return
            self._refuse("held_too_long", f"the engine did not come back within {self.hold_s:g} s (the proxy's "
                         "hold_s): retry later")
        except asyncio.CancelledError:  # the handler of a client that left is cancelled (listener.Connection)
            self.gone += 1
            raise
        finally:
            self.waiting.pop(future, None)
            self.held_seconds.observe(self.clock() - now)
        if outcome == GONE:
            self.gone += 1
            raise ConnectionResetError("the client left while its request was held")
        if outcome == CLOSING:
            self._refuse("proxy_stopping", "the proxy is stopping: retry later")
        if outcome == NOT_RESTARTING:
            self.refuse_if_not_restarting()

    def _refuse(self, reason: str, message: str, retry_after: int = 1) -> None:
        self.refused += 1
        raise Refusal(503, reason, message, retry_after)

    def _begin(self, now: float) -> None:
        if self.down_since is not None:
            return
        self.down_since, self.refused, self.gone = now, 0, 0
        log.log(logging.INFO if self.resting else logging.WARNING, "proxy: engine %s: holding requests (up to %g s, "
                "%d at most)", "at rest" if self.resting else "down", self.hold_s, self.hold_max)
        self._watcher = asyncio.get_running_loop().create_task(self._watch())

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(HEALTH_EVERY_S)
            self._drop_gone()
            answers = await self.engine_answers()
            if self.down_since is None:  # ended meanwhile (engine_up)
                return
            if answers and self.planned_since is not None and not self._seen_down:
                if self.clock() - self.planned_since < self.hold_s:
                    continue  # the old engine still drains
                self._lapse()
                return
            # Only a refusal, a close or a 5xx is the engine seen down: a look with no answer in time is no
            # verdict (a busy box timed one out while the old engine drained, and the next 200, the draining engine's,
            # then ended the planned stop's hold: its held requests went to the engine that was stopping).
            self._seen_down = self._seen_down or answers is False
            if answers and self.resting and self.rest_ends_on_word:
                if self.clock() - self.down_since < CLOCKS_BACK_S:
                    continue  # the daemon puts the clocks back, then says the engine is up
                log.warning("proxy: no word within %g s that the resting engine's clocks are back: sending the held "
                            "requests to it as it is, and saying the wake again every %g s until the word comes",
                            CLOCKS_BACK_S, WAKE_AGAIN_S)
                self._unconfirmed = True
                self._nagger = asyncio.get_running_loop().create_task(self._nag())
            if answers:
                self.planned_since, self.resting = None, False  # an engine that answers rests no more
                self._end(UP)
                return
            if not self.waiting and self.clock() - self.down_since >= max(self.hold_s, QUIET_S):
                self._end(None)
                return

    async def _nag(self) -> None:
        """A clocks rest's hold ended without the daemon's word (CLOCKS_BACK_S): its wake may have been lost (a full
        pipe), and the engine serves at its lowest clock meanwhile. Say it again until the word comes (engine_up)."""
        while self._unconfirmed and not self.closing:
            await asyncio.sleep(WAKE_AGAIN_S)
            if self._unconfirmed and not self.closing:
                word.say(word.WAKE)

    def _lapse(self) -> None:
        """hold_s since the word, and the engine never seen down: it was not restarted after all. The requests held
        go to it (one whose own hold_s ends now included, rather than a 503 from an engine that serves)."""
        log.warning("proxy: the engine did not go down within %g s of its planned stop: sending requests to it "
                    "again", self.hold_s)
        self.planned_since = None
        self._end(UP)

    def _drop_gone(self) -> None:
        for future, request in self.waiting.items():
            if request.transport is None and not future.done():  # the client closed its connection
                future.set_result(GONE)

    def _end(self, outcome: str | None) -> None:
        took = self.clock() - self.down_since
        forwarded = 0
        for future in self.waiting:
            if not future.done():
                future.set_result(UP)
                forwarded += 1
        gone = f", {self.gone} gone before" if self.gone else ""
        if outcome == UP:
            log.info("proxy: engine back after %.1f s: %d held requests forwarded, %d refused%s", took,
                     forwarded, self.refused, gone)
        elif not self.resting:  # at rest it is down on purpose until a request comes
            log.warning("proxy: engine still down after %.1f s, no request held now: %d refused%s", took,
                        self.refused, gone)
        watcher, self.down_since, self._watcher = self._watcher, None, None
        if watcher is not None and watcher is not asyncio.current_task():
            watcher.cancel()  # ended by the daemon's word, not by the watcher

    async def stop(self) -> None:
        for task in (self._watcher, self._nagger):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
