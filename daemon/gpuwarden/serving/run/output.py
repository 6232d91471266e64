"""A child's output, line by line: logged at the level the child gave it (the child's kind knows its format:
ChildSpec.log_level), and its last error lines kept for the FATAL line and for telling a lost port. Text for
people: the daemon reads no word of a child's from it (a front's answers come on its word pipe: word.py)."""

from __future__ import annotations

import logging
import re
from collections import deque
from collections.abc import Callable

log = logging.getLogger("gpuwarden")


class ChildOutput:
    def __init__(self, name: str, level_of: Callable[[str], int | None]):
        self.name, self.level_of = name, level_of
        self.error_lines: deque[str] = deque(maxlen=10)
        self._last_level = logging.INFO

    def on_line(self, line: str) -> None:
        level = self.level_of(line)
        if level is not None:
            self._last_level = level
        # Lines without a level (traceback bodies) keep the level of the line they follow.
        log.log(self._last_level, "%s: %s", self.name, line)
        if self._last_level >= logging.WARNING or re.search(r"Error|Exception", line):
            self.error_lines.append(line[:1000])
