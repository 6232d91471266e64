"""`gpuwarden proxy` and `proxy diff`: their help and options; the proxy is proxy/."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..proxy import command as proxy_command
from ..proxy.command import CLIENT_TIMEOUT_S, DUMP_MAX_BYTES
from .common import load_config
from .registry import Command
from ..base.exits import EX_CONFIG, EX_FAIL, EX_OK, EX_OSERR

HELP = """\
Runs the prefix-cache normalizing proxy in front of the serving engine: /v1/messages (Anthropic) and
/v1/chat/completions (OpenAI) requests have their cache busters removed (rules below), everything else
passes through untouched, and responses stream back chunk by chunk. /health and /metrics are the proxy's
own; the engine's prefix-cache counters are re-exported beside them.

Settings come from serve.proxy in the config; the options here override them (-c none: no config, the
defaults: 127.0.0.1:8001 in front of http://127.0.0.1:8000). With serve.proxy.enabled, `gpuwarden run`
starts and supervises this itself, as serve.user.

Rules: billing_header (Claude Code's per-request nonce block), cache_control (moving cache markers),
sort_tools (tools in a stable order), date_line ("Today's date is ..."; off by default), and
--remove-pattern REGEX for anything else in system text.

Limits: at most half the descriptors RLIMIT_NOFILE leaves (after a reserve) as client connections; a
connection that waits, or sends its headers, longer than --client-timeout, or its body slower than 16 KiB/s after
that, is closed; bodies over --max-body-bytes get 413; bodies and their parses hold at most 12 x --max-body-bytes
of memory at once (503 with Retry-After past it); each kind of client fault is logged once a minute, with a count.

While the engine is down (refusing connections, or answering 503 while it drains or starts), a request the engine
never had is held, and sent once the engine's /health answers: for at most --hold-s seconds, at most --hold-max
requests at once (and half the connection cap), its body within the budget above; past any of these, 503 with
Retry-After at once. --hold-s 0: no hold, 502 at once. A request in flight when the engine ended is never sent
again (it may be what ended it): 502 at once, or its stream cut. Told by the daemon that the engine is FATAL or
held (SIGRTMIN), every request gets 503 with Retry-After at once until it says an engine is healthy (SIGUSR2).
A client (its TCP peer address; an IPv6 /64, and 127.0.0.0/8 beside 127.0.0.1, as one; never X-Forwarded-For)
whose requests were in flight at --refuse-after-ends of the engine's ends within --ends-window-s is refused for the
rest of that window: 429 with Retry-After at once, nothing sent to the engine, so that one client's query of death,
sent again and again as new requests, cannot take the engine to FATAL.

The proxy sends the engine nothing over a connection that another user's socket took (a local user who binds the
engine's port while it restarts): each new connection's far end must be a socket of --engine-user, checked before
a byte is written; another's is closed unwritten, and the request is held as if the engine refused it. Under the
daemon with vLLM the engine listens on a Unix socket in a folder only root and serve.user's group can write
(serve.engine_listen), so there is no port to bind, and the socket's listener is checked the same way.

`gpuwarden proxy diff A B` shows where two dumped turns (--dump-dir) first differ: the cache buster."""


def arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--upstream", help="the engine, e.g. http://127.0.0.1:8000, or http+unix://%%2Fpath%%2Fapi.sock "
                   "for a Unix socket (default: where the config's engine listens: serve.engine_listen)")
    p.add_argument("--listen", help="HOST:PORT to serve on (default: serve.proxy.listen, 127.0.0.1:8001)")
    p.add_argument("--listen-fd", type=int, metavar="FD", help="serve on this inherited listening socket, bound "
                   "to --listen (default: $GPUWARDEN_LISTEN_FD, as the daemon passes the socket it keeps for the "
                   "proxy's port, so that the port is never free between two proxies)")
    p.add_argument("--engine", help="the engine's name, for its metric names (default: serve.engine)")
    p.add_argument("--engine-user", metavar="USER", help="the user the engine runs as: a byte goes only over a "
                   "connection taken by a socket of this host that this user owns (a name or uid; any: no check, "
                   "for an engine on another host; default: the proxy's own user, as under the daemon)")
    p.add_argument("--rules", help="the rules to apply, comma-separated, or none (default: serve.proxy's)")
    p.add_argument("--remove-pattern", action="append", metavar="REGEX", help="also remove this from system "
                   "text (repeatable; adds to serve.proxy.remove_patterns)")
    p.add_argument("--dump-dir", type=Path, help="dump each request, as received and as sent, per session")
    p.add_argument("--dump-keep", type=int, help="at most this many dump files (default: 200)")
    p.add_argument("--dump-max-bytes", type=int, default=DUMP_MAX_BYTES, help="at most this many bytes of dump "
                   "files; the oldest go first (default: 1 GiB)")
    p.add_argument("--max-body-bytes", type=int, help="refuse bigger request bodies with 413 (default: 32 MiB)")
    p.add_argument("--client-timeout", type=float, default=CLIENT_TIMEOUT_S, help="seconds a connection may wait "
                   "for its next request, and a request's headers may take; a body gets as long plus 1 s per 16 "
                   "KiB (default: 15)")
    p.add_argument("--hold-s", type=float, help="seconds a request may wait for an engine that is down; 0: "
                   "none, 502 at once (default: serve.proxy.hold_s, 300)")
    p.add_argument("--hold-max", type=int, help="requests held at once while the engine is down (default: "
                   "serve.proxy.hold_max, 256)")
    p.add_argument("--refuse-after-ends", type=int, metavar="N", help="refuse a client (429 at once) whose requests "
                   "were in flight at N of the engine's ends within --ends-window-s, for the rest of it; 0: never "
                   "(default: serve.proxy.refuse_after_ends, 2)")
    p.add_argument("--ends-window-s", type=float, metavar="S", help="the window over which the engine's ends are "
                   "counted for each client (default: serve.crash_loop_window_s, 600)")
    p.add_argument("--crash-loop-failures", type=int, metavar="N", help="the daemon's crash_loop_failures: once "
                   "N - 1 of the engine's ends are within --ends-window-s, a client in flight at any of them is "
                   "refused (default: serve.crash_loop_failures, 5)")
    p.add_argument("--idle-after-s", type=float, metavar="S", help="say on the daemon's word pipe that the engine is "
                   "idle once no request has come for this long and none is in flight (serve.idle; default: off)")
    p.add_argument("--idle-action", choices=("stop", "clocks"), help="what the engine's rest is (serve.idle.action): "
                   "at a clocks rest the engine still answers, so a held request waits for the daemon's word that "
                   "its clocks are back (SIGUSR2), 10 s at most; default: stop")
    p.add_argument("--energy-file", type=Path, metavar="PATH", help="the daemon's file of the engine's GPUs' energy "
                   "(rewritten each poll): each request's joules, its share by its tokens, in /metrics and one log "
                   "line a request; default: none (no joules)")
    p.add_argument("--model", help="the served model's name, the joules' model label (default: serve.model's last "
                   "part)")
    p.add_argument("action", nargs="?", choices=("run", "diff"), default="run", help="run (default) or diff")
    p.add_argument("dumps", nargs="*", type=Path, help="diff: two dump files, or one session folder (its last two "
                   "turns)")


def cmd_proxy(args: argparse.Namespace) -> int:
    return proxy_command.cmd_proxy(args, load_config)


COMMAND = Command("proxy", help="the prefix-cache normalizing proxy; `proxy diff A B` finds a cache buster",
                  run=cmd_proxy, arguments=arguments, description=HELP, order=110,
                  exits=((EX_OK, "stopped by SIGTERM or SIGINT; diff: the report is printed"),
                         (EX_FAIL, "diff: a dump cannot be read"),
                         (EX_OSERR, "cannot listen on the address (EX_OSERR)"),  # proxy/command.py's serve()
                         (EX_CONFIG, "bad arguments or configuration")))
