"""The proxy as the daemon's second supervised child: `python3 -m gpuwarden proxy` with every setting on its
command line, run as serve.user like the engine.

A process of its own, not a task in the daemon: a proxy fault (a hostile body, a bug, memory) then ends that
process, which the supervisor restarts with backoff, and never the GPU poll; its requests never wait on the
daemon's loop either. It listens on its own port and reaches the engine on serve.host:serve.port.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import sys
from pathlib import Path

from ..config import Config
from ..serving.command import ServeCommand, child_env
from ..serving.engines import Engine
from ..serving.identity import Identity
from ..serving.supervisor import Program
from .normalize import SWITCHES

log = logging.getLogger(__name__)
LEVEL = re.compile(r"^(DEBUG|INFO|WARNING|ERROR|CRITICAL) ")
PROXY = "proxy"  # its name among the supervisor's programs, and its `child` label
PACKAGE_PARENT = str(Path(__file__).resolve().parent.parent.parent)  # where `import gpuwarden` finds us


class ProxyChild(Engine):
    name = PROXY
    title = "the proxy"
    default_command = (sys.executable, "-m", "gpuwarden", "proxy")
    model_flag = memory_flag = ""
    default_memory_fraction = 0.0  # no GPU memory: the start never waits for it
    tp_flags = ()

    def log_level(self, line: str) -> int | None:
        match = LEVEL.match(line)
        return getattr(logging, match.group(1)) if match else None


def proxy_argv(config: Config) -> tuple[str, ...]:
    p, serve = config.serve.proxy, config.serve
    rules = [name for name in SWITCHES if getattr(p, name)]
    argv = [*ProxyChild.default_command, "-c", "none", "--upstream", serve.url, "--listen", p.address,
            "--engine", serve.engine, "--rules", ",".join(rules) or "none", "--max-body-bytes", str(p.max_body_bytes)]
    for pattern in p.remove_patterns:
        argv += ["--remove-pattern", pattern]
    if p.dump_dir is not None:
        argv += ["--dump-dir", str(p.dump_dir), "--dump-keep", str(p.dump_keep)]
    return tuple(argv)


def proxy_program(config: Config, engine: Program, identity: Identity, **program_kwargs) -> Program:
    """A Program beside the engine's, on no GPU, health-checked on its own /health."""
    p = config.serve.proxy
    if p.dump_dir is not None:
        prepare_dump_dir(p.dump_dir, identity)
    env = child_env(os.environ, sys.executable)
    env["PYTHONPATH"] = PACKAGE_PARENT
    command = ServeCommand(proxy_argv(config), env, engine.command.profile, (), ProxyChild(),
                           len(ProxyChild.default_command))
    serve = dataclasses.replace(config.serve, host=p.listen[0], port=p.listen[1],
                                startup_timeout_s=min(60.0, config.serve.startup_timeout_s))
    return Program(serve, command, identity, [], **program_kwargs)


def prepare_dump_dir(path: Path, identity: Identity) -> None:
    """Prompts are private: the dump directory is the service user's alone (0700)."""
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        if identity.switch and os.geteuid() == 0:
            os.chown(path, identity.uid, identity.gid)
        os.chmod(path, 0o700)
    except OSError as exc:
        log.error("proxy dump directory %s cannot be prepared: %s; the proxy will say so on each dump", path, exc)
