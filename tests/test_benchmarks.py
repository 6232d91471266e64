"""The benchmarks still run (smoke mode); their timings are recorded in benchmarks/RESULTS.md, not asserted."""

import subprocess
import sys

import pytest

from conftest import ROOT, subprocess_env


@pytest.mark.process
@pytest.mark.parametrize("script,expect", [
    ("detection_latency.py", "| 0.25 | 1 | 1 |"),
    ("footprint.py", "/metrics with 8 GPUs, 20 sequential scrapes"),
    ("power_budget.py", "sum of enforced limits at or below the budget at every check: yes"),
])
def test_benchmark_smoke(script, expect):
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), "--smoke"], capture_output=True,
                          text=True, env=subprocess_env(), timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert expect in proc.stdout
    assert "Traceback" not in proc.stderr


@pytest.mark.process
def test_scrape_benchmark_smoke():
    # Against HEAD: a fresh clone has it, and older revisions may need packages this venv lacks.
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "scrape.py"), "--smoke", "--before", "HEAD"],
                          capture_output=True, text=True, env=subprocess_env(), timeout=180, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| 8 |")]
    assert len(rows) == 2 and all(row.split("|")[5].strip() == "0" for row in rows), proc.stdout  # none failed


@pytest.mark.process
def test_soak_smoke_stays_flat_and_leaves_nothing(child_user):
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "soak.py"), "--smoke"], capture_output=True,
                          text=True, env=subprocess_env(), timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "SIGTERM: exit 0; fake-child processes left: 0; tracebacks in the daemon's own log: 0" in proc.stdout


def test_a_lag_is_excused_only_by_the_wait_for_a_cpu_just_before_it():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from soak import lags_not_explained_by_waiting

    def rows(*pairs):  # (lag p99 s, the daemon's total wait for a CPU s) per sample, as soak.py records them
        return [(t, "m", 1.0, 1, p99, p99, 0.1, "RUNNING", waited) for t, (p99, waited) in enumerate(pairs)]

    assert lags_not_explained_by_waiting(rows((0.1, 0.0), (0.1, 0.2), (2.5, 1.0))) == []  # waited 1.0 s >= 0.6
    blocked = rows((0.1, 0.0), (0.1, 0.0), (2.5, 0.1))  # a read that slept its 2 s deadline: no wait for a CPU
    assert lags_not_explained_by_waiting(blocked) == [blocked[2]]
    # the same worst lag, read again at the next samples, is that one stall, not another
    assert lags_not_explained_by_waiting(rows((2.5, 1.0), (2.5, 1.0), (2.5, 1.0))) == []


@pytest.mark.process
def test_supervisor_benchmark_smoke():
    # on the tests' stand-in engine: the script's steps in seconds (with vLLM, two starts cost CI four minutes,
    # and test_vllm_e2e SIGKILLs real vLLM and counts its orphans already)
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "supervisor.py"), "--smoke", "--fake-engine"],
                          capture_output=True, text=True, env=subprocess_env(), timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    row = [line for line in proc.stdout.splitlines() if line.startswith("| 1 |")]
    assert row and row[0].endswith("| 0 |"), proc.stdout  # no orphan left
    assert "every vLLM process gone after" in proc.stdout


@pytest.mark.process
def test_joules_conservation_smoke_keeps_the_books_and_leaves_nothing(child_user):
    # two cycles of the 5-minute schedule (RESULTS.md has the long run): the books per GPU, every request's joules
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "joules_conservation.py"), "--smoke"],
                          capture_output=True, text=True, env=subprocess_env(), timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "- 11 requests sent over 20 s, 0 not answered 200" in proc.stdout, proc.stdout
    assert "given joules: 11 (the histogram's count), 11 per-request lines; estimated: 3" in proc.stdout, proc.stdout
    assert "the daemon's exit 0" in proc.stdout and "left running" not in proc.stdout and "Traceback" not in proc.stderr


@pytest.mark.process
@pytest.mark.parametrize("script", ["sample_cost.py", "roofline.py", "nvml_cold_calls.py"])
def test_gpu_benchmarks_say_plainly_that_they_need_a_gpu(script):
    # They measure a real card (RESULTS.md has the numbers from the lent H200); here there is none.
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script)], capture_output=True, text=True,
                          env=subprocess_env(), timeout=120)
    if proc.returncode == 0:
        pytest.skip("a GPU is present here")
    assert "needs" in proc.stderr and "GPU" in proc.stderr and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


@pytest.mark.process
def test_the_lint_names_nine_in_ten_registry_traps_and_no_near_miss_draws_a_warning():
    # every visible trap of the community registry through the lint in-process (under a second): the bar
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "lint_registry.py"), "--check"],
                          capture_output=True, text=True, env=subprocess_env(), timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "drawing a warning or an error: 0;" in proc.stdout and "Traceback" not in proc.stderr
