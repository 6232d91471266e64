"""Daemon footprint with 8 simulated GPUs, and /metrics scrape latency.

    python3 benchmarks/footprint.py [--duration 60] [--rates 1,10] [--scrapes 1000] [--smoke]

For each poll rate it starts `gpuwarden run` (a real process) on eight
RTX PRO 6000, scrapes /metrics once a second as Prometheus would, and reads the
process's CPU time and RSS from /proc: CPU% over the run, RSS after a 2 s
warm-up and at the end (growth must stay flat). Then, against the 1 Hz daemon,
it times --scrapes back-to-back scrapes for p50/p99.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from _common import free_port, percentile

from gpuwarden.gpu.sim.scenario import resolve_scenario

TICKS = os.sysconf("SC_CLK_TCK")


def eight_gpu_scenario(folder: Path) -> Path:
    text = resolve_scenario("rtx-pro-6000-tp4").read_text().replace("count: 4", "count: 8")
    path = folder / "eight.yaml"
    path.write_text(text.replace("name: rtx-pro-6000-tp4", "name: rtx-pro-6000-x8"))
    return path


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS  # utime + stime


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def scrape(url: str) -> float:
    started = time.perf_counter()
    with urllib.request.urlopen(url, timeout=5) as reply:
        reply.read()
    return time.perf_counter() - started


def start_daemon(folder: Path, poll_s: float) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cfg = folder / f"poll-{poll_s}.yaml"
    cfg.write_text(f"poll_interval_s: {poll_s}\nlog_interval_s: 3600\nmetrics:\n  listen: 127.0.0.1:{port}\n")
    proc = subprocess.Popen([sys.executable, "-m", "gpuwarden", "run", "-c", str(cfg),
                             "--sim", str(eight_gpu_scenario(folder))],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}/metrics"
    deadline = time.monotonic() + 30
    while True:
        try:
            scrape(url)
            return proc, url
        except OSError:
            if time.monotonic() > deadline or proc.poll() is not None:
                proc.kill()
                raise SystemExit("the daemon did not start serving") from None
            time.sleep(0.1)


def measure(folder: Path, poll_s: float, duration_s: float) -> tuple[float, float, float]:
    proc, url = start_daemon(folder, poll_s)
    try:
        time.sleep(2)  # warm-up: imports done, first samples taken
        cpu0, rss0, t0 = cpu_seconds(proc.pid), rss_mib(proc.pid), time.monotonic()
        while time.monotonic() - t0 < duration_s:
            scrape(url)
            time.sleep(1)
        cpu1, rss1, t1 = cpu_seconds(proc.pid), rss_mib(proc.pid), time.monotonic()
        return (cpu1 - cpu0) / (t1 - t0) * 100, rss0, rss1
    finally:
        proc.terminate()
        proc.wait(30)


def scrape_latency(folder: Path, count: int) -> list[float]:
    proc, url = start_daemon(folder, 1.0)
    try:
        time.sleep(1.5)
        return sorted(scrape(url) for _ in range(count))
    finally:
        proc.terminate()
        proc.wait(30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float, default=60, help="seconds per poll rate")
    parser.add_argument("--rates", default="1,10", help="poll rates in Hz, comma-separated")
    parser.add_argument("--scrapes", type=int, default=1000)
    parser.add_argument("--smoke", action="store_true", help="2 s at 1 Hz and 20 scrapes: checks that it runs")
    args = parser.parse_args()
    rates = [1.0] if args.smoke else [float(r) for r in args.rates.split(",")]
    duration, scrapes = (2, 20) if args.smoke else (args.duration, args.scrapes)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        print("| GPUs | poll rate | run | CPU % | RSS after warm-up | RSS at end | growth |")
        print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
        for rate in rates:
            cpu, rss0, rss1 = measure(folder, 1 / rate, duration)
            print(f"| 8 | {rate:g} Hz | {duration:g} s | {cpu:.1f} | {rss0:.1f} MiB | {rss1:.1f} MiB | "
                  f"{rss1 - rss0:+.1f} MiB |")
        times = scrape_latency(folder, scrapes)
        p50, p99 = percentile(times, 0.5), percentile(times, 0.99)
        print(f"\n/metrics with 8 GPUs, {len(times)} sequential scrapes: p50 {p50 * 1e3:.2f} ms, "
              f"p99 {p99 * 1e3:.2f} ms, max {times[-1] * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
