"""GPM (gpu/nvml_gpm.py, watch/signals/activity.py): NVML's SM, tensor and DRAM activity read with the counters,
each read paired with the last (the first only primes), nothing but one line at info where a GPU has no GPM, the
simulator's derived and scripted figures, and the families on /metrics."""

import ctypes
import json
import logging

import pytest
from harness.fake_nvml import GPU_IS_LOST, NOT_SUPPORTED, FakeNvml, device
from gpuwarden import config
from gpuwarden.backends import open_configured
from gpuwarden.gpu.base import GPM_FIELDS
from gpuwarden.gpu.nvml import NvmlBackend
from gpuwarden.gpu.nvml_gpm import GPM_METRICS, MIB, NvmlGpm
from gpuwarden.gpu.sim.backend import ManualClock
from gpuwarden.tune.tuning import Tuner, TuningLife
from gpuwarden.watch.monitor import Monitor
from gpuwarden.web.exposition import make_registry
from prometheus_client import generate_latest

# An H200 under a bf16 matmul, as `nvidia-smi dmon --gpm-metrics` read one (issue 41), in NVML's units.
MATMUL = {1: 100.0, 2: 95.0, 3: 40.0, 5: 93.0, 7: 93.0, 10: 16.0, 12: 1.5, 13: 0.0, 20: 12.0, 21: 30.0,
          60: 0.0, 61: 0.0}
FAMILIES = ("gpuwarden_gpu_graphics_engine_active_ratio", "gpuwarden_gpu_sm_active_ratio",
            "gpuwarden_gpu_sm_occupancy_ratio", "gpuwarden_gpu_tensor_active_ratio",
            "gpuwarden_gpu_tensor_hmma_active_ratio", "gpuwarden_gpu_dram_bandwidth_ratio",
            "gpuwarden_gpu_fp32_active_ratio", "gpuwarden_gpu_fp16_active_ratio",
            "gpuwarden_gpu_pcie_tx_bytes_per_second", "gpuwarden_gpu_pcie_rx_bytes_per_second",
            "gpuwarden_gpu_nvlink_tx_bytes_per_second", "gpuwarden_gpu_nvlink_rx_bytes_per_second")


def nvml_gpu(**over):
    fake = FakeNvml([device("GPU-aaa", "00000000:18:00.0", **over)])
    return NvmlBackend(nvml=fake, clock=ManualClock()).gpus()[0], fake


def gpm_of(sample):
    return {field: getattr(sample, field) for field in GPM_FIELDS}


def test_every_gpm_field_has_its_nvml_metric():
    assert sorted(GPM_METRICS) == sorted(GPM_FIELDS)


def test_the_first_read_only_primes_and_each_next_pairs_with_the_last():
    gpu, fake = nvml_gpu(gpm=dict(MATMUL))
    first = gpu.sample(True)
    assert gpm_of(first) == dict.fromkeys(GPM_FIELDS)  # one sample: nothing to pair with yet
    assert fake.calls["nvmlGpmSampleGet"] == 1 and fake.calls["nvmlGpmMetricsGet"] == 0
    second = gpu.sample(True)
    assert second.sm_active_ratio == pytest.approx(0.95)
    assert second.tensor_active_ratio == pytest.approx(0.93)
    assert second.dram_bandwidth_ratio == pytest.approx(0.16)
    assert second.graphics_engine_active_ratio == pytest.approx(1.0)
    assert second.pcie_rx_bytes_per_s == pytest.approx(30 * MIB)
    fake.devices[0]["gpm"].update({2: 0.8, 5: 0.0})  # a sleep kernel now
    third = gpu.sample(True)
    assert third.sm_active_ratio == pytest.approx(0.008) and third.tensor_active_ratio == 0.0
    # each pair is (the last read's sample, this read's), on the one GPU
    assert fake.gpm_pairs == [(0, 1, 2), (0, 2, 3)]
    assert len(fake.gpm_samples) == 2  # two buffers, swapped: none allocated per read, none leaked


def test_gpm_is_read_with_the_counters_not_every_poll():
    gpu, fake = nvml_gpu(gpm=dict(MATMUL))
    gpu.sample(True)
    gpu.sample(True)
    kept = gpu.sample(False)  # a fast poll: the last figures, no NVML call
    assert fake.calls["nvmlGpmSampleGet"] == 2 and fake.calls["nvmlGpmMetricsGet"] == 1
    assert kept.sm_active_ratio == pytest.approx(0.95)


def test_ratios_are_clamped_and_a_metric_the_gpu_lacks_is_none_and_not_asked_again():
    values = {k: v for k, v in MATMUL.items() if k not in (60, 61)}  # a PCIe card: no NVLink
    values[2] = 100.4  # a counter's rounding past 100 %
    gpu, _ = nvml_gpu(gpm=values)
    for _ in range(3):
        s = gpu.sample(True)
    assert s.sm_active_ratio == 1.0
    assert s.nvlink_tx_bytes_per_s is None and s.nvlink_rx_bytes_per_s is None
    assert {60, 61} <= gpu.counters.gpm._dead


@pytest.mark.parametrize("how, said", [
    ("query_says_no", "nvmlGpmQueryDeviceSupport says this GPU does not support it (isSupportedDevice 0)"),
    ("query_not_supported", "nvmlGpmQueryDeviceSupport answered Not Supported"),
    ("sample_not_supported", "the driver answered Not Supported"),
    ("old_nvidia_ml_py", "this nvidia-ml-py has no nvmlGpmQueryDeviceSupport"),
])
def test_unsupported_is_logged_once_at_info_and_gives_no_figures(how, said, caplog):
    gpu, fake = nvml_gpu(gpm=None if how == "query_says_no" else dict(MATMUL))
    if how == "query_not_supported":
        fake.fail[("nvmlGpmQueryDeviceSupport", None)] = NOT_SUPPORTED
    elif how == "sample_not_supported":
        fake.fail[("nvmlGpmSampleGet", None)] = NOT_SUPPORTED
    elif how == "old_nvidia_ml_py":
        fake.nvmlGpmQueryDeviceSupport = None  # as getattr finds it on a module without the call
    caplog.set_level(logging.INFO, logger="gpuwarden")
    samples = [gpu.sample(True) for _ in range(4)]
    assert all(gpm_of(s) == dict.fromkeys(GPM_FIELDS) for s in samples)
    lines = [r for r in caplog.records if "GPM" in r.getMessage()]
    assert len(lines) == 1 and lines[0].levelno == logging.INFO
    assert lines[0].getMessage() == f"GPU0: GPM (SM, tensor and DRAM activity) not read: {said}"
    assert gpu.counters.gpm.unsupported == said
    assert fake.calls["nvmlGpmSampleGet"] <= 1 and fake.calls["nvmlGpmMetricsGet"] == 0
    assert all(s.freed for s in getattr(fake, "gpm_samples", []))  # buffers given back


def test_a_passing_failure_loses_one_interval_and_the_kept_sample_pairs_with_the_next():
    gpu, fake = nvml_gpu(gpm=dict(MATMUL))
    gpu.sample(True)
    fake.fail[("nvmlGpmMetricsGet", None)] = 999
    assert gpu.sample(True).sm_active_ratio is None
    del fake.fail[("nvmlGpmMetricsGet", None)]
    assert gpu.sample(True).sm_active_ratio == pytest.approx(0.95)
    assert fake.gpm_pairs == [(0, 2, 3)]
    assert gpu.counters.gpm.unsupported is None


def test_a_gpu_lost_during_the_gpm_read_is_reported_down():
    gpu, fake = nvml_gpu(gpm=dict(MATMUL))
    gpu.sample(True)
    fake.fail[("nvmlGpmSampleGet", None)] = GPU_IS_LOST
    assert gpu.sample(True).up is False


def test_a_new_handle_after_a_reinit_asks_again_and_primes_again():
    gpu, fake = nvml_gpu(gpm=dict(MATMUL))
    gpu.sample(True)
    gpu.sample(True)
    gpu.handle = fake.nvmlDeviceGetHandleByUUID("GPU-aaa")  # what refind() does after nvmlInit again
    assert gpu.sample(True).sm_active_ratio is None  # primes on the new handle
    assert gpu.sample(True).sm_active_ratio == pytest.approx(0.95)
    assert fake.calls["nvmlGpmQueryDeviceSupport"] == 2


def test_a_nan_or_infinite_answer_is_no_reading():
    gpu, fake = nvml_gpu(gpm={**MATMUL, 2: float("nan"), 5: float("inf")})
    gpu.sample(True)
    sample = gpu.sample(True)
    assert sample.sm_active_ratio is None and sample.tensor_active_ratio is None
    assert sample.dram_bandwidth_ratio == pytest.approx(0.16)


def test_a_finite_rate_that_scales_past_a_float_is_no_reading_not_infinity():
    """NVML's MiB/s times 2^20 overflows a double from 1.7e302 on: the finite check came before the scaling, so such a
    rate was exported as +Inf and written into /status as `Infinity` (not JSON to a strict reader)."""
    from harness.fake_nvml import FakeNvml, device
    from gpuwarden.gpu.nvml import NvmlBackend
    from test_gpm import MATMUL

    fake = FakeNvml([device("GPU-aaa", "00000000:18:00.0", gpm={**MATMUL, 20: 1e308, 21: 1e300})])
    gpu = NvmlBackend(nvml=fake, clock=ManualClock()).gpus()[0]
    gpu.sample(True)
    sample = gpu.sample(True)
    assert sample.pcie_tx_bytes_per_s is None  # before: inf
    assert sample.pcie_rx_bytes_per_s == pytest.approx(1e300 * 2**20)
    assert sample.sm_active_ratio == pytest.approx(0.95)
    json.dumps(sample.as_dict(), allow_nan=False)


def test_closing_the_backend_frees_every_gpm_buffer_before_nvml_shuts_down():
    fake = FakeNvml([device("GPU-aaa", "00000000:18:00.0", gpm=dict(MATMUL)),
                     device("GPU-bbb", "00000000:19:00.0", gpm=dict(MATMUL))])
    backend = NvmlBackend(nvml=fake, clock=ManualClock())
    for _ in range(3):
        for gpu in backend.gpus():
            gpu.sample(True)
    assert len(fake.gpm_samples) == 4 and not any(s.freed for s in fake.gpm_samples)
    backend.close()
    assert all(s.freed for s in fake.gpm_samples)  # two a GPU, each once (the fake fails a second free)
    backend.close()  # a second close frees nothing twice


def test_the_request_fits_pynvml_s_own_structs():
    """gpu/nvml_gpm.py's request against nvidia-ml-py's real ctypes structs (no driver: the call is stubbed)."""
    pynvml = pytest.importorskip("pynvml")
    for name in ("nvmlGpmQueryDeviceSupport", "nvmlGpmSampleAlloc", "nvmlGpmSampleGet", "nvmlGpmMetricsGet",
                 "nvmlGpmSampleFree", "c_nvmlGpmMetricsGet_t", "NVML_GPM_METRICS_GET_VERSION"):
        assert hasattr(pynvml, name), name
    assert pynvml.NVML_GPM_METRIC_SM_UTIL == GPM_METRICS["sm_active_ratio"]
    assert pynvml.NVML_GPM_METRIC_DRAM_BW_UTIL == GPM_METRICS["dram_bandwidth_ratio"]
    assert pynvml.NVML_GPM_METRIC_ANY_TENSOR_UTIL == GPM_METRICS["tensor_active_ratio"]
    assert pynvml.NVML_GPM_METRIC_HMMA_TENSOR_UTIL == GPM_METRICS["tensor_hmma_active_ratio"]
    assert pynvml.NVML_GPM_METRIC_NVLINK_TOTAL_TX_PER_SEC == GPM_METRICS["nvlink_tx_bytes_per_s"]
    seen = {}

    class Stub:
        NVMLError = pynvml.NVMLError
        c_nvmlGpmMetricsGet_t = pynvml.c_nvmlGpmMetricsGet_t
        NVML_GPM_METRICS_GET_VERSION = pynvml.NVML_GPM_METRICS_GET_VERSION

        @staticmethod
        def nvmlGpmMetricsGet(request):
            seen["request"] = (request.version, request.numMetrics, ctypes.addressof(request.sample1.contents))
            for i in range(request.numMetrics):
                request.metrics[i].nvmlReturn = 0
                request.metrics[i].value = float(request.metrics[i].metricId)
            return request

    gpm = NvmlGpm(type("Gpu", (), {"nvml": Stub, "handle": None, "index": 0, "uuid": "GPU-x"})())
    older, newer = pynvml.struct_c_nvmlGpmSample_t(), pynvml.struct_c_nvmlGpmSample_t()
    values = gpm._metrics(pynvml.c_nvmlGpmSample_t(older), pynvml.c_nvmlGpmSample_t(newer))
    assert seen["request"] == (1, len(GPM_METRICS), ctypes.addressof(older))
    assert values["sm_active_ratio"] == pytest.approx(0.02)  # id 2 answered as 2 %
    assert values["nvlink_rx_bytes_per_s"] == 60 * MIB


# -- the simulator ------------------------------------------------------------------------------------------------

def sim(scenario, clock=None):
    cfg = config.parse_text(f"gpu:\n  backend: sim\n  scenario: {scenario}\nmetrics:\n  listen: none\n")
    clock = clock or ManualClock()
    return cfg, clock, open_configured(cfg, clock)


SCRIPTED = """name: gpm-scripted
gpus:
  - name: NVIDIA H100 80GB HBM3
    count: 2
    compute_capability: "9.0"
    memory_clocks_mhz: [2619]
    graphics_clocks_mhz: [345, 1980, 15]
  - name: NVIDIA A100-SXM4-80GB
    compute_capability: "8.0"
    memory_clocks_mhz: [1593]
    graphics_clocks_mhz: [210, 1410, 15]
timeline:
  - {at_s: 0, event: load, utilization_pct: 100}
  - {at_s: 10, until_s: 20, event: gpm, gpus: [1], sm_active_pct: 1, tensor_active_pct: 0, pcie_rx_mib_per_s: 64}
"""


def test_the_simulator_derives_gpm_from_the_load_and_a_gpm_event_scripts_it(tmp_path):
    path = tmp_path / "gpm-scripted.yaml"
    path.write_text(SCRIPTED)
    _, clock, backend = sim(str(path))
    clock.advance(5)
    h100, scripted, a100 = (g.sample() for g in backend.gpus())
    assert h100.sm_active_ratio == pytest.approx(0.9) and h100.graphics_engine_active_ratio == 1.0
    assert scripted.sm_active_ratio == h100.sm_active_ratio
    assert gpm_of(a100) == dict.fromkeys(GPM_FIELDS)  # compute capability 8.0: no GPM
    clock.advance(10)  # 15 s: the event holds GPU1's figures
    h100, scripted, _ = (g.sample() for g in backend.gpus())
    assert scripted.sm_active_ratio == pytest.approx(0.01) and scripted.tensor_active_ratio == 0.0
    assert scripted.pcie_rx_bytes_per_s == 64 * MIB
    assert scripted.graphics_engine_active_ratio == 1.0  # not named: still derived
    assert scripted.utilization_pct == 100  # busy, and idle where it counts: what GPM alone shows
    assert h100.sm_active_ratio == pytest.approx(0.9)
    clock.advance(10)  # 25 s: ended
    assert backend.gpus()[1].sample().sm_active_ratio == pytest.approx(0.9)


def test_not_supported_gpm_in_a_scenario_gives_none(tmp_path):
    path = tmp_path / "no-gpm.yaml"
    path.write_text(SCRIPTED.replace('    count: 2\n', '    count: 2\n    not_supported: [gpm]\n'))
    _, _, backend = sim(str(path))
    assert all(gpm_of(g.sample()) == dict.fromkeys(GPM_FIELDS) for g in backend.gpus())


def test_a_gpm_figure_out_of_range_is_a_scenario_error(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text(SCRIPTED.replace("sm_active_pct: 1", "sm_active_pct: 150"))
    with pytest.raises(Exception, match="sm_active_pct"):
        sim(str(path))


def metrics_page(scenario):
    cfg, clock, backend = sim(scenario)
    clock.advance(30)  # under load by then
    snapshot = Monitor(cfg, backend, TuningLife(backend, cfg, Tuner(backend))).tick(clock.now)
    return generate_latest(make_registry(lambda: snapshot)).decode()


def test_the_families_are_on_the_page_where_gpm_works():
    page = metrics_page("h100-nvswitch")
    for family in FAMILIES:
        assert f"# TYPE {family} gauge" in page
    values = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in page.splitlines()
              if line and not line.startswith("#")}  # compared as numbers: prometheus_client writes them its way
    assert values['gpuwarden_gpu_sm_active_ratio{gpu="0"}'] == pytest.approx(0.855)  # 95 % utilization x 0.9
    assert values['gpuwarden_gpu_nvlink_tx_bytes_per_second{gpu="0"}'] == pytest.approx(2.375e10)


def test_no_series_where_gpm_is_unsupported():
    page = metrics_page("dgx-spark")  # GB10: unconfirmed, so modelled without GPM
    assert not any(f"{family}{{" in page for family in FAMILIES)
