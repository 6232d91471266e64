"""Does pinning the CPU vLLM to one core leave a process beside it a core of its own?

    python3 benchmarks/engine_pinning.py [--venv /opt/gpuwarden-test/venv-vllm] [--seconds 40]

The CPU build of vLLM's engine core spins while it decodes (a sleeper on its core waited 4.3 s of a 5.2 s decode
on the test machine). This serves the tiny test model (tests/vllm/make_tiny_model.py, the cpu-tiny profile's
flags) three ways, each with one client decoding back to back, and beside it a "daemon" stand-in: a thread that
sleeps 10 ms and records how late each wake-up is, as a poll loop would:

- no engine: the box's own floor;
- the engine unpinned, as tests/run ran it before the tiers;
- the engine pinned to the last core (`taskset -c N`, and VLLM_CPU_OMP_THREADS_BIND=N for its OpenMP threads), the
  sleeper left to the scheduler.

For each: the sleeper's wake-up lateness (p50, p99, max, in ms) and the engine's decode rate (tokens/s). The
figures decide how tests/run runs the real tier (benchmarks/RESULTS.md, "Engine pinning").
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ARGS = ["--max-model-len", "4096", "--kv-cache-memory-bytes", "1073741824"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def lateness(seconds: float) -> list[float]:
    """How late each 10 ms sleep wakes, in ms, over `seconds`."""
    out, end = [], time.monotonic() + seconds
    while time.monotonic() < end:
        began = time.monotonic()
        time.sleep(0.010)
        out.append((time.monotonic() - began - 0.010) * 1000)
    return out


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def engine(python: Path, model: Path, port: int, pin: int | None, home: Path) -> subprocess.Popen:
    env = dict(os.environ, VLLM_TARGET_DEVICE="cpu", HOME=str(home), VLLM_CPU_KVCACHE_SPACE="1")
    command = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--port", str(port),
               *ARGS]
    if pin is not None:
        env["VLLM_CPU_OMP_THREADS_BIND"] = str(pin)
        command = ["taskset", "-c", str(pin), *command]
    return subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
                            start_new_session=True)


def wait_healthy(port: int, proc: subprocess.Popen, timeout: float = 900) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the engine exited with {proc.returncode} before it was healthy")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                return
        except OSError:
            time.sleep(1)
    raise SystemExit("the engine was not healthy in time")


def decode(port: int, model: Path, stop: threading.Event, tokens: list[int]) -> None:
    body = json.dumps({"model": str(model), "prompt": "hello", "max_tokens": 2000, "temperature": 0,
                       "ignore_eos": True}).encode()
    while not stop.is_set():
        request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                         {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=600) as reply:
            tokens.append(json.load(reply)["usage"]["completion_tokens"])


def phase(name: str, python: Path, model: Path, seconds: float, pin: int | None, serve: bool) -> dict:
    proc, home = None, Path(tempfile.mkdtemp(prefix="pin-home-"))
    try:
        port = free_port()
        if serve:
            proc = engine(python, model, port, pin, home)
            wait_healthy(port, proc)
        stop, tokens = threading.Event(), []
        client = threading.Thread(target=decode, args=(port, model, stop, tokens), daemon=True)
        if serve:
            client.start()
            time.sleep(3)  # decoding under way
        began = time.monotonic()
        late = lateness(seconds)
        took = time.monotonic() - began
        stop.set()
        if serve:
            client.join(600)
        rate = sum(tokens) / (time.monotonic() - began) if serve else 0.0
        row = {"phase": name, "p50_ms": round(percentile(late, 0.5), 2), "p99_ms": round(percentile(late, 0.99), 1),
               "max_ms": round(max(late), 1), "wakeups": len(late), "decode_tok_s": round(rate, 1),
               "seconds": round(took, 1)}
        print(json.dumps(row), flush=True)
        return row
    finally:
        if proc is not None:
            os.killpg(proc.pid, 9)
            proc.wait(60)
        shutil.rmtree(home, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--venv", type=Path, default=Path("/opt/gpuwarden-test/venv-vllm"))
    parser.add_argument("--seconds", type=float, default=40)
    args = parser.parse_args()
    python = args.venv / "bin" / "python"
    if not python.exists():
        parser.error(f"{python} not found (bash tests/vllm/install)")
    if shutil.which("taskset") is None:
        parser.error("taskset not found (util-linux)")
    last = (os.cpu_count() or 1) - 1
    model = Path(tempfile.mkdtemp(prefix="pin-model-"))
    try:
        subprocess.run([str(python), str(ROOT / "tests" / "vllm" / "make_tiny_model.py"), str(model)],
                       check=True, capture_output=True, timeout=300)
        rows = [phase("no engine", python, model, args.seconds, None, False),
                phase("engine unpinned", python, model, args.seconds, None, True),
                phase(f"engine pinned to core {last}", python, model, args.seconds, last, True)]
    finally:
        shutil.rmtree(model, ignore_errors=True)
    print(f"\n{os.cpu_count()} cores; a 10 ms sleeper beside one client decoding 2,000-token answers back to back, "
          f"{args.seconds:g} s a phase\n")
    print("| phase | wake-up late p50 ms | p99 ms | max ms | decode tok/s |\n| --- | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r['phase']} | {r['p50_ms']} | {r['p99_ms']} | {r['max_ms']} | {r['decode_tok_s']} |")


if __name__ == "__main__":
    sys.exit(main())
