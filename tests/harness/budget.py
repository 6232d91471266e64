"""The test budget: seconds per tier and per test file at the end of a run, the real engines started, and the real
tier's limit (docs/development.md keeps the figures).

A test's tier comes from tests/harness/tiers.py; within the real tier, its part from its markers and fixtures
(PARTS). Setup and teardown count with the test that paid them: a session-scoped engine is charged to the first
test that needs it. Engine starts are counted from the daemons' own log lines (conftest.DaemonProcess): each
"vLLM starting (pid ...)" line of a real vLLM command is one start of the CPU vLLM, carried to xdist's controller
in the report's user_properties.

The real tier runs alone on one worker (tests/run), so its summed seconds are its wall time; past
REAL_STARTS_MAX engine starts the run fails and names the tests that started them, so that a new real-part test
shares a start instead of adding one.
"""

from __future__ import annotations

import os
from collections import defaultdict

# (part, markers, fixtures): a test needs the part when it has one of the markers or fixtures. The first match
# wins: a Prometheus test that serves real vLLM counts as vLLM.
PARTS = (
    ("nspawn", {"systemd"}, set()),
    ("Ray", {"ray"}, {"ray_processes"}),
    ("vLLM", {"vllm"}, {"vllm_python", "tiny_model", "served"}),
    ("Prometheus/Alertmanager", {"fleet"}, set()),
)
KEYWORD = "budget-part:"
TIER = "budget-tier:"
ENGINE_STARTS = "engine_starts"
# The real tier's budget is counted, not timed: the CPU vLLM's engine starts (about 30 s of both cores each, the
# most of the tier's time) that the daemons of one whole run log. A run past it fails and names the tests that
# started engines, so that a new real-part test shares a start instead of adding one. The tier's seconds are
# printed beside the count (a fresh clone's figures: docs/development.md), never failed on: a slow or busy box
# would fail a run whose tests all passed (CI's machine ran the tier 22 % slower than this one, on b167952).
REAL_STARTS_MAX = int(os.environ.get("GPUWARDEN_REAL_STARTS_MAX", "15"))


def part_of(markers: set[str], fixtures: set[str]) -> str:
    for part, marks, needs in PARTS:
        if markers & marks or fixtures & needs:
            return part
    return "none"


def tag(items, tier_of) -> None:
    """At collection (on each xdist worker too): the tier and part as keywords, which the reports carry."""
    for item in items:
        markers = {mark.name for mark in item.iter_markers()}
        tier = tier_of(item)
        part = part_of(markers, set(getattr(item, "fixturenames", ()))) if tier == "real" else "none"
        item.keywords[KEYWORD + part] = 1
        item.keywords[TIER + tier] = 1


def _keyword(report, prefix: str, default: str) -> str:
    return next((k[len(prefix):] for k in getattr(report, "keywords", {}) if k.startswith(prefix)), default)


class Budget:
    def __init__(self) -> None:
        self.seconds: dict[tuple[str, str, str], float] = defaultdict(float)  # (tier, part, file)
        self.tests: dict[tuple[str, str, str], set[str]] = defaultdict(set)
        self.per_test: dict[str, float] = defaultdict(float)
        self.tier_of_test: dict[str, str] = {}
        self.starts: dict[str, int] = defaultdict(int)  # test id: real engine starts

    def add(self, report) -> None:
        tier = _keyword(report, TIER, "unit")
        part = _keyword(report, KEYWORD, "none")
        key = (tier, part, report.nodeid.split("::", 1)[0])
        self.seconds[key] += report.duration
        self.tests[key].add(report.nodeid)
        self.per_test[report.nodeid] += report.duration
        self.tier_of_test[report.nodeid] = tier
        for name, value in getattr(report, "user_properties", ()):
            if name == ENGINE_STARTS:
                self.starts[report.nodeid] += int(value)

    def tier_seconds(self) -> dict[str, float]:
        totals: dict[str, float] = defaultdict(float)
        for (tier, _, _), seconds in self.seconds.items():
            totals[tier] += seconds
        return totals

    def lines(self) -> list[str]:
        if not self.seconds:
            return []
        width = max(len(f) for _, _, f in self.seconds)
        out = [f"{'tier':<7} {'part':<24} {'file':<{width}} {'tests':>5} {'seconds':>8}"]
        totals = self.tier_seconds()
        for tier in sorted(totals, key=totals.get, reverse=True):
            rows = sorted(((p, f, s) for (t, p, f), s in self.seconds.items() if t == tier), key=lambda r: -r[2])
            for part, path, seconds in rows[:12]:
                out.append(f"{tier:<7} {part:<24} {path:<{width}} {len(self.tests[(tier, part, path)]):>5} "
                           f"{seconds:>8.1f}")
            if len(rows) > 12:
                rest = sum(r[2] for r in rows[12:])
                out.append(f"{tier:<7} {'':<24} {f'({len(rows) - 12} more files)':<{width}} {'':>5} {rest:>8.1f}")
            out.append(f"{tier + ' total':<32} {'':<{width}} {'':>5} {totals[tier]:>8.1f}")
        out.append(f"{'all':<32} {'':<{width}} {'':>5} {sum(totals.values()):>8.1f}  (summed over workers)")
        starts = sum(self.starts.values())
        out.append(f"real vLLM engine starts: {starts}" + (
            " (" + ", ".join(f"{t.split('::')[-1][:48]} {n}" for t, n in
                             sorted(self.starts.items(), key=lambda kv: -kv[1]) if n) + ")" if starts else ""))
        return out

    def over_budget(self) -> list[str]:
        """Lines saying the real tier started more engines than its budget, naming the tests that started them;
        empty while within."""
        starts = sum(self.starts.values())
        if starts <= REAL_STARTS_MAX:
            return []
        out = [f"the real tier started {starts} vLLM engines, past its budget of {REAL_STARTS_MAX} "
               "(tests/harness/budget.py): share an engine start rather than add one. The tests that started them:"]
        out += [f"  {n:3d}  {t}" for t, n in sorted(self.starts.items(), key=lambda kv: -kv[1]) if n]
        return out
