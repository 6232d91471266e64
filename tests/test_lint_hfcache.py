"""The lint reads the model the engine will load (serving/lint/hfcache.py): a Hugging Face id is found in the
serving user's cache, at the revision the launch asks for, as huggingface_hub finds it (design/hf-cache-facts.md);
nothing is downloaded; what cannot be found or is refused says where it looked, and a rule skipped for want of a
fact is a finding of its own at info level, so a launch with skips is never shown as clean."""

import json
import os
import shutil
from pathlib import Path

import pytest
import yaml

from gpuwarden import config
from gpuwarden.gpu.sim.backend import SimBackend
from gpuwarden.gpu.sim.scenario import load_scenario, resolve_scenario
from gpuwarden.serving.lint import hfcache
from gpuwarden.serving.lint import model as M
from gpuwarden.serving.lint.packages import Installed
from gpuwarden.serving.compose.prepare import compose

MAIN, PINNED = "a" * 40, "b" * 40
# Trap 143's model facts: a Qwen3 config that declares a sliding window its own gates turn off.
WINDOWED = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "sliding_window": 4096,
            "num_hidden_layers": 36}
PLAIN = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "num_hidden_layers": 36}


def hub(root: Path, repo_id: str, snapshots: dict, refs: dict) -> Path:
    """A Hugging Face cache as huggingface_hub writes one: blobs, snapshots whose files link to ../../blobs, and
    refs/NAME holding a commit hash without a newline."""
    repo = root / ("models--" + repo_id.replace("/", "--"))
    (repo / "blobs").mkdir(parents=True)
    for commit, files in snapshots.items():
        (repo / "snapshots" / commit).mkdir(parents=True)
        for name, content in files.items():
            blob = repo / "blobs" / f"{commit}-{name}"
            blob.write_text(json.dumps(content) if isinstance(content, dict) else content)
            (repo / "snapshots" / commit / name).symlink_to(f"../../blobs/{blob.name}")
    for ref, commit in refs.items():
        (repo / "refs" / ref).parent.mkdir(parents=True, exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    return repo


@pytest.fixture
def cache(tmp_path):
    hub(tmp_path / "hf" / "hub", "Qwen/Qwen3-8B", {MAIN: {"config.json": WINDOWED}, PINNED: {"config.json": PLAIN}},
        {"main": MAIN, "v2": PINNED, "refs/pr/1": PINNED})
    return tmp_path / "hf"


# -- where the cache is ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("env,where", [
    ({"HOME": "/home/u"}, "/home/u/.cache/huggingface/hub"),
    ({"HOME": "/home/u", "XDG_CACHE_HOME": "/x"}, "/x/huggingface/hub"),
    ({"HOME": "/home/u", "XDG_CACHE_HOME": "/x", "HF_HOME": "~/hf"}, "/home/u/hf/hub"),
    ({"HOME": "/home/u", "HF_HOME": "/h", "HUGGINGFACE_HUB_CACHE": "$HOME/old"}, "/home/u/old"),
    ({"HOME": "/home/u", "HF_HOME": "/h", "HUGGINGFACE_HUB_CACHE": "/old", "HF_HUB_CACHE": "${DISK}/hub",
      "DISK": "/data"}, "/data/hub"),
    ({"HOME": "/home/u", "HF_HUB_CACHE": "$NOT_SET/hub"}, "$NOT_SET/hub"),  # as os.path.expandvars leaves it
])
def test_the_cache_is_the_one_huggingface_hub_picks_in_the_engines_environment(env, where):
    assert hfcache.cache_dir(env)[0] == where


def test_the_engines_home_decides_not_the_daemons(monkeypatch):
    monkeypatch.setenv("HOME", "/root")
    monkeypatch.setenv("HF_HOME", "/daemon/hf")
    assert hfcache.cache_dir({"HOME": "/srv/engine"})[0] == "/srv/engine/.cache/huggingface/hub"


# -- the id, at a revision -------------------------------------------------------------------------------------

@pytest.mark.parametrize("flags,commit", [
    ([], MAIN), (["--revision", "main"], MAIN), (["--revision", PINNED], PINNED), (["--revision=v2"], PINNED),
    (["--revision", "refs/pr/1"], PINNED),
])
def test_an_id_is_found_at_main_or_at_the_revision_the_launch_pins(cache, flags, commit):
    found = hfcache.locate("Qwen/Qwen3-8B", flags, {"HF_HOME": str(cache)})
    assert found.path == cache / "hub" / "models--Qwen--Qwen3-8B" / "snapshots" / commit, found


def test_each_revision_reads_its_own_snapshots_facts_through_the_links_into_blobs(cache):
    env = {"HF_HOME": str(cache)}
    main = M.launch_facts("Qwen/Qwen3-8B", [], env)
    pinned = M.launch_facts("Qwen/Qwen3-8B", ["--revision", "v2"], env)
    assert main.known and main.sliding_window == 4096
    assert pinned.known and pinned.sliding_window is None


def test_hf_config_path_is_where_the_config_comes_from(cache):
    hub(cache / "hub", "org/config-only", {MAIN: {"config.json": PLAIN}}, {"main": MAIN})
    facts = M.launch_facts("Qwen/Qwen3-8B", ["--hf-config-path", "org/config-only"], {"HF_HOME": str(cache)})
    assert facts.known and facts.sliding_window is None


@pytest.mark.parametrize("model,flags,env,says", [
    ("Qwen/Qwen3-8B", ["--revision", "v9"], {}, "refs/v9: no such file"),
    ("Qwen/Qwen3-8B", ["--revision", "c" * 40], {}, "is not in "),
    ("Other/Model", [], {}, "is in no cache the engine reads"),
    ("Qwen/../../etc", [], {}, "neither a local directory nor a Hugging Face id"),
    ("Qwen--x/y", [], {}, "neither a local directory nor a Hugging Face id"),
    ("Qwen/Qwen3-8B\n", [], {}, "neither a local directory nor a Hugging Face id"),
    ("Qwen/Qwen3-8B", ["--revision", "../../../etc"], {}, "no revision the cache can hold"),
    ("Qwen/Qwen3-8B", [], {"HF_HUB_CACHE": ""}, "is a relative path"),
    ("Qwen/Qwen3-8B", [], {"VLLM_USE_MODELSCOPE": "true"}, "ModelScope"),
    ("Qwen/Qwen3-8B", [], {"TRANSFORMERS_CACHE": "/t"}, "TRANSFORMERS_CACHE"),
])
def test_what_is_not_found_or_refused_says_why_in_one_line(cache, model, flags, env, says):
    facts = M.launch_facts(model, flags, {"HF_HOME": str(cache), **env})
    assert not facts.known and says in facts.why and "\n" not in facts.why, facts.why


def test_a_ref_or_snapshot_that_leads_out_of_the_cache_is_refused_in_one_line(cache, tmp_path):
    repo = cache / "hub" / "models--Qwen--Qwen3-8B"
    elsewhere = tmp_path / "elsewhere"
    (elsewhere / "snap").mkdir(parents=True)
    (elsewhere / "snap" / "config.json").write_text(json.dumps(WINDOWED))
    (elsewhere / "commit").write_text(MAIN)
    (repo / "refs" / "linked").symlink_to(elsewhere / "commit")
    (repo / "snapshots" / ("d" * 40)).symlink_to(elsewhere / "snap")
    (repo / "refs" / "out").write_text("d" * 40)
    env = {"HF_HOME": str(cache)}
    linked = M.launch_facts("Qwen/Qwen3-8B", ["--revision", "linked"], env)
    assert not linked.known and "refs/linked" in linked.why, linked.why
    out = M.launch_facts("Qwen/Qwen3-8B", ["--revision", "out"], env)
    assert not out.known and "is not in" in out.why and "/snapshots" in out.why, out.why
    # what a link leads to is never told apart: an existing folder outside and a missing one read alike (attacker
    # 10's F3: an oracle of root-only paths' existence)
    (repo / "snapshots" / ("d" * 40)).unlink()
    (repo / "snapshots" / ("d" * 40)).symlink_to(tmp_path / "no-such-folder")
    missing = M.launch_facts("Qwen/Qwen3-8B", ["--revision", "out"], env)
    assert missing.why == out.why, (missing.why, out.why)
    # a file of a snapshot that links out of the repository: refused by the model reader, as for a folder
    (repo / "snapshots" / MAIN / "config.json").unlink()
    (repo / "snapshots" / MAIN / "config.json").symlink_to(elsewhere / "snap" / "config.json")
    escaped = M.launch_facts("Qwen/Qwen3-8B", [], env)
    assert not escaped.known and "outside the model directory" in escaped.why and "\n" not in escaped.why


def test_a_refs_folder_linked_elsewhere_is_not_read_and_what_a_ref_holds_is_never_printed(cache, tmp_path):
    """Attacker 9's F3 (a): refs/ linked to a root-only folder was read as root (O_NOFOLLOW guards the last name
    only), and the hash it held was printed in the lint's message."""
    repo = cache / "hub" / "models--Qwen--Qwen3-8B"
    secret = tmp_path / "root-only"
    secret.mkdir(mode=0o700)
    (secret / "main").write_text("d" * 40)
    shutil.rmtree(repo / "refs")
    (repo / "refs").symlink_to(secret)
    facts = M.launch_facts("Qwen/Qwen3-8B", [], {"HF_HOME": str(cache)})
    assert not facts.known and "no such file in the repository" in facts.why and "d" * 40 not in facts.why, \
        facts.why
    (repo / "refs").unlink()
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("e" * 40)  # a ref of the repository's own, naming no snapshot here
    facts = M.launch_facts("Qwen/Qwen3-8B", [], {"HF_HOME": str(cache)})
    assert not facts.known and "e" * 40 not in facts.why and "the one main names" in facts.why, facts.why


def test_a_snapshot_swapped_for_a_link_after_it_was_checked_is_not_read_out_of_the_repository(cache, tmp_path):
    """Attacker 9's F3 (b): a folder on the way swapped for a link between the check and the open let the lint
    read a root-only file. The reads stay within the real paths locate checked, on what each open found."""
    found = hfcache.locate("Qwen/Qwen3-8B", [], {"HF_HOME": str(cache)})
    assert found.path is not None and found.roots
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "config.json").write_text(json.dumps({"model_type": "qwen3", "sliding_window": 31337}))
    moved = found.path.with_name("moved")
    found.path.rename(moved)  # what serve.user does, with the snapshot's name now a link out
    found.path.symlink_to(elsewhere)
    facts = M.model_facts("Qwen/Qwen3-8B", path=found.path, roots=found.roots)
    assert not facts.known and "moved outside the model directory" in facts.why, facts.why


# -- through the lint, as `profiles show` and `check` compose a launch ----------------------------------------

def composed(model: str, env: dict, args=()):
    serve = {"enabled": True, "engine": "vllm", "profile": "generic", "model": model, "args": list(args),
             "env": env}
    cfg = config.parse_text(yaml.safe_dump({"tuning": {"apply": False}, "serve": serve}), name="g.yaml")
    gpus = [g.sample() for g in SimBackend(load_scenario(resolve_scenario("rtx-pro-4000-headless"))).gpus()]
    found = Installed("/srv/venv/bin/python", True, {"vllm": "0.25.1", "torch": "2.11.0+cu130"}, "13.0")
    return compose(cfg, gpus, base_env={"PATH": "/usr/bin:/bin"}, found=found, ask=True)


def test_a_model_fact_rule_fires_through_the_id_and_the_pin_quiets_it(cache):
    fired = composed("Qwen/Qwen3-8B", {"HF_HOME": str(cache)})
    rules = [f.rule for f in fired.findings]
    assert "qwen3-sliding-window-off" in rules, [str(f) for f in fired.findings]
    assert "fact-unknown" not in rules
    quiet = composed("Qwen/Qwen3-8B", {"HF_HOME": str(cache)}, ["--revision", PINNED])
    assert "qwen3-sliding-window-off" not in [f.rule for f in quiet.findings]


def test_a_model_in_no_cache_lists_its_skipped_rules_and_the_fact_they_lacked(cache):
    launch = composed("Other/Model-8B", {"HF_HOME": str(cache)})
    unknown = [f for f in launch.findings if f.rule == "fact-unknown"]
    assert len(unknown) == 1 and unknown[0].severity == "info", [str(f) for f in launch.findings]
    text = str(unknown[0])
    assert "qwen3-sliding-window-off" in text and "the model's config.json" in text, text
    assert f"looked for Other/Model-8B at revision main in {cache}/hub (from HF_HOME)" in text, text
    assert unknown[0].fix and "\n" not in text
    skipped = [o for o in launch.outcomes if o.status == "skipped" and o.unknown]
    assert skipped and all(o.rule.id in text for o in skipped), (text, [o.rule.id for o in skipped])
    assert f"{len(skipped)} rule(s) not judged" in text
    # the same launch with its model in the cache: nothing skipped for want of the model
    hub(cache / "hub", "Other/Model-8B", {MAIN: {"config.json": PLAIN}}, {"main": MAIN})
    assert not [f for f in composed("Other/Model-8B", {"HF_HOME": str(cache)}).findings if f.rule == "fact-unknown"]


def test_the_daemons_own_environment_never_decides_where_the_engine_reads(cache, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(cache))
    launch = composed("Qwen/Qwen3-8B", {"HF_HOME": "/nonexistent/hf"})
    assert "fact-unknown" in [f.rule for f in launch.findings]
    assert os.environ["HF_HOME"] == str(cache)


def test_bench_reads_the_roofline_of_an_id_from_the_same_snapshot(cache):
    from gpuwarden.bench.command import _serving_facts

    serve = {"enabled": True, "model": "Qwen/Qwen3-8B", "args": ["--revision", "v2"], "env": {"HF_HOME": str(cache)}}
    cfg = config.parse_text(yaml.safe_dump({"serve": serve}), name="g.yaml")
    assert _serving_facts(cfg)[0] == cache / "hub" / "models--Qwen--Qwen3-8B" / "snapshots" / PINNED


def test_without_a_cache_variable_the_serving_users_home_decides(monkeypatch):
    """serve.user's home, as the engine gets it at spawn (HOME comes with the user), never root's."""
    if os.geteuid() != 0:
        pytest.skip("serve.user is only taken by root; another user serves as itself")
    monkeypatch.setenv("HOME", "/root")
    serve = {"enabled": True, "engine": "vllm", "profile": "generic", "model": "Qwen/Qwen3-8B", "user": "nobody"}
    cfg = config.parse_text(yaml.safe_dump({"tuning": {"apply": False}, "serve": serve}), name="g.yaml")
    gpus = [g.sample() for g in SimBackend(load_scenario(resolve_scenario("rtx-pro-4000-headless"))).gpus()]
    found = Installed("/srv/venv/bin/python", True, {"vllm": "0.25.1", "torch": "2.11.0+cu130"}, "13.0")
    launch = compose(cfg, gpus, base_env={"PATH": "/usr/bin:/bin"}, found=found, ask=True)
    text = " ".join(str(f) for f in launch.findings if f.rule == "fact-unknown")
    home = __import__("pwd").getpwnam("nobody").pw_dir
    assert f"in {home}/.cache/huggingface/hub (from HOME)" in text, text


# -- every model-fact rule, through an id ------------------------------------------------------------------------

# The files a checkpoint would ship for each rule's first firing example's model facts (its `model_facts:` in
# serving/lint/rules/builtin.yaml); the test reads them back through the id and checks they give those facts.
CHECKPOINTS = {
    "ngram-small-model": {"config.json": {"model_type": "qwen3"},
                          "model.safetensors": {"w": {"dtype": "BF16", "shape": [64000, 62500],
                                                      "data_offsets": [0, 0]}}},
    "fp4-moe-marlin-gb10": {"config.json": {"model_type": "hy_v3", "num_experts": 192, "quantization_config": {
        "quant_method": "compressed-tensors", "config_groups": {"group_0": {"weights": {"num_bits": 4}}}}}},
    "no-generation-config": {"config.json": {"model_type": "qwen3_5"}},
    "hybrid-fp4-ignore-list": {"config.json": {"model_type": "qwen3_next", "quantization_config": {
        "quant_method": "modelopt", "quant_algo": "NVFP4", "ignore": ["lm_head"]}}},
    "hybrid-prefix-caching": {"config.json": {"model_type": "nemotron_h"}},
    "context-beyond-training": {"config.json": {"model_type": "deepseek_v4", "max_position_embeddings": 1048576,
                                                "rope_scaling": {"factor": 16.0,
                                                                 "original_max_position_embeddings": 65536}}},
    "rope-extended-context": {"config.json": {"model_type": "qwen2", "max_position_embeddings": 32768, "rope_scaling": {
        "type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}}},
    "checkpoint-reasoning-parser": {"config.json": {"model_type": "nemotron_h"}, "nano_v3_reasoning_parser.py": "",
                                    "generation_config.json": {}},
    "mtp-one-draft-token": {"config.json": {"model_type": "deepseek_v3", "num_nextn_predict_layers": 1}},
    "indexer-spec-overhang": {"config.json": {"model_type": "glm_moe_dsa", "index_topk": 2048,
                                              "num_nextn_predict_layers": 1, "max_position_embeddings": 202752}},
    "mtp-excluded-from-quant": {"config.json": {"model_type": "deepseek_v4", "quantization_config": {
        "quant_method": "modelopt", "ignore": ["mtp.*", "lm_head"]}}},
    "qwen3-sliding-window-off": {"config.json": {"model_type": "qwen3", "sliding_window": 2048,
                                                 "num_hidden_layers": 5}},
}


def model_fact_rules():
    from gpuwarden.serving.compose.engines import builtin_rules

    out = []
    for rule in builtin_rules().rules:
        example = next((e for e in rule.examples if "model_facts" in e and e["fires"] != "none"), None)
        if example is not None:
            out.append((rule, example))
    return out


def test_the_checkpoints_below_cover_every_rule_that_reads_the_models_files():
    assert {rule.id for rule, _ in model_fact_rules()} == set(CHECKPOINTS)


@pytest.mark.parametrize("rule,example", model_fact_rules(), ids=[r.id for r, _ in model_fact_rules()])
def test_each_model_fact_rule_fires_through_a_hugging_face_id_in_the_users_cache(rule, example, tmp_path):
    import dataclasses
    import struct

    from test_rules import context, outcome_of

    files = CHECKPOINTS[rule.id]
    repo_id = "org/" + example["model"].rsplit("/", 1)[-1]
    snapshot = {}
    for name, content in files.items():
        if name.endswith(".safetensors"):
            header = json.dumps(content).encode()
            snapshot[name] = (struct.pack("<Q", len(header)) + header).decode("latin-1")
        else:
            snapshot[name] = content
    repo = hub(tmp_path / "hub", repo_id, {MAIN: {k: v for k, v in snapshot.items() if not k.endswith(".safetensors")}},
               {"main": MAIN})
    for name, raw in snapshot.items():  # a header only: binary, written as such
        if name.endswith(".safetensors"):
            (repo / "blobs" / name).write_bytes(raw.encode("latin-1"))
            (repo / "snapshots" / MAIN / name).symlink_to(f"../../blobs/{name}")
    flags = [str(a) for a in example.get("args", [])]
    facts = M.launch_facts(repo_id, flags, {"HF_HUB_CACHE": str(tmp_path / "hub")})
    assert facts.known, facts.why
    for field, value in example["model_facts"].items():  # the files say what the example's facts say
        got = getattr(facts, field)
        assert (tuple(got) if isinstance(got, (list, tuple)) else got) == \
            (tuple(value) if isinstance(value, list) else value), (field, got)
    settings = {k: v for k, v in example.items() if k not in ("fires", "case", "model_facts")}
    settings.setdefault("engine", rule.engine if rule.engine != "any" else "vllm")
    settings["model"] = repo_id
    ctx = dataclasses.replace(context(**settings, model_facts={}), model_facts=facts)
    outcome = outcome_of(rule, ctx)
    assert outcome.finding is not None and outcome.finding.severity == example["fires"], outcome.line()


def test_profiles_show_escapes_what_a_models_files_and_links_say(tmp_path, cli, monkeypatch):
    """Attacker 9's F4: `profiles show` printed the findings raw, and they quote serve.user's link targets: a name
    with ESC sequences retitled the admin's terminal and forged a line. `check` and --json escaped them already."""
    monkeypatch.setenv("STATE_DIRECTORY", str(tmp_path / "state"))
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").symlink_to(tmp_path / "x\x1b]0;OWNED\x07\x1b[2J\nerror: FORGED")
    conf = tmp_path / "g.yaml"
    conf.write_text(yaml.safe_dump({"tuning": {"apply": False}, "gpu": {"backend": "sim", "scenario": "dgx-spark"},
                                    "serve": {"enabled": True, "model": str(model), "profile": "generic"}}))
    status, out, err = cli("profiles", "show", "generic", "-c", conf)
    assert status == 0, err
    assert "\x1b" not in out and "\x07" not in out and "\nerror: FORGED" not in out, out
    assert "\\x1b" in out or "\\u001b" in out or "\\033" in out, out  # said, escaped
