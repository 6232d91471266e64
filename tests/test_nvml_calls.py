"""The NVML calls the package makes, against the ones CUDA 14 removes (gpu/nvml_successors.py), and both paths of
each: a driver with the successor (the old call is never made) and one without it (the old call still reads)."""

import ast
import importlib.util
import re
from pathlib import Path

import pytest

from harness.fake_nvml import UNKNOWN, FakeNvml, device
from gpuwarden.gpu.base import ClockEventReason as R
from gpuwarden.gpu.nvml import NvmlBackend
from gpuwarden.gpu.nvml_successors import DEPRECATED
from gpuwarden.gpu.sim.backend import ManualClock

PACKAGE = Path(__file__).resolve().parent.parent / "daemon" / "gpuwarden"
NVML_NAME = re.compile(r"nvml[A-Z]\w*")


def nvml_calls(root=PACKAGE):
    """{NVML name: files}: every `x.nvmlName` and every "nvmlName" string (a name the seam, NvmlGpu._read or
    NvmlSettings._set, is given) in the package's code; comments and docstrings do not count, nor the table of
    successors, which names every old call."""
    found = {}
    for path in sorted(root.rglob("*.py")):
        if path.name == "nvml_successors.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            name = node.attr if isinstance(node, ast.Attribute) else \
                node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None
            if name and NVML_NAME.fullmatch(name):
                found.setdefault(name, set()).add(str(path.relative_to(root)))
    return found


def test_the_scan_finds_the_calls_through_the_seam_and_direct_ones():
    calls = nvml_calls()
    assert {"nvmlInit", "nvmlEventSetWait_v2", "nvmlDeviceGetPowerUsage", "nvmlDeviceSetGpuLockedClocks",
            "nvmlDeviceGetFieldValues", "nvmlDeviceGetTemperatureV"} <= set(calls)
    # named in bench/energy.py's docstring only: not a call there
    assert "bench/energy.py" not in calls["nvmlDeviceGetTotalEnergyConsumption"]


def test_every_deprecated_call_the_package_makes_has_its_successor_path():
    calls = nvml_calls()
    orphans = [f"{old} ({', '.join(sorted(calls[old]))}): CUDA 14 removes it and {DEPRECATED[old]} is never "
               f"called" for old in sorted(set(calls) & set(DEPRECATED)) if DEPRECATED[old] not in calls]
    assert not orphans, "\n".join(orphans)


def installed_pynvml():
    spec = importlib.util.find_spec("pynvml")
    if spec is None or spec.origin is None:
        pytest.skip("nvidia-ml-py is not installed here")
    return Path(spec.origin).read_text()


def test_every_call_nvidia_ml_py_marks_removed_in_cuda_14_is_in_the_table():
    """pynvml.py (nvidia-ml-py 13.615) writes "# DEPRECATED: ... will be removed in CUDA 14.0" above each such
    function: one the package calls must be in DEPRECATED, so the test above sees it."""
    source = installed_pynvml()
    removed = set(re.findall(r"#[^\n]*DEPRECATED[^\n]*CUDA 14[^\n]*\n(?:#[^\n]*\n)*def (nvml\w+)\(", source))
    if not removed:
        pytest.skip("this nvidia-ml-py marks no call as removed in CUDA 14 (before 13.615)")
    missing = sorted((removed & set(nvml_calls())) - set(DEPRECATED))
    assert not missing, f"called, removed in CUDA 14, not in gpu/nvml_successors.DEPRECATED: {missing}"
    assert set(DEPRECATED) <= removed, "the table names only what nvidia-ml-py marks removed"


def test_each_successor_exists_in_the_installed_nvidia_ml_py():
    source = installed_pynvml()
    absent = sorted(new for new in set(DEPRECATED.values()) if f"def {new}(" not in source)
    assert not absent, f"not in this nvidia-ml-py: {absent}"


# -- both paths, over the fake ------------------------------------------------------------------------------
PER_POLL = {"nvmlDeviceGetTemperatureV", "nvmlDeviceGetCurrentClocksEventReasons", "nvmlDeviceGetClock",
            "nvmlDeviceGetFieldValues"}  # the successors the backend asks for; the old call is the fallback


def sample(fake):
    gpu = NvmlBackend(fake, clock=ManualClock(0.0)).gpus()[0]
    return gpu.sample(), gpu.sample()


def assert_reads_everything(s):
    assert s.temperature_c == 41 and s.clock_event_reasons == R.SwPowerCap
    assert s.violation_seconds["power"] == pytest.approx(5.0) and s.violation_seconds["thermal"] == 0
    assert s.board.default_graphics_clock_mhz == 1755


def test_a_cuda_14_driver_without_the_old_calls_reads_everything_and_is_never_asked_for_them():
    fake = FakeNvml([device("GPU-a", "00000000:18:00.0")], driver_lacks=DEPRECATED)
    for s in sample(fake):
        assert_reads_everything(s)
    assert {old: fake.calls[old] for old in DEPRECATED if fake.calls[old]} == {}


@pytest.mark.parametrize("lacks", ["driver_lacks", "pynvml_lacks"])
def test_a_driver_or_nvidia_ml_py_without_the_successors_falls_back_to_the_old_calls(lacks):
    fake = FakeNvml([device("GPU-a", "00000000:18:00.0")], **{lacks: PER_POLL})
    for s in sample(fake):
        assert_reads_everything(s)
    assert fake.calls["nvmlDeviceGetTemperature"] == 2 and fake.calls["nvmlDeviceGetViolationStatus"] == 6
    assert fake.calls["nvmlDeviceGetCurrentClocksThrottleReasons"] == 2
    assert fake.calls["nvmlDeviceGetDefaultApplicationsClock"] == 1
    if lacks == "driver_lacks":  # FUNCTION_NOT_FOUND once: not asked again
        assert fake.calls["nvmlDeviceGetTemperatureV"] == 1 and fake.calls["nvmlDeviceGetFieldValues"] == 1


def test_a_successor_that_fails_once_is_none_not_the_old_call():
    fake = FakeNvml([device("GPU-a", "00000000:18:00.0")])
    fake.fail[("nvmlDeviceGetTemperatureV", None)] = UNKNOWN
    fake.fail[("nvmlDeviceGetFieldValues", None)] = UNKNOWN
    s, _ = sample(fake)
    assert s.temperature_c is None and set(s.violation_seconds.values()) == {None}
    assert fake.calls["nvmlDeviceGetTemperature"] == 0 and fake.calls["nvmlDeviceGetViolationStatus"] == 0
