"""How tests/run spreads the suite over pytest-xdist's workers (`-n 4 --dist loadgroup --no-loadscope-reorder`).

Most of the suite waits (for a child, a timer, a scrape) rather than computes: the Debian 12 pass used 124 s of CPU
in 249 s on two workers. So four workers on two cores finish sooner without starving anyone.

Each test file stays on one worker, so that a module- or session-scoped fixture is built once. The long poles (the
files that start real vLLM engines, boot nspawn or run the fleet) come first in the collection, so that each
starts at once on a worker of its own while the short files fill the others. The vLLM files make two groups, not
one per file: a CPU vLLM start compiles on both cores for a minute, and each group starts one engine at a time
(the shared engine, conftest.served, lives on the group of the tests that use it).
"""

from __future__ import annotations

import pytest

# file: its group, in the order the groups start (the longest first)
LONG_POLES = {
    "test_vllm_e2e.py": "vllm-engines", "test_bench.py": "vllm-engines", "test_proxy_vllm.py": "vllm-engines",
    "test_multinode_vllm.py": "vllm-nodes", "test_prometheus.py": "vllm-nodes",
    "test_systemd_deb.py": "nspawn",
    "test_fleet.py": "fleet",
    "test_fleet_timing.py": "fleet-timing",
}
ORDER = list(dict.fromkeys(LONG_POLES.values()))


def group_of(filename: str) -> str:
    return LONG_POLES.get(filename, filename)


def spread(items) -> None:
    """Mark each test with its group and put the long poles first (a stable sort: the rest keep their order)."""
    for item in items:
        item.add_marker(pytest.mark.xdist_group(group_of(item.path.name)))
    items.sort(key=lambda item: ORDER.index(g) if (g := group_of(item.path.name)) in ORDER else len(ORDER))
