"""The memory temperature signal, end to end: NVML's MEMORY_TEMP field (82) read with the counters, the
simulator's reading (HBM cards only, as NVML), and its gauge on /metrics (watch/signals/thermal.py)."""

import pytest

from harness.fake_nvml import FakeNvml, device
from prometheus_client import generate_latest

from gpuwarden import config
from gpuwarden.backends import open_configured
from gpuwarden.gpu.nvml import NvmlBackend
from gpuwarden.gpu.sim.backend import MEMORY_ABOVE_DIE_C, ManualClock
from gpuwarden.tune.tuning import Tuner, TuningLife
from gpuwarden.watch.monitor import Monitor
from gpuwarden.web.exposition import make_registry


def nvml_gpu(**over):
    fake = FakeNvml([device("GPU-aaa", "00000000:18:00.0", **over)])
    return NvmlBackend(nvml=fake, clock=ManualClock()).gpus()[0], fake


def test_nvml_reads_the_memory_sensor_in_the_counters_batch():
    gpu, fake = nvml_gpu(mem_temp=67)
    assert gpu.sample(True).memory_temperature_c == 67
    assert fake.calls["field 82"] == 1  # with the counters, in their one batched call
    gpu.sample(False)
    assert fake.calls["field 82"] == 1  # not every poll


def test_a_card_without_the_sensor_reports_none_and_is_not_asked_again():
    gpu, fake = nvml_gpu()
    assert gpu.sample(True).memory_temperature_c is None
    gpu.sample(True)
    assert fake.calls["field 82"] == 1


def test_the_gauge_is_on_the_page_for_the_gpus_that_have_it():
    cfg = config.parse_text("gpu:\n  backend: sim\n  scenario: h100-nvswitch\nmetrics:\n  listen: none\n")
    clock = ManualClock()
    backend = open_configured(cfg, clock)
    monitor = Monitor(cfg, backend, TuningLife(backend, cfg, Tuner(backend)))
    snapshot = monitor.tick(clock.now)
    die = snapshot.gpus[0].sample.temperature_c
    text = generate_latest(make_registry(lambda: snapshot)).decode()
    assert "# TYPE gpuwarden_gpu_memory_temperature_celsius gauge" in text
    assert f'gpuwarden_gpu_memory_temperature_celsius{{gpu="0"}} {float(die + MEMORY_ABOVE_DIE_C)}' in text


@pytest.mark.parametrize("scenario, hbm", [("h100-nvswitch", True), ("rtx-pro-4000-headless", False),
                                           ("rtx-pro-6000-tp4", False), ("dgx-spark", False)])
def test_the_simulator_has_the_sensor_on_hbm_cards_only(scenario, hbm):
    # NVML_FI_DEV_MEMORY_TEMP is HBM's own sensor: GDDR cards and DGX Spark's unified LPDDR report none
    cfg = config.parse_text(f"gpu:\n  backend: sim\n  scenario: {scenario}\nmetrics:\n  listen: none\n")
    clock = ManualClock()
    backend = open_configured(cfg, clock)
    snapshot = Monitor(cfg, backend, TuningLife(backend, cfg, Tuner(backend))).tick(clock.now)
    readings = [view.sample.memory_temperature_c for view in snapshot.gpus]
    assert readings == ([v.sample.temperature_c + MEMORY_ABOVE_DIE_C for v in snapshot.gpus] if hbm
                        else [None] * len(readings))
    text = generate_latest(make_registry(lambda: snapshot)).decode()
    assert "# TYPE gpuwarden_gpu_memory_temperature_celsius gauge" in text  # the family stays, HELP and all
    assert ("gpuwarden_gpu_memory_temperature_celsius{" in text) == hbm
