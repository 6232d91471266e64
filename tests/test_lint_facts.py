"""The facts the lint rules read beyond the argv's words (serving/lint/facts.py, serving/lint/model.py):
JSON flags and numbers, the host's driver and nodes, and a local model directory read within bounds; rules.d
gets FILE:LINE for a fact or condition it cannot use; findings carry the facts they matched on and their link."""

import json
import os
import struct
import sys
import threading

import pytest

from gpuwarden.serving.lint import facts as F
from gpuwarden.serving.lint import model as M
from gpuwarden.serving.compose.engines import evaluate_lint, rules_for
from gpuwarden.base.yamlfile import ConfigErrors
from test_rules import context, outcome_of, serving_conf

# -- conditions and flags ------------------------------------------------------------------------------------


@pytest.mark.parametrize("cond,value,holds", [
    (">4", "8", True), (">4", "4", False), (">=0.85,<1", "0.9", True), (">=0.85,<1", 0.8, False),
    ("==1", 1, True), ("!=1", "2", True), (">4", "many", False), (">4", None, False),
    ("(?i)mtp|deepseek_mtp", "MTP", True), ("mtp", "ngram", False),
    (True, "true", True), (True, True, True), (False, "0", True), (True, None, False),
    (None, None, True), (None, "x", False), (3, "3.0", True),
])
def test_a_condition_compares_numbers_matches_text_and_tests_presence(cond, value, holds):
    assert F.condition(cond).holds(value) is holds


def test_a_condition_that_is_neither_comparison_nor_regex_says_so():
    with pytest.raises(ValueError, match="neither a comparison"):
        F.condition("(unclosed")


def test_a_json_flag_field_reads_as_vllm_does_and_the_dotted_spelling_wins():
    flags = ["--speculative-config", '{"method": "mtp", "num_speculative_tokens": 2, "x": {"y": [1, 2]}}']
    assert F.flag_fact(flags, "--speculative-config.method") == "mtp"
    assert F.flag_fact(flags, "--speculative-config.x.y") == [1, 2]
    assert F.flag_fact(flags, "--speculative-config.absent") is None
    assert F.flag_fact(flags + ["--speculative-config.method=ngram"], "--speculative-config.method") == "ngram"
    assert F.flag_fact(["--compilation_config.pass_config.fuse_gemm_comms", "true"],
                       "--compilation-config.pass_config.fuse_gemm_comms") == "true"


@pytest.mark.parametrize("raw", ["not json", "[1, 2]", '{"a": ' * 20 + "1" + "}" * 20,
                                 '{"a": "' + "x" * (F.MAX_FLAG_JSON + 1) + '"}'])
def test_a_json_flag_that_is_not_a_small_shallow_object_has_no_fields(raw):
    assert F.flag_fact(["--speculative-config", raw], "--speculative-config.method") is None


def test_a_boolean_flag_is_what_its_last_spelling_says():
    from gpuwarden.serving.lint.flags import switch

    assert switch(["--enable-prefix-caching"], "--enable-prefix-caching") is True
    assert switch(["--enable-prefix-caching", "--no-enable-prefix-caching"], "--enable-prefix-caching") is False
    assert switch(["--no_enable_prefix_caching", "--enable-prefix-caching"], "--enable-prefix-caching") is True
    assert switch([], "--enable-prefix-caching") is None


@pytest.mark.parametrize("driver,nvml,cuda", [
    ("580.95.05", None, "13.0"), ("575.64.05", None, "12.9"), ("610.43.02", "13.3", "13.3"),
    ("610.43.02", None, None), ("470.1", None, None), (None, None, None)])
def test_the_cuda_a_driver_runs_comes_from_nvml_else_the_branch_table(driver, nvml, cuda):
    assert F.driver_cuda(driver, nvml)[0] == cuda


@pytest.mark.parametrize("flags,gpus,count", [
    (["--tensor-parallel-size", "4"], 1, 4), (["--tensor-parallel-size", "4"], 4, 1),
    (["--nnodes", "2", "--tensor-parallel-size", "2"], 1, 2), (["-tp", "2", "-pp", "2"], 2, 2),
    (["--data-parallel-size", "4", "--data-parallel-size-local", "2"], 2, 2), ([], 1, 1)])
def test_a_group_spans_hosts_by_nnodes_data_parallel_or_more_ranks_than_gpus(flags, gpus, count):
    tp = int(F.flag_value(flags, "--tensor-parallel-size", "-tp") or 1)
    assert F.nodes(flags, tp, gpus)[0] == count


def test_torch_cuda_comes_from_version_py_else_the_local_version():
    assert F.cuda_of_torch("2.12.0+cu132", None) == "13.2" and F.cuda_of_torch("2.12.0+cu128", "12.8") == "12.8"
    assert F.cuda_of_torch("2.12.0+cpu", None) is None


# -- the model directory -------------------------------------------------------------------------------------

def header(tensors: dict) -> bytes:
    raw = json.dumps(tensors).encode()
    return struct.pack("<Q", len(raw)) + raw


def test_a_model_directory_gives_its_config_quantization_and_parameter_count(tmp_path):
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next", "num_nextn_predict_layers": 1,
        "max_position_embeddings": 262144, "rope_scaling": {"factor": 4.0, "original_max_position_embeddings": 65536},
        "quantization_config": {"quant_method": "compressed-tensors",
                                "config_groups": {"g": {"weights": {"num_bits": 4}}}, "ignore": ["lm_head"]}}))
    (folder / "qwen3_reasoning_parser.py").write_text("")
    (folder / "model-1.safetensors").write_bytes(header({
        "__metadata__": {"format": "pt"},
        "a.weight": {"dtype": "BF16", "shape": [1000, 1000], "data_offsets": [0, 0]},
        "b.weight_packed": {"dtype": "U8", "shape": [1000, 500], "data_offsets": [0, 0]},  # two FP4 a byte
        "b.weight_scale": {"dtype": "F8_E4M3", "shape": [1000, 62], "data_offsets": [0, 0]}}))
    facts = M.model_facts(str(folder))
    assert facts.known, facts.why
    assert (facts.model_type, facts.hybrid, facts.nextn_layers, facts.quant_method, facts.quant_bits) == \
        ("qwen3_next", True, 1, "compressed-tensors", 4)
    assert (facts.original_max_position_embeddings, facts.rope_factor, facts.quant_ignore) == (65536, 4.0, ("lm_head",))
    assert facts.params_b == pytest.approx(0.002) and facts.generation_config is False
    assert facts.reasoning_parsers == ("qwen3_reasoning_parser.py",)
    assert M.model_facts(str(folder)) is facts  # unchanged: from the cache
    (folder / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert M.model_facts(str(folder)).model_type == "llama"


def test_a_reload_reads_no_model_directory_only_the_cache(tmp_path):
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    on_loop = M.model_facts(str(folder), read=False)
    assert not on_loop.known and "not on a reload" in on_loop.why
    read = M.model_facts(str(folder))
    assert read.known and M.model_facts(str(folder), read=False) is read


def test_a_remote_id_or_a_missing_directory_has_no_facts_and_says_why(tmp_path):
    assert "not a local directory" in M.model_facts("Qwen/Qwen3-8B").why
    assert "No such file" in M.model_facts(str(tmp_path / "gone")).why
    (tmp_path / "empty").mkdir()
    assert M.model_facts(str(tmp_path / "empty")).why.endswith("has no config.json")


def test_a_hugging_face_snapshot_reads_through_its_links_into_blobs(tmp_path):
    repo = tmp_path / "models--org--name"
    (repo / "blobs").mkdir(parents=True)
    (repo / "blobs" / "abc").write_text(json.dumps({"model_type": "qwen3"}))
    snap = repo / "snapshots" / "0123"
    snap.mkdir(parents=True)
    (snap / "config.json").symlink_to("../../blobs/abc")
    facts = M.model_facts(str(snap))
    assert facts.known and facts.model_type == "qwen3"


def test_a_link_out_of_the_model_a_fifo_and_a_device_are_refused_without_reading(tmp_path):
    secret = tmp_path / "secret.json"
    secret.write_text("{}")
    for name, make in (("out", lambda p: p.symlink_to(secret)), ("dev", lambda p: p.symlink_to("/dev/zero")),
                       ("fifo", os.mkfifo)):
        folder = tmp_path / name
        folder.mkdir()
        make(folder / "config.json")
        done = []
        reader = threading.Thread(target=lambda: done.append(M.model_facts(str(folder))), daemon=True)
        reader.start()
        reader.join(5)  # a FIFO opened without O_NONBLOCK would block here for good
        assert done and not done[0].known, name
        assert "outside the model directory" in done[0].why or "not a regular file" in done[0].why, done[0].why


@pytest.mark.parametrize("text,says", [
    ("x" * (M.MAX_JSON_BYTES + 1), "more than the"),
    ("[" * 50 + "]" * 50, "deeper than"),
    ("[" * 100000 + "]" * 100000, "not JSON"),  # deeper than Python's parser goes: RecursionError, said
    ("{nope", "not JSON"),
])
def test_an_oversized_or_deep_config_is_refused_in_one_line(tmp_path, text, says):
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "config.json").write_text(text)
    facts = M.model_facts(str(folder))
    assert not facts.known and says in facts.why and "\n" not in facts.why


@pytest.mark.parametrize("blob,says", [
    (struct.pack("<Q", M.MAX_HEADER_BYTES + 1), "more than is read"),
    (struct.pack("<Q", 10**6) + b"{}", "more than is read"),  # a header longer than the file
    (b"\x01\x02", "too short"),
    (header({"t": {"dtype": "BF16"}}), "no dtype and shape"),
])
def test_a_bad_safetensors_header_leaves_the_count_unknown_and_says_why(tmp_path, blob, says):
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(blob)
    facts = M.model_facts(str(folder))
    assert facts.known and facts.params_b is None and says in facts.params_note


def test_a_directory_of_too_many_entries_is_not_listed_to_the_end(tmp_path, monkeypatch):
    monkeypatch.setattr(M, "MAX_ENTRIES", 5)
    folder = tmp_path / "m"
    folder.mkdir()
    for i in range(6):
        (folder / f"f{i}").write_text("")
    assert "more than 5 entries" in M.model_facts(str(folder)).why


# -- rules over facts ----------------------------------------------------------------------------------------

def test_a_rule_that_needs_an_unreadable_fact_is_skipped_and_says_why():
    rules = {r.id: r for r in rules_for(None).rules}
    line = outcome_of(rules["no-generation-config"], context(model="Qwen/Qwen3.5-9B")).line()
    assert line == ("no-generation-config: skipped, needs the model's config.json: Qwen/Qwen3.5-9B is not a local "
                    "directory (a remote id: its config.json is not read)")
    cuda = outcome_of(rules["cuda-toolchain-beyond-driver"], context(versions={"torch": "2.12.0+cu132"}))
    assert cuda.line() == "cuda-toolchain-beyond-driver: skipped, needs the driver version (no GPU readable here)"


def test_a_finding_says_the_facts_it_matched_on_and_its_link():
    rules = {r.id: r for r in rules_for(None).rules}
    finding = outcome_of(rules["cuda-toolchain-beyond-driver"], context(
        cc="12.1", driver="580.95.05", versions={"torch": "2.12.0+cu132"}, torch_cuda="13.2")).finding
    assert finding.facts == ("driver 580.95.05 supports CUDA 13.0", "torch 2.12.0+cu132 is built for CUDA 13.2")
    assert finding.traps == ("08",) and finding.link.endswith("/traps/runtime/08-image-toolchain-newer-than-driver.md")
    text = str(finding)
    assert "(matched: driver 580.95.05 supports CUDA 13.0; torch 2.12.0+cu132 is built for CUDA 13.2)" in text
    assert finding.as_dict()["facts"] == list(finding.facts) and finding.as_dict()["traps"] == ["08"]
    spec = outcome_of(rules["spec-depth-unified-memory"], context(cc="12.1", unified=True, gpu_memory_gib=121.5, args=[
        "--speculative-config", '{"method": "dflash", "num_speculative_tokens": 15}'])).finding
    assert "memory shared with the system" in spec.facts  # the product says the default it multiplied
    assert "--speculative-config.num_speculative_tokens 15 x --max-num-seqs 256 (vLLM's default) = 3840" in spec.facts
    assert "121.5 GiB on the smallest GPU (the system memory it shares)" in spec.facts


def test_a_secret_is_never_shown_among_the_facts():
    rules = {r.id: r for r in rules_for(None).rules}
    finding = outcome_of(rules["api-key-on-command-line"], context(args=["--api-key", "hunter2"])).finding
    assert "hunter2" not in str(finding) and "--api-key" in finding.facts


def test_rules_d_can_say_facts_and_numbers_as_data(tmp_path):
    (tmp_path / "10-site.yaml").write_text(
        "rules:\n  - id: site-deep-spec\n    severity: error\n"
        "    match:\n      values: {--speculative-config.num_speculative_tokens: '>4', host.gpus: '==1'}\n"
        "      values_not: {--speculative-config.method: ngram}\n"
        "    message: too deep for our one-GPU boxes\n    fix: at most 4\n    source: our runbook\n"
        "    traps: ['98']\n")
    rules = rules_for(tmp_path)
    fires = evaluate_lint(context(args=["--speculative-config", '{"method": "mtp", "num_speculative_tokens": 6}']),
                          rules)
    found = next(o for o in fires if o.rule.id == "site-deep-spec").finding
    assert found.severity == "error" and found.traps == ("98",) and \
        "--speculative-config.num_speculative_tokens 6" in found.facts
    quiet = evaluate_lint(context(args=["--speculative-config", '{"method": "mtp", "num_speculative_tokens": 4}']),
                          rules)
    assert next(o for o in quiet if o.rule.id == "site-deep-spec").status == "clear"


@pytest.mark.parametrize("match,says", [
    ("values: {model.colour: red}", "rules.0.match.values.model.colour: 'model.colour' is not a fact"),
    ("values: {--x: '(open'}", "neither a comparison"),
    ("values: {--x: [1]}", "expected a regular expression, a comparison"),
    ("defaults: {nope: 1}", "'nope' is not a fact"),
])
def test_a_bad_fact_or_condition_in_rules_d_is_a_file_line_error(tmp_path, match, says):
    (tmp_path / "bad.yaml").write_text(f"rules:\n  - id: enforce-eager\n    match:\n      {match}\n")
    with pytest.raises(ConfigErrors) as caught:
        rules_for(tmp_path)
    assert any(str(e).startswith(f"{tmp_path / 'bad.yaml'}:") and says in str(e) for e in caught.value.errors), \
        [str(e) for e in caught.value.errors]


def test_a_bad_fact_in_rules_d_stops_check_with_78_and_one_line(write, cli, child_user):
    conf = serving_conf(write, child_user)
    bad = write("etc/rules.d/50-site.yaml", "rules:\n  - id: enforce-eager\n    match:\n"
                "      values: {host.colour: red}\n")
    status, out, err = cli("check", "-c", conf)
    assert status == 78 and f"{bad}:4: rules.0.match.values.host.colour: 'host.colour' is not a fact" in err
    assert "Traceback" not in err


@pytest.mark.process
def test_profiles_show_explains_a_finding_with_its_link_and_facts(write, cli, child_user, monkeypatch, tmp_path):
    """The driver comes from the simulator's scenario; the model from a local directory."""
    monkeypatch.setenv("STATE_DIRECTORY", str(tmp_path / "state"))
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen3", "sliding_window": 2048,
                                                    "num_hidden_layers": 5}))
    conf = write("etc/gpuwarden.yaml", "gpu: {backend: sim, scenario: dgx-spark}\ntuning: {apply: false}\n"
                 f"serve:\n  enabled: true\n  model: {folder}\n  user: {child_user}\n  profile: generic\n"
                 f"  command: [{sys.executable}, -m, vllm.entrypoints.openai.api_server]\n")
    status, out, err = cli("profiles", "show", "-c", conf)
    assert status == 0, err
    line = next(line for line in out.splitlines() if "qwen3-sliding-window-off" in line and "warning" in line)
    assert "traps/memory/143-qwen3-sliding-window-config-can-resolve-full-attention.md]" in line
    assert "(matched: config.json qwen3 sliding_window 2048; use_sliding_window is not set" in line
    status, out, err = cli("profiles", "show", "--json", "-c", conf)
    shown = json.loads(out)
    finding = next(f for f in shown["lint"] if f["rule"] == "qwen3-sliding-window-off")
    assert finding["traps"] == ["143"] and finding["facts"][0] == "config.json qwen3 sliding_window 2048"


# -- the driver, from the GPU backends -----------------------------------------------------------------------

def test_nvml_gives_the_driver_and_the_cuda_it_runs_on_every_sample_read_once():
    from harness.fake_nvml import FakeNvml, device

    from gpuwarden.gpu.nvml import NvmlBackend

    class WithCuda(FakeNvml):
        asked = 0

        def nvmlSystemGetCudaDriverVersion_v2(self):
            WithCuda.asked += 1
            return 13000

    backend = NvmlBackend(WithCuda([device("GPU-a", "0000:01:00.0")]))
    samples = [backend.gpus()[0].sample() for _ in range(3)]
    assert {(s.driver_version, s.cuda_driver_version) for s in samples} == {("580.126.20", "13.0")}
    assert WithCuda.asked == 1
    old = NvmlBackend(FakeNvml([device("GPU-a", "0000:01:00.0")]))  # an nvidia-ml-py without the call
    assert old.gpus()[0].sample().cuda_driver_version is None


def test_the_simulator_gives_its_scenarios_driver():
    from gpuwarden.gpu.sim.backend import ManualClock, SimBackend
    from gpuwarden.gpu.sim.scenario import BUILTIN_DIR, load_scenario

    backend = SimBackend(load_scenario(BUILTIN_DIR / "dgx-spark.yaml"), ManualClock())
    sample = backend.gpus()[0].sample()
    assert (sample.driver_version, sample.cuda_driver_version, sample.memory_unified) == ("580.95.05", None, True)
    assert F.driver_cuda(sample.driver_version, sample.cuda_driver_version) == ("13.0", "driver branch 580")


def test_headers_are_counted_in_values_before_they_are_parsed(tmp_path):
    """Attacker 10's F4: headers within the byte caps, made of `[[],[],...]`, still cost 12 s of CPU to parse: the
    brackets and commas of all headers together are counted first, and past MAX_HEADER_TOKENS none is parsed."""
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    per = M.MAX_HEADER_TOKENS // 2 + 1  # two such headers pass the budget
    header = ('{"__metadata__": [' + "[]," * (per // 2) + "[]]}").encode()
    assert len(header) < M.MAX_HEADER_BYTES
    for name in ("a.safetensors", "b.safetensors"):
        (folder / name).write_bytes(struct.pack("<Q", len(header)) + header)
    facts = M.model_facts(str(folder))
    assert facts.known and facts.params_b is None and "JSON values in all" in facts.params_note, facts.params_note
