"""The command line, in-process and as a real process with real signals."""

import json
import subprocess

import pytest

from conftest import DEFAULT_CONFIG, gpuwarden_cmd, subprocess_env
from gpuwarden import __version__
from gpuwarden.gpu.sim.scenario import resolve_scenario

SIM = ("-c", DEFAULT_CONFIG, "--sim")


def test_version(capsys):
    from gpuwarden.cli.main import main

    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0 and capsys.readouterr().out.strip() == f"gpuwarden {__version__}"


def test_check_validates_tuning_against_sim_gpus(cli):
    status, out, _ = cli("check", *SIM, "rtx-pro-4000-headless")
    assert status == 0 and "tuning values OK on 2 GPU(s)" in out


def test_check_json_lists_errors(cli, write):
    path = write("g.yaml", "tuning:\n  gpu_clocks: [5, 1]\n  bogus: 1\n")
    status, out, _ = cli("check", "--json", "-c", path)
    report = json.loads(out)
    assert status == 78 and report["ok"] is False
    assert [(e["line"], e["key"]) for e in report["errors"]] == [(2, "tuning.gpu_clocks"), (3, "tuning.bogus")]


def test_check_catches_a_power_limit_the_card_rejects(cli, write):
    path = write("g.yaml", "gpu:\n  backend: sim\n  scenario: rtx-pro-4000-headless\ntuning:\n  power_limit_w: 160\n")
    status, _, err = cli("check", "-c", path)
    assert status == 78
    assert err.splitlines() == [f"{path}:5: tuning.power_limit_w: GPUs 0, 1 (NVIDIA RTX PRO 4000 Blackwell): "
                                "160 W is outside this GPU's power constraints (allowed 70-145 W)"]


def test_options_work_before_and_after_the_command(cli):
    assert cli("--sim", "dgx-spark", "-c", DEFAULT_CONFIG, "plan")[0] == 0
    assert cli("plan", "--sim", "dgx-spark", "-c", DEFAULT_CONFIG)[0] == 0


def test_plan_prints_actions_and_touches_nothing(cli):
    status, out, _ = cli("plan", *SIM, "rtx-pro-4000-headless")
    assert status == 0
    assert "GPU 0 gpu_clocks: 180 MHz now -> lock 3090-3090 MHz" in out
    assert "GPU 1 persistence_mode: off -> on" in out


def test_plan_json(cli):
    status, out, _ = cli("plan", "--json", *SIM, "rtx-pro-6000-tp4")
    plan = json.loads(out)
    assert status == 0 and plan["apply"] is True and len(plan["gpus"]) == 4
    clocks = [a for g in plan["gpus"] for a in g["actions"] if a["setting"] == "gpu_clocks"]
    assert {tuple(a["target"]) for a in clocks} == {(3090, 3090)}


def test_apply_applies_and_verifies(cli):
    status, out, _ = cli("apply", *SIM, "rtx-pro-4000-headless")
    assert status == 0
    assert out.count("verified GPU") == 4 and "reads 3090 MHz" in out


def test_apply_without_root_exits_77(cli, write):
    text = resolve_scenario("lock-lost").read_text().replace("as_root: true", "as_root: false")
    status, out, _ = cli("apply", *SIM, write("user.yaml", text))
    assert status == 77 and "needs root or CAP_SYS_ADMIN" in out


def test_apply_refuses_when_tuning_apply_is_false(cli, write):
    path = write("g.yaml", "gpu:\n  backend: sim\ntuning:\n  apply: false\n")
    status, _, err = cli("apply", "-c", path)
    assert status == 1 and f"tuning.apply is false ({path}:4)" in err


def test_unknown_sim_scenario_is_a_config_error(cli):
    status, _, err = cli("plan", *SIM, "no-such")
    assert status == 78 and "--sim: no scenario named 'no-such'" in err


def test_nvml_unavailable_is_one_line_exit_69(cli):
    # This machine has no NVIDIA driver; the real NVML backend must say so plainly.
    status, _, err = cli("plan", "-c", DEFAULT_CONFIG)
    if status == 0:
        pytest.skip("an NVIDIA driver is present here")
    assert status == 69 and len(err.strip().splitlines()) == 1 and err.startswith("gpuwarden: NVML")


def test_run_with_a_value_the_card_rejects_exits_78_before_touching_anything(write):
    path = write("g.yaml", "tuning:\n  power_limit_w: 160\n")
    proc = subprocess.run(gpuwarden_cmd() + ["run", "-c", str(path), "--sim", "rtx-pro-4000-headless"],
                          capture_output=True, text=True, env=subprocess_env(), timeout=60)
    assert proc.returncode == 78
    assert "160 W is outside this GPU's power constraints (allowed 70-145 W)" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_console_script_is_installed():
    import sys
    from pathlib import Path

    script = Path(sys.executable).parent / "gpuwarden"
    proc = subprocess.run([str(script), "--version"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.strip() == f"gpuwarden {__version__}"


@pytest.mark.parametrize("serve,says", [
    ("  profile: genric\n", "serve.profile: no profile named 'genric'"),
    ("  gpus: [7]\n", "serve.gpus.0: no GPU '7' on this host"),
    ("  args: [--api-key, secret]\n", "lint api-key-on-command-line"),
    ("  command: [/nonexistent/vllm, serve]\n", "serve.command: /nonexistent/vllm does not exist"),
])
def test_check_finds_what_run_would_refuse(write, cli, child_user, serve, says):
    base = ("gpu:\n  backend: sim\n  scenario: rtx-pro-4000-headless\nserve:\n  enabled: true\n  model: /m/Qwen3-4B\n"
            f"  user: {child_user}\n")
    if "command:" not in serve:
        base += "  command: [/usr/bin/python3, -m, vllm.entrypoints.openai.api_server]\n"
    status, _, err = cli("check", "-c", write("g.yaml", base + serve))
    assert status == 78 and says in err, err
