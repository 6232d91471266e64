"""When a GPU must not serve (issue 42's policy): the engine waits in HELD for the GPU's action (not FATAL, not
restarted), drains first where the policy says and the GPU answers, is reset by an injected command where the
policy allows and nobody else uses the GPU, starts again once the GPU is back with its tuning, and after such a
recovery must give the known answer. The state machine and the policy on fake process calls; the reset command
and the daemon with the fake engine (tests/harness/fakechild.py) as real processes."""

import dataclasses
import json
import logging
import os
import signal
import sys
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from conftest import free_port
from gpuwarden import config
from gpuwarden.backends import open_configured
from gpuwarden.base.httpget import HttpError
from gpuwarden.config import HealthPolicy
from gpuwarden.gpu.events import GpuEvent
from gpuwarden.gpu.sim import power
from gpuwarden.gpu.sim.backend import ManualClock
from gpuwarden.gpu.sim.scenario import resolve_scenario
from gpuwarden.serving.probe import known
from gpuwarden.serving.run.runtime import ServingRuntime
from gpuwarden.serving.run.supervisor import HELD, RUNNING, STARTING, STOPPED, STOPPING, Supervisor
from gpuwarden.service.recovery import Recovery, ResetFailed, run_reset
from gpuwarden.tune.tuning import Tuner, TuningLife
from gpuwarden.watch.health import waiting
from gpuwarden.watch.monitor import Monitor
from gpuwarden.watch.signals.serving import vllm_fatal
from test_drain import release, running
from test_faults import FLAGCHECK, fake, fault_config, no_fakes_left, status, wait_until  # noqa: F401 (fixtures)
from test_serving import running_supervisor

RESET = "the driver set a recovery action: reset the GPU"  # what EventBook.needs_reset says for action 1
REBOOT = "Xid 79 (GPU has fallen off the bus): reboot the node"


# -- the state: HELD, not FATAL -------------------------------------------------------------------------------

def test_a_held_engine_is_not_fatal_not_restarted_and_starts_again_when_released():
    sup, ops, clock = running_supervisor()
    pid = sup.child.pid
    sup.hold(clock.now, "waiting for GPU0's action: reset the GPU (the driver set a recovery action)")
    assert sup.state == HELD and (pid, signal.SIGKILL) in ops.signals
    view = sup.view()
    assert view.problem == "waiting for GPU0's action: reset the GPU (the driver set a recovery action)"
    assert not vllm_fatal(view).active  # the GPU's fault: vllm_fatal (whose fix blames the engine) stays quiet
    for _ in range(10):
        clock.advance(60)
        sup.tick(clock.now)
    assert sup.state == HELD and len(ops.children) == 1  # no restart loop, no budget spent
    assert sup.release(clock.now, "its GPUs answer again")
    assert sup.state == STARTING and len(ops.children) == 2
    assert not sup.release(clock.now, "again")  # only a held child is released


def test_a_hold_with_a_drain_is_a_planned_stop_then_held_and_a_stop_meanwhile_wins(caplog):
    caplog.set_level("INFO")
    program, ops, clock = running(60)
    leader = program.child.pid
    program.hold(clock.now, "waiting for GPU0's action: reset the GPU (x)", drain=True)
    assert program.state == STOPPING and ops.killed == [(leader, signal.SIGTERM)] and ops.signals == []
    assert "draining vLLM: 7 requests in flight, up to 60 s" in caplog.text
    clock.advance(2.5)
    ops.groups[leader] = []  # its requests finished, it exited
    program.tick(clock.now)
    assert program.state == HELD and "vLLM drained in 2.5 s" in caplog.text
    assert program.problem == "waiting for GPU0's action: reset the GPU (x)"

    program, ops, clock = running(60)
    program.hold(clock.now, "waiting for GPU0's action: reset the GPU (x)", drain=True)
    program.stop(clock.now)  # the daemon stops during the hold's drain: the stop is the stop
    ops.groups[program.child.pid] = []
    program.tick(clock.now)
    assert program.state == STOPPED


# -- the policy, with a real ServingRuntime and the simulator ---------------------------------------------------

def rig(policy=HealthPolicy(), argv=None, timeout_s=5.0):
    """A held-able engine (fake process calls) on a simulated one-GPU host, with its tuning, monitor and recovery."""
    sup, ops, clock = running_supervisor()
    cfg = config.parse_text("gpu:\n  backend: sim\n  scenario: dgx-spark\nmetrics:\n  listen: none\n")
    backend = open_configured(cfg, ManualClock())
    tuning = TuningLife(backend, cfg, Tuner(backend))
    tuning.start(tuning.check(cfg))
    serving = ServingRuntime(backend, ops=ops, clock=clock)
    serving.children = Supervisor([sup])
    recovery = Recovery(serving, tuning, backend, clock, policy, reset_argv=argv or (lambda i: ["true"]),
                        reset_timeout_s=timeout_s)
    return sup, ops, clock, Monitor(cfg, backend, tuning), recovery


def settle(recovery, monitor, clock, rounds=50):
    """Let a reset on its worker thread end, ticking as the daemon does: monitor, then recovery."""
    for _ in range(rounds):
        monitor.tick(clock.now)
        recovery.tick(clock.now, monitor.events.needs_reset)
        if not recovery._reset.busy:
            return
        time.sleep(0.05)


def test_by_default_the_engine_waits_for_the_gpu_and_starts_when_it_is_back_with_its_tuning(caplog):
    caplog.set_level("INFO")
    sup, ops, clock, monitor, recovery = rig()
    asked = []
    recovery.reset_argv = lambda i: asked.append(i) or ["true"]
    holds = monitor.record_events([GpuEvent(0, "recovery_action", 1)], clock.now)
    recovery.hold(clock.now, holds)
    assert sup.state == HELD and "waiting for GPU0's action: reset the GPU" in sup.problem
    for _ in range(5):
        settle(recovery, monitor, clock)
        clock.advance(10)
    assert sup.state == HELD and asked == []  # nothing reset under the default policy
    gpu = monitor.backend.gpus()[0]
    gpu.reset(1.0)  # somebody resets it: gone a second, then back with the driver's defaults
    monitor.tick(clock.now)  # it is lost
    gpu.backend.clock.advance(2)
    settle(recovery, monitor, clock)  # back: the tuning planned and applied, the wait cleared, the engine released
    assert not monitor.events.needs_reset and sup.state == STARTING and len(ops.children) == 2
    text = caplog.text
    assert text.index("is back: planned and applied its tuning") < text.index("vLLM released: its GPUs answer again")


def test_a_reset_between_two_polls_is_read_in_the_recovery_field_and_releases_the_engine(caplog):
    """ci48: the box starved the daemon through the reset's second off the bus; it never saw the GPU lost, and the
    engine stayed HELD for good. The driver's field, which asked for the reset, reads none again: that clears it."""
    caplog.set_level("INFO")
    sup, ops, clock, monitor, recovery = rig()
    gpu = monitor.backend.gpus()[0]
    gpu.recovery_action = 1  # the driver asks in its polled field and in an event, as the scenario's event does
    recovery.hold(clock.now, monitor.record_events([GpuEvent(0, "recovery_action", 1)], clock.now))
    for _ in range(20):  # polls, counter polls among them, read the field asking
        settle(recovery, monitor, clock)
        clock.advance(1)
    assert sup.state == HELD and monitor.events.needs_reset
    gpu.reset(1.0)
    gpu.backend.clock.advance(2)  # gone a second and back before the next poll: never seen lost
    for _ in range(20):
        settle(recovery, monitor, clock)
        clock.advance(1)
    assert not monitor.events.needs_reset and sup.state == STARTING and len(ops.children) == 2
    assert "GPU0: its driver's recovery action reads none again: it was reset between two polls" in caplog.text
    assert "is back: planned and applied its tuning" not in caplog.text  # the other way back was not taken


def test_a_gpu_judged_unhealthy_without_any_event_holds_the_engine_until_it_is_healthy_again():
    """The daemon holds for what the health model judges too (watch/health.waiting): here a GPU off the bus that
    no Xid announced."""
    from gpuwarden.watch.health import waiting

    sup, ops, clock, monitor, recovery = rig()
    gpu = monitor.backend.gpus()[0]
    gpu.reset(30.0)  # off the bus for 30 s, and no event says so
    monitor.tick(clock.now)
    wait = waiting(monitor.events.needs_reset, monitor.verdicts)
    assert not monitor.events.needs_reset and list(wait) == [0]
    recovery.hold(clock.now, list(wait.items()))
    assert sup.state == HELD and sup.problem.startswith("waiting for GPU0's action: reboot (GPU lost from the bus")
    recovery.tick(clock.now, wait)
    assert sup.state == HELD  # still judged unhealthy: no restart into it
    gpu.backend.clock.advance(31)
    monitor.tick(clock.now)
    recovery.tick(clock.now, waiting(monitor.events.needs_reset, monitor.verdicts))
    assert monitor.verdicts[0].state == "healthy" and sup.state == STARTING and len(ops.children) == 2


def test_a_drain_only_where_the_policy_says_and_the_gpu_still_answers():
    for policy, lost, drained in ((HealthPolicy(drain_before_stop=True), False, True),
                                  (HealthPolicy(drain_before_stop=True), True, False),
                                  (HealthPolicy(), False, False)):
        sup, ops, clock, monitor, recovery = rig(policy)
        sup.spec = dataclasses.replace(sup.spec, drain_s=30)
        monitor.backend.gpus()[0].lost = lost
        recovery.hold(clock.now, [(0, RESET)])
        assert sup.state == (STOPPING if drained else HELD), (policy, lost)


# -- each Xid as the daemon handles it (issue 51, finding 4) -----------------------------------------------------

def daemon_polls(sup, clock, monitor, recovery, events=(), polls=5):
    """What the daemon does: the events' holds and every GPU that waits (handle_gpu_events), then each poll:
    monitor, recovery, the engine's own tick."""
    holds = monitor.record_events(list(events), clock.now)
    recovery.hold(clock.now, holds + list(waiting(monitor.events.needs_reset, monitor.verdicts).items()))
    for _ in range(polls):
        monitor.tick(clock.now)
        recovery.hold(clock.now, list(waiting(monitor.events.needs_reset, monitor.verdicts).items()))
        recovery.tick(clock.now, waiting(monitor.events.needs_reset, monitor.verdicts))
        sup.tick(clock.now)
        clock.advance(1)


def docs_xids():
    from test_health import docs_xids
    return docs_xids()


@pytest.mark.parametrize("number, state, action, engine", docs_xids())
def test_each_xid_of_the_docs_table_holds_the_engine_or_lets_it_serve_as_the_table_says(number, state, action,
                                                                                       engine):
    sup, ops, clock, monitor, recovery = rig()
    daemon_polls(sup, clock, monitor, recovery, [GpuEvent(0, "xid", number)])
    v = monitor.verdicts[0]
    assert (v.state, v.action) == (state, action), v.reasons
    if engine.startswith("stopped"):
        assert sup.state == HELD and sup.problem.startswith(f"waiting for GPU0's action: {v.action_text}")
    else:
        assert sup.state == RUNNING and len(ops.children) == 1, sup.problem


def test_xid63_a_row_remap_pending_lets_the_engine_serve_degraded_until_the_gpu_is_reset(caplog):
    """NVIDIA's catalog: work continues, the remap takes effect at the next reset. Before: HELD, "reset the GPU"."""
    caplog.set_level("INFO")
    sup, ops, clock, monitor, recovery = rig()
    event = GpuEvent(0, "xid", 63)
    daemon_polls(sup, clock, monitor, recovery, [event], polls=30)
    assert sup.state == RUNNING and len(ops.children) == 1 and not monitor.events.needs_reset
    v = monitor.verdicts[0]
    assert (v.state, v.action) == ("degraded", "reset_gpu")
    assert v.reasons == ("Xid 63 (ECC page retirement or row remap recorded (takes effect at a reset)): "
                         "reset the GPU",)
    assert [a.alert for a in monitor.snapshot.firing() if a.alert.startswith("gpu_")] == ["gpu_xid", "gpu_degraded"]
    line = next(r for r in caplog.records if "Xid 63" in r.getMessage() and "recovery:" in r.getMessage())
    assert line.levelname == "WARNING" and "the GPU serves on, degraded until it is reset" in line.getMessage()
    daemon_polls(sup, clock, monitor, recovery, [event] * 3, polls=400)  # more of them, past the 5 minutes
    assert sup.state == RUNNING and monitor.verdicts[0].state == "degraded"  # it waits for the reset still
    gpu = monitor.backend.gpus()[0]
    gpu.reset(1.0)  # the maintenance window's reset: gone a second, then back
    daemon_polls(sup, clock, monitor, recovery, polls=1)
    gpu.backend.clock.advance(2)
    daemon_polls(sup, clock, monitor, recovery, polls=3)
    assert monitor.verdicts[0].state == "healthy" and not monitor.events.pending


def test_xid64_a_row_remap_that_failed_holds_the_engine_for_an_inspection_and_never_resets_it():
    sup, ops, clock, monitor, recovery = rig(HealthPolicy(reset_gpu=True))
    asked = []
    recovery.reset_argv = lambda i: asked.append(i) or ["true"]
    daemon_polls(sup, clock, monitor, recovery, [GpuEvent(0, "xid", 64)], polls=10)
    assert sup.state == HELD and asked == []  # a reset cannot repair it: not tried, even where the policy allows one
    assert sup.problem == ("waiting for GPU0's action: inspect the hardware (Xid 64 (ECC page retirement or row "
                           "remap failed))")
    assert (monitor.verdicts[0].state, monitor.verdicts[0].action) == ("unhealthy", "inspect")


# -- a GPU that flaps lost/back every poll --------------------------------------------------------------------

def flap(sup, clock, monitor, recovery, polls, lost_every=2):
    """Poll as the daemon does (hold for what waits, poll, recovery), the GPU lost on every lost_every-th poll."""
    gpu = monitor.backend.gpus()[0]
    for i in range(polls):
        recovery.hold(clock.now, list(waiting(monitor.events.needs_reset, monitor.verdicts).items()))
        if lost_every and i % lost_every == 0:
            gpu.reset(0.5)  # off the bus for this poll, back at the next
        monitor.tick(clock.now)
        recovery.tick(clock.now, waiting(monitor.events.needs_reset, monitor.verdicts))
        sup.tick(clock.now)
        clock.advance(1)
        gpu.backend.clock.advance(1)


def test_a_gpu_that_flaps_every_poll_does_not_restart_loop_the_engine_nor_flood_the_journal(caplog):
    """Before: 40 polls of a GPU lost and back every other poll started the engine 20 times (each release reset
    its restart budget) and wrote ~10 journal lines a flap: 200 lines."""
    caplog.set_level(logging.INFO, logger="gpuwarden")
    sup, ops, clock, monitor, recovery = rig()
    flap(sup, clock, monitor, recovery, 40)
    assert len(ops.children) <= 3, len(ops.children)  # the first start, one release, then it waits
    assert sup.state == HELD
    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.INFO]
    flapping = [m for m in lines if "health" in m and ("unhealthy" in m or "healthy again" in m)]
    back = [m for m in lines if "is back: planned and applied its tuning" in m]
    assert len(flapping) <= 8, flapping
    assert len(back) <= 2, back
    assert any("held again" in m and "its GPU flaps" in m for m in lines)
    # Once the GPU stays back long enough, the engine starts again by itself, once.
    flap(sup, clock, monitor, recovery, 15, lost_every=0)
    assert sup.state in (STARTING, RUNNING) and len(ops.children) <= 4


def test_a_single_loss_releases_the_engine_as_soon_as_the_gpu_is_back():
    sup, ops, clock, monitor, recovery = rig()
    flap(sup, clock, monitor, recovery, 1, lost_every=1)  # lost once
    flap(sup, clock, monitor, recovery, 1, lost_every=0)  # back: released at once (no flapping yet)
    assert sup.state in (STARTING, RUNNING) and len(ops.children) == 2


@pytest.mark.process
def test_the_reset_runs_only_where_allowed_and_nobody_else_uses_the_gpu(tmp_path, caplog):
    caplog.set_level("INFO")
    ran = tmp_path / "ran"
    argv = lambda i: [sys.executable, "-c", f"open({str(ran)!r}, 'a').write('reset {i}\\n'); print('GPU reset ok')"]  # noqa: E731
    sup, ops, clock, monitor, recovery = rig(HealthPolicy(reset_gpu=True), argv)
    gpu = monitor.backend.gpus()[0]
    monitor.events.needs_reset[0] = REBOOT
    recovery.hold(clock.now, [(0, REBOOT)])
    settle(recovery, monitor, clock)
    assert not ran.exists()  # a reboot is never the daemon's to do
    monitor.events.needs_reset[0] = RESET
    gpu.processes = [(4242, None)]  # somebody else's process on it
    for _ in range(3):
        settle(recovery, monitor, clock)
    assert not ran.exists() and sup.state == HELD
    refused = [r.getMessage() for r in caplog.records if "but pid 4242 use it: not resetting" in r.getMessage()]
    assert len(refused) == 1, refused  # said once
    gpu.processes = []
    settle(recovery, monitor, clock)
    settle(recovery, monitor, clock)  # the next poll re-applies the tuning, clears the wait, releases the engine
    assert ran.read_text() == "reset 0\n"
    assert "GPU0 reset in" in caplog.text and "(GPU reset ok)" in caplog.text
    assert not monitor.events.needs_reset and sup.state == STARTING


@pytest.mark.process
def test_a_reset_that_fails_leaves_the_gpu_waiting_and_is_said_once(caplog):
    argv = lambda i: [sys.executable, "-c", "import sys; print('Unable to reset GPU: in use\\x1b[2J'); sys.exit(3)"]  # noqa: E731
    sup, ops, clock, monitor, recovery = rig(HealthPolicy(reset_gpu=True), argv)
    monitor.events.needs_reset[0] = RESET
    recovery.hold(clock.now, [(0, RESET)])
    for _ in range(4):
        settle(recovery, monitor, clock)
    failed = [r.getMessage() for r in caplog.records if "reset failed" in r.getMessage()]
    assert len(failed) == 1 and "exit status 3: Unable to reset GPU: in use\\x1b[2J" in failed[0], failed
    assert "it stays unhealthy" in failed[0]
    assert sup.state == HELD and monitor.events.needs_reset == {0: RESET}
    recovery.configure(HealthPolicy(reset_gpu=True))  # a reload: the operator looked; it may be tried again
    settle(recovery, monitor, clock)
    assert len([r for r in caplog.records if "reset failed" in r.getMessage()]) == 2


@pytest.mark.process
def test_the_reset_command_has_a_time_limit_and_its_group_is_killed(tmp_path):
    pidfile = tmp_path / "pid"
    script = f"import os, time; open({str(pidfile)!r}, 'w').write(str(os.getpid())); time.sleep(60)"
    began = time.monotonic()
    with pytest.raises(ResetFailed, match="no end within 0.5 s: killed"):
        run_reset([sys.executable, "-c", script], timeout_s=0.5)
    assert time.monotonic() - began < 30  # a bound on a hang: the script sleeps 60 s
    pid = int(pidfile.read_text())
    assert not _alive(pid)
    with pytest.raises(ResetFailed, match="could not be started"):
        run_reset(["/nonexistent/nvidia-smi", "--gpu-reset"])
    big = "import sys; sys.stdout.write('x' * 10_000_000 + '\\nlast line\\n')"
    assert run_reset([sys.executable, "-c", big]) == "last line"  # only the output's end is read


def _alive(pid):
    try:
        state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.process
def test_a_reset_command_that_leaves_a_helper_in_its_session_leaves_nothing_running(tmp_path):
    """Before: a command that exited 0 left its background helper (same session) running for good."""
    pidfile = tmp_path / "helper"
    script = ("import subprocess, sys; p = subprocess.Popen(['sleep', '300']); "
              f"open({str(pidfile)!r}, 'w').write(str(p.pid)); print('GPU reset ok')")
    assert run_reset([sys.executable, "-c", script], timeout_s=20) == "GPU reset ok"
    helper = int(pidfile.read_text())
    for _ in range(50):
        if not _alive(helper):
            break
        time.sleep(0.1)
    alive = _alive(helper)
    if alive:
        os.kill(helper, 9)
    assert not alive, "the reset command's helper outlived it"


@pytest.mark.process
def test_a_reset_command_that_prints_without_end_stops_at_the_write_limit_not_at_a_full_disk(tmp_path):
    """Before: 60 s of output went to a temp file without limit (GBs); now RLIMIT_FSIZE stops it at 64 MiB."""
    script = "import sys\nwhile True: sys.stdout.write('x' * 65536)"
    began = time.monotonic()
    with pytest.raises(ResetFailed, match="exit status"):
        run_reset([sys.executable, "-c", script], timeout_s=60)
    assert time.monotonic() - began < 30


# -- the known answer, against a server -----------------------------------------------------------------------

class Engine(BaseHTTPRequestHandler):
    reply = (200, b"")

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        code, body = self.server.reply
        self.send_response(code)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def engine():
    server = ThreadingHTTPServer(("127.0.0.1", 0), Engine)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server
    server.shutdown()


def test_the_known_answer_is_read_bounded_and_compared(engine):
    url = f"http://127.0.0.1:{engine.server_address[1]}/v1/completions"
    engine.reply = (200, json.dumps({"choices": [{"text": " jumps over"}]}).encode())
    assert known.ask(url, "m") == " jumps over"
    assert known.compare(" jumps over", " jumps over") is None
    assert known.compare(" jumps over", " \x1b[2Jgarbage") == \
        'the known-answer check gave " \\x1b[2Jgarbage", the first healthy start gave " jumps over"'
    engine.reply = (200, b'{"choices": [{"text": "' + b"x" * known.ANSWER_MAX_BYTES + b'"}]}')
    with pytest.raises(HttpError):
        known.ask(url, "m")  # over the size cap: no answer, never a verdict
    for reply in ((500, b"{}"), (200, b"[]"), (200, b'{"choices": [{"text": 5}]}')):
        engine.reply = reply
        with pytest.raises(known.NoAnswer):
            known.ask(url, "m")
    began = time.monotonic()
    with pytest.raises(HttpError, match="timed out|within 0.5 s"):
        known.ask(f"http://127.0.0.1:{_silent_port()}/v1/completions", "m", timeout_s=0.5)
    assert time.monotonic() - began < 30  # a bound on a hang: the silent port never answers


def _silent_port():
    """A listener that accepts and never answers."""
    import socket
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(4)
    _silent_port.keep = sock
    return sock.getsockname()[1]


# -- the daemon with the fake engine, as real processes -------------------------------------------------------

def recovery_config(write, fake, tmp_path, health):
    """The fake engine (drain and answer modes) on a one-GPU simulator whose timeline a test moves on to a fault:
    the driver's recovery action "reset the GPU" at 1000 s, and a reset at 1008 s (the GPU gone for a second)."""
    answer = fake["script"].parent / f"answer-{free_port()}"
    answer.write_text(" the first answer")
    answer.chmod(0o644)
    scenario = write("scenario.yaml", resolve_scenario("dgx-spark").read_text().split("timeline:")[0] +
                     "timeline:\n  - {at_s: 1000, event: recovery_action, action: 1}\n"
                     "  - {at_s: 1008, event: gpu_reset, for_s: 1}\n")
    path, base, port = fault_config(write, fake, "drain,answer", serve_extra="  drain_s: 10\n  probe_after_s: 0\n",
                                    extra=f"health:\n{health}")
    text = path.read_text().replace("scenario: dgx-spark", f"scenario: {scenario}")
    text = text.replace('"drain,answer"]', f'"drain,answer", --answer-file, "{answer}"]')
    path.write_text(text.replace(str(FLAGCHECK), str(FLAGCHECK.parent / "fakechild-python")))
    channel = tmp_path / "channel"
    channel.mkdir()
    return path, base, port, answer, channel


def slow_request(port, seconds=None):
    """A slow request of the fake engine's, seconds long, or None: in flight until test_drain.release(port)."""
    outcome = []

    def one():
        query = "gate=1" if seconds is None else f"s={seconds}"
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/x?{query}", timeout=120) as reply:
                outcome.append(reply.status)
        except OSError as exc:
            outcome.append(f"failed: {exc}")
    thread = threading.Thread(target=one, daemon=True)
    thread.start()
    return thread, outcome


@pytest.mark.process
def test_the_engine_drains_waits_for_the_reset_and_comes_back_with_the_known_answer(write, fake, daemons, tmp_path,
                                                                                    no_fakes_left):
    path, base, port, answer, channel = recovery_config(write, fake, tmp_path, "  drain_before_stop: true\n"
                                                                               "  known_answer: true\n")
    d = daemons(path, env={**_env(), power.ENV: str(channel)})
    d.wait_for("vLLM healthy after", timeout=120)
    d.wait_for('known answer recorded at the first healthy start: " the first answer"', timeout=15)
    thread, outcome = slow_request(port)
    wait_until(lambda: (status(base).get("serving_stats") or {}).get("requests_running") == 1.0, 60)
    mark = len(d.lines)
    power.move_clock(channel, 1000)  # the fault: the driver asks for a GPU reset
    d.wait_for("draining vLLM: 1 request in flight, up to 10 s", after=mark, timeout=60)
    release(port)  # it ends during the drain
    d.wait_for("vLLM held, not restarting: waiting for GPU0's action: reset the GPU", after=mark, timeout=60)
    thread.join(60)
    assert outcome == [200]  # the request in flight finished: drained, not killed
    st = wait_until(lambda: (lambda s: s if s["serving"]["state"] == HELD else None)(status(base)), 60)
    assert st["serving"]["problem"].startswith("waiting for GPU0's action: reset the GPU")
    assert "vLLM HELD" in st["status"] and "vllm_fatal" not in {a["alert"] for a in st["alerts_firing"]}
    d.wait_for("vLLM released: its GPUs answer again", after=mark, timeout=20)  # the scripted reset at 1008 s
    d.wait_for("vLLM healthy after", after=mark, timeout=120)
    d.wait_for("the known-answer check passed after the recovery", after=mark, timeout=15)
    tail = "\n".join(d.lines[mark:])
    assert tail.count("vLLM starting") == 1 and "FATAL" not in tail and "SIGKILL to" not in tail
    assert tail.index("is back: planned and applied its tuning") < tail.index("vLLM released")
    assert d.stop() == 0


@pytest.mark.process
def test_a_known_answer_that_differs_after_the_recovery_keeps_the_engine_stopped(write, fake, daemons, tmp_path,
                                                                                 no_fakes_left):
    path, base, port, answer, channel = recovery_config(write, fake, tmp_path, "  known_answer: true\n")
    d = daemons(path, env={**_env(), power.ENV: str(channel)})
    d.wait_for('known answer recorded at the first healthy start: " the first answer"', timeout=30)
    mark = len(d.lines)
    power.move_clock(channel, 1000)
    d.wait_for("vLLM held, not restarting: waiting for GPU0's action: reset the GPU", after=mark, timeout=15)
    answer.write_text(" garbage\x1b[2J")  # the engine computes something else after the reset
    d.wait_for("vLLM released", after=mark, timeout=20)
    line = d.wait_for("the known-answer check gave", after=mark, timeout=30)
    assert 'gave " garbage\\x1b[2J", the first healthy start gave " the first answer"' in line
    st = wait_until(lambda: (lambda s: s if s["serving"]["state"] == HELD else None)(status(base)), 10)
    assert "the GPU stays unhealthy" in st["serving"]["problem"]
    time.sleep(3)
    assert "\n".join(d.lines[mark:]).count("vLLM starting") == 1  # held: no restart after the mismatch
    assert d.stop() == 0


def _env():
    from conftest import subprocess_env
    return subprocess_env()


def test_a_recovery_fault_does_not_stop_the_reboot_record(tmp_path, monkeypatch):
    """Faults stay in their room: recovery.tick raising every pass must not leave a fault that asks for a reboot
    uncounted (the count shared recovery's try, so the record was never written)."""
    from gpuwarden.gpu.sim.backend import ManualClock as Clock
    from gpuwarden.service.daemon import Daemon
    from gpuwarden.watch.health_record import HealthRecord, NAME

    class Watcher:
        failure = None

        def take(self):
            return []

    monkeypatch.setenv("STATE_DIRECTORY", str(tmp_path))
    cfg = config.parse_text("gpu:\n  backend: sim\n  scenario: rtx-pro-4000-headless\nmetrics:\n  listen: none\n"
                            "tuning:\n  apply: false\n")
    daemon = Daemon(cfg, open_configured(cfg, Clock()), reload=lambda: cfg)
    daemon.watcher = Watcher()

    def broken(*args, **kwargs):
        raise RuntimeError("recovery broke")

    monkeypatch.setattr(daemon.recovery, "tick", broken)
    daemon.monitor.events.needs_reset[0] = "Xid 79 (GPU has fallen off the bus): reboot the node"
    daemon.tick(time.monotonic())
    uuid = daemon.monitor.verdicts[0].uuid
    assert daemon.monitor.verdicts[0].reboot_faults == ("gpu_lost",)  # Xid 79 is the GPU lost from the bus
    assert HealthRecord.load(tmp_path / NAME).count(uuid, "gpu_lost") == 1
