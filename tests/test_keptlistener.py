"""The daemon's kept listener (base/keptlistener.py): bound once and listening at once, the same socket for each
child, passed across a handover and taken back from the fd store, a new address a new socket."""

import os
import socket

import pytest

from conftest import free_port
from gpuwarden.base.keptlistener import CHILD_ENV, KeptListener


def test_the_kept_socket_listens_at_once_and_a_bind_of_another_user_cannot_share_it():
    stored = []
    kept = KeptListener("proxy")
    kept.take(None, lambda name, fd: stored.append((name, fd)))
    port = free_port()
    fd = kept.bind("127.0.0.1", port)
    assert kept.bind("127.0.0.1", port) == fd and stored == [("proxy", fd)]  # the same socket for each child
    assert not os.get_inheritable(fd)  # passed to a child only by pass_fds
    other = socket.socket()
    other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    with other, pytest.raises(OSError):
        other.bind(("127.0.0.1", port))  # a squatter's loop never gets it
    kept.close(stopping=True)
    assert stored[-1] == ("proxy", None)


def test_a_handover_passes_the_socket_on_and_a_new_address_is_a_new_socket():
    stored = []
    kept = KeptListener("proxy")
    kept.take(None, lambda name, fd: stored.append((name, fd)))
    port = free_port()
    inode = os.fstat(kept.bind("127.0.0.1", port)).st_ino
    kept.hand_over()
    assert os.environ["GPUWARDEN_PROXY_FD"].isdigit()
    after = KeptListener("proxy")  # the image after the exec
    after.take(None, lambda name, fd: stored.append((name, fd)))
    assert "GPUWARDEN_PROXY_FD" not in os.environ and after.inode() == inode
    assert after.address() == ("127.0.0.1", port)
    moved = free_port()
    after.bind("127.0.0.1", moved)  # a reload that changes serve.proxy.listen
    assert after.address() == ("127.0.0.1", moved) and after.inode() != inode
    with socket.socket() as probe:  # the old port is let go
        probe.bind(("127.0.0.1", port))
    after.close(stopping=True)


def test_a_stored_fd_that_is_not_a_listener_is_closed_and_dropped_from_the_store():
    stored = []
    sock = socket.socket()
    fd = sock.detach()
    kept = KeptListener("proxy")
    kept.take(fd, lambda name, fd: stored.append((name, fd)))
    assert kept.sock is None and stored == [("proxy", None)]
    with pytest.raises(OSError):
        os.fstat(fd)


def test_the_proxy_gets_the_kept_socket_in_its_environment_and_its_argv_stays_what_adoption_checks(tmp_path):
    """The fd number changes from one daemon to the next (after a crash systemd gives the socket back at fd 3 or
    later), so it is not on the proxy's command line: the argv the record of children holds, which the next daemon
    compares with /proc/PID/cmdline before it adopts the proxy, is the spec's (before, every handover and crash
    restart killed the running proxy as "another command line" and started a new one)."""
    from test_planned_restart import engine_and_proxy

    _, _, proxy, ops, _ = engine_and_proxy(tmp_path)
    argv, env, _ = ops.children[-1]
    assert proxy.spec.listener == "proxy" and argv == proxy.spec.argv
    assert env[CHILD_ENV] == "99" and "--listen-fd" not in argv  # FakeOps.listen's fd


def test_the_proxy_takes_the_fd_from_its_environment_once_and_refuses_a_bad_one(monkeypatch):
    from gpuwarden.proxy.command import _listen_fd

    monkeypatch.setenv(CHILD_ENV, "7")
    assert _listen_fd(None) == 7 and CHILD_ENV not in os.environ  # nothing it starts inherits the word
    assert _listen_fd(None) is None and _listen_fd(5) == 5
    monkeypatch.setenv(CHILD_ENV, "7x")
    with pytest.raises(ValueError, match="not a file descriptor"):
        _listen_fd(None)
    with pytest.raises(ValueError, match="stdin, stdout and stderr"):
        _listen_fd(1)


def test_a_staged_address_listens_before_anything_stops_and_the_next_bind_takes_that_very_socket():
    """A reload's new proxy address (attacker 11's F1): bound and listening while the proxy on the old one serves
    on, so a local user cannot bind it between the check and the next proxy's start; the next bind takes the staged
    socket (the same inode); a staged address nobody takes goes at a stop; one that cannot be had raises at once."""
    stored = []
    kept = KeptListener("proxy")
    kept.take(None, lambda name, fd: stored.append((name, fd)))
    old_port, new_port = free_port(), free_port()
    old_fd = kept.bind("127.0.0.1", old_port)
    kept.stage("127.0.0.1", new_port)
    staged = kept.staged.fileno()
    other = socket.socket()
    other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    with other, pytest.raises(OSError):
        other.bind(("127.0.0.1", new_port))  # taken already, before any proxy stops
    assert kept.holds("127.0.0.1", old_port) and os.fstat(old_fd).st_ino  # the running proxy's socket stays
    staged_inode = os.fstat(staged).st_ino
    fd = kept.bind("127.0.0.1", new_port)
    assert os.fstat(fd).st_ino == staged_inode and kept.staged is None and stored[-1] == ("proxy", fd)
    kept.stage("127.0.0.1", new_port)  # the address kept: nothing staged
    assert kept.staged is None
    with pytest.raises(OSError):  # TEST-NET-1: no address of this host
        kept.stage("192.0.2.1", new_port)
    kept.stage("127.0.0.1", old_port)
    kept.close(stopping=True)
    assert kept.staged is None
    probe = socket.socket()
    with probe:
        probe.bind(("127.0.0.1", old_port))  # let go at the stop


def test_a_reload_to_another_address_of_the_kept_port_is_refused_with_what_to_do(monkeypatch):
    """127.0.0.1:P to 0.0.0.0:P: the kept socket is in the way. Attacker 13 found it refused with our own pid named as
    the holder; letting it go on (the next proxy's bind closing the old socket first) let attacker 14's bind loop take
    the port in that gap and read clients' keys. So it is refused, and the line says a restart moves it."""
    from gpuwarden.base import keptlistener
    from gpuwarden.base.yamlfile import ConfigError
    from gpuwarden.config import parse_text
    from gpuwarden.service.proxy_port import refuse_unlistenable

    kept = KeptListener("proxy")
    monkeypatch.setitem(keptlistener.LISTENERS, "proxy", kept)
    kept.take(None, lambda name, fd: None)
    port = free_port()
    kept.bind("127.0.0.1", port)
    cfg = parse_text(f"serve:\n  enabled: true\n  model: /m\n  proxy: {{enabled: true, listen: '0.0.0.0:{port}'}}\n")
    for handover in (False, True):
        with pytest.raises(ConfigError, match="the proxy's own socket holds this port on another address: restart"):
            refuse_unlistenable(cfg, handover=handover)
    assert kept.holds("127.0.0.1", port) and kept.staged is None
    kept.close(stopping=True)
