"""The metrics port's life on a daemon: taken over from the daemon before this one (a re-exec's inherited fd,
else systemd's fd store) or bound anew, waited for while another process holds it, served, and at a handover
passed on across the exec, so that the port is never let go.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import socket
from collections.abc import Callable

from ..base import smallfile
from ..base.statedir import listen_file
from ..base.systemd import Notifier
from ..config import Config, MetricsConfig
from ..serving.run import ports
from ..web.exposition import Exposition
from ..web.server import MetricsServer, family_of, take_listener

log = logging.getLogger("gpuwarden")

# The metrics listener's fd, inherited across a re-exec: the port is never let go, so no local user can bind it
# in between and keep the new image from starting. After a crash systemd's fd store holds it (FDNAME=metrics).
METRICS_FD_ENV = "GPUWARDEN_METRICS_FD"
# A metrics port another process holds (a local user can bind it whenever it is free: at boot, at a requested
# restart) is tried again this often from the tick: a bind, which never waits.
METRICS_RETRY_S = 2.0


class StartupError(Exception):
    """The daemon cannot start; the message is one line for the user."""


def let_inherit() -> None:
    """Just before the exec of a handover: the listener MetricsPort.close kept open goes across it."""
    if os.environ.get(METRICS_FD_ENV, "").isdigit():  # finish() kept it open; inheritable only now, for the exec
        os.set_inheritable(int(os.environ[METRICS_FD_ENV]), True)


def bind_refusal(host: str, port: int) -> str | None:
    """Why host:port cannot be listened on here at all, or None: bound and let go at once (a port another process
    holds is None too: a start waits for it). For a handover, before the exec: the new image's start raises
    StartupError where this is not None (an address not of this host, a port below 1024 without
    CAP_NET_BIND_SERVICE), and the daemon would end, its children left unsupervised."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, family_of(host), socket.SOCK_STREAM)[0]
        with socket.socket(family, kind, proto) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(address)
    except socket.gaierror as exc:
        return exc.strerror or str(exc)
    except OSError as exc:
        return None if exc.errno == errno.EADDRINUSE else (os.strerror(exc.errno) if exc.errno else str(exc))
    return None


def refuse_unbindable(config: Config, running: tuple[str, int] | None) -> None:
    """For a handover, the config on disk's metrics.listen where it differs from the running one: an address the new
    image cannot listen on at all would end it at its start (StartupError), its children left unsupervised, so it is
    a refusal here (ConfigError). A restart-only setting: a reload keeps the running one."""
    listen = config.metrics.listen
    if listen is not None and listen != running:
        why = bind_refusal(*listen)
        if why is not None:
            raise config.error(("metrics", "listen"), f"{listen[0]}:{listen[1]} cannot be listened on here: {why} "
                               "(the new image would end at its start)")


class MetricsPort:
    """The metrics server of one daemon, from taking the port to passing it on. metrics is a restart-only setting
    (a reload keeps the running value), so the settings given at the start hold for the daemon's whole life."""

    def __init__(self, settings: MetricsConfig, exposition: Exposition, status_document: Callable[[], dict],
                 notifier: Notifier, error_once: Callable[[str], None]):
        self.settings, self.exposition, self.status_document = settings, exposition, status_document
        self.notifier, self.error_once = notifier, error_once
        self.server: MetricsServer | None = None
        self.held_since: float | None = None  # metrics.listen was in use: the tick tries it again
        self._retry_at = 0.0

    def open(self, stored: int | None, now: float) -> None:
        """The metrics listener: the one the daemon before this one passed on (a re-exec's inherited fd, else
        systemd's fd store) where it listens on metrics.listen, else bound anew (_bind)."""
        passed = os.environ.pop(METRICS_FD_ENV, "")
        fd = int(passed) if passed.isdigit() else stored
        listen = self.settings.listen
        listener = take_listener(fd, listen) if fd is not None else None
        if fd is not None and listener is None:  # closed here; systemd's copy would hold the old port forever
            self.notifier.keep_fd("metrics", None)
        if listen is not None:
            self._bind(listener, now)

    def _bind(self, listener, now: float) -> None:
        """The one place the metrics server is made (and metrics.listen bound, without a listener passed on);
        kept in the fd store for the daemon after this one. A port another process holds is waited for, with
        one error line naming the holder where /proc tells: the daemon tunes and supervises meanwhile, and the
        tick tries again every METRICS_RETRY_S. Raises StartupError when the address cannot be bound at all."""
        host, port = self.settings.listen
        try:
            self.server = MetricsServer((host, port), self.exposition, self.status_document, self.settings.web,
                                        listener)
        except OSError as exc:
            # strerror alone: create_server's adds "(while attempting to bind on address ...)"; a name that does
            # not resolve is a gaierror, whose errno is no errno ("Unknown error -2")
            reason = exc.strerror if isinstance(exc, socket.gaierror) and exc.strerror else \
                os.strerror(exc.errno) if exc.errno else str(exc)
            if exc.errno != errno.EADDRINUSE:
                raise StartupError(f"cannot serve metrics on {host}:{port}: {reason} "
                                   "(change metrics.listen, or set it to none)") from None
            if self.held_since is None:
                self.held_since = now
                try:
                    who = ports.who_listens(port, host=host)
                except OSError:
                    who = "a process we cannot see"
                log.error("cannot serve metrics on %s:%d: %s (%s): running without /metrics and /status, "
                          "binding the port as soon as it is free", host, port, reason, who)
            self._retry_at = now + METRICS_RETRY_S
            return
        self.notifier.keep_fd("metrics", self.server.listener.fileno())  # systemd ignores one it holds already

    @property
    def renders(self) -> bool:
        """Whether each poll's snapshot is rendered for /metrics: while served, and while the port is held too, so
        that the first scrape once it is free reads the GPUs (the last poll's body), not an empty registry."""
        return self.server is not None or self.held_since is not None

    def serve(self, now: float) -> None:
        """Start the metrics server made by _bind, write the URL for `gpuwarden status`, and say so."""
        if self.server is None:
            return
        self.server.start()
        if os.environ.get("RUNTIME_DIRECTORY"):  # systemd's RuntimeDirectory=: the unit makes one
            try:  # readable by all: `gpuwarden status` run by any user reads it
                smallfile.write_atomic(listen_file(), (self.settings.url + "\n").encode(), 0o644)
            except OSError as exc:
                log.warning("%s not written: %s", listen_file(), exc.strerror or exc)
        held = "" if self.held_since is None else f" (the port was held for {now - self.held_since:.0f} s)"
        self.held_since = None
        log.info("serving /metrics and /status on %s%s", self.settings.url, held)  # after the file: it is there

    def retry(self, now: float) -> None:
        """metrics.listen was held at the start: bind it once it is free (tick; a bind never waits)."""
        if self.held_since is None or self.server is not None or now < self._retry_at:
            return
        try:
            self._bind(None, now)
        except StartupError as exc:  # the address went away meanwhile: say so now and then, keep trying
            self.error_once(str(exc))
            self._retry_at = now + METRICS_RETRY_S
        self.serve(now)

    def held_note(self) -> str:
        """For the STATUS= line while another process holds the port."""
        if self.held_since is None:
            return ""
        return " · metrics not served: %s:%d is held by another process" % self.settings.listen

    def close(self, handing_over: bool, stopping: bool) -> None:
        """Stop serving; a handover keeps the port (reexec passes it across the exec) and hands the scrapers it
        let in to the new image."""
        web = self.server.web if self.server is not None else None  # the server's (a reload's config: a copy)
        if self.server is not None:
            kept = self.server.stop(keep_listener=handing_over)
            if kept is not None:  # reexec() passes it across the exec: the port stays ours throughout
                os.environ[METRICS_FD_ENV] = str(kept)
            elif stopping:  # asked to stop: nothing to take back. After an error the restart takes it back.
                self.notifier.keep_fd("metrics", None)
            self.server = None
            if os.environ.get("RUNTIME_DIRECTORY"):
                with contextlib.suppress(OSError):
                    listen_file().unlink()
        if handing_over and web is not None:
            web.hand_over()  # after the server's end, so that every scraper it let in is in (reexec passes it)
