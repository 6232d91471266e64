"""The registry of child kinds: what the serving runtime (serving/run/runtime.py) runs beside one another, one
entry a kind. An entry names the kind, the function that builds its ChildSpec from a config, and whether it is
part of the engine or a side child:

- the engine's part (the engine, and a Ray node under it) is built from the engine's prepared command (its GPUs,
  its user, its installed version); it starts, stops and restarts as one;
- a side child (the proxy) is built from the config and the engine's user alone; a reload compares its spec with
  the running one and restarts it alone when that changed, the engine serving on.

serving/ sits below the proxy's package: the daemon hands the side kinds in (service/daemon.py), and the engine's
part is ENGINE_PART here.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable
from dataclasses import dataclass

from ...config import Config, ServeConfig
from ...gpu.base import Gpu
from ..compose.command import ServeCommand
from ..compose.identity import Identity
from .spec import ChildSpec, engine_spec, ray_spec
from ..compose.apikey import KeyUnknown, argv_key, proxy_asks_key
from .containers import container_spec


@dataclass(frozen=True)
class EngineParts:
    """What the engine's part is built from: the composed command, as whom, on which GPUs, which version."""

    command: ServeCommand
    identity: Identity
    gpus: tuple[Gpu, ...]
    version: str | None


@dataclass(frozen=True)
class ChildKind:
    name: str  # a side child's name among the programs and its `child` label (its spec's name)
    # The kind's spec for a config; None: not wanted. A side: build(config, identity) with the engine's user; the
    # engine's part: build(config, parts) with EngineParts. A reload compares specs by value: what a spec holds
    # (its log_level, its policy) is a module's function, never a new lambda, or every reload restarts the child.
    build: Callable[[Config, object], ChildSpec | None]
    engine: bool = False  # part of the engine: built from its command and restarted with it
    # The key of serve that this side alone reads ("proxy"): a reload that changes only such keys leaves the
    # engine running. A side that reads no key of its own leaves it "".
    section: str = ""
    also: tuple[str, ...] = ()  # more keys of serve this side alone reads among the children (the proxy: idle)

    @property
    def what(self) -> str:
        """The kind in the line a reload logs: its section, else its name."""
        return f"serve.{self.section}" if self.section else self.name


def main_spec(config: Config, parts: EngineParts) -> ChildSpec:
    """This node's main child: the engine; under Ray, on the head the engine that starts once the Ray head
    answers and finds the cluster at RAY_ADDRESS, on another node its Ray node (no vLLM there)."""
    engine = engine_spec(config.serve, parts.command, parts.identity, parts.gpus, parts.version)
    engine = with_key_digest(engine, config)
    if proxy_asks_key(config):
        engine = dataclasses.replace(engine, keyless_flags=True)
    if config.serve.container is not None:  # one host only: config refuses serve.nodes beside it
        return container_spec(engine, config.serve.container, config.gpu.backend == "sim", config.serve.port)
    role = parts.command.role
    if role is None or role.nodes.backend != "ray":
        return engine
    if role.head:
        return dataclasses.replace(engine, peer=(role.nodes.head, role.nodes.port),
                                   env={**engine.env, "RAY_ADDRESS": role.nodes.address})
    # what the node serves, for gpuwarden_serving_info: ServingNodesDiffer compares it with the head's
    node = ray_spec(config.serve, parts.command, parts.identity)
    return dataclasses.replace(node, model=engine.model, profile=engine.profile, version=engine.version)


KEY_DIGEST_ENV = "GPUWARDEN_ENGINE_KEY_SHA256"


def with_key_digest(spec: ChildSpec, config: Config) -> ChildSpec:
    """A key vLLM reads from its own --config file (or --api-key) is in neither its environment nor, once the file
    changes, its command line: the engine's spec carries a digest of it, so that a rotated key makes the engine's spec
    another (a handover replaces it with the proxy, whose key changed too; attacker 14: the engine adopted on the old
    key, the proxy on the new, every client refused). A key from the environment (the credential, serve.env_file)
    is in the engine's environment already: nothing is added."""
    try:
        key = argv_key(config) if config.serve.engine == "vllm" else None
    except KeyUnknown:
        key = None  # with the proxy on, the start refuses it first (prepare.blocking); without, no key is asked
    if not key:
        return spec
    digest = hashlib.sha256(key.encode("utf-8")).hexdigest()[:16]
    return dataclasses.replace(spec, env={**spec.env, KEY_DIGEST_ENV: digest})


def ray_head(config: Config, parts: EngineParts) -> ChildSpec | None:
    """The Ray head's node, beside the engine on the head of a Ray cluster (serving/run/spec.ray_spec)."""
    role = parts.command.role
    if role is None or role.nodes.backend != "ray" or not role.head:
        return None
    return ray_spec(config.serve, parts.command, parts.identity)


ENGINE = ChildKind("engine", main_spec, engine=True)  # first: the main program, whose state gates READY
RAY = ChildKind("ray", ray_head, engine=True)
ENGINE_PART = (ENGINE, RAY)


def side_specs(config: Config, identity: Identity, kinds: tuple[ChildKind, ...]) -> dict[str, ChildSpec]:
    """The side children this config wants, by kind name, in the registry's order."""
    return {kind.name: spec for kind in kinds if not kind.engine and (spec := kind.build(config, identity)) is not None}


def same_engine(old: ServeConfig, new: ServeConfig, sides: tuple[ChildKind, ...]) -> bool:
    """The engine's part is built from serve apart from the side kinds' own keys: those unchanged, so is it.
    (Built, it would be prepared: lint, its user, its home, which a reload that leaves it alone must not do.)"""
    theirs = {key: getattr(old, key) for kind in sides for key in (kind.section, *kind.also) if key}
    return dataclasses.replace(new, **theirs) == old
