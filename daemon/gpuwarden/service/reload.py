"""A new config on disk, checked whole before it replaces the running one: a reload (SIGHUP) planned before
anything changes, and the config a handover's (SIGUSR2) new image would start with. Where either would start the
engine anew, the engine's own parser must accept its flags first, as at a start: that check runs off the loop
(serving/run/deepcheck.py), and the reload or the handover waits for it (Waiting), the engine serving meanwhile. On
any error the daemon keeps running what runs, and says why in one line.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass

from ..base.yamlfile import InvalidConfig
from ..config import Config
from ..serving.run.deepcheck import due
from ..serving.run.runtime import Launch, ServingRuntime
from ..base.keptlistener import LISTENERS
from ..proxy.child import PROXY
from .proxy_port import refuse_unlistenable
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
    check: Launch | None = None  # what the engine's own parser must accept before anything changes


def plan_reload(new: Config, running: Config, tuning: TuningLife, serving: ServingRuntime) -> Reload:
    """The reload of `new` over the running config; InvalidConfig where it does not fit."""
    kept = [key for key in RESTART_ONLY if getattr(new, key) != getattr(running, key)]
    new = dataclasses.replace(new, **{key: getattr(running, key) for key in kept})
    if serving.clocks is not None:  # a plan made under a rest's low lock would judge gpu_clocks: auto on it
        serving.clocks.wake("a reload reads the tuning again")
    plan = tuning.check(new)
    refuse_unlistenable(new, handover=False)
    # lint, with the installed versions from the cache (read again before this, off the loop, where they changed):
    # nothing here waits on the engine's interpreter; its parser runs later, off the loop (Reload.check)
    step = serving.reloads.plan(new)
    return Reload(new, plan, step, kept, getattr(step, "check", None))


def carry_out(step: Reload, monitor, recovery, tuning: TuningLife, serving: ServingRuntime, now: float) -> None:
    """A reload that passed every check, carried out on the daemon's parts: the monitor's rules and its GPUs' waits,
    the health actions, the tuning, and serving (its planned step, or a reset of its backoff)."""
    if step.kept:
        log.warning("reload: %s only change on restart; keeping the running values", ", ".join(step.kept))
    # The operator reset the GPUs (or says they need none): a hold's wait, or an Xid 63's that serves on.
    if monitor.events.needs_reset or monitor.events.pending:
        log.info("reload: no GPU counts as waiting for a reset any more")
        monitor.gpus_were_reset()
    monitor.reconfigure(step.config)
    recovery.configure(step.config.health)
    tuning.reload(step.config, step.tuning)
    if step.serving_step is not None:
        step.serving_step(now)
    else:
        serving.reset(now)
    log.info("config reloaded from %s", ", ".join(step.config.files))


def refusal(exc: Exception) -> str:
    """Why a config was refused, in one line: its first problem (and how many more), or what went wrong checking
    it (RecursionError, MemoryError, a bug)."""
    if isinstance(exc, InvalidConfig):
        more = f" (and {len(exc.errors) - 1} more)" if len(exc.errors) > 1 else ""
        return f"{exc.errors[0]}{more}"
    return f"{type(exc).__name__}: {exc}"


def handover_refused(check: Callable[[], object]) -> bool:
    """SIGUSR2: the new image checks the config at start as Daemon.check does (adopting: lint at error level and
    flag facts, not the engine's parser), and exits 78 on a refusal, its engine orphaned; where the config asks for
    another engine command, it replaces the running engine with it. So check first: on the loop from the cache only,
    then the engine's parser off the loop (Waiting); stay where either refuses. True (said in one line) when one
    does."""
    try:
        check()
    except Exception as exc:  # staying is never worse
        verdict = "would not start" if isinstance(exc, InvalidConfig) else "cannot be checked"
        log.error("SIGUSR2: no handover, the config on disk %s: %s; this daemon keeps running", verdict,
                  refusal(exc))
        return True
    return False


class Waiting:
    """A reload and a handover that passed every check the loop runs itself, waiting for the engine's own parser (off
    the loop: serving/run/deepcheck.py) before anything that serves is stopped. A new SIGHUP replaces the waiting
    reload, a new SIGUSR2 the waiting handover; the loop asks on every pass and carries out what is ready. A refusal
    is said in one line, as any other reload's or handover's. One check runs at a time: a waiting reload goes first,
    and a handover that waits across a SIGHUP checks the config on disk again once the reload is settled (both read
    the same files, so they come to ask about the same command rather than end each other's check). A handover also
    waits while a restart of the engine is under way (ServingRuntime.replacing): the image after it adopts the
    engine that then runs, never one half stopped."""

    def __init__(self, serving: ServingRuntime):
        self.serving = serving
        self.deep = serving.deep
        self.reload: Reload | None = None
        self.handover = False  # a SIGUSR2 waits
        self._launch: Launch | None = None  # what its new image would start, where the engine's parser must see it
        self._check: Callable[[], Launch | None] | None = None  # the waiting handover's check of the files
        self._stale = False  # a SIGHUP read the files since the waiting handover did

    def reload_asked(self, load: Callable[[], Config], running: Config, tuning: TuningLife) -> bool:
        """SIGHUP: load the config on disk and plan its reload (plan_reload), which then waits here for the engine's
        parser where one is due; what the SIGHUP before waited for is not carried out. A refusal is said in one
        line. True: ask again once the installed versions are read (serving/run/replan.Replan.reread_installed)."""
        self.reload, self._stale = None, self.handover
        self.deep.forget()  # asked anew (a check already running for the same command is joined)
        try:
            new = load()
            if self.serving.reloads.reread_installed(new):
                return True
            self.reload = plan_reload(new, running, tuning, self.serving)
            if self.reload.check is not None:
                title = self.reload.check.command.engine.title
                log.info("reload: %s's parser checks the new flags before anything stops (%s serves meanwhile)",
                         title, title)
        except Exception as exc:  # InvalidConfig; RecursionError, MemoryError, a bug: still keep what runs
            LISTENERS[PROXY].unstage()  # a new proxy address it bound goes with it
            log.error("reload failed, still running the previous config: %s", refusal(exc))
        self._settled()
        return False

    def handover_asked(self, check: Callable[[], Launch | None] | None, again: bool = False) -> bool:
        """SIGUSR2: check (on the loop, from the cache) returns what the config on disk would serve (None: serving
        off; check None: no config file). True: hand over now; False: refused (said in one line), or waiting (said
        once) for the engine's parser, where the new image would start the engine anew, or for a restart of the
        engine under way. again: the same SIGUSR2's files read again after a SIGHUP (its answer not asked anew)."""
        self._check, self._stale = check, False
        found: list[Launch | None] = []
        if check is not None and handover_refused(lambda: found.append(check())):
            self.handover, self._launch = False, None
            self._settled()
            return False
        launch = found[0] if found else None
        self._launch = launch if due(launch, self.serving) else None
        if self._launch is None and not self.serving.replacing:
            self.handover = False
            self._settled()
            return True
        if not self.handover and self._launch is not None:
            log.info("SIGUSR2: the config on disk starts %s anew: its parser checks the flags before the handover "
                     "(this daemon serves on meanwhile)", self._launch.command.engine.title)
        elif not self.handover:
            log.info("SIGUSR2: a restart of the engine is under way: handing over once it is done")
        self.handover = True
        if self._launch is not None and not again:
            self.deep.forget()
        self._settled()
        return False

    def reload_ready(self) -> Reload | None:
        """The waiting reload once nothing is left to check (it waits no more); None: none waits, it still waits,
        or its flags were refused (said here)."""
        step = self.reload
        try:
            if step is None or (step.check is not None and not self.deep.accepted(step.check)):
                return None
        except Exception as exc:  # ConfigErrors: refused; anything else, staying is never worse
            log.error("reload failed, still running the previous config: %s", refusal(exc))
        else:
            self.reload = None
            return step
        self.reload = None
        return None

    def handover_ready(self) -> bool:
        """True once the waiting handover has nothing left to wait for (it waits no more); False: none waits, it
        still waits, or its flags were refused (said here: no handover)."""
        if not self.handover or self.serving.replacing or (self.reload is not None and self.reload.check is not None):
            return False  # none waits; or a restart under way, or a reload's check, goes first
        if self._stale:
            return self.handover_asked(self._check, again=True)
        if self._launch is not None:
            launch, answer = self._launch, []
            if handover_refused(lambda: answer.append(self.deep.accepted(launch))):
                self.handover, self._launch = False, None
                return False
            if not answer[0]:
                return False  # the parser has not answered yet
        self.handover, self._launch = False, None
        return True

    def _settled(self) -> None:
        """Where nothing waits for the engine's parser any more, a check still running is ended."""
        if self._launch is None and (self.reload is None or self.reload.check is None):
            self.deep.unasked()

    def drop(self) -> None:
        """The daemon stops: nothing waiting is carried out (the stop ends the check with the other helpers)."""
        for what in (["SIGHUP's reload"] if self.reload else []) + (["SIGUSR2's handover"] if self.handover else []):
            log.info("%s was waiting: not carried out, the daemon stops", what)
        self.reload, self.handover, self._launch = None, False, None
