"""The settings table: a new setting is one Tunable, and config, plan, apply, verify, restore, the originals
file and `plan`'s output all take it without another change (here a workload profile, as Blackwell has)."""

import json

import pytest

from gpuwarden import config
from gpuwarden.tune import tunables
from gpuwarden.backends import open_configured
from gpuwarden.gpu.sim.backend import ManualClock
from gpuwarden.tune.originals import OriginalsStore
from gpuwarden.tune.tunables import Step, Tunable, Unfit
from gpuwarden.gpu.base import GpuBoard, GpuSample
from gpuwarden.tune.tuning import Tuner, TuningLife, make_plan
from gpuwarden.base.yamlfile import ConfigErrors

PROFILES = ("default", "compute", "low_latency")


class WorkloadProfile(Tunable):
    """A stand-in for NVML's workload power profiles: the card's value lives in `profiles`."""

    key, default, records_original = "workload_profile", None, True

    def __init__(self):
        self.profiles: dict[str, str] = {}  # uuid -> profile in force
        self.calls: list[tuple[str, str]] = []

    def parse(self, r, path, default):
        return r.string(path, default if default is not None else "none", PROFILES + ("none",))

    def plan(self, wanted, sample, caps, persistenced):
        if wanted in (None, "none"):
            return None
        if sample.compute_capability != "12.0":
            raise Unfit("workload profiles need a Blackwell GPU", "none")
        current = self.profiles.get(sample.uuid, "default")
        return Step(current, wanted, current != wanted)

    def set(self, gpu, value):
        self.calls.append((gpu.uuid, value))
        self.profiles[gpu.uuid] = value

    def verify(self, step, sample):
        now = self.profiles.get(sample.uuid, "default")
        return now == step.target, f"reads {now}"

    def undo(self, original, locked):
        return original is not None, original

    def show(self, value, current):
        return "unreadable" if value is None else str(value)


@pytest.fixture
def profile(monkeypatch):
    fake = WorkloadProfile()
    monkeypatch.setattr(tunables, "TUNABLES", tunables.TUNABLES + (fake,))
    monkeypatch.setitem(tunables.BY_KEY, fake.key, fake)
    return fake


def test_a_new_setting_goes_through_config_plan_apply_verify_and_restore(profile, tmp_path):
    text = ("gpu:\n  backend: sim\n  scenario: rtx-pro-6000-tp4\ntuning:\n  workload_profile: compute\n"
            "  gpus:\n    \"1\": {workload_profile: low_latency}\n")
    cfg = config.parse_text(text, "t.yaml")
    assert cfg.tuning.default.workload_profile == "compute"
    assert cfg.tuning.for_gpu(1, "GPU-x").workload_profile == "low_latency"
    assert config.parse_text(config_text(cfg)).tuning == cfg.tuning  # as_dict writes it back
    backend = open_configured(cfg, ManualClock())
    plan = make_plan(backend, cfg)
    wanted = {a.gpu: a for a in plan.actions if a.setting == "workload_profile"}
    assert wanted[0].target == "compute" and wanted[1].target == "low_latency"
    assert "GPU 0 workload_profile: default -> compute" in [a.describe() for a in plan.actions]

    store = OriginalsStore(tmp_path / "originals.json", boot="b")
    tuner = Tuner(backend, store)
    assert all(o.ok for o in tuner.apply(plan) + tuner.verify(plan))
    uuids = [g.uuid for g in backend.gpus()]
    assert profile.profiles[uuids[0]] == "compute" and profile.profiles[uuids[1]] == "low_latency"
    saved = json.loads((tmp_path / "originals.json").read_text())
    assert saved["gpus"][uuids[0]]["workload_profile"] == "default"  # recorded before the first change

    # A restarted daemon restores it from the originals file, like the built-in settings.
    restored = Tuner(backend, store).restore()
    assert ("workload_profile" in {o.action.setting for o in restored}) and all(o.ok for o in restored)
    assert profile.profiles[uuids[0]] == "default"


def test_a_card_that_cannot_take_the_new_setting_is_a_config_error_at_its_line(profile):
    text = "gpu:\n  backend: sim\n  scenario: dgx-spark\ntuning:\n  workload_profile: compute\n"
    cfg = config.parse_text(text, "t.yaml")
    with pytest.raises(ConfigErrors) as caught:
        make_plan(open_configured(cfg, ManualClock()), cfg)
    assert "t.yaml:5: tuning.workload_profile: GPU 0" in str(caught.value)
    assert "workload profiles need a Blackwell GPU" in str(caught.value)


def test_the_new_key_is_validated_like_the_others(profile):
    with pytest.raises(ConfigErrors) as caught:
        config.parse_text("tuning:\n  workload_profile: turbo\n", "t.yaml")
    assert "t.yaml:2: tuning.workload_profile" in str(caught.value)


def config_text(cfg) -> str:
    import yaml

    return yaml.safe_dump(cfg.as_dict())


@pytest.mark.parametrize("card,locks,why", [
    (dict(compute_capability="9.0", board=GpuBoard("NVIDIA", "sxm", 1755)), False,
     "a datacenter card (NVIDIA, SXM, default 1755 MHz) boosts to 1980 MHz by itself; a lock buys nothing"),
    (dict(compute_capability="8.0", board=GpuBoard("Tesla", "pcie")), False, "a datacenter card (Tesla, PCIe)"),
    (dict(compute_capability="12.0", board=GpuBoard("NVIDIA RTX", "pcie")), True,
     "SM12.0 (NVIDIA RTX, PCIe): headless SM12x cards idle low under load"),
    (dict(compute_capability="8.9", board=GpuBoard("NVIDIA RTX", "pcie")), True, "a workstation card (NVIDIA RTX"),
    (dict(compute_capability="8.9", board=GpuBoard()), True, "the card does not say its class"),
    # Seen busy at an idle clock with nothing holding it down: locked, whatever it says it is.
    (dict(compute_capability="9.0", board=GpuBoard("NVIDIA", "sxm"), utilization_pct=90, sm_clock_mhz=345), True,
     "busy at 345 MHz with no throttle reason: it idles low under load"),
])
def test_gpu_clocks_auto_locks_what_needs_it_and_says_why(card, locks, why):
    sample = GpuSample(0, "GPU-0", "card", "0000:01:00.0", **{"sm_clock_mhz": 1980, "max_graphics_clock_mhz": 1980,
                                                                "utilization_pct": 0, **card})
    lock, reason = tunables.clock_class(sample)
    assert lock == locks and reason.startswith(why)


def test_auto_leaves_a_datacenter_card_unlocked_and_a_reload_from_max_resets_its_lock():
    cfg = config.parse_text("gpu:\n  backend: sim\n  scenario: h100-nvswitch\ntuning:\n  gpu_clocks: max\n")
    backend = open_configured(cfg, ManualClock())
    tuning = TuningLife(backend, cfg, Tuner(backend))
    tuning.start(tuning.check(cfg))
    assert backend.gpus()[0].gpu_lock == (1980, 1980) and tuning.locks[0][0] == (1980, 1980)
    auto = config.parse_text("gpu:\n  backend: sim\n  scenario: h100-nvswitch\n")
    tuning.reload(auto, tuning.check(auto))
    assert backend.gpus()[0].gpu_lock is None and tuning.locks[0][0] is None  # nothing to measure against
    (action,) = [a for a in tuning.plan.actions if a.gpu == 0 and a.setting == "gpu_clocks"]
    assert not action.change and action.describe().startswith("GPU 0 gpu_clocks: 1980 MHz now, no change (left "
                                                               "unlocked: a datacenter card (NVIDIA, SXM)")
