"""The health model (watch/health.py): each input's state and action, the escalation after N reboots, the host
taking the worst; then each fault class's scenario played through the monitor."""

from __future__ import annotations

import pytest

from gpuwarden.gpu.base import GpuHealth, GpuSample, NvLink
from gpuwarden.watch import health
from gpuwarden.watch.health import DEGRADED, HEALTHY, UNHEALTHY, Inputs, judge


def sample(index=0, up=True, error=None, **h) -> GpuSample:
    return GpuSample(index, f"GPU-{index}", "NVIDIA H100", f"00000000:{index + 1:02X}:00.0", "9.0", up=up,
                     error=error, health=GpuHealth(**h))


def verdict(s=None, reboots=health.no_reboots, **inputs):
    return judge(s or sample(), Inputs(**inputs), 3, reboots)


def test_a_gpu_with_nothing_wrong_is_healthy_with_no_action():
    v = verdict(sample(remap_pending=False, remap_failure=False, ecc_uncorrected=0, recovery_action=0))
    assert (v.state, v.action, v.reasons, v.text()) == (HEALTHY, "none", (), "none")


@pytest.mark.parametrize("s, inputs, state, action, reason", [
    (sample(up=False, error="GPU is lost"), {}, UNHEALTHY, "reboot", "GPU lost from the bus (GPU is lost)"),
    (sample(recovery_action=1), {}, UNHEALTHY, "reset_gpu", "the driver's recovery action: reset the GPU"),
    (sample(recovery_action=2), {}, UNHEALTHY, "reboot", "the driver's recovery action: reboot the node"),
    (sample(recovery_action=3), {}, UNHEALTHY, "restart_engine", "peer-to-peer"),
    (sample(recovery_action=4), {}, UNHEALTHY, "reset_gpu", "then reset the GPU"),
    (sample(recovery_action=99), {}, UNHEALTHY, "inspect", "action: 99"),
    (sample(remap_pending=True), {}, DEGRADED, "reset_gpu", "a remapped row waits for a GPU reset"),
    (sample(remap_failure=True), {}, UNHEALTHY, "inspect", "could not be remapped"),
    (sample(ecc_uncorrected=2), {}, UNHEALTHY, "reset_gpu", "2 uncorrected ECC error(s)"),
    (sample(fabric="in_progress"), {}, DEGRADED, "restart_engine", "fabric registration in progress"),
    (sample(fabric="completed", fabric_error="Not Ready"), {}, UNHEALTHY, "inspect", "failed (Not Ready)"),
    (sample(pcie_generation=2, pcie_generation_max=5, pcie_width=16, pcie_width_max=16), {"busy": True},
     DEGRADED, "inspect", "PCIe link Gen2 x16 of Gen5 x16 while busy"),
    (sample(nvlinks=(NvLink(0, "up", "GPU1"), NvLink(1, "down", "GPU1"))), {}, DEGRADED, "reset_gpu",
     "NVLink link 1 down (to GPU1) (1 of 2 up)"),
    (sample(), {"needs_reset": "Xid 79 (GPU has fallen off the bus): reboot the node"}, UNHEALTHY, "reboot",
     "Xid 79"),
    (sample(), {"needs_reset": "Xid 48 (double-bit ECC error): reset the GPU"}, UNHEALTHY, "reset_gpu", "Xid 48"),
    (sample(), {"recent_xids": ((13, 2),)}, DEGRADED, "restart_engine", "Xid 13 (Graphics Engine Exception) x2"),
])
def test_each_input_gives_its_state_action_and_reason(s, inputs, state, action, reason):
    v = verdict(s, **inputs)
    assert (v.state, v.action) == (state, action)
    assert any(reason in r for r in v.reasons), v.reasons


def test_an_idle_link_trained_down_and_a_device_xid_are_not_findings():
    """Idle links train down to save power; Xid 92 (high single-bit rate) asks for nothing in the catalog."""
    v = verdict(sample(pcie_generation=1, pcie_generation_max=5, pcie_width=16, pcie_width_max=16),
                recent_xids=((92, 1),))
    assert v.state == HEALTHY


def test_the_recovery_event_is_said_once_where_the_field_says_it_too():
    v = verdict(sample(recovery_action=1), needs_reset="the driver set a recovery action: reset the GPU")
    assert len(v.reasons) == 1 and v.faults == ("recovery_action",)


def test_the_most_severe_finding_sets_state_and_action_and_comes_first():
    v = verdict(sample(remap_pending=True, remap_failure=True, ecc_uncorrected=1), recent_xids=((31, 1),))
    assert (v.state, v.action) == (UNHEALTHY, "inspect")
    assert v.reasons[0] == "a memory row could not be remapped"
    assert v.faults == ("remap_failure", "ecc_uncorrected", "remap_pending", "xid31")


def test_a_reboot_becomes_inspect_at_the_configured_count_for_that_fault_only():
    seen = []

    def reboots(uuid, fault):
        seen.append((uuid, fault))
        return {"xid79": 3}.get(fault, 0)

    lost = verdict(sample(), reboots, needs_reset="Xid 79 (GPU has fallen off the bus): reboot the node")
    assert lost.action == "inspect" and "still after 3 reboots" in lost.reasons[0]
    other = verdict(sample(recovery_action=2), reboots)
    assert other.action == "reboot"
    assert seen == [("GPU-0", "xid79"), ("GPU-0", "recovery_action")]
    below = judge(sample(), Inputs(needs_reset="Xid 79 (x): reboot the node"), 4, reboots)
    assert below.action == "reboot"


def test_the_host_takes_the_worst_state_and_action():
    gpus = [verdict(sample(0)), verdict(sample(1, remap_pending=True)), verdict(sample(2, up=False))]
    h = health.host(gpus)
    assert (h.state, h.action) == (UNHEALTHY, "reboot")
    assert h.reasons == ("GPU1 degraded: reset the GPU", "GPU2 unhealthy: reboot")
    assert health.host([verdict(sample(0))]).state == HEALTHY
    assert health.host([]).state == HEALTHY


@pytest.mark.parametrize("answer, expected", [({"recovery_action": 2}, 2), ({"recovery_action": 0}, 0),
                                               ({}, None), ({"field_errors": {230: 2}}, None)])
def test_nvml_reads_the_recovery_action_in_the_batch_and_a_driver_without_it_is_asked_once(answer, expected):
    """NVML_FI_DEV_GET_GPU_RECOVERY_ACTION (230): an older driver answers NOT_SUPPORTED, or INVALID_ARGUMENT for
    an id it does not know; either way the field is None and left out of the next batches."""
    from fake_nvml import FakeNvml, device
    from gpuwarden.gpu.nvml import NvmlBackend
    from gpuwarden.gpu.sim.backend import ManualClock

    fake = FakeNvml([device("GPU-aaa", "00000000:18:00.0", **answer)])
    gpu = NvmlBackend(fake, clock=ManualClock(100.0), counters_interval_s=10.0).gpus()[0]
    first, second = gpu.sample(counters=True), gpu.sample(counters=True)
    assert first.health.recovery_action == second.health.recovery_action == expected
    assert fake.calls["field 230"] == (2 if expected is not None else 1)
    assert fake.calls["field 83"] == 2  # the rest of the batch goes on
