"""`gpuwarden tune`'s knee against the curve's own, on the simulated H100 (tests/test_tune.py's rig: a daemon on the
simulator, the fake server serving at the simulated card's speed): for a decode-heavy and a prefill-heavy workload,
the knee tune measured (wall-clock tokens a second and joules) beside the knee the curve has at the same settings
(test_tune.expected_knee: each step's speed from the simulated card's loaded clock, its draw from the simulator).

    python3 benchmarks/tune_knee.py [--runs 1] [--shape decode|prefill|both]

The figures are wall-clock: a busy host adds a client-side gap to every request and flattens the curve, so this runs
on a quiet host and says how far the host was from the curve's pace (each step's measured request time over the
modelled one). That is why it is here and not in the test tier, whose test asserts only that tune's knee is its own
table's. Prints a Markdown table for benchmarks/RESULTS.md; exit 1 where a run's knee is more than one step from the
curve's.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "daemon")]
# the daemon, the fake server and tune (`python -m gpuwarden`, children of this one) run this tree's code too
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, (str(ROOT / "daemon"), os.environ.get("PYTHONPATH"))))

from conftest import DaemonProcess  # noqa: E402  (the tests' own rig)
from test_tune import Rig, expected_knee  # noqa: E402

LENGTHS = {"decode": (8, 32), "prefill": (400, 2)}


def one(shape: str, folder: Path) -> dict:
    started: list[DaemonProcess] = []

    def daemons(path, *args, env=None, command=None):
        started.append(DaemonProcess(path, *args, env=env, command=command))
        return started[-1]

    rig = None
    try:
        rig = Rig(folder, daemons)  # its fake server first: ended below however the start goes
        rig.start_daemon()
        input_len, output_len = LENGTHS[shape]
        out = rig.tune("--steps", "6", "--duration", "1.5", "--input-len", str(input_len), "--output-len",
                       str(output_len), "--json")
        if out.returncode != 0:
            raise SystemExit(f"tune_knee: tune {shape} exited {out.returncode}: {out.stderr.strip()[-400:]}")
        result = json.loads(out.stdout)
    finally:
        if rig is not None:
            rig.close()
        for d in started:
            d.end()
    values = [s["setting"] for s in result["steps"]]
    true, model_s = expected_knee(values, input_len, output_len, 0.95)
    ratios = [4 * output_len / s["system_tokens_per_s"] / m for s, m in zip(result["steps"], model_s)]
    measured = values.index(result["knee"]["setting"])
    return {"shape": shape, "measured": values[measured], "curve": values[true], "steps": abs(measured - true),
            "ratios": ratios, "ok": abs(measured - true) <= 1}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=1, help="runs of each shape (default 1)")
    parser.add_argument("--shape", choices=("decode", "prefill", "both"), default="both")
    args = parser.parse_args()
    shapes = ("decode", "prefill") if args.shape == "both" else (args.shape,)
    rows = []
    with tempfile.TemporaryDirectory(prefix="tune-knee-") as tmp:
        for run in range(args.runs):
            for shape in shapes:
                rows.append(one(shape, Path(tmp) / f"{shape}{run}"))
                r = rows[-1]
                print(f"run {run + 1} {shape}: knee {r['measured']} W, the curve's {r['curve']} W", file=sys.stderr)
    print("| shape | tune's knee | the curve's knee | steps apart | measured/modelled request time, 700 W to 200 W |")
    print("| --- | ---: | ---: | ---: | --- |")
    for r in rows:
        print(f"| {r['shape']} | {r['measured']:g} W | {r['curve']:g} W | {r['steps']} | "
              f"{', '.join(f'{x:.2f}' for x in r['ratios'])} |")
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
