"""The proxy under hostile clients, in one run: a crowd of half-sent bodies past its fd limit, and its peak memory
with four maximum-size bodies at once.

    PYTHONPATH=daemon python3 benchmarks/proxy_limits.py [--crowd 1100] [--hold 30] [--nofile 1024]
        [--daemon DIR] [--skip-crowd] [--skip-memory] [--shapes ascii,cjk,astral,dicts] [--dumps both]

The fake engine (tests/harness/fake_upstream.py) and `gpuwarden proxy` run as processes of their own, the proxy under
RLIMIT_NOFILE = --nofile set in its own process, as the unit's LimitNOFILE= would (--daemon DIR: the package
to run, e.g. an older checkout's daemon/, for the figures before).

crowd: a client sends a small chat completion every 50 ms, each on a new connection with a 5 s deadline. After
5 s, a crowd (a process of its own) opens --crowd connections, each sending the headers and the first bytes of
a 1000-byte body and then nothing, and opens a new one for each the proxy closes, for --hold seconds; then it
closes them all and exits. Reported: the share of the client's requests answered 200 before, during and after
the hold; when the first 200 came after the crowd left; the bytes the proxy logged during the hold; its peak RSS.

memory: for each body shape (ASCII, CJK and astral-plane text, `[{},{},...]`), four clients send a body of
--max-body-bytes (32 MiB) to /v1/messages at once, each retrying a 503 after its Retry-After (at most 60 times);
a new proxy for each shape, without and with --dump-dir. Reported: its peak RSS (VmHWM) and the answers.
"""

import argparse
import http.client
import json
import multiprocessing
import os
import queue
import resource
import selectors
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from _common import free_port, start

ROOT = Path(__file__).resolve().parent.parent
HALF_SENT = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{\"model\": "
SMALL = json.dumps({"model": "tiny", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}).encode()




def stop(proc):
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


def peak_rss_mib(pid) -> float:
    with open(f"/proc/{pid}/status") as status:
        return int(next(line for line in status if line.startswith("VmHWM:")).split()[1]) / 1024


def post(port, body, timeout=5.0):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("POST", "/v1/chat/completions", body=body, headers={"Content-Type": "application/json"})
        reply = conn.getresponse()
        reply.read()
        return reply.status, reply.getheader("Retry-After")
    finally:
        conn.close()


# -- the crowd -----------------------------------------------------------------------------------------------

def crowd(port, n, hold_s, report):
    """Keep n half-sent bodies open for hold_s seconds, opening a new one for each the proxy closes."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    selector, opened, failed = selectors.DefaultSelector(), 0, 0
    end = time.monotonic() + hold_s
    while time.monotonic() < end:
        while len(selector.get_map()) < n and time.monotonic() < end:
            try:
                sock = socket.create_connection(("127.0.0.1", port), timeout=0.5)
                sock.sendall(HALF_SENT)
            except OSError:
                failed += 1
                break
            sock.setblocking(False)
            selector.register(sock, selectors.EVENT_READ)
            opened += 1
        for key, _ in selector.select(timeout=0.1):  # readable: closed by the proxy (or answered)
            selector.unregister(key.fileobj)
            key.fileobj.close()
    held = len(selector.get_map())
    for key in list(selector.get_map().values()):
        key.fileobj.close()
    report.put({"opened": opened, "failed_connects": failed, "open_at_end": held})


def run_crowd(args, env) -> dict:
    up, px = free_port(), free_port()
    log = tempfile.NamedTemporaryFile(prefix="proxy-log-", delete=False)
    procs = [start([sys.executable, str(ROOT / "tests" / "harness" / "fake_upstream.py"), "--port", str(up)], up, env)]
    try:
        proxy = start([sys.executable, "-m", "gpuwarden", "proxy", "-c", "none", "--upstream",
                       f"http://127.0.0.1:{up}", "--listen", f"127.0.0.1:{px}"], px, env, log, args.nofile)
        procs.append(proxy)
        results, marks = [], {}
        stop_client = threading.Event()

        def client():
            while not stop_client.is_set():
                began = time.monotonic()
                try:
                    ok = post(px, SMALL)[0] == 200
                except OSError:
                    ok = False
                results.append((began, ok, time.monotonic() - began))
                stop_client.wait(max(0.0, 0.05 - (time.monotonic() - began)))

        thread = threading.Thread(target=client, daemon=True)
        thread.start()
        time.sleep(5)
        report = multiprocessing.Queue()
        worker = multiprocessing.Process(target=crowd, args=(px, args.crowd, args.hold, report))
        marks["arrive"], log_before = time.monotonic(), os.path.getsize(log.name)
        worker.start()
        worker.join(args.hold + 60)
        if worker.is_alive():
            worker.kill()
            worker.join()
        marks["leave"], log_during = time.monotonic(), os.path.getsize(log.name) - log_before
        try:
            crowd_report = report.get(timeout=10)
        except queue.Empty:
            crowd_report = {}
        time.sleep(10)
        stop_client.set()
        thread.join(10)
        alive = proxy.poll() is None
        rss = peak_rss_mib(proxy.pid) if alive else None
    finally:
        for proc in reversed(procs):
            stop(proc)
        os.unlink(log.name)
    phases = {"before": [r for r in results if r[0] < marks["arrive"]],
              "during": [r for r in results if marks["arrive"] <= r[0] < marks["leave"]],
              "after": [r for r in results if r[0] >= marks["leave"]]}
    first_ok = next((r[0] + r[2] - marks["leave"] for r in phases["after"] if r[1]), None)
    out = {"crowd": crowd_report, "proxy_alive": alive, "peak_rss_mib": rss, "log_bytes_during_hold": log_during,
           "first_200_after_leaving_s": first_ok}
    for name, rows in phases.items():
        out[f"served_{name}"] = f"{sum(ok for _, ok, _ in rows)}/{len(rows)}"
        latencies = sorted(t for _, ok, t in rows if ok)
        out[f"p99_ms_{name}"] = round(latencies[int(0.99 * (len(latencies) - 1))] * 1e3, 1) if latencies else None
    return out


# -- memory --------------------------------------------------------------------------------------------------

def body_of(shape: str, size: int) -> bytes:
    head = b'{"model": "tiny", "max_tokens": 1, "messages": [{"role": "user", "content": "'
    tail = b'"}]}'
    room = size - len(head) - len(tail)
    if shape == "ascii":
        text = b"x" * room
    elif shape == "cjk":
        text = "中".encode() * (room // 3)
    elif shape == "astral":
        text = b"x" * (room - 4) + "😀".encode()
    else:  # [{},{},...]: the shape that took the proxy to 846 MB
        units = (size - 40) // 3
        return b'{"model": "tiny", "messages": [' + b"{}," * units + b"{}]}"
    return head + text + tail


def run_memory(args, env, shape: str, dumps: bool) -> dict:
    up, px = free_port(), free_port()
    procs = [start([sys.executable, str(ROOT / "tests" / "harness" / "fake_upstream.py"), "--port", str(up)], up, env)]
    body = body_of(shape, args.max_body_bytes)
    answers, tries = [], []
    with tempfile.TemporaryDirectory() as dump_dir:
        try:
            extra = ["--max-body-bytes", str(args.max_body_bytes)] + (["--dump-dir", dump_dir] if dumps else [])
            proxy = start([sys.executable, "-m", "gpuwarden", "proxy", "-c", "none", "--upstream",
                           f"http://127.0.0.1:{up}", "--listen", f"127.0.0.1:{px}", *extra], px, env,
                          nofile=args.nofile)
            procs.append(proxy)
            idle = peak_rss_mib(proxy.pid)

            def client():
                for attempt in range(1, 61):
                    try:
                        status, retry = post(px, body, timeout=120)
                    except OSError as exc:
                        status, retry = type(exc).__name__, None
                    if status != 503:
                        break
                    time.sleep(float(retry or 1))
                answers.append(status)
                tries.append(attempt)

            began = time.monotonic()
            threads = [threading.Thread(target=client) for _ in range(4)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(600)
            took = time.monotonic() - began
            rss = peak_rss_mib(proxy.pid)
            kept = sum(1 for _ in Path(dump_dir).glob("*/*.json"))
        finally:
            for proc in reversed(procs):
                stop(proc)
    return {"shape": shape, "dumps": dumps, "body_bytes": len(body), "idle_rss_mib": round(idle, 1),
            "peak_rss_mib": round(rss, 1), "answers": sorted(answers, key=str), "attempts": sorted(tries),
            "seconds": round(took, 1), "dumps_kept": kept}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--crowd", type=int, default=1100)
    parser.add_argument("--hold", type=float, default=30.0)
    parser.add_argument("--nofile", type=int, default=1024)
    parser.add_argument("--max-body-bytes", type=int, default=32 << 20)
    parser.add_argument("--daemon", type=Path, default=ROOT / "daemon", help="the gpuwarden package's parent")
    parser.add_argument("--skip-crowd", action="store_true")
    parser.add_argument("--skip-memory", action="store_true")
    parser.add_argument("--shapes", default="ascii,cjk,astral,dicts", help="memory: the body shapes, comma-separated")
    parser.add_argument("--dumps", choices=("off", "on", "both"), default="both", help="memory: without, with or both")
    args = parser.parse_args()
    env = dict(os.environ, PYTHONPATH=str(args.daemon.resolve()), PYTHONUNBUFFERED="1")
    if not args.skip_crowd:
        print(json.dumps({"crowd": run_crowd(args, env)}), flush=True)
    if not args.skip_memory:
        for dumps in {"off": (False,), "on": (True,), "both": (False, True)}[args.dumps]:
            for shape in args.shapes.split(","):
                print(json.dumps({"memory": run_memory(args, env, shape, dumps)}), flush=True)


if __name__ == "__main__":
    main()
