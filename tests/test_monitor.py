"""Alert rules driven by sim timelines; transitions asserted exactly, in sim time."""

import logging

import pytest

from gpuwarden import config
from gpuwarden.tune.sweeps import Sweeps
from gpuwarden.watch.alerts import AlertSettings, AlertState, Check
from gpuwarden.watch.signals import RULES_BY_NAME
from gpuwarden.backends import open_configured
from gpuwarden.web.exposition import make_registry
from gpuwarden.gpu.sim.backend import ManualClock
from gpuwarden.gpu.sim.scenario import resolve_scenario
from gpuwarden.watch.monitor import Monitor
from gpuwarden.tune.tuning import Tuner, TuningLife

FAST = "poll_interval_s: 0.5\nalerts:\n  for_s: 1\n  clear_for_s: 2\n"


def monitor_for(scenario, extra=FAST, clock=None):
    cfg = config.parse_text(f"gpu:\n  backend: sim\n  scenario: {scenario}\nmetrics:\n  listen: none\n{extra}")
    clock = clock or ManualClock()
    backend = open_configured(cfg, clock)
    tuning = TuningLife(backend, cfg, Tuner(backend))
    tuning.start(tuning.check(cfg))
    monitor = Monitor(cfg, backend, tuning)
    return monitor, clock


def play(monitor, clock, until, step=0.5):
    """Tick every step until `until`; return [(t, gpu, alert, 'firing'|'resolved')]."""
    events, firing = [], set()
    while clock.now <= until + 1e-9:
        snapshot = monitor.tick(clock.now)
        now = {(a.gpu, a.alert) for a in snapshot.firing()}
        events += [(clock.now, g, a, "firing") for g, a in sorted(now - firing)]
        events += [(clock.now, g, a, "resolved") for g, a in sorted(firing - now)]
        firing = now
        clock.advance(step)
    return events


def test_read_only_headless_card_fires_clock_low_for_each_busy_gpu():
    monitor, clock = monitor_for("rtx-pro-4000-headless", FAST + "tuning:\n  apply: false\n")
    events = play(monitor, clock, 3)
    assert events == [(1.0, 0, "memory_clock_low", "firing"), (1.0, 0, "sm_clock_low", "firing"),
                      (1.0, 1, "memory_clock_low", "firing"), (1.0, 1, "sm_clock_low", "firing")]


def test_locked_card_raises_no_clock_alert_only_the_design_power_notice():
    monitor, clock = monitor_for("rtx-pro-4000-headless")
    events = play(monitor, clock, 45)
    # Load steps up at t=20 on GPU 0 and back at t=40; for_s 1, clear_for_s 2. 145 W is this card's maximum
    # limit (160 W is rejected), so the cap is its design power: a notice, not a power_capped warning.
    assert events == [(21.0, 0, "at_design_power", "firing"), (42.0, 0, "at_design_power", "resolved")]
    capped = [a for a in monitor.snapshot.alerts if a.alert == "at_design_power" and a.gpu == 0][0]
    assert capped.short == "-37%" and capped.severity == "info"  # 1935 of locked 3090 MHz


def capped_line(caplog, gpu=0):
    return [r.getMessage() for r in caplog.records if f"GPU{gpu} " in r.getMessage() and "power_capped firing" in
            r.getMessage()][0]


def chosen_gauge(monitor):
    families = {m.name: m for m in make_registry(lambda: monitor.snapshot).collect()}
    return {s.labels["gpu"]: s.value for s in families["gpuwarden_gpu_power_limit_chosen_watts"].samples}


def notice_line(caplog, gpu=0):
    return [r.getMessage() for r in caplog.records if f"GPU{gpu} " in r.getMessage() and
            "held_at_chosen_limit firing" in r.getMessage()][0]


def test_a_limit_the_tuning_chose_is_a_notice_of_that_choice_not_a_power_capped_warning(caplog):
    monitor, clock = monitor_for("rtx-pro-4000-headless", FAST + "tuning:\n  power_limit_w: 120\n")
    with caplog.at_level(logging.INFO, logger="gpuwarden"):
        events = play(monitor, clock, 25)
    assert (1.0, 0, "held_at_chosen_limit", "firing") in events  # at 120 W, 60 % load already caps
    assert not [e for e in events if e[2] in ("power_capped", "at_design_power")]
    notice = [a for a in monitor.snapshot.alerts if a.alert == "held_at_chosen_limit" and a.gpu == 0][0]
    assert notice.severity == "info"
    line = notice_line(caplog)
    assert "SM clock 2580 MHz, -17% of locked 3090 MHz; drawing 120 W held at 120 W, chosen in " \
           "tuning.power_limit_w (SwPowerCap)" in line
    assert line.endswith("fix: nothing to fix: the limit was chosen, and the clock loss shown is its price")
    assert "raise" not in line and "increase" not in line
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING and "GPU0 " in r.getMessage()]
    assert chosen_gauge(monitor) == {"0": 120, "1": 120}


def test_a_tune_sweeps_step_is_the_notice_not_power_capped(tmp_path, caplog):
    monitor, clock = monitor_for("rtx-pro-4000-headless")
    sweeps = Sweeps(monitor.tuning, clock, marker=tmp_path / "sweep.json")
    owner = object()
    assert sweeps.handle({"op": "begin", "setting": "power_limit_w", "gpus": [0], "lease_s": 60, "force": True},
                         "test", owner)["ok"]
    assert sweeps.handle({"op": "set", "value": 100}, "test", owner)["ok"]
    with caplog.at_level(logging.INFO, logger="gpuwarden"):
        events = play(monitor, clock, 5)
    assert (1.0, 0, "held_at_chosen_limit", "firing") in events
    assert not [e for e in events if e[2] == "power_capped"]
    assert "held at 100 W, set by a tune sweep (SwPowerCap)" in notice_line(caplog)


def test_a_thermal_cap_still_warns_at_a_chosen_limit():
    monitor, clock = monitor_for("thermal", FAST + "tuning:\n  power_limit_w: 200\n")
    events = play(monitor, clock, 22)
    assert (1.0, 0, "held_at_chosen_limit", "firing") in events  # 60 % of 450 W is above the chosen 200 W
    assert (11.0, 0, "thermal_slowdown", "firing") in events
    assert not [e for e in events if e[2] == "power_capped"]
    severity = {a.alert: a.severity for a in monitor.snapshot.alerts}
    assert severity["thermal_slowdown"] == "warning" and severity["held_at_chosen_limit"] == "info"


def test_a_limit_below_the_maximum_nobody_here_chose_warns_with_the_watts_that_could_be_added(caplog):
    # Somebody ran `nvidia-smi -pl 120` on GPU 0: the tuning sets no limit, so the raise is the fix.
    monitor, clock = monitor_for("rtx-pro-4000-headless")
    monitor.backend.gpus()[0].set_power_limit_w(120)
    with caplog.at_level(logging.INFO, logger="gpuwarden"):
        events = play(monitor, clock, 25)
    assert (1.0, 0, "power_capped", "firing") in events
    line = capped_line(caplog)
    assert "at power limit 120 W (SwPowerCap)" in line
    assert line.endswith("fix: raise tuning.power_limit_w by up to 25 W, to 145 W (the card's maximum), "
                         "or accept the clock loss")
    assert chosen_gauge(monitor) == {}  # nothing chosen on either GPU: no series
    # The tuning wants 130 W, yet the card enforces 120 W that somebody else set: throttled below the choice, a
    # warning whose fix is to find what lowered it (raising the config would change nothing).
    caplog.clear()
    monitor, clock = monitor_for("rtx-pro-4000-headless", FAST + "tuning:\n  power_limit_w: 130\n")
    monitor.backend.gpus()[0].set_power_limit_w(120)
    with caplog.at_level(logging.INFO, logger="gpuwarden"):
        play(monitor, clock, 3)
    line = capped_line(caplog, 0)
    assert "at power limit 120 W, below the 130 W chosen in tuning.power_limit_w (SwPowerCap)" in line
    assert line.endswith("fix: something else lowered the limit (nvidia-smi -pl, a cron job, another tool): stop "
                         "it, then `systemctl reload gpuwarden` sets the chosen limit again")
    assert "held at 130 W, chosen in tuning.power_limit_w" in notice_line(caplog, 1)
    assert chosen_gauge(monitor) == {"0": 130, "1": 130}
    monitor, clock = monitor_for("rtx-pro-4000-headless", FAST.replace("alerts:\n", "alerts:\n  warn_at_design_power: "
                                                                      "true\n"))
    events = play(monitor, clock, 25)
    assert (21.0, 0, "power_capped", "firing") in events and not [e for e in events if e[2] == "at_design_power"]


def test_a_sweeps_step_is_the_chosen_limit_while_it_holds_the_gpu(tmp_path):
    monitor, clock = monitor_for("rtx-pro-4000-headless", FAST + "tuning:\n  power_limit_w: 120\n")
    sweeps = Sweeps(monitor.tuning, clock, marker=tmp_path / "sweep.json")
    owner = object()
    assert sweeps.handle({"op": "begin", "setting": "power_limit_w", "gpus": [0], "lease_s": 60, "force": True},
                         "test", owner)["ok"]
    play(monitor, clock, 1)
    assert chosen_gauge(monitor) == {"0": 120, "1": 120}  # no step set yet: the configured limit stands
    assert sweeps.handle({"op": "set", "value": 100}, "test", owner)["ok"]
    play(monitor, clock, 2)
    assert chosen_gauge(monitor) == {"0": 100, "1": 120}
    assert monitor.tuning.chosen_power_limit(0, monitor.backend.gpus()[0].uuid) == (100, "set by a tune sweep")
    assert sweeps.handle({"op": "end"}, "test", owner)["ok"]
    play(monitor, clock, 3)
    assert chosen_gauge(monitor) == {"0": 120, "1": 120}
    # A GPU's own override is named as the key that chose it.
    monitor, clock = monitor_for("rtx-pro-4000-headless", FAST + "tuning:\n  gpus:\n    '1': {power_limit_w: 110}\n")
    chosen = {g.index: monitor.tuning.chosen_power_limit(g.index, g.uuid) for g in monitor.backend.gpus()}
    assert chosen == {0: None, 1: (110, "chosen in tuning.gpus.1.power_limit_w")}
    # Read-only: the tuning applies nothing, so nothing is its choice.
    monitor, clock = monitor_for("rtx-pro-4000-headless", FAST + "tuning:\n  apply: false\n  power_limit_w: 120\n")
    play(monitor, clock, 1)
    assert chosen_gauge(monitor) == {}


def test_lock_lost_is_detected_reapplied_and_resolved():
    monitor, clock = monitor_for("lock-lost", FAST + "  reapply_min_interval_s: 5\n")
    events = play(monitor, clock, 40)
    assert events == [
        (11.0, 0, "clock_lock_lost", "firing"), (11.0, 0, "memory_clock_low", "firing"),
        (11.0, 0, "persistence_off", "firing"), (11.0, 0, "sm_clock_low", "firing"),
        (13.5, 0, "clock_lock_lost", "resolved"), (13.5, 0, "memory_clock_low", "resolved"),
        (13.5, 0, "persistence_off", "resolved"), (13.5, 0, "sm_clock_low", "resolved"),
        (31.0, 0, "clock_lock_lost", "firing"), (31.0, 0, "memory_clock_low", "firing"),
        (31.0, 0, "persistence_off", "firing"), (31.0, 0, "sm_clock_low", "firing"),
        (33.5, 0, "clock_lock_lost", "resolved"), (33.5, 0, "memory_clock_low", "resolved"),
        (33.5, 0, "persistence_off", "resolved"), (33.5, 0, "sm_clock_low", "resolved"),
    ]
    assert monitor.tuning.reapplies[0] == 2
    gpu = monitor.backend.gpus()[0]
    assert gpu.gpu_lock == (3090, 3090) and gpu.persistence


def test_reapply_is_rate_limited(write):
    # A lock that keeps dropping: driver reloads every second for 20 s.
    text = resolve_scenario("lock-lost").read_text().split("timeline:")[0]
    text += "timeline:\n  - {at_s: 0, event: load, utilization_pct: 60}\n" + "".join(
        f"  - {{at_s: {t}, event: driver_reload}}\n" for t in range(5, 25))
    monitor, clock = monitor_for(write("flaky.yaml", text), FAST + "  reapply_min_interval_s: 5\n")
    play(monitor, clock, 25)
    assert monitor.tuning.reapplies[0] == 4  # t=6, 11, 16, 21: at most one per 5 s


def test_gpu_lost_then_back_resolves_and_relocks():
    monitor, clock = monitor_for("gpu-lost")
    events = play(monitor, clock, 30)
    lost = [e for e in events if e[2] == "gpu_lost"]
    assert lost == [(11.0, 1, "gpu_lost", "firing"), (22.0, 1, "gpu_lost", "resolved")]
    assert not any(e[1] == 0 for e in events), "GPU 0 was never affected"
    # Back without its lock at t=20: planned and locked again as it answers, before any alert could fire.
    assert not [e for e in events if e[2] in ("clock_lock_lost", "sm_clock_low")]
    assert monitor.backend.gpus()[1].gpu_lock == (3090, 3090) and monitor.tuning.locks[1][0] == (3090, 3090)


def test_thermal_scenario_severities():
    monitor, clock = monitor_for("thermal")
    events = play(monitor, clock, 50)
    fired = {(t, a) for t, _, a, kind in events if kind == "firing"}
    assert {(11.0, "thermal_slowdown"), (26.0, "hw_thermal_slowdown"), (36.0, "power_brake"),
            (41.0, "hw_slowdown")} <= fired
    severity = {a.alert: a.severity for a in monitor.snapshot.alerts}
    assert severity["thermal_slowdown"] == "warning"
    assert {severity[r] for r in ("hw_thermal_slowdown", "hw_slowdown", "power_brake", "gpu_lost")} == {"critical"}


def test_no_flapping_around_the_threshold(write):
    # Utilization toggles between busy and idle every second: never busy for for_s = 2.
    text = resolve_scenario("lock-lost").read_text().split("timeline:")[0]
    text += "timeline:\n" + "".join(f"  - {{at_s: {t}, event: load, utilization_pct: {60 if t % 2 else 0}}}\n"
                                    for t in range(0, 30))
    monitor, clock = monitor_for(write("toggle.yaml", text), "alerts:\n  for_s: 2\n  clear_for_s: 5\n"
                                                            "tuning:\n  apply: false\n")
    assert play(monitor, clock, 30, step=0.25) == []


def test_after_a_stall_the_stalled_time_does_not_count_toward_for_s(write):
    """The GPUs turn busy at t=0.5, so sm_clock_low is pending when the daemon stops (SIGSTOP, a frozen host) from
    t=1 to t=7: one reading after the stall cannot show that the condition held for for_s, so the alert fires
    for_s after the resume, not at once. On the clock the test drives (tests/test_faults.py has the same with a
    real SIGSTOP)."""
    text = resolve_scenario("rtx-pro-4000-headless").read_text().replace(
        "  - {at_s: 0, event: load, utilization_pct: 60, memory_used_pct: 85}   # vLLM already serving",
        "  - {at_s: 0.5, event: load, utilization_pct: 60, memory_used_pct: 85}")
    settings = "poll_interval_s: 0.5\nalerts:\n  for_s: 2\ntuning:\n  apply: false\n"

    def fired(events):
        return sorted({t for t, _, alert, phase in events if alert == "sm_clock_low" and phase == "firing"})

    monitor, clock = monitor_for(write("late-load.yaml", text), settings)
    assert play(monitor, clock, 1.0) == []
    assert {s.phase for k, s in monitor.states.items() if k[0] == "sm_clock_low"} == {"pending"}
    clock.advance(6.0)  # no poll from t=1.0 to t=7.0
    after = fired(play(monitor, clock, 12.0))
    # pending again from the readings after the stall: for_s after the resume, within a poll (without the rule: 7.5)
    assert len(after) == 1 and 7.0 + 2 <= after[0] <= 7.0 + 2 + 0.5, after


def test_firing_alert_survives_short_clear_periods():
    state = AlertState(RULES_BY_NAME["sm_clock_low"], 0, "GPU-x")
    settings = AlertSettings(for_s=1, clear_for_s=5, repeat_s=1000)
    on, off = Check(True, "SM clock 180 MHz"), Check(False)
    timeline = [(0, on), (1, on), (2, off), (4, on), (5, off), (9, off), (10, off)]
    events = [(t, state.step(check, t, settings)) for t, check in timeline]
    assert [e for e in events if e[1]] == [(1, "firing"), (10, "resolved")]


def test_reminder_every_repeat_s(caplog):
    monitor, clock = monitor_for("rtx-pro-4000-headless", FAST + "  repeat_s: 5\ntuning:\n  apply: false\n")
    with caplog.at_level(logging.WARNING, logger="gpuwarden"):
        play(monitor, clock, 12)
    gpu0_sm = [r.getMessage() for r in caplog.records if r.getMessage().startswith("GPU0") and "sm_clock_low" in
               r.getMessage()]
    assert len(gpu0_sm) == 3  # fired at 1 s, reminded at 6 s and 11 s
    assert "still firing after 5 s" in gpu0_sm[1]


def test_busy_hook_counts_as_busy():
    # dgx-spark's load is 70 %; with a busy threshold of 90 % only the hook makes it busy.
    monitor, clock = monitor_for("dgx-spark", FAST + "  busy_utilization_pct: 90\n  sm_clock_min_mhz: 5000\n"
                                                     "tuning:\n  apply: false\n")
    assert play(monitor, clock, 3) == []
    monitor.report_running_requests(2)
    assert play(monitor, clock, 6)[0][1:] == (0, "sm_clock_low", "firing")


def test_absolute_threshold_in_mhz():
    monitor, clock = monitor_for("rtx-pro-4000-headless", FAST + "  sm_clock_min_mhz: 2000\n")
    events = play(monitor, clock, 25)
    assert (21.0, 0, "sm_clock_low", "firing") in events  # power-capped 1935 MHz < 2000 MHz


def test_journal_lines_carry_gpu_uuid_value_threshold_reasons_and_fix(caplog):
    monitor, clock = monitor_for("rtx-pro-4000-headless")
    with caplog.at_level(logging.INFO, logger="gpuwarden"):
        play(monitor, clock, 45)
    uuid = monitor.backend.gpus()[0].uuid
    firing = [r for r in caplog.records if "at_design_power firing" in r.getMessage()]
    resolved = [r for r in caplog.records if "at_design_power resolved" in r.getMessage()]
    assert len(firing) == 1 and len(resolved) == 1, "exactly one line per transition"
    assert firing[0].levelno == 25 and resolved[0].levelno == 25  # NOTICE: not a warning
    assert firing[0].getMessage() == (
        f"GPU0 {uuid} at_design_power firing: SM clock 1935 MHz, -37% of locked 3090 MHz; drawing 145 W "
        "at its maximum power limit 145 W (SwPowerCap); reasons: SwPowerCap; fix: nothing to change: this is "
        "the card's design power, and no higher limit is allowed")
    assert resolved[0].getMessage().startswith(f"GPU0 {uuid} at_design_power resolved after 21 s (worst: SM clock "
                                               "1935 MHz, -37% of locked 3090 MHz")


def test_critical_rules_log_at_crit(caplog):
    monitor, clock = monitor_for("gpu-lost")
    with caplog.at_level(logging.WARNING, logger="gpuwarden"):
        play(monitor, clock, 12)
    (line,) = [r for r in caplog.records if "gpu_lost firing" in r.getMessage()]
    assert line.levelno == logging.CRITICAL


@pytest.mark.parametrize("scenario", ["rtx-pro-4000-headless", "rtx-pro-6000-tp4", "dgx-spark"])
def test_status_line(scenario):
    monitor, clock = monitor_for(scenario)
    play(monitor, clock, 25)
    line = monitor.snapshot.summary_line()
    n = len(monitor.backend.gpus())
    assert line.startswith(f"{n} GPU" + ("s" if n > 1 else "") + " · locked ")
    samples = [v.sample for v in monitor.snapshot.gpus]
    if scenario == "rtx-pro-4000-headless":
        assert line == f"2 GPUs · locked 3090 MHz · {activity(samples)} · GPU0 at_design_power (-37%)"
    if scenario == "dgx-spark":  # GB10 reports no GPM: no activity in the line
        assert "SM " not in line and all(s.sm_active_ratio is None for s in samples)


def activity(samples, numbers=True) -> str:
    """What the status line should say of GPM's SM, tensor and DRAM activity: the GPUs' mean, from the samples."""
    def mean(field):
        value = 100 * sum(getattr(s, field) for s in samples) / len(samples)
        return f"{value if numbers else round(value, -1):.0f}%"
    return f"SM {mean('sm_active_ratio')}, tensor {mean('tensor_active_ratio')}, DRAM {mean('dram_bandwidth_ratio')}"


def test_the_resolved_line_quotes_the_worst_reading_and_the_fix_follows_the_reasons():
    from gpuwarden.watch.alerts import AlertSettings, AlertState, Check
    from gpuwarden.watch.signals import RULES_BY_NAME

    settings = AlertSettings(for_s=0, clear_for_s=0)
    state = AlertState(RULES_BY_NAME["sm_clock_low"], 0, "GPU-0")
    for t, mhz in enumerate((900, 400, 1000)):
        state.step(Check(True, f"SM clock {mhz} MHz", value=float(mhz)), float(t), settings)
    state.step(Check(False), 3.0, settings)
    assert state.worst.observed == "SM clock 400 MHz"  # not the last one, 1000 MHz
    monitor, clock = monitor_for("rtx-pro-4000-headless", FAST.replace("alerts:\n", "alerts:\n  sm_clock_min_mhz: 2000\n"))
    play(monitor, clock, 25)
    check = [s.check for (name, gpu), s in monitor.states.items() if name == "sm_clock_low" and gpu == 0][0]
    assert check.fix.startswith("the clock is held down by SwPowerCap, which a lock cannot override")


@pytest.mark.parametrize("on,off", [(1, 1), (2, 1), (0.5, 0.5)])
def test_a_flapping_hardware_slowdown_fires_on_its_duty_cycle(write, on, off):
    # No streak of HwSlowdown lasts for_s 2, yet the card is slowed a third to two thirds of the time.
    text = resolve_scenario("hw-slowdown-flapping").read_text().split("  - {at_s: 5,")[0]
    t, rows = 5.0, []
    while t < 65:
        rows.append(f"  - {{at_s: {t:g}, event: hw_slowdown, until_s: {t + on:g}}}\n")
        t += on + off
    path = write("flap.yaml", text + "".join(rows))
    monitor, clock = monitor_for(path, "poll_interval_s: 1\ncounters_interval_s: 1\nalerts:\n  for_s: 2\n"
                                       "tuning:\n  apply: false\n")
    events = play(monitor, clock, 40, step=1.0)
    fired = [t for t, _, alert, kind in events if alert == "hw_slowdown" and kind == "firing"]
    assert fired and fired[0] <= 20, events
    state = monitor.states[("hw_slowdown", 0)]
    assert "held the clocks down" in state.check.observed and "(violation counter board_limit)" in state.check.observed


def test_link_and_memory_health_alerts_follow_the_scenario():
    monitor, clock = monitor_for("link-and-memory", FAST + "tuning:\n  apply: false\n")
    events = [(t, alert, what) for t, _, alert, what in play(monitor, clock, 55)
              if alert in ("pcie_link_degraded", "row_remap_pending", "ecc_uncorrected", "row_remap_failure")]
    assert events == [(6.0, "pcie_link_degraded", "firing"),  # Gen2 under load, held for for_s
                      (17.0, "pcie_link_degraded", "resolved"),  # back at 15, clear for clear_for_s
                      (21.0, "row_remap_pending", "firing"),
                      (26.0, "ecc_uncorrected", "firing")]  # the idle Gen1 at 40-50 s is power saving: silent
    gpu = monitor.snapshot.gpus[0].sample
    assert gpu.health.remap_pending and gpu.health.ecc_uncorrected == 1
    alert = next(a for a in monitor.snapshot.alerts if a.alert == "ecc_uncorrected")
    assert alert.severity == "critical" and "1 uncorrected ECC error(s)" in alert.observed


def test_the_counters_are_read_on_every_nth_poll_for_all_gpus_at_once():
    """counters_interval_s on the poll schedule: each GPU timing its own reads drifted with the polls' jitter
    (10 or 11 polls apart, on different polls per GPU)."""
    from harness.fake_nvml import FakeNvml, device
    from gpuwarden.gpu.nvml import NvmlBackend

    cfg = config.parse_text("poll_interval_s: 1\ncounters_interval_s: 3\nmetrics:\n  listen: none\n"
                            "tuning:\n  apply: false\n")
    fake = FakeNvml([device("GPU-a", "00000000:18:00.0"), device("GPU-b", "00000000:3b:00.0")])
    read_on: list[tuple[int, int]] = []
    batch = fake.nvmlDeviceGetFieldValues
    fake.nvmlDeviceGetFieldValues = lambda h, ids: read_on.append((monitor.polls, h.index)) or batch(h, ids)
    clock = ManualClock(0)
    backend = NvmlBackend(fake, clock=clock, counters_interval_s=cfg.counters_interval_s)
    read_on.clear()  # the backend's own first read at start
    monitor = Monitor(cfg, backend, TuningLife(backend, cfg, Tuner(backend)))
    for poll in range(12):
        monitor.tick(clock.now)
        clock.advance(1.3 if poll % 2 else 0.8)  # jitter: a per-GPU timer would drift off the schedule
    assert read_on == [(p, gpu) for p in (1, 4, 7, 10) for gpu in (0, 1)]  # polls counted from 1 once taken
    assert monitor.counters_every() == 3


def test_the_status_line_for_systemd_carries_the_state_not_the_readings():
    monitor, clock = monitor_for("rtx-pro-4000-headless")
    play(monitor, clock, 25)
    samples = [v.sample for v in monitor.snapshot.gpus]
    assert monitor.snapshot.summary_line() == \
        f"2 GPUs · locked 3090 MHz · {activity(samples)} · GPU0 at_design_power (-37%)"
    # the activity to the nearest 10%: the line moves when the work does
    assert monitor.snapshot.summary_line(numbers=False) == \
        f"2 GPUs · locked 3090 MHz · {activity(samples, numbers=False)} · GPU0 at_design_power"


def test_status_is_sent_when_the_state_changes_at_most_every_five_seconds(tmp_path):
    import socket

    from gpuwarden.base.systemd import STATUS_MIN_INTERVAL_S, Notifier

    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(tmp_path / "notify"))
    sock.setblocking(False)
    notifier = Notifier({"NOTIFY_SOCKET": str(tmp_path / "notify")})
    notifier.ready("ok", 0.0)
    for t in range(1, 21):  # a state that flaps every poll for 20 s, then settles on "b"
        notifier.status("a" if t % 2 else "b", float(t))
    for t in range(21, 30):
        notifier.status("b", float(t))
    sent = []
    while True:
        try:
            sent.append(sock.recv(4096).decode())
        except BlockingIOError:
            break
    sock.close()
    assert STATUS_MIN_INTERVAL_S == 5.0
    assert sent == ["READY=1\nSTATUS=ok", "STATUS=a", "STATUS=b", "STATUS=a", "STATUS=b"]  # t = 0, 5, 10, 15, 20


def nvlink_events(scenario, until, alerts=("nvlink_degraded", "nvlink_errors", "fabric_not_ready")):
    monitor, clock = monitor_for(scenario, FAST + "counters_interval_s: 2\ntuning:\n  apply: false\n")
    return [(t, gpu, alert, what) for t, gpu, alert, what in play(monitor, clock, until) if alert in alerts], monitor


def test_an_nvlink_link_down_or_slow_is_nvlink_degraded():
    events, monitor = nvlink_events("nvlink-down", 40)
    assert events == [(11.0, 1, "nvlink_degraded", "firing"),  # down at 10 s, held for for_s
                      (16.0, 2, "nvlink_degraded", "firing"),  # half speed from 15 s
                      (32.0, 1, "nvlink_degraded", "resolved")]  # back at 30 s, clear for clear_for_s
    alert = next(a for a in monitor.snapshot.alerts if a.alert == "nvlink_degraded" and a.gpu == 2)
    assert alert.observed == "NVLink link 7 at 13281 of 26562 MB/s; 18 of 18 links up"


def test_nvlink_replays_fire_and_crc_errors_below_100_a_second_do_not():
    events, monitor = nvlink_events("nvlink-errors", 60)
    # Replays from 10 s, seen by the first counters read after (every 4th poll at 0.5 s: 12 s), firing at once;
    # the growth leaves the 10 s window at 30 s, then clear_for_s. GPU 0's 20 CRC errors a second never fire.
    assert events == [(12.0, 2, "nvlink_errors", "firing"), (32.0, 2, "nvlink_errors", "resolved")]
    check = next(s.check for (name, gpu), s in monitor.states.items() if name == "nvlink_errors" and gpu == 2)
    assert check.observed.startswith("NVLink errors in the last 10 s: link 3 replay +")
    assert monitor.snapshot.gpus[0].sample.health.nvlinks[4].crc >= 1000


def test_a_fabric_that_is_not_ready_fires_after_a_minute_and_resolves_when_it_completes():
    events, _ = nvlink_events("fabric-not-ready", 110)
    assert events == [(60.0, gpu, "fabric_not_ready", "firing") for gpu in range(4)] + \
        [(102.0, gpu, "fabric_not_ready", "resolved") for gpu in range(4)]


def test_an_nvlink_host_idle_then_loaded_raises_no_warning():
    monitor, clock = monitor_for("h100-nvswitch", FAST + "tuning:\n  apply: false\n")
    assert [e for e in play(monitor, clock, 50) if e[3] == "firing"] == []
    assert monitor.snapshot.summary_line() == "4 GPUs · read-only · SM 0%, tensor 0%, DRAM 0% · ok"  # idle H100s


def test_nvlink_and_fabric_metrics_come_from_the_snapshot():
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from gpuwarden.web.exposition import make_registry

    events, monitor = nvlink_events("nvlink-down", 16)
    text = generate_latest(make_registry(lambda: monitor.snapshot)).decode()
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in text_string_to_metric_families(text) for s in f.samples}
    assert samples[("gpuwarden_gpu_nvlink_links", (("gpu", "1"),))] == 18
    assert samples[("gpuwarden_gpu_nvlink_links_up", (("gpu", "1"),))] == 17
    assert samples[("gpuwarden_gpu_nvlink_link_up", (("gpu", "1"), ("link", "5")))] == 0
    assert samples[("gpuwarden_gpu_nvlink_link_speed_bytes_per_second", (("gpu", "2"), ("link", "7")))] == 13281e6
    assert samples[("gpuwarden_gpu_nvlink_errors_total", (("gpu", "0"), ("kind", "replay")))] == 0
    assert samples[("gpuwarden_gpu_fabric_ready", (("gpu", "3"),))] == 1
    assert samples[("gpuwarden_alert_active", (("alert", "nvlink_degraded"), ("gpu", "1"), ("severity", "warning")))] \
        == 1
    pcie, clock = monitor_for("rtx-pro-4000-headless")
    text = generate_latest(make_registry(lambda: pcie.tick(clock.now))).decode()
    assert "gpuwarden_gpu_nvlink_links{" not in text and "gpuwarden_gpu_fabric_ready{" not in text
