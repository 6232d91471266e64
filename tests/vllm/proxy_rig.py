"""The real CPU vLLM with prefix caching and a tools-first chat template, and `gpuwarden proxy` in front of it:
the rig of the proxy's replay test and benchmarks. Both are real processes, stopped with their groups."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
FULL_RULES = ("--rules", "billing_header,cache_control,sort_tools,date_line")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float, log: Path) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args[:3]} exited with {proc.returncode}: {log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2):
                return
        except OSError:
            time.sleep(0.2)
    raise RuntimeError(f"{url} not healthy within {timeout:g} s: {log.read_text()[-3000:]}")


# the cpu-tiny profile's environment (its eager backend, its unpinned thread), as a daemon gives its engine
PROFILE_ENV = yaml.safe_load((HERE / "cpu-tiny.yaml").read_text())["env"]


class Rig:
    def __init__(self, vllm_python: Path, model: Path, workdir: Path, proxy_args=FULL_RULES,
                 gpuwarden=(sys.executable, "-m", "gpuwarden"), env=None):
        self.engine_port, self.proxy_port = free_port(), free_port()
        self.engine = f"http://127.0.0.1:{self.engine_port}"
        self.proxy = f"http://127.0.0.1:{self.proxy_port}"
        self.procs: list[subprocess.Popen] = []
        engine_log, proxy_log = workdir / "vllm.log", workdir / "proxy.log"
        # In the caller's session, in a group of its own: a session of its own is a CPU autogroup of its own on
        # this 2-core box, where CPU vLLM withholds streams (benchmarks/RESULTS.md, section 9).
        self._start([str(vllm_python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
                     "--served-model-name", "tiny", "--host", "127.0.0.1", "--port", str(self.engine_port),
                     "--kv-cache-memory-bytes", "1073741824", "--max-model-len", "16384", "--enable-prefix-caching",
                     "--chat-template", str(HERE / "tools_first.jinja"), "--enable-auto-tool-choice",
                     "--tool-call-parser", "hermes"], engine_log, {**os.environ, **PROFILE_ENV, "VLLM_SERVER_DEV_MODE": "1"})
        wait_healthy(self.engine, self.procs[-1], 600, engine_log)
        from agent_session import TIMESTAMP_RULE

        self._start([*gpuwarden, "proxy", "-c", "none", "--upstream", self.engine, "--listen",
                     f"127.0.0.1:{self.proxy_port}", *proxy_args, "--remove-pattern", TIMESTAMP_RULE], proxy_log,
                    env or os.environ)
        wait_healthy(self.proxy, self.procs[-1], 60, proxy_log)
        self.proxy_log = proxy_log

    def _start(self, argv, log: Path, env) -> None:
        with open(log, "w") as out:
            self.procs.append(subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, process_group=0, env=env))

    def stop(self) -> None:
        for proc in reversed(self.procs):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
