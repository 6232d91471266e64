"""READ-ONLY, for a real multi-GPU host: what would tuning.power_budget_w split, and can the budget be met?
(issue 43 item 1) Run by hand on a GPU host; not collected by pytest.

    PYTHONPATH=daemon python3 tests/hardware/budget_readonly.py [BUDGET_W]

BUDGET_W defaults to 80 % of the sum of the cards' maximum limits (a budget that makes the split matter). It writes
a config with that budget and tuning.apply false, then runs `gpuwarden plan` and `gpuwarden doctor` under
tests/hardware/nvml_readonly.py's guard (pynvml wrapped so only reads pass: any setter raises before reaching a
card) and prints the split they would make. Nothing is set: plan only reads, and apply is false.
"""

import subprocess
import sys
import tempfile
from pathlib import Path

import pynvml

HERE = Path(__file__).resolve().parent


def default_budget() -> float:
    pynvml.nvmlInit()
    try:
        top = sum(pynvml.nvmlDeviceGetPowerManagementLimitConstraints(pynvml.nvmlDeviceGetHandleByIndex(i))[1]
                  for i in range(pynvml.nvmlDeviceGetCount()))
    finally:
        pynvml.nvmlShutdown()
    return round(0.8 * top / 1000)  # mW -> W


def main() -> int:
    budget = float(sys.argv[1]) if len(sys.argv) > 1 else default_budget()
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "gpuwarden.yaml"
        path.write_text(f"gpu: {{backend: nvml}}\nmetrics: {{listen: none}}\n"
                        f"tuning: {{apply: false, power_budget_w: {budget:g}}}\n")
        status = 0
        for command in (["plan"], ["doctor"]):
            argv = [sys.executable, str(HERE / "nvml_readonly.py"), "guard", *command, "-c", str(path)]
            done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
            print(f"$ gpuwarden {' '.join(command)}  (exit {done.returncode})")
            print(done.stdout + done.stderr)
            lines = [line for line in (done.stdout + done.stderr).splitlines() if "budget" in line]
            print("  budget lines:", *lines, sep="\n    ")
            status = max(status, 1 if command == ["plan"] and done.returncode else 0)
    return status


if __name__ == "__main__":
    sys.exit(main())
