"""Attacks on the lint-rule conditions of issue 44 item 2 (products of numeric facts, comparisons with a fact,
list facts matched by a regex, model.index_topk) as a local user or a config author makes them: a config.json
of another user with numbers beyond a float, NaN and Infinity, names of megabytes and lists of 100,000 items;
serve.args with 400 or 5,000 digits, 'nan' and an infinity times 0; a rules.d number in Arabic-Indic digits.
None may stop `gpuwarden check` or the daemon's start (the lint runs on it) with a traceback, nor hang it."""

import json
import time

import pytest

from gpuwarden.base.yamlfile import ConfigErrors
from gpuwarden.serving.compose import facts as F
from gpuwarden.serving.compose import model as M
from gpuwarden.serving.compose.engines import evaluate_lint
from test_rule_conditions import model_dir, site_outcome, site_rules
from test_rules import context

HUGE = "1" + "0" * 400  # 10**400: Python's json takes it, float() of it raises OverflowError
SPEC = "--speculative-config"
PRODUCT = "--speculative-config.num_speculative_tokens * --max-num-seqs"


def raw_model_dir(tmp_path, name: str, text: str) -> str:
    folder = tmp_path / name
    folder.mkdir()
    (folder / "config.json").write_text(text)
    return str(folder)


# -- config.json: numbers a float cannot hold, NaN, Infinity -------------------------------------------------

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


# -- NaN and an infinity times 0 ------------------------------------------------------------------------------

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


# -- serve.args with thousands of digits ----------------------------------------------------------------------

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


# -- list facts and names from config.json: time bounded ------------------------------------------------------

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
    start = time.monotonic()
    assert site_outcome(rules, context(model=many)).status == "clear"
    assert time.monotonic() - start < 5
    assert F.condition("l9999.").holds(tuple(names)) is True  # item by item, still


def test_a_list_fact_still_matches_as_json_while_short(tmp_path):
    assert F.condition(r'\["a","b"\]').holds(("a", "b")) is True
    long = tuple(f"m{i}" for i in range(2000))
    assert F.condition(r'\[.*\]').holds(long) is False  # over MAX_LIST_JSON: items only


# -- rules.d --------------------------------------------------------------------------------------------------

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


# -- the command line -----------------------------------------------------------------------------------------

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
