"""The proxy as the daemon's second supervised child: `python3 -m gpuwarden proxy` with every setting on its
command line, run as serve.user like the engine.

A process of its own, not a task in the daemon: a proxy fault (a hostile body, a bug, memory) then ends that
process, which the supervisor restarts with backoff, and never the GPU poll; its requests never wait on the
daemon's loop either. It listens on its own port and reaches the engine on its Unix socket, or serve.host:serve.port
(serving/compose/enginesock.py).
"""

from __future__ import annotations

import logging
import os
import re
import sys
from pathlib import Path

from ..config import Config
from ..serving.compose.command import child_env, engine_of
from ..serving.compose.enginesock import engine_url
from ..serving.compose.homes import let_group_in
from ..serving.compose.identity import Identity
from ..serving.run.energyfeed import feed_path
from ..serving.run.kinds import ChildKind
from ..serving.run.spec import ChildSpec, Timing
from ..serving.compose.apikey import engine_key
from .keys import ENV as KEY_ENV
from .normalize import SWITCHES

log = logging.getLogger(__name__)
LEVEL = re.compile(r"^(DEBUG|INFO|WARNING|ERROR|CRITICAL) ")
PROXY = "proxy"  # its name among the supervisor's programs, and its `child` label
PACKAGE_PARENT = str(Path(__file__).resolve().parent.parent.parent)  # where `import gpuwarden` finds us
COMMAND = (sys.executable, "-m", "gpuwarden", "proxy")


def log_level(line: str) -> int | None:
    """The level of a line of the proxy's output (its own log format); None: a continuation."""
    match = LEVEL.match(line)
    return getattr(logging, match.group(1)) if match else None


def proxy_argv(config: Config) -> tuple[str, ...]:
    p, serve = config.serve.proxy, config.serve
    rules = [name for name in SWITCHES if getattr(p, name)]
    argv = [*COMMAND, "-c", "none", "--upstream", engine_url(serve, engine_of(config)), "--listen", p.address,
            "--engine", serve.engine, "--rules", ",".join(rules) or "none", "--max-body-bytes", str(p.max_body_bytes),
            "--client-timeout", f"{p.client_timeout_s:g}", "--hold-s", f"{p.hold_s:g}", "--hold-max", str(p.hold_max),
            # the engine's ends are counted over the daemon's crash-loop window: fewer within it than its failures
            "--refuse-after-ends", str(p.refuse_after_ends), "--ends-window-s", f"{serve.crash_loop_window_s:g}",
            "--crash-loop-failures", str(serve.crash_loop_failures)]
    # A value the config's author wrote goes as --flag=VALUE: one beginning with "-" (a model /srv/models/-merged, a
    # pattern -x) would be taken for a flag, and the proxy would not start (attacker 51)
    for pattern in p.remove_patterns:
        argv.append(f"--remove-pattern={pattern}")
    # joules per request: the daemon's file of the engine's GPUs' energy (serving/run/energyfeed.py)
    label = serve.model.rstrip("/").rsplit("/", 1)[-1]
    label = label if label not in ("", "--") else serve.model  # "--model=--" is the end of options to argparse
    label = "./--" if label == "--" else label
    argv += [f"--energy-file={feed_path(*p.listen)}", f"--model={label}"]
    if serve.idle is not None:  # the proxy says when the engine has had no request for this long (proxy/quiet.py)
        argv += ["--idle-after-s", f"{serve.idle.after_s:g}", "--idle-action", serve.idle.action]
    if p.dump_dir is not None:
        argv += [f"--dump-dir={p.dump_dir}", "--dump-keep", str(p.dump_keep), "--dump-max-bytes",
                 str(p.dump_max_bytes)]
    return tuple(argv)


def proxy_spec(config: Config, identity: Identity) -> ChildSpec | None:
    """The proxy's child when serve.proxy is on: beside the engine, on no GPU, health-checked on its own
    /health, as the engine's user; None when it is off."""
    p = config.serve.proxy
    if not p.enabled:
        return None
    if p.dump_dir is not None:
        prepare_dump_dir(p.dump_dir, identity)
    env = child_env(os.environ, sys.executable)
    env["PYTHONPATH"] = PACKAGE_PARENT
    key = engine_key(config)  # a key in vLLM's flags is refused with the proxy on (prepare.blocking)
    if key:  # the proxy asks it on every path: vLLM asks it under /v1 alone (proxy/keys.py)
        env[KEY_ENV] = key
    timing = Timing.of(config.serve, startup_timeout_s=min(60.0, config.serve.startup_timeout_s))
    # The engine's user, which the proxy runs as too: only its socket is sent a byte (upstream.py).
    argv = (*proxy_argv(config), "--engine-user", str(identity.uid))
    return ChildSpec(PROXY, "the proxy", argv, env, identity, p.listen[0], p.listen[1], "/health",
                     timing, log_level, fronts_engine=True, listener=PROXY)


# Its entry in the registry of child kinds (serving/run/kinds.py): a side child that serve.proxy alone configures
# (and serve.idle, of the children), so that a reload that changes only those restarts only the proxy.
PROXY_KIND = ChildKind(PROXY, proxy_spec, section="proxy", also=("idle",))


def prepare_dump_dir(path: Path, identity: Identity) -> None:
    """Prompts are private: the dump directory is the service user's own where it already is; else root's in the
    user's group only, 0770 (the unit has no CAP_CHOWN to give it away), and each session's folder in it is the
    user's own, 0700, made by the proxy."""
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        if not identity.switch:
            os.chmod(path, 0o700)
        elif os.lstat(path).st_uid != identity.uid:
            let_group_in(path, identity, 0o770)
    except OSError as exc:
        log.error("proxy dump directory %s cannot be prepared: %s; the proxy will say so on each dump", path,
                  exc.strerror or exc)
