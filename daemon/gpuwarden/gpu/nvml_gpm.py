"""GPM, NVML's GPU Performance Monitoring (Hopper and newer): how much of the GPU worked, not only whether some
kernel ran. "Utilization" reads 99.5 % for a kernel that sleeps on one SM; GPM's SM activity reads 0.8 % (a
lent H200, driver 580.159.04, nvidia-ml-py 13.615).

NVML's calls, as nvidia-ml-py (module pynvml) spells them:
  nvmlGpmQueryDeviceSupport(handle) -> c_nvmlGpmSupport_t (.isSupportedDevice)
  nvmlGpmSampleAlloc() -> c_nvmlGpmSample_t; nvmlGpmSampleGet(handle, sample); nvmlGpmSampleFree(sample)
  nvmlGpmMetricsGet(c_nvmlGpmMetricsGet_t): version NVML_GPM_METRICS_GET_VERSION, numMetrics, sample1 (the
      older), sample2, and metrics[i].metricId in; metrics[i].nvmlReturn and .value (a double) out.
A metric is the rate or share between two samples, so one sample is kept per GPU and each read pairs with the
last: the first read only primes. On that H200 a sample cost 0.23-0.35 ms and nvmlGpmMetricsGet for 8 metrics
1-4 ms, too much for every poll of an 8-GPU host: NvmlCounters reads this with the counters, every
counters_interval_s, and each figure is then the mean over that interval.

Where GPM is unsupported (the support query says no, an nvidia-ml-py without the calls, or the driver answers
NOT_SUPPORTED) the driver's answer is logged once at info, kept in `unsupported` (for doctor), and the sample's
GPM fields stay None: no series.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any

from . import errors
from .base import GPM_RATIOS

log = logging.getLogger("gpuwarden")

MIB = 1024 * 1024
# GpuSample field -> NVML_GPM_METRIC_* id (nvmlGpmMetricId_t in nvml.h; the same ids `nvidia-smi dmon
# --gpm-metrics` takes). The shares come as percent (0.0-100.0), the traffic as MiB/s.
GPM_METRICS = {
    "graphics_engine_active_ratio": 1,  # GRAPHICS_UTIL
    "sm_active_ratio": 2,  # SM_UTIL
    "sm_occupancy_ratio": 3,  # SM_OCCUPANCY
    "tensor_active_ratio": 5,  # ANY_TENSOR_UTIL
    "tensor_hmma_active_ratio": 7,  # HMMA_TENSOR_UTIL
    "dram_bandwidth_ratio": 10,  # DRAM_BW_UTIL
    "fp32_active_ratio": 12,  # FP32_UTIL
    "fp16_active_ratio": 13,  # FP16_UTIL
    "pcie_tx_bytes_per_s": 20,  # PCIE_TX_PER_SEC
    "pcie_rx_bytes_per_s": 21,  # PCIE_RX_PER_SEC
    "nvlink_rx_bytes_per_s": 60,  # NVLINK_TOTAL_RX_PER_SEC
    "nvlink_tx_bytes_per_s": 61,  # NVLINK_TOTAL_TX_PER_SEC
}
CALLS = ("nvmlGpmQueryDeviceSupport", "nvmlGpmSampleAlloc", "nvmlGpmSampleGet", "nvmlGpmMetricsGet",
         "nvmlGpmSampleFree", "c_nvmlGpmMetricsGet_t")
FUNCTION_NOT_FOUND = 13
FOR_GOOD = (errors.NotSupported.nvml_code, FUNCTION_NOT_FOUND)  # answers that will not change until a re-init


def scale(field: str, value: float) -> float:
    """NVML's percent as a 0..1 ratio (clamped: a counter's rounding may pass 100), its MiB/s as bytes/s."""
    if field in GPM_RATIOS:
        return min(max(value / 100.0, 0.0), 1.0)
    return max(value, 0.0) * MIB


class NvmlGpm:
    """One GPU's GPM: the sample kept from the last read, and the figures of the last pair."""

    def __init__(self, gpu: Any):  # its NvmlGpu: the handle, the pynvml module, the index for the log
        self.gpu = gpu
        self.nvml = gpu.nvml
        self.values: dict[str, float] = {}  # GpuSample field -> value; empty: unknown (no series)
        self.unsupported: str | None = None  # why GPM is not read on this GPU, as the driver said it
        self.cost_s: float | None = None  # what the last read took (a sample, and the metrics of a pair)
        self._handle: Any = None  # the handle the kept sample was taken with; another one (a re-init) re-primes
        self._kept: Any = None  # the last sample, which the next read pairs with
        self._spare: Any = None  # the other buffer: samples are allocated twice, once, and swapped
        self._dead: set[int] = set()  # metric ids this GPU answered NOT_SUPPORTED for: not asked again

    def read(self) -> None:
        """Take a sample and, when one is kept, the metrics between the two. Raises GpuLost; nothing else."""
        if self.gpu.handle is not self._handle:
            self._restart()
        if self.unsupported is not None:
            return
        started = time.perf_counter()
        try:
            self._read()
        except self.nvml.NVMLError as exc:
            code = getattr(exc, "value", None)
            if code == errors.GpuLost.nvml_code:
                raise errors.GpuLost(f"GPU {self.gpu.index} ({self.gpu.uuid}) is lost") from None
            self.values = {}
            if code in FOR_GOOD:
                self._give_up(f"the driver answered {exc}")
            else:  # a passing failure: this interval is unknown, the kept sample still pairs with the next
                log.debug("GPU%s: GPM read failed: %s", self.gpu.index, exc)
        finally:
            self.cost_s = time.perf_counter() - started

    def _restart(self) -> None:
        """A new handle (the first read, or NVML re-initialised): ask again whether GPM works, and prime."""
        self._release()
        self._handle, self.unsupported, self.values, self._dead = self.gpu.handle, None, {}, set()
        missing = [name for name in CALLS if getattr(self.nvml, name, None) is None]
        if missing:
            self._give_up(f"this nvidia-ml-py has no {missing[0]}")
            return
        try:
            support = self.nvml.nvmlGpmQueryDeviceSupport(self.gpu.handle)
        except self.nvml.NVMLError as exc:
            if getattr(exc, "value", None) == errors.GpuLost.nvml_code:
                self._handle = None  # asked again once the GPU is back
                raise errors.GpuLost(f"GPU {self.gpu.index} ({self.gpu.uuid}) is lost") from None
            self._give_up(f"nvmlGpmQueryDeviceSupport answered {exc}")
            return
        if not getattr(support, "isSupportedDevice", 0):
            self._give_up("nvmlGpmQueryDeviceSupport says this GPU does not support it (isSupportedDevice 0)")

    def _read(self) -> None:
        nvml = self.nvml
        if self._spare is None:
            self._spare = nvml.nvmlGpmSampleAlloc()
        nvml.nvmlGpmSampleGet(self.gpu.handle, self._spare)
        older, self._kept, self._spare = self._kept, self._spare, self._kept
        if older is None:
            return  # the first sample: nothing to pair with yet
        self.values = self._metrics(older, self._kept)

    def _metrics(self, older: Any, newer: Any) -> dict[str, float]:
        wanted = {field: metric for field, metric in GPM_METRICS.items() if metric not in self._dead}
        if not wanted:
            return {}
        request = self.nvml.c_nvmlGpmMetricsGet_t()
        request.version = self.nvml.NVML_GPM_METRICS_GET_VERSION
        request.numMetrics = len(wanted)
        request.sample1, request.sample2 = older, newer
        for i, metric in enumerate(wanted.values()):
            request.metrics[i].metricId = metric
        self.nvml.nvmlGpmMetricsGet(request)
        out = {}
        for i, (field, metric) in enumerate(wanted.items()):
            answer = request.metrics[i]
            # a NaN or inf is no reading: no series; nor a rate whose MiB/s scale past a double's range
            if answer.nvmlReturn == 0 and math.isfinite(answer.value) and \
                    math.isfinite(value := scale(field, float(answer.value))):
                out[field] = value
            elif answer.nvmlReturn in FOR_GOOD:
                self._dead.add(metric)  # e.g. NVLink's on a card without it
        return out

    def _give_up(self, why: str) -> None:
        self.unsupported = why
        self.values = {}
        self._release()
        log.info("GPU%s: GPM (SM, tensor and DRAM activity) not read: %s", self.gpu.index, why)

    def _release(self) -> None:
        """Free the sample buffers (after a re-init NVML may refuse: they are gone with it either way)."""
        for sample in (self._kept, self._spare):
            if sample is not None:
                try:
                    self.nvml.nvmlGpmSampleFree(sample)
                except self.nvml.NVMLError:
                    pass
        self._kept = self._spare = None

    def close(self) -> None:
        self._release()
