"""Joules per request over a long run (issue 56): `gpuwarden run` on the simulated H100s (their power known: an idle
engine's context, 50 W a card over idle), the fake engine in its tokens mode (tests/harness/fakechild.py) behind the
proxy, and a known schedule of requests for DURATION seconds. At the end the daemon is stopped in place (SIGSTOP: its
energy file stands still) and the proxy's books are set beside the daemon's sums since the proxy's first reading,
per GPU: the requests' shares plus the idle energy (plus what nobody got, and what still waits) against what was
measured.

    python3 benchmarks/joules_conservation.py [--duration 300] [--smoke]

The schedule, a cycle every 10 s (every request's tokens as it asks the fake engine, so known):
- at 0.0 s, together: "small" (50 prompt + 100 output tokens, 0.3 s to its first byte, 1.5 s of decode) and "large"
  (twice the tokens, the same spans): twice the tokens over the same span, about twice the joules;
- at 0.5 s a stream with its usage (20 + 30, 0.1 s + 0.9 s); at 1.0 s a stream without usage (the proxy's estimate);
- at 2.0 s a plain one of long prompt (200 + 50, 0.5 s + 2.0 s);
- every third cycle from the second, at 3.0 s, a stream its client leaves after 300 bytes (10 + 400 over 8 s);
- then nothing until the next cycle: idle energy.

Prints a Markdown table for benchmarks/RESULTS.md (a row a GPU, and the requests' figures below it); exit 1 where a
GPU's books miss its measured energy by more than 0.5 %, a request got no joules, or the daemon did not stop clean.
Run as root, as CI runs the tests (the engine and the proxy run as gpuwarden-test), or as the user the engine runs as.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "vllm"))
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "tests"))
from _common import free_port, percentile  # noqa: E402
from harness.scrape import samples  # noqa: E402
from restart_rig import CHILD_USER, runnable_daemon  # noqa: E402

HARNESS = ROOT / "tests" / "harness"
CYCLE_S = 10.0
BOUND = 0.005  # the issue's: apportioned plus idle within 0.5 % of measured, per GPU
EXACT_J = 0.002  # whole mJ on both sides: the books once the proxy has read the daemon's last sums
SMALL = {"name": "small", "prompt_tokens": 50, "output_tokens": 100, "prefill_s": 0.3, "decode_s": 1.5}
LARGE = {"name": "large", "prompt_tokens": 100, "output_tokens": 200, "prefill_s": 0.3, "decode_s": 1.5}
STREAM = {"name": "stream", "prompt_tokens": 20, "output_tokens": 30, "prefill_s": 0.1, "decode_s": 0.9,
          "stream": True}
NO_USAGE = {"name": "no-usage", "prompt_tokens": 20, "output_tokens": 30, "decode_s": 0.6, "stream": True,
            "usage": False}
LONG_PROMPT = {"name": "long-prompt", "prompt_tokens": 200, "output_tokens": 50, "prefill_s": 0.5, "decode_s": 2.0}
CUT = {"name": "cut", "prompt_tokens": 10, "output_tokens": 400, "decode_s": 8, "stream": True}


def schedule(cycles: int) -> list[tuple[float, dict, int | None]]:
    """(when, from the run's start; the request's shape; bytes after which its client leaves, or None)."""
    out = []
    for n in range(cycles):
        at = n * CYCLE_S
        out += [(at, SMALL, None), (at, LARGE, None), (at + 0.5, STREAM, None), (at + 1.0, NO_USAGE, None),
                (at + 2.0, LONG_PROMPT, None)]
        if n % 3 == 1:
            out.append((at + 3.0, CUT, 300))
    return out


class Daemon:
    """`gpuwarden run` with its output read into lines."""

    def __init__(self, command: list[str], config: Path, env: dict):
        self.lines: list[str] = []
        self.proc = subprocess.Popen([*command, "run", "-c", str(config)], stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, env=env)
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def wait_for(self, text: str, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in list(self.lines):
                if text in line:
                    return line
            if self.proc.poll() is not None:
                break
            time.sleep(0.1)
        raise SystemExit(f"{text!r} not logged within {timeout:g} s; the daemon's last lines:\n" +
                         "\n".join(self.lines[-30:]))

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.send_signal(signal.SIGTERM)
            try:
                return self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        return self.proc.wait(30)


def ask(port: int, shape: dict, cut_after: int | None, outcomes: list) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    try:
        conn.request("POST", "/v1/completions", body=json.dumps(shape), headers={"Content-Type": "application/json"})
        reply = conn.getresponse()
        reply.read(cut_after) if cut_after else reply.read()
        outcomes.append((shape["name"], reply.status))
    except (OSError, http.client.HTTPException) as exc:
        outcomes.append((shape["name"], f"{type(exc).__name__}: {exc}"))
    finally:
        conn.close()


def families(port: int) -> dict[str, dict[tuple[str, ...], float]]:
    """The proxy's /metrics: each family's samples by their label values."""
    return samples(urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode())


def write_config(folder: Path, user: str, proxy_port: int) -> Path:
    """The fake engine where the engine's user can read it, the quiet H100s' scenario, and the daemon's config."""
    from gpuwarden.gpu.sim.scenario import resolve_scenario

    for name, mode in (("fakechild.py", 0o644), ("fakechild-python", 0o755)):
        shutil.copy(HARNESS / name, folder / name)
        (folder / name).chmod(mode)
    h100 = resolve_scenario("h100-nvswitch").read_text()
    scenario = folder / "quiet-h100.yaml"
    scenario.write_text(h100.split("timeline:")[0] + "timeline:\n  - {at_s: 0, event: load, utilization_pct: 0, "
                        "memory_used_pct: 1}\n")
    config = folder / "gpuwarden.yaml"
    config.write_text(f"""poll_interval_s: 0.25
metrics:
  listen: 127.0.0.1:{free_port()}
gpu:
  backend: sim
  scenario: {scenario}
serve:
  enabled: true
  profile: generic
  model: /fake/model
  command: [/usr/bin/python3, {folder / "fakechild.py"}, --mode, "drain,tokens"]
  python: {folder / "fakechild-python"}
  port: {free_port()}
  user: {user}
  startup_timeout_s: 60
  stop_timeout_s: 2
  liveness_interval_s: 1
  backoff_max_s: 1
  drain_s: 10
  proxy: {{enabled: true, listen: '127.0.0.1:{proxy_port}'}}
""")
    return config


def books(port: int, gpus) -> tuple[dict, dict]:
    """Per GPU: the proxy's settled energy by where it went, and what still waits (J)."""
    f = families(port)
    settled = f.get("gpuwarden_proxy_gpu_energy_joules_total", {})
    waiting = f.get("gpuwarden_proxy_gpu_energy_waiting_joules", {})
    return ({g: {to: settled.get((g, to), 0.0) for to in ("requests", "idle", "nobody")} for g in gpus},
            {g: waiting.get((g,), 0.0) for g in gpus})


def run(duration: float, venv: Path) -> int:
    cycles = max(1, round(duration / CYCLE_S))
    user = CHILD_USER if os.geteuid() == 0 else None
    command, env, package = runnable_daemon(venv / "bin" / "python", user or "")
    work = Path(tempfile.mkdtemp(prefix="gpuwarden-joules-"))
    work.chmod(0o755)
    runtime = work / "run"
    runtime.mkdir(mode=0o755)
    proxy_port = free_port()
    import pwd
    config = write_config(work, user or pwd.getpwuid(os.geteuid()).pw_name, proxy_port)
    daemon = Daemon(command, config, dict(env, RUNTIME_DIRECTORY=str(runtime)))
    code, stopped = None, False
    try:
        daemon.wait_for("vLLM healthy after", 60)
        daemon.wait_for("the proxy healthy after", 60)
        first = json.loads(daemon.wait_for("joules per request: the engine's GPUs' energy read from", 30)
                           .split("sums=")[1].split(" mJ")[0])
        plan = schedule(cycles)
        print(f"{len(plan)} requests over {cycles} cycles of {CYCLE_S:g} s", file=sys.stderr)
        outcomes: list = []
        threads, began = [], time.monotonic()
        for at, shape, cut in plan:
            time.sleep(max(0.0, began + at - time.monotonic()))
            thread = threading.Thread(target=ask, args=(proxy_port, shape, cut, outcomes), daemon=True)
            thread.start()
            threads.append(thread)
        for thread in threads:
            thread.join(120)
        time.sleep(CYCLE_S / 2)  # the last cycle's idle: the tail of the run is nobody's
        deadline = time.monotonic() + 60  # the last requests' joules: once the next readings cover their ends
        while True:
            f = families(proxy_port)
            given = sum(f.get("gpuwarden_proxy_request_joules_count", {}).values())
            pending = sum(f.get("gpuwarden_proxy_joules_pending_requests", {}).values())
            if (given >= len(plan) and not pending) or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        daemon.proc.send_signal(signal.SIGSTOP)  # its file stands still: the books must come to it
        stopped = True
        from gpuwarden.serving.run.energyfeed import feed_path

        sums = json.loads(feed_path("127.0.0.1", proxy_port, {"RUNTIME_DIRECTORY": str(runtime)}).read_text())["gpus"]
        drew = {g: (mj - first.get(g, 0)) / 1000 for g, mj in sums.items()}
        deadline = time.monotonic() + 30  # the proxy reads the file twice a second: its books come to the last sums
        while True:
            settled, waiting = books(proxy_port, drew)
            off = {g: sum(settled[g].values()) + waiting[g] - drew[g] for g in drew}
            if all(abs(off[g]) <= EXACT_J for g in drew) or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        f = families(proxy_port)
        daemon.proc.send_signal(signal.SIGCONT)
        stopped = False
    finally:
        if stopped:
            daemon.proc.send_signal(signal.SIGCONT)
        code = daemon.stop()
        left = subprocess.run(["pgrep", "-f", str(work)], capture_output=True, text=True).stdout.split()
        for pid in left:  # ours alone: its command line names this run's folder
            os.kill(int(pid), signal.SIGKILL)
        shutil.rmtree(work, ignore_errors=True)
        if package is not None:
            shutil.rmtree(package, ignore_errors=True)
    lines = [line for line in daemon.lines if "joules=" in line]

    def joules_of(prompt: int, output: int) -> list[float]:
        return [float(line.split("joules=")[1].split()[0]) for line in lines
                if f": {prompt} prompt + {output} output tokens, joules=" in line]

    small, large = joules_of(50, 100), joules_of(100, 200)
    ratios = [b / a for a, b in zip(small, large) if a > 0]
    count = sum(f.get("gpuwarden_proxy_request_joules_count", {}).values())
    joules_sum = sum(f.get("gpuwarden_proxy_request_joules_sum", {}).values())
    requests_total = sum(settled[g]["requests"] for g in drew)
    failed = [o for o in outcomes if o[1] != 200]
    worst = max(abs(off[g]) / drew[g] for g in drew)
    print("| GPU | measured (J) | requests (J) | idle (J) | nobody (J) | waiting (J) | books - measured (J) | "
          "off |\n| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for g in sorted(drew, key=int):
        s = settled[g]
        print(f"| {g} | {drew[g]:.3f} | {s['requests']:.3f} | {s['idle']:.3f} | {s['nobody']:.3f} | "
              f"{waiting[g]:.3f} | {off[g]:+.3f} | {abs(off[g]) / drew[g]:.5%} |")
    print(f"\n- {len(plan)} requests sent over {cycles * CYCLE_S:g} s, {len(failed)} not answered 200"
          f"{(': ' + str(failed[:4])) if failed else ''} (the clients that left mid-stream read 300 bytes of a 200)")
    print(f"- given joules: {count:.0f} (the histogram's count), {len(lines)} per-request lines; estimated: "
          f"{sum(f.get('gpuwarden_proxy_requests_estimated_total', {}).values()):.0f}")
    print(f"- the histogram's sum {joules_sum:.3f} J against the requests' book over the GPUs {requests_total:.3f} J")
    print("- the proxy's counters of trouble: " + ", ".join(
        f"{name} {sum(f.get(f'gpuwarden_proxy_{name}_total', {}).values()):.0f}"
        for name in ("energy_unread", "energy_intervals_refused", "requests_unmeasured")))
    if ratios:
        print(f"- twice the tokens over the same span: large / small joules p50 {percentile(ratios, 0.5):.3f}, "
              f"min {min(ratios):.3f}, max {max(ratios):.3f} ({len(ratios)} pairs)")
    print(f"- the worst GPU's books off by {worst:.5%} (bound {BOUND:.1%}); the daemon's exit {code}")
    ok = worst <= BOUND and count >= len(plan) and code == 0 and not left
    if left:
        print(f"- **left running: {len(left)} processes**")
    return 0 if ok else 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float, default=300.0, help="seconds of the schedule (300: the issue's 5 "
                        "minutes)")
    parser.add_argument("--smoke", action="store_true", help="two cycles (20 s): that the script still runs")
    parser.add_argument("--venv", type=Path, default=Path(os.environ.get("GPUWARDEN_VLLM_VENV",
                                                                        "/opt/gpuwarden-test/venv-vllm")),
                        help="as root, the proxy runs on this venv's Python (the engine's user can run it)")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a kill stops the daemon it started (finally)
    sys.exit(run(20.0 if args.smoke else args.duration, args.venv))


if __name__ == "__main__":
    main()
