"""The community registry's traps as an operator meets them (tests/minefield_cases.yaml): for each trap judged
visible before the start, `gpuwarden profiles show --json --sim SCENARIO` on its own launch names the trap, and
on each launch with one of the registry's documented fixes (its near misses) does not. The engine's versions
are package metadata in a fake interpreter environment (dist-info directories, torch/version.py), read by the
same probe as a real one, run as the engine's user; a model whose trap is in its files is written where the
registry's launch reads it: under its Hugging Face id in the serving user's cache (HF_HOME), or a local
directory. benchmarks/lint_registry.py measures the same cases in-process (recall, and near misses drawing a
warning or an error)."""

import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import yaml

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "benchmarks"))
from lint_registry import model_of, scenario_path, sides  # noqa: E402  (the benchmark's, one home for both)
CASES = yaml.safe_load((HERE / "minefield_cases.yaml").read_text())
DISTRIBUTIONS = {"vllm": "vllm", "flashinfer": "flashinfer-python", "torch": "torch", "sglang": "sglang"}
COMMANDS = {"vllm": ["-m", "vllm.entrypoints.openai.api_server"], "sglang": ["-m", "sglang.launch_server"]}


def runnable_by_others(path: str) -> bool:
    """Whether a user other than this one can run path: it and every directory above its target let others in."""
    real = Path(os.path.realpath(path))
    return all(os.stat(p).st_mode & stat.S_IXOTH for p in [real, *real.parents])


@pytest.fixture(scope="module")
def fake_python():
    """fake_python(versions, torch_cuda) -> the python of an environment that has those distributions installed
    as metadata only. Made under a directory the engine's user can read (it runs the probe), removed after."""
    base = next((p for p in (sys.executable, "/usr/bin/python3") if os.path.exists(p) and
                 (os.geteuid() != 0 or runnable_by_others(p))), None)
    if base is None:
        pytest.skip("no Python here that the engine's user may run")
    tag = subprocess.run([base, "-c", "import sys; print(f'python{sys.version_info[0]}.{sys.version_info[1]}')"],
                         capture_output=True, text=True, check=True).stdout.strip()  # its site-packages' name
    root = Path(tempfile.mkdtemp(prefix="gpuwarden-fake-env-"))
    root.chmod(0o755)
    made = {}

    def make(versions: dict, torch_cuda: str | None) -> str:
        key = (tuple(sorted(versions.items())), torch_cuda)
        if key not in made:
            env = root / f"env{len(made)}"
            # A virtual environment by hand: bin/python beside a pyvenv.cfg makes its own site-packages the path.
            (env / "bin").mkdir(parents=True)
            os.symlink(os.path.realpath(base), env / "bin" / "python")
            (env / "pyvenv.cfg").write_text(f"home = {Path(os.path.realpath(base)).parent}\n"
                                            "include-system-site-packages = false\n")
            site = env / "lib" / tag / "site-packages"
            site.mkdir(parents=True)
            for module, version in versions.items():
                info = site / f"{DISTRIBUTIONS[module]}-{version}.dist-info"
                info.mkdir()
                (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {DISTRIBUTIONS[module]}\n"
                                               f"Version: {version}\n")
            if torch_cuda:
                (site / "torch").mkdir()
                (site / "torch" / "version.py").write_text(f"__version__ = {versions.get('torch')!r}\n"
                                                           f"cuda = {torch_cuda!r}\n")
            for path in [env, *env.rglob("*")]:
                if not path.is_symlink():
                    path.chmod(0o755 if path.is_dir() else 0o644)
            made[key] = str(env / "bin" / "python")
        return made[key]

    yield make
    shutil.rmtree(root, ignore_errors=True)


def show(case: dict, run: dict, tmp_path: Path, cli, child_user, fake_python, side: str) -> dict:
    """`profiles show --json` of one side of a case: run is the trap's launch or a near miss, as
    benchmarks/lint_registry.py's sides() merges a fix over its case (the one place that does)."""
    engine = case.get("engine", "vllm")
    python = fake_python(run["versions"], run.get("torch_cuda"))
    model, env = model_of(run, tmp_path / side)
    scenario = case.get("scenario") or str(scenario_path(case, tmp_path))
    serve = {"enabled": True, "engine": engine, "profile": f"{'sglang-' if engine == 'sglang' else ''}generic",
             "model": model, "user": child_user, "python": python, "command": [python, *COMMANDS[engine]],
             "args": run.get("args", []), "env": env}
    conf = tmp_path / f"{side}.yaml"
    conf.write_text(yaml.safe_dump({"tuning": {"apply": False}, "serve": serve}))
    status, out, err = cli("profiles", "show", "--json", "--sim", scenario, "-c", conf)
    assert status == 0, err
    return json.loads(out)


def named(shown: dict, trap: str) -> list[str]:
    return [f["rule"] for f in shown["lint"] if trap in f["traps"]]


def with_rule(case: dict):
    """The case, expected to fail while no built-in rule names its trap yet (a miss benchmarks/lint_registry.py
    lists; the mark goes by itself once a rule's `traps:` names it)."""
    from gpuwarden.serving.compose.engines import builtin_rules

    if any(case["trap"] in rule.traps for rule in builtin_rules().rules):
        return case
    return pytest.param(case, marks=pytest.mark.xfail(reason=f"no built-in rule names trap {case['trap']} yet"))


@pytest.mark.process
@pytest.mark.parametrize("case", [with_rule(c) for c in CASES["cases"]], ids=[c["trap"] for c in CASES["cases"]])
def test_a_visible_trap_is_named_and_its_documented_fix_is_not(case, tmp_path, cli, child_user, fake_python,
                                                               monkeypatch):
    monkeypatch.setenv("STATE_DIRECTORY", str(tmp_path / "state"))
    (_, launch), *near_misses = sides(case)
    trap = show(case, launch, tmp_path, cli, child_user, fake_python, "trap")
    assert trap["installed"]["known"], trap["installed"]["error"]  # the fake environment was read
    assert named(trap, case["trap"]), [(f["rule"], f["traps"]) for f in trap["lint"]]
    finding = next(f for f in trap["lint"] if case["trap"] in f["traps"])
    assert finding["link"].endswith(".md") and f"/{case['trap']}-" in finding["link"] and finding["facts"]
    for side, run in near_misses:
        fixed = show(case, run, tmp_path, cli, child_user, fake_python, side.replace(" ", ""))
        assert not named(fixed, case["trap"]), (side, [f for f in fixed["lint"] if case["trap"] in f["traps"]])


def test_the_cases_cover_the_traps_judged_visible_and_the_rules_name_most_of_them():
    """Every trap judged visible has a case; every other trap of the registry version is listed once, as not
    visible or out of scope, with why; the built-in rules name at least 80 % of the visible ones (the issue's
    bar)."""
    from gpuwarden.serving.compose.engines import builtin_rules

    visible, cases = set(CASES["visible"]), {c["trap"] for c in CASES["cases"]}
    others = [set(CASES["not_visible"]), set(CASES["out_of_scope"])]
    assert cases == visible and not visible & others[0] and not visible & others[1] and not others[0] & others[1]
    assert len(visible) + len(others[0]) + len(others[1]) == CASES["registry"]["canonical_trap_count"]
    assert all(isinstance(why, str) and why for key in ("not_visible", "out_of_scope") for why in CASES[key].values())
    named_by_rules = {t for rule in builtin_rules().rules for t in rule.traps}
    assert len(visible & named_by_rules) >= 0.8 * len(visible), sorted(visible - named_by_rules)
