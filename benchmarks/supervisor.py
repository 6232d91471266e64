"""Supervisor timings with the real CPU build of vLLM: SIGKILL of the API server to restart and to healthy,
SIGTERM of the daemon to every child gone, and orphans left after repeated kill cycles.

    python3 benchmarks/supervisor.py [--cycles 20] [--smoke] [--fake-engine]

Runs `gpuwarden run` (a real process) on a sim GPU serving a tiny random Llama
(tests/vllm/make_tiny_model.py) with vLLM from GPUWARDEN_VLLM_VENV
(default /opt/gpuwarden-test/venv-vllm; install it with tests/vllm/install).
--fake-engine serves tests/harness/fakechild.py instead: the script's own steps in seconds (CI's smoke: two vLLM starts
cost CI four minutes, and test_vllm_e2e already SIGKILLs real vLLM); the figures in RESULTS.md are vLLM's.
"""

from __future__ import annotations

import argparse
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

from _common import free_port, percentile

from gpuwarden.serving.run.processes import ProcessOps

ROOT = Path(__file__).resolve().parent.parent
VENV = Path(os.environ.get("GPUWARDEN_VLLM_VENV", "/opt/gpuwarden-test/venv-vllm"))


def group_alive(pgid):
    """Live processes of a process group, orphans included: the supervisor's own check."""
    return ProcessOps().group_pids(pgid)


class Log:
    """The daemon's log lines with the monotonic time each arrived."""

    def __init__(self, stream):
        self.lines: list[tuple[float, str]] = []
        threading.Thread(target=self._read, args=(stream,), daemon=True).start()

    def _read(self, stream):
        for line in stream:
            self.lines.append((time.monotonic(), line.rstrip()))

    def wait(self, text: str, after: int, timeout: float = 600) -> tuple[float, str]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for stamp, line in self.lines[after:]:
                if text in line:
                    return stamp, line
            time.sleep(0.01)
        raise SystemExit(f"timed out waiting for {text!r}")


def vllm_engine(work: Path) -> str:
    """The serve keys for vLLM's CPU build on a tiny random Llama made in work."""
    python = VENV / "bin" / "python"
    if not python.exists():
        raise SystemExit(f"no vLLM at {VENV}: run bash tests/vllm/install")
    model = work / "model"
    subprocess.run([str(python), str(ROOT / "tests" / "vllm" / "make_tiny_model.py"), str(model)], check=True,
                   capture_output=True)
    for path in model.iterdir():
        path.chmod(0o644)
    model.chmod(0o755)
    (work / "profiles.d").mkdir()
    (work / "profiles.d" / "cpu-tiny.yaml").write_text((ROOT / "tests" / "vllm" / "cpu-tiny.yaml").read_text())
    return (f"  profile: cpu-tiny\n  model: {model}\n"
            f"  command: [{python}, -m, vllm.entrypoints.openai.api_server]\n")


def fake_engine(work: Path) -> str:
    """The serve keys for the tests' stand-in, copied where the child user can read it."""
    fake = work / "fakechild.py"
    shutil.copy(ROOT / "tests" / "harness" / "fakechild.py", fake)
    fake.chmod(0o644)
    return (f"  profile: generic\n  model: /fake/model\n"
            f"  python: {ROOT / 'tests' / 'harness' / 'fakechild-flagcheck'}\n"
            f"  command: [/usr/bin/python3, {fake}, --mode, 'healthy,engine']\n")  # the child user may not reach our venv


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cycles", type=int, default=20)
    parser.add_argument("--smoke", action="store_true", help="one kill cycle: checks that it runs")
    parser.add_argument("--fake-engine", action="store_true",
                        help="serve the tests' stand-in (tests/harness/fakechild.py), not vLLM: checks the script, "
                             "not vLLM")
    args = parser.parse_args()
    cycles = 1 if args.smoke else args.cycles
    work = Path(tempfile.mkdtemp(prefix="gpuwarden-bench-"))
    os.chmod(work, 0o755)
    serve = fake_engine(work) if args.fake_engine else vllm_engine(work)
    metrics = free_port()
    user = "gpuwarden-test" if os.geteuid() == 0 else os.environ.get("USER", "nobody")
    config = work / "gpuwarden.yaml"
    config.write_text(f"""poll_interval_s: 0.5
metrics: {{listen: 127.0.0.1:{metrics}}}
gpu: {{backend: sim, scenario: dgx-spark}}
serve:
  enabled: true
{serve}  port: {free_port()}
  user: {user}
  startup_timeout_s: 400
  stop_timeout_s: 20
  stable_after_s: 1
  crash_loop_failures: 1000
""")
    if os.geteuid() == 0:
        subprocess.run(["useradd", "--system", "--create-home", "--home-dir", f"/var/lib/{user}", "--shell",
                        "/usr/sbin/nologin", user], capture_output=True)
    daemon = subprocess.Popen([sys.executable, "-m", "gpuwarden", "run", "-c", str(config)], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    log = Log(daemon.stdout)
    detect, restart, healthy, orphans = [], [], [], 0
    try:
        log.wait("vLLM healthy after", 0)
        for _ in range(cycles):
            time.sleep(2)  # past stable_after_s, so every restart starts from the 1 s backoff
            with urllib.request.urlopen(f"http://127.0.0.1:{metrics}/status", timeout=5) as reply:
                pid = json.load(reply)["serving"]["pid"]
            mark = len(log.lines)
            killed = time.monotonic()
            os.kill(pid, signal.SIGKILL)
            t_detect, _ = log.wait("vLLM exited with signal SIGKILL", mark)
            log.wait("processes of the previous vLLM are gone", mark, timeout=30)  # confirmed, not waited for
            orphans += len(group_alive(pid))
            t_restart, _ = log.wait("vLLM starting (pid", mark)
            t_healthy, _ = log.wait("vLLM healthy after", mark)
            detect.append(t_detect - killed)
            restart.append(t_restart - killed)
            healthy.append(t_healthy - killed)
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics}/status", timeout=5) as reply:
            last = json.load(reply)["serving"]["pid"]
        stopping = time.monotonic()
        daemon.send_signal(signal.SIGTERM)
        daemon.wait(120)
        exited = time.monotonic() - stopping
        while group_alive(last):
            time.sleep(0.01)
        all_gone = time.monotonic() - stopping
    finally:
        if daemon.poll() is None:  # a step failed: SIGTERM, so the daemon stops its engine (SIGKILL left it running)
            daemon.terminate()
            try:
                daemon.wait(60)
            except subprocess.TimeoutExpired:
                daemon.kill()
    print("| kill cycles | detected p50 / p99 | restart issued p50 / p99 | healthy again p50 / p99 | orphans left |")
    print("| ---: | ---: | ---: | ---: | ---: |")
    cells = [f"{percentile(xs, .5):.2f} / {percentile(xs, .99):.2f} s" for xs in (detect, restart, healthy)]
    print(f"| {cycles} | {' | '.join(cells)} | {orphans} |")
    print(f"\nSIGTERM to the daemon: it exited after {exited:.2f} s; every vLLM process gone after {all_gone:.2f} s")


if __name__ == "__main__":
    main()
