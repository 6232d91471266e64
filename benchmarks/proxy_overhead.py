"""What the proxy adds on loopback: per request and per streamed chunk, against direct, in one run.

    python3 benchmarks/proxy_overhead.py [--requests 400] [--streams 60] [--chunks 50] [--chunk-delay 0.005]

A fake engine (tests/harness/fake_upstream.py) and `gpuwarden proxy` (all rules on) run as processes of their own;
this client alternates, request by request, between the engine directly and the proxy, over one kept-alive
connection to each:
- per request: a small non-streaming chat completion (so the proxy parses and checks it), send to last byte;
- per chunk: streams of --chunks SSE events --chunk-delay apart; chunk k's arrival after the send, through the
  proxy minus direct, as medians over the streams for each k (the engine's own timer jitter is in both).
"""

import argparse
import http.client
import json
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "vllm"))
from _common import start  # noqa: E402  (benchmarks/ is the script's own directory)
from proxy_rig import free_port  # noqa: E402


def timed(conn, body: bytes, stream: bool) -> list[float]:
    """[time to the last byte] or, streaming, [time to the response headers, then to each SSE event]."""
    began = time.perf_counter()
    conn.request("POST", "/v1/chat/completions", body=body, headers={"Content-Type": "application/json"})
    reply = conn.getresponse()
    if not stream:
        reply.read()
        return [time.perf_counter() - began]
    times = [time.perf_counter() - began]
    while True:
        line = reply.readline()
        if not line:
            break
        if line.startswith(b"data: "):
            times.append(time.perf_counter() - began)
    return times


def pct(values, q):
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--streams", type=int, default=60)
    parser.add_argument("--chunks", type=int, default=50)
    parser.add_argument("--chunk-delay", type=float, default=0.005)
    args = parser.parse_args()
    up, px = free_port(), free_port()
    procs = [start([sys.executable, str(ROOT / "tests" / "harness" / "fake_upstream.py"), "--port", str(up),
                    "--chunk-delay", str(args.chunk_delay)], up)]
    try:
        procs.append(start([sys.executable, "-m", "gpuwarden", "proxy", "-c", "none", "--upstream",
                            f"http://127.0.0.1:{up}", "--listen", f"127.0.0.1:{px}", "--rules",
                            "billing_header,cache_control,sort_tools,date_line"], px))
        conns = {"direct": http.client.HTTPConnection("127.0.0.1", up), "proxy": http.client.HTTPConnection("127.0.0.1", px)}
        small = json.dumps({"model": "tiny", "max_tokens": 8, "messages": [
            {"role": "system", "content": "You are a coding agent."}, {"role": "user", "content": "hi " * 200}],
            "tools": [{"type": "function", "function": {"name": n, "parameters": {}}} for n in ("a", "b", "c")]}).encode()
        streamed = json.dumps({"stream": True, "chunks": args.chunks}).encode()
        for who in conns:  # warm both paths
            timed(conns[who], small, False)
        latency = {"direct": [], "proxy": []}
        for i in range(args.requests):
            order = ("direct", "proxy") if i % 2 else ("proxy", "direct")
            for who in order:
                latency[who] += timed(conns[who], small, False)
        arrivals = {"direct": [], "proxy": []}
        for i in range(args.streams):
            order = ("direct", "proxy") if i % 2 else ("proxy", "direct")
            for who in order:
                arrivals[who].append(timed(conns[who], streamed, True))
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(10)
    ms = {who: [v * 1e3 for v in values] for who, values in latency.items()}
    print(f"per request ({args.requests} each, alternating): direct p50 {pct(ms['direct'], .5):.3f} ms, p99 "
          f"{pct(ms['direct'], .99):.3f} ms; proxy p50 {pct(ms['proxy'], .5):.3f} ms, p99 {pct(ms['proxy'], .99):.3f} ms; "
          f"added: p50 {pct(ms['proxy'], .5) - pct(ms['direct'], .5):.3f} ms, "
          f"p99 {pct(ms['proxy'], .99) - pct(ms['direct'], .99):.3f} ms")
    n = min(len(a) for who in arrivals for a in arrivals[who])
    added = [(statistics.median(a[k] for a in arrivals["proxy"]) - statistics.median(a[k] for a in arrivals["direct"]))
             * 1e3 for k in range(n)]  # [0]: the response headers, then each event
    relay = [a - added[0] for a in added[1:]]  # what passing one event on adds, beyond the request's own overhead
    print(f"per chunk ({args.streams} streams of {n - 1} events each way), medians over streams: headers "
          f"{added[0]:.3f} ms later through the proxy; each event {statistics.median(added[1:]):.3f} ms later "
          f"(max {max(added[1:]):.3f}), of which passing it on: median {statistics.median(relay):.3f} ms, "
          f"max {max(relay):.3f} ms")
    added = added[1:]
    print(json.dumps({"request_ms": {w: {"p50": pct(v, .5), "p99": pct(v, .99)} for w, v in ms.items()},
                      "chunk_added_ms": {"median": statistics.median(added), "max": max(added)}}), file=sys.stderr)


if __name__ == "__main__":
    main()
