"""`gpuwarden proxy`: run the normalizing proxy (standalone, or as the daemon's child), and `proxy diff`."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import re
import socket
import sys
from pathlib import Path

from ..config import IDLE_MAX_S, IDLE_MIN_S, ProxyConfig, parse_address
from ..serving.compose.engines import engine_for
from ..serving.compose.enginesock import engine_url
from .keys import ENV as KEY_ENV
from ..base.keptlistener import CHILD_ENV
from ..base.sockowner import named
from ..base.systemd import LineFormatter
from ..base.timedregex import PatternError, compile_patterns
from . import diff
from .casualties import CRASH_LOOP_FAILURES, WINDOW_S
from .dump import Dumper
from .faults import LOUD_LOGGERS, proxy_faults
from .normalize import RULES, SWITCHES, Rules
from .upstream import engine_uid
from ..base.exits import EX_CONFIG, EX_FAIL, EX_OK, EX_OSERR

DUMP_MAX_BYTES = 1 << 30
CLIENT_TIMEOUT_S = 15.0  # above the 4-5 s keep-alive clients keep themselves (Node's undici, httpx)

log = logging.getLogger("gpuwarden.proxy")


def cmd_proxy(args: argparse.Namespace, load_config) -> int:
    if args.action == "diff":
        return _diff(args.dumps)
    if args.dumps:
        return _usage("proxy: dump files are for `gpuwarden proxy diff`")
    config = None if str(args.config).lower() == "none" else load_config(args)
    settings = config.serve.proxy if config else ProxyConfig()
    try:
        rules = _rules(args.rules, settings, args.remove_pattern or [])
        listen = _listen(args.listen) if args.listen else settings.listen
        owner = engine_uid(args.engine_user)
        listen_fd = _listen_fd(args.listen_fd)
    except ValueError as exc:
        return _usage(f"proxy: {exc}")
    engine = engine_for(args.engine or (config.serve.engine if config else "vllm"))
    if engine is None:
        return _usage(f"proxy: no serving engine named '{args.engine}'")
    try:
        upstream = args.upstream or (engine_url(config.serve, engine) if config else "http://127.0.0.1:8000")
    except ValueError as exc:
        return _usage(f"proxy: serve.engine_listen: {exc}")
    if not (re.match(r"^https?://[^/\s]+/?$", upstream) or re.match(r"^http\+unix://%2F[^/\s]+/?$", upstream)):
        return _usage(f"proxy: --upstream {upstream!r} is not a base URL such as http://127.0.0.1:8000 (or "
                      "http+unix://%2Fpath%2Fto%2Fsocket for a Unix socket)")
    dump_dir = args.dump_dir or settings.dump_dir
    keep = settings.dump_keep if args.dump_keep is None else args.dump_keep
    max_body = settings.max_body_bytes if args.max_body_bytes is None else args.max_body_bytes
    hold_s = settings.hold_s if args.hold_s is None else args.hold_s
    hold_max = settings.hold_max if args.hold_max is None else args.hold_max
    refuse_after = settings.refuse_after_ends if args.refuse_after_ends is None else args.refuse_after_ends
    window_s = (config.serve.crash_loop_window_s if config else WINDOW_S) if args.ends_window_s is None \
        else args.ends_window_s
    if keep < 2 or max_body < 1024 or args.dump_max_bytes < 1 << 20 or not 0.1 <= args.client_timeout <= 3600:
        return _usage("proxy: --dump-keep must be at least 2, --max-body-bytes at least 1024, --dump-max-bytes at "
                      "least 1048576, and --client-timeout 0.1 to 3600 s")
    if not 0 <= hold_s <= 3600 or not 1 <= hold_max <= 4096:
        return _usage("proxy: --hold-s must be 0 to 3600 s and --hold-max 1 to 4096")
    idle_after = args.idle_after_s if args.idle_after_s is not None else \
        (config.serve.idle.after_s if config and config.serve.idle else 0.0)
    if idle_after and not IDLE_MIN_S <= idle_after <= IDLE_MAX_S:
        return _usage(f"proxy: --idle-after-s must be {IDLE_MIN_S} to {IDLE_MAX_S} s")
    idle_action = args.idle_action or (config.serve.idle.action if config and config.serve.idle else "stop")
    failures = (config.serve.crash_loop_failures if config else CRASH_LOOP_FAILURES) \
        if args.crash_loop_failures is None else args.crash_loop_failures
    if not 0 <= refuse_after <= 1000 or not 1 <= window_s <= 86400 or not 1 <= failures <= 1000:
        return _usage("proxy: --refuse-after-ends must be 0 to 1000, --ends-window-s 1 to 86400 s and "
                      "--crash-loop-failures 1 to 1000")
    # One line per record, control characters escaped: the lines quote clients' request paths, and reach the
    # daemon's journal as the child's output (or the proxy's own journal when it runs alone).
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(LineFormatter("%(levelname)s %(message)s"))
    logging.basicConfig(level=logging.INFO, handlers=[handler])
    faults = proxy_faults()
    dumper = Dumper(dump_dir, keep, args.dump_max_bytes, faults.note) if dump_dir else None
    key = os.environ.pop(KEY_ENV, "") or None  # the engine's API key, where the daemon passed it (proxy/keys.py)
    model = args.model or (config.serve.model.rstrip("/").rsplit("/", 1)[-1] if config else "") or "unnamed"
    return serve(upstream, listen, rules, engine, dumper, max_body, args.client_timeout, faults, (hold_s, hold_max),
                 owner, (refuse_after, window_s, failures), listen_fd, key, idle_after, idle_action,
                 (args.energy_file, model[:128]))


def _listen_fd(given: int | None) -> int | None:
    """The inherited listening socket to serve on: --listen-fd, else the daemon's (CHILD_ENV, out of the environment
    once read); None: bind --listen."""
    passed = os.environ.pop(CHILD_ENV, "")
    if given is None and passed:
        if not passed.isdigit():
            raise ValueError(f"{CHILD_ENV}={passed!r} is not a file descriptor")
        given = int(passed)
    if given is not None and given < 3:
        raise ValueError(f"--listen-fd {given} is one of stdin, stdout and stderr, not a listening socket")
    return given


def serve(upstream, listen, rules, engine, dumper, max_body, client_timeout_s, faults, hold, owner, ends,
          listen_fd=None, api_key=None, idle_after_s=0.0, idle_action="stop", energy=(None, "unnamed")) -> int:
    from ..serving.run.spec import DOWN_SIGNAL, REST_SIGNAL, STOPPING_SIGNAL, UP_SIGNAL
    from .listener import Connections, connection_cap, run
    from .server import Proxy, ProxyMetrics

    faults.quiet(LOUD_LOGGERS)
    names = engine.metric_names
    metrics = ProxyMetrics((names.prefix_cache_queries, names.prefix_cache_hits))
    conns = Connections(connection_cap(), client_timeout_s, faults,
                        lambda reason: metrics.failures.labels(reason).inc())
    proxy = Proxy(upstream, rules, metrics, dumper, max_body, metrics_path=engine.metrics_path, faults=faults,
                  conns=conns, hold_s=hold[0], hold_max=hold[1], health_path=engine.health_path, engine_uid=owner,
                  ends=ends, api_key=api_key, idle_after_s=idle_after_s)
    proxy.hold.rest_ends_on_word = idle_action == "clocks"
    proxy.joules.path, proxy.joules.model = energy  # joules per request (proxy/joules.py), where the daemon feeds it
    enabled = [name for name in RULES if getattr(rules, name)]
    held = (f"; requests held up to {proxy.hold.hold_s:g} s, {proxy.hold.hold_max} at most, while the engine is "
            "down" if proxy.hold.on else "; no hold while the engine is down")
    whose = "any socket" if owner is None else f"only a socket of {named(owner)}"
    refused = (f"; a client in flight at {ends[0]} of the engine's ends within {ends[1]:g} s refused" if ends[0]
               else "; no client refused for the engine's ends")
    keyed = "; the engine's API key asked on every path" if api_key else ""
    idle = f"; the engine idle after {idle_after_s:g} s without a request ({idle_action})" if idle_after_s else ""
    idle += f"; joules per request from {energy[0]}" if energy[0] else ""
    log.info("proxy on http://%s:%d for %s (%s); rules: %s%s; at most %d connections%s%s%s%s", *listen, upstream,
             whose, ", ".join(enabled) or "none", f"; dumps in {dumper.directory}" if dumper else "", conns.cap, held,
             refused, keyed, idle)
    try:
        # A stop cuts streams still open after 2 s; the daemon's word of the engine's planned stop, of its return
        # and of an end it does not restart from (serving/run/spec.py) reach the hold.
        told = {STOPPING_SIGNAL: proxy.hold.engine_stopping, UP_SIGNAL: proxy.hold.engine_up,
                DOWN_SIGNAL: proxy.hold.engine_not_restarting, REST_SIGNAL: proxy.hold.engine_resting}
        sock = None if listen_fd is None else socket.socket(fileno=listen_fd)  # the daemon's, kept by it
        asyncio.run(run(proxy.app(), listen[0], listen[1], conns, signals=told, sock=sock))
    except OSError as exc:
        print(f"gpuwarden proxy: cannot listen on {listen[0]}:{listen[1]}: {exc.strerror or exc}", file=sys.stderr)
        return EX_OSERR
    return EX_OK


def _rules(names: str | None, settings: ProxyConfig, extra: list[str]) -> Rules:
    flags = {n: getattr(settings, n) for n in SWITCHES}
    if names is not None:
        chosen = set() if names.strip().lower() == "none" else {n.strip() for n in names.split(",") if n.strip()}
        unknown = chosen - set(flags)
        if unknown:
            raise ValueError(f"unknown rule(s) {', '.join(sorted(unknown))} in --rules; known: {', '.join(flags)}")
        flags = {n: n in chosen for n in flags}
    texts = (*settings.remove_patterns, *extra)
    try:
        patterns = compile_patterns(texts)
    except PatternError as exc:  # a{4294967295}, 1,000 nested groups, copies past MAX_REPEATS in all
        raise ValueError(f"--remove-pattern {texts[exc.index]!r} is not a regular expression: {exc}") from None
    return Rules(**flags, remove_patterns=tuple(patterns))


def _listen(value: str) -> tuple[str, int]:
    address = parse_address(value)
    if address is None:
        raise ValueError(f"--listen {value!r} is not HOST:PORT")
    return address


def _diff(paths: list[Path]) -> int:
    if len(paths) == 1 and paths[0].is_dir():
        paths = diff.turns(paths[0])[-2:]
        if len(paths) < 2:
            return _usage("proxy diff: the session folder has fewer than two turns")
    if len(paths) != 2:
        return _usage("proxy diff: give two dump files, or one session folder")
    try:
        print(diff.report(*paths))
    except (ValueError, OSError) as exc:
        print(f"gpuwarden proxy diff: {exc}", file=sys.stderr)
        return EX_FAIL
    return EX_OK


def _usage(message: str) -> int:
    print(f"gpuwarden {message}", file=sys.stderr)
    return EX_CONFIG
