"""The word to the children in front of the engine (ChildSpec.fronts_engine: the proxy): that the engine begins a
planned stop (STOPPING_SIGNAL: it drains, its /health still answering while vLLM answers new requests 500, so the
proxy holds them unsent), that an engine is healthy (UP_SIGNAL: the proxy sends what it holds), and that the engine is
down and not restarted (DOWN_SIGNAL: FATAL until SIGHUP, or HELD for its GPU; the proxy answers 503 at once instead of
holding requests for hold_s, and sends nothing to a port no engine of ours holds).

The engine's SIGTERM waits for the fronts told of its stop to answer (holding or no-hold on their word pipe,
word.py, not taken back by released since) or to be gone, HEAR_S at most: a request a front forwards after the SIGTERM
meets vLLM 0.32 shutting down, which answers it 200 with no tokens (a busy box can run the proxy late, after both
went in one tick). A front whose word pipe the daemon has not (adopted without one kept) or that never answers
costs a stop HEAR_S. An engine that ends meanwhile is stopped at once, not restarted (supervisor.py).

Two signals pending at once are handled in no set order (a stop's word can be overtaken by the last word of health),
so each word goes to each front twice, a tick apart, and the proxy
takes a word it already follows as a no-op. A front that starts (or restarts) while the word stands is told it
once it is RUNNING. Only a front that is RUNNING and handles the signal is sent it: by default both end a process
(one not yet listening, or a proxy of an older gpuwarden adopted after an upgrade).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from .spec import DOWN_SIGNAL, REST_SIGNAL, STOPPING_SIGNAL, UP_SIGNAL

log = logging.getLogger("gpuwarden")
TIMES = 2  # each word to each front: once at once, once on the next tick
HEAR_S = 5.0  # the longest the engine's SIGTERM waits for its fronts' answer


class FrontWord:
    def __init__(self):
        self.planned = False  # the engine's stop began while it served: its fronts hold until it is back
        self._told: dict[str, tuple[int, int, int]] = {}  # front's name -> (its pid, the word, times told)
        self._asked: dict[str, tuple[int, int]] = {}  # front told of the stop -> (its pid, its answers before)
        self._until: float | None = None  # the engine's SIGTERM waits for the answers until then

    @property
    def waiting(self) -> bool:
        """The engine's stop is told and its SIGTERM waits for the fronts' answer (heard)."""
        return self._until is not None

    def stopping(self, fronts: Iterable, now: float) -> bool:
        """The engine is about to get its SIGTERM, serving: tell the fronts first. Whether it waits for their
        answer (a front was told)."""
        self.planned = True
        told = self._tell(fronts, STOPPING_SIGNAL)
        self._asked = {front.name: (front.child.pid, _answers(front)) for front in told}
        self._until = now + HEAR_S if told else None
        return bool(told)

    def heard(self, fronts: Iterable, now: float) -> bool:
        """Whether the engine's SIGTERM may go now: every front told has answered or is gone, or HEAR_S passed (the
        caller then ends the wait: stop_waiting)."""
        if self._until is None:
            return True
        running = {front.name: front for front in fronts if front.state == "RUNNING"}
        silent = [name for name, (pid, before) in self._asked.items() if name in running
                  and running[name].child.pid == pid and not _holds(running[name].word, before)]
        if silent and now < self._until:
            return False
        if silent:
            log.warning("%s did not say within %g s that it holds new requests: the engine stops anyway",
                        " and ".join(silent), HEAR_S)
        return True

    def stop_waiting(self) -> None:
        self._until = None

    def update(self, running: bool, stopping: bool, fronts: Iterable, down: bool = False,
               resting: bool = False) -> None:
        """Each tick: the standing word, to the fronts not told it twice (a new front process counts anew). While
        the engine's SIGTERM waits for the answer, the word is its stop; down: the engine is not restarted (FATAL,
        HELD); resting: it rests until a request comes (serve.idle: REST_SIGNAL, the proxy holds and wakes it)."""
        running, stopping = running and not self.waiting, stopping or self.waiting
        self.planned = self.planned and stopping
        word = UP_SIGNAL if running else STOPPING_SIGNAL if self.planned else REST_SIGNAL if resting else \
            DOWN_SIGNAL if down else None
        if word is not None:
            self._tell(fronts, word)

    def _tell(self, fronts: Iterable, word: int) -> list:
        """Send word to the fronts not told it twice; the fronts it went to."""
        told = []
        for front in fronts:
            if front.state != "RUNNING":
                continue
            pid = front.child.pid
            last = self._told.get(front.name)
            times = last[2] if last is not None and last[:2] == (pid, word) else 0
            if times < TIMES and front.ops.catches(pid, word):
                front.ops.kill(pid, word)
                self._told[front.name] = (pid, word, times + 1)
                told.append(front)
        return told


def _answers(front) -> int:
    return front.word.answers if front.word is not None else 0


def _holds(word, before: int) -> bool:
    """The front answered since the word (more answers than before), and no word that the engine is up, handled
    after the stop's, took it back (word.RELEASED): the word's repeat a tick later is answered anew. No word pipe:
    no answer."""
    return word is not None and word.answers > before and not word.released
