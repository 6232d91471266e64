"""`gpuwarden doctor` on every sim scenario: findings, severities and exit status."""

import json
import subprocess
from types import SimpleNamespace

import pytest

from conftest import DEFAULT_CONFIG, gpuwarden_cmd, subprocess_env
from gpuwarden import config
from gpuwarden.watch.doctor import diagnose, exit_status
from gpuwarden.backends import open_configured
from gpuwarden.gpu.sim import power
from gpuwarden.gpu.sim.backend import ManualClock
from gpuwarden.gpu.sim.scenario import builtin_scenarios, resolve_scenario
from gpuwarden.tune.tuning import Tuner, make_plan
from test_sim import BIG_TEXT, HOSTILE_LOADS, UNIT_CAPS, nobody_channel, plant  # noqa: F401 (the fixture)

# Untuned, as every scenario boots: the headless SM120 cards stay at 180 MHz while busy (an error);
# the DGX Spark boosts, so only its persistence mode is off (a warning).
EXPECTED_EXIT = {"rtx-pro-4000-headless": 2, "rtx-pro-6000-tp4": 2, "dgx-spark": 1, "lock-lost": 2,
                 "gpu-lost": 2, "thermal": 2, "persistenced-no-persistence": 2, "hw-slowdown-flapping": 1,
                 "gpu-lost-at-start": 2, "link-and-memory": 1, "h100-nvswitch": 1, "nvlink-down": 1,
                 "nvlink-errors": 1, "fabric-not-ready": 2, "nvlink-iommu": 1, "xid79": 1, "xid48-row-remap": 1,
                 "recovery-action": 1, "rtx-pro-6000-server-x2": 1, "rtx-pro-6000-server-x4-lost": 1}
BOOSTING = ("hw-slowdown-flapping", "link-and-memory", "h100-nvswitch", "nvlink-down", "nvlink-errors",
            "fabric-not-ready", "nvlink-iommu", "xid79", "xid48-row-remap", "recovery-action", "rtx-pro-6000-server-x2",
            "rtx-pro-6000-server-x4-lost")


@pytest.mark.parametrize("scenario", builtin_scenarios())
def test_doctor_on_every_scenario(cli, scenario):
    status, out, _ = cli("doctor", "--json", "-c", DEFAULT_CONFIG, "--sim", scenario)
    report = json.loads(out)
    assert status == EXPECTED_EXIT[scenario] == report["exit_status"]
    checks = {f["check"]: f for f in report["findings"]}
    assert checks["driver"]["severity"] == "ok"
    if scenario == "persistenced-no-persistence":  # left to nvidia-persistenced: nothing to fix
        assert checks["GPU0 persistence"]["severity"] == "info" and not checks["GPU0 persistence"]["fix"]
    else:
        assert checks["GPU0 persistence"]["severity"] == "warning" and checks["GPU0 persistence"]["fix"]
    assert checks["vLLM"]["severity"] == "info"  # serving is off in the default config
    if scenario == "dgx-spark":
        assert checks["GPU0 power limit"]["severity"] == "info" and checks["GPU0 clocks"]["severity"] == "ok"
    elif scenario in BOOSTING:  # they boost, and at t=0 nothing has happened
        assert checks["GPU0 clocks"]["severity"] == "ok"
    else:
        assert checks["GPU0 clocks"]["severity"] == "error"
        assert "busy but stuck low with no throttle reason" in checks["GPU0 clocks"]["message"]
        assert "gpu_clocks: max" in checks["GPU0 clocks"]["fix"]


def test_doctor_is_happy_once_tuned():
    cfg = config.parse_text("gpu:\n  backend: sim\n  scenario: rtx-pro-4000-headless\n")
    backend = open_configured(cfg, ManualClock())
    Tuner(backend).apply(make_plan(backend, cfg))
    findings = diagnose(cfg, backend, deep=False)
    assert exit_status(findings) == 0, [str(f) for f in findings]
    assert {f.severity for f in findings} <= {"ok", "info"}


def test_doctor_reports_throttling_and_a_low_power_limit():
    clock = ManualClock()
    cfg = config.parse_text("gpu:\n  backend: sim\n  scenario: rtx-pro-4000-headless\n")
    backend = open_configured(cfg, clock)
    gpu = backend.gpus()[0]
    gpu.set_gpu_locked_clocks(3090, 3090)
    gpu.set_power_limit_w(100)
    findings = {f.check: f for f in diagnose(cfg, backend, deep=False)}
    assert findings["GPU0 clocks"].severity == "warning" and "SwPowerCap" in findings["GPU0 clocks"].message
    assert findings["GPU0 clocks"].fix == "tuning.power_limit_w: 145 adds 45 W"
    assert findings["GPU0 power limit"].severity == "warning"
    assert "100 W (allowed 70-145 W): below the card's maximum" in findings["GPU0 power limit"].message


def test_doctor_lints_the_vllm_command(write, cli, child_user):
    path = write("g.yaml", "gpu:\n  backend: sim\n  scenario: dgx-spark\nserve:\n  enabled: true\n"
                 f"  user: {child_user}\n"
                 "  model: /m/Qwen3-4B\n  args: [--api-key, k, --enforce-eager]\n")
    status, out, _ = cli("doctor", "--no-deep", "-c", path)
    assert status == 2
    assert "ERROR   vLLM lint api-key-on-command-line: --api-key on the command line shows in ps [source: ps(1)" \
           " shows every process's full command line to every local user; not a bug: by design upstream as of vLLM" \
           " 0.32.0] -> fix: put VLLM_API_KEY=... in" in out
    assert "WARNING vLLM lint enforce-eager" in out
    assert "WARNING vLLM lint gb10-memory-utilization" in out  # a DGX Spark without --kv-cache-memory-bytes
    assert "OK      vLLM profile: sm121-gpt-oss-120b for /m/Qwen3-4B" in out


def test_doctor_text_is_one_line_per_finding(cli):
    status, out, _ = cli("doctor", "-c", DEFAULT_CONFIG, "--sim", "dgx-spark")
    lines = out.strip().splitlines()
    assert status == 1 and len(lines) == 8  # the GPU's health among them
    assert "INFO    GPU0 GPM: SM, tensor and DRAM activity not read: scenario dgx-spark models this NVIDIA GB10 " \
        "without it (gpm in its not_supported)" in lines  # GB10's GPM is unconfirmed: the scenario says no
    assert all(line.split()[0] in ("OK", "INFO", "WARNING", "ERROR") for line in lines)
    # What the configured tuning sets, from the plan (which walks the settings table).
    assert any(line.startswith("INFO    GPU0 tuning: set by `gpuwarden apply` or the service: persistence_mode: off "
                               "-> on; gpu_clocks: 3003 MHz now -> lock 3003-3003 MHz (auto: SM12.1") for line in lines)


def test_doctor_names_the_config_line_a_card_cannot_take(cli, write):
    conf = write("g.yaml", "tuning:\n  power_limit_w: 900\n")
    status, out, _ = cli("doctor", "--no-deep", "-c", conf, "--sim", "rtx-pro-4000-headless")
    assert status == 2
    assert f"ERROR   tuning: {conf}:2: tuning.power_limit_w: GPUs 0, 1 (NVIDIA RTX PRO 4000 Blackwell): 900 W is " \
           "outside this GPU's power constraints (allowed 70-145 W)" in out


def test_doctor_calls_a_cap_at_the_maximum_limit_the_design_power():
    # As on the lent H200 under a bf16 matmul: 693 of 700 W, SwPowerCap, the limit is the card's maximum.
    clock = ManualClock()
    cfg = config.parse_text("gpu:\n  backend: sim\n  scenario: rtx-pro-4000-headless\n")
    backend = open_configured(cfg, clock)
    backend.gpus()[0].set_gpu_locked_clocks(3090, 3090)
    clock.advance(21)  # GPU 0 at full load from t=20: capped at its 145 W maximum
    findings = {f.check: f for f in diagnose(cfg, backend, deep=False)}
    clocks = findings["GPU0 clocks"]
    assert clocks.severity == "ok" and clocks.message.startswith("at its design power (SwPowerCap at its maximum "
                                                                 "limit, 145 W)")
    assert findings["GPU0 power limit"].severity == "ok"


def test_iommu_state(tmp_path):
    from gpuwarden.gpu.iommu import iommu_state

    iommu, cmdline = tmp_path / "iommu", tmp_path / "cmdline"
    iommu.mkdir()
    cmdline.write_text("BOOT_IMAGE=/vmlinuz ro quiet\n")
    assert iommu_state(iommu, cmdline) == "off"
    (iommu / "dmar0").mkdir()
    assert iommu_state(iommu, cmdline) == "translating"
    cmdline.write_text("BOOT_IMAGE=/vmlinuz ro iommu=pt\n")
    assert iommu_state(iommu, cmdline) == "passthrough"
    assert iommu_state(tmp_path / "none", cmdline) == "off"


def test_doctor_reports_the_link_the_memory_and_the_peer_path_for_tensor_parallelism(write):
    # PCIe cards (a host bridge between each pair, the simulator's default) on a host whose IOMMU translates.
    scenario = write("pcie.yaml", resolve_scenario("rtx-pro-6000-tp4").read_text().replace(
        "driver_version:", "iommu: translating\ndriver_version:"))
    cfg = config.parse_text(f"gpu:\n  backend: sim\n  scenario: {scenario}\nserve:\n  enabled: true\n"
                            "  model: /m/GLM-4.7-NVFP4\n  user: nobody\n")
    findings = {f.check: f for f in diagnose(cfg, open_configured(cfg, ManualClock()), deep=False)}
    assert findings["GPU0 PCIe"].severity == "ok" and findings["GPU0 PCIe"].message.startswith("Gen5 x16 of Gen5 x16")
    assert findings["GPU0 memory"].severity == "ok"
    peer = findings["vLLM lint tp-pcie-iommu"]  # the GLM profile runs tensor parallelism 4
    assert peer.severity == "warning" and "tensor parallelism 4" in peer.message and "iommu=pt" in peer.fix
    assert "vllm-project/vllm#33041" in peer.message
    paths = findings["GPU peer paths"]
    assert paths.severity == "info" and paths.message.startswith(
        "tensor parallelism 4: a PCIe host bridge between all 6 pairs; IOMMU translating: peer traffic over PCIe")
    assert "GPU0 NVLink" not in findings and "GPU0 fabric" not in findings  # PCIe cards: nothing to say


def test_an_nvlink_host_with_a_translating_iommu_gets_no_advice_to_turn_p2p_off():
    """NCCL_P2P_DISABLE=1 and --disable-custom-all-reduce would take NVLink away from the engine: the lint
    fires only where peer traffic crosses the IOMMU over PCIe."""
    cfg = config.parse_text("gpu:\n  backend: sim\n  scenario: nvlink-iommu\nserve:\n  enabled: true\n"
                            "  model: /m/Qwen3-32B\n  user: nobody\n  args: [--tensor-parallel-size, '4']\n")
    findings = {f.check: f for f in diagnose(cfg, open_configured(cfg, ManualClock()), deep=False)}
    assert not [c for c in findings if "tp-pcie-iommu" in c]
    paths = findings["GPU peer paths"]
    assert (paths.severity, paths.message) == ("ok", "tensor parallelism 4: NVLink (6 links a pair) between all 6 "
                                                     "pairs; IOMMU translating")
    assert findings["GPU2 NVLink"].message == ("18 of 18 links up at 26562 MB/s to GPU0, GPU1, GPU3; errors since "
                                               "the driver loaded: replay 0, recovery 0, crc 0")
    # One pair over PCIe in the same group: the advice comes back, naming that pair.
    from gpuwarden.serving.lint.checks import iommu_translating

    ctx = SimpleNamespace(iommu="translating", tp_size=4, peer_paths=((0, 1, "nvlink"), (2, 3, "host_bridge")))
    assert iommu_translating(ctx)["facts"] == ["the IOMMU translates DMA", "GPU2-GPU3 over a PCIe host bridge"]
    assert iommu_translating(SimpleNamespace(iommu="translating", tp_size=2, peer_paths=((0, 1, "nvswitch"),))) \
        is None


def test_doctor_on_a_degraded_link_and_pending_remap():
    clock = ManualClock()
    cfg = config.parse_text("gpu:\n  backend: sim\n  scenario: link-and-memory\n")
    backend = open_configured(cfg, clock)
    clock.advance(26)
    findings = {f.check: f for f in diagnose(cfg, backend, deep=False)}
    assert findings["GPU0 memory"].severity == "error" and "1 uncorrected ECC" in findings["GPU0 memory"].message
    clock.advance(15)  # 41 s: idle at Gen1, which is power saving
    findings = {f.check: f for f in diagnose(cfg, backend, deep=False)}
    assert findings["GPU0 PCIe"].severity == "info" and "Gen1 x16 of Gen5 x16" in findings["GPU0 PCIe"].message


def test_doctor_names_the_metrics_a_running_vllm_no_longer_serves(write, cli, child_user, monkeypatch):
    served = {"vllm:generation_tokens_total": 5.0, "vllm:prompt_tokens_total": 9.0,
              "vllm:num_requests_running": 0.0, "vllm:num_requests_waiting": 0.0,
              "vllm:prefix_cache_queries_total": 0.0, "vllm:prefix_cache_hits_total": 0.0}
    monkeypatch.setattr("gpuwarden.serving.probe.metrics.fetch", lambda url: served)
    path = write("g.yaml", "gpu:\n  backend: sim\n  scenario: rtx-pro-4000-headless\nserve:\n  enabled: true\n"
                 f"  user: {child_user}\n  model: /m/Qwen3-4B\n")
    status, out, _ = cli("doctor", "--no-deep", "-c", path)
    assert "WARNING vLLM metrics: this vLLM no longer serves vllm:kv_cache_usage_perc or " \
           "vllm:gpu_cache_usage_perc: gpuwarden's serving metrics and stall alert go blind" in out
    served["vllm:kv_cache_usage_perc"] = 0.1
    status, out, _ = cli("doctor", "--no-deep", "-c", path)
    assert "OK      vLLM metrics: serves every metric gpuwarden reads (7 series)" in out


def test_doctor_says_when_the_lint_rules_are_older_than_the_installed_vllm(monkeypatch):
    from gpuwarden.watch.doctor import _installed
    from gpuwarden.serving.compose.engines import rules_for
    from gpuwarden.serving.compose.engines.vllm import ENGINE
    from gpuwarden.serving.lint.packages import Installed

    written = rules_for(None).written_against
    newer = Installed("/py", True, {"vllm": "0.34.1", "flashinfer": None, "torch": "2.14.0", "sglang": None})
    lines = _installed(newer, ENGINE, written)
    assert lines[1].severity == "warning" and lines[1].message.startswith(
        "written against vLLM 0.32.0 at the newest; the installed 0.34.1 is newer")
    same = Installed("/py", True, {"vllm": "0.32.0+cpu", "flashinfer": None, "torch": "2.13.0", "sglang": None})
    assert len(_installed(same, ENGINE, written)) == 1  # a local build of the same release is not newer


def test_doctor_counts_one_replay_and_names_the_persistenced_command(write, monkeypatch):
    from harness.fake_nvml import FakeNvml, device
    from gpuwarden.gpu.nvml import NvmlBackend

    monkeypatch.setattr("gpuwarden.gpu.nvml.persistenced_state", lambda proc_root: "stopped")
    backend = NvmlBackend(FakeNvml([device("GPU-a", "00000000:18:00.0", replays=1),
                                    device("GPU-b", "00000000:3b:00.0", replays=2, persistence=1)]))
    cfg = config.parse_text("tuning:\n  apply: false\n")
    findings = {f.check: f for f in diagnose(cfg, backend, deep=False)}
    assert findings["GPU0 PCIe"].message == "Gen5 x16 of Gen5 x16, 1 replay"
    assert findings["GPU1 PCIe"].message == "Gen5 x16 of Gen5 x16, 2 replays"
    off, on = findings["GPU0 persistence"], findings["GPU1 persistence"]
    assert off.severity == "warning" and "nvidia-persistenced is installed but not running" in off.message
    assert off.fix == on.fix == "`systemctl enable --now nvidia-persistenced`"  # not `sudo gpuwarden apply`
    assert on.severity == "info" and on.message.startswith("persistence mode on, through NVML's setter")
    # The H100s say what they are: gpu_clocks: auto leaves them unlocked, and says why.
    assert "gpu_clocks: 1980 MHz now, no change (left unlocked: a datacenter card (NVIDIA, SXM, default 1755 MHz)" \
        in findings["GPU0 tuning"].message


def test_doctor_reports_a_power_limit_the_config_chose_as_a_choice():
    """tuning.power_limit_w: 100 on a 70-145 W card, capped under load: a choice with its price, no advice to
    raise it (the standard: a limit the user chose is never advice to undo it)."""
    cfg = config.parse_text("gpu:\n  backend: sim\n  scenario: rtx-pro-4000-headless\ntuning:\n  power_limit_w: 100\n")
    backend = open_configured(cfg, ManualClock())
    gpu = backend.gpus()[0]
    gpu.set_gpu_locked_clocks(3090, 3090)
    gpu.set_power_limit_w(100)
    findings = {f.check: f for f in diagnose(cfg, backend, deep=False)}
    clocks, power = findings["GPU0 clocks"], findings["GPU0 power limit"]
    assert clocks.severity == "ok" and "at the power limit chosen in tuning.power_limit_w (100 W)" in clocks.message
    assert power.severity == "ok" and power.message == "100 W (allowed 70-145 W): chosen in tuning.power_limit_w"
    assert not clocks.fix and not power.fix


@pytest.mark.process
def test_doctor_on_a_channel_another_user_filled_prints_its_gpm_lines_not_a_traceback(tmp_path, nobody_channel):
    chan = nobody_channel
    conf = tmp_path / "d.yaml"
    conf.write_text("gpu: {backend: sim, scenario: h100-nvswitch}\nmetrics: {listen: none}\n")
    env = {**subprocess_env(), power.ENV: str(chan), "STATE_DIRECTORY": str(tmp_path / "state")}
    for gpus, load in (('{"gpus": 5}', HOSTILE_LOADS[0]),
                       ('{"gpus": [{"index": 0, "gpu_lock": [1000, %s]}]}' % BIG_TEXT, '{"open": 1}')):
        plant(chan, "gpus.json", "file", gpus)
        plant(chan, "load.json", "file", load)
        out = subprocess.run([*UNIT_CAPS, *gpuwarden_cmd(), "doctor", "-c", str(conf)], capture_output=True,
                             text=True, env=env, timeout=120)
        assert "Traceback" not in out.stderr + out.stdout, out.stderr
        assert "GPU0 GPM" in out.stdout and "SM " in out.stdout, out.stdout
