"""Issue 35: a handover (SIGUSR2, as the package's upgrade sends it) must not be worse than staying.

The new image checks the config on disk at start and refuses it (exit 78) when lint finds an error, which
orphaned the engine for the unit's cleanup to kill. So the old image refuses the handover when the new one
would refuse the config, and a start that fails anyway with children to adopt leaves them to the next
daemon, never to cleanup's kill. Real processes: the daemon, the fake engine (tests/harness/fakechild.py) and
`gpuwarden cleanup` as the unit's ExecStopPost runs it.
"""

import os
import signal
import subprocess
import sys

import pytest

from conftest import gpuwarden_cmd
from gpuwarden.serving.run import handover
from test_adoption import env_with_state, running_pid
from test_faults import fake, fault_config, no_fakes_left, status, wait_until  # noqa: F401 (fixtures)


KEY_ON_COMMAND_LINE = "serve:\n  args: [--api-key, x]\n"  # lint api-key-on-command-line, an error


def parent_of(pid):
    with open(f"/proc/{pid}/stat", "rb") as f:
        return int(f.read().rsplit(b")", 1)[1].split()[1])


def cleanup(env, **result):
    """`gpuwarden cleanup` as ExecStopPost runs it, with systemd's word on how the daemon ended."""
    return subprocess.run([*gpuwarden_cmd(), "cleanup"], env=dict(env, **result), capture_output=True, text=True,
                          timeout=60)


@pytest.mark.process
def test_a_handover_the_new_image_would_refuse_is_refused_and_the_old_image_keeps_serving(
        write, fake, daemons, tmp_path, no_fakes_left):
    path, base, port = fault_config(write, fake, "healthy,chatty")
    env, folder = env_with_state(tmp_path)
    d = daemons(path, env=env)
    pid = running_pid(base)
    began = status(base)["daemon"]["started_at"]
    dropin = write("conf.d/key.yaml", KEY_ON_COMMAND_LINE)
    mark = len(d.lines)
    d.proc.send_signal(signal.SIGHUP)  # the reload refuses it (as it did before the fix)
    d.wait_for("reload failed, still running the previous config", after=mark, timeout=10)
    mark = len(d.lines)
    d.proc.send_signal(signal.SIGUSR2)
    line = d.wait_for("SIGUSR2: no handover", after=mark, timeout=10)
    assert "lint api-key-on-command-line" in line and "keeps running" in line
    # Its engine's next lines are still read by this image, which was not replaced: no exec came.
    d.wait_for("vllm: INFO fakechild tick", after=len(d.lines), timeout=10)
    after = "\n".join(d.lines[mark:])
    assert "handing over" not in after and "adopted after an upgrade" not in after
    assert d.proc.poll() is None
    assert status(base)["daemon"]["started_at"] == began, "the same image (a re-exec starts anew)"
    assert running_pid(base) == pid and parent_of(pid) == d.proc.pid, "the engine is still the daemon's child"
    fixed_on_disk_it_hands_over(d, dropin, base, pid)
    assert handover.start_ticks(pid) is None


def fixed_on_disk_it_hands_over(d, dropin, base, pid):
    """The drop-in that made the handover refused removed: the next SIGUSR2 hands over, the same engine adopted, and
    the daemon stops cleanly."""
    dropin.unlink()
    mark = len(d.lines)
    d.proc.send_signal(signal.SIGUSR2)
    d.wait_for("adopted after an upgrade (re-exec, same daemon pid)", after=mark, timeout=30)
    assert running_pid(base) == pid
    assert d.stop() == 0


@pytest.mark.process
def test_a_handover_to_a_metrics_address_the_new_image_cannot_listen_on_is_refused_and_the_engine_serves_on(
        write, fake, daemons, tmp_path, no_fakes_left):
    """The attacker's finding 3 of 2026-12-02: `check` took a metrics.listen that is no address of this host, the
    new image's start could not bind it and ended, and the engine and proxy served on unsupervised (under the unit,
    a restart every 5 s that failed the same way). A handover now tries the new address first (a SIGHUP keeps the
    running one: a restart-only setting)."""
    path, base, port = fault_config(write, fake, "healthy,chatty")
    env, folder = env_with_state(tmp_path)
    d = daemons(path, env=env)
    pid = running_pid(base)
    began = status(base)["daemon"]["started_at"]
    dropin = write("conf.d/metrics.yaml", "metrics:\n  listen: 192.0.2.1:9999\n")  # TEST-NET-1: not this host's
    mark = len(d.lines)
    d.proc.send_signal(signal.SIGUSR2)
    line = d.wait_for("SIGUSR2: no handover", after=mark, timeout=10)
    assert "metrics.listen: 192.0.2.1:9999 cannot be listened on here: Cannot assign requested address" in line, line
    assert "keeps running" in line and d.proc.poll() is None
    assert status(base)["daemon"]["started_at"] == began and running_pid(base) == pid
    fixed_on_disk_it_hands_over(d, dropin, base, pid)


@pytest.mark.process
@pytest.mark.parametrize("edit, said", [
    ("gpu:\n  scenario: dgx-sparkk\n", "gpu.scenario: no scenario named 'dgx-sparkk'"),
    ("gpu:\n  backend: nvml\n", "gpu.backend: nvml: the new image could not open it: NVML does not open in a new "
                               "process"),
])
def test_a_handover_to_a_gpu_backend_the_new_image_cannot_open_is_refused_and_the_engine_serves_on(
        write, fake, daemons, tmp_path, no_fakes_left, edit, said):
    """Attacker 6's finding 1: the new image opens the GPU backend the config on disk names before anything else
    (cli/run.py), and the handover's check did not: a scenario typo ended it with exit 78 (cleanup then killed the
    engine), NVML that cannot initialise in a new process (a driver's userspace upgraded beside its kernel module;
    here: no NVML at all) with 69, the engine unsupervised. Now the check opens it first, NVML in a new process."""
    path, base, port = fault_config(write, fake, "healthy,chatty")
    env, folder = env_with_state(tmp_path)
    d = daemons(path, env=env)
    pid = running_pid(base)
    began = status(base)["daemon"]["started_at"]
    dropin = write("conf.d/gpu.yaml", edit)
    mark = len(d.lines)
    d.proc.send_signal(signal.SIGUSR2)
    line = d.wait_for("SIGUSR2: no handover", after=mark, timeout=30)
    assert said in line and "keeps running" in line, line
    assert d.proc.poll() is None
    assert status(base)["daemon"]["started_at"] == began and running_pid(base) == pid
    fixed_on_disk_it_hands_over(d, dropin, base, pid)


@pytest.mark.process
def test_would_open_says_what_a_new_process_met_opening_nvml_in_one_line(tmp_path):
    """backends.would_open's probe, here a stand-in that fails as nvmlInit does after a driver's userspace upgrade:
    its last line, cut to 300 characters, and its exit status."""
    from gpuwarden import config
    from gpuwarden.backends import would_open
    from gpuwarden.gpu.errors import Unavailable

    cfg = config.parse_text("gpu:\n  backend: nvml\nmetrics:\n  listen: none\n")
    fails = [sys.executable, "-c", "print('noise'); print('Driver/library version mismatch' + 'x' * 400); "
                                   "raise SystemExit(1)"]
    with pytest.raises(Unavailable, match=r"NVML does not open in a new process: Driver/library version "
                                          r"mismatchx{269} \(exit status 1\)$"):
        would_open(cfg, probe=fails)
    would_open(cfg, probe=[sys.executable, "-c", "pass"])  # a probe that initialises: nothing raised


def test_bind_refusal_names_an_address_that_cannot_be_listened_on_and_passes_one_that_is_only_taken():
    import socket

    from gpuwarden.service.metrics_port import bind_refusal

    with socket.create_server(("127.0.0.1", 0)) as taken:
        assert bind_refusal("127.0.0.1", taken.getsockname()[1]) is None  # held by another: a start waits for it
    assert bind_refusal("192.0.2.1", 9999) == "Cannot assign requested address"


def test_a_name_with_only_ipv6_addresses_is_refused_as_the_new_image_would_fail_to_bind_it(monkeypatch):
    """Attacker 8's finding 2: the check resolved a name in any family and bound its first (IPv6) address, while the
    new image's server resolves a name as IPv4 only: the handover passed, and the new image ended at its start."""
    import socket

    from gpuwarden.service.metrics_port import bind_refusal
    from gpuwarden.web.server import family_of

    real = socket.getaddrinfo

    def resolve(host, port, family=0, kind=0, *rest):
        if host == "v6only.test":  # an AAAA record, no A record
            if family == socket.AF_INET:
                raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
            return [(socket.AF_INET6, socket.SOCK_STREAM, 6, "", ("::1", port, 0, 0))]
        return real(host, port, family, kind, *rest)

    monkeypatch.setattr(socket, "getaddrinfo", resolve)
    assert family_of("v6only.test") == socket.AF_INET and family_of("::1") == socket.AF_INET6
    assert bind_refusal("v6only.test", 9999) == "Name or service not known"


@pytest.mark.process
@pytest.mark.parametrize("how", ["crash", "handover"])
def test_a_start_that_fails_with_an_engine_to_adopt_leaves_it_serving_for_the_next_daemon(
        write, fake, daemons, tmp_path, no_fakes_left, how):
    """The new image refuses the config anyway (a new release's lint rule, an edit after the check): its
    engine keeps serving, cleanup keeps it, and a daemon started on the fixed config adopts it. "crash": a
    daemon killed, restarted on the bad config; "handover": the same start as the old image's re-exec makes
    it (the test plays the old image's part: the variable it leaves)."""
    path, base, port = fault_config(write, fake, "healthy")
    env, folder = env_with_state(tmp_path)
    first = daemons(path, env=env)
    pid = running_pid(base)
    first.proc.kill()  # the engine serves on, its record not "stopping"
    first.proc.wait(10)
    dropin = write("conf.d/key.yaml", KEY_ON_COMMAND_LINE)
    failing = daemons(path, env=dict(env, GPUWARDEN_HANDOVER="1") if how == "handover" else env)
    assert failing.proc.wait(60) == 78
    failing.stop()
    line = failing.wait_for("keeps serving unsupervised")
    assert f"vllm pid {pid}" in line and "the next daemon adopts" in line
    assert "lint api-key-on-command-line" in failing.log
    record = handover.load(folder)
    assert record.keep and not record.stopping and [c.pid for c in record.children] == [pid]
    # ExecStopPost after exit 78 (which the unit does not restart): the engine is kept.
    kept = cleanup(env, SERVICE_RESULT="exit-code", EXIT_STATUS="78")
    assert kept.returncode == 0 and "keeping 1 child(ren)" in kept.stdout, kept.stdout + kept.stderr
    assert handover.proven(record.children[0]) is None, "the engine still serves"
    # Fixed, the next daemon adopts it; a stop then ends it, and cleanup after that stop leaves nothing.
    dropin.unlink()
    second = daemons(path, env=env)
    second.wait_for("adopted after a restart of the daemon", timeout=30)
    assert running_pid(base) == pid
    assert not handover.load(folder).keep
    assert second.stop() == 0
    assert handover.start_ticks(pid) is None
    assert cleanup(env, SERVICE_RESULT="success", EXIT_STATUS="0").returncode == 0


@pytest.mark.process
def test_cleanup_keeps_what_a_failed_start_left_and_ends_what_a_stop_left(tmp_path):
    env, folder = env_with_state(tmp_path)
    argv = [sys.executable, "-c", "import time; time.sleep(60)"]
    child = subprocess.Popen(argv, start_new_session=True)
    try:
        wait_until(lambda: handover.cmdline_digest(child.pid) == handover.argv_digest(argv), timeout=10)
        entry = handover.Recorded("vllm", child.pid, handover.start_ticks(child.pid), os.geteuid(),
                                  handover.argv_digest(argv))
        handover.save(folder, handover.Record((entry,), keep=True))
        assert handover.load(folder).keep
        kept = cleanup(env, SERVICE_RESULT="exit-code", EXIT_STATUS="78")
        assert kept.returncode == 0 and "keeping 1 child(ren)" in kept.stdout
        assert child.poll() is None
        # A stop (the record says "stopping") ends it, whatever an older mark said.
        handover.save(folder, handover.Record((entry,), stopping=True, keep=True))
        assert cleanup(env, SERVICE_RESULT="success", EXIT_STATUS="0").returncode == 0
        assert child.wait(10) == -signal.SIGKILL
        assert handover.load(folder) is None
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


def test_more_sigusr2_in_one_wake_up_hand_over_once(caplog):
    """Two SIGUSR2 read in one wake-up of the loop (a postinst and an operator): one handover, said once."""
    from gpuwarden import config
    from gpuwarden.base import earlysignals
    from gpuwarden.backends import open_configured
    from gpuwarden.service.daemon import Daemon

    cfg = config.parse_text("gpu:\n  backend: sim\n  scenario: dgx-spark\nmetrics:\n  listen: none\n"
                            "tuning:\n  apply: false\n")
    daemon = Daemon(cfg, open_configured(cfg), reload=lambda: cfg)
    try:
        with caplog.at_level("INFO", logger="gpuwarden"):
            daemon.changes.handle_usr2()
            daemon.changes.handle_usr2()
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, earlysignals.SIGNALS)  # handle_usr2 blocked them for the exec
        daemon.backend.close()
    assert daemon.changes.handing_over
    assert sum("handing over" in r.getMessage() for r in caplog.records) == 1


SENT_BEFORE_THE_EXEC = """
import logging, os, signal
from gpuwarden.base import earlysignals
logging.basicConfig(level=logging.INFO)
signal.pthread_sigmask(signal.SIG_BLOCK, earlysignals.SIGNALS)  # as the old image left them for execv
os.kill(os.getpid(), signal.SIGUSR2)  # a second SIGUSR2, pending across the exec
os.kill(os.getpid(), signal.SIGHUP)
earlysignals.hold()
from gpuwarden.service.daemon import SignalWaker
waker = SignalWaker()
print(sorted(signal.Signals(s).name for s in waker.wait(0)))
"""


@pytest.mark.process
@pytest.mark.parametrize("handover_env", [True, False])
def test_a_sigusr2_sent_before_the_exec_is_not_a_second_handover(handover_env):
    """The new image gets the SIGUSR2s that waited (blocked) across the exec: those asked for the code it runs.
    Other held signals (a reload) still come; a process that is no handover's image drops nothing."""
    env = dict(os.environ, GPUWARDEN_HANDOVER="1") if handover_env else \
        {k: v for k, v in os.environ.items() if k != "GPUWARDEN_HANDOVER"}
    out = subprocess.run([sys.executable, "-c", SENT_BEFORE_THE_EXEC], env=env, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == ("['SIGHUP']" if handover_env else "['SIGHUP', 'SIGUSR2']")
    assert ("already handed over" in out.stderr) == handover_env


@pytest.mark.process
def test_a_new_image_whose_loader_refuses_the_config_leaves_the_engine_serving(
        write, fake, daemons, tmp_path, no_fakes_left):
    """The old image checked the config with its own loader; the new release's loader may refuse it (a key it
    dropped or reads otherwise) before the daemon exists: exit 78 all the same, and cleanup must keep the engine."""
    path, base, port = fault_config(write, fake, "healthy")
    env, folder = env_with_state(tmp_path)
    first = daemons(path, env=env)
    pid = running_pid(base)
    first.proc.kill()
    first.proc.wait(10)
    dropin = write("conf.d/unknown.yaml", "serve:\n  no_such_key_in_this_release: 1\n")
    failing = daemons(path, env=dict(env, GPUWARDEN_HANDOVER="1"))
    assert failing.proc.wait(60) == 78
    failing.stop()
    assert "no_such_key_in_this_release" in failing.log
    assert f"vllm pid {pid}" in failing.wait_for("keeps serving unsupervised")
    assert handover.load(folder).keep
    kept = cleanup(env, SERVICE_RESULT="exit-code", EXIT_STATUS="78")
    assert kept.returncode == 0 and "keeping 1 child(ren)" in kept.stdout, kept.stdout + kept.stderr
    dropin.unlink()
    second = daemons(path, env=env)
    second.wait_for("adopted after a restart of the daemon", timeout=30)
    assert running_pid(base) == pid
    assert second.stop() == 0
