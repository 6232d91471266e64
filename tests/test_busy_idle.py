"""The "busy but idle" notice (issue 41): kernels run nearly all the time while almost no SM works, for a minute.
Judged on GPM's own figures (the same interval for both), on the readings a real H200 gave for issue 41's loads,
and through the monitor on a simulated card that scripts them."""

import logging

import pytest
from test_gpm import SCRIPTED
from test_monitor import monitor_for, play

from gpuwarden.gpu.base import GpuSample
from gpuwarden.watch.alerts import INFO
from gpuwarden.watch.signals import RULES_BY_NAME
from gpuwarden.watch.signals.activity import BUSY_BUT_IDLE_FOR_S, busy_but_idle

RULE = RULES_BY_NAME["busy_but_idle"]


def reading(util, kernels, sm, tensor=0.0, dram=0.0) -> GpuSample:
    return GpuSample(index=0, uuid="GPU-0", name="H200", pci_bus_id="0", compute_capability="9.0", up=True,
                     timestamp=0.0, utilization_pct=util,
                     graphics_engine_active_ratio=kernels, sm_active_ratio=sm, tensor_active_ratio=tensor,
                     dram_bandwidth_ratio=dram)


# (load, utilization %, GPM graphics-engine activity, SM, tensor, DRAM): issue 41's H200 table
LOADS = [("a sleep kernel", 99.5, 0.995, 0.008, 0.0, 0.0, True),
         ("a bf16 matmul", 100, 1.0, 0.95, 0.93, 0.16, False),
         ("a device-to-device copy", 99.2, 0.99, 0.98, 0.0, 0.87, False),
         ("idle", 0, 0.0, 0.0, 0.0, 0.0, False),
         ("a bursty engine: a busy instant, an idle interval's mean", 100, 0.3, 0.02, 0.01, 0.05, False),
         ("decode of a small model at batch 1", 100, 0.97, 0.22, 0.05, 0.35, False)]


@pytest.mark.parametrize("load,util,kernels,sm,tensor,dram,fires", LOADS, ids=[load[0] for load in LOADS])
def test_the_notice_reads_gpm_figures_of_one_interval(load, util, kernels, sm, tensor, dram, fires):
    check = busy_but_idle(reading(util, kernels, sm, tensor, dram), None)
    assert check.active is fires, load
    if fires:
        assert "SM active 0.8%" in check.observed and "kernels active 100%" in check.observed


def test_no_gpm_no_notice():
    assert not busy_but_idle(reading(100, None, None), None).active  # before Hopper, or the driver said no
    assert RULE.severity == INFO and RULE.for_s == BUSY_BUT_IDLE_FOR_S == 60


SLEEP_THEN_WORK = SCRIPTED.replace("name: gpm-scripted", "name: busy-idle").split("timeline:")[0] + """timeline:
  - {at_s: 0, event: load, utilization_pct: 99}
  - {at_s: 0, until_s: 100, event: gpm, gpus: [1], sm_active_pct: 1, tensor_active_pct: 0, dram_bandwidth_pct: 0}
  - {at_s: 120, until_s: 160, event: gpm, gpus: [0], sm_active_pct: 2, tensor_active_pct: 0}
"""


def test_a_sleeping_gpu_gets_the_notice_after_a_minute_and_the_working_ones_none(tmp_path, caplog):
    path = tmp_path / "busy-idle.yaml"
    path.write_text(SLEEP_THEN_WORK)
    monitor, clock = monitor_for(str(path))
    with caplog.at_level(logging.INFO, logger="gpuwarden"):
        events = [e for e in play(monitor, clock, 200) if e[2] == "busy_but_idle"]
    # GPU1 sleeps 100 s: fires a minute in, resolves once it works (clear_for_s 2); GPU0's 40 s pause is a pause;
    # GPU2, the A100, has no GPM; GPU0's derived load (SM 90 %) never.
    assert [(gpu, what) for _, gpu, _, what in events] == [(1, "firing"), (1, "resolved")], events
    assert events[0][0] == pytest.approx(BUSY_BUT_IDLE_FOR_S, abs=1)
    (line,) = [r for r in caplog.records if "busy_but_idle firing" in r.getMessage()]
    assert logging.INFO <= line.levelno < logging.WARNING  # a notice, not a warning
    assert "SM active 1.0%" in line.getMessage() and "CPU-bound" in line.getMessage()
