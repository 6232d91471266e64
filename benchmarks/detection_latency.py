"""Detection latency: wall clock from a clock collapse on the sim to the journal line and to /metrics.

    python3 benchmarks/detection_latency.py [--trials 20] [--polls 1.0,0.25] [--for-s 1] [--smoke]

Each trial runs the real daemon loop in this process on a one-GPU sim whose
locked, busy GPU collapses to 180 MHz at a random moment. The sim's clock is
the monotonic clock from a known start, so the collapse instant is exact. The
journal time is when the `sm_clock_low firing` line is emitted; the metric time
is when a scrape (one every 5 ms) first shows gpuwarden_alert_active = 1. The
goal is at most 2 poll intervals + for_s. Once both are seen the daemon is sent SIGTERM, as systemctl stop
stops it (so a busy host makes a trial later, never a miss); a trial with neither within 60 s is a miss.
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import signal
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from _common import free_port, percentile

from gpuwarden import config
from gpuwarden.service.daemon import Daemon, run
from gpuwarden.gpu.sim.backend import SimBackend
from gpuwarden.gpu.sim.scenario import load_scenario, resolve_scenario
from gpuwarden.base.systemd import Notifier

ALERT_LINE = 'gpuwarden_alert_active{alert="sm_clock_low",gpu="0",severity="warning"} 1.0'


def scenario_with_collapse(folder: Path, at_s: float) -> Path:
    base = resolve_scenario("lock-lost").read_text().split("timeline:")[0]
    path = folder / "collapse.yaml"
    path.write_text(base + "timeline:\n  - {at_s: 0, event: load, utilization_pct: 60}\n"
                           f"  - {{at_s: {at_s:.4f}, event: clock_collapse}}\n")
    return path


class FiringLine(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.at: float | None = None

    def emit(self, record: logging.LogRecord) -> None:
        if self.at is None and "sm_clock_low firing" in record.getMessage():
            self.at = time.monotonic()


def watch_metric(url: str, stop: threading.Event, seen: list[float], line: FiringLine) -> None:
    """Scrape until the alert shows; then, once the journal line came too, stop the daemon (its SIGTERM)."""
    while not stop.is_set() and not (seen and line.at is not None):
        if not seen:
            try:
                with urllib.request.urlopen(url, timeout=1) as reply:
                    if ALERT_LINE in reply.read().decode():
                        seen.append(time.monotonic())
            except OSError:
                pass  # not serving yet
        time.sleep(0.005)
    if not stop.is_set():  # the daemon's loop still runs (its bound is a minute away): its signal handler is set
        os.kill(os.getpid(), signal.SIGTERM)


def trial(poll_s: float, for_s: float, folder: Path) -> tuple[float, float]:
    collapse_at = 1.0 + random.random() * poll_s  # any phase against the poll schedule
    port = free_port()
    cfg = config.parse_text(f"poll_interval_s: {poll_s}\nlog_interval_s: 3600\nalerts:\n  for_s: {for_s}\n"
                            f"metrics:\n  listen: 127.0.0.1:{port}\n", name="bench.yaml")
    scenario = load_scenario(scenario_with_collapse(folder, collapse_at))
    line = FiringLine()
    logging.getLogger("gpuwarden").addHandler(line)
    stop, seen = threading.Event(), []
    watcher = threading.Thread(target=watch_metric, args=(f"http://127.0.0.1:{port}/metrics", stop, seen, line))
    t0 = time.monotonic()
    backend = SimBackend(scenario, clock=lambda: time.monotonic() - t0)
    watcher.start()
    try:
        run(Daemon(cfg, backend, notifier=Notifier({})), duration_s=collapse_at + for_s + 60)  # a bound on a hang
    finally:
        stop.set()
        watcher.join()
        logging.getLogger("gpuwarden").removeHandler(line)
    collapse = t0 + collapse_at
    if line.at is None or not seen:
        raise SystemExit(f"no detection within a minute (poll {poll_s} s)")
    return line.at - collapse, seen[0] - collapse


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--polls", default="1.0,0.25", help="poll intervals to measure, comma-separated")
    parser.add_argument("--for-s", type=float, default=1.0)
    parser.add_argument("--smoke", action="store_true", help="one trial at 0.25 s: checks that it runs")
    args = parser.parse_args()
    polls = [0.25] if args.smoke else [float(p) for p in args.polls.split(",")]
    trials = 1 if args.smoke else args.trials
    # Between trials the daemon's loop (and its handler) is not running: a watcher's SIGTERM that comes just as a
    # trial's loop ended at its bound finds this no-op, not the default that would end the benchmark
    signal.signal(signal.SIGTERM, lambda *_: None)
    print("| poll_interval_s | for_s | trials | journal p50 | journal p99 | metric p50 | metric p99 | goal |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    with tempfile.TemporaryDirectory() as folder:
        for poll in polls:
            results = [trial(poll, args.for_s, Path(folder)) for _ in range(trials)]
            journal, metric = [r[0] for r in results], [r[1] for r in results]
            goal = 2 * poll + args.for_s
            print(f"| {poll:g} | {args.for_s:g} | {trials} | {percentile(journal, .5):.3f} s | "
                  f"{percentile(journal, .99):.3f} s | {percentile(metric, .5):.3f} s | "
                  f"{percentile(metric, .99):.3f} s | <= {goal:g} s "
                  f"{'met' if max(journal + metric) <= goal else 'MISSED'} |")


if __name__ == "__main__":
    main()
