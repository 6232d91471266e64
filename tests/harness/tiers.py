"""The suite's three tiers, and the check that each test's marker says what it does.

- unit: no marker. No process: a test of this tier runs in the pytest process alone.
- process: `@pytest.mark.process`. It starts processes (the daemon, the proxy, the fake engine, promtool) on the
  simulator; nothing in it needs a real part.
- real: a marker of REAL_PARTS (`vllm`, `systemd`, `fleet`, `ray`). It needs a real part (the CPU vLLM, an nspawn
  boot, Prometheus and Alertmanager as servers, Ray). tests/run runs this tier after the others, on one worker, so
  that a real engine never shares the box with a test that times something.

The check: every process start in the pytest process (subprocess.Popen, os.fork, os.posix_spawn and what calls
them: asyncio's subprocesses, multiprocessing) is counted against the test being set up, run or torn down. After
a test that passed:
- an unmarked test that started a process fails: mark it `process` (or its real part);
- a marked test that started none, and needs no fixture that started one, fails: it is a unit test.

A session- or module-scoped fixture's processes count for every test that needs the fixture (its first user pays
the start; the others still depend on it).
"""

from __future__ import annotations

import os
import subprocess
from collections import defaultdict

import pytest

# marker: what it needs (the real tier)
REAL_PARTS = {
    "vllm": "the real CPU build of vLLM (tests/vllm/install)",
    "systemd": "the .deb booted under systemd-nspawn (root)",
    "fleet": "Prometheus and Alertmanager as servers (Debian's packages)",
    "ray": "the real ray package, its head and worker processes",
}
PROCESS = "process"
MARKERS = {
    PROCESS: "starts processes (the daemon, the proxy, the fake engine, a tool) on the simulator; no real part",
    **{name: f"real tier: {need}" for name, need in REAL_PARTS.items()},
    "real": "set by tests/harness/tiers.py on every test with a real part's marker (tests/run runs them last, alone)",
    "docs": "the documentation site built with MkDocs (newest pass only: .[docs])",
}


def tier_of(item) -> str:
    names = {mark.name for mark in item.iter_markers()}
    if names & REAL_PARTS.keys():
        return "real"
    return PROCESS if PROCESS in names else "unit"


class Starts:
    """Counts process starts in this (worker) process, by the test and the fixture running when they happened."""

    def __init__(self) -> None:
        self.total = 0
        self.by_test: dict[str, list[str]] = defaultdict(list)
        self.fixtures: set[str] = set()  # fixtures whose setup started a process
        self.current: str | None = None
        self._installed = False

    def note(self, what: str) -> None:
        self.total += 1
        if self.current is not None:
            self.by_test[self.current].append(what)

    def install(self) -> None:
        if self._installed:
            return
        self._installed = True
        starts = self
        execute_child = subprocess.Popen._execute_child

        def _execute_child(popen, args, executable, *rest, **kwargs):
            first = args if isinstance(args, (str, bytes)) else (list(args)[:1] or ["?"])[0]
            starts.note(os.path.basename(str(executable or first)))
            return execute_child(popen, args, executable, *rest, **kwargs)

        subprocess.Popen._execute_child = _execute_child
        for name in ("fork", "posix_spawn", "posix_spawnp"):
            original = getattr(os, name, None)
            if original is None:
                continue

            def wrapped(*args, _original=original, _name=name, **kwargs):
                pid = _original(*args, **kwargs)
                if pid != 0:  # the parent's side of a fork
                    starts.note(_name)
                return pid

            setattr(os, name, wrapped)


STARTS = Starts()


def configure(config) -> None:
    for name, text in MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {text}")
    STARTS.install()


def collection_modifyitems(items) -> None:
    for item in items:
        if tier_of(item) == "real":
            item.add_marker(pytest.mark.real)


def fixture_setup(fixturedef):
    """Around a fixture's setup (a hookwrapper's body): remember a fixture that started a process."""
    before = STARTS.total
    yield
    if STARTS.total > before:
        STARTS.fixtures.add(fixturedef.argname)


def verdict(item) -> str | None:
    """Why this test's marker is wrong, or None."""
    tier = tier_of(item)
    started = STARTS.by_test.get(item.nodeid, [])
    through = sorted(set(getattr(item, "fixturenames", ())) & STARTS.fixtures)
    if tier == "unit" and started:
        names = ", ".join(sorted(set(started))[:5])
        return (f"tier: this unit test started {len(started)} process(es) ({names}); a test that starts processes "
                "is marked `process` (or its real part's marker): see tests/harness/tiers.py")
    if tier == "unit" and through:
        return (f"tier: this unit test needs fixtures that start processes ({', '.join(through)}); mark it "
                "`process` (or its real part's marker)")
    if tier != "unit" and not started and not through:
        return (f"tier: marked {tier} but started no process and needs no fixture that does: it is a unit test, "
                "drop the marker (pytestmark included)")
    return None


def runtest_protocol(item):
    """Around a test's whole run (a hookwrapper's body): its starts are counted under its id."""
    STARTS.current = item.nodeid
    try:
        yield
    finally:
        STARTS.current = None


def makereport(item, call, report) -> None:
    """At teardown of a test that passed: a wrong tier marker fails it."""
    if call.when != "teardown" or report.outcome != "passed":
        return
    if getattr(item, "_tier_failed_earlier", False):
        return
    if (why := verdict(item)) is not None:
        report.outcome = "failed"
        report.longrepr = why
    STARTS.by_test.pop(item.nodeid, None)


def note_failure(item, call, report) -> None:
    if call.when in ("setup", "call") and report.outcome != "passed":
        item._tier_failed_earlier = True

