"""Profiles, lint rules, the argv/env builder, the vLLM metrics reader and the supervisor's state machine."""

import errno
import os
import pwd
import signal

import pytest

from gpuwarden import config
from gpuwarden.backends import open_configured
from gpuwarden.gpu.base import GpuSample
from gpuwarden.gpu.sim.backend import ManualClock
from gpuwarden.gpu.sim.scenario import builtin_scenarios
from gpuwarden.serving.compose.command import build_command, chosen_gpus
from gpuwarden.serving.lint.flags import flag_value
from gpuwarden.serving.compose.engines import lint
from gpuwarden.serving.compose.profiles import load_profiles, select_profile
from gpuwarden.serving.compose.identity import Identity
from gpuwarden.serving.run.processes import Child
from gpuwarden.serving.run.supervisor import BACKOFF, FATAL, RUNNING, STARTING, STOPPED, STOPPING, Program
from gpuwarden.serving.compose.engines.vllm import ENGINE as VLLM
from gpuwarden.serving.probe.metrics import MetricsReader, parse
from gpuwarden.serving.run.spec import engine_spec
from gpuwarden.base.yamlfile import ConfigErrors

PROFILES = load_profiles(None)


def sample(index=0, cc="12.0", mem_gib=24, uuid=None):
    return GpuSample(index, uuid or f"GPU-{index}", "G", f"00:{index}", cc,
                     memory_total_bytes=None if mem_gib is None else mem_gib * 2**30, memory_used_bytes=0)


# -- profiles -------------------------------------------------------------------

def test_builtin_profiles_carry_the_reported_flags():
    assert {name for name, p in PROFILES.items() if p.engine == "vllm"} == {
        "sm120-small-dense", "sm120-glm47-nvfp4-tp4", "sm120-deepseek-v4-flash-tp8",
        "sm121-gpt-oss-120b", "generic"}
    small = PROFILES["sm120-small-dense"]
    assert flag_value(small.args, "--attention-backend") == "TRITON_ATTN"
    assert flag_value(small.args, "--gpu-memory-utilization") == "0.85"
    assert "--enable-chunked-prefill" not in small.args and small.bad_version("0.18.1") is not None
    assert small.bad_version("0.17.1") is None
    glm = PROFILES["sm120-glm47-nvfp4-tp4"]
    assert flag_value(glm.args, "--gpu-memory-utilization") == "0.80" and dict(glm.env) == {
        "CUDA_DEVICE_MAX_CONNECTIONS": "1"}
    dsv4 = dict(PROFILES["sm120-deepseek-v4-flash-tp8"].env)
    assert dsv4 == {"VLLM_USE_DEEP_GEMM": "0"}  # not the variable vLLM releases never read
    assert flag_value(PROFILES["sm121-gpt-oss-120b"].args, "--kv-cache-dtype") == "fp8"


@pytest.mark.parametrize("gpus,expected", [
    ([sample(0)], "sm120-small-dense"),
    ([sample(i, mem_gib=96) for i in range(4)], "sm120-glm47-nvfp4-tp4"),
    ([sample(i, mem_gib=96) for i in range(8)], "sm120-deepseek-v4-flash-tp8"),
    ([sample(0, cc="12.1", mem_gib=None)], "sm121-gpt-oss-120b"),
    ([sample(0, cc="9.0", mem_gib=141)], "generic"),
    ([sample(0), sample(1)], "generic"),  # two 24 GB SM120 cards: no two-GPU profile
])
def test_auto_selection(gpus, expected):
    assert select_profile(PROFILES, "auto", gpus).name == expected


@pytest.mark.parametrize("scenario", builtin_scenarios())
def test_every_scenario_gets_a_profile(scenario):
    cfg = config.parse_text(f"gpu:\n  backend: sim\n  scenario: {scenario}\n")
    samples = [g.sample() for g in open_configured(cfg, ManualClock()).gpus()]
    assert select_profile(PROFILES, "auto", [s for s in samples if s.up]) is not None


def test_user_profiles_override_builtins_by_name(write):
    write("profiles.d/sm120-small-dense.yaml", "name: sm120-small-dense\ndescription: mine\n"
          "args: [--max-num-seqs, \"4\"]\n")
    profiles = load_profiles(write("x", "").parent / "profiles.d")
    assert profiles["sm120-small-dense"].description == "mine" and len(profiles) == len(PROFILES)


def test_bad_profile_file_is_a_located_error(write):
    path = write("profiles.d/bad.yaml", "name: bad\nargs: [--max-num-seqs, 8]\nmatch:\n  gpu_count: [4, 2]\n")
    with pytest.raises(ConfigErrors) as info:
        load_profiles(path.parent)
    lines = [str(e) for e in info.value.errors]
    assert f"{path}:2: args.1: expected a string, got an integer 8 (quote numbers: \"8\")" in lines
    assert any(line.startswith(f"{path}:4: match.gpu_count: expected [MIN, MAX]") for line in lines)


# -- the command ---------------------------------------------------------------------

def serve_config(text=""):
    return config.parse_text("serve:\n  model: /m/Qwen3-4B\n  port: 8123\n" + text, name="c.yaml")


def test_final_argv_and_env():
    cfg = serve_config("  args: [--max-num-seqs, \"4\"]\n  env: {VLLM_LOGGING_LEVEL: WARNING}\n")
    base = {"PATH": "/root/bin:/bin", "NOTIFY_SOCKET": "/run/x", "WATCHDOG_USEC": "1", "WATCHDOG_PID": "1",
            "HOME": "/root", "CREDENTIALS_DIRECTORY": "/run/credentials/gpuwarden.service", "INVOCATION_ID": "ab",
            "DB_PASSWORD": "x", "LANG": "C.UTF-8", "LC_TIME": "C", "CUDA_CACHE_PATH": "/c", "NCCL_P2P_DISABLE": "1",
            "NVIDIA_DRIVER_CAPABILITIES": "compute"}
    cmd = build_command(cfg.serve, PROFILES["sm120-small-dense"], [sample(1)], base, secrets={"VLLM_API_KEY": "k"})
    assert cmd.argv[:4] == ("vllm", "serve", "--model", "/m/Qwen3-4B")
    assert cmd.argv[-4:] == ("--host", "127.0.0.1", "--port", "8123")
    assert flag_value(cmd.argv, "--max-num-seqs") == "4"  # the user's args come after the profile's: they win
    assert cmd.env["CUDA_VISIBLE_DEVICES"] == "1" and cmd.env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    assert cmd.env == {"LANG": "C.UTF-8", "LC_TIME": "C", "CUDA_CACHE_PATH": "/c", "NCCL_P2P_DISABLE": "1",
                       "NVIDIA_DRIVER_CAPABILITIES": "compute",  # the allow-list of our environment
                       "PATH": "/usr/local/bin:/usr/bin:/bin",  # made for the child, never ours
                       "VLLM_LOGGING_LEVEL": "WARNING", "VLLM_API_KEY": "k",  # serve.env, then the secrets
                       "CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": "1"}


def test_redaction_of_secret_looking_values():
    from gpuwarden.serving.compose.secrets import redact_argv, redact_env

    assert redact_env({"VLLM_API_KEY": "k", "HF_TOKEN": "t", "VLLM_LOGGING_LEVEL": "INFO", "EMPTY_KEY": ""}) == {
        "VLLM_API_KEY": "<redacted>", "HF_TOKEN": "<redacted>", "VLLM_LOGGING_LEVEL": "INFO", "EMPTY_KEY": ""}
    assert redact_argv(["vllm", "--api-key", "k", "--hf-token=t", "--port", "1"]) == [
        "vllm", "--api-key", "<redacted>", "--hf-token=<redacted>", "--port", "1"]

    # Every spelling the engines' parsers take: underscores, =, unique prefixes, several keys after one flag.
    for argv, shown in ((["--api_key", "k"], ["--api_key", "<redacted>"]),
                        (["--api_key=k"], ["--api_key=<redacted>"]),
                        (["--api-ke", "k", "--port", "1"], ["--api-ke", "<redacted>", "--port", "1"]),
                        (["--hf_token", "t"], ["--hf_token", "<redacted>"]),
                        (["--api-key", "k1", "k2", "--port", "1"], ["--api-key", "<redacted>", "<redacted>",
                                                                    "--port", "1"]),
                        (["--ssl-keyfile", "/k.pem"], ["--ssl-keyfile", "/k.pem"]),
                        (["--api-key", "-424242", "--port", "1"], ["--api-key", "<redacted>", "--port", "1"]),
                        (["--api-server-count", "2"], ["--api-server-count", "2"])):
        assert redact_argv(argv) == shown, argv


@pytest.mark.parametrize("spelling", [["--api_key", "k"], ["--api_key=k"], ["--api-ke", "k"], ["--api-key=k"]])
def test_the_api_key_lint_sees_every_spelling(spelling):
    profile = load_profiles(None)["generic"]
    findings = lint(["vllm", "serve", *spelling], {}, profile, ["12.0"], "/m/x", prefix=2, engine=VLLM)
    assert "api-key-on-command-line" in [f.rule for f in findings]


def test_a_password_in_a_url_is_redacted_whatever_the_variable():
    from gpuwarden.serving.compose.secrets import redact_env

    shown = redact_env({"HTTPS_PROXY": "http://user:PROXYSECRET@proxy:3128", "NO_PROXY": "http://host:80/x"})
    assert shown == {"HTTPS_PROXY": "http://<redacted>@proxy:3128", "NO_PROXY": "http://host:80/x"}


def test_env_file_format_and_permissions(write):
    from gpuwarden.serving.compose.secrets import SecretFileError, read_env_file

    path = write("s.env", "# comment\nexport VLLM_API_KEY='k 1'\n\nHF_TOKEN=t\n")
    path.chmod(0o600)
    assert read_env_file(path, owner=os.geteuid()) == {"VLLM_API_KEY": "k 1", "HF_TOKEN": "t"}
    path.chmod(0o640)
    with pytest.raises(SecretFileError, match="mode 0640 lets others read it"):
        read_env_file(path, owner=os.geteuid())
    bad = write("b.env", "ok=1\nnot a line\n")
    bad.chmod(0o600)
    with pytest.raises(SecretFileError) as info:
        read_env_file(bad, owner=os.geteuid())
    assert info.value.line == 2 and "not a line" not in info.value.message


def test_gpu_selection_by_index_and_uuid():
    cfg = serve_config("  gpus: [GPU-3, 1]\n")
    chosen = chosen_gpus(cfg, [sample(i) for i in range(4)])
    assert [g.index for g in chosen] == [1, 3]
    bad = serve_config("  gpus: [7]\n")
    with pytest.raises(Exception, match=r"c.yaml:4: serve.gpus.0: no GPU '7' on this host"):
        chosen_gpus(bad, [sample(0)])


GENERIC = PROFILES["generic"]


# -- lint (every rule's own cases are its examples in the rules file: tests/test_rules.py) ---------------

def test_known_bad_vllm_version_is_an_error():
    from gpuwarden.serving.lint.packages import Installed

    small = PROFILES["sm120-small-dense"]

    def found(version):
        have = Installed("/py", True, {"vllm": version, "flashinfer": None, "torch": "2.9.0", "sglang": None})
        return {f.rule: f.severity for f in lint(list(small.args), {}, small, ["12.0"], "/m/Qwen3-4B", have)}

    assert found("0.18.1") == {"known-bad": "error", "profile-untested": "warning"}
    assert found("0.17.1") == {}


# -- vLLM metrics ----------------------------------------------------------------------

SCRAPE = """# TYPE vllm:generation_tokens counter
vllm:generation_tokens_total{{engine="0",model_name="m"}} {gen}
vllm:prompt_tokens_total{{engine="0",model_name="m"}} {prompt}
vllm:num_requests_running{{engine="0",model_name="m"}} 3.0
vllm:num_requests_waiting{{engine="0",model_name="m"}} 1.0
vllm:{kv}{{engine="0",model_name="m"}} 0.25
"""


class Inline:
    """The Background interface, run synchronously, so state-machine tests need no threads."""

    def __init__(self, clock):
        self.clock, self.busy, self._done = clock, False, None

    def start(self, fn, *args):
        from gpuwarden.base.background import Outcome

        at = self.clock()
        try:
            self._done = Outcome(fn(*args), None, at, self.clock())
        except Exception as exc:
            self._done = Outcome(None, exc, at, self.clock())
        return True

    def take(self):
        done, self._done = self._done, None
        return done

    def discard(self):
        self._done = None


def test_metrics_rates_and_the_kv_cache_rename(monkeypatch):
    texts = iter([SCRAPE.format(gen=100, prompt=10, kv="kv_cache_usage_perc"),
                  SCRAPE.format(gen=334, prompt=48, kv="gpu_cache_usage_perc")])
    clock = ManualClock(10)
    reader = MetricsReader("http://x/metrics", VLLM.metric_names, clock, Inline(clock))
    monkeypatch.setattr("gpuwarden.serving.probe.metrics.fetch",
                        lambda url, owner=None, wanted=None: parse(next(texts), wanted))
    first = reader.read(10.0)
    assert first.generation_tokens_per_s is None and first.kv_cache_usage_ratio == 0.25
    clock.advance(1)
    second = reader.read(11.0)
    assert second.generation_tokens_per_s == 234 and second.prompt_tokens_per_s == 38
    assert (second.requests_running, second.requests_waiting, second.kv_cache_usage_ratio) == (3, 1, 0.25)


def test_a_read_that_hangs_never_holds_up_the_poll_that_asked_for_it(monkeypatch):
    """The engine's /metrics is read on a worker thread (base/background.py): while a read hangs (a trickling,
    silent or huge answer, until its deadline), every poll returns at once with the last stats and starts no
    second read; the answer is taken by the first poll after it came. tests/test_faults.py runs such engines."""
    import threading

    from gpuwarden.base.background import Background

    clock = ManualClock(10)
    answer, calls = threading.Event(), []

    def fetch(url, owner=None, wanted=None):
        calls.append(url)
        assert answer.wait(60), "the test never let the read finish"
        return parse(SCRAPE.format(gen=100, prompt=10, kv="kv_cache_usage_perc"))

    monkeypatch.setattr("gpuwarden.serving.probe.metrics.fetch", fetch)
    reader = MetricsReader("http://x/metrics", VLLM.metric_names, clock, Background("serving-metrics", clock))
    for _ in range(20):  # 20 polls while the read hangs: each returns, none starts another read
        assert reader.read(clock.now) is None
        clock.advance(0.25)
    assert calls == ["http://x/metrics"] and reader.job.busy
    answer.set()
    reader.job._thread.join(60)
    stats = reader.read(clock.now)
    assert (stats.requests_running, stats.kv_cache_usage_ratio) == (3, 0.25)


def test_only_the_names_read_are_parsed_however_many_the_engine_sends():
    """Attacker 8's finding 6: an engine's /metrics of 8 MiB of distinct names cost the root daemon 3.4 s of CPU and
    228 MB a read; the lines of other names are skipped unparsed now, summed over label sets as before."""
    from gpuwarden.serving.probe.metrics import read_names

    wanted = read_names(VLLM.metric_names)
    noise = "".join(f"# HELP junk_{i} x\n# TYPE junk_{i} gauge\njunk_{i}{{a=\"{i}\"}} {i}\n" for i in range(20_000))
    text = noise + SCRAPE.format(gen=100, prompt=10, kv="kv_cache_usage_perc") + noise.replace("junk", "more")
    full = parse(text)
    kept = parse(text, wanted)
    assert len(full) > 40_000 and set(kept) <= wanted
    assert kept == {name: value for name, value in full.items() if name in wanted} and kept
    assert "junk_0" not in kept and parse("", wanted) == {}
    from gpuwarden.serving.probe.metrics import MAX_SAMPLES

    flood = "".join(f'vllm:num_requests_running{{x="{i}"}} 1\n' for i in range(MAX_SAMPLES + 1))
    with pytest.raises(ValueError, match="more than"):  # a read name under endless label sets: no answer
        parse(flood, wanted)


def test_unreachable_metrics_is_none():
    clock = ManualClock(0)
    assert MetricsReader("http://127.0.0.1:9/metrics", VLLM.metric_names, clock, Inline(clock)).read(0) is None
    assert parse('a_total{x="1"} 2\na_total{x="2"} 3\n')["a_total"] == 5


def test_non_finite_vllm_values_are_dropped():
    values = parse("vllm:num_requests_running NaN\nvllm:num_requests_waiting +Inf\n"
                   "vllm:generation_tokens_total 12\n")
    assert values == {"vllm:generation_tokens_total": 12.0}


# -- supervisor state machine, with the OS seam replaced ----------------------------------------

class FakeOps:
    def __init__(self, clock):
        self.clock = clock
        self.children, self.exit, self.groups = [], {}, {}
        self.health_ok = False
        self.spawn_error = None
        self.port_is_free = True
        self.squatters, self.escapees = set(), []
        self.signals, self.uids, self.killed = [], {}, []
        self.sent = []  # every signal, to a group (killpg) or a process (kill), in order
        self.deaf = set()  # pids with no handler for any signal (catches)
        self.word_ends = {}  # pid -> the write end of its word pipe (serving/run/word.py), as the child holds it

    def spawn(self, argv, env, user, on_line, pass_fds=()):
        if self.spawn_error is not None:
            raise self.spawn_error
        pid = 1000 + 10 * len(self.children)
        self.children.append((argv, env, user))
        from gpuwarden.serving.run.word import WORD_ENV

        if WORD_ENV in env:  # the child's copy of its end, which outlives the daemon's close of its own
            assert int(env[WORD_ENV]) in pass_fds
            self.word_ends[pid] = os.dup(int(env[WORD_ENV]))
        self.groups[pid] = [pid, pid + 1, pid + 2]  # API server, EngineCore, Worker
        on_line("INFO 11-26 [api_server.py:1] starting")
        return Child(pid, pid)

    def say(self, pid, line: bytes):
        """What the child writes on its word pipe (a word is one JSON line: word.say's)."""
        os.write(self.word_ends[pid], line)

    def poll(self, child):
        return self.exit.get(child.pid)

    def killpg(self, pgid, sig):
        self.signals.append((pgid, sig))
        self.sent.append(("group", pgid, sig))
        if sig == signal.SIGKILL:
            self.groups[pgid] = []

    def kill(self, pid, sig):
        self.killed.append((pid, sig))
        self.sent.append(("process", pid, sig))

    def catches(self, pid, sig):
        return pid not in self.deaf

    def group_pids(self, pgid):
        return list(self.groups.get(pgid, []))

    def uid_of(self, pid):
        return self.uids.get(pid)

    def health(self, url, owner=None):
        from gpuwarden.base.httpget import HttpError, Reply

        if self.spawn_error is not None:
            raise HttpError("connection refused")
        return Reply(200 if self.health_ok else 503, b"", 0)

    def background(self, name):
        return Inline(self.clock)

    def port_free(self, host, port):
        return self.port_is_free

    def listen(self, name, host, port):  # the daemon's kept listener (the proxy's): held by another while not free
        if not self.port_is_free:
            raise OSError(errno.EADDRINUSE, "Address already in use")
        return 99

    def owns_port(self, host, port, group, uid):
        self.owner_asked = (host, port)
        return bool([p for p in group if p not in self.squatters])

    def alive(self, pids):
        return [p for p in pids if any(p in group for group in self.groups.values())]

    def who_listens(self, host, port):
        return "pid 4444 (user mallory, nc)"

    def escaped(self):
        out, self.escapees = self.escapees, []
        return out

    def end_helpers(self):
        pass

    def reap(self, pids):
        pass

    def describe(self, pid):
        return f"pid {pid}"


class FakeGpu:
    def __init__(self, used_gib=0.0, processes=()):
        self.index, self.processes = 0, list(processes)
        self.used = used_gib

    def compute_processes(self):
        return list(self.processes)

    def note_engine(self, held):
        self.context = held

    def sample(self):
        return GpuSample(0, "GPU-0", "G", "", "12.0", memory_total_bytes=24 * 2**30,
                         memory_used_bytes=int(self.used * 2**30))


def supervisor(text="", gpu=None, crash_loop_failures=4):
    cfg = serve_config(f"  crash_loop_failures: {crash_loop_failures}\n  crash_loop_window_s: 100\n"
                       "  stable_after_s: 30\n  liveness_interval_s: 5\n  liveness_failures: 2\n"
                       "  startup_timeout_s: 60\n" + text)
    clock = ManualClock(100)
    ops = FakeOps(clock)
    cmd = build_command(cfg.serve, GENERIC, [sample()], {"PATH": "/bin"})
    me = pwd.getpwuid(os.geteuid())
    sup = Program(engine_spec(cfg.serve, cmd, Identity(me.pw_name, me.pw_uid, me.pw_gid, me.pw_dir, (), False),
                              [gpu or FakeGpu()]), ops=ops, clock=clock)
    return sup, ops, clock


def running_supervisor():
    """supervisor(), started and healthy: RUNNING."""
    sup, ops, clock = supervisor()
    ops.health_ok = True
    sup.start(clock.now)
    sup.tick(clock.now)
    assert sup.state == RUNNING
    return sup, ops, clock


def test_start_healthy_running():
    sup, ops, clock = supervisor()
    sup.start(clock.now)
    assert sup.state == STARTING and len(ops.children) == 1
    clock.advance(1)
    sup.tick(clock.now)
    assert sup.state == STARTING
    ops.health_ok = True
    clock.advance(44)
    sup.tick(clock.now)
    assert sup.state == RUNNING and sup.time_to_healthy_s == 45


def test_sigkilled_api_server_is_cleaned_up_and_restarted_with_backoff(caplog):
    caplog.set_level("INFO")
    sup, ops, clock = supervisor()
    ops.health_ok = True
    sup.start(clock.now)
    sup.tick(clock.now)
    pid = sup.child.pid
    ops.exit[pid] = -signal.SIGKILL
    ops.groups[pid] = [pid + 1, pid + 2]  # the orphans
    sup.tick(clock.now)
    assert (pid, signal.SIGKILL) in ops.signals and ops.group_pids(pid) == []
    assert sup.state == BACKOFF and sup.last_exit_code == -9 and sup.restarts == 1
    clock.advance(0.9)
    sup.tick(clock.now)
    assert len(ops.children) == 1  # 1 s backoff not over yet
    assert "all 2 processes of the previous vLLM are gone" in caplog.text  # confirmed on a later tick
    clock.advance(0.2)
    sup.tick(clock.now)
    assert sup.state == STARTING and len(ops.children) == 2


def test_backoff_doubles_caps_and_resets_after_a_stable_run():
    sup, ops, clock = supervisor("  backoff_max_s: 4\n", crash_loop_failures=99)
    delays = []
    for _ in range(5):
        sup.start(clock.now)
        ops.exit[sup.child.pid] = 1
        sup.tick(clock.now)
        delays.append(sup.phase.retry_at - clock.now)
        clock.advance(delays[-1])
    assert delays == [1, 2, 4, 4, 4]
    ops.health_ok = True
    sup.tick(clock.now)  # starts
    sup.tick(clock.now)  # healthy
    assert sup.state == RUNNING
    clock.advance(31)
    sup.tick(clock.now)  # stable for stable_after_s
    ops.exit[sup.child.pid] = 1
    sup.tick(clock.now)
    assert sup.phase.retry_at - clock.now == 1


def test_died_while_starting_differs_from_exited_later(caplog):
    sup, ops, clock = supervisor()
    sup.start(clock.now)
    ops.exit[sup.child.pid] = 1
    sup.tick(clock.now)
    assert "vLLM died while starting with exit status 1" in caplog.text
    clock.advance(2)
    sup.tick(clock.now)
    ops.health_ok = True
    sup.tick(clock.now)
    ops.exit[sup.child.pid] = 2
    sup.tick(clock.now)
    assert "vLLM exited with exit status 2" in caplog.text


def test_crash_loop_goes_fatal_with_the_last_error_lines_and_sighup_resets(caplog):
    sup, ops, clock = supervisor()
    for _ in range(4):
        sup.start(clock.now)
        sup.on_line("ERROR 11-26 [core.py:1] OSError: /m/Qwen3-4B does not appear to have a file named config.json")
        sup.on_line("Traceback line without a level")
        ops.exit[sup.child.pid] = 1
        sup.tick(clock.now)
        clock.advance(10)
    assert sup.state == FATAL
    fatal = [r for r in caplog.records if "vLLM FATAL" in r.getMessage()]
    assert len(fatal) == 1 and fatal[0].levelname == "ERROR"  # the detail; the vllm_fatal alert is the crit line
    assert "4 failures within 100 s" in fatal[0].getMessage()
    assert "does not appear to have a file named config.json" in fatal[0].getMessage()
    assert "Traceback line without a level" in fatal[0].getMessage()  # continuation keeps the ERROR level
    clock.advance(1000)
    sup.tick(clock.now)
    assert sup.state == FATAL and len(ops.children) == 4  # stays down until SIGHUP
    sup.reset(clock.now)
    assert sup.state == STARTING and len(ops.children) == 5


def test_liveness_failures_restart_the_child():
    sup, ops, clock = supervisor()
    ops.health_ok = True
    sup.start(clock.now)
    sup.tick(clock.now)
    ops.health_ok = False
    clock.advance(5)
    sup.tick(clock.now)
    assert sup.state == RUNNING
    clock.advance(5)
    sup.tick(clock.now)
    assert sup.state == BACKOFF and "2 liveness probes" in sup.problem


def test_startup_timeout():
    sup, ops, clock = supervisor()
    sup.start(clock.now)
    clock.advance(61)
    sup.tick(clock.now)
    assert sup.state == BACKOFF and "startup_timeout_s" in sup.problem
    assert ops.groups[1000] == []


def test_stop_is_a_timed_state_sigterm_then_sigkill_to_the_group():
    sup, ops, clock = supervisor("  stop_timeout_s: 3\n")
    ops.health_ok = True
    sup.start(clock.now)
    sup.tick(clock.now)
    started = clock.now
    sup.stop(clock.now)  # returns at once; the fake group ignores SIGTERM
    assert sup.state == STOPPING and clock.now == started
    assert [s for _, s in ops.signals] == [signal.SIGTERM]
    clock.advance(2.9)
    sup.tick(clock.now)
    assert sup.state == STOPPING and [s for _, s in ops.signals] == [signal.SIGTERM]
    clock.advance(0.2)
    sup.tick(clock.now)  # the deadline passed: SIGKILL
    assert [s for _, s in ops.signals] == [signal.SIGTERM, signal.SIGKILL]
    sup.tick(clock.now)
    assert sup.state == STOPPED and sup.stopped and ops.group_pids(1000) == []


def test_a_second_stop_request_escalates_at_once():
    sup, ops, clock = supervisor("  stop_timeout_s: 600\n")
    ops.health_ok = True
    sup.start(clock.now)
    sup.tick(clock.now)
    sup.stop(clock.now)
    sup.kill_now(clock.now)
    assert [s for _, s in ops.signals] == [signal.SIGTERM, signal.SIGKILL]
    sup.tick(clock.now)
    assert sup.state == STOPPED


def test_spawn_failures_back_off_then_go_fatal(caplog):
    sup, ops, clock = supervisor(crash_loop_failures=3)
    ops.spawn_error = FileNotFoundError(2, "No such file or directory", "/opt/vllm/bin/vllm")
    sup.start(clock.now)
    assert sup.state == BACKOFF and sup.problem == ("vLLM could not be started: No such file or directory: "
                                                    "/opt/vllm/bin/vllm")
    for _ in range(5):
        clock.advance(10)
        sup.tick(clock.now)
    assert sup.state == FATAL and "3 failures within 100 s" in sup.problem
    attempts = [r for r in caplog.records if r.levelname == "ERROR" and r.getMessage().startswith("vLLM could not")]
    assert len(attempts) == 3, "one line per attempt, and no more after FATAL"


def test_a_step_that_raises_still_ends_in_backoff():
    sup, ops, clock = supervisor()
    ops.health_ok = True
    sup.start(clock.now)
    sup.tick(clock.now)

    def no_fds(pgid, sig):
        raise OSError(24, "Too many open files")

    ops.killpg = no_fds
    ops.exit[sup.child.pid] = 1
    with pytest.raises(OSError):
        sup.tick(clock.now)
    assert sup.state == BACKOFF, "never stuck in EXITED"


def test_a_squatter_on_the_port_is_never_taken_for_vllm(caplog):
    caplog.set_level("INFO")
    sup, ops, clock = supervisor()
    ops.port_is_free = False
    sup.start(clock.now)
    assert sup.state == BACKOFF and sup.blocked and ops.children == []
    assert sup.problem == "port 8123 on 127.0.0.1 is in use by pid 4444 (user mallory, nc); vLLM needs it"
    clock.advance(5)
    sup.tick(clock.now)
    assert caplog.text.count("vLLM start waits") == 1, "said once per reason, not every retry"
    # It got the port after our preflight: its /health answer is not trusted.
    ops.port_is_free, ops.health_ok = True, True
    clock.advance(5)
    sup.tick(clock.now)
    assert sup.state == STARTING
    ops.squatters = set(ops.groups[sup.child.pid])
    sup.tick(clock.now)
    assert sup.state == BACKOFF and "not by vLLM's process group" in sup.problem


def test_an_engine_behind_the_proxy_whose_config_file_gained_a_key_waits_to_start_and_starts_once_mended(
        tmp_path, caplog):
    """Attacker 15: vLLM reads its --config file again at each start, so a key written there without a reload reached
    the engine at its next crash's restart, and the proxy, given the environment's key or none, split from it (every
    client refused, or vLLM's unguarded paths open). Behind the proxy each start reads the file first: one with a key
    waits, says why once, counts no failure and goes on once the file is mended."""
    import dataclasses

    from gpuwarden.serving.run.supervisor import PREFLIGHT_RETRY_S

    caplog.set_level("INFO")
    flags = tmp_path / "flags.yaml"
    flags.write_text("max-num-seqs: 4\n")
    sup, ops, clock = supervisor(crash_loop_failures=2)
    sup.spec = dataclasses.replace(sup.spec, argv=(*sup.spec.argv, "--config", str(flags)), keyless_flags=True)
    ops.health_ok = True
    sup.start(clock.now)
    sup.tick(clock.now)
    assert sup.state == RUNNING and len(ops.children) == 1
    flags.write_text("max-num-seqs: 4\napi-key: k-behind-the-proxy\n")  # edited, not reloaded
    ops.exit[sup.child.pid] = 1  # then the engine crashes
    for _ in range(6):
        clock.advance(PREFLIGHT_RETRY_S + 30)
        sup.tick(clock.now)
    assert sup.state == BACKOFF and sup.blocked and len(ops.children) == 1, sup.state
    assert sup.problem == ("with the proxy on, vLLM's flags give it an API key (--api-key, or api-key in its --config "
                           "file), which the proxy cannot follow: give it as VLLM_API_KEY in serve.env_file or the "
                           "systemd credential instead, and reload")
    assert caplog.text.count("vLLM start waits") == 1 and "k-behind-the-proxy" not in caplog.text
    flags.write_text("max-num-seqs: 4\n")
    clock.advance(PREFLIGHT_RETRY_S)
    sup.tick(clock.now)
    sup.tick(clock.now)
    assert sup.state == RUNNING and len(ops.children) == 2, "never FATAL: a wait counts no failure"


def test_a_start_that_loses_its_port_to_a_local_user_waits_and_never_counts_to_fatal():
    """A local user who binds the engine's own address and port at each start, after our preflight found it
    free and before the engine binds (seconds of imports for vLLM), answering /health or not: each start was a
    failure, and a healthy engine was FATAL 10 s after a start (/tmp/atk35/f1_race.sh: 5 starts, 0 healthy,
    FATAL). Such a start now waits for the port, as a preflight that finds it taken does."""
    from test_serving import supervisor
    from gpuwarden.serving.run.supervisor import BACKOFF, FATAL, PREFLIGHT_RETRY_S, RUNNING

    sup, ops, clock = supervisor(crash_loop_failures=2)
    for attempt in range(4):
        sup.start(clock.now)
        child = sup.child
        if attempt % 2:  # it answers /health on our address before the engine binds
            ops.health_ok, ops.squatters = True, set(ops.groups[child.pid])
        else:  # it only holds the port: the engine cannot bind and exits
            sup.on_line("OSError: [Errno 98] Address already in use")
            ops.exit[child.pid] = 1
        sup.tick(clock.now)
        assert sup.state == BACKOFF and sup.blocked, (attempt, sup.state, sup.problem)
        assert sup.state != FATAL and sup.restarts == 0
        ops.health_ok, ops.squatters = False, set()
        clock.advance(PREFLIGHT_RETRY_S)
    sup.start(clock.now)  # the user gave up: the engine starts and serves
    ops.health_ok = True
    sup.tick(clock.now)
    assert sup.state == RUNNING
    # A crash that is not about the port still counts.
    ops.exit[sup.child.pid] = 1
    sup.tick(clock.now)
    assert sup.restarts == 1 and not sup.blocked


def test_processes_that_left_the_group_are_killed_and_named(caplog):
    sup, ops, clock = supervisor()
    ops.health_ok = True
    sup.start(clock.now)
    sup.tick(clock.now)
    sup.stop(clock.now)
    ops.groups[1000] = []  # the group obeyed SIGTERM; a setsid() grandchild did not see it
    ops.escapees = [5555]
    sup.tick(clock.now)
    assert sup.state == STOPPED and (5555, signal.SIGKILL) in ops.killed
    assert "killed 1 process(es) that had left vLLM's process group: pid 5555" in caplog.text


def test_preflight_kills_our_leftovers_and_waits_for_foreign_processes():
    gpu = FakeGpu(processes=[(4242, 2**30)])
    sup, ops, clock = supervisor(gpu=gpu)
    ops.uids[4242] = os.geteuid()  # ours: a leftover engine from an earlier child
    sup.start(clock.now)
    assert (4242, signal.SIGKILL) in ops.killed
    gpu.processes = [(777, 2**30)]
    ops.uids[777] = 12345  # somebody else's
    sup.stop(clock.now)
    ops.groups[1000] = []  # it obeyed SIGTERM
    sup.tick(clock.now)
    sup.start(clock.now)
    assert sup.state == BACKOFF and sup.blocked and "other compute processes [777]" in sup.problem
    assert sup.view().blocked


def test_preflight_waits_for_free_memory():
    sup, ops, clock = supervisor("  args: [--gpu-memory-utilization, \"0.85\"]\n", gpu=FakeGpu(used_gib=10))
    sup.start(clock.now)
    assert sup.state == BACKOFF and "less than --gpu-memory-utilization 0.85" in sup.problem
    assert ops.children == []


@pytest.mark.parametrize("as_json", [False, True])
def test_profiles_show_redacts_secret_looking_values(write, cli, as_json):
    path = write("g.yaml", "serve:\n  model: /m/Qwen3-4B\n  env: {VLLM_API_KEY: sk-live-123, VLLM_LOGGING_LEVEL: INFO}\n"
                 "  allow_lint_errors: true\n  args: [--api-key, sk-arg-456]\n")
    status, out, _ = cli("profiles", "show", "generic", "-c", path, *(["--json"] if as_json else []))
    assert status == 0
    assert "sk-live-123" not in out and "sk-arg-456" not in out and "<redacted>" in out
    assert "VLLM_LOGGING_LEVEL" in out and "INFO" in out


@pytest.mark.process
def test_a_user_without_a_writable_home_gets_one_under_the_state_directory(tmp_path):
    from gpuwarden.serving.compose.homes import child_home

    me = pwd.getpwuid(os.geteuid())
    state = {"STATE_DIRECTORY": str(tmp_path / "state")}
    missing = Identity(me.pw_name, me.pw_uid, me.pw_gid, str(tmp_path / "no-such-home"), (), False)
    env, why = child_home(missing, create=True, environ=state)
    home = tmp_path / "state" / "home" / me.pw_name
    assert why == (f"{me.pw_name}: its home {tmp_path / 'no-such-home'} does not exist; "
                   f"the engine's home and caches are {home}")
    assert env == {"HOME": str(home), "XDG_CACHE_HOME": f"{home}/.cache", "VLLM_CACHE_ROOT": f"{home}/.cache/vllm",
                   "HF_HOME": f"{home}/.cache/huggingface", "TRITON_CACHE_DIR": f"{home}/.cache/triton",
                   "TORCHINDUCTOR_CACHE_DIR": f"{home}/.cache/torchinductor"}
    assert (home / ".cache" / "huggingface").is_dir() and (home.stat().st_mode & 0o777) == 0o700
    (tmp_path / "own").mkdir()
    works = Identity(me.pw_name, me.pw_uid, me.pw_gid, str(tmp_path / "own"), (), False)
    assert child_home(works, create=True, environ=state) == ({}, None)  # a home that works is left alone
