"""bench's GPM activity and the bound it names (bench/bound.py, report.py), and the simulator's side of it: the
served workload's prefill share on the channel (gpu/sim/power.py) and the GPM figures mixed by it (gpu/sim/gpm.py).
The sweeps that run them end to end are in test_bench.py."""

import json

import pytest

from gpuwarden import config
from gpuwarden.backends import open_configured
from gpuwarden.bench.bound import (COMPUTE_SM_MIN, COMPUTE_TENSOR_MIN, HOST_SM_MAX, MEMORY_DRAM_MIN, NOT_REPORTED,
                                   bound, describe, step_activity)
from gpuwarden.bench.report import render_markdown, render_table, roofline_line
from gpuwarden.gpu.sim import gpm, power
from gpuwarden.gpu.sim.backend import ManualClock

EPS = 1e-9


# -- the bound ---------------------------------------------------------------------------------------------------

def test_issue_41s_h200_readings_name_their_bounds():
    assert bound(sm=0.95, tensor=0.93, dram=0.16) == "compute"  # a bf16 matmul
    assert bound(sm=0.98, tensor=0.0, dram=0.87) == "memory"  # a device-to-device copy
    assert bound(sm=0.008, tensor=0.0, dram=0.0) == "host"  # a sleep kernel at 99.5 % utilization


def test_the_bounds_edges():
    # memory: DRAM at its threshold and above the tensor cores; just below it, not memory
    assert bound(0.6, 0.2, MEMORY_DRAM_MIN) == "memory"
    assert bound(0.6, 0.2, MEMORY_DRAM_MIN - EPS) == "mixed"
    # DRAM high but no busier than the tensor cores: compute (both near full: the tensor cores are the limit)
    assert bound(0.9, 0.85, 0.85) == "compute" and bound(0.9, 0.85 - EPS, 0.85) == "memory"
    # compute: tensor at its threshold, or the SMs at theirs, with DRAM low
    assert bound(0.6, COMPUTE_TENSOR_MIN, 0.3) == "compute"
    assert bound(0.6, COMPUTE_TENSOR_MIN - EPS, 0.3) == "mixed"
    assert bound(COMPUTE_SM_MIN, 0.0, 0.3) == "compute" and bound(COMPUTE_SM_MIN - EPS, 0.0, 0.3) == "mixed"
    # host: the SMs below their threshold, nothing else high
    assert bound(HOST_SM_MAX - EPS, 0.1, 0.1) == "host" and bound(HOST_SM_MAX, 0.1, 0.1) == "mixed"
    # the SMs low but DRAM at its threshold still reads memory (checked first)
    assert bound(0.1, 0.0, MEMORY_DRAM_MIN) == "memory"


def gpu(index, sm, tensor, dram, utilization=100.0):
    return {"index": index, "utilization_pct_mean": utilization, "sm_active_ratio_mean": sm,
            "tensor_active_ratio_mean": tensor, "dram_bandwidth_ratio_mean": dram}


def test_a_step_is_judged_by_the_gpus_that_served_it():
    # GPU 1 idled through the step (another engine's, or a spare): left out, not averaged in
    a = step_activity([gpu(0, 0.6, 0.2, 0.8), gpu(1, 0.0, 0.0, 0.0, utilization=0.0)], ok_requests=4)
    assert a["gpus"] == [0] and a["bound"] == "memory" and a["dram_bandwidth"] == 0.8
    # two tensor-parallel GPUs: their means
    a = step_activity([gpu(0, 0.9, 0.8, 0.3), gpu(1, 1.0, 0.9, 0.2)], ok_requests=4)
    assert a["gpus"] == [0, 1] and a["tensor_active"] == pytest.approx(0.85) and a["bound"] == "compute"
    # requests ran and every GPU idled: the host held them
    a = step_activity([gpu(0, 0.0, 0.0, 0.0, utilization=0.0)], ok_requests=4)
    assert a["bound"] == "host" and a["gpus"] == [0]
    # no request completed: the figures, but no bound
    a = step_activity([gpu(0, 0.6, 0.2, 0.8)], ok_requests=0)
    assert a["bound"] is None and a["sm_active"] == 0.6 and a["why"] == "no request of the step completed"


def test_no_gpm_is_said_not_guessed():
    no_gpm = {"index": 0, "utilization_pct_mean": 100.0, "sm_active_ratio_mean": None,
              "tensor_active_ratio_mean": None, "dram_bandwidth_ratio_mean": None}
    for gpus in ([no_gpm], [{"index": 0, "utilization_pct_mean": 100.0}]):  # None, or an older daemon's /status
        a = step_activity(gpus, ok_requests=4)
        assert a["bound"] is None and a["sm_active"] is None and a["why"] == NOT_REPORTED
    assert step_activity([], ok_requests=4)["why"] == "no GPU was read during the step"
    assert describe(step_activity([no_gpm], 4)) == "not measured (no GPM figures)"
    assert describe(step_activity([gpu(0, 0.6, 0.2, 0.8)], 0)) == "not measured (no request of the step completed)"


# -- the report ----------------------------------------------------------------------------------------------------

def step(concurrency, activity):
    return {"concurrency": concurrency, "interrupted": False, "ok": 8, "requests": 8, "cut": 0, "errors": 0,
            "system_tokens_per_s": 100.0, "per_request_tokens_per_s_mean": 50.0, "per_request_tokens_per_s_p50": 50.0,
            "ttft_p50_s": 0.01, "ttft_p99_s": 0.02, "itl_p50_s": 0.01, "itl_p99_s": 0.02, "gpus": [], "engine": {},
            "activity": activity}


def result(*steps):
    return {"model": "m", "url": "http://x", "api": "completions", "input_len": 16, "output_len": 48,
            "gpu_source": "the sim backend", "steps": list(steps),
            "roofline": {"known": False, "why": "no model", "measured_bound": steps[0]["activity"]}}


def test_the_table_and_the_markdown_show_the_activity_and_the_bound():
    r = result(step(1, step_activity([gpu(0, 0.603, 0.21, 0.796)], 8)),
               step(4, step_activity([gpu(0, 0.0, 0.0, 0.0, utilization=0.0)], 8)))
    table = render_table(r).splitlines()
    assert table[2].split()[12:16] == ["60", "21", "80", "memory"]  # percent, rounded
    assert table[3].split()[12:16] == ["0", "0", "0", "host"]
    assert table[4] == ("roofline: unknown (no model); measured at C=1: memory-bound (SM 60%, tensor 21%, DRAM 80%)")
    md = render_markdown(r)
    assert "| SM MHz min/mean | mem MHz | SM act% | tensor% | DRAM bw% | bound | W/GPU / limit |" in md
    assert "| - | - | 60 | 21 | 80 | memory | - |" in md and "| - | - | 0 | 0 | 0 | host | - |" in md
    assert "measured at C=1: memory-bound" in md
    assert json.loads(json.dumps(r))["steps"][0]["activity"]["bound"] == "memory"  # --json is the result as is


def test_without_gpm_a_dash_and_the_reason_once():
    none = step_activity([{"index": 0, "utilization_pct_mean": 100.0}], 8)
    r = result(step(1, none), step(2, none))
    table = render_table(r).splitlines()
    assert table[2].split()[12:16] == table[3].split()[12:16] == ["-", "-", "-", "-"]
    assert table[4] == "roofline: unknown (no model); measured at C=1: not measured (no GPM figures)"
    assert [l for l in table if NOT_REPORTED in l] == [
        f"! SM, tensor and DRAM activity and the bound not reported: {NOT_REPORTED}"]
    md = render_markdown(r)
    assert md.count(f"- SM, tensor and DRAM activity and the bound not reported: {NOT_REPORTED}") == 1


def test_the_roofline_line_names_the_measured_bound_beside_the_ceiling():
    r = {"known": True, "bandwidth_bytes_per_s": 3.35e12, "tp": 1, "weight_bytes": 16e9, "kv_bytes_per_token": None,
         "kv_note": "no config.json", "context_tokens": 40, "ceiling_tokens_per_s": 209.4,
         "measured_tokens_per_s": 150.0, "efficiency": 150.0 / 209.4,
         "measured_bound": step_activity([gpu(0, 0.1, 0.02, 0.15)], 8)}
    line = roofline_line(r)
    assert line.startswith("roofline (C=1): 3.350 TB/s over 1 GPU(s) / (16.000 GB of weights") and "72% of the" in line
    assert line.endswith("; measured at C=1: host-bound (SM 10%, tensor 2%, DRAM 15%: the GPU waits on the CPU or "
                         "the network)")
    del r["measured_bound"]  # a run saved before bench measured the bound: the ceiling alone
    assert roofline_line(r).endswith("of the ceiling")


# -- the simulator: the workload's prefill share -------------------------------------------------------------------

def h100_backend():
    cfg = config.parse_text("gpu:\n  backend: sim\n  scenario: h100-nvswitch\nmetrics:\n  listen: none\n")
    return open_configured(cfg, ManualClock())


H100 = h100_backend().gpus()[0].model


def activity_of(figures):
    return figures["sm_active_ratio"], figures["tensor_active_ratio"], figures["dram_bandwidth_ratio"]


def test_decode_is_memory_bound_prefill_compute_bound_and_a_share_mixes_them():
    assert activity_of(gpm.figures(H100, 100, 0, None, prefill_share=0.0)) == gpm.DECODE
    assert activity_of(gpm.figures(H100, 100, 0, None, prefill_share=1.0)) == gpm.PREFILL
    assert bound(*gpm.DECODE) == "memory" and bound(*gpm.PREFILL) == "compute"
    half = gpm.figures(H100, 50, 0, None, prefill_share=0.5)  # half busy, half of that prefill
    assert activity_of(half) == pytest.approx((0.3875, 0.2625, 0.275))
    assert half["tensor_hmma_active_ratio"] == half["tensor_active_ratio"]
    assert half["graphics_engine_active_ratio"] == 0.5
    # no share: today's derivation from the load alone
    assert activity_of(gpm.figures(H100, 100, 0, None)) == (0.9, 0.54, 0.5)
    # a scripted gpm event still wins over the share
    assert gpm.figures(H100, 100, 0, {"tensor_active_pct": 3}, prefill_share=1.0)["tensor_active_ratio"] == 0.03
    idle = gpm.figures(H100, 0, 0, None, prefill_share=1.0)
    assert activity_of(idle) == (0.0, 0.0, 0.0)


def test_the_channel_carries_the_share_and_ignores_a_malformed_one(tmp_path):
    power.write_load(tmp_path, 2, prefill_share=0.25)
    assert power.read_load(tmp_path) == power.Load(busy=True, prefill_share=0.25)
    power.write_load(tmp_path, 2)
    assert power.read_load(tmp_path) == power.Load(busy=True, prefill_share=None)
    for bad in ('"0.5"', "1.5", "-0.1", "true", "NaN", "[0.5]", "null"):
        (tmp_path / "load.json").write_text(f'{{"open": 1, "at": 0, "prefill_share": {bad}}}')
        assert power.read_load(tmp_path) == power.Load(busy=True, prefill_share=None), bad
    # the file's size bound holds with the new key: a padded file is not read at all
    (tmp_path / "load.json").write_text('{"open": 1, "prefill_share": 0.5, "pad": "' + "x" * power.MAX_FILE_BYTES
                                        + '"}')
    assert power.read_load(tmp_path) is None and power.busy(tmp_path) is None


def test_the_simulated_card_reads_the_share_from_the_channel(tmp_path, monkeypatch):
    monkeypatch.setenv(power.ENV, str(tmp_path))
    card = h100_backend().gpus()[0]
    power.write_load(tmp_path, 3, prefill_share=0.0)
    decode = card.sample()
    assert decode.utilization_pct == 100.0 and bound(*activity_of(decode.as_dict())) == "memory"
    power.write_load(tmp_path, 3, prefill_share=1.0)
    prefill = card.sample()
    assert (prefill.sm_active_ratio, prefill.tensor_active_ratio, prefill.dram_bandwidth_ratio) == gpm.PREFILL
    power.write_load(tmp_path, 3)  # a server that says no share: the load alone, as before
    assert card.sample().sm_active_ratio == 0.9
