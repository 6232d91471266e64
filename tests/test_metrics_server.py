"""The /metrics server against clients that misbehave on purpose, over real sockets (issue 24, item 6):
bytes trickled to hold every slot, a request head over the cap, unknown users timed against known ones, and
the log those faults leave. The server runs in this process; crowds of wrong passwords and tricklers against
a real daemon with TLS and basic auth are in test_webconfig.py (a crowd of threads in this process would
starve the server of the GIL, which a crowd elsewhere cannot)."""

import http.client
import logging
import re
import socket
import ssl
import subprocess
import sys
import time

import bcrypt
import pytest

from conftest import ROOT, free_port
from gpuwarden.web import server
from gpuwarden.web.exposition import Exposition
from gpuwarden.web.server import MAX_CONNECTIONS, MetricsServer
from gpuwarden.base.webconfig import PASSED_REMEMBERED, WebConfig, basic_auth_header

sys.path.insert(0, str(ROOT / "benchmarks"))
import metrics_attack  # noqa: E402  (the benchmark's scrape, one copy)

PASSWORD = "s3cret"
FAULTS = re.compile(r"metrics endpoint: client faults: (.*) \(the last from [^)]*\)$")


@pytest.fixture(scope="module")
def cert(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tls")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
                    "-keyout", str(folder / "server.key"), "-out", str(folder / "server.crt")],
                   check=True, capture_output=True, timeout=60)
    return folder / "server.crt", folder / "server.key"


@pytest.fixture
def serve():
    """Start a MetricsServer on a free loopback port; every one is stopped at the end."""
    servers = []

    def _serve(web: WebConfig | None = None) -> int:
        port = free_port()
        server = MetricsServer(("127.0.0.1", port), Exposition(lambda: None, time.monotonic), lambda: {"ok": 1}, web)
        servers.append(server)
        server.start()
        return port

    yield _serve
    for server in servers:
        server.stop()


def client_context(cert) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(cert[0]))
    context.check_hostname = False
    return context


def scrape(port: int, context: ssl.SSLContext | None = None, auth: tuple[str, str] | None = None,
           source: str = "127.0.0.1") -> int:
    """The status of a GET /metrics (0: refused, reset or timed out after 10 s, as Prometheus): the benchmark's."""
    return metrics_attack.get(port, context, auth, source)


def trickle(sockets: list, byte: bytes = b"a") -> None:
    """One byte more on each socket that is still open; those the server closed are dropped from the list."""
    for s in list(sockets):
        try:
            s.sendall(byte)
        except OSError:
            sockets.remove(s)
            s.close()


def fault_counts(caplog) -> dict[str, int]:
    """The counts per kind of every 'client faults' line logged so far, summed."""
    counts: dict[str, int] = {}
    for record in caplog.records:
        match = FAULTS.match(record.getMessage())
        if match:
            for part in match.group(1).split(", "):
                count, kind = part.split(" ", 1)
                counts[kind] = counts.get(kind, 0) + int(count)
    return counts


@pytest.mark.process
@pytest.mark.parametrize("tls", [False, True], ids=["http", "https"])
def test_clients_trickling_their_requests_hold_no_slot_that_a_scrape_needs(serve, cert, tls):
    web = WebConfig("web.yml", *cert) if tls else None
    port = serve(web)
    context = client_context(cert) if tls else None
    crowd = []
    try:
        for _ in range(MAX_CONNECTIONS + 16):  # each begins a request, then sends a byte at a time, never ending
            s = socket.create_connection(("127.0.0.1", port), timeout=10)
            if context:
                s = context.wrap_socket(s)
            s.sendall(b"GET /metrics HTTP/1.1\r\nX-Trickle: ")
            crowd.append(s)
        codes = []
        for _ in range(6):  # a byte every 0.2 s: under any per-read timeout
            trickle(crowd)
            codes.append(scrape(port, context))
            time.sleep(0.2)
        assert codes == [200] * 6, f"scrapes answered {codes} (0: refused) with {MAX_CONNECTIONS + 16} tricklers"
    finally:
        for s in crowd:
            s.close()


@pytest.mark.process
def test_scrapes_over_tls_leave_no_fault_in_the_log(serve, cert, caplog):
    port = serve(WebConfig("web.yml", *cert))
    caplog.set_level(logging.INFO, logger="gpuwarden")
    assert [scrape(port, client_context(cert)) for _ in range(3)] == [200] * 3
    time.sleep(0.2)  # the server's side of each close
    assert not [r.getMessage() for r in caplog.records if "metrics endpoint" in r.getMessage()]


def test_a_request_has_one_deadline_however_its_bytes_are_spaced(serve, monkeypatch):
    monkeypatch.setattr(server, "REQUEST_DEADLINE_S", 1.0)
    port = serve()
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        began = time.monotonic()
        s.sendall(b"GET /metrics HTTP/1.1\r\nX-Trickle: ")
        open_ = [s]
        while open_ and time.monotonic() - began < 60:  # a bound on a hang: no deadline would keep it open
            time.sleep(0.2)
            trickle(open_)
        took = time.monotonic() - began
    assert not open_, "a request trickled a byte every 0.2 s was still open after 60 s (deadline 1 s)"
    assert took >= 0.9, f"closed after {took:.2f} s, before its 1 s deadline"


def test_a_request_head_over_the_cap_is_answered_431(serve):
    port = serve()
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(b"GET /metrics HTTP/1.1\r\nX-Big: " + b"a" * 20 * 1024 + b"\r\n\r\n")  # over 16 KiB
        assert s.recv(64).startswith(b"HTTP/1.1 431 ")


@pytest.fixture(scope="module")
def slow_hash():
    """A bcrypt hash of cost 10: about 70 ms a check here, far above the cost of a request."""
    return bcrypt.hashpw(PASSWORD.encode(), bcrypt.gensalt(rounds=10)).decode()


def test_an_unknown_user_takes_as_long_as_a_wrong_password(serve, slow_hash, monkeypatch):
    """An unknown user costs one bcrypt check against a real configured hash (the costliest), as a wrong password
    costs one against its user's: the same work, counted, so timing does not tell which names exist. Counted rather
    than timed: a busy box's stopwatch says nothing either way."""
    port = serve(WebConfig("web.yml", users=(("prometheus", slow_hash),)))
    checked = []
    real = bcrypt.checkpw

    def counting(password, hashed):
        checked.append(hashed.decode())
        return real(password, hashed)

    monkeypatch.setattr(bcrypt, "checkpw", counting)
    for user in ("nobody", "prometheus"):
        assert scrape(port, auth=(user, "guess")) == 401
    assert checked == [slow_hash, slow_hash], checked  # one check each, at the same cost


def test_passwords_that_passed_are_remembered_up_to_a_bound():
    right = "p" * 72  # bcrypt reads 72 bytes: any suffix passes too, so an authorized client could mint many
    web = WebConfig("web.yml", users=(("prometheus", bcrypt.hashpw(right.encode(), bcrypt.gensalt(4)).decode()),))
    headers = [basic_auth_header("prometheus", f"{right}{i}") for i in range(PASSED_REMEMBERED + 6)]
    if not web.authorized(headers[0]):
        pytest.skip(f"bcrypt {bcrypt.__version__} refuses passwords over 72 bytes: no suffix passes")
    assert all(web.authorized(h) for h in headers[1:])
    assert web.remembered(headers[-1]) is True and web.remembered(headers[0]) is None, \
        f"more than {PASSED_REMEMBERED} passwords that passed were kept"


def test_client_faults_are_one_line_a_minute_with_a_count_per_kind(serve, caplog, monkeypatch):
    monkeypatch.setattr(server, "FAULT_LOG_INTERVAL_S", 1.0)
    port = serve()
    caplog.set_level(logging.INFO, logger="gpuwarden")
    for _ in range(5):
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            s.sendall(b"NONSENSE\r\n\r\n")
            assert s.recv(64).startswith(b"HTTP/1.1 400 ")
    for _ in range(3):
        socket.create_connection(("127.0.0.1", port), timeout=10).close()  # hangs up before a byte
    expected = {"not an HTTP/1 request": 5, "hung up": 3}
    deadline = time.monotonic() + 60  # a bound on a hang
    while fault_counts(caplog) != expected and time.monotonic() < deadline:
        time.sleep(0.1)
    lines = [r for r in caplog.records if "metrics endpoint" in r.getMessage()]
    assert fault_counts(caplog) == expected, [r.getMessage() for r in lines]
    gaps = [b.created - a.created for a, b in zip(lines, lines[1:])]
    assert len(lines) >= 2 and min(gaps) >= 0.95, f"the first fault at once, the rest at most a line a minute " \
                                                  f"(here: 1 s); lines {gaps} s apart"
    assert not any(r.exc_info for r in caplog.records) and "Traceback" not in caplog.text
