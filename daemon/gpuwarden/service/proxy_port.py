"""The proxy's port on a daemon: the listener the daemon keeps for its proxies (base/keptlistener.py), taken over from
the daemon before this one (a re-exec's inherited fd, else systemd's fd store), let go where the config runs no
proxy, and at a handover passed on across the exec, as the metrics port (service/metrics_port.py)."""

from __future__ import annotations

import errno

from ..base.keptlistener import LISTENERS
from ..base.systemd import Notifier
from ..config import Config
from ..proxy.child import PROXY
from ..serving.run import ports
from .metrics_port import bind_refusal


def _only_ours(kept, port: int) -> bool:
    """Whether every socket listening on port is the daemon's kept one."""
    inode = kept.inode()
    listening = ports.listening_sockets(port)
    return inode is not None and bool(listening) and set(listening) == {inode}


def refuse_unlistenable(config: Config, handover: bool) -> None:
    """Before a reload or a handover changes anything: the proxy's address of the new config, where it is not the
    one kept, must be one the proxy can listen on now, else the change is refused (ConfigError) and the running proxy
    serves on; before, the running proxy was stopped first and its successor waited for an address it could not
    have (not this host's, or a local user's), serving down with no alert. A reload binds it now and keeps it
    (KeptListener.stage: the next proxy takes that socket, so nobody can bind the port in between); a handover only
    tries it (the new image binds it), which leaves a local user the moment between the check and its start."""
    serve = config.serve
    if not (serve.enabled and serve.proxy.enabled):
        return
    host, port = serve.proxy.listen
    kept = LISTENERS[PROXY]
    if kept.holds(host, port):
        return
    if handover:
        why = bind_refusal(host, port)
        if why is None and not ports.port_free(host, port):
            why = ("the proxy's own socket holds this port on another address: restart the daemon to move it"
                   if _only_ours(kept, port) else f"in use by {ports.who_listens(port, host=host)}")
    else:
        try:
            kept.stage(host, port)
            why = None
        except OSError as exc:
            why = (f"in use by {ports.who_listens(port, host=host)}" if exc.errno == errno.EADDRINUSE
                   else exc.strerror or str(exc))
            if exc.errno == errno.EADDRINUSE and _only_ours(kept, port):
                # The same port on another address (127.0.0.1 to 0.0.0.0): our own socket is in the way. Moving it
                # would close it before the new bind, and a local user's bind loop took the port in that gap and
                # read clients' keys (attacker 14): a restart moves it, with systemd's store holding the socket.
                why = "the proxy's own socket holds this port on another address: restart the daemon to move it"
    if why is not None:
        raise config.error(("serve", "proxy", "listen"), f"{serve.proxy.address} cannot be listened on: {why}; the "
                           "running proxy serves on", "an address of this host whose port nobody else holds")


def let_inherit() -> None:
    """Just before the exec of a handover: the socket ProxyPort.close kept open goes across it."""
    LISTENERS[PROXY].let_inherit()


class ProxyPort:
    def __init__(self, notifier: Notifier):
        self.notifier = notifier
        self.kept = LISTENERS[PROXY]

    def open(self, stored: int | None, config: Config) -> None:
        """At the start, before anything is started: the socket the daemon before this one kept (close-on-exec
        from here on), unless this config runs no proxy."""
        self.kept.take(stored, self.notifier.keep_fd)
        self.follow(config)

    def follow(self, config: Config) -> None:
        """A config that runs no proxy (serving or the proxy off) lets the port go: no connection waits unanswered in
        its backlog, and systemd's store lets it go too. One that runs a proxy binds it at the proxy's start
        (serving/run/preflight.py), a new address there closing the old."""
        if not (config.serve.enabled and config.serve.proxy.enabled):
            self.kept.close(stopping=True)

    def close(self, handing_over: bool) -> None:
        """The daemon's end: a handover passes the socket on (reexec, let_inherit); else the daemon's copy is closed
        and systemd's store keeps its own. systemd releases a unit's store only once it is inactive with no job
        queued (unit_submit_to_release_resources_queue): a `systemctl restart` or an automatic restart gives the
        next daemon the same socket, and the port is never free between the two (a local user's bind loop took it
        there before, and with it the clients' API keys); a `systemctl stop` lets it go."""
        if handing_over:
            self.kept.hand_over()
        else:
            self.kept.close(stopping=False)
