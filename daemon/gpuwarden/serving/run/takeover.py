"""Taking back one child an earlier daemon left running (its entry in the children's record, serving/run/handover.py)
into the program the new config runs for it: the process proven ours (ProcessOps.adopt), its output and word pipes
read again, its state as recorded (Program.adopt), and whether the config still asks for what it runs."""

from __future__ import annotations

import logging

from . import handover
from .supervisor import Program
from .word import close_word

log = logging.getLogger("gpuwarden")


def take_over(program: Program, entry: handover.Recorded, fd: int | None, word_fd: int | None, now: float,
              how: str) -> bool | None:
    """True: taken back, the config asks for what it runs; False: taken back, but its command, environment or user
    changed since its start (to be replaced, as a reload would); None: not ours to take (said by ProcessOps.adopt),
    the pipes given back."""
    child = program.ops.adopt(entry, fd, program.on_line)
    if child is None:
        close_word(word_fd)
        return None
    if program.spec.fronts_engine:
        if word_fd is None:  # an older gpuwarden's front, or a pipe not kept
            log.info("%s (pid %d): adopted without its word pipe: its answers to a planned stop are not heard until "
                     "it restarts (a stop waits HEAR_S for it)", program.title, child.pid)
        program.listen_to(child, word_fd)
    else:
        close_word(word_fd)
    program.adopt(child, now, handover.started_wall(entry.start_ticks), how, entry.starting)
    if (entry.argv_sha256, entry.uid) != (handover.argv_digest(program.spec.argv), program.spec.runs_as.uid) \
            or entry.env_sha256 not in (None, handover.env_digest(program.spec.env)):
        log.info("%s's command, environment or user changed since it was started: replacing it, as a reload would",
                 program.title)
        return False
    return True
