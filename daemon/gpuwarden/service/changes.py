"""The changes an operator asks a running daemon for by signal: a reload of the config (SIGHUP) and a handover to
the installed code (SIGUSR2, an upgrade's postinst). Each is checked whole before anything changes (reload.py), the
engine's own parser off the loop where the engine would start anew (reload.Waiting); a refused one leaves what
runs as it is, in one line.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from ..backends import would_open
from ..config import Config
from ..gpu.errors import GpuError
from . import adoption
from .metrics_port import refuse_unbindable
from .proxy_port import refuse_unlistenable
from .reload import Reload, Waiting, carry_out

if TYPE_CHECKING:
    from .daemon import Daemon

log = logging.getLogger("gpuwarden")


class Changes:
    """A daemon's reload and handover: what was asked (a SIGHUP waits for the next poll, any number of them one
    reload), what waits for the engine's parser, and whether the loop ends for the handover. It carries a change
    out through the daemon's parts and sets the daemon's config; it never stops the daemon or a child itself, and
    never waits on the loop for a check."""

    def __init__(self, daemon: Daemon):
        self.daemon = daemon
        self.reload_asked = False  # a SIGHUP came: the next tick reloads
        self.waiting = Waiting(daemon.serving)  # a reload or a handover waiting for the engine's parser
        self.handing_over = False  # a SIGUSR2 came: the loop ends and the installed code takes over (re-exec)

    def tick(self) -> None:
        """A SIGHUP planned; carried out once nothing is left to check (the engine's parser: the engine serves on)."""
        if self.reload_asked and not self.daemon.serving.reloads.rereading:
            self.reload_asked = False
            self.reload()
        elif (step := self.waiting.reload_ready()) is not None:
            self.apply(step)

    def check_handover(self, config: Config):
        """The daemon's check() of the config on disk as the new image's start runs it (adopting: not deep, from the
        cache), the metrics address it would bind (metrics_port.refuse_unbindable), and the GPU backend it opens
        first (backends.would_open: NVML in a new process, on the loop, within its deadline). The serving launch,
        or None."""
        refuse_unbindable(config, self.daemon.metrics.settings.listen)
        refuse_unlistenable(config, handover=True)
        launch = self.daemon.check(config, deep=False, on_loop=True)[1]
        self.daemon.serving.reloads.refuse_taken_port(config, launch)
        try:  # what the new image opens before anything else (cli/run.py): its GPU backend, in a new process
            would_open(config)
        except GpuError as exc:
            raise config.error(("gpu", "backend"), f"{config.gpu.backend}: the new image could not open it: {exc}") \
                from None
        return launch

    def handle_usr2(self) -> None:
        """Hand over to the installed code (an upgrade): the loop ends, cli re-executes this process, and the new image
        adopts its children (serving/run/handover.py); once checked whole (Waiting: then run() calls hand_over)."""
        if self.handing_over:  # more of them in one wake-up of the loop: one handover, said once
            return
        if self.daemon.stopping:
            log.warning("SIGUSR2 received while stopping: no handover")
            return
        load = self.daemon.reload_config
        if self.waiting.handover_asked(load and (lambda: self.check_handover(load()))):
            self.hand_over()

    def hand_over(self) -> None:
        """Set the handover going (adoption.hand_over): the loop ends, and cli re-executes this process."""
        adoption.hand_over(self.daemon.serving, self.daemon.notifier)
        self.handing_over = True

    def handle_hup(self) -> None:
        """A reload is asked for; the next poll carries it out, so that any number of SIGHUPs in a row cost at
        most one reload per poll and the loop keeps its schedule (and the watchdog its food)."""
        self.reload_asked = True

    def reload(self) -> None:
        """Reload: load, validate and prepare everything first, the engine's own parser included where the engine
        starts anew (off the loop: Waiting); on any error keep running what runs. Carried out (apply) at once where
        nothing is left to check, else by the tick once the parser has answered; asked again where the installed
        versions are read first."""
        daemon = self.daemon
        if daemon.reload_config is None:
            log.warning("SIGHUP received, but this daemon has no config file to reload")
            return
        if daemon.stopping:
            log.warning("SIGHUP received while stopping: ignored")
            return
        self.reload_asked = self.waiting.reload_asked(daemon.reload_config, daemon.config, daemon.tuning)
        if (step := self.waiting.reload_ready()) is not None:
            self.apply(step)

    def apply(self, step: Reload) -> None:
        """Carry out a reload that passed every check (reload.carry_out), from this poll on."""
        daemon = self.daemon
        daemon.config = step.config
        carry_out(step, daemon.monitor, daemon.recovery, daemon.tuning, daemon.serving, daemon.clock())
        daemon.proxy_port.follow(daemon.config)  # no proxy any more: its port let go
