"""A multi-node engine's roles (serve.nodes): the config, each node's rank, the engine's flags and environment
per role, the interface and reachability checks, and the supervision of a part that serves no API."""

import os
import pwd
import socket

import pytest

from gpuwarden import config
from gpuwarden.gpu.sim.backend import ManualClock
from gpuwarden.serving.compose.command import build_command
from gpuwarden.serving.compose.engines.vllm import ENGINE as VLLM
from gpuwarden.serving.compose.identity import Identity
from gpuwarden.serving.compose.nodes import interface, reachable, role_of
from gpuwarden.serving.compose.profiles import load_profiles
from gpuwarden.serving.run.spec import engine_spec
from gpuwarden.serving.run.supervisor import BACKOFF, RUNNING, STARTING, Program
from gpuwarden.base.yamlfile import ConfigError, ConfigErrors
from test_serving import FakeGpu, FakeOps, sample

GENERIC = load_profiles(None)["generic"]
NODES = "  nodes:\n    count: 2\n    head: 10.0.0.1\n    port: 29511\n    interface: eth1\n"


def node_config(nodes=NODES, extra=""):
    return config.parse_text("serve:\n  model: /m/Qwen3-4B\n  port: 8123\n" + extra + nodes, name="c.yaml")


def errors(text):
    with pytest.raises(ConfigErrors) as info:
        config.parse_text(text, name="c.yaml")
    return [str(e) for e in info.value.errors]


def test_bad_nodes_sections_are_one_located_line_each():
    base = "serve:\n  model: /m\n  nodes:\n"
    assert errors(base + "    count: 2\n    head: 10.0.0.1\n") == [
        "c.yaml:3: serve.nodes.rank: this node's rank is not set, and no hosts list to find it in "
        "(rank: 0-1 (0 is the head), or hosts: [HEAD, ...])"]
    assert errors(base + "    count: 2\n    rank: 2\n    head: 10.0.0.1\n")[0].startswith("c.yaml:5: serve.nodes.rank:")
    assert errors(base + "    count: 3\n    hosts: [10.0.0.1, 10.0.0.2]\n") == [
        "c.yaml:5: serve.nodes.hosts: 2 hosts for count 3 (one address per node, head first)"]
    assert errors(base + "    rank: 0\n") == [
        "c.yaml:3: serve.nodes.head: the head's address is not set (head: ADDRESS, or hosts: [HEAD, ...])"]
    assert errors(base + "    rank: 0\n    head: 10.0.0.1\n    backend: slurm\n") == [
        "c.yaml:6: serve.nodes.backend: 'slurm' is not a valid choice (allowed: mp, ray)"]
    assert errors(base + "    rank: 0\n    head: 10.0.0.1\n    colour: red\n")[0].startswith("c.yaml:6: serve.nodes.colour:")


def test_the_config_round_trips_with_its_nodes():
    cfg = node_config(NODES + "    rank: 1\n")
    assert cfg.serve.nodes.address == "10.0.0.1:29511" and cfg.serve.nodes.backend == "mp"
    assert cfg.as_dict()["serve"]["nodes"] == {"count": 2, "hosts": [], "head": "10.0.0.1", "port": 29511,
                                               "backend": "mp", "interface": "eth1", "rank": 1}
    assert "nodes" not in node_config("").as_dict()["serve"]


def test_the_rank_comes_from_the_one_host_entry_that_is_ours():
    hosts = "  nodes:\n    hosts: [10.0.0.1, 10.0.0.2, 10.0.0.3]\n    count: 3\n"
    cfg = node_config(hosts)
    assert role_of(cfg, local=lambda a: a == "10.0.0.2").rank == 1
    assert cfg.serve.nodes.head == "10.0.0.1"
    with pytest.raises(ConfigError) as info:
        role_of(cfg, local=lambda a: False)
    assert str(info.value) == ("c.yaml:5: serve.nodes.hosts: none of them is an address of this host "
                               "(set serve.nodes.rank (0-2) on this node)")
    with pytest.raises(ConfigError) as info:
        role_of(cfg, local=lambda a: a != "10.0.0.1")
    assert "entries 1, 2 all are an address of this host" in str(info.value)
    assert role_of(node_config(hosts.replace("10.0.0.1", "127.0.0.1"))).rank == 0  # a real bind: ours


def command(rank, backend="mp", extra="", hosts=False):
    listed = "    hosts: [10.0.0.1, 10.0.0.2]\n" if hosts else ""
    cfg = node_config(NODES + listed + f"    rank: {rank}\n    backend: {backend}\n", extra)
    return build_command(cfg.serve, GENERIC, [sample()], {"PATH": "/bin"}, role=role_of(cfg)), cfg


def test_each_role_gets_vllms_own_multinode_flags_and_the_collectives_interface():
    head, _ = command(0, extra="  env: {GLOO_SOCKET_IFNAME: mine}\n")
    worker, _ = command(1)
    shared = ["--distributed-executor-backend", "mp", "--nnodes", "2", "--master-addr", "10.0.0.1",
              "--master-port", "29511"]
    for cmd, rank in ((head, "0"), (worker, "1")):
        argv = list(cmd.argv)
        assert all(flag in argv for flag in shared) and argv[argv.index("--node-rank") + 1] == rank
        assert cmd.env["NCCL_SOCKET_IFNAME"] == "eth1"
    assert head.env["GLOO_SOCKET_IFNAME"] == "mine"  # serve.env is the user's last word; doctor says so
    assert "--headless" not in head.argv and "--port" in head.argv
    assert worker.argv[-1] == "--headless" and "--port" not in worker.argv and "--host" not in worker.argv
    ray_head, _ = command(0, "ray")
    assert list(ray_head.argv[-2:]) == ["--distributed-executor-backend", "ray"] and "--nnodes" not in ray_head.argv


def test_an_engine_without_a_multinode_mode_is_a_config_error():
    from gpuwarden.serving.compose.engines.sglang import ENGINE as SGLANG

    with pytest.raises(ValueError, match="SGLang has no multi-node mode"):
        SGLANG.node_args(None)
    assert VLLM.node_args  # vLLM has one


def test_interfaces_and_reachability_read_the_real_host():
    lo = interface("lo")
    assert lo.exists and lo.up and lo.mtu and lo.mtu >= 1500
    assert not interface("gw-no-such0").exists and not interface("../lo").exists
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        assert reachable("127.0.0.1", port) is None
    assert reachable("127.0.0.1", port) == "Connection refused"


class PeerOps(FakeOps):
    """FakeOps whose head answers when told."""

    def __init__(self, clock):
        super().__init__(clock)
        self.head_answers = False

    def reachable(self, host, port):
        return None if self.head_answers else "Connection refused"

    def peers(self, port, uid, accepted):
        return {}


def worker_program():
    cmd, cfg = command(1, extra="  liveness_interval_s: 5\n  liveness_failures: 2\n  crash_loop_failures: 2\n")
    me = pwd.getpwuid(os.geteuid())
    spec = engine_spec(cfg.serve, cmd, Identity(me.pw_name, me.pw_uid, me.pw_gid, me.pw_dir, (), False), [FakeGpu()])
    clock = ManualClock(100)
    ops = PeerOps(clock)
    return Program(spec, ops, clock), ops, clock


def test_a_worker_waits_for_the_head_without_failing_and_a_lost_head_costs_no_restart(caplog):
    caplog.set_level("INFO")
    program, ops, clock = worker_program()
    assert program.spec.port == 0 and program.spec.peer == ("10.0.0.1", 29511) and program.title == "vLLM rank 1 of 2"
    for _ in range(20):  # the head is 100 s late: the worker waits, never FATAL, nothing spawned
        program.start(clock.now) if program.state != BACKOFF else program.tick(clock.now)
        clock.advance(5)
    assert program.state == BACKOFF and program.blocked and not ops.children
    assert program.problem.startswith("waiting for rank 0: the head's rendezvous 10.0.0.1:29511 does not answer")
    assert program.view().head_up is False and program.view().role == "worker"
    ops.head_answers = True
    for _ in range(3):
        clock.advance(5)
        program.tick(clock.now)
    assert program.state in (STARTING, RUNNING) and len(ops.children) == 1
    program.tick(clock.now)
    assert program.state == RUNNING and program.view().head_up is True
    ops.head_answers = False  # the head's engine died: the rendezvous is gone
    for _ in range(3):
        clock.advance(5)
        program.tick(clock.now)
    assert program.state == BACKOFF and program.blocked and program.restarts == 0
    assert "vLLM rank 1 of 2 lost rank 0 (the head), ending its part" in caplog.text
    ops.head_answers = True
    for _ in range(3):
        clock.advance(5)
        program.tick(clock.now)
    assert len(ops.children) == 2  # back once the head is


def test_a_worker_whose_own_engine_dies_is_restarted_and_counted():
    program, ops, clock = worker_program()
    ops.head_answers = True
    program.start(clock.now)
    clock.advance(5)
    program.start(clock.now) if program.state == BACKOFF else None
    program.tick(clock.now)
    clock.advance(5)
    program.tick(clock.now)
    assert program.state in (STARTING, RUNNING) and ops.children
    ops.exit[program.child.pid] = -9
    program.tick(clock.now)
    assert program.state == BACKOFF and not program.blocked and program.restarts == 1


def head_program():
    cmd, cfg = command(0, extra="  liveness_interval_s: 5\n  liveness_failures: 2\n", hosts=True)
    me = pwd.getpwuid(os.geteuid())
    spec = engine_spec(cfg.serve, cmd, Identity(me.pw_name, me.pw_uid, me.pw_gid, me.pw_dir, (), False), [FakeGpu()])
    clock = ManualClock(100)
    ops = PeerOps(clock)
    ops.links = {1: "10.0.0.1"}  # socket inode -> remote address, as ports.peers gives them
    ops.peers = lambda port, uid, accepted: dict(ops.links) if (port, accepted) == (29511, True) else {}
    ops.health_ok = True
    return Program(spec, ops, clock), ops, clock


def test_the_head_restarts_its_part_when_a_ranks_connection_to_the_rendezvous_closes(caplog):
    program, ops, clock = head_program()
    assert program.spec.rendezvous == 29511 and program.spec.peer is None
    program.start(clock.now)
    program.tick(clock.now)
    assert program.state == RUNNING
    ops.links = {1: "10.0.0.1", 2: "10.0.0.2"}  # rank 1 joined (its connection shows up from the first probe on)
    for _ in range(2):
        clock.advance(5)
        program.tick(clock.now)
    assert program.state == RUNNING
    ops.links = {1: "10.0.0.1"}  # rank 1's process is gone
    clock.advance(5)
    program.tick(clock.now)
    assert program.state == RUNNING  # one read is no verdict (the table is no snapshot): the next, at once, is
    program.tick(clock.now)
    assert program.state == BACKOFF and program.restarts == 0 and program.problem.startswith("lost rank 1 (10.0.0.2)")
    assert "vLLM rank 0 of 2 lost rank 1 (10.0.0.2): its connection to the rendezvous on port 29511 closed" in caplog.text
    clock.advance(1)
    program.tick(clock.now)
    assert program.state == STARTING and len(ops.children) == 2


def test_a_worker_whose_part_failed_waits_for_the_head_to_restart_its_part_but_not_forever():
    program, ops, clock = worker_program()
    ops.head_answers = True
    for _ in range(3):
        program.start(clock.now) if program.state != BACKOFF else program.tick(clock.now)
        clock.advance(5)
    assert program.state in (STARTING, RUNNING)
    ops.exit[program.child.pid] = -9
    program.tick(clock.now)
    for _ in range(3):  # the head's rendezvous still answers: the old engine; wait for it to go
        clock.advance(2)
        program.tick(clock.now)
    assert program.state == BACKOFF and "waiting for rank 0 to restart its part" in program.problem
    assert len(ops.children) == 1
    clock.advance(40)  # bounded: 2 x 5 s x 2 probes + 10 s
    program.tick(clock.now)
    clock.advance(5)
    program.tick(clock.now)
    assert len(ops.children) == 2


def test_a_stranger_that_connects_to_the_rendezvous_and_leaves_is_not_a_lost_rank():
    program, ops, clock = head_program()
    program.start(clock.now)
    program.tick(clock.now)
    ops.links = {1: "127.0.0.1", 2: "10.0.0.2", 3: "203.0.113.9"}  # its own rank 0, rank 1, and a stranger
    for _ in range(2):
        clock.advance(5)
        program.tick(clock.now)
    ops.links = {1: "127.0.0.1", 2: "10.0.0.2"}
    clock.advance(5)
    program.tick(clock.now)
    assert program.state == RUNNING


def test_preflight_names_the_interface_its_variables_and_the_heads_rendezvous():
    from gpuwarden.serving.compose.nodes import preflight

    lo = node_config(NODES.replace("eth1", "lo") + "    rank: 1\n")
    role = role_of(lo)
    env = {"NCCL_SOCKET_IFNAME": "lo", "GLOO_SOCKET_IFNAME": "eth0"}
    lines = preflight(role, env, reach=lambda host, port: "Connection refused")
    assert lines[0] == ("info", "nodes", "this node is rank 1 of 2 (worker; head 10.0.0.1:29511, backend mp)", "")
    assert ("ok", "nodes interface", f"lo is up, MTU {interface('lo').mtu}", "") in lines
    assert ("warning", "nodes interface", "the engine gets GLOO_SOCKET_IFNAME=eth0, not serve.nodes.interface lo",
            "remove GLOO_SOCKET_IFNAME from serve.env or the profile") in lines
    assert not [line for line in lines if "NCCL_SOCKET_IFNAME=" in line[2]]
    assert ("warning", "nodes head", "the head's rendezvous 10.0.0.1:29511 does not answer: Connection refused",
            "start the head (this node waits for it); if it runs, open port 29511 between the nodes") in lines
    missing = preflight(role_of(node_config(NODES.replace("eth1", "gw-none0") + "    rank: 0\n")), {})
    error = [line for line in missing if line[0] == "error"]
    assert error[0][2] == "no network interface gw-none0 on this host" and "lo" in error[0][3]
    assert not [line for line in missing if line[1] == "nodes head"]  # the head asks nobody


def serving_file(write, nodes: str):
    """A gpuwarden.yaml that serves /bin/true on a sim DGX Spark, with this serve.nodes block (indented 2)."""
    return write("gpuwarden.yaml", f"""gpu:
  backend: sim
  scenario: dgx-spark
serve:
  enabled: true
  model: /m/Qwen3-4B
  user: {pwd.getpwuid(os.geteuid()).pw_name if os.geteuid() else "nobody"}
  command: [/bin/true]
{nodes}""")


def test_check_refuses_an_interface_that_is_not_there(write, cli, tmp_path):
    path = serving_file(write, NODES.replace("eth1", "gw-none0") + "    rank: 0\n")
    status, out, err = cli("check", "-c", path)
    assert status == 78, (out, err)
    assert f"{path}:" in err and "serve.nodes.interface: no network interface gw-none0 on this host" in err
    assert "Traceback" not in err


def test_ray_nodes_are_children_started_from_the_engines_own_environment():
    from gpuwarden.serving.run.spec import ray_spec

    me = pwd.getpwuid(os.geteuid())
    who = Identity(me.pw_name, me.pw_uid, me.pw_gid, me.pw_dir, (), False)
    venv = "  command: [/opt/venv/bin/python, -m, vllm.entrypoints.openai.api_server]\n"
    head_cmd, cfg = command(0, "ray", extra=venv, hosts=True)
    head = ray_spec(cfg.serve, head_cmd, who)
    assert head.argv == ("/opt/venv/bin/ray", "start", "--head", "--port", "29511", "--node-ip-address", "10.0.0.1",
                         "--include-dashboard", "false", "--disable-usage-stats", "--block")
    assert (head.title, head.port, head.peer, head.health_path) == ("Ray head", 29511, None, "")
    worker_cmd, cfg = command(1, "ray", extra=venv, hosts=True)
    worker = ray_spec(cfg.serve, worker_cmd, who)
    assert worker.argv[1:5] == ("start", "--address", "10.0.0.1:29511", "--node-ip-address")
    assert (worker.port, worker.peer, worker.rendezvous) == (0, ("10.0.0.1", 29511), 0)
    assert worker.env["NCCL_SOCKET_IFNAME"] == "eth1" and worker.env["VLLM_HOST_IP"] == "10.0.0.2"
    assert engine_spec(cfg.serve, head_cmd, who, []).rendezvous == 0  # Ray's GCS is not vLLM's rendezvous
    clock = ManualClock(100)
    ops = PeerOps(clock)
    ops.head_answers = True
    program = Program(worker, ops, clock)
    for _ in range(2):
        program.start(clock.now)
    assert program.child is not None
    ops.exit[program.child.pid] = -9
    program.tick(clock.now)
    for _ in range(2):  # the head still answers: a Ray node rejoins its GCS at once, it does not wait for it
        clock.advance(3)
        program.tick(clock.now)
    assert len(ops.children) == 2


def test_a_worker_waiting_for_its_head_is_not_a_blocked_start_alert():
    from gpuwarden.watch.signals.serving import vllm_start_blocked

    program, ops, clock = worker_program()
    program.start(clock.now)
    waiting = program.view()
    assert waiting.blocked and not vllm_start_blocked(waiting).active
    import dataclasses

    other = dataclasses.replace(waiting, problem="GPU0 runs other compute processes [4242]")
    assert vllm_start_blocked(other).active  # a start blocked by something here still warns


def test_a_starting_head_says_which_rank_it_waits_for(caplog):
    caplog.set_level("INFO")
    program, ops, clock = head_program()
    ops.health_ok = False
    program.start(clock.now)
    program.tick(clock.now)
    assert program.state == STARTING
    assert program.view().problem == "waiting for rank 1 (10.0.0.2) to join the rendezvous on port 29511"
    assert "vLLM rank 0 of 2 is waiting for rank 1 (10.0.0.2)" in caplog.text
    ops.links = {1: "10.0.0.1", 2: "10.0.0.2"}
    clock.advance(0.5)
    program.tick(clock.now)
    assert program.view().problem is not None  # read once a second while it starts, not every tick
    clock.advance(0.5)
    program.tick(clock.now)
    assert program.state == STARTING and program.view().problem is None


def test_a_rank_lost_right_after_the_head_turned_healthy_is_seen(caplog):
    # The real two-node run: the worker joined while the head started, and was SIGKILLed within a second of the
    # head's healthy line, before a read while RUNNING. Watched only from RUNNING on, the first read there was
    # the baseline and the loss went unseen; the head kept an engine without its rank 1.
    program, ops, clock = head_program()
    ops.health_ok = False
    program.start(clock.now)
    ops.links = {1: "10.0.0.1", 2: "10.0.0.2"}  # both ranks joined during the start
    for _ in range(3):
        program.tick(clock.now)
        clock.advance(5)
    assert program.state == STARTING and program.view().problem is None
    ops.health_ok = True
    program.tick(clock.now)
    assert program.state == RUNNING
    ops.links = {1: "10.0.0.1"}  # rank 1 gone at once
    probes(program, clock)
    assert program.state == BACKOFF and program.problem.startswith("lost rank 1 (10.0.0.2):")


def test_a_rank_lost_while_the_head_starts_restarts_its_part():
    # vLLM's start would wait for the lost rank until startup_timeout_s (15 minutes by default): start anew
    program, ops, clock = head_program()
    ops.health_ok = False
    program.start(clock.now)
    ops.links = {1: "10.0.0.1", 2: "10.0.0.2"}
    for _ in range(3):
        program.tick(clock.now)
        clock.advance(5)
    ops.links = {1: "10.0.0.1"}
    program.tick(clock.now)
    program.tick(clock.now)  # the confirming read
    assert program.state == BACKOFF and program.restarts == 0 and program.problem.startswith("lost rank 1")
    clock.advance(1)
    program.tick(clock.now)
    assert program.state == STARTING and len(ops.children) == 2


# -- issue 30: the rendezvous watch against strangers, big socket tables, and addresses written as names ---------

def running_head():
    program, ops, clock = head_program()
    program.start(clock.now)
    program.tick(clock.now)
    assert program.state == RUNNING
    return program, ops, clock


def probes(program, clock, n=1):
    """n liveness periods; each one's second tick is where a read that found a loss is confirmed."""
    for _ in range(n):
        clock.advance(5)
        program.tick(clock.now)
        program.tick(clock.now)


def test_a_connection_seen_by_one_read_only_is_not_a_rank():
    # a worker's liveness probe, or anyone's connect-and-close, between two reads of the table
    program, ops, clock = running_head()
    ops.links = {1: "10.0.0.1", 2: "10.0.0.2"}
    probes(program, clock, 2)
    ops.links = {1: "10.0.0.1", 2: "10.0.0.2", 3: "10.0.0.2"}
    probes(program, clock)
    ops.links = {1: "10.0.0.1", 2: "10.0.0.2"}
    probes(program, clock, 2)
    assert program.state == RUNNING


def test_a_stranger_connecting_as_a_rank_leaves_does_not_hide_the_loss():
    program, ops, clock = running_head()
    ops.links = {1: "10.0.0.1", 2: "10.0.0.2"}
    probes(program, clock, 2)
    ops.links = {1: "10.0.0.1", 3: "127.0.0.1"}  # rank 1 gone; a local process connected meanwhile: same count
    probes(program, clock)
    assert program.state == BACKOFF and program.problem.startswith("lost rank 1 (10.0.0.2):")


def test_a_lost_connection_is_named_by_its_address_not_taken_for_rank_1():
    program, ops, clock = running_head()
    ops.links = {1: "10.0.0.1", 2: "10.0.0.1", 3: "10.0.0.2"}  # a local process through the head's own address
    probes(program, clock, 2)
    ops.links = {1: "10.0.0.1", 3: "10.0.0.2"}
    probes(program, clock)
    assert program.state == BACKOFF and program.problem.startswith("lost a connection from 10.0.0.1:")
    assert "rank 1" not in program.problem


def test_restarts_for_lost_ranks_are_bounded_and_then_wait_long(caplog):
    from gpuwarden.serving.run.ranks import LOST_RANK_BACKOFF_S, LOST_RANK_LIMIT

    program, ops, clock = running_head()
    waits = []
    for i in range(LOST_RANK_LIMIT + 1):  # someone holds a connection for two reads, then closes it; again
        ops.links = {1: "10.0.0.1", 100 + i: "10.0.0.1"}
        probes(program, clock, 2)
        ops.links = {1: "10.0.0.1"}
        probes(program, clock)
        assert program.state == BACKOFF and program.restarts == 0
        waits.append(program.phase.retry_at - clock.now)
        clock.advance(waits[-1])
        program.tick(clock.now)
        program.tick(clock.now)
        assert program.state == RUNNING
    assert waits == [1.0] * LOST_RANK_LIMIT + [LOST_RANK_BACKOFF_S]
    assert f"{LOST_RANK_LIMIT + 1} such restarts within 10 minutes, so the next waits 300 s" in caplog.text


def test_a_socket_table_past_its_cap_gives_no_verdict_on_ranks_but_still_names_the_listener(tmp_path, monkeypatch):
    from gpuwarden.serving.run import ports

    header = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n"
    row = "   {n}: {local} {remote} {st} 00000000:00000000 00:00000000 00000000  {uid}        0 {inode} 1\n"
    port = 29511
    here, rank1 = f"0200007F:{port:04X}", "0300007F:A000"
    lines = [row.format(n=0, local=here, remote="00000000:0000", st="0A", uid=999, inode=10)]  # listeners first
    lines += [row.format(n=i, local="0100007F:1F90", remote=f"0100007F:{i + 2000:04X}", st="01", uid=0, inode=100 + i)
              for i in range(1, 40)]  # the API port's clients
    lines.append(row.format(n=40, local=here, remote=rank1, st="01", uid=999, inode=11))
    (tmp_path / "net").mkdir()
    (tmp_path / "net" / "tcp").write_text(header + "".join(lines))
    assert ports.peers(port, 999, proc=str(tmp_path)) == {11: "127.0.0.3"}
    monkeypatch.setattr(ports, "MAX_LINES", 20)
    assert ports.peers(port, 999, proc=str(tmp_path)) is None  # a partial table could hide the rank: no verdict
    assert ports.listening_sockets(port, proc=str(tmp_path)) == {10: 999}


def test_the_socket_table_is_read_off_the_loop_and_once_a_probe_period(tmp_path):
    import threading
    import time as wall

    from gpuwarden.base.background import Background

    program, ops, clock = head_program()
    calls, release, called = [], threading.Event(), threading.Event()

    def slow_peers(port, uid, accepted):  # /proc/net/tcp with 28,000 connections: seconds
        calls.append(threading.current_thread() is not threading.main_thread())  # off the loop: not the ticker's
        called.set()
        release.wait(60)
        return {1: "10.0.0.1", 2: "10.0.0.2"}

    ops.peers = slow_peers
    program._links_probe = Background("links", wall.monotonic)
    ops.health_ok = False
    program.start(clock.now)
    for _ in range(20):  # STARTING: 20 ticks of 0.25 s, one read started, none waited for (order, not seconds)
        program.tick(clock.now)
        clock.advance(0.25)
    assert called.wait(60)  # a bound on a hang: the read's thread began
    assert calls == [True]
    release.set()
    deadline = wall.monotonic() + 60  # a bound on a hang
    while program.problem is not None or program.state != STARTING:
        assert wall.monotonic() < deadline, program.problem
        wall.sleep(0.01)
        program.tick(clock.now)


@pytest.mark.process
def test_the_rendezvous_watch_reads_real_connections_and_ignores_a_process_that_connects_and_leaves():
    import dataclasses
    import subprocess
    import sys

    from gpuwarden.serving.run import ports

    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        port = listener.getsockname()[1]
        rank1 = socket.create_connection(("127.0.0.1", port))
        held, _ = listener.accept()
        found = ports.peers(port, os.geteuid())
        assert found == {os.fstat(held.fileno()).st_ino: "127.0.0.1"}
        assert ports.peers(port, os.geteuid(), accepted=False) == {os.fstat(rank1.fileno()).st_ino: "127.0.0.1"}

        program, ops, clock = head_program()
        program.spec = dataclasses.replace(program.spec, rendezvous=port)
        ops.peers = lambda port, uid, accepted: ports.peers(port, uid, accepted=accepted)
        program.start(clock.now)
        program.tick(clock.now)
        probes(program, clock, 2)
        # a stranger process (any uid: the accepted socket carries the listener's) connects and leaves
        stranger = subprocess.Popen([sys.executable, "-c", f"import socket,sys; s=socket.create_connection("
                                     f"('127.0.0.1',{port})); sys.stdout.write('on\\n'); sys.stdout.flush(); "
                                     f"sys.stdin.read()"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert stranger.stdout.readline() == "on\n"
        visitor, _ = listener.accept()
        probes(program, clock)
        stranger.stdin.close()
        stranger.wait(10)
        visitor.close()
        probes(program, clock, 2)
        assert program.state == RUNNING  # seen by one read only: not a rank
        held.close()
        rank1.close()
        probes(program, clock)
        assert program.state == BACKOFF and program.problem.startswith("lost a connection from 127.0.0.1")


def test_nodes_addresses_are_numeric_canonical_and_one_line_each_when_not():
    base = "serve:\n  model: /m\n  port: 8123\n  nodes:\n    count: 2\n"
    cfg = config.parse_text(base + "    hosts: ['FD00:0:0:0::1', '::ffff:10.0.0.2']\n    head: 'FD00::1'\n",
                            name="c.yaml")
    assert cfg.serve.nodes.hosts == ("fd00::1", "10.0.0.2") and cfg.serve.nodes.head == "fd00::1"
    long = "a" * 64 + ".example"
    for written, bad in (("node-b", "node-b"), ("'127.1'", "127.1"), (long, long), ('"10.0.0.2\\0"', "10.0.0.2\0"),
                         ('"10.0.0.1\\nforged"', "10.0.0.1\nforged"), ("''", "")):
        assert errors(base + f"    hosts: [10.0.0.1, {written}]\n") == [
            f"c.yaml:6: serve.nodes.hosts.1: not a numeric IP address: {bad!r} (the node's IP address, "
            "e.g. 10.0.0.2; a name is never looked up)"], bad
    assert errors(base + "    rank: 0\n    head: head.example\n") == [
        "c.yaml:7: serve.nodes.head: not a numeric IP address: 'head.example' (the node's IP address, e.g. "
        "10.0.0.2; a name is never looked up)"]
    for bad in ("0.0.0.0", "'::'", "224.0.0.1"):
        assert errors(base + f"    hosts: [10.0.0.1, {bad}]\n")[0].endswith(
            "is not one node's address (the address this node is reached at, e.g. 10.0.0.2)"), bad
    assert errors(base + "    rank: 0\n    hosts: [10.0.0.1, 10.0.0.1]\n") == [
        "c.yaml:7: serve.nodes.hosts.1: 10.0.0.1 is also entry 0 (one address per node)"]
    # the head's rendezvous listens on every address of its port: never serve.port (tests/test_config.py: every
    # listener against every other, while serving)
    assert errors(base.replace("model: /m", "enabled: true\n  model: /m") + "    rank: 0\n    head: 10.0.0.1\n"
                  "    port: 8123\n") == [
        "c.yaml:9: serve.nodes.port: *:8123 (the head's rendezvous, on every address) collides with serve.port "
        "127.0.0.1:8123 (the engine's API, on serve.host; c.yaml:4): two listeners cannot share one address and port "
        "(another port, or another address: 127.0.0.1 and 127.0.0.2 are two, 0.0.0.0 and :: are every address of "
        "the port)"]
    assert errors("serve:\n  enabled: true\n  model: /m\n  nodes:\n    rank: 0\n    head: 10.0.0.1\n"
                  "    port: 8000\n")[0].startswith(
        "c.yaml:7: serve.nodes.port: *:8000 (the head's rendezvous, on every address) collides with serve.port "
        "127.0.0.1:8000 (the engine's API, on serve.host; the default)")


def test_the_head_compares_the_kernels_addresses_with_canonical_hosts():
    cmd, cfg = command(0, extra="  liveness_interval_s: 5\n  liveness_failures: 2\n", hosts=True)
    cfg = config.parse_text("serve:\n  model: /m/Qwen3-4B\n  port: 8123\n  liveness_interval_s: 5\n  nodes:\n"
                            "    count: 2\n    hosts: ['FD00:0:0:0::1', 'FD00::2']\n    rank: 0\n    port: 29511\n",
                            name="c.yaml")
    cmd = build_command(cfg.serve, GENERIC, [sample()], {"PATH": "/bin"}, role=role_of(cfg))
    me = pwd.getpwuid(os.geteuid())
    spec = engine_spec(cfg.serve, cmd, Identity(me.pw_name, me.pw_uid, me.pw_gid, me.pw_dir, (), False), [FakeGpu()])
    clock = ManualClock(100)
    ops = PeerOps(clock)
    ops.links = {1: "fd00::1", 2: "fd00::2"}  # inet_ntop's text, as ports.peers gives it
    ops.peers = lambda port, uid, accepted: dict(ops.links)
    ops.health_ok = True
    program = Program(spec, ops, clock)
    program.start(clock.now)
    program.tick(clock.now)
    probes(program, clock, 2)
    ops.links = {1: "fd00::1"}
    probes(program, clock)
    assert program.state == BACKOFF and program.problem.startswith("lost rank 1 (fd00::2)")


def test_is_local_address_takes_no_name_and_no_garbage():
    from gpuwarden.serving.compose.nodes import is_local_address

    assert is_local_address("127.0.0.1") and not is_local_address("")
    assert not is_local_address("localhost") and not is_local_address("10.0.0.1\0")
    assert reachable("a" * 64 + ".example", 1) is not None  # UnicodeError: words, not a traceback


@pytest.mark.parametrize("head", ["a" * 64 + ".example", '"10.9.9.9\\0"', '"10.0.0.1\\nforged line"'])
def test_check_and_doctor_say_one_line_for_a_head_that_is_not_an_address(write, cli, head):
    path = serving_file(write, f"  nodes:\n    count: 2\n    rank: 1\n    head: {head}\n")
    for verb in ("check", "doctor"):
        status, out, err = cli(verb, "-c", path)
        assert status == 78, (verb, out, err)
        assert f"{path}:12: serve.nodes.head: not a numeric IP address" in err and "Traceback" not in err


def test_a_running_head_reads_the_socket_table_once_a_period_while_its_health_answer_is_pending():
    import threading
    import time as wall

    from gpuwarden.base.background import Background

    program, ops, clock = running_head()
    calls, release, called = [], threading.Event(), threading.Event()
    ops.peers = lambda port, uid, accepted: calls.append(port) or {1: "10.0.0.1"}
    program._probe = Background("health", wall.monotonic)  # /health slow to answer: the probe stays pending
    ops.health = lambda url: release.wait(10)
    for _ in range(20):  # 5 s of 0.25 s ticks from the probe on: one read
        program.tick(clock.now)
        clock.advance(0.25)
    release.set()
    assert len(calls) == 1, calls


@pytest.mark.process
@pytest.mark.skipif(os.geteuid() != 0, reason="a connection of another uid needs root to start a process as nobody")
def test_a_local_connection_of_another_user_is_no_rank_however_long_it_stays():
    import dataclasses
    import subprocess
    import sys

    from gpuwarden.serving.run import ports

    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        port = listener.getsockname()[1]
        program, ops, clock = head_program()
        program.spec = dataclasses.replace(program.spec, rendezvous=port)
        ops.peers = lambda port, uid, accepted: ports.peers(port, uid, accepted=accepted)
        program.start(clock.now)
        program.tick(clock.now)
        python = "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else sys.executable  # nobody may run it
        stranger = subprocess.Popen([python, "-c", f"import socket,sys; s=socket.create_connection("
                                     f"('127.0.0.1',{port})); sys.stdout.write('on\\n'); sys.stdout.flush(); "
                                     f"sys.stdin.read()"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                    cwd="/", user=65534, group=65534, extra_groups=[])
        assert stranger.stdout.readline() == "on\n"
        visitor, _ = listener.accept()  # as the engine's rendezvous would: the socket has our uid now
        assert ports.peers(port, os.geteuid()) == {}
        probes(program, clock, 3)
        stranger.stdin.close()
        stranger.wait(10)
        visitor.close()
        probes(program, clock, 2)
        assert program.state == RUNNING


# -- issue 30, second attack (helper-15 on 733b31b): the worker's watch, a start's short-lived rank, blind reads --

def worker_with_links(hosts=True):
    cmd, cfg = command(1, extra="  liveness_interval_s: 5\n  liveness_failures: 2\n  crash_loop_failures: 2\n",
                       hosts=hosts)
    me = pwd.getpwuid(os.geteuid())
    spec = engine_spec(cfg.serve, cmd, Identity(me.pw_name, me.pw_uid, me.pw_gid, me.pw_dir, (), False), [FakeGpu()])
    clock = ManualClock(100)
    ops = PeerOps(clock)
    ops.head_answers = True
    ops.links = {}
    ops.peers = lambda port, uid, accepted: dict(ops.links) if (port, accepted) == (29511, False) else {}
    program = Program(spec, ops, clock)
    program.start(clock.now)
    ops.links = {5: "10.0.0.1"}  # its vLLM's connection to the head's rendezvous
    probes(program, clock, 3)
    assert program.state == RUNNING
    return program, ops, clock


@pytest.mark.parametrize("hosts, other", [(True, "127.0.0.1"), (True, "10.0.0.2"), (False, "203.0.113.7")])
def test_a_worker_counts_only_its_connections_to_the_head(hosts, other):
    # another process of the serving user on the worker (a torchrun job on the default port 29500, a debugging
    # client) holds a connection to that port elsewhere, then closes it: the worker's part is not ended
    program, ops, clock = worker_with_links(hosts)
    ops.links = {5: "10.0.0.1", 6: other}
    probes(program, clock, 2)
    ops.links = {5: "10.0.0.1"}
    probes(program, clock, 2)
    assert program.state == RUNNING
    ops.links = {}  # its own connection to the head closed: that is the head lost
    probes(program, clock)
    assert program.state == BACKOFF and program.blocked and program.restarts == 0


def test_a_rank_that_joins_and_dies_seconds_later_while_the_head_starts_is_seen():
    # a worker whose vLLM joins the store and fails (NCCL init on a bad interface) ~3 s later: read every second
    # while the head starts, it is held, and its loss restarts the head's part instead of a wait until
    # startup_timeout_s
    program, ops, clock = head_program()
    ops.health_ok = False
    program.start(clock.now)
    program.tick(clock.now)
    ops.links = {1: "10.0.0.1", 2: "10.0.0.2"}
    for _ in range(3):
        clock.advance(1)
        program.tick(clock.now)
    ops.links = {1: "10.0.0.1"}
    for _ in range(2):  # the read that finds it gone, and the one that confirms it
        clock.advance(1)
        program.tick(clock.now)
    assert program.state == BACKOFF and program.problem.startswith("lost rank 1 (10.0.0.2)")


def test_a_connection_missing_from_one_read_only_ends_nothing():
    # /proc/net/tcp is written in chunks, and a line can be skipped when a neighbour in its hash bucket closes
    # between two: the loss must show in the next read too
    program, ops, clock = running_head()
    ops.links = {1: "10.0.0.1", 2: "10.0.0.2"}
    probes(program, clock, 2)
    ops.links = {1: "10.0.0.1"}
    clock.advance(5)
    program.tick(clock.now)
    ops.links = {1: "10.0.0.1", 2: "10.0.0.2"}  # back in the confirming read
    program.tick(clock.now)
    probes(program, clock, 3)
    assert program.state == RUNNING and len(ops.children) == 1  # the first part, never ended


def test_a_watch_that_cannot_read_the_tables_says_so_once_in_a_while(caplog):
    from gpuwarden.serving.run.ranks import BLIND_LOG_S

    program, ops, clock = running_head()
    ops.peers = lambda port, uid, accepted: None  # the tables past ports' caps: no verdict
    probes(program, clock, int(BLIND_LOG_S / 5) + 2)
    lines = [r.getMessage() for r in caplog.records if "cannot watch its rendezvous connections" in r.getMessage()]
    assert len(lines) == 2 and "a lost rank is not seen until they shrink" in lines[0]
    assert program.state == RUNNING


def test_lines_on_the_port_past_their_cap_give_no_verdict(tmp_path, monkeypatch):
    from gpuwarden.serving.run import ports

    header = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n"
    row = "   {n}: 0200007F:{port:04X} 0100007F:{peer:04X} 01 00000000:00000000 00:00000000 00000000  999  0 {n} 1\n"
    (tmp_path / "net").mkdir()
    (tmp_path / "net" / "tcp").write_text(header + "".join(row.format(n=i + 1, port=29511, peer=30000 + i)
                                                           for i in range(50)))
    assert len(ports.peers(29511, 999, proc=str(tmp_path))) == 50
    monkeypatch.setattr(ports, "MAX_PORT_LINES", 40)  # a local user's thousands of sockets on that port number
    assert ports.peers(29511, 999, proc=str(tmp_path)) is None


# -- issue 30, third look (helper-16 on af13180) ------------------------------------------------------------------

def test_two_reads_that_each_miss_another_connection_end_nothing():
    # the table skipped inode 2 in one read and inode 3 in the next: no connection was gone in both
    program, ops, clock = running_head()
    ops.links = {1: "10.0.0.1", 2: "10.0.0.2", 3: "10.0.0.2"}
    probes(program, clock, 2)
    ops.links = {1: "10.0.0.1", 3: "10.0.0.2"}
    clock.advance(5)
    program.tick(clock.now)
    ops.links = {1: "10.0.0.1", 2: "10.0.0.2"}
    program.tick(clock.now)
    assert program.state == RUNNING
    ops.links = {1: "10.0.0.1", 2: "10.0.0.2", 3: "10.0.0.2"}
    probes(program, clock, 2)
    assert program.state == RUNNING and len(ops.children) == 1
    ops.links = {1: "10.0.0.1", 2: "10.0.0.2"}  # inode 3 gone for good: two reads, and the part ends
    probes(program, clock)
    assert program.state == BACKOFF and program.problem.startswith("lost rank 1 (10.0.0.2)")


def test_an_ipv6_listener_is_found_however_many_ipv4_lines_mention_its_port(tmp_path):
    from gpuwarden.serving.run import ports

    header = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n"
    row = "   {n}: {local} {remote} {st} 00000000:00000000 00:00000000 00000000  {uid}  0 {inode} 1\n"
    port = 8123
    (tmp_path / "net").mkdir()
    # a local user's 10,001 connections to 127.0.0.1:PORT fill /proc/net/tcp with lines on the port
    (tmp_path / "net" / "tcp").write_text(header + "".join(
        row.format(n=i, local=f"0100007F:{30000 + i % 30000:04X}", remote=f"0100007F:{port:04X}", st="01",
                   uid=65534, inode=100 + i) for i in range(ports.MAX_PORT_LINES + 1)))
    (tmp_path / "net" / "tcp6").write_text(header + row.format(
        n=0, local=f"00000000000000000000000000000000:{port:04X}", remote="00000000000000000000000000000000:0000",
        st="0A", uid=999, inode=7))  # the engine on "::"
    assert ports.listening_sockets(port, proc=str(tmp_path)) == {7: 999}
    assert ports.peers(port, 999, proc=str(tmp_path)) is None  # no verdict on ranks past the cap


def test_a_scoped_address_is_refused_and_ipv6_is_written_as_the_kernel_writes_it():
    assert [e for e in errors("serve:\n  model: /m\n  nodes:\n    count: 2\n    rank: 1\n"
                              "    hosts: ['fe80::1%eth1', 'fe80::2%eth1']\n")
            if "a scoped address ('fe80::1%eth1') is not taken" in e]
    assert config.node_address("fe80::1%eth1") is None
    from gpuwarden.serving.run import ports
    assert config.node_address("::1.2.3.4") == ports._address("00000000000000000000000004030201") == "::1.2.3.4"
    assert config.node_address("FD00:0::2") == "fd00::2" and config.node_address("::ffff:10.0.0.2") == "10.0.0.2"


def test_a_head_outside_hosts_is_a_preflight_warning():
    from gpuwarden.serving.compose.nodes import preflight

    cfg = node_config("  nodes:\n    count: 2\n    head: 10.0.1.1\n    port: 29511\n    interface: lo\n"
                      "    hosts: [10.0.0.1, 10.0.0.2]\n    rank: 0\n")
    lines = preflight(role_of(cfg), {"NCCL_SOCKET_IFNAME": "lo", "GLOO_SOCKET_IFNAME": "lo"})
    assert [line for line in lines if line[0] == "warning" and "serve.nodes.head 10.0.1.1 is not in "
            "serve.nodes.hosts" in line[2]]
