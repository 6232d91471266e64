"""The suite's three tiers, and the check that each test's marker says what it does.

- unit: no marker. No process: a test of this tier runs in the pytest process alone.
- process: `@pytest.mark.process`. It starts processes (the daemon, the proxy, the fake engine, promtool) on the
  simulator; nothing in it needs a real part.
- real: a marker of REAL_PARTS (`vllm`, `systemd`, `fleet`, `ray`, `podman`). It needs a real part (the CPU vLLM, an nspawn
  boot, Prometheus and Alertmanager as servers, Ray). tests/run runs this tier after the others, on one worker, so
  that a real engine never shares the box with a test that times something.

The check: every process start in the pytest process (subprocess.Popen, os.fork, os.posix_spawn and what calls
them: asyncio's subprocesses, multiprocessing) is counted against the test being set up, run or torn down. After
a test that passed:
- an unmarked test that started a process fails: mark it `process` (or its real part);
- a test marked `process` that started none, and needs no fixture that started one, fails: it is a unit test. (A
  real part's marker says what the test needs, which can be files alone: the installed vLLM's metadata.)

A session- or module-scoped fixture's processes count for every test that needs the fixture (its first user pays
the start; the others still depend on it).
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
from collections import defaultdict

import pytest

from harness import engines
from harness.budget import ENGINE_STARTS

# marker: what it needs (the real tier)
REAL_PARTS = {
    "vllm": "the real CPU build of vLLM (tests/vllm/install)",
    "systemd": "the .deb booted under systemd-nspawn (root)",
    "fleet": "Prometheus and Alertmanager as servers (Debian's packages)",
    "ray": "the real ray package, its head and worker processes",
    "podman": "Debian's podman and runc, its API served on a socket of the tests' own (tests/harness/podman_rig.py)",
}
PROCESS = "process"
MARKERS = {
    PROCESS: "starts processes (the daemon, the proxy, the fake engine, a tool) on the simulator; no real part",
    **{name: f"real tier: {need}" for name, need in REAL_PARTS.items()},
    "real": "set by tests/harness/tiers.py on every test with a real part's marker (tests/run runs them last, alone)",
    "docs": "the documentation site built with MkDocs (newest pass only: .[docs])",
    "soak": "a long run of shipped timings, not in tests/run: `pytest -p no:xdist -m soak` (benchmarks/RESULTS.md)",
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
        # threads other than the main one that were alive when the test began: the objects, not their idents, which
        # a thread started later may take over once one of them has ended (hunt 8: a reset run on a new worker
        # thread was taken for an earlier test's, and the test was judged to have started no process)
        self.older: set[threading.Thread] = set()
        self._installed = False

    def note(self, what: str) -> None:
        self.total += 1
        # a thread an earlier test left running (a daemon's reader, a server) is not this test's doing
        if self.current is not None and threading.current_thread() not in self.older:
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
# GPUWARDEN_TIER_LEDGER=FILE: write each wrong marker there as a JSON line instead of failing the test (for a tool
# that mends markers in bulk)
LEDGER = os.environ.get("GPUWARDEN_TIER_LEDGER")


def configure(config) -> None:
    for name, text in MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {text}")
    STARTS.install()
    engines.current = lambda: STARTS.current


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


def _function(item) -> tuple[str, str]:
    """A test function: its parametrized cases share one marker, so the check judges them together."""
    return (str(item.path), getattr(item, "originalname", item.name))


def _last_cases(session) -> dict[tuple[str, str], str]:
    """Each test function's last case in this process's collection (its cases run in that order, on one worker)."""
    last = getattr(session, "_tier_last_cases", None)
    if last is None:
        last = session._tier_last_cases = {_function(i): i.nodeid for i in session.items}
    return last


def verdict(item, started: list[str], through: list[str]) -> str | None:
    """Why this test function's marker is wrong, or None."""
    tier = tier_of(item)
    if tier == "unit" and started:
        names = ", ".join(sorted(set(started))[:5])
        return (f"tier: this unit test started {len(started)} process(es) ({names}); a test that starts processes "
                "is marked `process` (or its real part's marker): see tests/harness/tiers.py")
    if tier == "unit" and through:
        return (f"tier: this unit test needs fixtures that start processes ({', '.join(through)}); mark it "
                "`process` (or its real part's marker)")
    if tier == PROCESS and not started and not through:
        return ("tier: marked process but started no process and needs no fixture that does: it is a unit test, "
                "drop the marker (pytestmark included)")
    return None


def runtest_protocol(item):
    """Around a test's whole run (a hookwrapper's body): its starts are counted under its id."""
    STARTS.current = item.nodeid
    STARTS.older = {t for t in threading.enumerate() if t is not threading.main_thread()}
    try:
        yield
    finally:
        STARTS.current = None


def runtest_teardown(nextitem):
    """Around a test's teardown (a hookwrapper's body): the last test of a session (nextitem None) also ends the
    session's and its module's fixtures, whose processes (userdel of a user a fixture made) are not this test's;
    they are not counted. A unit test that ended a worker's run failed here, as chance put it last."""
    if nextitem is None:
        STARTS.current = None
    yield


FUNCTIONS: dict[tuple[str, str], dict] = defaultdict(lambda: {"started": [], "through": set(), "spoilt": False})


def makereport(item, call, report) -> None:
    """At the teardown of a test function's last case: a wrong tier marker fails it. A function any case of which
    failed or was skipped is not judged."""
    if call.when != "teardown":
        return
    if starts := engines.take(item.nodeid):
        report.user_properties.append((ENGINE_STARTS, starts))
    key = _function(item)
    seen = FUNCTIONS[key]
    seen["started"] += STARTS.by_test.pop(item.nodeid, [])
    seen["through"] |= set(getattr(item, "fixturenames", ())) & STARTS.fixtures
    if report.outcome != "passed" or getattr(item, "_tier_failed_earlier", False):
        seen["spoilt"] = True
    if _last_cases(item.session).get(key) != item.nodeid:
        return
    FUNCTIONS.pop(key)
    if seen["spoilt"]:
        return
    why = verdict(item, seen["started"], sorted(seen["through"]))
    if why is None:
        return
    if LEDGER:
        with open(LEDGER, "a") as ledger:
            ledger.write(json.dumps({"file": key[0], "function": key[1], "tier": tier_of(item),
                                     "started": len(seen["started"]), "through": sorted(seen["through"])}) + "\n")
        return
    report.outcome = "failed"
    report.longrepr = why


def note_failure(item, call, report) -> None:
    if call.when in ("setup", "call") and report.outcome != "passed":
        item._tier_failed_earlier = True
