"""Counting the real engines the tests start, from the daemons' own log lines.

The supervisor logs one "vLLM starting (pid N, ...): ARGV" line per spawn (serving/run/supervisor.py). A line whose
argv runs the real vLLM (its OpenAI entry point, or tests/vllm/vllm_cli.py) is a start of the CPU vLLM: a minute
or more of both cores. conftest's DaemonProcess and tests/vllm/restart_rig.py pass every line they read to seen();
the count goes to the test running at that moment (tests/harness/tiers.py), and the budget prints it.
"""

from __future__ import annotations

import os
import re
from collections import defaultdict

REAL_START = re.compile(r" starting \(pid \d+[^)]*\): (\S+) (-m vllm\.entrypoints\.|\S*vllm_cli\.py serve)")
# Only the CPU vLLM's own interpreter (tests/run's GPUWARDEN_VLLM_VENV) runs the real one: a planted fake `vllm`
# package on the same entry point (tests/test_privilege.py) is no engine start.
VENV = os.environ.get("GPUWARDEN_VLLM_VENV", "/opt/gpuwarden-test/venv-vllm").rstrip("/") + "/"
COUNTS: dict[str | None, int] = defaultdict(int)
current = None  # set by the tier plugin: a callable giving the running test's id


def seen(line: str) -> None:
    if (found := REAL_START.search(line)) and found.group(1).startswith(VENV):
        COUNTS[current() if current else None] += 1


def take(test_id: str) -> int:
    return COUNTS.pop(test_id, 0)
