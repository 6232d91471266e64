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


@pytest.mark.process
def test_run_with_a_value_the_card_rejects_exits_78_before_touching_anything(write):
    path = write("g.yaml", "tuning:\n  power_limit_w: 160\n")
    proc = subprocess.run(gpuwarden_cmd() + ["run", "-c", str(path), "--sim", "rtx-pro-4000-headless"],
                          capture_output=True, text=True, env=subprocess_env(), timeout=60)
    assert proc.returncode == 78
    assert "160 W is outside this GPU's power constraints (allowed 70-145 W)" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.process
def test_console_script_is_installed():
    import sys
    from pathlib import Path

    script = Path(sys.executable).parent / "gpuwarden"
    proc = subprocess.run([str(script), "--version"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.strip() == f"gpuwarden {__version__}"


# process: check asks the engine's interpreter (/usr/bin/python3) what it has installed, as the engine's user
@pytest.mark.process
@pytest.mark.parametrize("serve,says", [
    ("  profile: genric\n", "serve.profile: no profile named 'genric'"),
    ("  gpus: [7]\n", "serve.gpus.0: no GPU '7' on this host"),
    ("  args: [--api-key, secret]\n", "lint api-key-on-command-line"),
    ("  allow_lint_errors: true\n  args: [--api_key=secret]\n  proxy: {enabled: true}\n",
     "serve.args: with the proxy on, vLLM's flags give it an API key"),
    ("  command: [/nonexistent/vllm, serve]\n", "serve.command: /nonexistent/vllm does not exist"),
])
def test_check_finds_what_run_would_refuse(write, cli, child_user, serve, says):
    base = ("gpu:\n  backend: sim\n  scenario: rtx-pro-4000-headless\nserve:\n  enabled: true\n  model: /m/Qwen3-4B\n"
            f"  user: {child_user}\n")
    if "command:" not in serve:
        base += "  command: [/usr/bin/python3, -m, vllm.entrypoints.openai.api_server]\n"
    status, _, err = cli("check", "-c", write("g.yaml", base + serve))
    assert status == 78 and says in err, err


@pytest.mark.process
@pytest.mark.parametrize("profile, says", [
    ("env: {VLLM_API_KEY: in-the-profile}\nargs: []\n",
     "serve.profile: with the proxy on, the profile's env gives vLLM VLLM_API_KEY, which the proxy cannot follow"),
    ("args: [--config, FLAGS]\n", "serve.args: with the proxy on, vLLM's flags give it an API key"),
], ids=["env", "config"])
def test_check_refuses_a_key_a_profile_gives_vllm_behind_the_proxy(write, cli, child_user, tmp_path, profile, says):
    """Attacker 16: a profile's env or args gave vLLM a key the proxy did not ask (check said OK; with --config in
    the profile's args the first start then waited for ever)."""
    flags = write("flags.yaml", "api-key: in-flags\n")
    write("profiles.d/keyed.yaml", "name: keyed\ndescription: a key in a profile\n" + profile.replace("FLAGS", str(flags)))
    status, _, err = cli("check", "-c", write("g.yaml", (
        "gpu:\n  backend: sim\n  scenario: rtx-pro-4000-headless\nserve:\n  enabled: true\n  model: /m/Qwen3-4B\n"
        f"  user: {child_user}\n  profile: keyed\n  proxy: {{enabled: true}}\n"
        "  command: [/usr/bin/python3, -m, vllm.entrypoints.openai.api_server]\n")))
    assert status == 78 and says in err, err


# The commands of 0.2, in the order `gpuwarden --help` lists them; a new command may come anywhere among them.
LISTED = ["check", "plan", "apply", "cleanup", "run", "profiles", "doctor", "status", "bench", "tune", "proxy"]
NOT_COMMANDS = {"common", "main", "registry"}  # the modules of cli/ that serve every command


def _help(capsys, *argv: str) -> str:
    from gpuwarden.cli.main import main

    with pytest.raises(SystemExit) as info:
        main([*argv, "--help"])
    assert info.value.code == 0
    return capsys.readouterr().out


def _listed(top_help: str) -> list[str]:
    """The command names under COMMAND in `gpuwarden --help`, in order."""
    block = top_help.split("\n  COMMAND\n", 1)[1].split("\n\n", 1)[0]
    return [line.split()[0] for line in block.splitlines() if line.startswith("    ") and line[4] != " "]


def test_every_module_in_cli_is_a_command_and_help_lists_each(capsys):
    import importlib
    import pkgutil

    from gpuwarden import cli
    from gpuwarden.cli.registry import find_commands

    modules = {m.name for m in pkgutil.iter_modules(cli.__path__)} - NOT_COMMANDS
    for name in modules:  # the file's name is the command's (a hyphen in the command, _ in the file)
        assert importlib.import_module(f"gpuwarden.cli.{name}").COMMAND.name.replace("-", "_") == name
    commands = find_commands()
    assert {c.replace("-", "_") for c in commands} == modules and set(LISTED) <= modules
    listed = _listed(_help(capsys))
    assert listed == list(commands) and [n for n in listed if n in LISTED] == LISTED
    for name in commands:
        assert _help(capsys, name).startswith(f"usage: gpuwarden {name} [-h] [-c CONFIG] [--sim SCENARIO]")


HELLO = '''"""A toy command: the recipe's one file."""

from ..base.exits import EX_OK
from .common import load_config
from .registry import Command


def arguments(p):
    p.add_argument("--name", default="world", help="whom to greet")


def cmd_hello(args):
    config = load_config(args)
    print(f"hello {args.name} from {config.files[0]}")
    return EX_OK


COMMAND = Command("hello", help="say hello (a toy)", run=cmd_hello, arguments=arguments)
'''


def test_a_new_command_is_one_file_in_cli(tmp_path, monkeypatch, capsys, cli):
    """The package map's recipe, done: one file beside the others, and nothing else edited."""
    import sys

    from gpuwarden import cli as package

    (tmp_path / "hello.py").write_text(HELLO)
    monkeypatch.setattr(package, "__path__", [*package.__path__, str(tmp_path)])
    try:
        top = _help(capsys)
        assert _listed(top)[-1] == "hello" and "say hello (a toy)" in top  # no order given: listed last
        assert "--name NAME" in _help(capsys, "hello")
        assert cli("hello", "--name", "you", "-c", DEFAULT_CONFIG) == (0, f"hello you from {DEFAULT_CONFIG}\n", "")
        status, _, err = cli("hello", "-c", tmp_path / "absent.yaml")  # the entry's exit statuses come with it
        assert status == 78 and "absent.yaml" in err
    finally:
        sys.modules.pop("gpuwarden.cli.hello", None)
