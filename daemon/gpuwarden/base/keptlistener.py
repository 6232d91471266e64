"""A listening socket the daemon binds and keeps for its whole life, by name, and hands to each child that serves on
it as an inherited fd, its number in the child's environment (CHILD_ENV; the proxy reads it as `--listen-fd`'s
default). The port is then never free between two children (a crash, a restart, a reload that restarts the child),
so no local user can bind it in the window and take the clients' requests; connections that come meanwhile wait in
the backlog for the next child. The number is not on the child's command line: that is the child's identity for the
daemon after this one (serving/run/handover.py compares it with /proc/PID/cmdline before adopting), and the number
differs from one daemon to the next (after a crash systemd hands the socket back at fd 3 or later).

Across a re-exec (a handover) the fd is inherited (GPUWARDEN_<NAME>_FD); after a crash systemd's fd store holds it
(FDNAME=<name>), as for the metrics listener (service/metrics_port.py). A new address is a new socket: the old
one is closed.
"""

from __future__ import annotations

import contextlib
import errno
import ipaddress
import logging
import os
import socket
from collections.abc import Callable

log = logging.getLogger("gpuwarden")

BACKLOG = 64  # as the proxy's own listener (proxy/listener.py)
CHILD_ENV = "GPUWARDEN_LISTEN_FD"  # in a child's environment: the fd of the kept listener it serves on
# The body of the proxy's fixed 503 at its connection cap (proxy/listener.py): only a running proxy's event loop
# writes it, so the daemon's liveness probe takes it as alive (serving/run/health.py): a full proxy is not a dead one.
CAP_REFUSED = b"the proxy has too many open connections, all being served: retry\n"


def _numeric(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def canonical(host: str) -> str:
    """host as getsockname() spells it: a numeric address in its canonical form ('::1' for '0::1'); a host that is
    no IP literal as it is (the config refuses those for serve.proxy.listen)."""
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        return host


def _env(name: str) -> str:
    return f"GPUWARDEN_{name.upper()}_FD"


class KeptListener:
    def __init__(self, name: str):
        self.name = name
        self.sock: socket.socket | None = None
        # A reload's new address, bound and listening before anything stops (stage): the next bind() to it takes
        # it, so the port is never free between the check and the new child's start.
        self.staged: socket.socket | None = None
        self.keep_fd: Callable[[str, int | None], None] = lambda name, fd: None

    def take(self, stored: int | None, keep_fd: Callable[[str, int | None], None]) -> None:
        """At the daemon's start: the socket the daemon before this one passed on (a re-exec's inherited fd, else
        systemd's fd store), kept until a child asks for another address (bind)."""
        self.keep_fd = keep_fd
        passed = os.environ.pop(_env(self.name), "")
        fd = int(passed) if passed.isdigit() else stored
        if fd is None:
            return
        try:
            sock = socket.socket(fileno=fd)
            if sock.type != socket.SOCK_STREAM or not sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                raise OSError("not a listening socket")
        except OSError:
            with contextlib.suppress(OSError):
                os.close(fd)
            self.keep_fd(self.name, None)
            return
        os.set_inheritable(fd, False)
        self.sock = sock

    def bind(self, host: str, port: int) -> int:
        """The fd of the socket listening on host:port: the one kept, else a new one (bound and listening at once,
        the old one closed) put in the fd store. Raises OSError (EADDRINUSE: another process holds it; EINVAL: host
        is no IP literal, the kept socket untouched: a spelling unlike getsockname()'s must never close the socket
        while the port is wanted, since the close is the window a local user binds in; the config refuses those)."""
        if not _numeric(host):
            raise OSError(errno.EINVAL, f"{host!r} is not a numeric IP address")
        if self.holds(host, port):
            if self.sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                return self.sock.fileno()
            # A child that shares the fd can shutdown() it: it then no longer listens, and another user may bind
            # the port (SO_REUSEADDR). Bound anew.
            log.warning("the kept %s listener on %s:%d no longer listens (a child shut it down?); binding it anew",
                        self.name, host, port)
        staged, self.staged = self.staged, None
        self.close(stopping=True)
        if staged is not None and staged.getsockname()[:2] == (canonical(host), port):
            sock = staged
        else:
            if staged is not None:
                staged.close()
            sock = _listening(host, port)
        self.sock = sock
        self.keep_fd(self.name, sock.fileno())
        return sock.fileno()

    def stage(self, host: str, port: int) -> None:
        """A reload's new address, bound and listening now, while the child on the old one serves on: the reload is
        refused where this raises (OSError: EADDRINUSE, another process holds it; EADDRNOTAVAIL, not this host's),
        and the next bind() to it takes it. Nothing is staged for the address already kept."""
        if not _numeric(host):
            raise OSError(errno.EINVAL, f"{host!r} is not a numeric IP address")
        if self.holds(host, port):
            return
        if self.staged is not None:
            if self.staged.getsockname()[:2] == (canonical(host), port):
                return
            self.staged.close()
            self.staged = None
        self.staged = _listening(host, port)

    def unstage(self) -> None:
        """A reload that staged an address and was refused (or replaced by another): the address goes, or it would
        stay bound with nobody serving on it (attacker 12's F9)."""
        if self.staged is not None:
            self.staged.close()
            self.staged = None

    def address(self) -> tuple[str, int] | None:
        return self.sock.getsockname()[:2] if self.sock is not None else None

    def holds(self, host: str, port: int) -> bool:
        """True if the kept socket is bound to host:port, host compared in canonical form (canonical)."""
        address = self.address()
        return address is not None and address == (canonical(host), port)

    def inode(self) -> int | None:
        return os.fstat(self.sock.fileno()).st_ino if self.sock is not None else None

    def hand_over(self) -> None:
        """A handover: the socket stays open, and let_inherit passes it across the exec."""
        if self.sock is not None:
            os.environ[_env(self.name)] = str(self.sock.detach())
            self.sock = None

    def let_inherit(self) -> None:
        if os.environ.get(_env(self.name), "").isdigit():
            os.set_inheritable(int(os.environ[_env(self.name)]), True)

    def close(self, stopping: bool) -> None:
        """Let the port go: asked to stop (or a new address), also out of systemd's store; after an error the
        store keeps it for the restart. A staged address goes at a stop."""
        if stopping and self.staged is not None:
            self.staged.close()
            self.staged = None
        if self.sock is not None:
            self.sock.close()
            self.sock = None
            if stopping:
                self.keep_fd(self.name, None)


def _listening(host: str, port: int) -> socket.socket:
    """A new socket bound to host:port and listening at once (a bound socket that does not listen can be shared).
    Raises OSError."""
    host = canonical(host)
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(BACKLOG)
    except OSError:
        sock.close()
        raise
    return sock


# The proxy's listener (serve.proxy.listen): its ChildSpec names it (listener="proxy").
LISTENERS = {"proxy": KeptListener("proxy")}
