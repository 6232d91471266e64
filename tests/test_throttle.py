"""throttle.py: the one answer to "is this clock low, and why", as alerts, tuning and doctor ask it."""

from gpuwarden import config
from gpuwarden.gpu import throttle
from gpuwarden.watch.alerts import GpuContext
from gpuwarden.watch.signals import RULES_BY_NAME
from gpuwarden.backends import open_configured
from gpuwarden.watch.doctor import diagnose
from gpuwarden.gpu.base import ClockEventReason as R
from gpuwarden.gpu.base import GpuSample
from gpuwarden.gpu.sim.backend import ManualClock
from gpuwarden.gpu.throttle import Threshold
from gpuwarden.tune.tuning import Action, _verify

SIM = "gpu:\n  backend: sim\n  scenario: rtx-pro-4000-headless\n"


def sample(sm=900, reasons=R.NONE, util=90.0) -> GpuSample:
    return GpuSample(0, "GPU-a", "card", "0000:01:00.0", "12.0", sm_clock_mhz=sm, max_sm_clock_mhz=3090,
                     memory_clock_mhz=13365, max_memory_clock_mhz=13365, utilization_pct=util,
                     clock_event_reasons=reasons, power_w=100.0, power_limit_w=140.0, power_limit_max_w=145.0)


def test_every_reason_that_holds_a_clock_down_explains_it_in_all_three_places():
    lock = (3090, 3090)
    settings = config.AlertSettings()
    for reason in (R.SwPowerCap, R.SwThermalSlowdown, R.HwThermalSlowdown, R.HwSlowdown, R.HwPowerBrakeSlowdown,
                   R.SyncBoost):
        s = sample(reasons=reason)
        assert throttle.held_down_by(s) == reason
        ctx = GpuContext(True, lock, None, False, settings)
        assert not RULES_BY_NAME["clock_lock_lost"].check(s, ctx).active, reason
        assert _verify(Action(0, "GPU-a", "gpu_clocks", 900, lock, True), s).ok, reason
    assert not throttle.held_down_by(sample(reasons=R.GpuIdle | R.ApplicationsClocksSetting))
    assert RULES_BY_NAME["clock_lock_lost"].check(sample(), GpuContext(True, lock, None, False, settings)).active
    assert not _verify(Action(0, "GPU-a", "gpu_clocks", 900, lock, True), sample()).ok


def test_the_lock_tolerance_is_one_number():
    assert throttle.within_lock(3090 - throttle.LOCK_TOLERANCE_MHZ, (3090, 3090))
    assert not throttle.within_lock(3090 - throttle.LOCK_TOLERANCE_MHZ - 1, (3090, 3090))
    assert throttle.below_lock(3090 - throttle.LOCK_TOLERANCE_MHZ - 1, (3090, 3090))


def test_judge_resolves_the_threshold_on_the_lock_else_the_maximum():
    s = sample(sm=1500)
    assert throttle.judge(1500, 3090, None, Threshold(fraction=0.5), s).low  # 1500 < 1545
    assert not throttle.judge(1500, 3090, (2000, 2000), Threshold(fraction=0.5), s).low  # 1500 >= 1000
    assert not throttle.judge(1500, 3090, None, Threshold(mhz=1000), s).low
    assert throttle.judge(None, 3090, None, Threshold(fraction=0.5), s) is None


def _doctor_clocks(extra: str) -> dict:
    cfg = config.parse_text(SIM + extra)
    backend = open_configured(cfg, ManualClock())
    return {f.check: f for f in diagnose(cfg, backend, deep=False)}["GPU0 clocks"]


def test_doctor_uses_the_configured_busy_level_and_threshold():
    # The headless card runs at 180 of 3090 MHz at 60% utilization: an error with the defaults...
    assert _doctor_clocks("").severity == "error"
    # ...not once 60% is not busy by the configured level, or 180 MHz is above the configured threshold.
    assert _doctor_clocks("alerts:\n  busy_utilization_pct: 70\n").severity != "error"
    assert _doctor_clocks("alerts:\n  sm_clock_min_mhz: 100\n").severity != "error"
