"""HTTP over a Unix stream socket: its URL, a connection to it as the user it belongs to, and who answers it.

A TCP port on loopback is free for any local user to bind while its server is away; a path in a directory only
root and one user may write is not. So an engine behind the proxy listens on a Unix socket (vLLM's --uds), and
everything that talks to it names it by a URL of the scheme http+unix, its path percent-encoded as the host
(`http+unix://%2Fvar%2Flib%2Fgpuwarden%2Fengine%2Fapi.sock/health`), as requests-unixsocket spells it: a base URL
that paths are appended to, as an http:// one is.

The socket is made by the engine as its user, mode 0600 under the unit's umask 0077, and the unit leaves root no
CAP_DAC_OVERRIDE: root may not connect to it. So a connection of root's is made with the calling thread's file
system ids set to the socket's user and group for the connect() alone (setfsuid/setfsgid act on one thread, and
need CAP_SETUID and CAP_SETGID, which the unit keeps); every other thread keeps root's.

Who took the connection is the kernel's answer for the connection itself: SO_PEERCRED, the credentials of the
process that listened on the socket.
"""

from __future__ import annotations

import ctypes
import functools
import os
import socket
import struct
from urllib.parse import quote, unquote, urlsplit

SCHEME = "http+unix"
PEERCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


def url(path: str) -> str:
    """The base URL of the HTTP server on the socket at path."""
    return f"{SCHEME}://{quote(path, safe='')}"


def path_of(address: str) -> str | None:
    """The socket's path of an http+unix URL; None for any other URL."""
    parts = urlsplit(address)
    if parts.scheme != SCHEME or not parts.netloc:
        return None
    return unquote(parts.netloc)


def shown(address: str) -> str:
    """A URL as messages show it: an http+unix one as unix:PATH plus its path, any other as it is."""
    path = path_of(address)
    if path is None:
        return address
    return f"unix:{path}{urlsplit(address).path}"


def connect(path: str, timeout: float | None, uid: int | None = None, gid: int | None = None) -> socket.socket:
    """A stream connection to the socket at path, within timeout. Made as uid and gid where the caller is root and
    they are another user's (the socket and its directory are that user's; see the module's docstring). OSError
    as connect() raises it."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(timeout)
        with as_user(uid, gid):
            sock.connect(path)
    except BaseException:
        sock.close()
        raise
    return sock


class as_user:
    """The calling thread's file system uid and gid set to uid and gid while inside (root only; a no-op for anyone
    else, and for root's own ids)."""

    def __init__(self, uid: int | None, gid: int | None):
        self.active = os.geteuid() == 0 and uid not in (None, 0)
        self.uid, self.gid = uid, gid if gid is not None else os.getegid()

    def __enter__(self) -> None:
        if self.active:
            libc = _lib()
            libc.setfsgid(self.gid)
            libc.setfsuid(self.uid)
            if libc.setfsuid(-1) != self.uid:  # setfsuid answers the previous id, and never fails loudly
                libc.setfsuid(0)
                libc.setfsgid(0)
                raise PermissionError(1, f"cannot act as uid {self.uid} to reach its socket (no CAP_SETUID)")

    def __exit__(self, *exc) -> None:
        if self.active:
            libc = _lib()
            libc.setfsuid(0)
            libc.setfsgid(os.getegid())


@functools.cache
def _lib() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def peer_uid(sock: socket.socket) -> int | None:
    """The uid of the process that listened on the socket sock is connected to (SO_PEERCRED); None where sock is
    no connected Unix socket."""
    if sock.family != socket.AF_UNIX:
        return None
    try:
        _, uid, _ = PEERCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, PEERCRED.size))
    except OSError:
        return None
    return uid
