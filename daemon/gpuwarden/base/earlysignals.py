"""Signals that arrive before the daemon's loop can take them.

Python starts with SIGHUP, SIGTERM and SIGUSR2 at their default action (end the process) and SIGINT raising
KeyboardInterrupt. The daemon's own handlers come once its loop exists, after imports, the config and
NVML: seconds on a busy host. A `systemctl reload` or a logrotate in that window would kill it with
status 129 and no log line. So the entry points call hold() first: until the loop takes over, the three
signals are only written down. take() hands them to the loop, which then deals with them in order;
release() gives a command that is not the daemon its default signals back, and delivers what was held.
SIGUSR2 asks the daemon to hand over to the installed code (serving/run/handover.py).
"""

from __future__ import annotations

import signal

SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR2)  # SIGUSR2: hand over (an upgrade)
_held: list[int] = []
_previous: dict[int, object] = {}
_before_exec: set[int] = set()  # pending at hold(): sent before this image began, blocked across an execv


def _note(signum: int, _frame) -> None:
    _held.append(signum)


def hold() -> None:
    """From now on the signals are only written down (first thing in the process). A handover (re-exec)
    blocked them across execv (block_for_exec): they were kept pending, and arrive now, written down."""
    for sig in SIGNALS:
        _previous.setdefault(sig, signal.signal(sig, _note))
    _before_exec.update(signal.sigpending() & set(SIGNALS))
    signal.pthread_sigmask(signal.SIG_UNBLOCK, SIGNALS)


def block_for_exec() -> None:
    """Before execv: the new image starts with every handler at its default action (end the process) until its
    hold(); blocked, the signals wait for it instead. The mask survives exec."""
    signal.pthread_sigmask(signal.SIG_BLOCK, SIGNALS)


def sent_before_exec(sig: int) -> bool:
    """sig was waiting when hold() unblocked it: sent before this image's code was loaded (across a handover's
    execv), so a SIGUSR2 among them asked for the code this image runs."""
    return sig in _before_exec


def take() -> list[int]:
    """The signals written down so far, in order (the daemon's loop installs its own handlers first)."""
    taken = list(_held)
    del _held[:]
    return taken


def original(sig: int, current):
    """What a handler being replaced stands for: the handler from before hold(), where current is hold()'s."""
    return _previous.get(sig, current) if current is _note else current


def release() -> None:
    """Not the daemon: the default handlers again, and any signal that arrived meanwhile delivered now."""
    for sig, old in _previous.items():
        signal.signal(sig, old)
    _previous.clear()
    for signum in take():
        signal.raise_signal(signum)
