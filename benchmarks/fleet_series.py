"""The series budget of one host: what a gpuwarden daemon adds to Prometheus, by GPU count.

    python3 benchmarks/fleet_series.py [--gpus 1,4,8] [--families]

For each GPU count it starts `gpuwarden run` (a real process, tuned, polling once a second) on that many
simulated RTX PRO 6000, once without and once with a serving engine (tests/harness/fakechild.py standing in for
vLLM), scrapes /metrics five times once the engine serves, and reports the series (sample lines) and the
bytes of a scrape, with the series each GPU adds, and the series docs/fleet.md's remote-write keep list (KEEP,
the same regex) lets through. --families adds the series of each metric family for the largest GPU count
with an engine.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from pathlib import Path

from _common import free_port
from soak import child_user

ROOT = Path(__file__).resolve().parent.parent
DAEMON = os.environ.get("PYTHONPATH") or str(ROOT / "daemon")  # this checkout's daemon, unless told otherwise
sys.path.insert(0, DAEMON)
from gpuwarden.gpu.sim.scenario import resolve_scenario  # noqa: E402

# docs/fleet.md's write_relabel_configs keep list for a long-term store (recording rules and ALERTS are kept
# there too; they are the local Prometheus's own series, not a host's).
KEEP = re.compile(r"gpuwarden_gpu_(info|up|sm_clock_hertz|memory_clock_hertz|power_watts|power_limit_watts"
                  r"|temperature_celsius|utilization_ratio|memory_used_bytes|energy_joules_total"
                  r"|clock_event_seconds_total|xids_total)|gpuwarden_serving_(info|state|restarts_total"
                  r"|stalls_total|generation_tokens_per_second|prompt_tokens_per_second|requests_running"
                  r"|requests_waiting|kv_cache_usage_ratio)|gpuwarden_build_info")


def fetch(port: int) -> bytes:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
        return reply.read()


def series(body: bytes) -> list[str]:
    return [line for line in body.decode().splitlines() if line and not line.startswith("#")]


def measure(folder: Path, gpus: int, engine: bool, fake: Path) -> tuple[int, int, int, Counter]:
    name = f"x{gpus}-{'engine' if engine else 'none'}"
    scenario = folder / f"{name}.yaml"
    scenario.write_text(resolve_scenario("rtx-pro-6000-tp4").read_text().replace("count: 4", f"count: {gpus}")
                        .replace("memory_used_pct: 80", "memory_used_pct: 5"))
    port = free_port()
    config = folder / f"{name}.yaml.conf"
    config.write_text(f"poll_interval_s: 1\nlog_interval_s: 3600\nmetrics:\n  listen: 127.0.0.1:{port}\n")
    if engine:
        config.write_text(config.read_text() + f"""serve:
  enabled: true
  profile: generic
  model: /fake/model
  command: [/usr/bin/python3, {fake}, --mode, healthy]
  python: {ROOT / "tests" / "harness" / "fakechild-flagcheck"}
  port: {free_port()}
  user: {child_user()}
  stop_timeout_s: 2
""")
    state = folder / name
    state.mkdir()
    env = dict(os.environ, STATE_DIRECTORY=str(state), RUNTIME_DIRECTORY=str(state), PYTHONPATH=DAEMON)
    proc = subprocess.Popen([sys.executable, "-m", "gpuwarden", "run", "-c", str(config), "--sim", str(scenario)],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        ready = b"gpuwarden_serving_generation_tokens_per_second" if engine else b"gpuwarden_gpu_up"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if ready in fetch(port):
                    break
            except OSError:
                pass
            time.sleep(0.5)
        else:
            raise SystemExit(f"fleet_series.py: {name} did not serve its metrics within 60 s")
        time.sleep(3)  # the counters read every counters_interval_s and a few polls in
        bodies = []
        for _ in range(5):
            bodies.append(fetch(port))
            time.sleep(1)
        counts = [len(series(b)) for b in bodies]
        families = Counter(line.split("{")[0].split(" ")[0] for line in series(bodies[-1]))
        kept = sum(n for family, n in families.items() if KEEP.fullmatch(family))
        return max(counts), int(statistics.median(len(b) for b in bodies)), kept, families
    finally:
        proc.terminate()
        proc.wait(30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpus", default="1,4,8")
    parser.add_argument("--families", action="store_true")
    args = parser.parse_args()
    counts = [int(n) for n in args.gpus.split(",")]
    folder = Path(tempfile.mkdtemp(prefix="gpuwarden-fleet-series-"))
    folder.chmod(0o755)
    fake = folder / "fakechild.py"
    shutil.copy(ROOT / "tests" / "harness" / "fakechild.py", fake)
    fake.chmod(0o644)
    rows, last = [], None
    try:
        for engine in (False, True):
            for gpus in counts:
                n, size, kept, families = measure(folder, gpus, engine, fake)
                rows.append((gpus, engine, n, size, kept))
                last = families
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    print("| GPUs | engine | series | bytes a scrape | series per GPU more | kept for remote write |")
    print("|---:|---|---:|---:|---:|---:|")
    for gpus, engine, n, size, kept in rows:
        base = next((r for r in rows if r[1] == engine), None)
        per = f"{(n - base[2]) / (gpus - base[0]):.1f}" if gpus != base[0] else ""
        print(f"| {gpus} | {'yes' if engine else 'no'} | {n} | {size:,} | {per} | {kept} |")
    if args.families and last:
        print(f"\nseries by family ({counts[-1]} GPUs, with an engine):")
        for family, n in last.most_common():
            print(f"  {n:4d} {family}")


if __name__ == "__main__":
    main()
