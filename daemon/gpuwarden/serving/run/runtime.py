"""Serving on a running daemon: the children, the replacement waiting for them to stop, the engine's metrics
reader and its stall watch, behind tick, reload, hold and stop. The daemon holds one ServingRuntime and
knows nothing of its parts.

A start or a reload is prepared first (prepare_launch: engine, profile, lint, identity, secrets, the specs
of every child), so that a bad config is refused before anything stops; carrying it out never fails that
way. The children are kinds of a registry (serving/run/kinds.py): the engine's part, and the side kinds the
daemon hands in (`sides`: serving/ sits below the proxy's package and does not import it). A reload restarts
only the kinds whose spec changed; a change of the engine's part restarts them all.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from ...config import Config
from ...gpu.base import GpuBackend
from ...base.yamlfile import ConfigErrors
from ..compose.command import ServeCommand
from ..lint.findings import INFO
from ..probe.metrics import MetricsReader, ServingStats
from ..compose.prepare import prepare_serve
from . import handover
from .deepcheck import DeepCheck
from .energyfeed import EnergyFeed, feed_path
from .replan import Replan
from .kinds import ENGINE_PART, ChildKind, EngineParts, side_specs
from .holding import waiting_for
from .leftovers import Leftovers
from .processes import ProcessOps
from .spec import ChildSpec, other_drain
from ..probe.stall import Progress, StallWatch
from .takeover import take_over
from .resting import each_tick
from .word import close_word, kept_word
from .supervisor import (BACKOFF, FATAL, HELD, RESTING, RUNNING, STARTING, STOPPING, Program, ServingView,
                         Supervisor)

log = logging.getLogger("gpuwarden")


@dataclass(frozen=True)
class Launch:
    """Everything a start needs, checked: the children's specs and what watching the engine needs."""

    config: Config
    command: ServeCommand  # the engine's composed command: its metrics path, model name and key
    engine: ChildSpec
    sides: tuple[ChildSpec, ...] = ()
    image: str | None = None  # a container engine's image ID as it was read for this launch (None: unknown)


def prepare_launch(config: Config, backend: GpuBackend, sides: Sequence[ChildKind], deep: bool,
                   on_loop: bool = False) -> Launch:
    """Engine, profile, GPUs, lint, spawnability (and with deep, the engine's own parser), logged as a start
    logs them. Raises ConfigErrors when something would block the start. on_loop: from the daemon's loop (a
    reload), which must not wait on the engine's interpreter."""
    prepared = prepare_serve(config, backend, deep=deep, create_home=True, on_loop=on_loop, starting=deep)
    title = prepared.command.engine.title
    if prepared.home_note:
        log.info("%s's user %s", title, prepared.home_note)
    if prepared.installed is not None:
        log.info("%s: %s", title, prepared.installed.describe())
    for finding in prepared.findings:  # a fact the lint could not read is said, not warned of
        log.log(logging.INFO if finding.severity == INFO else logging.WARNING, "%s lint %s", title, finding)
    if prepared.command.drain.note:  # how a stop treats the requests in flight, where not as serve.drain_s says
        log.log(prepared.command.drain.level, "%s", prepared.command.drain.note)
    problems = prepared.blocking(config)
    if problems:
        raise ConfigErrors(problems)
    if prepared.flags is not None:
        log.info("%s %s accepts the flags (checked with %s)", title, prepared.flags.version, prepared.flags.python)
    chosen = {g.index for g in prepared.command.gpus}
    gpus = [g for g in backend.gpus() if g.index in chosen]
    version = prepared.installed.version(prepared.command.engine.name) if prepared.installed else None
    parts = EngineParts(prepared.command, prepared.identity, tuple(gpus), version)
    engine, *part = [spec for kind in ENGINE_PART if (spec := kind.build(config, parts)) is not None]
    sides = side_specs(config, prepared.identity, tuple(sides)).values()
    found = prepared.installed
    image = found.stamp[0] if config.serve.container and found is not None and found.known and found.stamp else None
    return Launch(config, prepared.command, engine, (*part, *sides), image)


def _as_recorded(launch: Launch, adoptable: handover.Record | None) -> ChildSpec:
    """The engine's spec; but where the engine a start adopts differs from it by the drain flag alone (spec.other_drain:
    its version unknown here, or started before drains), the spec it runs: the same command, adopted, not restarted."""
    other = other_drain(launch.engine, launch.command, launch.config.serve)
    entry = next((e for e in (adoptable.children if adoptable else ()) if e.name == launch.engine.name), None)
    if other is not None and entry is not None and entry.argv_sha256 == handover.argv_digest(other.argv):
        return other
    return launch.engine


def watchers(launch: Launch, clock) -> tuple[MetricsReader, StallWatch]:
    """The engine's /metrics reader and its stall watch for a launch: each probe authenticates as users do and
    writes only to a socket the engine's user owns."""
    engine, serve = launch.command.engine, launch.config.serve
    owner = launch.engine.identity.uid  # the engine's user: every probe writes only to its socket
    url = launch.engine.url  # its port, or its Unix socket (serving/compose/enginesock.py)
    reader = MetricsReader(url + engine.metrics_path, engine.metric_names, clock, owner=owner)
    stall_watch = StallWatch(serve.stall_after_s, serve.probe_after_s, serve.probe_timeout_s,
                             url + engine.completions_path, engine.served_model(serve, launch.command.argv),
                             clock, key=engine.api_key(launch.command.argv, launch.command.env), owner=owner)
    return reader, stall_watch


class ServingRuntime:
    """Serving on a running daemon: the launch that runs, its Supervisor of Programs, the launch that waits for
    them to stop (a reload), the engine's metrics reader and stall watch, and the record of what runs (Recorder).
    It owns the children; it never blocks the loop (a stop is a timed state, the engine's parser and its /health
    are asked off it) and never starts a child the checks of prepare_launch have not passed."""

    def __init__(self, backend: GpuBackend, sides: Sequence[ChildKind] = (), ops: ProcessOps | None = None,
                 clock: Callable[[], float] = time.monotonic, state_dir: Path | None = None,
                 keep_fd: Callable[[str, int | None], None] | None = None, clocks=None):
        self.backend = backend
        self.sides = tuple(sides)  # the side kinds of the registry, beside the engine's part (kinds.ENGINE_PART)
        self.ops = ops or ProcessOps()  # one for every child: it knows which processes we started
        self.clock = clock
        self.recorder = handover.Recorder(state_dir, keep_fd)  # the record of running children, for adoption
        self._stopping = False  # stop() came: whatever outlives this daemon is a leftover, not to adopt
        self.leftovers = Leftovers(self.ops)  # what an earlier daemon left that this one does not run
        self._busy = False  # something ran at the last tick: nothing running now calls for a look
        self.launch: Launch | None = None  # what runs now
        self.children: Supervisor | None = None
        self.pending: Launch | None = None  # the next launch, started once the running children have stopped
        self._kept: dict[str, Program] = {}  # side programs the pending launch runs on as they are (the proxy)
        self.reader: MetricsReader | None = None  # the engine's /metrics
        self.stall_watch: StallWatch | None = None  # is the engine making progress
        self.reloads = Replan(self)  # a reload's plan: what a config read again asks, checked before anything stops
        self.deep = DeepCheck(self.ops)  # the engine's own parser on what a reload or a handover would start
        self.drains: Counter = Counter()  # the engine's planned stops by outcome, across its restarts (drains.py)
        self.clocks = clocks  # serve.idle's clocks: the daemon's seam to the GPUs' clocks (tune/idleclocks.py)
        self.feed: EnergyFeed | None = None  # the engine's GPUs' energy for the proxy's joules (energyfeed.py)

    def prepare(self, config: Config, deep: bool, on_loop: bool = False) -> Launch:
        return prepare_launch(config, self.backend, self.sides, deep, on_loop)

    # -- what the daemon asks ---------------------------------------------------------------
    @property
    def engine(self) -> Program | None:
        return self.children.main if self.children is not None else None

    @property
    def ready(self) -> bool:
        """Start-up is over for serving: the engine is healthy, FATAL, HELD or at rest (so `systemctl start`
        returns)."""
        return self.engine is None or self.engine.state in (RUNNING, FATAL, HELD, RESTING)

    @property
    def replacing(self) -> bool:
        """A restart of the engine is under way: it stops, or the launch after it waits for its stop."""
        return self.pending is not None or (self.engine is not None and self.engine.state == STOPPING)

    @property
    def stopped(self) -> bool:
        return self._idle and not self._busy and not self.leftovers.strays  # _busy: the look for leftovers is still due

    @property
    def _idle(self) -> bool:
        return (self.children is None or self.children.stopped) and not self.leftovers.unnamed

    def start(self, launch: Launch, now: float, adoptable: handover.Record | None = None,
              fds: Mapping[str, int] | None = None, how: str = "") -> None:
        """Start the launch's children; with adoptable (the record an earlier daemon left), a recorded child
        that is provably ours is taken over instead: kept as it is when the config asks for the same command,
        else stopped and replaced as a reload would (the new one starts once it has stopped). One the launch
        does not name is stopped (stop_unnamed)."""
        kept = self._kept
        self.launch, self._kept = launch, {}
        programs = [Program(_as_recorded(launch, adoptable), self.ops, self.clock, self.drains),
                    *(kept.get(spec.name) or Program(spec, self.ops, self.clock) for spec in launch.sides)]
        self.children = Supervisor(programs)
        self.reader, self.stall_watch = watchers(launch, self.clock)
        named = {p.name: p for p in programs}
        fds = dict(fds or {})  # each pipe is taken once
        stale = set()  # adopted children whose command, environment or user changed since their start
        for entry in adoptable.children if adoptable is not None else ():
            program = named.pop(entry.name, None)
            fd, word_fd = fds.pop(f"child-{entry.name}", None), kept_word(fds.pop(f"word-{entry.name}", None))
            if program is None:
                close_word(word_fd)
                self.leftovers.stop(entry, fd, now, launch.config.serve.stop_timeout_s, "not in this config")
            elif take_over(program, entry, fd, word_fd, now, how) is False:
                stale.add(program.name)
        changed = bool(stale)
        self.children.start(now)  # the programs not adopted
        sides = {spec.name: spec for spec in launch.sides}
        if changed and stale <= set(sides):
            # Only side children changed (serve.proxy edited before an upgrade's SIGUSR2): they are replaced, the
            # engine serves on, as a SIGHUP would do it (Replan._replace_sides); replacing all would cut the requests in
            # flight and make a real vLLM load anew.
            for name in sorted(stale):
                self.children.replace(name, Program(sides[name], self.ops, self.clock), now)
        elif changed:
            self.replace_all(launch, now, stale=stale)
        self._record(now)
        if adoptable is not None and adoptable.children:
            self._sweep(adoptable, launch.config.serve.stop_timeout_s, now)

    def stop_unnamed(self, record: handover.Record | None, fds: Mapping[str, int] | None, now: float,
                     grace: float, why: str) -> None:
        """Stop every child of record (serving is off: no launch names any)."""
        fds = dict(fds or {})
        for entry in record.children if record is not None else ():
            self.leftovers.stop(entry, fds.pop(f"child-{entry.name}", None), now, grace, why)
        self._record(now)
        if record is not None and record.children:
            self._sweep(record, grace, now)

    def _sweep(self, record: handover.Record | None, grace: float | None, now: float) -> None:
        live = [p.child.pid for p in (self.children.programs.values() if self.children else ()) if p.child]
        self.leftovers.sweep(record, grace, now, live)

    # -- the record of running children (serving/run/handover.py) ---------------------------------
    def _record(self, now: float) -> None:
        """What runs now, for the record: the children, and what an earlier daemon left that this one still ends."""
        running = []
        for program in (self.children.programs.values() if self.children is not None else ()):
            child = program.child
            if child is not None and child.start_ticks is not None:
                running.append(handover.Recorded(program.name, child.pid, child.start_ticks, program.spec.runs_as.uid,
                                                 handover.argv_digest(program.spec.argv), child.output_fd,
                                                 program.state == STARTING, handover.env_digest(program.spec.env),
                                                 child.word_fd))
        running += self.leftovers.recorded  # not adopted, but theirs to end until gone
        self.leftovers.uids.update(c.uid for c in running)
        self.recorder.update(running, self._stopping)

    def handover_record(self) -> handover.Record:
        """What a re-executed daemon needs: the running children, their pipes inheritable."""
        self._record(self.clock())
        return self.recorder.for_exec()

    def tick(self, now: float) -> tuple[tuple[ServingView, ...] | None, ServingStats | None]:
        """Advance the children, read the engine's metrics and judge its progress: (views, stats)."""
        self._swap_in_pending(now)
        # Something ran at the last tick, or runs as this one begins: an unnamed child whose group was gone by this
        # daemon's first tick (a busy box's slow start) is taken out below, and its end still calls for the look
        ran = self._busy or not self._idle
        if self.leftovers.unnamed:
            self.leftovers.tick(now)
            self._record(now)
        due, self._busy = self._idle and ran, not self._idle  # a look that fails is not due again
        if due:  # the children's groups are gone: anything left of them is a leftover
            self._sweep(None, None, now)
        self.leftovers.strays.tick(now)
        if self.children is None:
            return None, None
        engine = self.children.main
        was_running = engine.state == RUNNING
        try:
            self.children.tick(now)
        finally:
            self._record(now)
        stats = None
        # A headless part of a multi-node engine serves no API: the head reads the metrics and watches progress.
        if engine.state == RUNNING and engine.spec.listens:
            if not was_running:
                self.reader.reset()  # a new child: its counters restart at zero
                self.stall_watch.reset(now)
            stats = self.reader.read(now)
            engine.drain.note(stats)
            progress = Progress(stats.tokens_total, stats.requests_running, stats.requests_waiting) \
                if stats else None
            # At a clocks rest no probe: its completion would run at the lowest clock and, seen running, end the rest
            progress = None if engine.resting.clocks else progress
            engine.note_stall(now, self.stall_watch.update(now, progress), self.launch.config.serve.restart_on_stall)
        elif engine.state == STOPPING and engine.drain.active and engine.spec.listens:
            engine.drain.note(self.reader.read(now))  # what the drain has left, for its last line; not published
        each_tick(self.children, self.launch.config.serve.idle if self.launch else None, self.pending is not None,
                  now, stats, self.clocks)
        return self.children.views(), stats

    def views(self) -> tuple[ServingView, ...] | None:
        return self.children.views() if self.children is not None else None

    def feed_energy(self, watts: Mapping[int, float | None]) -> None:
        """The proxy's joules per request: the engine's GPUs' energy, read now (watts: this poll's power of each GPU,
        for a card without a counter). Only while a proxy is configured to read it."""
        config = self.launch.config if self.launch is not None and self.children is not None else None
        if config is None or not config.serve.proxy.enabled or self._stopping:  # stopping: the file is gone
            return
        path = feed_path(*config.serve.proxy.listen)
        if self.feed is None or self.feed.path != path:
            if self.feed is not None:  # the proxy moved (a reload): its old file goes
                self.feed.close()
            self.feed = EnergyFeed(path)
        self.feed.tick(self.children.main.gpus or self.backend.gpus(), watts)

    def _swap_in_pending(self, now: float) -> None:
        """After a reload, the new children start once the old ones are fully stopped."""
        if self.children is not None and not self.children.stopped:
            return
        if self.pending is not None:
            launch, self.pending = self.pending, None
            self.start(launch, now)
        elif self.children is not None:
            self.launch = self.children = self.reader = self.stall_watch = None

    def replace_all(self, launch: Launch | None, now: float, stale: set[str] = frozenset()) -> None:
        """Stop the children; the launch's start once they have stopped. A side child whose spec the launch keeps
        as it is (the proxy, serve.proxy unchanged) runs on into the launch: it holds requests meanwhile. stale: an
        adopted child whose running command differs from its spec, never kept."""
        self._kept = {name: program for name, program in _unchanged_sides(self.children, launch, self.sides).items()
                      if name not in stale}
        if self.children is not None:
            self.children.stop(now, keep=frozenset(self._kept))  # the new children start once these have stopped
        self.pending = launch

    # -- the rest of the life cycle ----------------------------------------------------------
    def hold(self, now: float, holds: Sequence[tuple[int, str]], drain: frozenset[int] = frozenset()) -> None:
        """GPUs that need a reset or a reboot ((gpu, "what: action"), -1: unnamed): the engine on them waits in HELD
        (serving/run/holding.py); drain: GPUs that still answer, where the policy lets the engine drain first."""
        mine = {g.index for g in self.engine.gpus} if self.engine is not None else set()
        for gpu, why in holds:
            if gpu in mine or gpu < 0:
                self.engine.hold(now, waiting_for(gpu, why), drain=gpu in drain)

    def release(self, now: float, why: str) -> bool:
        """The held engine's GPUs are back: it starts again. False: it was not held."""
        return self.engine is not None and self.engine.release(now, why)

    def reset(self, now: float) -> None:
        """A reload that changed nothing of serving: a FATAL child tries again."""
        if self.children is not None:
            self.children.reset(now)

    def stop(self, now: float) -> float | None:
        """Stop every child; the longest wait for SIGKILL among them (an engine's drain included), None: none."""
        self.pending, self._kept = None, {}
        if self.feed is not None:  # the proxy stops too
            self.feed.close()
        self.ops.end_helpers()  # a reload's read of the installed versions still running: nothing waits for it now
        wait = self.children.stop(now) if self.children is not None else None
        if self.children is not None or self.leftovers.unnamed:
            self._stopping = True
            self._record(now)
        return wait

    def kill_now(self, now: float) -> None:
        if self.children is not None:
            self.children.kill_now(now)
        self.leftovers.kill_now(now)  # a second stop request: no more grace


def _unchanged_sides(children: Supervisor | None, launch: Launch | None, sides: tuple[ChildKind, ...]) -> dict:
    """The running side programs (the proxy) whose spec the launch keeps as it is: they run on into it."""
    if children is None or launch is None:
        return {}
    names, wanted = {kind.name for kind in sides}, {spec.name: spec for spec in launch.sides}
    # Only one that runs or is on its way (a STOPPING one would end, a FATAL one never come back, in the launch)
    return {name: program for name, program in children.programs.items()
            if name in names and wanted.get(name) == program.spec and program.state in (STARTING, RUNNING, BACKOFF)}
