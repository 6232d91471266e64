"""How long the engine has had no request, as the proxy sees every one (serve.idle, design/idle-engine.md): the
proxy's word `idle` (serving/run/word.py) once after_s has passed with none in flight and none begun, and again each
after_s while the quiet lasts (the daemon may have let one pass: a request of its own was running at the engine).
The daemon decides what to do with it (rest the engine); the proxy decides nothing. The clock is injected, so that a
test drives it."""

from __future__ import annotations

import time
from collections.abc import Callable


class Quiet:
    def __init__(self, after_s: float, say: Callable[[], object], clock: Callable[[], float] = time.monotonic):
        """after_s: the quiet that makes the word (0: never); say: what says it (word.say(word.IDLE))."""
        self.after_s, self.say, self.clock = after_s, say, clock
        self.in_flight = 0
        self.last = clock()  # the last request begun or ended, or the last word (the proxy's start counts as one)

    def began(self) -> None:
        self.in_flight += 1
        self.last = self.clock()

    def ended(self) -> None:
        self.in_flight = max(0, self.in_flight - 1)
        self.last = self.clock()

    def due_in(self) -> float | None:
        """Seconds until the word is due (0: now); None: never while a request is in flight, or off."""
        if self.after_s <= 0 or self.in_flight:
            return None
        return max(0.0, self.last + self.after_s - self.clock())

    def tick(self) -> bool:
        """Say the word if it is due; whether it was said now."""
        if self.due_in() != 0.0:
            return False
        self.last = self.clock()
        self.say()
        return True
