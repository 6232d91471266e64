"""Rest and wake with the real CPU vLLM (issue 54): `gpuwarden run` with the proxy in front and `serve.idle: {action:
stop, after_s: N}`, and a client that sends a burst of requests through the proxy, then pauses past after_s, CYCLES
times (tests/vllm/restart_rig.py). Each burst's first request wakes the resting engine; every request is judged whole
(its token count).

    python3 benchmarks/idle_cycles.py [--venv /opt/gpuwarden-test/venv-vllm] [--cycles 5] [--after-s 10]

Prints a Markdown table for benchmarks/RESULTS.md: a row a cycle (the rest: the engine's process gone and nothing listening on its socket;
the wake: the daemon's "awake" line and gpuwarden_serving_wake_seconds; the burst: requests answered whole, failed,
the first one's wait), and the totals. Run as root, as CI runs the tests (the engine runs as gpuwarden-test).
"""

import argparse
import os
import re
import signal
import socket
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "vllm"))
from restart_rig import SHORT, START_S, Client, Rig, tiny_model  # noqa: E402

BURST = 4  # requests a burst, at once


def metric(port: int, name: str) -> float | None:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    values = [float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + "{")]
    return values[0] if values else None


def burst(rig: Rig) -> list:
    """BURST requests through the proxy at once: (ok, what, seconds) each."""
    out = []

    def one():
        client = Client("proxy", rig.proxy_port, False, SHORT, [], threading.Event(), str(rig.model))
        began = time.monotonic()
        ok, what = client.once()
        out.append((ok, what, time.monotonic() - began))

    threads = [threading.Thread(target=one) for _ in range(BURST)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(START_S)
    return out


def listens(path: str) -> bool:
    """Whether anything accepts on the engine's Unix socket (its file may stay after the engine ended: no port)."""
    with socket.socket(socket.AF_UNIX) as probe:
        try:
            probe.connect(path)
        except OSError:
            return False
    return True


def cycle(rig: Rig, number: int, after: int) -> dict:
    """Wait for the rest, look that the engine that rested (the last one started) is gone, then a burst that wakes
    it."""
    rested, _ = rig.wait_for("vLLM rests: no request through the proxy", START_S, after)
    start = next(line for line in reversed(rig.lines[:rested]) if "vLLM starting (pid" in line)
    pid = int(re.search(r"\(pid (\d+)", start).group(1))
    gone = not os.path.exists(f"/proc/{pid}") and not (isinstance(rig.engine, str) and listens(rig.engine))
    mark = len(rig.lines)
    answers = burst(rig)
    _, awake = rig.wait_for("vLLM awake: healthy", 60, mark)
    return {"cycle": number, "rested_at": rested, "gone": gone, "answers": answers,
            "awake_s": float(re.search(r"healthy ([0-9.]+) s", awake).group(1)),
            "exported_s": metric(rig.metrics_port, "gpuwarden_serving_wake_seconds"), "next": len(rig.lines)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--venv", type=Path, default=Path(os.environ.get("GPUWARDEN_VLLM_VENV",
                                                                        "/opt/gpuwarden-test/venv-vllm")))
    parser.add_argument("--cycles", type=int, default=5)
    parser.add_argument("--after-s", type=float, default=10.0, help="serve.idle.after_s (10 at least)")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a kill stops the daemon it started (finally)
    python = args.venv / "bin" / "python"
    with tempfile.TemporaryDirectory() as tmp:
        model = tiny_model(python, Path(tmp))  # the engine's user reads it
        workdir = Path(tmp) / "run"
        workdir.mkdir()
        rig = Rig(python, model, workdir, hold_s=600, idle_after_s=args.after_s)
        rows, after = [], 0
        try:
            rig.start()
            for number in range(1, args.cycles + 1):
                rows.append(cycle(rig, number, after))
                after = rows[-1]["next"]
                done = rows[-1]
                print(f"cycle {number}: gone {done['gone']}, awake in {done['awake_s']:.1f} s, "
                      f"{sum(ok for ok, _, _ in done['answers'])}/{BURST} whole", file=sys.stderr)
        finally:
            code = rig.stop()
        print(f"daemon exit {code}", file=sys.stderr)
    print("| cycle | engine gone while resting | wake (the daemon's line) | wake (exported) | answered whole | "
          "failed | the burst's longest |\n| ---: | --- | ---: | ---: | ---: | ---: | ---: |")
    for row in rows:
        answers = row["answers"]
        print(f"| {row['cycle']} | {'yes' if row['gone'] else '**no**'} | {row['awake_s']:.1f} s | "
              f"{row['exported_s']:.1f} s | {sum(ok for ok, _, _ in answers)} | {sum(not ok for ok, _, _ in answers)} "
              f"| {max(s for _, _, s in answers):.1f} s |")
    failed = [what for row in rows for ok, what, _ in row["answers"] if not ok]
    print(f"\n{sum(len(r['answers']) for r in rows)} requests, {len(failed)} failed" +
          "".join(f"\n- {what}" for what in failed[:8]))


if __name__ == "__main__":
    main()
