"""`gpuwarden status` (web/status.py, cli/status.py) against whatever answers on the metrics port's /status: GPM
figures that are strings, bools, negative, NaN, 1e308 or 400-digit integers, nesting past Python's recursion
limit, a gigabyte, a server that trickles. Each is one line and exit 3, naming the URL; `gpuwarden status` runs as
a real process. The hostile server here (hostile_status) also answers bench's GPU view (test_bench_watch.py)."""

import json
import subprocess
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from conftest import gpuwarden_cmd, subprocess_env

BIG_TEXT = "9" * 400


def good_gpu(**fields):
    return {"index": 0, "name": "H100", "up": True, "sm_clock_mhz": 1980, "memory_clock_mhz": 2619,
            "max_sm_clock_mhz": 1980, "power_w": 500.0, "power_limit_w": 700.0, "temperature_c": 60,
            "utilization_pct": 100.0, "memory_bandwidth_bytes_per_s": 3.35e12, "clock_event_reasons": [],
            "sm_lock_mhz": None, "sm_active_ratio": 0.6, "tensor_active_ratio": 0.2, "dram_bandwidth_ratio": 0.8,
            **fields}


def state_of(*gpus, **daemon):
    return json.dumps({"daemon": {"version": "x", "pid": 1, "started_at": time.time(), **daemon},
                       "status": "ok", "gpus": list(gpus), "alerts_firing": []}).encode()


def raw_state(gpu_text: str, daemon_text: str = '{"version": "x"}') -> bytes:
    """A /status written by hand: what json.dumps would not write (NaN, 400-digit integers)."""
    return f'{{"daemon": {daemon_text}, "status": "ok", "gpus": [{gpu_text}], "alerts_firing": []}}'.encode()


def figure(name: str, text: str) -> bytes:
    base = json.dumps(good_gpu())[:-1]
    return raw_state(f'{base}, "{name}": {text}}}')


# (what, the body or a mode): each answered in turn, one per request
BAD_FIGURES = [
    ("a string", figure("sm_active_ratio", '"x"')),
    ("400 digits", figure("sm_active_ratio", BIG_TEXT)),
    ("1e308", figure("tensor_active_ratio", "1e308")),
    ("negative", figure("dram_bandwidth_ratio", "-5")),
    ("a bool", figure("sm_active_ratio", "true")),
    ("NaN", figure("sm_active_ratio", "NaN")),
    ("Infinity", figure("dram_bandwidth_ratio", "-Infinity")),
    ("nested lists", figure("tensor_active_ratio", "[[0.5]]")),
    ("power of 400 digits", figure("power_w", BIG_TEXT)),
    ("started_at of 400 digits", raw_state(json.dumps(good_gpu()), '{"started_at": %s}' % BIG_TEXT)),
]
BAD_BODIES = [
    ("nesting past the recursion limit", b'{"daemon": {}, "gpus": ' + b"[" * 200_000 + b"]" * 200_000 + b"}"),
    ("a gigabyte announced", ("length", 10**9)),
    ("a gigabyte streamed", ("stream", 10**9)),
    ("a trickle", ("trickle", 120.0)),  # cut by the read's 3 s deadline, long before it ends
]


class Hostile(BaseHTTPRequestHandler):
    answers: list = []  # bodies or (mode, n), served in turn
    served = [0]

    def log_message(self, *args):
        pass

    def do_GET(self):
        if self.path != "/status":
            self.send_error(404)
            return
        answer = self.answers[self.served[0] % len(self.answers)]
        self.served[0] += 1
        try:
            if isinstance(answer, bytes):
                self.send_response(200)
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)
                return
            mode, n = answer
            self.send_response(200)
            if mode == "length":
                self.send_header("Content-Length", str(n))
            self.end_headers()
            if mode in ("length", "stream"):
                chunk = b'{"daemon": {}, "gpus": [' + b" " * (1 << 20)
                sent = 0
                while sent < n:
                    self.wfile.write(chunk)
                    sent += len(chunk)
            else:  # a byte a second, for n seconds
                self.wfile.write(b'{"daemon": {},')
                end = time.monotonic() + n
                while time.monotonic() < end:
                    self.wfile.write(b" ")
                    self.wfile.flush()
                    time.sleep(1)
        except OSError:  # the client gave up, as it should
            pass


@pytest.fixture
def hostile_status():
    servers = []

    def start(answers):
        handler = type("H", (Hostile,), {"answers": list(answers), "served": [0]})
        server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        server.daemon_threads = True
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


@pytest.mark.process
@pytest.mark.parametrize("what,answer", BAD_FIGURES + BAD_BODIES, ids=[w for w, _ in BAD_FIGURES + BAD_BODIES])
def test_status_from_a_foreign_server_is_one_line_naming_what_and_where(what, answer, hostile_status, tmp_path):
    server = hostile_status([answer])
    conf = tmp_path / "s.yaml"
    conf.write_text(f"gpu: {{backend: sim, scenario: dgx-spark}}\nmetrics: {{listen: '127.0.0.1:"
                    f"{server.server_address[1]}'}}\n")
    started = time.monotonic()
    out = subprocess.run([*gpuwarden_cmd(), "status", "-c", str(conf)], capture_output=True, text=True,
                         env={**subprocess_env(), "STATE_DIRECTORY": str(tmp_path / "state")}, timeout=60)
    took = time.monotonic() - started
    assert out.returncode == 3 and out.stdout == "", (what, out)
    assert len(out.stderr.splitlines()) == 1 and "Traceback" not in out.stderr, (what, out.stderr)
    assert f"127.0.0.1:{server.server_address[1]}" in out.stderr, out.stderr
    assert took < 60, took  # the read's 3 s deadline and the interpreter's start, not the 120 s trickle
    if answer in dict(BAD_FIGURES).values() and "started_at" not in what and "power" not in what:
        assert "GPU 0" in out.stderr and "is not a share 0..1" in out.stderr, out.stderr  # names the figure
