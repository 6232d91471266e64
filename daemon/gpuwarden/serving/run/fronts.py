"""The word to the children in front of the engine (ChildSpec.fronts_engine: the proxy): that the engine begins a
planned stop (STOPPING_SIGNAL: it drains, its /health still answering while vLLM answers new requests 500, so the
proxy holds them unsent), and that an engine is healthy (UP_SIGNAL: the proxy sends what it holds).

Two signals pending at once are handled in no set order (the attacker of issue 40 saw a stop's word overtaken by
the last word of health in 13 of 60 rounds), so each word goes to each front twice, a tick apart, and the proxy
takes a word it already follows as a no-op. A front that starts (or restarts) while the word stands is told it
once it is RUNNING. Only a front that is RUNNING and handles the signal is sent it: by default both end a process
(one not yet listening, or a proxy of an older gpuwarden adopted after an upgrade).
"""

from __future__ import annotations

from collections.abc import Iterable

from .spec import STOPPING_SIGNAL, UP_SIGNAL

TIMES = 2  # each word to each front: once at once, once on the next tick


class FrontWord:
    def __init__(self):
        self.planned = False  # the engine's stop began while it served: its fronts hold until it is back
        self._told: dict[str, tuple[int, int, int]] = {}  # front's name -> (its pid, the word, times told)

    def stopping(self, fronts: Iterable) -> None:
        """The engine is about to get its SIGTERM, serving: tell the fronts first."""
        self.planned = True
        self._tell(fronts, STOPPING_SIGNAL)

    def update(self, running: bool, stopping: bool, fronts: Iterable) -> None:
        """Each tick: the standing word, to the fronts not told it twice (a new front process counts anew)."""
        self.planned = self.planned and stopping
        word = UP_SIGNAL if running else STOPPING_SIGNAL if self.planned else None
        if word is not None:
            self._tell(fronts, word)

    def _tell(self, fronts: Iterable, word: int) -> None:
        for front in fronts:
            if front.state != "RUNNING":
                continue
            pid = front.child.pid
            last = self._told.get(front.name)
            times = last[2] if last is not None and last[:2] == (pid, word) else 0
            if times < TIMES and front.ops.catches(pid, word):
                front.ops.kill(pid, word)
                self._told[front.name] = (pid, word, times + 1)
