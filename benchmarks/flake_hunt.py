"""Flake hunt: the process tier, N times in a row with CPU hogs beside it, and every test that failed any run.

    python3 benchmarks/flake_hunt.py [--runs 3] [--hogs 2] [--workers 4] [--venv .venv] [-- PYTEST ARGS...]

A test of the process tier (tests/harness/tiers.py) asserts order and outcome, not seconds, so a busy box must not
fail it. This makes the box busy on purpose: `stress-ng --cpu HOGS` (Debian's stress-ng; a busy loop of Python per
hog where it is missing, which the table says) runs for the whole hunt, then each run is
`pytest -n WORKERS -m "process and not real"` with a JUnit report. At the end a table: each run's minutes, passed
and failed; then each test that failed in any run, with how many runs it failed and the first line of its failure,
and the folder that keeps each run's report and output whole (removed when no test failed).
The hogs are stopped (their process group) however the hunt ends. Exit status 1 when any test failed.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SELECTION = "process and not real"


def start_hogs(count: int) -> tuple[subprocess.Popen | None, str]:
    if count <= 0:
        return None, "none"
    if shutil.which("stress-ng"):
        command = ["stress-ng", "--cpu", str(count), "--quiet"]
        what = f"stress-ng --cpu {count}"
    else:
        command = ["sh", "-c", f'for i in $(seq {count}); do "{sys.executable}" -c "while True: pass" & done; wait']
        what = f"{count} Python busy loops (stress-ng not installed: apt-get install stress-ng)"
    return subprocess.Popen(command, start_new_session=True, stdout=subprocess.DEVNULL), what


def stop_hogs(hogs: subprocess.Popen | None) -> None:
    if hogs is None:
        return
    try:
        os.killpg(hogs.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    hogs.wait(30)


def failures(report: Path) -> dict[str, str]:
    """test id: the first line of its failure or error, from pytest's JUnit report."""
    out = {}
    if not report.exists():
        return {"(no report: pytest did not finish)": ""}
    for case in ElementTree.parse(report).iter("testcase"):
        for kind in ("failure", "error"):
            node = case.find(kind)
            if node is not None:
                test = f"{case.get('classname', '')}::{case.get('name', '')}"
                message = (node.get("message") or node.text or "").strip().splitlines()
                out[test] = message[0][:160] if message else kind
    return out


def counts(report: Path) -> tuple[int, int]:
    if not report.exists():
        return 0, 0
    root = ElementTree.parse(report).getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    total = int(suite.get("tests", 0)) - int(suite.get("skipped", 0))
    bad = int(suite.get("failures", 0)) + int(suite.get("errors", 0))
    return total - bad, bad


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3, help="runs of the process tier (default 3)")
    parser.add_argument("--hogs", type=int, default=2, help="CPU hogs beside it for the whole hunt (default 2)")
    parser.add_argument("--workers", type=int, default=4, help="pytest-xdist workers, as tests/run (default 4)")
    parser.add_argument("--venv", type=Path, default=ROOT / ".venv", help="the venv tests/run made (default .venv)")
    parser.add_argument("pytest_args", nargs="*", help="more pytest arguments (after --)")
    args = parser.parse_args()
    python = args.venv / "bin" / "python"
    if not python.exists():
        parser.error(f"{python} not found: run `bash tests/run` once first (it makes the venvs)")
    if not 1 <= args.runs <= 50:
        parser.error("--runs: 1 to 50")
    folder = Path(tempfile.mkdtemp(prefix="flake-hunt-"))
    hogs, what = start_hogs(args.hogs)
    rows, failed_in = [], defaultdict(list)
    try:
        for run in range(1, args.runs + 1):
            report = folder / f"run{run}.xml"
            began = time.monotonic()
            print(f"run {run} of {args.runs} beside {what} ...", flush=True)
            subprocess.run([str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", str(args.workers),
                            "-m", SELECTION, f"--junitxml={report}", *args.pytest_args], cwd=ROOT,
                           stdout=(folder / f"run{run}.log").open("wb"), stderr=subprocess.STDOUT)
            passed, bad = counts(report)
            rows.append((run, (time.monotonic() - began) / 60, passed, bad))
            for test, line in failures(report).items():
                failed_in[test].append((run, line))
            if passed + bad == 0:  # a run that ran nothing (interrupted, or a selection that matches no test)
                failed_in["(no test ran)"].append((run, "the run ran no test: it proves nothing"))
            print(f"run {run}: {passed} passed, {bad} failed in {rows[-1][1]:.1f} min", flush=True)
    finally:
        stop_hogs(hogs)
    print(f"\n### Flake hunt: `-m \"{SELECTION}\"`, {args.workers} workers, beside {what}\n")
    print("| run | minutes | passed | failed |\n| ---: | ---: | ---: | ---: |")
    for run, minutes, passed, bad in rows:
        print(f"| {run} | {minutes:.1f} | {passed} | {bad} |")
    if failed_in:
        print("\n| test | runs failed | first failure |\n| --- | ---: | --- |")
        for test, runs in sorted(failed_in.items(), key=lambda kv: -len(kv[1])):
            print(f"| `{test}` | {len(runs)} of {args.runs} | {runs[0][1].replace('|', '/')} |")
        # A failure's first line rarely says why: its whole text and the run's output are kept to read
        print(f"\nEach run's JUnit report (runN.xml: every failure whole) and output (runN.log) are kept in {folder}")
    else:
        print("\nNo test failed in any run.")
        shutil.rmtree(folder, ignore_errors=True)
    return 1 if failed_in else 0


if __name__ == "__main__":
    sys.exit(main())
