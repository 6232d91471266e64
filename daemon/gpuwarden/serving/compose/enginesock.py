"""Where the engine listens: serve.host:serve.port, or a Unix socket no other local user can take.

Any local user can bind the engine's TCP port while the engine is away (before its first start, during a crash's
or a reload's restart) and hold it: the engine then cannot start for as long as they like (vllm_start_blocked).
Behind the proxy nobody but gpuwarden needs the engine's port, so there the engine listens on a Unix socket
instead (vLLM's --uds; it then binds no TCP port): engine/PORT.sock in the state directory (PORT: serve.port,
which names the engine apart from another daemon's on the host, as its TCP port would), in a folder that is
root's and serve.user's group's alone (0770: the unit gives root no CAP_CHOWN, so root lets the group in, as for
the homes: homes.let_group_in). It lives in the state directory, not the runtime one: systemd removes
RuntimeDirectory= at an automatic restart, and an engine the next daemon adopts keeps its socket.

serve.engine_listen: tcp, unix, or auto (the default): unix where the proxy is in front, the engine has such a
flag (vLLM; SGLang 0.5 has none), the engine runs on one host and the path fits a socket's 107 bytes; else
tcp. Everything that talks to the engine
names it by engine_url: an http+unix URL for the socket (base/unixsock.py), or serve.url.
"""

from __future__ import annotations

import errno
import grp
import os
import pwd
import stat
from collections.abc import Mapping, Sequence
from pathlib import Path

from ...base import unixsock
from ...base.statedir import state_dir
from ...config import ServeConfig
from ..lint.flags import names_flag
from .homes import let_group_in
from .identity import Identity
from ..lint.findings import WARNING, LintFinding

FOLDER = "engine"
MAX_PATH = 107  # sun_path's 108 bytes, with the NUL


def socket_dir(environ: Mapping[str, str] = os.environ) -> Path:
    return state_dir(environ) / FOLDER


def engine_socket(serve: ServeConfig, engine, environ: Mapping[str, str] = os.environ) -> str | None:
    """The path of the socket the engine listens on, or None where it listens on serve.host:serve.port.
    ValueError (one line) where serve.engine_listen asks for a socket the engine cannot have."""
    path, why_not = _socket_or_why_not(serve, engine, environ)
    if path is None and why_not and serve.engine_listen == "unix":
        raise ValueError(why_not)
    return path


def _socket_or_why_not(serve: ServeConfig, engine, environ: Mapping[str, str]) -> tuple[str | None, str]:
    """(the socket's path, "") where the engine listens on one; (None, why not) where auto or unix would have it
    but cannot; (None, "") where it is TCP by choice (tcp, or auto without the proxy, or an engine without the
    flag, or a multi-node head)."""
    mode = serve.engine_listen
    flag = getattr(engine, "uds_flag", None)
    if mode == "tcp" or (mode == "auto" and not (serve.proxy.enabled and flag and serve.nodes is None)):
        return None, ""
    if flag is None:
        return None, f"{engine.title} has no flag to listen on a Unix socket"
    if serve.nodes is not None:
        return None, "a multi-node engine's head listens on TCP (its ranks and Ray reach it there)"
    path = str(socket_dir(environ) / f"{serve.port}.sock")  # named by serve.port: one per daemon of the host
    if len(os.fsencode(path)) > MAX_PATH:
        return None, f"the socket's path {path} is longer than a Unix socket's {MAX_PATH} bytes"
    if others := group_shared(serve.user):
        return None, (f"serve.user {serve.user}'s primary group is also {', '.join(others)}'s: they could take the "
                      "engine's socket path while the engine restarts (the socket's folder is that group's)")
    return path, ""


def group_shared(user: str | None, getpwnam=pwd.getpwnam, getgrgid=grp.getgrgid, getpwall=pwd.getpwall,
                 root: bool | None = None) -> list[str]:
    """The other users of serve.user's primary group (its listed members, and users whose primary group it is),
    where the daemon runs as root and so makes the socket's folder that group's; [] otherwise. At most 5 named."""
    if not (os.geteuid() == 0 if root is None else root) or not user:
        return []
    try:
        entry = getpwnam(user)
    except KeyError:
        return []  # identity.resolve says so
    others = set()
    try:
        others.update(getgrgid(entry.pw_gid).gr_mem)
    except KeyError:
        pass
    others.update(p.pw_name for p in getpwall() if p.pw_gid == entry.pw_gid)
    others.discard(user)
    return sorted(others)[:5]


def fallback_finding(serve: ServeConfig, engine, environ: Mapping[str, str] = os.environ) -> LintFinding | None:
    """Where the engine listens on TCP although auto would put it on a socket behind the proxy (the socket cannot
    be had: a local user can again hold serve.port while it restarts), or on a socket no one but gpuwarden reaches
    (unix without the proxy): one warning, not a silent choice."""
    path, why_not = _socket_or_why_not(serve, engine, environ)
    if path is None and why_not and serve.engine_listen == "auto":
        return LintFinding(WARNING, "engine-listen-tcp-fallback",
                           f"{engine.title} listens on {serve.host}:{serve.port}, not on a Unix socket behind the "
                           f"proxy: {why_not}; a local user who binds that port while it restarts keeps it from "
                           "starting", "serve.engine_listen: auto",
                           "give serve.user a group of its own (or a shorter state directory), or choose "
                           "serve.engine_listen: tcp to say so", facts=(why_not,))
    if path is not None and not serve.proxy.enabled:
        return LintFinding(WARNING, "engine-listen-unix-without-proxy",
                           f"{engine.title} listens on the Unix socket {path} and the proxy is off: no client but "
                           "gpuwarden's own commands reaches it", "serve.engine_listen: unix",
                           "serve.proxy.enabled: true, or serve.engine_listen: auto", facts=(path,))
    return None


def engine_url(serve: ServeConfig, engine, environ: Mapping[str, str] = os.environ) -> str:
    """The engine's base URL: http+unix:// for its socket, else http://serve.host:serve.port."""
    path = engine_socket(serve, engine, environ)
    return unixsock.url(path) if path else serve.url


def configured_url(serve: ServeConfig) -> str:
    """engine_url for serve.engine by name (bench, tune, doctor): serve.url where the engine is unknown or the
    setting impossible (their own commands say why)."""
    from .engines import engine_for

    try:
        return engine_url(serve, engine_for(serve.engine))
    except (ValueError, AttributeError):
        return serve.url


def listen_args(serve: ServeConfig, engine) -> tuple[str, ...]:
    """The flags that say where the engine listens; the last of its argv but a node's, so they win."""
    path = engine_socket(serve, engine)
    return (engine.uds_flag, path) if path else ("--host", serve.host, "--port", str(serve.port))


def conflict_finding(serve: ServeConfig, engine, user_args: Sequence[str]) -> LintFinding | None:
    """serve.args that say where to listen: gpuwarden sets that (its flags come after, and win), so such a flag
    is one line, never a second address."""
    path = engine_socket(serve, engine)
    names = ("--host", "--port", *((engine.uds_flag,) if getattr(engine, "uds_flag", None) else ()))
    given = sorted({n for arg in user_args for n in names if names_flag(arg, n)})
    if not given:
        return None
    where = f"the Unix socket {path} (serve.engine_listen)" if path else f"{serve.host}:{serve.port}"
    return LintFinding(WARNING, "listen-flags-in-args",
                       f"serve.args gives {', '.join(given)}, but gpuwarden says where {engine.title} listens: "
                       f"{where}; the flags in serve.args are overridden",
                       "gpuwarden's serve.engine_listen, serve.host and serve.port",
                       "remove them from serve.args; set serve.engine_listen (tcp or unix), serve.host and "
                       "serve.port instead", facts=tuple(given))


def make_socket_dir(identity: Identity, create: bool, environ: Mapping[str, str] = os.environ) -> None:
    """The socket's folder: root's, in serve.user's group only, 1770 (as root), or the user's own 0700 (run as
    that user). create False (the main loop) only checks that it is there. Raises OSError."""
    folder = socket_dir(environ)
    if not create:
        st = os.lstat(folder)
        if not stat.S_ISDIR(st.st_mode) or (identity.switch and st.st_gid != identity.gid):
            raise OSError(errno.EEXIST, f"{folder} is not the engine socket's folder (made at the daemon's start)")
        return
    folder.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
    try:
        os.mkdir(folder, 0o700)
    except FileExistsError:
        pass
    st = os.lstat(folder)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
        raise OSError(errno.EEXIST, f"{folder} is there and is not {'root' if identity.switch else 'our'}'s folder")
    if identity.switch:
        # sticky: a member of the group may not unlink or rename the engine's socket (serve.user's), nor the
        # daemon's, which owns the folder, a socket left behind
        let_group_in(folder, identity, 0o1770)
        _passable(folder.parent, identity)
    else:
        os.chmod(folder, 0o700)


def _passable(folder: Path, identity: Identity) -> None:
    """serve.user may pass every folder above the socket's (else the engine's bind fails, EACCES, until FATAL).
    Raises OSError naming the first it may not."""
    for above in (folder, *folder.parents):
        st = os.stat(above)
        if st.st_uid == identity.uid:
            bit = stat.S_IXUSR
        elif st.st_gid == identity.gid or st.st_gid in identity.groups:
            bit = stat.S_IXGRP
        else:
            bit = stat.S_IXOTH
        if not st.st_mode & bit:
            raise OSError(errno.EACCES, f"{identity.name} may not pass {above} to reach the engine's socket")


def clear_stale(path: str) -> str | None:
    """Before a start: an earlier engine's socket (a crash leaves it; vLLM's bind() would then fail) removed.
    None when the path is free; else why it cannot be made free, one line."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    except OSError as exc:
        return f"the engine's socket {path} cannot be checked: {exc.strerror or exc}"
    if stat.S_ISDIR(st.st_mode):
        return f"{path} is a directory; the engine's socket goes there"
    try:
        os.unlink(path)
    except FileNotFoundError:
        return None
    except OSError as exc:
        return f"the earlier engine's socket {path} cannot be removed: {exc.strerror or exc}"
    return None
