"""Issue 43's last done-when through real processes: the busy card's served tok/s through the fake OpenAI server
under tuning.power_budget_w 800 against a static 400/400 split (benchmarks/power_budget.py --through-server), and
the simulator channel's per-GPU load (load.json's "gpus") that lets the fake server busy one card alone."""

from __future__ import annotations

import importlib.util
import json

import pytest
from conftest import ROOT
from gpuwarden.gpu.sim import power
from gpuwarden.gpu.sim.backend import ManualClock, SimBackend
from gpuwarden.gpu.sim.scenario import load_scenario, resolve_scenario


def _bench():
    spec = importlib.util.spec_from_file_location("power_budget_bench", ROOT / "benchmarks" / "power_budget.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# -- the channel: load.json's "gpus" ---------------------------------------------------------------------------

@pytest.mark.parametrize("gpus, expected", [
    (None, None),  # absent: every card, as before the key
    ([1], frozenset({1})),
    ([], frozenset()),
    ([0, "1", True, 1.0, -1, 64, 10**400, None, [0], 3], frozenset({0, 3})),  # what is no index is left out
    ("0", None), ({"0": 1}, None),  # not a list: the key is not read
    ([70] * 64 + [1], frozenset()),  # entries past the bound are not read
])
def test_load_names_the_servers_cards(tmp_path, gpus, expected):
    data = {"open": 1, "at": 0}
    if gpus is not None:
        data["gpus"] = gpus
    (tmp_path / "load.json").write_text(json.dumps(data))
    load = power.read_load(tmp_path)
    assert load.busy and load.gpus == expected
    assert [load.serves(i) for i in range(4)] == [expected is None or i in expected for i in range(4)]


def test_write_load_round_trips_the_cards(tmp_path):
    power.write_load(tmp_path, 2, 0.5, [1])
    assert power.read_load(tmp_path) == power.Load(True, 0.5, frozenset({1}))
    power.write_load(tmp_path, 0)
    assert power.read_load(tmp_path).gpus is None


def test_only_the_named_card_is_busy(tmp_path, monkeypatch):
    monkeypatch.setenv(power.ENV, str(tmp_path))
    power.write_load(tmp_path, 3, 0.9, [1])
    backend = SimBackend(load_scenario(resolve_scenario("rtx-pro-6000-server-x2")), clock=ManualClock())
    idle, busy = (g.sample() for g in backend.gpus())
    assert busy.utilization_pct == 100 and idle.utilization_pct == 0  # the scenario had GPU 0 busy
    assert [g.prefill_share for g in backend.gpus()] == [None, 0.9]
    power.write_load(tmp_path, 3, 0.9)  # without the key, every card is the server's
    assert [g.sample().utilization_pct for g in backend.gpus()] == [100, 100]


# -- the done-when, through real processes ---------------------------------------------------------------------

@pytest.mark.process
def test_budget_serves_the_busy_card_faster_than_a_static_split(tmp_path):
    """The daemon (gpuwarden run) on rtx-pro-6000-server-x2 with an 800 W budget, then with 400 W on both cards;
    the fake server on GPU 0 alone, a prefill-heavy workload for 4 s each. The fake server's speed is modelled (it
    sleeps each prompt token's time over the card's published prefill speed), not the host's CPU: the model gives
    x1.456 (600 W over 400 W), measured x1.40-1.43 (RESULTS.md 21b); a busy box adds the same client-side gap to
    every request both ways, which only lowers the ratio towards 1, and it would take a gap above 0.5 s a request
    (~0.43 s at 600 W, ~0.62 s at 400 W) to bring it under 1.2."""
    bench = _bench()
    budget = bench.through_server(tmp_path / "budget", "budget", 4, 8, shapes=("prefill",))
    static = bench.through_server(tmp_path / "static", "static", 4, 8, shapes=("prefill",))
    assert budget["limits"] == [600, 150] and static["limits"] == [400, 400]
    ratio = budget["prefill"]["tok_s"] / static["prefill"]["tok_s"]
    assert ratio > 1.2, (ratio, budget, static)
    # the enforced sum never passed the budget: the daemon's /status (read through the run), the simulator's own
    # limits (at every set), the daemon's /metrics at the end
    assert budget["budget_seen"] and budget["status_reads"] > 10
    assert budget["status_max"] <= 800 and budget["sim_max"] <= 800 and budget["metrics_max"] <= 800, budget
    assert budget["status_max"] == budget["sim_max"] == 750  # 600 + 150: the idle card holds its minimum
