"""How tests/run orders the tests: the unit and process tiers over pytest-xdist's workers (`-n 4`), the real tier
on one worker (tests/harness/tiers.py).

Unit and process tests mostly wait (for a child, a timer, a scrape) rather than compute, so four workers on two
cores finish sooner without starving anyone; a real engine, which spins on both cores, is not among them.

Each test file stays on one worker, so that a module- or session-scoped fixture is built once: xdist's by-scope
scheduler with the scope read as the file (conftest's pytest_xdist_make_scheduler), in the collection's order. The
long files come first, so that they start at once while the short files fill the other workers.

In the real tier, which runs in one process, the tests that share the session's engine (conftest.served) come
last: a session fixture is torn down only when the session ends, so its engine would otherwise serve on beside
every later test's own engine.
"""

from __future__ import annotations

# the process tier's longest files (the budget's table), started first
LONG_FILES = ("test_faults.py", "test_daemon.py", "test_benchmarks.py", "test_tune.py", "test_bench_limits.py",
              "test_handover_safety.py", "test_adoption.py", "test_proxy_limits.py")
SHARED_ENGINE = "served"


def rank(item) -> tuple[int, int]:
    if SHARED_ENGINE in getattr(item, "fixturenames", ()):
        return (2, 0)
    name = item.path.name
    return (0, LONG_FILES.index(name)) if name in LONG_FILES else (1, 0)


def spread(items) -> None:
    """The long files first, the shared engine's users last (a stable sort: the rest keep their order)."""
    items.sort(key=rank)


def make_scheduler(config, log):
    """xdist's by-scope scheduler, a scope being a file, taken in the collection's order: no reordering by size."""
    from xdist.scheduler import LoadScopeScheduling

    class ByFile(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return nodeid.split("::", 1)[0]

    config.option.loadscopereorder = False
    return ByFile(config, log)
