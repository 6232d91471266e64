"""GPM where people look (issue 41 item 2): `gpuwarden status`'s ACTIVITY column, doctor's line per GPU, and the
dashboard's row "What the GPU is doing (GPM)". The reading itself is tests/test_gpm.py's."""

import json
import re

import pytest
from conftest import DEFAULT_CONFIG, ROOT
from harness.fake_nvml import NOT_SUPPORTED, FakeNvml, device
from test_gpm import MATMUL, SCRIPTED, metrics_page, sim
from gpuwarden import config
from gpuwarden.gpu.nvml import NvmlBackend
from gpuwarden.gpu.sim.backend import ManualClock
from gpuwarden.tune.tuning import Tuner, TuningLife
from gpuwarden.watch.doctor import diagnose
from gpuwarden.watch.monitor import Monitor
from gpuwarden.web.status import render_status

DASHBOARD = ROOT / "etc" / "grafana" / "gpuwarden-dashboard.json"
# Issue 41's sleep kernel on GPU1 of test_gpm's two H100s, scripted; its A100 beside them (compute capability 8.0:
# no GPM).
SLEEPING = SCRIPTED.replace("name: gpm-scripted", "name: gpm-sleeping").split("timeline:")[0] + """timeline:
  - {at_s: 0, event: load, utilization_pct: 99}
  - {at_s: 0, event: gpm, gpus: [1], sm_active_pct: 1, tensor_active_pct: 0, dram_bandwidth_pct: 0}
"""


def status_table(scenario):
    """`gpuwarden status`'s text, from the daemon's own /status JSON for this scenario after 30 s."""
    cfg, clock, backend = sim(scenario)
    clock.advance(30)
    snapshot = Monitor(cfg, backend, TuningLife(backend, cfg, Tuner(backend))).tick(clock.now)
    state = json.loads(json.dumps({"daemon": {"version": "test", "pid": 1}, **snapshot.as_dict()}))
    return render_status(state)


def cells(table, column):
    """{GPU index: the text under column} of the status table (columns are padded to their widest cell)."""
    lines = table.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("GPU  "))
    names = re.findall(r"\S+(?: MHz)?", lines[header])
    starts = [lines[header].index(name) for name in names]
    at = names.index(column)
    end = starts[at + 1] if at + 1 < len(starts) else None
    out = {}
    for line in lines[header + 1:]:
        if not line.strip():
            break
        out[int(line.split()[0])] = line[starts[at]:end].strip()
    return out


def test_status_shows_sm_tensor_and_dram_beside_utilization(tmp_path):
    path = tmp_path / "gpm-sleeping.yaml"
    path.write_text(SLEEPING)
    table = status_table(str(path))
    util, activity = cells(table, "UTIL"), cells(table, "ACTIVITY")
    assert util == {0: "99%", 1: "99%", 2: "99%"}
    assert activity[1] == "SM 1% · tensor 0% · DRAM 0%"  # busy by utilization, idle where it counts
    assert re.fullmatch(r"SM \d+% · tensor \d+% · DRAM \d+%", activity[0])  # derived from the load
    assert activity[2] == "-"  # the A100: no GPM


def test_status_leaves_the_figures_out_on_a_card_without_gpm():
    table = status_table("dgx-spark")
    assert cells(table, "ACTIVITY") == {0: "-"}
    assert cells(table, "UTIL") == {0: "70%"}
    assert not re.search(r"\b(SM|tensor|DRAM) \d+%", table)


def test_status_renders_a_down_gpu_and_an_older_daemon_without_the_fields():
    state = {"daemon": {}, "gpus": [
        {"index": 0, "name": "H100", "up": False, "error": "GPU 0 is lost"},
        {"index": 1, "name": "H100", "utilization_pct": 50.0},  # a daemon from before GPM: no such keys
        {"index": 2, "name": "H100", "utilization_pct": 50.0, "sm_active_ratio": 0.5, "tensor_active_ratio": None,
         "dram_bandwidth_ratio": 0.25}]}
    table = render_status(state)
    assert cells(table, "ACTIVITY") == {0: "", 1: "-", 2: "SM 50% · DRAM 25%"}  # a missing figure left out
    assert cells(table, "REASONS")[0] == "GPU 0 is lost"


# -- doctor ---------------------------------------------------------------------------------------------------

def nvml_doctor(*gpm, before=0, fail=None):
    """doctor's findings by check on fake NVML H100s, one per gpm entry (None: the support query says no), with
    the fake; before: samples with the counters the GPUs took first (a daemon's earlier reads); fail: a call
    the driver answers NOT_SUPPORTED."""
    fake = FakeNvml([device(f"GPU-{i}", f"00000000:{0x18 + i:02x}:00.0", gpm=g) for i, g in enumerate(gpm)])
    if fail:
        fake.fail[(fail, None)] = NOT_SUPPORTED
    backend = NvmlBackend(nvml=fake, clock=ManualClock())
    for gpu in backend.gpus():
        for _ in range(before):
            gpu.sample(True)
    findings = {f.check: f for f in diagnose(config.parse_text("tuning:\n  apply: false\n"), backend, deep=False)}
    return findings, fake


def test_doctor_says_gpm_works_from_its_one_sample_and_reads_it_once_a_gpu():
    findings, fake = nvml_doctor(dict(MATMUL), dict(MATMUL))
    for index in (0, 1):
        line = findings[f"GPU{index} GPM"]
        assert line.severity == "ok" and line.message.startswith("works (a first sample read; ")
    assert fake.calls["nvmlGpmSampleGet"] == 2  # one per GPU: doctor's own sample primed it, nothing more
    assert fake.calls["nvmlGpmMetricsGet"] == 0
    assert fake.calls["nvmlGpmQueryDeviceSupport"] == 2


def test_doctor_shows_what_gpm_read_where_a_pair_was_read():
    findings, fake = nvml_doctor(dict(MATMUL), before=2)
    line = findings["GPU0 GPM"]
    assert (line.severity, line.message) == ("ok", "SM 95% · tensor 93% · DRAM 16% at util 97%")
    assert fake.calls["nvmlGpmSampleGet"] == 2  # the two reads before; doctor's sample kept their figures


@pytest.mark.parametrize("how, said", [
    ("driver", "the driver answered Not Supported"),
    ("query", "nvmlGpmQueryDeviceSupport says this GPU does not support it (isSupportedDevice 0)"),
])
def test_doctor_gives_the_drivers_answer_where_gpm_does_not_work(how, said):
    if how == "driver":  # a GPU the support query accepts, whose sample the driver refuses
        findings, _ = nvml_doctor(dict(MATMUL), fail="nvmlGpmSampleGet")
    else:  # a card before Hopper
        findings, _ = nvml_doctor(None)
    line = findings["GPU0 GPM"]
    assert (line.severity, line.message) == ("info", f"SM, tensor and DRAM activity not read: {said}")
    assert str(line) == f"INFO    GPU0 GPM: SM, tensor and DRAM activity not read: {said}"


def test_doctor_on_the_simulator_follows_the_scenario(cli, tmp_path):
    status, out, _ = cli("doctor", "--json", "-c", DEFAULT_CONFIG, "--sim", "dgx-spark")
    line = {f["check"]: f for f in json.loads(out)["findings"]}["GPU0 GPM"]
    assert line["severity"] == "info" and status == 1  # information: the exit status stays the persistence warning's
    assert line["message"] == "SM, tensor and DRAM activity not read: scenario dgx-spark models this NVIDIA GB10 " \
        "without it (gpm in its not_supported)"
    path = tmp_path / "gpm-sleeping.yaml"
    path.write_text(SLEEPING)
    status, out, _ = cli("doctor", "-c", DEFAULT_CONFIG, "--sim", str(path))
    assert "OK      GPU1 GPM: SM 1% · tensor 0% · DRAM 0% at util 99%" in out.splitlines()
    assert "INFO    GPU2 GPM: SM, tensor and DRAM activity not read: scenario gpm-sleeping models this " \
        "NVIDIA A100-SXM4-80GB without it (compute capability 8.0, before Hopper)" in out.splitlines()


# -- the dashboard ------------------------------------------------------------------------------------------------

def gpm_row():
    """The panels of the dashboard's GPM row: those after its row panel, up to the next row."""
    panels = json.loads(DASHBOARD.read_text())["panels"]
    start = next(i for i, p in enumerate(panels) if p["type"] == "row" and p["title"] == "What the GPU is doing (GPM)")
    end = next((i for i, p in enumerate(panels) if i > start and p["type"] == "row"), len(panels))
    return panels[start + 1:end]


def test_the_dashboard_has_a_gpm_row_of_exported_metrics():
    row = gpm_row()
    exprs = [t["expr"] for p in row for t in p["targets"]]
    names = set(re.findall(r"\bgpuwarden_[a-z0-9_]+", " ".join(exprs)))
    assert {"gpuwarden_gpu_sm_active_ratio", "gpuwarden_gpu_sm_occupancy_ratio", "gpuwarden_gpu_tensor_active_ratio",
            "gpuwarden_gpu_dram_bandwidth_ratio", "gpuwarden_gpu_pcie_tx_bytes_per_second",
            "gpuwarden_gpu_pcie_rx_bytes_per_second", "gpuwarden_gpu_nvlink_tx_bytes_per_second",
            "gpuwarden_gpu_nvlink_rx_bytes_per_second"} <= names
    page = metrics_page("h100-nvswitch")  # GPM and NVLink: every series the row reads is on the page
    for name in names:
        assert re.search(rf'^{name}{{gpu="0"}} ', page, re.MULTILINE), f"the dashboard reads {name}: not exported"
    for expr in exprs:
        assert 'instance=~"$instance",gpu=~"$gpu"' in expr, expr
    for panel in row:  # ratios as percent, 0-100; traffic in bytes per second
        ratio = any("_ratio" in t["expr"] for t in panel["targets"])
        assert panel["fieldConfig"]["defaults"]["unit"] == ("percent" if ratio else "Bps"), panel["title"]
        if ratio:
            assert all(t["expr"].startswith("100 * ") for t in panel["targets"]), panel["title"]


def test_the_dashboard_panels_do_not_overlap_and_have_their_own_ids():
    panels = json.loads(DASHBOARD.read_text())["panels"]
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids))
    cells_taken = {}
    for p in panels:
        g = p["gridPos"]
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells_taken, f"{p['title']} overlaps {cells_taken[(x, y)]}"
                cells_taken[(x, y)] = p["title"]
