"""The engine seam's contract, for every engine in serving/compose/engines/, and SGLang's own parts.

No real SGLang serves in these tests (it cannot on these CPUs): its argv, health and metrics paths, metric
names, log parser and lint are tested here against the seam; its real argument parser runs in
test_sglang_flag_check_runs_sglangs_own_parser when the vLLM venv also holds sglang (tests/vllm/install).
"""

import dataclasses
import logging
import os
import pwd

import pytest

from gpuwarden import config
from gpuwarden.web.exposition import make_registry
from gpuwarden.gpu.base import GpuSample
from gpuwarden.gpu.sim.backend import ManualClock
from gpuwarden.serving.compose.command import build_command, entry_length
from gpuwarden.serving.compose.engines import Engine, engine_for, lint, names
from gpuwarden.serving.lint.flags import flag_value
from gpuwarden.serving.compose.identity import Identity
from gpuwarden.serving.probe.metrics import MetricsReader, parse
from gpuwarden.serving.compose.prepare import compose
from gpuwarden.serving.run.spec import engine_spec
from gpuwarden.serving.compose.profiles import load_profiles, select_profile
from gpuwarden.serving.run.supervisor import RUNNING, STARTING, Program, Supervisor
from gpuwarden.base.yamlfile import ConfigError
from test_faults import fake, no_fakes_left  # noqa: F401 (the fixtures the real-process test uses)
from test_faults import fault_config, metrics, serving_state, status, wait_until
from test_serving import FakeGpu, FakeOps, Inline

PROFILES = load_profiles(None)
ENGINES = names()

# For each engine: a line of its output at each level, and a scrape in its metric names.
LOG_LINES = {
    "vllm": [("INFO 11-26 12:00:00 [api_server.py:1] starting", logging.INFO),
             ("(EngineCore_DP0 pid=12) WARNING 11-26 [core.py:9] slow", logging.WARNING),
             ("ERROR 11-26 [core.py:1] OSError: no config.json", logging.ERROR),
             ("  File \"x.py\", line 3, in <module>", None)],
    "sglang": [("[2026-11-26 12:00:00 TP0] Load weight begin. avail mem=94.50 GB", logging.INFO),
               ("[2026-11-26 12:00:01] INFO:     127.0.0.1:5 - \"GET /health HTTP/1.1\" 200 OK", logging.INFO),
               ("[2026-11-26 12:00:02 TP3] Using default MoE kernel config. Performance might be sub-optimal! "
                "Warning: no tuned config", logging.WARNING),
               ("[2026-11-26 12:00:03 TP0] Scheduler hit an exception: Traceback (most recent call last):",
                logging.ERROR),
               ("Traceback (most recent call last):", logging.ERROR),
               ("RuntimeError: CUDA error: out of memory", logging.ERROR),
               ("  File \"scheduler.py\", line 3, in event_loop", None)],
}


def scrape(engine: Engine, generation: float, running: float) -> str:
    n = engine.metric_names
    return (f"# TYPE x counter\n{n.generation_tokens}{{model_name=\"m\"}} {generation}\n"
            f"{n.prompt_tokens}{{model_name=\"m\"}} 10\n{n.requests_running}{{model_name=\"m\"}} {running}\n"
            f"{n.requests_waiting}{{model_name=\"m\"}} 2\n{n.kv_cache_usage[0]}{{model_name=\"m\"}} 0.5\n")


def serve(engine: str, extra: str = "") -> config.Config:
    return config.parse_text(f"serve:\n  engine: {engine}\n  model: /m/Model-8B\n  port: 8123\n{extra}", "c.yaml")


def sample(index=0, cc="12.0", mem_gib=96):
    return GpuSample(index, f"GPU-{index}", "G", f"00:{index}", cc, memory_total_bytes=mem_gib * 2**30,
                     memory_used_bytes=0)


def test_both_engines_are_found_by_module():
    assert {"vllm", "sglang"} <= set(ENGINES)
    assert engine_for("vllm").title == "vLLM" and engine_for("sglang").title == "SGLang"
    assert engine_for("nope") is None and engine_for("../vllm") is None


@pytest.mark.parametrize("name", ENGINES)
def test_argv_has_the_command_model_required_profile_and_user_args_in_that_order(name):
    engine = engine_for(name)
    cfg = serve(name, "  args: [--extra, \"1\"]\n")
    profile = select_profile(PROFILES, "auto", [sample()], name)
    assert profile is not None and profile.engine == name  # every engine has a profile for any GPU
    cmd = build_command(cfg.serve, profile, [sample()], {"PATH": "/bin"})
    prefix = engine.default_command
    assert cmd.argv[:len(prefix)] == prefix and cmd.prefix == len(prefix)
    assert cmd.flags == list(cmd.argv[len(prefix):])
    assert cmd.flags[:2] == [engine.model_flag, "/m/Model-8B"]
    assert all(arg in cmd.flags for arg in engine.required_args)
    assert cmd.argv[-6:] == ("--extra", "1", "--host", "127.0.0.1", "--port", "8123")
    # A serve.command of its own: its entry point is the prefix; a flag after it is one the engine's parser reads.
    own = build_command(serve(name, "  command: [/opt/e/bin/python, -m, e.serve, --quiet]\n").serve, profile,
                        [sample()], {"PATH": "/bin"})
    assert own.prefix == 3 and own.flags[:3] == ["--quiet", engine.model_flag, "/m/Model-8B"]


@pytest.mark.parametrize("command, entry", [
    (["vllm", "serve"], 2), (["vllm", "serve", "--no-such-cmdflag"], 2), (["/opt/e/bin/vllm"], 1),
    (["python3", "-m", "vllm.entrypoints.openai.api_server", "--quiet"], 3),
    (["/usr/bin/python3", "-u", "-X", "dev", "-m", "sglang.launch_server", "--x", "1"], 6),
    (["/usr/bin/python3", "/t/fakechild.py", "--mode", "killer"], 2), (["python3.12", "-mvllm", "--x"], 2),
    (["/opt/e/bin/serve.py", "--mode", "killer"], 1), (["python3"], 1),
    (["/opt/v/bin/python", "/t/vllm_cli.py", "serve", "--nnodes", "2"], 3)])
def test_the_entry_point_of_serve_command_ends_where_the_engines_flags_begin(command, entry):
    assert entry_length(command) == entry


@pytest.mark.parametrize("name", ENGINES)
def test_memory_fraction_and_tensor_parallel_size(name):
    engine = engine_for(name)
    assert engine.memory_fraction([]) == engine.default_memory_fraction
    assert engine.memory_fraction([engine.memory_flag, "0.5"]) == 0.5
    assert engine.memory_fraction([f"{engine.memory_flag}=0.7"]) == 0.7
    assert engine.tensor_parallel_size([]) == 1
    for flag in engine.tp_flags:
        assert engine.tensor_parallel_size([flag, "4"]) == 4


@pytest.mark.parametrize("name", ENGINES)
def test_log_levels(name):
    engine = engine_for(name)
    for line, level in LOG_LINES[name]:
        assert engine.log_level(line) == level, line


@pytest.mark.parametrize("name", ENGINES)
def test_metric_names_map_to_the_generic_stats(name, monkeypatch):
    engine = engine_for(name)
    texts = iter([scrape(engine, 100, 3), scrape(engine, 400, 5)])
    monkeypatch.setattr("gpuwarden.serving.probe.metrics.fetch",
                        lambda url, owner=None, wanted=None: parse(next(texts), wanted))
    clock = ManualClock(0)
    reader = MetricsReader("http://x" + engine.metrics_path, engine.metric_names, clock, Inline(clock))
    reader.read(0)
    clock.advance(2)
    stats = reader.read(2)
    assert stats.generation_tokens_per_s == 150 and stats.prompt_tokens_per_s == 0
    assert (stats.requests_running, stats.requests_waiting, stats.kv_cache_usage_ratio) == (5, 2, 0.5)
    assert engine.health_path.startswith("/") and engine.metrics_path.startswith("/")


class RecordingOps(FakeOps):
    def __init__(self, clock):
        super().__init__(clock)
        self.urls = []

    def health(self, url, owner=None):
        self.urls.append(url)
        return super().health(url, owner)


@pytest.mark.parametrize("name", ENGINES)
def test_a_program_of_each_engine_starts_probes_its_health_and_logs_its_lines(name, caplog):
    caplog.set_level("INFO")
    cfg = serve(name)
    clock = ManualClock(100)
    ops = RecordingOps(clock)
    profile = select_profile(PROFILES, "auto", [sample()], name)
    cmd = build_command(cfg.serve, profile, [sample()], {"PATH": "/bin"})
    me = pwd.getpwuid(os.geteuid())
    program = Program(engine_spec(cfg.serve, cmd, Identity(me.pw_name, me.pw_uid, me.pw_gid, me.pw_dir, (), False),
                                  [FakeGpu()]), ops=ops, clock=clock)
    supervisor = Supervisor([program])
    supervisor.start(clock.now)
    assert program.state == STARTING and ops.children[0][0] == cmd.argv
    ops.health_ok = True
    supervisor.tick(clock.now)
    assert program.state == RUNNING
    assert ops.urls[-1] == "http://127.0.0.1:8123" + engine_for(name).health_path
    assert f"{engine_for(name).title} healthy after" in caplog.text
    view = supervisor.views()[0]
    assert view.engine == name and ("STOPPED", "STARTING", 1) in view.transitions


def test_the_supervisor_ticks_every_program_even_when_one_fails():
    class Broken:
        name, stopped = "broken", True

        def tick(self, now):
            raise RuntimeError("boom")

    class Counting:
        name, stopped, ticks = "counting", True, 0

        def tick(self, now):
            self.ticks += 1

    counting = Counting()
    supervisor = Supervisor([Broken(), counting])
    with pytest.raises(RuntimeError, match="boom"):
        supervisor.tick(0)
    assert counting.ticks == 1 and supervisor.main.name == "broken" and supervisor.stopped


def test_unknown_engine_is_an_error_at_its_line():
    cfg = serve("tgi")
    with pytest.raises(ConfigError) as caught:
        compose(cfg, [sample()])
    assert str(caught.value).startswith("c.yaml:2: serve.engine: no serving engine named 'tgi'")
    assert "sglang" in str(caught.value) and "vllm" in str(caught.value)


def test_a_profile_of_another_engine_is_refused():
    cfg = serve("sglang", "  profile: sm120-small-dense\n")
    with pytest.raises(ConfigError, match="profile sm120-small-dense is for engine vllm, and serve.engine is sglang"):
        compose(cfg, [sample()])


# -- SGLang -----------------------------------------------------------------------------------------

def test_auto_picks_the_sglang_deepseek_profile_on_eight_sm120_cards_and_only_for_sglang():
    eight = [sample(i) for i in range(8)]
    assert select_profile(PROFILES, "auto", eight, "sglang").name == "sm120-deepseek-v4-flash-sglang-tp8"
    assert select_profile(PROFILES, "auto", eight, "vllm").name == "sm120-deepseek-v4-flash-tp8"
    assert select_profile(PROFILES, "auto", [sample(cc="9.0")], "sglang").name == "sglang-generic"


def test_sglang_command_for_deepseek_v4_carries_the_reports_flags_and_serves_metrics():
    cfg = config.parse_text("serve:\n  engine: sglang\n  model: /srv/DeepSeek-V4-Flash-FP8\n", "c.yaml")
    composed = compose(cfg, [sample(i) for i in range(8)], base_env={"PATH": "/bin"})
    argv = composed.command.argv
    assert argv[:5] == ("python3", "-m", "sglang.launch_server", "--model-path", "/srv/DeepSeek-V4-Flash-FP8")
    assert "--enable-metrics" in argv and flag_value(argv, "--tensor-parallel-size") == "8"
    assert composed.command.memory_fraction == 0.85
    assert {f.rule: f.severity for f in composed.findings} == {  # no PYTHONPATH patch yet
        "sglang-dsv4-sm120-flashmla": "warning",
        "fact-unknown": "info"}  # /srv/DeepSeek-V4-Flash-FP8 is not here: its config.json's rules are not judged


def rules(argv, env=None, cc="12.0", model="/m/DeepSeek-V4-Flash-FP8"):
    profile = PROFILES["sglang-generic"]
    return {f.rule: f.severity for f in lint(argv, env or {}, profile, [cc], model)}


def test_sglang_lint_from_the_deepseek_v4_report():
    good = ["--fp8-gemm-backend", "triton", "--moe-runner-backend", "triton"]
    assert rules(good, {"PYTHONPATH": "/dsv4"}) == {}
    assert rules(good) == {"sglang-dsv4-sm120-flashmla": "warning"}
    assert rules([], {"PYTHONPATH": "/dsv4"}) == {"sglang-dsv4-sm120-triton": "warning"}
    assert rules(good + ["--context-length", "393216"], {"PYTHONPATH": "/dsv4"}) == {
        "sglang-dsv4-sm120-long-context": "warning"}
    assert rules([], cc="9.0") == {} and rules([], model="/m/Qwen3-8B") == {}  # SM120 DeepSeek-V4 only
    # SGLang reads its key from nowhere but --api-key: a warning, not the error that has a fix for vLLM.
    assert rules(good + ["--api-key", "k"], {"PYTHONPATH": "/dsv4"}) == {"api-key-on-command-line-sglang": "warning"}
    assert all(f.source for f in lint([], {}, PROFILES["sglang-generic"], ["12.0"], "/m/DeepSeek-V4"))


def test_sglang_metrics_carry_the_engine_label_and_no_vllm_names():
    from gpuwarden.watch.monitor import GpuView, Snapshot
    from gpuwarden.serving.probe.metrics import ServingStats
    from gpuwarden.serving.run.supervisor import ServingView

    view = ServingView("RUNNING", "/m/x", "sglang-generic", 1, 0, None, 3.0, None, False, "sglang", "SGLang",
                       (("STOPPED", "STARTING", 1), ("STARTING", "RUNNING", 1)))
    snap = Snapshot(0.0, 0.0, (GpuView(sample(), None, None),), (), children=(view,),
                    stats=ServingStats(generation_tokens_per_s=42.0))
    families = {m.name: m for m in make_registry(lambda: snap).collect()}
    assert not [name for name in families if name.startswith("gpuwarden_vllm")]
    rate = families["gpuwarden_serving_generation_tokens_per_second"].samples[0]
    assert rate.labels == {"engine": "sglang"} and rate.value == 42.0
    moves = {(s.labels["from"], s.labels["to"]): s.value for s in families["gpuwarden_serving_transitions"].samples
             if s.name.endswith("_total")}
    assert moves == {("STOPPED", "STARTING"): 1, ("STARTING", "RUNNING"): 1}
    assert "x (sglang-generic) 42 tok/s" in snap.summary_line()
    # The installed version rides on the info series, for the fleet's ServingEngineVersionsDiffer.
    assert families["gpuwarden_serving_info"].samples[0].labels == {"engine": "sglang", "model": "/m/x",
                                                                    "profile": "sglang-generic", "version": ""}
    versioned = dataclasses.replace(view, version="0.5.23")
    snap = dataclasses.replace(snap, children=(versioned,))
    info = {m.name: m for m in make_registry(lambda: snap).collect()}["gpuwarden_serving_info"].samples[0]
    assert info.labels["version"] == "0.5.23"


@pytest.mark.process
@pytest.mark.vllm
def test_sglang_flag_check_runs_sglangs_own_parser(vllm_python, child_user, write, cli):
    """SGLang's ServerArgs parser, in the interpreter that holds it (the vLLM venv, where tests/vllm/install
    adds sglang without its GPU dependencies), accepts the profile and rejects what SGLang rejects."""
    def conf(args):
        return write("g.yaml", f"gpu: {{backend: sim, scenario: rtx-pro-6000-tp4}}\ntuning: {{apply: false}}\n"
                     f"serve:\n  enabled: true\n  engine: sglang\n  model: /m/Qwen3-8B\n  user: {child_user}\n"
                     f"  command: [{vllm_python}, -m, sglang.launch_server]\n  args: {args}\n")
    status, out, err = cli("check", "--deep", "-c", conf('["--tp", "4"]'))
    assert status == 0, err
    assert "SGLang 0.5.23 accepts:" in out and "--model-path /m/Qwen3-8B" in out
    status, _, err = cli("check", "--deep", "-c", conf('["--cuda-graph-max-bs", "32"]'))
    assert status == 78 and "SGLang rejects the flags: ambiguous option: --cuda-graph-max-bs" in err


@pytest.mark.process
def test_the_daemon_serves_with_sglang_as_a_real_child_and_exports_its_counters(write, daemons, fake, no_fakes_left):
    """The whole path with a real process speaking as SGLang (tests/harness/fakechild.py --mode sglang, which exits 2
    without --model-path and --enable-metrics, as SGLang's parser would): the daemon builds SGLang's argv,
    finds it healthy, reads its sglang: counters into gpuwarden_serving_*{engine="sglang"}, and stops it."""
    path, base, _ = fault_config(write, fake, "sglang")
    path.write_text(path.read_text().replace("  profile: generic\n", "  engine: sglang\n  profile: sglang-generic\n"))
    d = daemons(path)
    wait_until(lambda: serving_state(base) == "RUNNING", timeout=30)
    text = wait_until(lambda: (lambda t: t if 'gpuwarden_serving_generation_tokens_per_second{engine="sglang"}'
                                          in t else None)(metrics(base)), timeout=15)
    assert 'gpuwarden_serving_requests_running{engine="sglang"} 2.0' in text
    assert 'gpuwarden_serving_kv_cache_usage_ratio{engine="sglang"} 0.2' in text
    assert 'gpuwarden_serving_state{child="sglang",state="RUNNING"} 1.0' in text
    assert "gpuwarden_vllm_" not in text  # the legacy names are vLLM's only
    state = status(base)
    assert state["serving"]["engine"] == "sglang" and state["serving_stats"]["requests_running"] == 2
    assert "SGLang healthy after" in d.log and "--model-path /fake/model --enable-metrics" in d.log
    assert "sglang: [" in d.log  # its own lines, logged under its name
    assert d.stop() == 0
    assert "SGLang stopped after" in d.log


def test_profiles_show_builds_a_named_profile_for_its_own_engine(cli, write):
    conf = write("c.yaml", "gpu: {backend: sim, scenario: rtx-pro-4000-headless}\nserve:\n  model: /m/DeepSeek-V4-Flash\n")
    status, out, _ = cli("profiles", "show", "sm120-deepseek-v4-flash-sglang-tp8", "-c", conf)
    assert status == 0
    assert "python3 -m sglang.launch_server --model-path /m/DeepSeek-V4-Flash --enable-metrics" in out
    assert "engine sglang; SGLang tested range not stated; known good" in out and "sglang-dsv4-sm120-flashmla" in out
    status, out, _ = cli("profiles", "list", "-c", conf)
    rows = {line.split()[0]: line.split()[1] for line in out.splitlines()}
    assert rows["sglang-generic"] == "sglang" and rows["generic"] == "vllm"
