"""The proxy's connections to the engine: only to a socket of the engine's user.

A local user who binds the engine's port while it restarts (a crash, a reload, an upgrade: minutes with a real vLLM)
and answers /health 200 would get every request the proxy holds or sends, API keys and prompts included. So each
new connection to the engine is checked after connect() and before a byte is written: the socket that took it must
be a socket of this host owned by the engine's user (base/sockowner.py: sock_diag, 14 µs a connection; a
kept-alive connection is not checked again, it cannot change hands). Another uid's socket is closed with a reset,
unwritten, and the try counts as refused at connect: the request was never seen, so it is held (hold.py) until the
engine's /health answers over a connection that passes, or refused 503 at hold_s. The hold's /health and the
scrape of /metrics go through the same check, so a squatter's answers count for nothing. A squatter of the engine's
own uid passes: that user can stop or replace the engine anyway.

Under the daemon with vLLM the engine listens on a Unix socket instead (serving/compose/enginesock.py: no port for
anyone to bind); then EngineUnixConnector reaches it, and the kernel names who listens there (SO_PEERCRED), checked
the same way. The TCP check stays for SGLang (no such flag), serve.engine_listen: tcp and a standalone proxy.
"""

from __future__ import annotations

import errno
import functools
import logging
import os
import pwd

import aiohttp
from aiohttp.client_proto import ResponseHandler

from ..base import sockowner
from ..base.faultlog import FaultLog

ANY = "any"  # --engine-user any: no check (an engine on another host)


def engine_uid(user: str | None) -> int | None:
    """--engine-user: a user name or uid; any: None (no check); none given: the proxy's own uid, which the daemon's
    proxy shares with the engine (serve.user). ValueError for a name that is no user."""
    if user is None:
        return os.geteuid()
    if user == ANY:
        return None
    if user.isdigit() and user.isascii():
        return int(user)
    try:
        return pwd.getpwnam(user).pw_uid
    except KeyError:
        raise ValueError(f"--engine-user {user!r} is no user (a name, a uid, or {ANY})") from None


class NotTheEngine(ConnectionRefusedError):
    """The socket that took the connection is not the engine user's: closed unwritten, as if refused."""


class DropsUnsent(ResponseHandler):
    """A connection to the engine that, closed with bytes still unsent, lets them go at once (a reset) instead of
    waiting to write them: asyncio's close() writes what it buffered first, so a request whose client left while the
    engine did not read its body kept its connection, its descriptor and its bytes for as long as the engine did not
    read, counted by nothing (the pool slot, the client's place under the cap and the body's budget all given back):
    1,000 clients that send 512 KB and leave would take the proxy to its descriptor limit in 22 s. A connection closed with nothing left to write closes as before."""

    def close(self) -> None:
        transport = self.transport
        if transport is not None and transport.get_write_buffer_size():
            transport.abort()
        super().close()


def drop_unsent(connector: aiohttp.BaseConnector) -> None:
    """The connector's connections are DropsUnsent (aiohttp's own factory attribute, in 3.8 as in 3.14)."""
    connector._factory = functools.partial(DropsUnsent, loop=connector._loop)


class EngineConnector(aiohttp.TCPConnector):
    """aiohttp's connector, with each new connection's far end checked before aiohttp writes to it (uid None: no
    check). A connection another uid's socket took is closed and the host's next address tried, if any (aiohttp 3.8
    tries them one by one; 3.10 and later hand all over at once); past the last, ClientConnectorError, as for a
    refused connect: the proxy holds the request (never seen)."""

    def __init__(self, *, uid: int | None, faults: FaultLog | None = None, **kwargs):
        super().__init__(**kwargs)
        self.uid, self.faults, self.refused = uid, faults, 0
        drop_unsent(self)

    async def _wrap_create_connection(self, *args, **kwargs):
        infos = kwargs.get("addr_infos")  # aiohttp 3.10 and later: every address of the host at once (3.8: one)
        while True:
            transport, protocol = await super()._wrap_create_connection(*args, **kwargs)
            if self.uid is None:
                return transport, protocol
            why = self.not_the_engine(transport)
            if why is None:
                return transport, protocol
            peer = transport.get_extra_info("peername")
            sock = transport.get_extra_info("socket")
            if sock is not None:
                sockowner.reset_on_close(sock)
            transport.abort()  # unwritten: the socket that took the connection never reads a byte of ours
            self.refused += 1
            if self.faults is not None:
                self.faults.note("connections to a socket not the engine's", why, logging.WARNING)
            if infos and peer:  # the host's other addresses next ("localhost": [::1] squatted, 127.0.0.1 the engine's)
                infos[:] = [info for info in infos if info[4][:2] != peer[:2]]
                if infos:
                    continue
            raise aiohttp.ClientConnectorError(kwargs["req"].connection_key, NotTheEngine(errno.ECONNREFUSED, why))

    def not_the_engine(self, transport) -> str | None:
        return _why_not(transport, self.uid)


class EngineUnixConnector(aiohttp.UnixConnector):
    """aiohttp's connector to a Unix socket (the engine's, serving/compose/enginesock.py), each new connection's
    listener checked before aiohttp writes to it: a process of uid (SO_PEERCRED; None: no check). Another's is
    closed unwritten, and the try counts as refused at connect, as EngineConnector's."""

    def __init__(self, path: str, *, uid: int | None, faults: FaultLog | None = None, **kwargs):
        super().__init__(path, **kwargs)
        self.uid, self.faults, self.refused = uid, faults, 0
        drop_unsent(self)

    async def _create_connection(self, req, *args, **kwargs):
        proto = await super()._create_connection(req, *args, **kwargs)
        transport = proto.transport
        why = None if self.uid is None or transport is None else _why_not(transport, self.uid)
        if why is None:
            return proto
        transport.abort()
        self.refused += 1
        if self.faults is not None:
            self.faults.note("connections to a socket not the engine's", why, logging.WARNING)
        raise aiohttp.ClientConnectorError(req.connection_key, NotTheEngine(errno.ECONNREFUSED, why))


def _why_not(transport, uid: int) -> str | None:
    """None when the far end of this new connection is the engine user's socket; else why not, in one line."""
    sock = transport.get_extra_info("socket")
    if sock is None:
        return "the engine's connection has no socket to check: nothing sent"
    return sockowner.why_not(sock, uid, f" (an engine elsewhere needs --engine-user {ANY})")

