"""/metrics for Prometheus while crowds attack it (issue 24, item 6), before and after, side by side.

    python3 benchmarks/metrics_attack.py [--before REV] [--seconds 20] [--clients 64] [--smoke]
    python3 benchmarks/metrics_attack.py crowd {trickle,guess} --port P [--cafile CRT] [--clients 64] [--seconds 5]

For each code tree (the revision given by --before, unpacked with `git archive`, and this checkout) and
each attack, it starts `gpuwarden run` on two simulated GPUs, lets a good scraper fetch /metrics once, then
starts the crowd as a process of its own and lets the good scraper fetch once every 0.5 s for --seconds
(10 s timeout, as Prometheus's default). The guessing crowd comes three times: after that first fetch
(warm: the good password remembered); with no fetch before (cold: Prometheus started during the attack,
its first scrape needs a password check); and after the first fetch and a SIGUSR2 (handover: the new
image must still remember it). The attacks:

- trickle: --clients connections that each send a request head a byte every 0.5 s and never finish it,
  reconnecting when the server closes them; over plain HTTP, and over TLS with basic auth (the handshake
  finished first);
- guess: --clients scrapers with a new wrong password each time, back to back (TLS, basic auth, bcrypt
  cost 12). The good scrapes come in turn from 127.0.0.2, as Prometheus on a host of its own, and from
  127.0.0.1, the crowd's own address: a row for each.

It reports the good scrapes answered 200, their latency p50/p99, and the daemon's CPU (user + system,
from /proc) over the window. `crowd` runs one crowd alone and prints what it got as JSON (the tests use it).
"""

from __future__ import annotations

import argparse
import http.client
import itertools
import json
import os
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

from _common import free_port, percentile
from scrape import checkout  # first: it puts this checkout's daemon/ on sys.path
from footprint import cpu_seconds  # noqa: I001

from gpuwarden.base.webconfig import basic_auth_header

ROOT = Path(__file__).resolve().parent.parent
GOOD = ("prometheus", "s3cret")
REQUEST = b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Trickle: "


def client_context(cafile: str | None) -> ssl.SSLContext | None:
    if cafile is None:
        return None
    context = ssl.create_default_context(cafile=cafile)
    context.check_hostname = False
    return context


def get(port: int, context: ssl.SSLContext | None, auth: tuple[str, str] | None = None,
        source: str = "127.0.0.1", timeout: float = 10) -> int:
    """The status of GET /metrics, or 0 when refused, reset or timed out."""
    headers = {"Authorization": basic_auth_header(*auth)} if auth else {}
    conn = (http.client.HTTPSConnection("127.0.0.1", port, timeout=timeout, context=context,
                                        source_address=(source, 0)) if context
            else http.client.HTTPConnection("127.0.0.1", port, timeout=timeout, source_address=(source, 0)))
    try:
        conn.request("GET", "/metrics", headers=headers)
        response = conn.getresponse()
        response.read()
        return response.status
    except (OSError, http.client.HTTPException):
        return 0
    finally:
        conn.close()


def guess_crowd(port: int, cafile: str | None, clients: int, seconds: float, source: str = "127.0.0.1") -> dict:
    """Wrong passwords, a new one each time, from `clients` threads back to back, all from the source address;
    the replies by status."""
    context = client_context(cafile)
    replies: Counter[int] = Counter()
    lock = threading.Lock()
    end = time.monotonic() + seconds

    def guesser(n: int) -> None:
        for i in itertools.count():
            if time.monotonic() >= end:
                return
            code = get(port, context, ("prometheus", f"guess-{n}-{i}"), source, timeout=5)
            with lock:
                replies[code] += 1

    threads = [threading.Thread(target=guesser, args=(n,)) for n in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return {"replies": {str(code): count for code, count in sorted(replies.items())}}


def trickle_crowd(port: int, cafile: str | None, clients: int, seconds: float, every: float = 0.5) -> dict:
    """`clients` requests that never end, a byte each every `every` s; one closed by the server is opened
    again. How many were opened, and how many the server closed."""
    context = client_context(cafile)
    opened = closed = 0
    crowd: list[socket.socket] = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        while len(crowd) < clients and time.monotonic() < end:
            try:
                s = socket.create_connection(("127.0.0.1", port), timeout=5)
                if context:
                    s = context.wrap_socket(s)
                s.sendall(REQUEST)
            except OSError:
                closed += 1
                time.sleep(0.01)
                continue
            opened += 1
            crowd.append(s)
        time.sleep(every)
        for s in list(crowd):
            try:
                s.sendall(b"a")
            except OSError:
                closed += 1
                crowd.remove(s)
                s.close()
    for s in crowd:
        s.close()
    return {"opened": opened, "closed_by_server": closed}


def web_files(folder: Path) -> Path:
    """A web.yml with a self-signed certificate and prometheus:s3cret at bcrypt cost 12."""
    import bcrypt

    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
                    "-keyout", str(folder / "server.key"), "-out", str(folder / "server.crt")],
                   check=True, capture_output=True, timeout=60)
    hashed = bcrypt.hashpw(GOOD[1].encode(), bcrypt.gensalt(rounds=12)).decode()
    web = folder / "web.yml"
    web.write_text(f"tls_server_config:\n  cert_file: server.crt\n  key_file: server.key\n"
                   f"basic_auth_users:\n  {GOOD[0]}: '{hashed}'\n")
    return web


def start(tree: Path, folder: Path, name: str, web: Path | None) -> tuple[subprocess.Popen, int, Path]:
    port = free_port()
    cfg = folder / f"{name}.yaml"
    cfg.write_text(f"poll_interval_s: 1.0\nlog_interval_s: 3600\ntuning:\n  apply: false\n"
                   f"metrics:\n  listen: 127.0.0.1:{port}\n" + (f"  web_config: {web}\n" if web else ""))
    log = folder / f"{name}.log"
    proc = subprocess.Popen([sys.executable, "-m", "gpuwarden", "run", "-c", str(cfg), "--sim",
                             "rtx-pro-4000-headless"], env=dict(os.environ, PYTHONPATH=str(tree)),
                            stdout=subprocess.DEVNULL, stderr=log.open("wb"))
    return proc, port, log


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)


def serving(proc: subprocess.Popen, log: Path, times: int, tree: Path) -> None:
    """Until the daemon's log says it serves /metrics for the times-th time (a handover's new image: 2)."""
    deadline = time.monotonic() + 30
    while log.read_text(errors="replace").count("serving /metrics and /status on ") < times:
        if time.monotonic() > deadline or proc.poll() is not None:
            raise SystemExit(f"metrics_attack.py: the daemon from {tree} did not serve /metrics")
        time.sleep(0.1)


def attack(tree: Path, folder: Path, name: str, kind: str, web: Path | None, sources: list[str],
           clients: int, seconds: float, when: str = "warm") -> list[dict]:
    """One daemon, one crowd; a row per good scraper's source address, the scrapers taking turns. when: warm
    (a good fetch first), cold (none), handover (a good fetch, then SIGUSR2)."""
    proc, port, log = start(tree, folder, name, web)
    context = client_context(str(web.parent / "server.crt") if web else None)
    auth = GOOD if web else None
    try:
        serving(proc, log, 1, tree)
        if when != "cold" and get(port, context, auth) != 200:  # the good password remembered
            raise SystemExit(f"metrics_attack.py: the daemon from {tree} refused the good scrape")
        if when == "handover":
            proc.send_signal(signal.SIGUSR2)
            serving(proc, log, 2, tree)
        crowd = subprocess.Popen([sys.executable, __file__, "crowd", kind, "--port", str(port), "--clients",
                                  str(clients), "--seconds", str(seconds + 2)]
                                 + (["--cafile", str(web.parent / "server.crt")] if web else []),
                                 stdout=subprocess.PIPE, text=True)
        try:
            time.sleep(1)  # the crowd in place
            began, cpu_before = time.monotonic(), cpu_seconds(proc.pid)
            results = {source: [] for source in sources}
            for tick in itertools.count():
                if time.monotonic() - began >= seconds:
                    break
                source = sources[tick % len(sources)]
                t = time.perf_counter()
                code = get(port, context, auth, source)
                results[source].append((code, time.perf_counter() - t))
                time.sleep(max(0.0, began + (tick + 1) * 0.5 - time.monotonic()))
            window = time.monotonic() - began
            cores = (cpu_seconds(proc.pid) - cpu_before) / window
            out, _ = crowd.communicate(timeout=seconds + 60)
        finally:
            if crowd.poll() is None:
                crowd.kill()
                crowd.wait(5)
    finally:
        stop(proc)
    text = log.read_text(errors="replace")
    rows = []
    for source, scrapes in results.items():
        ok = [took for code, took in scrapes if code == 200]
        failed = Counter(code for code, _ in scrapes if code != 200)
        rows.append({"source": source, "scrapes": len(scrapes), "answered": len(ok), "first": scrapes[0],
                     "failed": " ".join(f"{n}x{code or 'none'}" for code, n in sorted(failed.items())) or "-",
                     "p50_ms": percentile(ok, 0.5) * 1000 if ok else None,
                     "p99_ms": percentile(ok, 0.99) * 1000 if ok else None, "cores": cores,
                     "crowd": json.loads(out.strip().splitlines()[-1]) if out.strip() else {},
                     "tracebacks": text.count("Traceback"), "fault_lines": text.count("client fault")})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command")
    crowd = sub.add_parser("crowd", help="run one crowd alone; print what it got as JSON")
    crowd.add_argument("kind", choices=["trickle", "guess"])
    crowd.add_argument("--port", type=int, required=True)
    crowd.add_argument("--cafile")
    crowd.add_argument("--clients", type=int, default=64)
    crowd.add_argument("--seconds", type=float, default=5.0)
    crowd.add_argument("--source", default="127.0.0.1", help="the guessers' address (guess only)")
    parser.add_argument("--before", default="ec4d29d8", help="the revision to compare against (default: the "
                        "last one before the event-loop server)")
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--smoke", action="store_true", help="a short run: this tree only, 4 s each")
    parser.add_argument("--guess-only", action="store_true", help="only the guessing crowds (warm, cold, handover)")
    args = parser.parse_args()
    if args.command == "crowd":
        if args.kind == "trickle":
            print(json.dumps(trickle_crowd(args.port, args.cafile, args.clients, args.seconds)))
        else:
            print(json.dumps(guess_crowd(args.port, args.cafile, args.clients, args.seconds, args.source)))
        return
    seconds = 4.0 if args.smoke else args.seconds
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        web = web_files(folder)
        trees = {"after": ROOT / "daemon"}
        if not args.smoke:
            (folder / "before").mkdir()
            trees = {"before": checkout(args.before, folder / "before"), **trees}
        attacks = [("trickle", "HTTP", None, ["127.0.0.1"], "warm"),
                   ("trickle", "TLS + auth", web, ["127.0.0.1"], "warm"),
                   ("guess", "TLS + auth", web, ["127.0.0.2", "127.0.0.1"], "warm"),
                   ("guess", "TLS + auth", web, ["127.0.0.2"], "cold"),
                   ("guess", "TLS + auth", web, ["127.0.0.2", "127.0.0.1"], "handover")]
        if args.guess_only:
            attacks = [a for a in attacks if a[0] == "guess"]
        print(f"{args.clients} clients in each crowd, good scrapes every 0.5 s for {seconds:g} s\n")
        print("| tree | crowd | server | good scraper | answered | not answered | first scrape | p50 ms | p99 ms "
              "| daemon CPU (cores) | crowd got | daemon log |")
        print("|---|---|---|---|---:|---|---|---:|---:|---:|---|---|")
        for kind, server, web_yml, sources, when in attacks:
            for name, tree in trees.items():
                rows = attack(tree, folder, f"{name}-{kind}-{server[:3]}-{when}", kind, web_yml, sources,
                              args.clients, seconds, when)
                for row in rows:
                    share = 100 * row["answered"] / max(1, row["scrapes"])
                    code, took = row["first"]
                    cells = [name, kind, server, f"{row['source']}, {when}",
                             f"{row['answered']}/{row['scrapes']} ({share:.0f} %)", row["failed"],
                             f"{code or 'none'} in {took * 1000:.0f} ms",
                             *("-" if row[k] is None else f"{row[k]:.1f}" for k in ("p50_ms", "p99_ms")),
                             f"{row['cores']:.2f}", json.dumps(row["crowd"]),
                             f"{row['fault_lines']} fault lines, {row['tracebacks']} tracebacks"]
                    print("| " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
