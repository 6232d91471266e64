"""Lint-rule conditions written as data beyond one fact against a constant (issue 44 item 2): a product of numeric
facts (speculative depth x sequences, trap 98), a flag compared with a model field, optionally scaled
(--max-model-len against sliding_window), the smallest GPU's memory as a host fact, and a model's family and
sparse-attention indexer from its config.json. Each new form is checked when the rules are loaded (FILE:LINE,
`gpuwarden check` exits 78); a finding says the values it compared; an unknown value skips the rule, saying why."""

import dataclasses
import json
import time
from types import SimpleNamespace

import pytest

from gpuwarden.base.yamlfile import ConfigErrors
from gpuwarden.serving.lint import facts as F
from gpuwarden.serving.lint import model as M
from gpuwarden.serving.compose.engines import evaluate_lint, rules_for
from gpuwarden.serving.lint.rules import LintContext
from test_rules import context, serving_conf

SPEC4 = ["--speculative-config", '{"method": "mtp", "num_speculative_tokens": 4}']
PRODUCT = "--speculative-config.num_speculative_tokens * --max-num-seqs"
PRODUCT_TEXT = "--speculative-config.num_speculative_tokens 4 x --max-num-seqs 256 (vLLM's default) = 1024"


def site_rules(tmp_path, match: str):
    """rules.d with one warning rule, site-x, matching as match (YAML lines under match:) says."""
    (tmp_path / "10-site.yaml").write_text(
        "rules:\n  - id: site-x\n    severity: warning\n    match:\n"
        + "".join(f"      {line}\n" for line in match.splitlines())
        + "    message: m\n    fix: f\n    source: s\n")
    return rules_for(tmp_path)


def site_outcome(rules, ctx):
    return next(o for o in evaluate_lint(ctx, rules) if o.rule.id == "site-x")


# -- products ------------------------------------------------------------------------------------------------

def test_a_product_of_flags_fires_at_its_bound_and_says_the_values_it_multiplied(tmp_path):
    rules = site_rules(tmp_path, f"values: {{'{PRODUCT}': '>=64'}}\ndefaults: {{--max-num-seqs: 256}}")
    fired = site_outcome(rules, context(args=SPEC4)).finding
    assert fired.facts == (PRODUCT_TEXT,)
    at = site_outcome(rules, context(args=[*SPEC4, "--max-num-seqs", "16"]))
    assert at.status == "applied" and "x --max-num-seqs 16 = 64" in at.finding.facts[0]
    assert site_outcome(rules, context(args=[*SPEC4, "--max-num-seqs", "8"])).status == "clear"
    dotted = site_outcome(rules, context(args=["--speculative-config.num_speculative_tokens=15",
                                               "--max-num-seqs", "32"]))
    assert dotted.finding.facts == ("--speculative-config.num_speculative_tokens 15 x --max-num-seqs 32 = 480",)


def test_a_product_whose_factor_is_absent_without_a_default_or_not_a_number_skips_saying_why(tmp_path):
    rules = site_rules(tmp_path, f"values: {{'{PRODUCT}': '>=64'}}")
    assert site_outcome(rules, context(args=SPEC4)).line() == \
        "site-x: skipped, needs --max-num-seqs, which is not given and has no default in the rule"
    assert site_outcome(rules, context(args=[*SPEC4, "--max-num-seqs", "lots"])).line() == \
        "site-x: skipped, needs --max-num-seqs as a number: --max-num-seqs lots"
    assert site_outcome(rules, context()).reason.startswith("needs --speculative-config.num_speculative_tokens")


def test_a_product_may_scale_by_a_number_and_reads_a_k_suffix_as_vllm_does(tmp_path):
    rules = site_rules(tmp_path, "values: {'2 * --max-model-len': '>60000'}")
    assert site_outcome(rules, context(args=["--max-model-len", "32k"])).finding.facts == \
        ("2 x --max-model-len 32k = 64000",)
    assert site_outcome(rules, context(args=["--max-model-len", "16000"])).status == "clear"


# -- a fact compared with another ----------------------------------------------------------------------------

def test_a_flag_compared_with_a_model_field_says_both_values(tmp_path):
    rules = site_rules(tmp_path, "values: {--max-model-len: '>model.sliding_window'}")
    window = {"model_type": "qwen3", "sliding_window": 4096}
    fired = site_outcome(rules, context(model="/m/q", model_facts=window, args=["--max-model-len", "8192"]))
    assert fired.finding.facts == ("--max-model-len 8192 > config.json sliding_window 4096",)
    quiet = site_outcome(rules, context(model="/m/q", model_facts=window, args=["--max-model-len", "4096"]))
    assert quiet.status == "clear"


def test_a_scaled_model_field_on_the_right_and_values_not(tmp_path):
    rules = site_rules(tmp_path, "values: {--max-model-len: '>=0.9*model.max_position_embeddings'}\n"
                                 "values_not: {--gpu-memory-utilization: '<host.gpus * 0.1'}")
    facts = {"model_type": "llama", "max_position_embeddings": 40960}
    fired = site_outcome(rules, context(model="/m/l", model_facts=facts, args=[
        "--max-model-len", "36864", "--gpu-memory-utilization", "0.9"]))
    assert fired.finding.facts == ("--max-model-len 36864 >= 0.9 x config.json max_position_embeddings 40960 = 36864",
                                   "--gpu-memory-utilization 0.9 not < 1 GPU(s) here x 0.1 = 0.1")
    assert site_outcome(rules, context(model="/m/l", model_facts=facts, args=[
        "--max-model-len", "36863", "--gpu-memory-utilization", "0.9"])).status == "clear"


@pytest.mark.parametrize("facts,args,reason", [
    ({"model_type": "llama"}, ["--max-model-len", "8192"],
     "needs model.sliding_window, which the model's config.json does not set"),
    ({"model_type": "qwen3", "sliding_window": 4096}, [],
     "needs --max-model-len, which is not given and has no default in the rule"),
    (None, ["--max-model-len", "8192"], "needs the model's config.json: Qwen/Qwen3-8B is not a local directory"),
])
def test_a_comparison_with_a_fact_unknown_on_either_side_skips_saying_why(tmp_path, facts, args, reason):
    rules = site_rules(tmp_path, "values: {--max-model-len: '>model.sliding_window'}")
    ctx = context(model="/m/q" if facts else "Qwen/Qwen3-8B", model_facts=facts, args=args)
    outcome = site_outcome(rules, ctx)
    assert outcome.status == "skipped" and outcome.reason.startswith(reason), outcome.line()


@pytest.mark.parametrize("text,value,limit,holds", [
    (">model.sliding_window", 8192, 4096, True), (">model.sliding_window", 4096, 4096, False),
    (">=64,<model.sliding_window", 100, 4096, True), (">=64,<model.sliding_window", 32, 4096, False),
])
def test_a_comparison_reads_its_fact_limit_from_the_launch(text, value, limit, holds):
    cond = F.condition(text)
    assert cond.holds(value, {cond.products[0]: limit}) is holds


# -- the host's GPU memory -----------------------------------------------------------------------------------

def test_the_smallest_gpus_memory_is_a_host_fact(tmp_path):
    from gpuwarden.gpu.sim.backend import ManualClock, SimBackend
    from gpuwarden.gpu.sim.scenario import BUILTIN_DIR, load_scenario

    samples = [g.sample() for g in SimBackend(load_scenario(BUILTIN_DIR / "rtx-pro-4000-headless.yaml"),
                                              ManualClock()).gpus()]
    samples[1] = dataclasses.replace(samples[1], memory_total_bytes=16 * 2**30)
    base = context(gpus=2)
    command = SimpleNamespace(argv=base.argv, env={}, profile=base.profile, gpus=samples, engine=base.engine,
                              prefix=base.prefix)
    ctx = LintContext.of(command, base.model, base.installed, base.model_facts)
    assert ctx.fact("host.gpu_memory_gib") == (16.0, "16 GiB on the smallest GPU")
    rules = site_rules(tmp_path, "values: {host.gpu_memory_gib: '<=128'}")
    assert site_outcome(rules, ctx).finding.facts == ("16 GiB on the smallest GPU",)
    spark = dataclasses.replace(base, gpu_memory=124416 * 2**20, unified=True)
    assert site_outcome(rules, spark).finding.facts == ("121.5 GiB on the smallest GPU (the system memory it shares)",)
    assert site_outcome(rules, dataclasses.replace(base, gpu_memory=141 * 10**9)).status == "clear"
    assert site_outcome(rules, base).line() == "site-x: skipped, needs the GPUs' memory (no GPU readable here)"


# -- the model's family and indexer --------------------------------------------------------------------------

def model_dir(tmp_path, name: str, config: dict) -> str:
    folder = tmp_path / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


def test_a_sparse_attention_indexer_and_the_family_come_from_config_json(tmp_path):
    """The field names of deepseek-ai/DeepSeek-V3.2-Exp's config.json; vLLM takes index_topk as the sign."""
    v32 = model_dir(tmp_path, "v32", {"architectures": ["DeepseekV32ForCausalLM"], "model_type": "deepseek_v32",
                                      "index_topk": 2048, "index_n_heads": 64, "index_head_dim": 128})
    v3 = model_dir(tmp_path, "v3", {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3"})
    glm = model_dir(tmp_path, "glm", {"architectures": ["GlmMoeDsaForCausalLM"], "model_type": "glm_moe_dsa"})
    assert (M.model_facts(v32).indexer, M.model_facts(v32).index_topk) == (True, 2048)
    assert (M.model_facts(v3).indexer, M.model_facts(v3).index_topk) == (False, None)
    assert (M.model_facts(glm).indexer, M.model_facts(glm).index_topk) == (True, None)  # its config class's default
    rules = site_rules(tmp_path, "values: {model.architectures: 'Deepseek.*', model.model_type: 'deepseek_v3.*', "
                                 "model.indexer: true, model.index_topk: '>=2048'}")
    fired = site_outcome(rules, context(model=v32)).finding
    assert fired.facts == ('config.json architectures ["DeepseekV32ForCausalLM"]',
                           "config.json model_type deepseek_v32", "config.json indexer true",
                           "config.json index_topk 2048")
    assert site_outcome(rules, context(model=v3)).status == "clear"


@pytest.mark.parametrize("pattern,value,holds", [
    ("Deepseek.*", ("DeepseekV32ForCausalLM",), True), ("Qwen.*", ("DeepseekV32ForCausalLM",), False),
    (r'\["a","b"\]', ("a", "b"), True),  # the whole list as JSON still matches, as before
    ("b", ["a", "b"], True),
])
def test_a_list_fact_matches_a_regex_when_one_item_does(pattern, value, holds):
    assert F.condition(pattern).holds(value) is holds


# -- refused when loaded -------------------------------------------------------------------------------------

@pytest.mark.parametrize("match,says", [
    ("values: {'--max-num-seqs * model.colour': '>1'}", "'model.colour' is not a fact (a flag"),
    ("values: {'--max-num-seqs * model.model_type': '>1'}", "model.model_type is not a number"),
    ("values: {'--max-num-seqs * host.driver': '>1'}", "host.driver is not a number"),
    ("values: {'--max-num-seqs * ': '>1'}", "is missing a number or a fact beside a *"),
    ("values: {'--max-num-seqs * max': '>1'}", "'max' is neither a number nor a fact"),
    ("values: {'--a * --b * --c * --d * --e': '>1'}", "multiplies 5 factors: at most 4"),
    ("values: {'2 * 3': '>1'}", "'2 * 3' multiplies no fact: write the number"),
    (f"values: {{'{PRODUCT}': '(?i)mtp'}}", "is a number: compare it (e.g. '>=64'), not a string"),
    (f"values: {{'{PRODUCT}': null}}", "is a number: compare it"),
    ("values: {--max-model-len: '>model.colour'}", "'>model.colour': 'model.colour' is not a fact"),
    ("values: {--max-model-len: '==auto'}", "'==auto': 'auto' is neither a number nor a fact"),
    ("values: {--max-model-len: '>=0.9*'}", "'>=0.9*' is missing a number or a fact beside a *"),
    ("values: {--max-model-len: '>'}", "'>' is missing a number or a fact"),
    ("values: {--max-model-len: '=>4'}", "'=>4' is not a comparison"),
    ("values: {--max-model-len: '>" + " " * 200 + "model.sliding_window'}", "characters: at most 200"),
    ("values: {model.model_type: '>model.sliding_window'}",
     "model.model_type is compared with a fact: model.model_type is not a number"),
    (f"values: {{'{PRODUCT}': '>=64'}}\ndefaults: {{--max-num-seqs: lots}}",
     "--max-num-seqs is multiplied or compared with a fact: its default must be a number, got 'lots'"),
    # YAML's .nan equals nothing: under values_not it fired on every launch
    ("values_not: {--max-num-seqs: .nan}", "nan is no number a fact can equal: write a finite number"),
    ("values: {--max-num-seqs: -.inf}", "-inf is no number a fact can equal"),
])
def test_a_condition_that_cannot_work_is_a_file_line_error(tmp_path, match, says):
    with pytest.raises(ConfigErrors) as caught:
        site_rules(tmp_path, match)
    lines = [str(e) for e in caught.value.errors]
    assert any(line.startswith(f"{tmp_path / '10-site.yaml'}:") and ": rules.0.match." in line and says in line
               and "\n" not in line for line in lines), lines


def test_a_bad_expression_in_rules_d_stops_check_with_78_and_one_line(write, cli, child_user):
    conf = serving_conf(write, child_user)
    bad = write("etc/rules.d/50-site.yaml", "rules:\n  - id: enforce-eager\n    match:\n"
                "      values: {'--max-num-seqs * model.colour': '>1'}\n")
    status, _, err = cli("check", "-c", conf)
    assert status == 78 and f"{bad}:4: rules.0.match.values.--max-num-seqs * model.colour: '--max-num-seqs * " \
        "model.colour': 'model.colour' is not a fact" in err
    assert "Traceback" not in err


@pytest.mark.process
def test_profiles_show_says_the_product_and_the_gpu_memory_it_compared(write, cli, child_user, monkeypatch,
                                                                        tmp_path):
    """The memory comes from the simulator's DGX Spark scenario (124416 MiB, shared with the system)."""
    monkeypatch.setenv("STATE_DIRECTORY", str(tmp_path / "state"))
    conf = write("etc/gpuwarden.yaml", "gpu: {backend: sim, scenario: dgx-spark}\ntuning: {apply: false}\n"
                 f"serve:\n  enabled: true\n  model: /m/Qwen3-4B\n  user: {child_user}\n  profile: generic\n"
                 "  command: [python3, -m, vllm.entrypoints.openai.api_server]\n"
                 "  args: [--speculative-config, '{\"method\": \"mtp\", \"num_speculative_tokens\": 4}']\n")
    write("etc/rules.d/50-site.yaml", "rules:\n  - id: site-spec-uma\n    severity: warning\n    match:\n"
          f"      values: {{host.gpu_memory_gib: '<=128', '{PRODUCT}': '>=224'}}\n"
          "      defaults: {--max-num-seqs: 256}\n"
          "    message: K x seqs beyond the soaked 224 on a 128 GB card\n    fix: lower --max-num-seqs\n"
          "    source: model-serving-minefield trap 98\n")
    status, out, err = cli("profiles", "show", "--json", "-c", conf)
    assert status == 0, err
    finding = next(f for f in json.loads(out)["lint"] if f["rule"] == "site-spec-uma")
    assert finding["facts"] == ["121.5 GiB on the smallest GPU (the system memory it shares)", PRODUCT_TEXT]


# -- hostile input: config.json numbers a float cannot hold, NaN, Infinity -----------------------------------
# A config.json of another user with numbers beyond a float, NaN and Infinity, names of megabytes and lists of
# 100,000 items; serve.args with 400 or 5,000 digits, 'nan' and an infinity times 0; a rules.d number in
# Arabic-Indic digits. None may stop `gpuwarden check` or the daemon's start (the lint runs on it) with a
# traceback, nor hang it.

HUGE = "1" + "0" * 400  # 10**400: Python's json takes it, float() of it raises OverflowError
SPEC = "--speculative-config"


def raw_model_dir(tmp_path, name: str, text: str) -> str:
    folder = tmp_path / name
    folder.mkdir()
    (folder / "config.json").write_text(text)
    return str(folder)


def test_a_config_json_number_beyond_a_float_or_nan_or_infinity_reads_as_not_set(tmp_path):
    """10**400 as sliding_window or index_topk raised OverflowError out of the lint (a rope factor of it already
    out of model_facts, on the daemon's start); NaN and Infinity as a rope factor compared as numbers."""
    big = raw_model_dir(tmp_path, "big", '{"model_type": "qwen3", "sliding_window": %s, "index_topk": %s, '
                                         '"max_position_embeddings": -%s, "rope_scaling": {"factor": %s}}'
                        % (HUGE, HUGE, HUGE, HUGE))
    facts = M.model_facts(big)
    assert facts.known, facts.why
    assert (facts.sliding_window, facts.index_topk, facts.max_position_embeddings, facts.rope_factor) == \
        (None, None, None, None)
    assert facts.indexer is True  # vLLM's hasattr(config, "index_topk") holds whatever its value
    rules = site_rules(tmp_path, "values: {--max-model-len: '>model.sliding_window', 'model.index_topk * 2': '>1'}")
    outcome = site_outcome(rules, context(model=big, args=["--max-model-len", "8192"]))
    assert outcome.reason == "needs model.sliding_window, which the model's config.json does not set"
    for word in ("NaN", "Infinity", "-Infinity"):
        odd = raw_model_dir(tmp_path, word, '{"model_type": "llama", "rope_scaling": {"factor": %s}}' % word)
        assert M.model_facts(odd).rope_factor is None


def test_a_json_flag_integer_beyond_a_float_is_an_infinity_as_its_400_digit_text_is(tmp_path):
    """{"num_speculative_tokens": 10**400} in serve.args raised OverflowError out of the lint."""
    rules = site_rules(tmp_path, f"values: {{'{PRODUCT}': '>=224'}}\ndefaults: {{--max-num-seqs: 256}}")
    fired = site_outcome(rules, context(args=[SPEC, '{"num_speculative_tokens": %s}' % HUGE])).finding
    assert fired.facts[0].endswith("= inf")
    quiet = site_outcome(rules, context(args=[SPEC, '{"num_speculative_tokens": -%s}' % HUGE]))
    assert quiet.status == "clear"
    assert F.as_number(10**400) == float("inf") and F.as_number(-10**400) == float("-inf")


# -- hostile input: NaN and an infinity times 0 --------------------------------------------------------------

@pytest.mark.parametrize("args", [
    [SPEC, '{"num_speculative_tokens": NaN}'],  # Python's json takes NaN
    [SPEC, '{"num_speculative_tokens": 4}', "--max-num-seqs", "nan"],
    [SPEC, '{"num_speculative_tokens": 4}', "--max-num-seqs", "-nan"],
])
def test_nan_in_a_product_skips_the_rule_saying_so_rather_than_deciding(tmp_path, args):
    """NaN compared false with every bound: a values_not: on it fired as if it were out of bounds."""
    rules = site_rules(tmp_path, f"values_not: {{'{PRODUCT}': '<224'}}\ndefaults: {{--max-num-seqs: 256}}")
    outcome = site_outcome(rules, context(args=args))
    assert outcome.status == "skipped" and "as a number" in outcome.reason, outcome.line()


def test_an_infinite_factor_times_zero_skips_the_rule(tmp_path):
    rules = site_rules(tmp_path, "values_not: {'--max-num-seqs * --max-model-len': '<1'}")
    outcome = site_outcome(rules, context(args=["--max-num-seqs", "9" * 400, "--max-model-len", "0"]))
    assert outcome.status == "skipped" and outcome.reason.startswith("needs a number for --max-num-seqs 999"), \
        outcome.line()


# -- hostile input: serve.args with thousands of digits ------------------------------------------------------

def test_a_flag_of_5000_digits_skips_a_check_that_cannot_read_it_and_stops_no_lint():
    """vllm.py's kv_cache_fp8_e5m2 int()s --max-num-seqs: past 4,300 digits Python raises ValueError, which
    came out of evaluate_lint on every SM120 start."""
    outcomes = evaluate_lint(context(args=["--max-num-seqs", "9" * 5000]))
    kv = next(o for o in outcomes if o.rule.id == "kv-cache-fp8-e5m2")
    assert kv.status == "skipped" and "4300 digits" in kv.reason


@pytest.mark.parametrize("args", [["--nnodes", "9" * 400], ["-pp", "1e309"],
                                  ["--data-parallel-size", "inf", "--data-parallel-size-local", "1"]])
def test_an_infinite_parallel_size_is_no_node_count_and_no_traceback(args):
    """facts.nodes int()ed an infinity: OverflowError for every rule on host.nodes."""
    count, _ = context(args=args).fact("host.nodes")
    assert count == 1


# -- hostile input: list facts and names from config.json, time bounded --------------------------------------

def test_a_regex_on_a_list_of_100000_names_and_a_name_of_a_megabyte_takes_no_time(tmp_path):
    """'.*l.*b.*' on quant_ignore's 100,000 names took 25 s (the list's JSON, 1 MB, matched whole: quadratic);
    a name of 1 MB took as long in one item (model_type, architectures)."""
    names = [f"l{i}" for i in range(100_000)]
    many = model_dir(tmp_path, "many", {"model_type": "x", "quantization_config": {
        "quant_method": "fp8", "ignore": [*names, "l" * 2**20]}, "architectures": ["a" * 2**20]})
    facts = M.model_facts(many)
    assert len(facts.quant_ignore) == 100_000 and facts.architectures == ()
    long_type = model_dir(tmp_path, "long", {"model_type": "a" * 2**20})
    assert M.model_facts(long_type).model_type is None
    rules = site_rules(tmp_path, "values: {model.quant_ignore: '.*l.*b.*'}")
    start = time.process_time()  # CPU, not wall: a busy box slows the wall clock, not the work
    assert site_outcome(rules, context(model=many)).status == "clear"
    assert time.process_time() - start < 5
    assert F.condition("l9999.").holds(tuple(names)) is True  # item by item, still


def test_a_list_fact_still_matches_as_json_while_short(tmp_path):
    assert F.condition(r'\["a","b"\]').holds(("a", "b")) is True
    long = tuple(f"m{i}" for i in range(2000))
    assert F.condition(r'\[.*\]').holds(long) is False  # over MAX_LIST_JSON: items only


# -- hostile input: rules.d ----------------------------------------------------------------------------------

@pytest.mark.parametrize("match", ["values: {--max-num-seqs: '>١٢'}", "values: {'--max-num-seqs * ٢': '>1'}"])
def test_a_number_in_other_digits_than_0_to_9_is_a_file_line_error(tmp_path, match):
    """NUMBER's \\d took Arabic-Indic digits: '>١٢' loaded as '>12'."""
    with pytest.raises(ConfigErrors) as caught:
        site_rules(tmp_path, match)
    lines = [str(e) for e in caught.value.errors]
    assert any(line.startswith(f"{tmp_path / '10-site.yaml'}:5: ") and "is neither a number nor a fact" in line
               for line in lines), lines


def test_an_expression_of_200_characters_loads_and_201_is_refused(tmp_path):
    key = "--max-num-seqs * --" + "b" * (F.MAX_EXPRESSION - 19)
    assert len(key) == F.MAX_EXPRESSION
    site_rules(tmp_path, f"values: {{'{key}': '>1'}}")
    with pytest.raises(ConfigErrors) as caught:
        site_rules(tmp_path, f"values: {{'{key}b': '>1'}}")
    assert "an expression of 201 characters: at most 200" in str(caught.value.errors[0])


# -- hostile input: the command line -------------------------------------------------------------------------

@pytest.mark.process
def test_check_and_profiles_show_take_a_hostile_config_json_and_huge_flags(write, cli, child_user, monkeypatch,
                                                                           tmp_path):
    monkeypatch.setenv("STATE_DIRECTORY", str(tmp_path / "state"))
    model = raw_model_dir(tmp_path, "hostile", '{"model_type": "deepseek_v32", "index_topk": %s, "sliding_window": '
                                               'NaN, "rope_scaling": {"factor": %s}}' % (HUGE, HUGE))
    conf = write("etc/gpuwarden.yaml", "gpu: {backend: sim, scenario: rtx-pro-4000-headless}\ntuning: {apply: false}\n"
                 f"serve:\n  enabled: true\n  model: {model}\n  user: {child_user}\n  profile: generic\n"
                 "  command: [python3, -m, vllm.entrypoints.openai.api_server]\n"
                 f"  args: [--max-num-seqs, '{'9' * 5000}', --max-model-len, '1e309', --nnodes, '{'9' * 400}']\n")
    write("etc/rules.d/50-site.yaml", "rules:\n  - id: site-topk\n    severity: warning\n    match:\n"
          "      values: {'model.index_topk * --max-num-seqs': '>1', --max-model-len: '>model.sliding_window'}\n"
          "    message: m\n    fix: f\n    source: s\n")
    status, out, err = cli("profiles", "show", "--json", "-c", conf)
    assert status == 0 and "Traceback" not in err, err
    lint = {o["rule"]: o for o in json.loads(out)["lint"]}
    assert "site-topk" not in lint  # skipped: index_topk 10**400 reads as not set
    status, _, err = cli("check", "-c", conf)
    assert "Traceback" not in err and status in (0, 78), err


def test_a_key_with_a_newline_is_refused_on_one_line(tmp_path):
    """A quoted YAML key may hold a newline; the FILE:LINE error printed it raw, on two lines."""
    with pytest.raises(ConfigErrors) as caught:
        site_rules(tmp_path, 'values: {"--max-num-seqs\\n* model.colour": ">1"}')
    line = str(caught.value.errors[0])
    assert "\n" not in line and "rules.0.match.values.--max-num-seqs\\n* model.colour: " in line, line
