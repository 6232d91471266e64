"""Text from outside (a request path, an engine's output, a process name, a server's answer) never reaches the
journal stream, STATUS= or a terminal with a control character in it (issue 35, finding 6 and its minors).

journald ends a record at NUL and reads a leading `<N>` as its priority; CR and LF end a line; ESC drives a
terminal (clear the screen, OSC 52 writes the clipboard). The proxy, the daemon and the fake engine run as real
processes, read as bytes: a text-mode reader would turn a CR into a line end and hide it.
"""

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from conftest import free_port, gpuwarden_cmd, subprocess_env
from gpuwarden.serving.run.ports import describe
from gpuwarden.base.systemd import JournalFormatter, Notifier, QueuedLog
from test_faults import fake, fault_config  # noqa: F401 (fake: a fixture)

HERE = Path(__file__).resolve().parent
# The attack of the issue: NUL, then a `<0>` (emergency) record that names a GPU fault, then clear-screen.
FORGED_PATH = "/x%00%3C0%3Egpuwarden:%20GPU0%20gpu_needs_reset%20FORGED%1b[2J"
CONTROLS = (b"\x00", b"\r", b"\x1b", b"\x07")


def clean(data: bytes) -> None:
    """No control character but the line ends."""
    for char in CONTROLS:
        assert char not in data, (char, data)


class RawProcess:
    """A process whose stdout and stderr are collected as bytes."""

    def __init__(self, argv, env=None):
        self.data = bytearray()
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     env=env or subprocess_env())
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self):
        while chunk := self.proc.stdout.read1(65536):
            self.data += chunk

    def wait_for(self, text: bytes, timeout=60.0) -> bytes:
        """The line that holds text, once it is whole."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in bytes(self.data).split(b"\n")[:-1]:
                if text in line:
                    return line
            assert self.proc.poll() is None or self._reader.is_alive(), bytes(self.data)
            time.sleep(0.05)
        raise AssertionError(f"{text!r} not written; output was:\n{bytes(self.data)!r}")

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        self._reader.join(5)


def up(port, path, timeout=30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=2):
                return
        except OSError:
            time.sleep(0.05)
    raise AssertionError(f"nothing answers on port {port}")


@pytest.fixture
def processes():
    started: list[RawProcess] = []

    def start(argv, env=None) -> RawProcess:
        started.append(RawProcess(argv, env))
        return started[-1]

    yield start
    for p in reversed(started):
        p.stop()


def raw_request(port, head: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(head)
        return sock.recv(65536)


# -- the proxy: request paths ---------------------------------------------------------------------------------
@pytest.mark.process
def test_a_forged_path_reaches_the_proxys_log_escaped_on_one_line_in_the_413_502_and_client_gone_lines(processes):
    up_port, proxy_port = free_port(), free_port()
    upstream = processes([sys.executable, str(HERE / "harness" / "fake_upstream.py"), "--port", str(up_port),
                          "--chunk-delay", "0.02"])
    up(up_port, "/v1/models")
    proxy = processes([*gpuwarden_cmd(), "proxy", "-c", "none", "--upstream", f"http://127.0.0.1:{up_port}",
                       "--listen", f"127.0.0.1:{proxy_port}", "--hold-s", "0"])  # the engine down: 502 at once
    up(proxy_port, "/health")

    # A client that leaves a stream on a path with CR and ESC in it.
    body = b'{"stream": true, "endless": true}'
    sock = socket.create_connection(("127.0.0.1", proxy_port), timeout=10)
    sock.sendall(b"POST /gone%%0D%%1b[31mRED HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
    seen = b""
    while b"data: " not in seen:
        seen += sock.recv(4096)
    sock.close()
    gone = proxy.wait_for(b"after")
    assert b"left POST /gone\\r\\x1b[31mRED after" in gone, gone

    # The request: refused with 413 before its body is read.
    answer = raw_request(proxy_port, f"POST {FORGED_PATH} HTTP/1.1\r\nHost: x\r\n"
                                     "Content-Length: 99999999999999\r\n\r\n".encode())
    assert answer.startswith(b"HTTP/1.1 413"), answer
    line = proxy.wait_for(b"FORGED")
    assert b"POST /x\\x00<0>gpuwarden: GPU0 gpu_needs_reset FORGED\\x1b[2J from" in line, line
    assert line.startswith(b"WARNING proxy: ") and b"413" in line, line

    # The engine down: 502, its line quoting the path.
    upstream.stop()
    answer = raw_request(proxy_port, b"POST /down%0D%1b]52;c;Zm9yZ2Vk%07 HTTP/1.1\r\nHost: x\r\n"
                                     b"Content-Length: 2\r\n\r\n{}")
    assert answer.startswith(b"HTTP/1.1 502"), answer
    down = proxy.wait_for(b"/down")
    assert b"POST /down\\r\\x1b]52;c;Zm9yZ2Vk\\x07 from" in down and b"502" in down, down
    clean(bytes(proxy.data))


# -- the daemon: its children's output, its records, STATUS= ----------------------------------------------------
@pytest.mark.process
def test_an_engines_control_characters_reach_the_daemons_log_escaped_on_one_line(processes, write, fake):
    path, base, _ = fault_config(write, fake, "healthy,controls")
    daemon = processes([*gpuwarden_cmd(), "run", "-c", str(path)],
                       env=dict(subprocess_env(), STATE_DIRECTORY=str(path.parent / "state")))
    line = daemon.wait_for(b"FORGED")
    assert b"fakechild said: a\\x00<0>gpuwarden: GPU0 gpu_needs_reset FORGED\\r\\x1b[2J\\x1b]52;c;Zm9yZ2Vk\\x07 end" \
        in line, line
    daemon.stop()
    clean(bytes(daemon.data))


def test_a_record_with_line_ends_and_a_priority_in_it_is_one_journal_line_with_one_priority():
    read, write = os.pipe()
    handler = QueuedLog(JournalFormatter("%(message)s"), fd=write)
    logger = logging.getLogger("test_outside_text")
    logger.addHandler(handler)
    logger.propagate = False
    try:
        try:
            raise ValueError("a\nb")
        except ValueError:
            logger.warning("proxy: POST %s\n<0>gpuwarden: GPU0 gpu_needs_reset\r\x1b[2J", "/x\x00", exc_info=True)
        assert handler.drain(5)
    finally:
        logger.removeHandler(handler)
        handler.close()
        os.close(write)
    with os.fdopen(read, "rb") as out:
        data = out.read()
    assert data.count(b"\n") == 1 and data.endswith(b"\n"), data
    assert data.startswith(b"<4>proxy: POST /x\\x00\\n<0>gpuwarden: GPU0 gpu_needs_reset\\r\\x1b[2J\\nTraceback"), data
    assert b"ValueError: a\\nb" in data
    clean(data)


def test_a_status_with_a_line_end_is_one_field_of_the_datagram(tmp_path):
    path = tmp_path / "notify"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as systemd:
        systemd.bind(str(path))
        systemd.settimeout(5)
        notifier = Notifier({"NOTIFY_SOCKET": str(path)})
        notifier.ready("port 8000 held by pid 7 (user bob, x\nSTOPPING=1)", now=0.0)
        notifier.status("port 8000 held by pid 8 (user bob, \x1b\rSTOPPING=1)", now=100.0)
        ready, status = systemd.recv(4096), systemd.recv(4096)
    assert ready.split(b"\n") == [b"READY=1", b"STATUS=port 8000 held by pid 7 (user bob, x\\nSTOPPING=1)"]
    assert status.split(b"\n") == [b"STATUS=port 8000 held by pid 8 (user bob, \\x1b\\rSTOPPING=1)"]


@pytest.mark.process
def test_a_process_name_with_a_line_end_or_bytes_not_utf8_is_described_on_one_line():
    # A real process names itself, as any local user's can (prctl PR_SET_NAME, or its own comm file).
    child = subprocess.Popen([sys.executable, "-c", "import sys, time; open('/proc/self/comm', 'wb').write("
                              "bytes.fromhex(sys.argv[1])); print(flush=True); time.sleep(60)",
                              (b"a\nSTOPPING=1\xff").hex()], stdout=subprocess.PIPE)
    try:
        child.stdout.readline()  # named
        said = describe(child.pid)
    finally:
        child.kill()
        child.wait()
    assert said.endswith(", a\\nSTOPPING=1\ufffd)") and said.startswith(f"pid {child.pid} ("), said


# -- the terminal: status and bench -----------------------------------------------------------------------------
class Answers(BaseHTTPRequestHandler):
    """A server that answers each path with what the test put in `routes`: (raw status line, body)."""

    routes: dict = {}

    def _answer(self):
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        status, body = self.routes.get(self.path.split("?")[0], (b"HTTP/1.1 404 Not Found", b"{}"))
        self.wfile.write(status + b"\r\nContent-Type: application/json\r\nContent-Length: %d\r\n"
                                  b"Connection: close\r\n\r\n" % len(body) + body)

    do_GET = do_POST = _answer

    def log_message(self, *args):
        pass


@pytest.fixture
def answers():
    servers = []

    def start(routes):
        handler = type("Routes", (Answers,), {"routes": routes})
        server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return server.server_address[1]

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


def test_status_with_a_5000_digit_status_code_is_one_line_and_no_traceback(answers, cli, write):
    port = answers({"/status": (b"HTTP/1.1 " + b"2" * 5000 + b" OK", b"{}")})
    config = write("g.yaml", f"gpu: {{backend: sim, scenario: dgx-spark}}\nmetrics: {{listen: '127.0.0.1:{port}'}}\n")
    code, out, err = cli("status", "-c", config)
    assert code != 0 and out == "", (code, out)
    assert len(err.splitlines()) == 1 and "status code that is not three digits" in err, err


def test_status_strings_with_escapes_are_printed_escaped(answers, cli, write):
    state = {"daemon": {"version": "1\x1b[2J", "pid": 5, "started_at": time.time()}, "status": "ok\x1b]52;c;eA==\x07",
             "gpus": [{"index": 0, "name": "GPU\x1b[31m\nfake row", "up": False, "error": "x\r\x00"}],
             "alerts_firing": [{"gpu": None, "severity": "crit", "alert": "a\x1b", "observed": "o", "threshold": "t"}]}
    port = answers({"/status": (b"HTTP/1.1 200 OK", json.dumps(state).encode())})
    config = write("g.yaml", f"gpu: {{backend: sim, scenario: dgx-spark}}\nmetrics: {{listen: '127.0.0.1:{port}'}}\n")
    code, out, err = cli("status", "-c", config)
    assert code == 0, err
    clean(out.encode())
    assert "gpuwarden 1\\x1b[2J (pid 5" in out and "ok\\x1b]52;c;eA==\\x07" in out, out
    assert "GPU\\x1b[31m\\nfake row" in out and "x\\r\\x00" in out and "a\\x1b" in out, out


def test_status_of_the_wrong_shape_is_one_line(answers, cli, write):
    state = {"daemon": {}, "gpus": [{"index": 0, "name": "g", "power_w": "many"}]}
    port = answers({"/status": (b"HTTP/1.1 200 OK", json.dumps(state).encode())})
    config = write("g.yaml", f"gpu: {{backend: sim, scenario: dgx-spark}}\nmetrics: {{listen: '127.0.0.1:{port}'}}\n")
    code, out, err = cli("status", "-c", config)
    assert code != 0 and len(err.splitlines()) == 1 and "not shaped as" in err, (code, out, err)


@pytest.mark.process
def test_bench_prints_a_servers_error_text_escaped(answers, tmp_path, write):
    hostile = "\x1b]52;c;Zm9yZ2Vk\x07\x1b[2J\rcleared"
    error = json.dumps({"error": {"message": hostile}}).encode()
    port = answers({"/v1/models": (b"HTTP/1.1 200 OK", json.dumps({"data": [{"id": "m\x1b[5m"}]}).encode()),
                    "/v1/completions": (b"HTTP/1.1 500 Internal Server Error", error),
                    "/v1/chat/completions": (b"HTTP/1.1 500 Internal Server Error", error)})
    conf = write("b.yaml", "gpu: {backend: sim, scenario: rtx-pro-4000-headless}\nmetrics: {listen: none}\n")
    out = subprocess.run([*gpuwarden_cmd(), "bench", "-c", str(conf), "--url", f"http://127.0.0.1:{port}",
                          "--idle", "0"], capture_output=True, env={**subprocess_env(), "STATE_DIRECTORY":
                                                                   str(tmp_path / "state")}, timeout=120)
    assert out.returncode == 1, out
    clean(out.stdout + out.stderr)
    assert b"\\x1b]52;c;Zm9yZ2Vk\\x07\\x1b[2J\\rcleared" in out.stderr, out.stderr
