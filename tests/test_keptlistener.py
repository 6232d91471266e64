"""The daemon's kept listener (base/keptlistener.py): bound once and listening at once, the same socket for each
child, passed across a handover and taken back from the fd store, a new address a new socket."""

import os
import socket

import pytest

from conftest import free_port
from gpuwarden.base.keptlistener import KeptListener


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
