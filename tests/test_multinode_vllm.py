"""Two gpuwarden daemons on this one machine as two nodes of one engine. First, one vLLM engine (tensor parallel 2 across
--nnodes 2, on vLLM's own multi-node mode), each on its own loopback address (127.0.0.2 head, 127.0.0.3
worker), its own ports, state and home. One scenario, because every vLLM start costs minutes on CI's 2 cores:
the worker comes up 15 s after the head waits for it, completions come back through the head, the worker's engine is
SIGKILLed and the whole engine comes back without a command, and the head's stop ends the worker's part too and
leaves no engine process on either node. Two starts of the two-rank engine: the worker's wait for a lost head and the
head's restart of its part are the unit tests' (tests/test_nodes.py), and the worker sees the head go at the stop.

Then the same supervision on Ray: real Ray nodes (`ray start --head` / `ray start --address` as each node's
children) under a Ray driver that serves (tests/vllm/ray_server.py: vLLM's CPU build cannot run on Ray).

Each node gets its own home and caches: two ranks sharing one torch compile cache race on it ("file too short").
"""

import json
import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest

from conftest import CPU_TINY_PROFILE, ROOT, free_port, subprocess_env
from test_vllm_e2e import group_alive

pytestmark = [pytest.mark.process, pytest.mark.vllm]

HEAD, WORKER = "127.0.0.2", "127.0.0.3"
LATE_S = 15  # the worker's daemon starts this long after the head waits for it in its rendezvous
START_S = 900  # a two-rank start on a busy 2-core machine (import, compile, rendezvous): generous


def node(base, write, rank, vllm_python, model, user, api_port, master_port, backend="mp", command=None):
    """One node's config (the same but for the rank, its metrics address and its own home), state and env."""
    command = command or [vllm_python, ROOT / "tests" / "vllm" / "vllm_cli.py", "serve"]
    folder = base / f"node{rank}"
    home = folder / "home"
    home.mkdir(parents=True)
    uid = pwd.getpwnam(user)
    os.chown(home, uid.pw_uid, uid.pw_gid)
    (folder / "profiles.d").mkdir()
    (folder / "profiles.d" / "cpu-tiny.yaml").write_text(CPU_TINY_PROFILE.read_text())
    listen = f"{HEAD if rank == 0 else WORKER}:{free_port()}"
    caches = {"HOME": home, "XDG_CACHE_HOME": home / ".cache", "VLLM_CACHE_ROOT": home / ".cache/vllm",
              "TORCHINDUCTOR_CACHE_DIR": home / ".cache/torchinductor", "TRITON_CACHE_DIR": home / ".cache/triton"}
    env = {"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "1", **{k: str(v) for k, v in caches.items()}}
    path = folder / "gpuwarden.yaml"
    path.write_text(f"""poll_interval_s: 0.5
metrics:
  listen: {listen}
gpu:
  backend: sim
  scenario: dgx-spark
serve:
  enabled: true
  profile: cpu-tiny
  model: {model}
  command: {json.dumps([str(c) for c in command])}
  host: {HEAD}
  port: {api_port}
  user: {user}
  args: [--tensor-parallel-size, "2"]
  env: {json.dumps(env)}
  startup_timeout_s: {START_S}
  stop_timeout_s: 20
  liveness_interval_s: 2
  nodes:
    count: 2
    rank: {rank}
    hosts: [{HEAD}, {WORKER}]
    port: {master_port}
    backend: {backend}
    interface: lo
""")
    state = folder / "state"
    state.mkdir()
    state.chmod(0o755)
    run_env = dict(subprocess_env(), STATE_DIRECTORY=str(state), RUNTIME_DIRECTORY=str(folder / "run"))
    return path, f"http://{listen}", run_env


def scrape(base):
    with urllib.request.urlopen(base + "/metrics", timeout=10) as reply:
        return reply.read().decode()


def started_pid(d, title, after):
    line = d.wait_for(f"{title} starting (pid", timeout=START_S, after=after)
    return int(line.split("(pid ")[1].split(",")[0])


def gone(pgid, within=30):
    """True once no process of the group is left (SIGKILL of a process with memory mapped is not instant)."""
    deadline = time.monotonic() + within
    while group_alive(pgid) and time.monotonic() < deadline:
        time.sleep(0.5)
    return group_alive(pgid) == []


def complete(port, model):
    """A completion through the head's API, on the head's address."""
    body = json.dumps({"model": str(model), "prompt": "the gpu runs", "max_tokens": 5}).encode()
    request = urllib.request.Request(f"http://{HEAD}:{port}/v1/completions", body,
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as reply:
        return json.load(reply)["choices"][0]["text"]


def test_two_nodes_serve_one_model_lose_a_rank_and_come_back(write, daemons, vllm_python, tiny_model,
                                                                        child_user):
    t0 = time.monotonic()
    base = Path(tempfile.mkdtemp(prefix="gpuwarden-nodes-"))
    base.chmod(0o755)  # the child user reaches its home below it
    try:
        api_port, master_port = free_port(), free_port()
        head_cfg, head_url, head_env = node(base, write, 0, vllm_python, tiny_model, child_user, api_port, master_port)
        worker_cfg, worker_url, worker_env = node(base, write, 1, vllm_python, tiny_model, child_user, api_port,
                                                  master_port)
        h = daemons(head_cfg, env=head_env)
        head_pid = started_pid(h, "vLLM rank 0 of 2", 0)
        # The worker comes up late: the head, once it waits in its rendezvous, goes on waiting, never FATAL.
        h.wait_for(f"vLLM rank 0 of 2 is waiting for rank 1 ({WORKER}) to join the rendezvous", timeout=START_S)
        time.sleep(LATE_S)
        assert h.proc.poll() is None and "FATAL" not in h.log, h.log
        assert "vLLM rank 0 of 2 healthy" not in h.log
        with urllib.request.urlopen(head_url + "/status", timeout=10) as reply:
            doc = json.load(reply)
        assert "vLLM rank 0 of 2 STARTING" in doc["status"] and "waiting for rank 1" in doc["status"]
        assert (doc["serving"]["role"], doc["serving"]["rank"], doc["serving"]["nodes"]) == ("head", 0, 2)
        w = daemons(worker_cfg, env=worker_env)
        worker_pid = started_pid(w, "vLLM rank 1 of 2", 0)
        argv = Path(f"/proc/{worker_pid}/cmdline").read_bytes().split(b"\0")
        assert b"--headless" in argv and b"--port" not in argv and argv[argv.index(b"--node-rank") + 1] == b"1"
        environ = Path(f"/proc/{worker_pid}/environ").read_bytes().split(b"\0")
        assert b"GLOO_SOCKET_IFNAME=lo" in environ and f"VLLM_HOST_IP={WORKER}".encode() in environ
        h.wait_for("vLLM rank 0 of 2 healthy after", timeout=START_S)
        w.wait_for("vLLM rank 1 of 2 healthy after", timeout=60)
        print(f"first start, worker {LATE_S} s late: serving after {time.monotonic() - t0:.0f} s")
        assert complete(api_port, tiny_model)
        head_metrics, worker_metrics = scrape(head_url), scrape(worker_url)
        rendezvous = f"{HEAD}:{master_port}"
        assert (f'gpuwarden_serving_node_info{{head="{rendezvous}",nodes="2",rank="0",role="head"}} 1.0'
                in head_metrics)
        assert (f'gpuwarden_serving_node_info{{head="{rendezvous}",nodes="2",rank="1",role="worker"}} 1.0'
                in worker_metrics)
        assert f'gpuwarden_serving_head_reachable{{head="{rendezvous}"}} 1.0' in worker_metrics
        assert f'gpuwarden_serving_node_up{{head="{rendezvous}",rank="0"}} 1.0' in head_metrics
        assert f'gpuwarden_serving_node_up{{head="{rendezvous}",rank="1"}} 1.0' in worker_metrics

        # SIGKILL the worker's engine: both notice, the head names rank 1, and the whole engine comes back.
        t1 = time.monotonic()
        hm, wm = len(h.lines), len(w.lines)
        os.kill(worker_pid, signal.SIGKILL)
        w.wait_for("vLLM rank 1 of 2 exited with signal SIGKILL", timeout=30, after=wm)
        # named by the lost connection's address: "rank 1 (127.0.0.3)", or, where the worker's connection came
        # from another loopback address, "a connection from 127.0.0.1"
        lost = h.wait_for("vLLM rank 0 of 2 lost ", timeout=60, after=hm)
        assert "its connection to the rendezvous" in lost
        old_head = head_pid
        head_pid = started_pid(h, "vLLM rank 0 of 2", hm)
        assert gone(old_head), "the head's part that lost its rank is ended, group and all"
        worker_pid = started_pid(w, "vLLM rank 1 of 2", wm)
        h.wait_for("vLLM rank 0 of 2 healthy after", timeout=START_S, after=hm)
        assert complete(api_port, tiny_model)
        print(f"worker's engine SIGKILLed: serving again after {time.monotonic() - t1:.0f} s")

        assert "FATAL" not in h.log and "FATAL" not in w.log
        assert "Traceback (most recent call last)" not in "\n".join(
            row for d in (h, w) for row in d.lines if "vllm: " not in row)

        # Stop the head: its engine is gone, and the worker's part ends with it (the worker's daemon waits).
        wm = len(w.lines)
        assert h.stop() == 0  # the daemon's own SIGKILL comes at drain_s + 10 = 70 s (ci51: over 60 s, starved)
        assert group_alive(head_pid) == [], "the head's stop leaves no engine process on the head"
        w.wait_for("vLLM rank 1 of 2 lost rank 0 (the head)", timeout=60, after=wm)
        assert gone(worker_pid), "nor on the worker"
        assert w.stop() == 0
    finally:
        shutil.rmtree(base, ignore_errors=True)
    print(f"two-node scenario: {time.monotonic() - t0:.0f} s")


def ray_processes(user):
    """PIDs of user's processes running Ray's code (its CLI, GCS, raylet, workers), zombies not."""
    uid = pwd.getpwnam(user).pw_uid
    found = set()
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            if entry.stat().st_uid != uid or " Z " in (entry / "stat").read_text().rsplit(")", 1)[1][:3]:
                continue
            if b"/ray/" in (entry / "cmdline").read_bytes() or b" ray::" in b" " + (entry / "cmdline").read_bytes():
                found.add(int(entry.name))
        except OSError:
            continue
    return found


def test_ray_nodes_as_children_serve_lose_the_worker_node_and_come_back(write, daemons, vllm_python, child_user):
    t0 = time.monotonic()
    before = ray_processes(child_user)
    base = Path(tempfile.mkdtemp(prefix="gpuwarden-ray-"))
    base.chmod(0o755)
    try:
        api_port, gcs_port = free_port(), free_port()
        server = [vllm_python, ROOT / "tests" / "vllm" / "ray_server.py"]
        configs = [node(base, write, rank, vllm_python, "tiny", child_user, api_port, gcs_port, "ray", server)
                   for rank in (0, 1)]
        h = daemons(configs[0][0], env=configs[0][2])
        w = daemons(configs[1][0], env=configs[1][2])
        ray_head = started_pid(h, "Ray head", 0)
        ray_worker = started_pid(w, "Ray rank 1 of 2", 0)
        argv = Path(f"/proc/{ray_worker}/cmdline").read_bytes().split(b"\0")
        assert b"start" in argv and argv[argv.index(b"--address") + 1] == f"{HEAD}:{gcs_port}".encode()
        assert argv[argv.index(b"--node-ip-address") + 1] == WORKER.encode()
        h.wait_for("vLLM rank 0 of 2 healthy after", timeout=START_S)
        engine = int(h.wait_for("vLLM rank 0 of 2 starting (pid").split("(pid ")[1].split(",")[0])
        assert f"RAY_ADDRESS={HEAD}:{gcs_port}".encode() in Path(f"/proc/{engine}/environ").read_bytes()
        assert complete(api_port, "tiny") == f"{HEAD} {WORKER}"  # a task ran on each Ray node
        print(f"Ray: serving after {time.monotonic() - t0:.0f} s")

        # Lose the worker's Ray node: its daemon restarts it, the head's engine (which lost a node of its
        # group) restarts, and both nodes serve again without a command.
        t1 = time.monotonic()
        hm, wm = len(h.lines), len(w.lines)
        os.kill(ray_worker, signal.SIGKILL)
        w.wait_for("Ray rank 1 of 2 exited with signal SIGKILL", timeout=30, after=wm)
        # Ray's GCS declares a node dead after its health checks fail (seconds when the node says goodbye, half
        # a minute and more when it cannot); a busy host stretches that.
        h.wait_for("vLLM rank 0 of 2 exited", timeout=300, after=hm)
        ray_worker = started_pid(w, "Ray rank 1 of 2", wm)
        h.wait_for("vLLM rank 0 of 2 healthy after", timeout=START_S, after=hm)
        assert complete(api_port, "tiny") == f"{HEAD} {WORKER}"
        print(f"Ray: worker node SIGKILLed, serving again after {time.monotonic() - t1:.0f} s")
        assert "FATAL" not in h.log and "FATAL" not in w.log

        # Stop both: no Ray process and no engine left, escaped workers included. Ray's node takes its time to
        # end on a busy box (a fresh clone's run on four workers saw a worker daemon's stop pass 90 s): the
        # deadline is for a stop that hangs, and a failure shows what each daemon said.
        for d in (h, w):
            try:
                assert d.stop(timeout=240) == 0, d.log[-3000:]
            except subprocess.TimeoutExpired:
                raise AssertionError("a daemon did not stop within 240 s:\n" + d.log[-3000:]) from None
        assert gone(ray_head) and gone(ray_worker) and gone(engine)
        deadline = time.monotonic() + 30
        while ray_processes(child_user) - before and time.monotonic() < deadline:
            time.sleep(0.5)
        assert ray_processes(child_user) - before == set()
    finally:
        shutil.rmtree(base, ignore_errors=True)
    print(f"Ray scenario: {time.monotonic() - t0:.0f} s")
