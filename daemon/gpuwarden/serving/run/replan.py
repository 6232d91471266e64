"""A reload's plan for serving (SIGHUP, and the checks of a handover): what a config read again asks of the running
children, checked before anything stops, and the step that carries it out. Split from runtime.ServingRuntime,
which owns the children and carries the steps out: this part reads what runs and decides, off nothing but the
config, the installed versions (read again off the loop first) and what the engine's user may bind.

    runtime.reloads.reread_installed(config)   # True: ask again once the installed versions are read
    step = runtime.reloads.plan(config)        # None: nothing to do; raises ConfigErrors: nothing stops
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ...base.yamlfile import ConfigErrors
from ...config import Config
from ..compose.apikey import KEY_ENV, engine_key, secrets_changed
from ..compose.container import container_problems
from ..compose.prepare import installed_for
from .deepcheck import due
from .kinds import ChildKind, same_engine, side_specs
from .spec import ChildSpec
from .supervisor import Program

if TYPE_CHECKING:
    from .runtime import Launch, ServingRuntime

log = logging.getLogger("gpuwarden")


class Replan:
    """The reload half of a ServingRuntime: the read of the installed versions a reload waits for, the plan of a
    reloaded config and the checks that refuse it before anything stops."""

    def __init__(self, runtime: ServingRuntime):
        self.runtime = runtime
        self._reread = runtime.ops.background("installed")  # a reload's read of the engine's installed versions

    @property
    def rereading(self) -> bool:
        """The installed versions are being read for a reload, which waits for them (the loop does not)."""
        return self._reread.busy

    def reread_installed(self, config: Config) -> bool:
        """A reload's first step: where the engine's interpreter or one of its package folders changed since its
        installed versions were read (a pip install upgrading the engine in place), read them again, on a worker
        thread: the probe may take installed.TIMEOUT_S, and the loop must not wait on it. True: a read runs, and
        the reload comes back once it has answered; False: the cache answers, or this reload's read ended (a
        failed read leaves the versions unknown, and the reload goes on without them)."""
        done = self._reread.take()
        if done is not None and done.error is not None:
            log.warning("reload: the engine's installed versions could not be read: %s: %s",
                        type(done.error).__name__, done.error)
        elif done is not None and not done.value.known:  # an unknown version restarts nothing: say why not
            log.warning("reload: %s; the engine's version is not compared", done.value.describe())
        if done is not None or self.runtime.launch is None or not config.serve.enabled:
            return False
        if self._reread.busy:
            return True
        # A container's image may be another under the same name (a pull, a tag): only its runtime can say, so a
        # reload always asks it (its ID, and the probe only where the ID is new; _upgraded compares them).
        if config.serve.container is None and installed_for(config, self.runtime.launch.command, ask=False).known:
            return False
        return self._reread.start(installed_for, config, self.runtime.launch.command, True, self.runtime.ops.helper)

    def plan(self, config: Config) -> Callable[[float], None] | None:
        """Check what a reloaded config asks of serving, and return the step that carries it out (None: no
        change; a Restart where the engine's part restarts, whose `check` the engine's own parser must accept
        first). Raises ConfigErrors (nothing is stopped then). The engine's part unchanged: only the side kinds
        whose spec changed restart (serve.proxy changed: the proxy), and the engine keeps serving. Another engine
        version installed under the running one: all restart, as for a changed section, so that the engine runs
        (and gpuwarden_serving_info says) the installed version."""
        old = self.runtime.launch.config.serve if self.runtime.launch is not None else None
        new = config.serve
        upgraded = None
        if old is not None and new.enabled and self.runtime.pending is None:
            upgraded = _upgraded(config, self.runtime.launch, self.runtime.engine)
        rotated = old is not None and new.enabled and self.runtime.launch is not None and key_rotated(config, self.runtime.launch)
        if old is not None and self.runtime.pending is None and upgraded is None and same_engine(old, new, self.runtime.sides) \
                and not rotated:
            wanted = side_specs(config, self.runtime.engine.identity, self.runtime.sides)
            running = {spec.name: spec for spec in self.runtime.launch.sides}
            changed = [kind for kind in self.runtime.sides if wanted.get(kind.name) != running.get(kind.name)]
            return (lambda now: self._replace_sides(config, wanted, changed, now)) if changed else None
        if old is not None and new == old and upgraded is None and not rotated:
            return None
        if old is None and not new.enabled and self.runtime.pending is None:
            return None
        launch = self.runtime.prepare(config, deep=False, on_loop=True) if new.enabled else None
        self.refuse_taken_port(config, launch)
        refuse_container(config, launch)
        return Restart(self.runtime, launch, upgraded)

    def refuse_taken_port(self, config: Config, launch: Launch | None) -> None:
        """Before a reload or a handover stops the engine: a new engine's TCP port (one the running engine does not
        listen on) that another process holds refuses the change (ConfigError), and the running engine serves on;
        before, it was stopped first and its successor waited for a local user to let go. Between this look and
        the new engine's bind (its predecessor's drain) a local user can still take the port: the start then waits
        as at boot (vllm_start_blocked); behind the proxy the engine has no port (serving/compose/enginesock.py)."""
        spec = launch.engine if launch is not None else None
        if spec is None or not spec.port or spec.socket or spec.listener:
            return
        running = self.runtime.engine.spec if self.runtime.engine is not None else None
        if running is None or (not running.socket and (running.host, running.port) == (spec.host, spec.port)):
            return  # nothing serves that a refusal would keep, or the port is the running engine's
        if not self.runtime.ops.port_free(spec.host, spec.port):
            raise config.error(("serve", "port"), f"port {spec.port} on {spec.host} is in use by "
                               f"{self.runtime.ops.who_listens(spec.host, spec.port)}; the running engine serves on",
                               "a port nobody else holds")

    def _replace_sides(self, config: Config, wanted: dict[str, ChildSpec], changed: list[ChildKind],
                       now: float) -> None:
        running = {spec.name: spec for spec in self.runtime.launch.sides}
        titles = [(wanted.get(kind.name) or running[kind.name]).title for kind in changed]
        log.info("reload: %s changed; restarting %s only", ", ".join(kind.what for kind in changed),
                 " and ".join(titles))
        for kind in changed:
            spec = wanted.get(kind.name)
            self.runtime.children.replace(kind.name, Program(spec, self.runtime.ops, self.runtime.clock) if spec else None, now)
            running.pop(kind.name, None)
        sides = (*running.values(), *(spec for name, spec in wanted.items() if name not in running))
        self.runtime.launch = dataclasses.replace(self.runtime.launch, config=config, sides=sides)


@dataclass(frozen=True)
class Restart:
    """A reload's step that stops the engine's part and starts launch (None: serving off) once it has stopped;
    upgraded: why, where the installed version changed under the running engine (said as it is carried out)."""

    runtime: ServingRuntime
    launch: Launch | None
    upgraded: str | None = None

    @property
    def check(self) -> Launch | None:
        """The launch whose flags the engine's own parser must accept before this step (deepcheck.due), or None."""
        return self.launch if due(self.launch, self.runtime, self.upgraded is not None) else None

    def __call__(self, now: float) -> None:
        if self.upgraded is not None:
            log.warning("%s", self.upgraded)
        self.runtime.replace_all(self.launch, now)


def _upgraded(config: Config, launch: Launch, engine: Program) -> str | None:
    """Why the engine must restart although its section did not change: the installed version (as
    Replan.reread_installed left it) is not the one it runs, or a container engine's image name is now another image (a
    pull or a tag since its start). None where they match, or either is unknown: an unknown version or image never
    restarts the engine by itself."""
    running = engine.spec.version
    found = installed_for(config, launch.command, ask=False)
    kind = launch.command.engine
    container = config.serve.container
    if container is not None and launch.config.serve.container == container and launch.image and found.known \
            and found.stamp and found.stamp[0] != launch.image:
        return (f"reload: {container.image} is now image {short_id(found.stamp[0])}, the engine runs "
                f"{short_id(launch.image)}: restarting it on the new image")
    version = found.version(kind.name) if found.known else None
    if not running or not version or version == running:
        return None
    return (f"reload: {kind.title} {version} is installed, the engine runs {running}: restarting it on the "
            "installed version")

def short_id(image_id: str) -> str:
    """An image ID as the runtimes show it: sha256:0123456789ab."""
    algorithm, _, digest = image_id.partition(":")
    return f"{algorithm}:{digest[:12]}" if digest else image_id[:19]


def refuse_container(config: Config, launch: Launch | None) -> None:
    """A reload to a container engine that `check` refuses (an image the runtime does not have, a mount's source
    that does not exist, an image without the engine) is refused (ConfigErrors) before the running engine stops:
    before, a typo in the image's name stopped a healthy container and ended FATAL (attacker 12's F5). On the loop:
    what the reload's read of the image met before it (installed_for, from its memory), the mounts looked at."""
    if launch is None or config.serve.container is None:
        return
    found = installed_for(config, launch.command, ask=False)
    problems = container_problems(config, launch.command.engine.name, found, config.gpu.backend == "sim")
    if problems:
        raise ConfigErrors(problems)


def key_rotated(config: Config, launch: Launch) -> bool:
    """The engine's secrets or its API key differ from those it runs with: a key rotated in serve.env_file or
    serve.env restarts the engine with the proxy (attackers 13 and 14: the proxy alone restarted on the new key, or
    nothing did, and the old key kept working). A key in vLLM's own flags is refused with the proxy on."""
    proxy = next((spec for spec in launch.sides if spec.fronts_engine), None)
    given = proxy.env.get(KEY_ENV) if proxy is not None else None
    return secrets_changed(config, launch.command.env) or (proxy is not None and engine_key(config) != given)
