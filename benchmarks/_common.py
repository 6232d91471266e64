"""Small helpers the benchmark scripts share (they run as scripts, so this sits beside them)."""

import math
import resource
import socket
import subprocess
import time
import urllib.request


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def percentile(values: list[float], q: float) -> float:
    """The nearest-rank q-quantile (q in 0-1); NaN of none (a cell whose every sample failed prints as nan)."""
    ordered = sorted(values)
    if not ordered:
        return math.nan
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def start(argv, port, env=None, log=None, nofile=None):
    """Start a server (fake engine, proxy) and wait until its /v1/models answers; nofile: its fd limit."""
    limit = (lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))) if nofile else None
    proc = subprocess.Popen(argv, stdout=log or subprocess.DEVNULL, stderr=log or subprocess.DEVNULL, env=env,
                            preexec_fn=limit)
    for _ in range(300):
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=1).read()
            return proc
        except OSError:
            time.sleep(0.05)
    proc.kill()
    raise SystemExit(f"{argv[:4]} did not start")
