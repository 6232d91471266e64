"""How tests/run spreads the suite over pytest-xdist's workers (`-n 4`).

Most of the suite waits (for a child, a timer, a scrape) rather than computes: the Debian 12 pass used 124 s of CPU
in 249 s on two workers. So four workers on two cores finish sooner without starving anyone.

Each test file stays on one worker, so that a module- or session-scoped fixture is built once. The long poles (the
files that start real vLLM engines, boot nspawn or run the fleet) come first in the collection, so that each
starts at once on a worker of its own while the short files fill the others. The vLLM files make two groups, not
one per file: a CPU vLLM start compiles on both cores for a minute, and each group starts one engine at a time
(the shared engine, conftest.served, lives on the group of the tests that use it).

The scheduler is xdist's own by-scope one with the scope read from LONG_POLES (conftest's
pytest_xdist_make_scheduler), not `--dist loadgroup`: pytest 9 keeps a node's id where xdist 3.8's loadgroup can
no longer append the group to it, and every test then went its own way (three starts of one module's engine).
"""

from __future__ import annotations


# file: its group, in the order the groups start (the longest first)
LONG_POLES = {
    "test_vllm_e2e.py": "vllm-engines", "test_bench.py": "vllm-engines", "test_proxy_vllm.py": "vllm-engines",
    # six engine starts of its own: after the others of its group, never a fifth engine at once beside them (in the
    # nspawn group it loaded the box to 60 and timed-out tests beside it)
    "test_planned_restart_vllm.py": "vllm-engines",
    "test_multinode_vllm.py": "vllm-nodes", "test_prometheus.py": "vllm-nodes",
    "test_recovery_vllm.py": "vllm-nodes",  # one engine start and one restart, one after the other
    "test_fleet_timing.py": "fleet-timing",  # nine minutes of the shipped waits
    "test_systemd_deb.py": "nspawn",
    "test_fleet.py": "fleet",
}
ORDER = list(dict.fromkeys(LONG_POLES.values()))


def group_of(filename: str) -> str:
    return LONG_POLES.get(filename, filename)


def spread(items) -> None:
    """Put the long poles first (a stable sort: the rest keep their order)."""
    items.sort(key=lambda item: ORDER.index(g) if (g := group_of(item.path.name)) in ORDER else len(ORDER))


def make_scheduler(config, log):
    """xdist's by-scope scheduler, a scope being a group of LONG_POLES or else a file, taken in the collection's
    order (the long poles first): no reordering by size."""
    from xdist.scheduler import LoadScopeScheduling

    class ByGroup(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return group_of(nodeid.split("::", 1)[0].rsplit("/", 1)[-1])

    config.option.loadscopereorder = False
    return ByGroup(config, log)
