"""Tuning plan / apply / verify / restore on the simulator, for every built-in scenario."""

import pytest

from gpuwarden import config
from gpuwarden.backends import open_configured
from gpuwarden.gpu import errors
from gpuwarden.gpu.sim.backend import ManualClock
from gpuwarden.gpu.sim.scenario import builtin_scenarios, resolve_scenario
from gpuwarden.tune.tuning import Tuner, make_plan
from gpuwarden.base.yamlfile import ConfigErrors


def setup(scenario, tuning="", clock=None):
    cfg = config.parse_text(f"gpu:\n  backend: sim\n  scenario: {scenario}\n{tuning}", name="test.yaml")
    return cfg, open_configured(cfg, clock or ManualClock())


# H100 SXM cards: they boost by themselves
DATACENTER = {"h100-nvswitch", "nvlink-down", "nvlink-errors", "fabric-not-ready", "nvlink-iommu", "xid79",
              "xid48-row-remap", "recovery-action"}


@pytest.mark.parametrize("scenario", [s for s in builtin_scenarios() if s != "gpu-lost-at-start"])
def test_plan_apply_verify_restore(scenario):  # gpu-lost-at-start: its GPU 1 has no plan at t=0 (test_monitor)
    cfg, backend = setup(scenario)
    before = {g.index: g.sample() for g in backend.gpus()}
    plan = make_plan(backend, cfg)
    # The plan is data: making it changed nothing.
    assert {g.index: g.sample() for g in backend.gpus()} == before
    assert {a.setting for a in plan.actions} == {"persistence_mode", "gpu_clocks"}
    # gpu_clocks: auto locks the max, except on the H100s, which boost by themselves.
    top = {g.index: None if scenario in DATACENTER else (g.capabilities().graphics_clocks_mhz[0],) * 2
           for g in backend.gpus()}
    for action in plan.actions:
        if action.setting == "gpu_clocks":
            assert action.target == top[action.gpu] and action.change == (scenario not in DATACENTER)
            assert action.current == before[action.gpu].sm_clock_mhz
            assert action.note.startswith("left unlocked: a datacenter card" if scenario in DATACENTER else "auto: ")

    tuner = Tuner(backend)
    applied = tuner.apply(plan)
    assert applied and all(o.ok for o in applied), [o.describe() for o in applied]
    verified = tuner.verify(plan)
    assert verified and all(o.ok for o in verified), [o.describe() for o in verified]
    left_to_persistenced = backend.persistenced_running()  # then persistence mode stays as the daemon keeps it
    for gpu in backend.gpus():
        assert gpu.gpu_lock == top[gpu.index] and gpu.persistence != left_to_persistenced

    restored = tuner.restore()
    assert restored and all(o.ok for o in restored)
    for gpu in backend.gpus():
        assert gpu.gpu_lock is None and gpu.persistence is False
        assert gpu.sample().sm_clock_mhz == before[gpu.index].sm_clock_mhz
    assert tuner.restore() == []  # nothing left to restore


def test_max_memory_clock_and_power_limit_are_applied_and_restored():
    cfg, backend = setup("rtx-pro-4000-headless", "tuning:\n  memory_clocks: max\n  power_limit_w: 130\n")
    plan = make_plan(backend, cfg)
    by_setting = {(a.gpu, a.setting): a for a in plan.actions}
    assert by_setting[(0, "memory_clocks")].target == (14001, 14001)
    assert by_setting[(0, "power_limit_w")].current == 145 and by_setting[(0, "power_limit_w")].target == 130
    tuner = Tuner(backend)
    assert all(o.ok for o in tuner.apply(plan) + tuner.verify(plan))
    gpu = backend.gpus()[0]
    assert gpu.sample().power_limit_w == 130 and gpu.memory_lock == (14001, 14001)
    tuner.restore()
    assert gpu.sample().power_limit_w == 145 and gpu.memory_lock is None


def test_power_limit_outside_constraints_is_a_config_error_naming_gpu_value_and_range():
    cfg, backend = setup("rtx-pro-4000-headless", "tuning:\n  power_limit_w: 160\n")
    with pytest.raises(ConfigErrors) as info:
        make_plan(backend, cfg)
    lines = [str(e) for e in info.value.errors]
    assert lines == ["test.yaml:5: tuning.power_limit_w: GPUs 0, 1 (NVIDIA RTX PRO 4000 Blackwell): "
                     "160 W is outside this GPU's power constraints (allowed 70-145 W)"]  # once, naming both GPUs
    cfg, backend = setup("rtx-pro-4000-headless", "tuning:\n  gpus:\n    \"1\": {power_limit_w: 160}\n")
    with pytest.raises(ConfigErrors) as info:
        make_plan(backend, cfg)
    uuid1 = backend.gpus()[1].uuid
    assert [str(e) for e in info.value.errors] == [
        f"test.yaml:6: tuning.gpus.1.power_limit_w: GPU 1 (NVIDIA RTX PRO 4000 Blackwell, {uuid1}): "
        "160 W is outside this GPU's power constraints (allowed 70-145 W)"]


def test_unsupported_clock_is_a_config_error_at_the_override_line():
    cfg, backend = setup("rtx-pro-4000-headless", "tuning:\n  gpus:\n    \"1\":\n      gpu_clocks: [2400, 3500]\n")
    with pytest.raises(ConfigErrors) as info:
        make_plan(backend, cfg)
    (problem,) = info.value.errors
    assert problem.line == 7 and problem.key == "tuning.gpus.1.gpu_clocks"
    assert "GPU 1" in problem.message and "[2400, 3500] MHz is not supported" in problem.message
    assert problem.allowed == "allowed 180-3090 MHz"


def test_override_for_a_missing_gpu_is_a_config_error():
    cfg, backend = setup("dgx-spark", "tuning:\n  gpus:\n    \"3\": {gpu_clocks: max}\n")
    with pytest.raises(ConfigErrors) as info:
        make_plan(backend, cfg)
    assert str(info.value.errors[0]).startswith("test.yaml:6: tuning.gpus.3: no such GPU on this host (GPU indices 0-0")


def test_power_limit_on_a_card_without_one_is_a_config_error():
    cfg, backend = setup("dgx-spark", "tuning:\n  power_limit_w: 100\n")
    with pytest.raises(ConfigErrors, match="setting a power limit is not supported on this GPU"):
        make_plan(backend, cfg)


def test_per_gpu_override_by_index_and_uuid():
    _, probe = setup("rtx-pro-6000-tp4")
    uuid3 = probe.gpus()[3].uuid
    cfg, backend = setup("rtx-pro-6000-tp4", f"tuning:\n  gpus:\n    \"1\": {{gpu_clocks: [2400, 2400]}}\n"
                                             f"    {uuid3}: {{gpu_clocks: none}}\n")
    targets = {a.gpu: a.target for a in make_plan(backend, cfg).actions if a.setting == "gpu_clocks"}
    assert targets == {0: (3090, 3090), 1: (2400, 2400), 2: (3090, 3090)}


def test_nvidia_persistenced_is_noted_and_persistence_left_alone(write):
    text = resolve_scenario("lock-lost").read_text().replace("as_root: true",
                                                             "as_root: true\nnvidia_persistenced: true")
    cfg = config.parse_text(f"gpu:\n  backend: sim\n  scenario: {write('p.yaml', text)}\n")
    backend = open_configured(cfg, ManualClock())
    plan = make_plan(backend, cfg)
    assert any("nvidia-persistenced is running" in n for n in plan.notes)
    (persistence,) = [a for a in plan.actions if a.setting == "persistence_mode"]
    assert not persistence.change and persistence.note == "left to nvidia-persistenced"
    Tuner(backend).apply(plan)
    assert backend.gpus()[0].persistence is False


@pytest.mark.parametrize("state,fix", [("absent", "install nvidia-persistenced (Debian: non-free"),
                                       ("stopped", "`systemctl enable --now nvidia-persistenced`")])
def test_without_nvidia_persistenced_the_plan_says_once_that_it_falls_back_to_nvml(write, state, fix):
    text = resolve_scenario("lock-lost").read_text().replace("as_root: true",
                                                             f"as_root: true\nnvidia_persistenced: {state}")
    cfg = config.parse_text(f"gpu:\n  backend: sim\n  scenario: {write('p.yaml', text)}\n")
    backend = open_configured(cfg, ManualClock())
    plan = make_plan(backend, cfg)
    (note,) = [n for n in plan.notes if "nvidia-persistenced" in n]
    where = "not installed" if state == "absent" else "installed but not running"
    assert note.startswith(f"nvidia-persistenced is {where}: gpuwarden falls back to NVML's persistence-mode "
                           "setter on GPU 0") and fix in note
    Tuner(backend).apply(plan)
    assert backend.gpus()[0].persistence is True
    # Once on, nothing falls back: nothing more to say.
    assert not [n for n in make_plan(backend, cfg).notes if "nvidia-persistenced" in n]


def test_no_permission_is_reported_not_raised(write):
    text = resolve_scenario("lock-lost").read_text().replace("as_root: true", "as_root: false")
    cfg = config.parse_text(f"gpu:\n  backend: sim\n  scenario: {write('u.yaml', text)}\n")
    backend = open_configured(cfg, ManualClock())
    outcomes = Tuner(backend).apply(make_plan(backend, cfg))
    assert outcomes and all(not o.ok and o.error is errors.NoPermission for o in outcomes)
    assert "needs root or CAP_SYS_ADMIN" in outcomes[0].message


def test_verify_catches_a_lock_lost_to_a_driver_reload():
    clock = ManualClock()
    cfg, backend = setup("lock-lost", clock=clock)
    plan = make_plan(backend, cfg)
    tuner = Tuner(backend)
    tuner.apply(plan)
    assert all(o.ok for o in tuner.verify(plan))
    clock.advance(10)  # driver reload
    failed = [o for o in tuner.verify(plan) if not o.ok]
    assert {o.action.setting for o in failed} == {"persistence_mode", "gpu_clocks"}
    assert "reads 180 MHz, outside the lock" in [o.message for o in failed if o.action.setting == "gpu_clocks"][0]


def test_verify_accepts_a_clock_held_below_the_lock_by_power_cap():
    clock = ManualClock()
    cfg, backend = setup("rtx-pro-4000-headless", clock=clock)
    plan = make_plan(backend, cfg)
    tuner = Tuner(backend)
    tuner.apply(plan)
    clock.advance(25)  # GPU 0 power-capped
    (check,) = [o for o in tuner.verify(plan) if o.action.gpu == 0 and o.action.setting == "gpu_clocks"]
    assert check.ok and "held below the lock by SwPowerCap" in check.message


def test_down_gpu_gets_no_actions_and_a_note():
    clock = ManualClock(15)  # GPU 1 is lost between 10 s and 20 s
    cfg, backend = setup("gpu-lost", clock=clock)
    plan = make_plan(backend, cfg)
    assert [len(g.actions) for g in plan.gpus] == [2, 0]
    assert any("GPU 1" in n and "down" in n for n in plan.notes)


def test_originals_survive_a_restart_of_the_daemon_in_the_same_boot(tmp_path):
    from gpuwarden.tune.originals import OriginalsStore

    cfg, backend = setup("rtx-pro-4000-headless", "tuning:\n  power_limit_w: 120\n")
    store = OriginalsStore(tmp_path / "originals.json", boot="boot-1")
    Tuner(backend, store).apply(make_plan(backend, cfg))  # then the daemon crashes; the cards keep the tuning
    assert backend.gpus()[0].power_limit_w == 120
    restarted = Tuner(backend, OriginalsStore(tmp_path / "originals.json", boot="boot-1"))
    restarted.apply(make_plan(backend, cfg))  # a restart re-applies: the tuned values must not become "original"
    assert all(o.ok for o in restarted.restore())
    gpu = backend.gpus()[0]
    assert gpu.power_limit_w == 145 and gpu.gpu_lock is None and gpu.persistence is False  # what the card had
    # Another boot: the file is stale (a reboot reset the cards), so nothing is restored from it.
    Tuner(backend, store).apply(make_plan(backend, cfg))
    assert Tuner(backend, OriginalsStore(tmp_path / "originals.json", boot="boot-2")).restore() == []
