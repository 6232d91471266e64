"""`gpuwarden bench` against servers that never let go: a stream that never ends, and a 500 with a 1.5 GB body.

    python3 benchmarks/bench_limits.py [--tree DIR ...] [--duration 10] [--error-gb 1.5] [--kill-after 120]

For each tree (a `daemon/` folder to run gpuwarden from; default: this checkout's), two runs of
`gpuwarden bench` as a process of its own against tests/harness/fake_openai.py on loopback:

- endless: every stream sends a token each 200 ms and never ends (the calibration request is served whole):
  `--concurrency 4 --duration D --warmup 0 --output-len 128`, the grace left at its default (D, at most 30 s);
  the chunk cap (2 x 128 + 16 chunks, 54 s at this rate) lies beyond it, so the grace is what ends each stream;
- huge error: every completion is answered 500 with a body of --error-gb GB.

Per run: bench's exit status, its wall time, the step's own duration, cut and failed requests, bench's peak
RSS (the kernel's, from wait4) and what the server handed to the socket. A run still going after --kill-after
seconds is killed (its process group) and said so. Only processes this script started are signalled.
"""

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from _common import free_port

ROOT = Path(__file__).resolve().parent.parent
FAKE = ROOT / "tests" / "harness" / "fake_openai.py"
CONFIG = "gpu: {backend: sim, scenario: rtx-pro-4000-headless}\nmetrics: {listen: none}\n"


def start_fake(*args) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, str(FAKE), "--port", str(port), *args], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, start_new_session=True)
    if proc.stdout.readline().strip() != "listening":
        raise SystemExit(f"the fake server did not start: {' '.join(args)}")
    return proc, f"http://127.0.0.1:{port}"


def stop(proc: subprocess.Popen) -> None:
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def run_bench(tree: Path, config: Path, state: Path, args: list[str], kill_after: float) -> dict:
    """gpuwarden bench from tree, timed; its own rusage from wait4, so the peak RSS is bench's alone."""
    env = {**os.environ, "PYTHONPATH": str(tree), "STATE_DIRECTORY": str(state)}
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        start = time.monotonic()
        proc = subprocess.Popen([sys.executable, "-m", "gpuwarden", "bench", "-c", str(config), *args, "--json"],
                                stdout=out, stderr=err, env=env, start_new_session=True)
        killed = False
        while True:  # bounded: kill_after
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            if time.monotonic() - start > kill_after:
                os.killpg(proc.pid, signal.SIGKILL)
                killed = True
                pid, status, usage = os.wait4(proc.pid, 0)
                break
            time.sleep(0.05)
        wall = time.monotonic() - start
        proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here: Popen must not wait for it again
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    try:
        steps = json.loads(stdout)["steps"] if stdout.strip() else []
    except ValueError:
        steps = []
    return {"exit": "killed" if killed else proc.returncode, "wall_s": wall, "peak_rss_mib": usage.ru_maxrss / 1024,
            "step": steps[0] if steps else None, "stderr": stderr.strip().splitlines()[-1:] if stderr.strip() else []}


def sent_mib(url: str) -> float:
    with urllib.request.urlopen(url + "/debug/open", timeout=5) as reply:
        return json.loads(reply.read())["error_bytes_sent"] / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tree", action="append", type=Path, help="a daemon/ folder (repeatable; default: ours)")
    parser.add_argument("--duration", type=float, default=10.0)
    parser.add_argument("--error-gb", type=float, default=1.5)
    parser.add_argument("--kill-after", type=float, default=120.0)
    args = parser.parse_args()
    trees = args.tree or [ROOT / "daemon"]
    print("| tree | server | bench exit | wall s | step s | cut | failed | peak RSS MiB | server handed out MiB |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "bench.yaml"
        config.write_text(CONFIG)
        for tree in trees:
            cases = [("never-ending streams", ("--endless", "--token-delay", "0.2", "--good-first", "1"),
                      ["--concurrency", "4", "--duration", f"{args.duration:g}", "--warmup", "0", "--output-len",
                       "128"]),
                     (f"500 with a {args.error_gb:g} GB body", ("--error-bytes", str(int(args.error_gb * 1e9))), [])]
            for name, fake_args, bench_args in cases:
                fake, url = start_fake(*fake_args)
                try:
                    r = run_bench(tree, config, Path(tmp) / "state", ["--url", url, *bench_args], args.kill_after)
                    handed = sent_mib(url) if "--error-bytes" in fake_args else None
                finally:
                    stop(fake)
                step = r["step"] or {"duration_s": "-", "cut": "-", "errors": "-"}  # no step: failed before one
                seconds = step["duration_s"] if step["duration_s"] == "-" else f"{step['duration_s']:.1f}"
                print(f"| {tree} | {name} | {r['exit']} | {r['wall_s']:.1f} | {seconds} | {step['cut']} | "
                      f"{step['errors']} | {r['peak_rss_mib']:.0f} | {'-' if handed is None else f'{handed:.1f}'} |",
                      flush=True)
                for line in r["stderr"]:
                    print(f"  stderr: {line[:160]}", file=sys.stderr)


if __name__ == "__main__":
    main()
