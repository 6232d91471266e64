"""/metrics scrape latency, before and after, side by side in one run.

    python3 benchmarks/scrape.py [--before REV] [--seconds 10] [--gpus 8,64] [--scrapers 1,50] [--smoke]

For each code tree (the revision given by --before, checked out with `git archive`, and this checkout)
it starts `gpuwarden run` on 8 and on 64 simulated RTX PRO 6000 polling once a second, then lets 1 and
50 concurrent scrapers fetch /metrics back to back for --seconds each, and reports p50 and p99. The
pairs run in turn on the same machine, so their ratio is the figure to read.
"""

from __future__ import annotations

import argparse
import http.client
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from _common import free_port, percentile

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "daemon"))
from gpuwarden.gpu.sim.scenario import resolve_scenario  # noqa: E402


def scenario(folder: Path, gpus: int) -> Path:
    text = resolve_scenario("rtx-pro-6000-tp4").read_text().replace("count: 4", f"count: {gpus}")
    path = folder / f"x{gpus}.yaml"
    path.write_text(text)
    return path


def checkout(rev: str, folder: Path) -> Path:
    """The daemon package of rev, unpacked under folder (nothing in this checkout changes)."""
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev, "daemon"], capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(folder)], input=archive.stdout, check=True)
    return folder / "daemon"


def start(tree: Path, folder: Path, gpus: int) -> tuple[subprocess.Popen, int]:
    port = free_port()
    cfg = folder / f"{tree.parent.name}-{gpus}.yaml"
    cfg.write_text(f"poll_interval_s: 1.0\nlog_interval_s: 3600\nmetrics:\n  listen: 127.0.0.1:{port}\n"
                   f"tuning:\n  apply: false\ngpu:\n  backend: sim\n  scenario: {scenario(folder, gpus)}\n")
    env = dict(os.environ, PYTHONPATH=str(tree))
    proc = subprocess.Popen([sys.executable, "-m", "gpuwarden", "run", "-c", str(cfg)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120  # a bound on a hang: a busy box's start, not a speed
    while time.monotonic() < deadline:
        try:
            if b"gpuwarden_gpu_up" in fetch(port):
                return proc, port
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise SystemExit(f"scrape.py: the daemon from {tree} did not serve /metrics")


def fetch(port: int) -> bytes:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("GET", "/metrics")
        return conn.getresponse().read()
    finally:
        conn.close()


def measure(port: int, scrapers: int, seconds: float) -> tuple[list[float], int]:
    """Latencies of the scrapes that succeeded, and how many failed (refused, reset, 10 s timeout)."""
    times: list[float] = []
    failed = [0]
    lock = threading.Lock()
    end = time.monotonic() + seconds

    def scraper() -> None:
        first = True  # every scraper scrapes at least once: a thread that got the CPU only after `end` (a busy box)
        while first or time.monotonic() < end:  # left the smoke's cell empty (ci46)
            first = False
            began = time.perf_counter()
            try:
                fetch(port)
            except OSError:
                with lock:
                    failed[0] += 1
                continue
            took = time.perf_counter() - began
            with lock:
                times.append(took)

    threads = [threading.Thread(target=scraper) for _ in range(scrapers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return times, failed[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", default="ed73cf1", help="the revision to compare against (default: the "
                        "last one before the cached exposition)")
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--gpus", default="8,64")
    parser.add_argument("--scrapers", default="1,50")
    parser.add_argument("--smoke", action="store_true", help="a short run for CI: 8 GPUs, 1 and 5 scrapers, 1 s")
    args = parser.parse_args()
    gpu_counts = [8] if args.smoke else [int(x) for x in args.gpus.split(",")]
    scraper_counts = [1, 5] if args.smoke else [int(x) for x in args.scrapers.split(",")]
    seconds = 1.0 if args.smoke else args.seconds
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        (folder / "before").mkdir()
        trees = {"before": checkout(args.before, folder / "before"), "after": ROOT / "daemon"}
        print("| GPUs | scrapers | before p50 ms | before p99 ms | before failed | after p50 ms | after p99 ms "
              "| after failed | p99 before/after |")
        print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for gpus in gpu_counts:
            daemons = {name: start(tree, folder, gpus) for name, tree in trees.items()}
            try:
                time.sleep(1.5)
                for scrapers in scraper_counts:
                    got = {name: measure(port, scrapers, seconds) for name, (_, port) in daemons.items()}
                    p = {name: (percentile(t, 0.5) * 1e3, percentile(t, 0.99) * 1e3, failed)
                         for name, (t, failed) in got.items()}
                    b, a = p["before"], p["after"]
                    print(f"| {gpus} | {scrapers} | {b[0]:.2f} | {b[1]:.2f} | {b[2]} | {a[0]:.2f} | {a[1]:.2f} | {a[2]} "
                          f"| {b[1] / a[1]:.1f}x |", flush=True)
            finally:
                for proc, _ in daemons.values():
                    proc.terminate()
                    proc.wait(30)
        print(f"\n(before: {args.before}; after: this checkout; {seconds:g} s per cell, back-to-back scrapes)")


if __name__ == "__main__":
    main()
