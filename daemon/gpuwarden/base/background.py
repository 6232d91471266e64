"""One call at a time on a worker thread, so the main loop starts work and never waits for it.

The loop calls start() when it wants a fresh answer and take() on later passes;
a call that is still running is simply not started again. Every call run here
must end by itself (the HTTP reads have a total deadline).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Outcome:
    value: Any = None
    error: BaseException | None = None
    started_at: float = 0.0
    finished_at: float = 0.0


class Background:
    def __init__(self, name: str, clock: Callable[[], float]):
        self.name = name
        self.clock = clock
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._done: Outcome | None = None

    @property
    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self, fn: Callable[..., Any], *args: Any) -> bool:
        """Run fn(*args) on a worker thread unless a call is still running; True if started."""
        if self.busy:
            return False
        started = self.clock()

        def work() -> None:
            try:
                outcome = Outcome(fn(*args), None, started, self.clock())
            except Exception as exc:  # handed to the loop, which decides what it means
                outcome = Outcome(None, exc, started, self.clock())
            with self._lock:
                self._done = outcome

        self._thread = threading.Thread(target=work, name=self.name, daemon=True)
        self._thread.start()
        return True

    def take(self) -> Outcome | None:
        """The finished call's outcome, once; None while running or when nothing finished."""
        with self._lock:
            done, self._done = self._done, None
        return done

    def discard(self) -> None:
        """Forget any finished outcome (a new child: an answer about the old one means nothing)."""
        self.take()
