"""What the test's fleet costs Prometheus: its own ingestion figures, read at the end of tests/test_fleet.py.

    python3 benchmarks/fleet_ingest.py

Runs the fleet test (sixteen daemons, 36 simulated GPUs, three engines, Debian's prometheus scraping every
second with the shipped rules, Debian's prometheus-alertmanager), which writes Prometheus's figures to the
file named by GPUWARDEN_FLEET_FIGURES just before it stops the servers, and prints them: the series in the
head block, samples appended per second, samples per scrape by host, scrape durations and the rule groups'
evaluation time. The test scrapes every second; at the usual 15 s the samples per second are a fifteenth.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="gpuwarden-fleet-ingest-") as folder:
        out = Path(folder) / "figures.json"
        env = dict(os.environ, GPUWARDEN_FLEET_FIGURES=str(out))
        env.setdefault("PYTHONPATH", str(ROOT / "daemon"))  # this checkout's daemon, unless told otherwise
        run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                              str(ROOT / "tests" / "test_fleet.py"), "-k", "sixteen"], cwd=ROOT, env=env,
                             capture_output=True, text=True, timeout=1200)
        if run.returncode != 0 or not out.exists():
            sys.exit(f"fleet_ingest.py: the fleet test failed:\n{run.stdout[-4000:]}{run.stderr[-2000:]}")
        figures = json.loads(out.read_text())
    per_host = figures["samples_per_scrape"]
    print(f"| hosts scraped | series in the head | samples appended/s (1 s scrapes) | at 15 s scrapes "
          f"| scrape duration avg / max | rule groups' evaluation |")
    print("|---:|---:|---:|---:|---:|---:|")
    rate = figures["samples_appended_per_s"]
    print(f"| {figures['targets']:.0f} | {figures['head_series']:,.0f} | {rate:,.0f} | {rate / 15:,.0f} "
          f"| {figures['scrape_duration_avg_s'] * 1000:.1f} / {figures['scrape_duration_max_s'] * 1000:.1f} ms "
          f"| {figures['rule_groups_duration_s'] * 1000:.1f} ms |")
    print("\nsamples per scrape, by host:", ", ".join(f"{h} {n:.0f}" for h, n in sorted(per_host.items())))
    print(f"sum {sum(per_host.values()):.0f}")


if __name__ == "__main__":
    main()
