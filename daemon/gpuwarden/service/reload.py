"""A new config on disk, checked whole before it replaces the running one: a reload (SIGHUP) planned before
anything changes, and the config a handover's (SIGUSR2) new image would start with. On any error the daemon
keeps running what runs, and says why in one line.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass

from ..base.yamlfile import InvalidConfig
from ..config import Config
from ..serving.run.runtime import ServingRuntime
from ..tune.tuning import Plan, TuningLife

log = logging.getLogger("gpuwarden")

# Settings a reload cannot change in a running daemon.
RESTART_ONLY = ("gpu", "metrics", "counters_interval_s")


@dataclass(frozen=True)
class Reload:
    """A reloaded config that fits, nothing changed yet: what the daemon then carries out."""

    config: Config  # with the running values of the restart-only settings
    tuning: Plan
    serving_step: Callable[[float], None] | None  # None: no child to restart (the serving is reset)
    kept: list[str]  # restart-only settings the file changed: the running values stay


def plan_reload(new: Config, running: Config, tuning: TuningLife, serving: ServingRuntime) -> Reload:
    """The reload of `new` over the running config; InvalidConfig where it does not fit."""
    kept = [key for key in RESTART_ONLY if getattr(new, key) != getattr(running, key)]
    new = dataclasses.replace(new, **{key: getattr(running, key) for key in kept})
    plan = tuning.check(new)
    # lint only, with the installed versions from the cache (read again before this, off the loop, where they
    # changed): nothing here waits on the engine's interpreter
    return Reload(new, plan, serving.plan_reload(new), kept)


def refusal(exc: Exception) -> str:
    """Why a config was refused, in one line: its first problem (and how many more), or what went wrong checking
    it (RecursionError, MemoryError, a bug)."""
    if isinstance(exc, InvalidConfig):
        more = f" (and {len(exc.errors) - 1} more)" if len(exc.errors) > 1 else ""
        return f"{exc.errors[0]}{more}"
    return f"{type(exc).__name__}: {exc}"


def handover_refused(check: Callable[[], object]) -> bool:
    """SIGUSR2: the new image checks the config at start as Daemon.check does (adopting: lint at error level and
    flag facts, not the engine's parser), and exits 78 on a refusal, its engine orphaned: so check first, from the
    cache only (this is the main loop), and stay where it would refuse. True (said in one line) when it would."""
    try:
        check()
    except Exception as exc:  # staying is never worse
        verdict = "would not start" if isinstance(exc, InvalidConfig) else "cannot be checked"
        log.error("SIGUSR2: no handover, the config on disk %s: %s; this daemon keeps running", verdict,
                  refusal(exc))
        return True
    return False
