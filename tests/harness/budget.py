"""The test budget: seconds per test file at the end of a run, grouped by the real part each test needs, so that
what CI's time goes to can be read off one table (docs/development.md keeps it).

A test's part comes from its markers and fixtures (PARTS): the real CPU vLLM, the nspawn boot, Prometheus and
Alertmanager, Ray; "none" is everything else (simulated GPUs, fake children, the daemon as a process). Setup and
teardown count with the test that paid them: a session-scoped engine is charged to the first test that needs it.
"""

from __future__ import annotations

from collections import defaultdict

# (part, markers, fixtures, test files): a test needs the part when it has one of the markers or fixtures, or
# lives in one of the files. The first match wins: a Prometheus test that serves real vLLM counts as vLLM.
PARTS = (
    ("nspawn", {"systemd"}, set(), set()),
    ("Ray", set(), {"ray_processes"}, set()),
    ("vLLM", {"vllm"}, {"vllm_python", "tiny_model", "long_tiny_model", "served"}, set()),
    ("Prometheus/Alertmanager", {"fleet"}, set(), {"test_prometheus.py", "test_fleet.py"}),
)
KEYWORD = "budget-part:"


def part_of(markers: set[str], fixtures: set[str], filename: str) -> str:
    for part, marks, needs, files in PARTS:
        if markers & marks or fixtures & needs or filename in files:
            return part
    return "none"


def tag(items) -> None:
    """At collection (on each xdist worker too): the part as a keyword, which the reports carry to the summary."""
    for item in items:
        markers = {mark.name for mark in item.iter_markers()}
        part = part_of(markers, set(getattr(item, "fixturenames", ())), item.path.name)
        item.keywords[KEYWORD + part] = 1


class Budget:
    def __init__(self) -> None:
        self.seconds: dict[tuple[str, str], float] = defaultdict(float)
        self.tests: dict[tuple[str, str], set[str]] = defaultdict(set)

    def add(self, report) -> None:
        part = next((k[len(KEYWORD):] for k in getattr(report, "keywords", {}) if k.startswith(KEYWORD)), "none")
        key = (part, report.nodeid.split("::", 1)[0])
        self.seconds[key] += report.duration
        self.tests[key].add(report.nodeid)

    def lines(self) -> list[str]:
        if not self.seconds:
            return []
        totals: dict[str, float] = defaultdict(float)
        for (part, _), seconds in self.seconds.items():
            totals[part] += seconds
        width = max(len(f) for _, f in self.seconds)
        out = [f"{'part':<24} {'file':<{width}} {'tests':>5} {'seconds':>8}"]
        for part in sorted(totals, key=totals.get, reverse=True):
            rows = sorted(((f, s) for (p, f), s in self.seconds.items() if p == part), key=lambda r: -r[1])
            for path, seconds in rows:
                out.append(f"{part:<24} {path:<{width}} {len(self.tests[(part, path)]):>5} {seconds:>8.1f}")
            out.append(f"{part + ' total':<24} {'':<{width}} {'':>5} {totals[part]:>8.1f}")
        out.append(f"{'all':<24} {'':<{width}} {'':>5} {sum(totals.values()):>8.1f}  (summed over workers)")
        return out
