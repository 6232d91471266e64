"""A full proxy is not a dead proxy, and the proxy listens only where the config names a numeric address (attack
findings 4 and 5). Real processes: the daemon on the simulator, its proxy (as serve.user), the fake engine.

- Finding 4: a client that filled the proxy's connection cap with slow requests made the proxy answer the
  daemon's /health probe with the cap's fixed 503; three in a row and the daemon killed the proxy, cutting every
  stream in flight and forgetting the refused clients. The probe now takes that 503 as alive (health.judge).
- Finding 5: 'serve.proxy.listen: localhost:PORT' passed check; the kept socket's numeric address never equalled
  it, and the daemon killed its own proxy as untrusted and re-bound the kept socket at each start. It is a config
  error now, one line, exit 78, before anything listens."""

import socket
import subprocess
import time

import pytest

from conftest import gpuwarden_cmd
from gpuwarden.base.keptlistener import CAP_REFUSED
from gpuwarden.proxy.listener import connection_cap
from test_faults import fake, no_fakes_left, status  # noqa: F401 (fixtures)
from test_proxy_port import listening_inodes, proxy_pid
from test_query_of_death import served_config

NOFILE = 300  # the daemon's, and so its proxy's: a cap of 22 connections (proxy/listener.connection_cap)


def until(predicate, what, within_s=120):
    """Wait for predicate (a bound for a hang, not a speed)."""
    deadline = time.monotonic() + within_s
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def slow_request(port):
    """A GET the fake engine answers after 600 s (drain mode): held open, being served, for the test's length."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=60)
    sock.sendall(b"GET /v1/slow?s=600 HTTP/1.1\r\nHost: x\r\n\r\n")
    return sock


def fill(streams, port):
    """Each stream the proxy closed while the cap filled (a connection still sending its headers is the one the cap
    closes when a probe of the daemon's holds a slot a moment) sent anew; True when none was."""
    closed = [i for i, s in enumerate(streams) if not still_open(s)]
    for i in closed:
        streams[i].close()
        streams[i] = slow_request(port)
    return not closed


def full(port):
    """True if a new connection gets the cap's fixed 503."""
    data = b""
    with socket.create_connection(("127.0.0.1", port), timeout=60) as extra:
        while chunk := extra.recv(4096):  # the cap closes it at once
            data += chunk
    return data.startswith(b"HTTP/1.1 503 ") and data.endswith(CAP_REFUSED)


def still_open(sock):
    """True while the proxy has neither answered nor closed the connection."""
    sock.setblocking(False)
    try:
        sock.recv(1)  # an answer or the end: either is no longer in flight
        return False
    except BlockingIOError:
        return True
    except OSError:
        return False
    finally:
        sock.setblocking(True)


def running(base):
    """The requests the engine serves, as the daemon last read them (behind the proxy the engine listens on a Unix
    socket of the state directory, serving/compose/enginesock.py: the daemon's /status is the way to its count)."""
    return (status(base).get("vllm") or {}).get("requests_running") or 0


def proxy_probes(base):
    return next(c["probes"] for c in status(base)["children"] if c["title"] == "the proxy")


@pytest.mark.process
def test_a_proxy_full_of_slow_streams_is_alive_for_the_daemon_and_its_streams_go_on(
        write, fake, daemons, proxy_daemon, no_fakes_left):
    path, base, _, port = served_config(write, fake, "drain")
    command, env = proxy_daemon
    d = daemons(path, command=["prlimit", f"--nofile={NOFILE}:{NOFILE}", "--", *command], env=env)
    d.wait_for("the proxy healthy after", timeout=60)
    d.wait_for("vLLM healthy after", timeout=60)
    proxy, inodes = proxy_pid(d), listening_inodes(port)
    cap = connection_cap(NOFILE)
    streams = [slow_request(port) for _ in range(cap)]
    try:
        until(lambda: fill(streams, port) and running(base) >= cap,
              "every slot holds a request the engine is serving")
        assert full(port), "one connection more gets the cap's 503: so does every probe of the daemon's"
        full_from = proxy_probes(base)
        # More probes than it takes to kill (liveness_failures, 3), every one of them answered by the full proxy.
        until(lambda: proxy_probes(base) >= full_from + 4, "the daemon probed the full proxy")
        assert all(still_open(s) for s in streams), "no stream in flight was cut"
        assert full(port), "the cap was full throughout the probes"
    finally:
        for s in streams:
            s.close()
    # The full proxy's 503 fails no probe. A probe can fail alone another way: the test's own new connections
    # (fill's, full's) make the cap close the connection that waits on its client, and a busy box can keep the
    # daemon's probe waiting there a moment ("Connection reset by peer"). That is the cap's slow-client rule, not a
    # verdict on a full proxy; two in a row would be.
    failed = [line for line in d.lines if "liveness probe failed" in line]
    assert all("(1 of 3)" in line and "503" not in line for line in failed), failed
    assert "not trusted" not in d.log, d.log
    assert proxy_pid(d) == proxy and d.log.count("the proxy starting (pid") == 1, "the proxy never restarted"
    assert listening_inodes(port) == inodes, "the same socket throughout"
    assert d.stop() == 0


@pytest.mark.process
@pytest.mark.parametrize("host", ["localhost", "127.1", "LOCALHOST"])
def test_a_proxy_address_that_is_a_name_is_refused_before_anything_listens(write, fake, daemons, proxy_daemon,
                                                                           host):
    path, _, _, port = served_config(write, fake, "drain")
    path.write_text(path.read_text().replace(f"'127.0.0.1:{port}'", f"'{host}:{port}'"))
    check = subprocess.run([*gpuwarden_cmd(), "check", "-c", str(path)], capture_output=True, text=True, timeout=120)
    command, env = proxy_daemon
    d = daemons(path, command=command, env=env)
    assert d.proc.wait(120) == 78
    d._reader.join(5)
    said = (f"serve.proxy.listen: '{host}:{port}' is not a numeric IP address in canonical form (an IP literal such "
            f"as 127.0.0.1:{port} or [::1]:{port}; the proxy takes no host name)")
    assert check.returncode == 78 and said in check.stdout + check.stderr, (check.stdout, check.stderr)
    named = [line for line in d.lines if "serve.proxy.listen" in line]
    assert len(named) == 1 and said in named[0], d.log
    assert "the proxy starting" not in d.log, d.log
    assert listening_inodes(port) == [], "nothing listened on the port"
