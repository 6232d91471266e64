"""Stall detection (serving/probe/stall.py): counters that stop while work waits, and the idle probe."""

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from gpuwarden.watch.signals import RULES_BY_NAME
from gpuwarden.gpu.base import GpuSample
from gpuwarden.gpu.sim.backend import ManualClock
from gpuwarden.serving.probe.stall import Progress, StallWatch
from gpuwarden.serving.run.supervisor import BACKOFF, RUNNING
from test_serving import Inline, running_supervisor, supervisor


def watch(clock, stall_after_s=10, probe_after_s=5, background=None, url="http://127.0.0.1:9/v1/completions",
          key=None, probe_timeout_s=30):
    """probe_timeout_s: real seconds, against this process's server (30 by default: a bound on a hang, where a busy
    box made a 2 s probe of an answering server fail)."""
    return StallWatch(stall_after_s, probe_after_s, probe_timeout_s, url, "m", clock, background or Inline(clock),
                      key=key)


def test_counters_that_stop_while_requests_run_are_a_stall_and_moving_again_ends_it():
    clock = ManualClock(0)
    w = watch(clock)
    assert w.update(0, Progress(100, 8, 0)) is None
    assert w.update(9, Progress(100, 8, 0)) is None  # 9 s without a token: not yet
    reason = w.update(10, Progress(100, 8, 0))
    assert reason.startswith("no token generated or prefilled for 10 s with 8 running and 0 waiting")
    assert w.update(11, None) == reason  # no read this poll: still stalled
    assert w.update(12, Progress(130, 8, 0)) is None  # tokens again


def test_work_that_arrives_after_a_long_idle_gets_its_whole_window():
    clock = ManualClock(0)
    w = watch(clock, probe_after_s=0)
    w.update(0, Progress(100, 0, 0))
    assert w.update(3600, Progress(100, 0, 1)) is None  # an hour idle, then a request waits: its prefill starts
    assert w.update(3609, Progress(100, 1, 0)) is None
    assert w.update(3610, Progress(100, 1, 0)) is not None


def test_waiting_requests_alone_count_as_work():
    w = watch(ManualClock(0), probe_after_s=0)
    w.update(0, Progress(5, 0, 3))
    assert "0 running and 3 waiting" in w.update(10, Progress(5, 0, 3))


class Completions(BaseHTTPRequestHandler):
    hang = threading.Event()
    released = threading.Event()  # the fixture's end: a hung answer lets go
    bodies: list = []
    key: str | None = None  # as vLLM with VLLM_API_KEY: /v1/* wants "Authorization: Bearer KEY", else 401
    authorizations: list = []

    def do_POST(self):  # noqa: N802
        Completions.bodies.append(self.rfile.read(int(self.headers["Content-Length"])))
        Completions.authorizations.append(self.headers.get("Authorization"))
        if Completions.key is not None and self.headers.get("Authorization") != f"Bearer {Completions.key}":
            body = b'{"error": "Unauthorized"}'
            self.send_response(401)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return
        if Completions.hang.is_set():  # a frozen engine: the answer does not come, until the test ends
            Completions.released.wait(120)
            return
        body = b'{"choices": [{"text": "k"}]}'
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def completions():
    server = ThreadingHTTPServer(("127.0.0.1", 0), Completions)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    Completions.bodies.clear()
    Completions.authorizations.clear()
    Completions.hang.clear()
    Completions.released.clear()
    Completions.key = None
    yield f"http://127.0.0.1:{server.server_address[1]}/v1/completions"
    Completions.released.set()
    server.shutdown()


def test_idle_probe_answers_keep_it_alive_and_a_hung_probe_is_a_stall(completions):
    clock = ManualClock(0)
    w = watch(clock, url=completions, probe_timeout_s=5)  # the hung probe takes all of it

    def at(t, progress=Progress(10, 0, 0)):
        clock.advance(t - clock.now)
        return w.update(t, progress)

    at(0)
    assert at(4) is None and w.probes == 0
    assert at(5) is None and w.probes == 1  # idle 5 s: probe
    assert b'"max_tokens": 1' in Completions.bodies[0] and b'"model": "m"' in Completions.bodies[0]
    assert at(6) is None  # it answered (at 5): alive
    assert at(9) is None and w.probes == 1  # 5 s counts from the answer
    Completions.hang.set()
    assert at(10) is None and w.probes == 2  # the engine froze: this probe hangs
    reason = at(11)
    assert reason and "the stall probe (a one-token completion, serve.probe_timeout_s 5) failed" in reason
    assert at(12) == reason and w.probes == 2  # stalled until the counters move: no more probes
    assert at(13, Progress(11, 0, 0)) is None


def test_the_probe_authenticates_with_the_engines_key_as_a_client_does(completions):
    Completions.key = "s3cret"
    clock = ManualClock(0)
    w = watch(clock, url=completions, key="s3cret")
    for t in range(0, 60):
        clock.advance(t - clock.now)
        assert w.update(t, Progress(10, 0, 0)) is None
    assert w.probes >= 5 and set(Completions.authorizations) == {"Bearer s3cret"}


@pytest.mark.parametrize("key", ["pässwort", "ключ-🔑"])
def test_a_key_beyond_ascii_is_sent_not_counted_as_a_dead_engine(completions, key):
    """An engine key with non-ASCII characters made every probe fail to encode: a stall, restarts, FATAL."""
    Completions.key = key.encode("latin-1", "replace").decode("latin-1") if key == "pässwort" else "unmatchable"
    clock = ManualClock(0)
    w = watch(clock, url=completions, key=key)
    for t in range(0, 30):
        clock.advance(t - clock.now)
        assert w.update(t, Progress(10, 0, 0)) is None
    assert w.probes >= 2 and len(Completions.authorizations) == w.probes


def test_a_probe_refused_for_its_credentials_proves_the_engine_alive(completions, caplog):
    """401 without the key (a server with VLLM_API_KEY that the daemon was not given): never a stall, and said
    once."""
    Completions.key = "s3cret"
    clock = ManualClock(0)
    w = watch(clock, url=completions)  # no key
    for t in range(0, 60):
        clock.advance(t - clock.now)
        assert w.update(t, Progress(10, 0, 0)) is None
    assert w.probes >= 5
    said = [r for r in caplog.records if "cannot authenticate" in r.getMessage()]
    assert len(said) == 1 and "s3cret" not in said[0].getMessage()


def test_the_key_comes_from_the_command_in_the_engines_own_spellings():
    from gpuwarden.serving.compose.engines import engine_for

    vllm, sglang = engine_for("vllm"), engine_for("sglang")
    assert vllm.api_key(["vllm", "serve", "--port", "1"], {"VLLM_API_KEY": "env"}) == "env"
    for argv in (["--api-key", "flag", "other"], ["--api_key", "flag"], ["--api-key=flag"], ["--api-ke", "flag"]):
        assert vllm.api_key(argv, {"VLLM_API_KEY": "env"}) == "flag", argv  # the flag wins, as in vLLM
    assert vllm.api_key([], {}) is None and vllm.api_key([], {"VLLM_API_KEY": ""}) is None
    assert sglang.api_key(["--api-key", "k"], {}) == "k" and sglang.api_key([], {"VLLM_API_KEY": "env"}) is None


def test_a_stall_restarts_the_engine_as_a_crash_does_and_a_healthy_child_clears_it():
    sup, ops, clock = running_supervisor()
    pid = sup.child.pid
    sup.note_stall(clock.now, "no token for 300 s", restart=True)
    assert sup.state == BACKOFF and sup.stalls == 1 and (pid, 9) in ops.signals
    assert sup.view().stalled == "no token for 300 s"
    clock.advance(1.1)
    sup.tick(clock.now)  # starts again
    sup.tick(clock.now)  # healthy
    assert sup.state == RUNNING and sup.view().stalled is None and sup.view().stalls == 1


def test_without_restart_the_stall_is_reported_until_progress_returns():
    sup, ops, clock = running_supervisor()
    sup.note_stall(clock.now, "no token", restart=False)
    sup.note_stall(clock.now, "no token", restart=False)
    assert sup.state == RUNNING and sup.stalls == 1 and sup.view().stalled == "no token"
    sup.note_stall(clock.now, None, restart=False)
    assert sup.view().stalled is None


def gpu(util, power, limit=300.0):
    return GpuSample(0, "GPU-0", "G", "", "12.0", utilization_pct=util, power_w=power, power_limit_w=limit)


def test_the_alert_carries_the_gpus_picture():
    sup, ops, clock = supervisor()
    sup.stalled = "no token for 300 s"
    rule = RULES_BY_NAME["vllm_stalled"]
    check = rule.check(sup.view(), [gpu(98, 21)])
    assert check.active and rule.severity == "critical" and rule.for_s == 0
    assert "GPU0 util 98% at 21 W of 300 W: a kernel is spinning" in check.observed
    assert "the GPU is idle" in rule.check(sup.view(), [gpu(0, 40)]).observed
    sup.stalled = None
    assert not rule.check(sup.view(), [gpu(98, 21)]).active
