"""GPM (NVML's GPU Performance Monitoring) for the fake NVML (tests/harness/fake_nvml.py, whose FakeNvml takes these
calls): the calls, structs and constants of nvidia-ml-py's pynvml that gpu/nvml_gpm.py uses.

A device record's `gpm` says what the GPU answers: absent or None, nvmlGpmQueryDeviceSupport says
isSupportedDevice 0 (a card before Hopper); a dict {NVML_GPM_METRIC id: value}, it is supported and
nvmlGpmMetricsGet answers each id with the value the record held when the newer sample of the pair was taken
(percent, or MiB/s), and NOT_SUPPORTED for an id the dict lacks. The driver's NOT_SUPPORTED for a whole call is
FakeNvml.fail[(name, index)]; an nvidia-ml-py without the calls is an instance attribute set to None.
"""

from types import SimpleNamespace

NOT_SUPPORTED, INVALID_ARGUMENT = 3, 2


class GpmSample:
    """nvmlGpmSample_t: a buffer, filled by nvmlGpmSampleGet."""

    def __init__(self, number):
        self.number = number  # its allocation, for the tests' bookkeeping
        self.index = self.taken = self.values = None
        self.freed = False


class GpmMetricsGet:
    """c_nvmlGpmMetricsGet_t, with the metrics array as a list (pynvml's holds NVML_GPM_METRIC_MAX)."""

    def __init__(self):
        self.version = self.numMetrics = 0
        self.sample1 = self.sample2 = None
        self.metrics = [SimpleNamespace(metricId=0, nvmlReturn=0, value=0.0) for _ in range(98)]


class FakeGpm:
    c_nvmlGpmMetricsGet_t = GpmMetricsGet
    NVML_GPM_METRICS_GET_VERSION = 1

    def _gpm_book(self):
        if not hasattr(self, "gpm_samples"):
            self.gpm_samples = []  # every GpmSample allocated, in order
            self.gpm_pairs = []  # (device index, older sample's take, newer's) of each nvmlGpmMetricsGet
            self.gpm_takes = 0
        return self

    def nvmlGpmQueryDeviceSupport(self, h):
        dev = self._dev("nvmlGpmQueryDeviceSupport", h)
        return SimpleNamespace(version=1, isSupportedDevice=int(dev.get("gpm") is not None))

    def nvmlGpmSampleAlloc(self):
        self._check("nvmlGpmSampleAlloc")
        book = self._gpm_book()
        sample = GpmSample(len(book.gpm_samples))
        book.gpm_samples.append(sample)
        return sample

    def nvmlGpmSampleFree(self, sample):
        self._check("nvmlGpmSampleFree")
        assert not sample.freed, "a GPM sample freed twice"
        sample.freed = True

    def nvmlGpmSampleGet(self, h, sample):
        dev = self._dev("nvmlGpmSampleGet", h)
        assert not sample.freed, "a freed GPM sample read into"
        if dev.get("gpm") is None:
            raise self.NVMLError(NOT_SUPPORTED)
        book = self._gpm_book()
        book.gpm_takes += 1
        sample.index, sample.taken, sample.values = h.index, book.gpm_takes, dict(dev["gpm"])
        return sample

    def nvmlGpmMetricsGet(self, request):
        self._check("nvmlGpmMetricsGet")
        older, newer = request.sample1, request.sample2
        if request.version != 1 or older is None or newer is None or older.taken is None or newer.taken is None \
                or older.index != newer.index or older.taken >= newer.taken or older.freed or newer.freed:
            raise self.NVMLError(INVALID_ARGUMENT)
        self._gpm_book().gpm_pairs.append((newer.index, older.taken, newer.taken))
        for metric in request.metrics[:request.numMetrics]:
            value = newer.values.get(metric.metricId)
            metric.nvmlReturn, metric.value = (NOT_SUPPORTED, 0.0) if value is None else (0, float(value))
        return request
