"""The benchmarks still run (smoke mode); their timings are recorded in benchmarks/RESULTS.md, not asserted."""

import subprocess
import sys

import pytest

from conftest import ROOT, subprocess_env

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("script,expect", [
    ("detection_latency.py", "| 0.25 | 1 | 1 |"),
    ("footprint.py", "/metrics with 8 GPUs, 20 sequential scrapes"),
])
def test_benchmark_smoke(script, expect):
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), "--smoke"], capture_output=True,
                          text=True, env=subprocess_env(), timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert expect in proc.stdout
    assert "Traceback" not in proc.stderr
