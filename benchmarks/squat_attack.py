"""A local user squats the engine's port while it restarts; clients keep sending keyed requests through the proxy.

    sudo python3 benchmarks/squat_attack.py [--cycles 10]      # root: the squatter runs as user nobody

The proxy alone (--hold-s 30) in front of tests/harness/fake_upstream.py; four clients send chat requests with
`Authorization: Bearer sk-ATTACKED` and a private prompt without pause. Each cycle: tests/harness/squatter.py as
nobody loops on bind() of the engine's port every millisecond, the engine is SIGKILLed, the squatter takes the port
and answers everything 200 for 1.5 s, then goes, and the engine starts again. Printed: what the squatter read, and
what the clients got (benchmarks/RESULTS.md, section 23).
"""

import argparse
import base64
import http.client
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
KEY = b"sk-ATTACKED"


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Squatter:
    def __init__(self, port: int, seen: dict):
        self.bound, self.seen = threading.Event(), seen
        self.proc = subprocess.Popen(["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups",
                                      "/usr/bin/python3", str(ROOT / "tests" / "harness" / "squatter.py"), "--port",
                                      str(port)], stdout=subprocess.PIPE, text=True)
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            if line.startswith("CONN"):
                self.seen["conns"] += 1
            elif line.startswith("DATA "):
                self.seen["data"] += base64.b64decode(line[5:])
            elif line.startswith("BOUND"):
                self.bound.set()

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait(10)
        self.reader.join(10)
        self.proc.stdout.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cycles", type=int, default=10)
    args = parser.parse_args()
    if os.geteuid() != 0:
        sys.exit("squat_attack: run as root: the squatter must be another user (nobody) than the engine's")
    up, front = free_port(), free_port()
    proxy = subprocess.Popen([sys.executable, "-m", "gpuwarden", "proxy", "-c", "none", "--upstream",
                              f"http://127.0.0.1:{up}", "--listen", f"127.0.0.1:{front}", "--hold-s", "30"],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             env=dict(os.environ, PYTHONPATH=str(ROOT / "daemon")))
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(proxy.stdout), daemon=True).start()

    def engine_up() -> bool:
        try:
            conn = http.client.HTTPConnection("127.0.0.1", up, timeout=1)
            conn.request("GET", "/debug/open")
            ok = "open" in conn.getresponse().read().decode()  # the squatter answers {}
            conn.close()
            return ok
        except OSError:
            return False

    def start_engine() -> subprocess.Popen:
        engine = subprocess.Popen([sys.executable, str(ROOT / "tests" / "harness" / "fake_upstream.py"), "--port",
                                   str(up), "--chunk-delay", "0"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 60
        while not engine_up():
            if engine.poll() is not None or time.monotonic() > deadline:
                sys.exit(f"squat_attack: the fake engine did not start (exit {engine.poll()}): it needs aiohttp")
            time.sleep(0.05)
        return engine

    answers: dict = {}
    stop = threading.Event()

    def client() -> None:
        body = json.dumps({"messages": [{"role": "user", "content": "my private prompt"}]})
        while not stop.is_set():
            try:
                conn = http.client.HTTPConnection("127.0.0.1", front, timeout=60)
                conn.request("POST", "/v1/chat/completions", body=body,
                             headers={"Authorization": f"Bearer {KEY.decode()}"})
                status = conn.getresponse()
                status.read()
                conn.close()
                answers[status.status] = answers.get(status.status, 0) + 1
            except OSError as exc:
                answers[type(exc).__name__] = answers.get(type(exc).__name__, 0) + 1
            time.sleep(0.02)

    seen = {"conns": 0, "data": b""}
    time.sleep(1.5)
    engine = start_engine()
    clients = [threading.Thread(target=client, daemon=True) for _ in range(4)]
    for t in clients:
        t.start()
    held = 0
    try:
        for _ in range(args.cycles):
            time.sleep(0.5)
            squatter = Squatter(up, seen)
            time.sleep(0.3)  # looping on bind()
            engine.kill()  # the crash
            engine.wait()
            held += squatter.bound.wait(5)
            time.sleep(1.5)  # the clients' requests and the hold's looks at /health meet the squatter
            squatter.stop()
            engine = start_engine()
    finally:
        stop.set()
        for t in clients:
            t.join(70)
        engine.kill()
        proxy.terminate()
        proxy.wait(30)
    print(f"cycles {args.cycles}; the squatter held the port {held} times; connections it took {seen['conns']}; "
          f"bytes it read {len(seen['data'])}; the key among them: {KEY in seen['data']}")
    print("clients' answers:", dict(sorted(answers.items(), key=str)))
    print("proxy lines naming the squatter:", sum("not of the engine's" in line for line in lines))


if __name__ == "__main__":
    main()
