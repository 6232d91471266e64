"""The proxy's kept listener and the daemon's judgement of its proxy, without processes (attack findings 4, 5, 7).

- serve.proxy.listen is a numeric IP literal in canonical form, as getsockname() spells it: a host name or another
  spelling (localhost, 127.1, [0::1]) is one config line, naming the key, the value and what to write. Before,
  'localhost:8001' passed, never equalled the kept socket's address, and the daemon killed its own proxy as untrusted
  and closed and re-bound the kept socket at each start (the window a local user bound the port in).
- The kept socket is compared in canonical form everywhere (KeptListener.holds), and a host that is no IP literal
  never closes it.
- A kept socket that no longer listens (a child shut it down) is bound anew, said in one line.
- The proxy's fixed 503 at its connection cap is a live proxy for the daemon's probe: a full proxy is not a dead one."""

import errno
import logging
import socket
from types import SimpleNamespace

import pytest

from gpuwarden import config
from gpuwarden.base.background import Outcome
from gpuwarden.base import httpget
from gpuwarden.base.httpget import Reply
from gpuwarden.base.keptlistener import CAP_REFUSED, KeptListener, canonical
from gpuwarden.base.yamlfile import InvalidConfig
from gpuwarden.proxy import listener
from gpuwarden.serving.run import health

SERVING = "serve:\n  enabled: true\n  model: /m\n"


@pytest.mark.parametrize("value, hint", [
    ("localhost:8001", "an IP literal such as 127.0.0.1:8001 or [::1]:8001; the proxy takes no host name"),
    ("LOCALHOST:8001", "an IP literal such as 127.0.0.1:8001 or [::1]:8001; the proxy takes no host name"),
    ("127.1:8001", "an IP literal such as 127.0.0.1:8001 or [::1]:8001; the proxy takes no host name"),
    ("[0::1]:8001", "an IP literal such as 127.0.0.1:8001 or [::1]:8001, i.e. [::1]:8001"),
])
def test_a_proxy_address_that_is_not_a_canonical_ip_literal_is_one_config_line(value, hint):
    with pytest.raises(InvalidConfig) as caught:
        config.parse_text(SERVING + f"  proxy: {{enabled: true, listen: '{value}'}}\n", "g.yaml")
    assert [str(e) for e in caught.value.errors] == [
        f"g.yaml:4: serve.proxy.listen: '{value}' is not a numeric IP address in canonical form ({hint})"]


@pytest.mark.parametrize("value", ["[::ffff:127.0.0.1]:8001", "[::ffff:7f00:1]:8001", "[::FFFF:127.0.0.1]:8001"])
def test_an_ipv4_mapped_proxy_address_however_spelled_is_one_config_line_naming_the_ipv4_one(value):
    """The attacker's F2 (2026-12-02): check suggested '[::ffff:7f00:1]' for '[::ffff:127.0.0.1]' and took it; the
    kernel names that socket '::ffff:127.0.0.1', the kept socket never matched it, and the daemon killed its proxy
    as untrusted every few seconds and freed the port at each start."""
    with pytest.raises(InvalidConfig) as caught:
        config.parse_text(SERVING + f"  proxy: {{enabled: true, listen: '{value}'}}\n", "g.yaml")
    assert [str(e) for e in caught.value.errors] == [
        f"g.yaml:4: serve.proxy.listen: '{value}' is an IPv4-mapped IPv6 address (the IPv4 address itself, "
        f"127.0.0.1:8001)"]


@pytest.mark.parametrize("value", ["127.0.0.1:8001", "[::1]:8001", "0.0.0.0:8001", "[::]:8001"])
def test_a_canonical_ip_literal_is_taken(value):
    cfg = config.parse_text(SERVING + f"  proxy: {{enabled: true, listen: '{value}'}}\n", "g.yaml")
    assert canonical(cfg.serve.proxy.listen[0]) == cfg.serve.proxy.listen[0]


def kept() -> tuple[KeptListener, list]:
    stored = []
    k = KeptListener("test")
    k.keep_fd = lambda name, fd: stored.append(fd)
    return k, stored


def test_the_kept_socket_is_compared_in_canonical_form_and_a_name_never_closes_it():
    k, stored = kept()
    fd = k.bind("127.0.0.1", 0)
    port = k.address()[1]
    try:
        assert k.holds("127.0.0.1", port) and not k.holds("127.0.0.2", port) and not k.holds("127.0.0.1", port + 1)
        with pytest.raises(OSError) as caught:
            k.bind("localhost", port)
        assert caught.value.errno == errno.EINVAL
        assert k.bind("127.0.0.1", port) == fd and stored == [fd]  # the same socket throughout, never closed
    finally:
        k.close(stopping=True)


def test_an_ipv6_address_is_held_however_it_is_spelled():
    k, _ = kept()
    try:
        k.bind("::1", 0)
    except OSError:
        pytest.skip("no IPv6 loopback here")
    try:
        port = k.address()[1]
        assert k.holds("0::1", port) and k.holds("0:0:0:0:0:0:0:1", port)
        assert k.bind("0:0::1", port) == k.sock.fileno()
    finally:
        k.close(stopping=True)


def test_a_kept_socket_that_no_longer_listens_is_said_and_bound_anew(caplog):
    k, stored = kept()
    k.bind("127.0.0.1", 0)
    port = k.address()[1]
    old = k.sock
    old.shutdown(socket.SHUT_RD)  # what serve.user can do to the fd it shares (pidfd_getfd)
    assert not old.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)
    try:
        with caplog.at_level(logging.WARNING, logger="gpuwarden"):
            fd = k.bind("127.0.0.1", port)
        assert k.sock is not old and old.fileno() == -1
        assert k.sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)
        assert stored[-2:] == [None, fd]
        assert [r.getMessage() for r in caplog.records] == [
            f"the kept test listener on 127.0.0.1:{port} no longer listens (a child shut it down?); binding it anew"]
    finally:
        k.close(stopping=True)


# -- the daemon's probe of its proxy --------------------------------------------------------------------------------

class Probe:
    def __init__(self, outcome):
        self.outcome = outcome

    def start(self, fn, *args):
        return True

    def take(self):
        return self.outcome


class Ops:
    def __init__(self, owns=True):
        self.owns = owns

    def health(self, url, owner):
        raise AssertionError("the probe is a stub")

    def group_pids(self, pgid):
        return [pgid]

    def owns_port(self, host, port, group, uid):
        return self.owns

    def who_listens(self, host, port):
        return "pid 9 (user mallory)"


def judged(code, body, listener_name="proxy", owns=True):
    spec = SimpleNamespace(health_path="/health", listener=listener_name, host="127.0.0.1", port=8001,
                           identity=SimpleNamespace(uid=1000), url="http://127.0.0.1:8001", title="the proxy",
                           launcher=None)
    probe = Probe(Outcome(value=Reply(code, body, 40000), started_at=2.0))
    return health.judge(spec, probe, Ops(owns), SimpleNamespace(pgid=7), 1.0, lambda why: why)


def test_the_proxys_cap_503_is_alive_and_any_other_503_is_not():
    assert listener.REFUSAL.endswith(CAP_REFUSED)  # the body the cap writes is the one the probe knows
    assert judged(503, CAP_REFUSED) == (True, "")
    assert judged(200, b"ok") == (True, "")
    assert judged(503, b"overloaded\n") == (False, "/health answered 503")
    assert judged(500, CAP_REFUSED) == (False, "/health answered 500")
    # only from the proxy (a child on a kept listener); an engine's answer is its own
    assert judged(503, CAP_REFUSED, listener_name="") == (False, "/health answered 503")
    # the port's owner is still checked: a squatter that writes the same 503 is not the proxy
    assert judged(503, CAP_REFUSED, owns=False) == (
        False, "port 8001 is answered by pid 9 (user mallory), not by the proxy's process group")


def judged_unasked(reply, kept=True, monkeypatch=None):
    """The probe wrote nothing: the far end was closed before its owner could be named (httpget.Unasked), having
    written reply (None: nothing whole)."""
    monkeypatch.setitem(health.LISTENERS, "proxy", SimpleNamespace(holds=lambda host, port: kept))
    spec = SimpleNamespace(health_path="/health", listener="proxy", host="127.0.0.1", port=8001,
                           identity=SimpleNamespace(uid=1000), url="http://127.0.0.1:8001", title="the proxy",
                           launcher=None)
    why = "http://127.0.0.1:8001: 127.0.0.1:8001 was taken by no open socket of this host: nothing sent"
    probe = Probe(Outcome(error=httpget.Unasked(why, reply), started_at=2.0))
    return health.judge(spec, probe, Ops(), SimpleNamespace(pgid=7), 1.0, lambda why: why)


def test_the_caps_503_written_before_the_probe_could_name_its_closed_end_is_alive_on_the_kept_listener_only(
        monkeypatch):
    """A full proxy writes its 503 unasked and closes at once: the probe found the far end closed, wrote nothing,
    and read the 503 it had been sent (a busy box, process test test_proxy_full.py)."""
    why = "http://127.0.0.1:8001: 127.0.0.1:8001 was taken by no open socket of this host: nothing sent"
    assert judged_unasked(Reply(503, CAP_REFUSED, 0), monkeypatch=monkeypatch) == (True, "")
    assert judged_unasked(Reply(503, CAP_REFUSED, 0), kept=False, monkeypatch=monkeypatch) == (False, why)
    assert judged_unasked(None, monkeypatch=monkeypatch) == (False, why)
    # an answer nobody asked for is never a healthy /health: only the cap's own 503 is taken
    assert judged_unasked(Reply(200, b"ok", 0), monkeypatch=monkeypatch) == (False, why)
    assert judged_unasked(Reply(503, b"overloaded\n", 0), monkeypatch=monkeypatch) == (False, why)


def test_what_a_closed_end_wrote_is_read_whole_without_a_byte_written():
    for end in (True, False):
        near, far = socket.socketpair()
        with near, far:
            far.sendall(listener.REFUSAL)
            if end:
                far.shutdown(socket.SHUT_WR)
                reply = httpget._written_before_asked(near, 1024, "x")
                assert (reply.code, reply.body) == (503, CAP_REFUSED)
            else:  # no end yet: nothing is waited for
                assert httpget._written_before_asked(near, 1024, "x") is None
    near, far = socket.socketpair()
    with near, far:
        far.sendall(listener.REFUSAL[:20])
        far.shutdown(socket.SHUT_WR)
        assert httpget._written_before_asked(near, 1024, "x") is None  # not a whole answer
        far.setblocking(False)
        try:
            assert far.recv(1) == b""  # and nothing was written to it
        except BlockingIOError:
            pass
