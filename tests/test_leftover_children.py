"""A child the daemon before this one recorded, which this daemon's config no longer names (the proxy turned
off between a crash and the restart, any side child), is stopped at the start: SIGTERM to its group, SIGKILL
after the grace, one line in the log, and it stays in children.json until it is gone. A process that is not
provably the recorded one is never touched. Real processes: the daemon, the fake engine (tests/harness/fakechild.py),
the real proxy, and a stand-in side child that ignores SIGTERM."""

import os
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from conftest import free_port
from gpuwarden.serving.run import handover
from test_adoption import env_with_state, running_pid
from test_faults import POLL, fake, fault_config, no_fakes_left, wait_until  # noqa: F401 (fixtures)

pytestmark = pytest.mark.process


def start_recordable(argv, **kwargs):
    """A process in its own session (as the daemon starts its children) and its record entry, once it runs
    argv (exec'd: /proc shows the command line the record proves)."""
    proc = subprocess.Popen(argv, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            **kwargs)
    wait_until(lambda: handover.cmdline_digest(proc.pid) == handover.argv_digest(argv), timeout=10)
    return proc, handover.start_ticks(proc.pid)


def answers(url):
    try:
        with urllib.request.urlopen(url, timeout=2) as reply:
            return reply.status
    except OSError:
        return None


def groups_alive(pgids):
    """Those of the process groups that still have a live (not zombie) process: a child whose daemon died is
    re-parented to a PID 1 that may never reap it."""
    alive = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_bytes().rsplit(b")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != b"Z" and int(fields[2]) in pgids:
            alive.add(int(fields[2]))
    return alive


def test_a_recorded_child_the_new_config_does_not_name_is_stopped_and_nothing_is_left(write, fake, daemons,
                                                                                     tmp_path, no_fakes_left):
    proxy_port = free_port()
    # a grace of 10 s: the test looks at the side child within it (2 s was a race a busy box could lose)
    path, base, port = fault_config(write, fake, "healthy", serve_extra="  stop_timeout_s: 10\n",
                                    extra="  proxy:\n    enabled: false\n")
    env, folder = env_with_state(tmp_path)
    first = daemons(path, env=env)
    engine = running_pid(base)
    first.proc.kill()  # the crash: no stop, no cleanup
    first.proc.wait(10)
    # What the first daemon ran beside its engine when serve.proxy was on (written here into its record: the
    # proxy's interpreter is not one every test host lets the child user run): the real proxy, and a side child
    # that ignores SIGTERM. And a look-alike: recorded with another start time, a recycled PID, never touched.
    proxy_argv = [sys.executable, "-m", "gpuwarden", "proxy", "-c", "none", "--upstream", f"http://127.0.0.1:{port}",
                  "--listen", f"127.0.0.1:{proxy_port}"]
    proxy, proxy_ticks = start_recordable(proxy_argv, env=env)
    stubborn_argv = [fake["python"], str(fake["script"]), "--mode", "ignore-term", "--port", str(free_port())]
    stubborn, stubborn_ticks = start_recordable(stubborn_argv)
    look_argv = [fake["python"], str(fake["script"]), "--mode", "noaccept", "--port", str(free_port())]
    look_alike, look_ticks = start_recordable(look_argv)
    try:
        wait_until(lambda: answers(f"http://127.0.0.1:{proxy_port}/health") == 200, timeout=120)
        me = os.geteuid()
        left = handover.load(folder)
        handover.save(folder, handover.Record((
            *left.children,
            handover.Recorded("proxy", proxy.pid, proxy_ticks, me, handover.argv_digest(proxy_argv)),
            handover.Recorded("side", stubborn.pid, stubborn_ticks, me, handover.argv_digest(stubborn_argv)),
            handover.Recorded("old", look_alike.pid, look_ticks - 1, me, handover.argv_digest(look_argv)))))

        second = daemons(path, env=env)
        assert f"pid {engine}, up " in second.wait_for("vLLM adopted after a restart of the daemon", timeout=30)
        line = second.wait_for(f"proxy pid {proxy.pid}: recorded by the daemon before, not in this config",
                               timeout=30)
        assert "SIGTERM" in line
        assert proxy.wait(60) == 0, "the proxy ended on SIGTERM, within the grace"
        assert answers(f"http://127.0.0.1:{proxy_port}/health") is None
        second.wait_for(f"side pid {stubborn.pid}: recorded by the daemon before, not in this config")
        # Until it is gone it stays in the record (a crash now still knows it); it ignores SIGTERM, so it is
        # there for the grace.
        wait_until(lambda: "side" in [c.name for c in handover.load(folder).children], timeout=5)
        assert stubborn.poll() is None
        assert stubborn.wait(60) == -signal.SIGKILL, "SIGKILL once the grace (stop_timeout_s: 10) passed"
        wait_until(lambda: [c.name for c in handover.load(folder).children] == ["vllm"], timeout=10)
        assert running_pid(base) == engine
        assert look_alike.poll() is None, "a process not provably the recorded one is left alone"
        assert f"old pid {look_alike.pid}: recorded" not in second.log

        assert second.stop() == 0
        cleanup = subprocess.run([sys.executable, "-m", "gpuwarden", "cleanup"],
                                 env=dict(env, SERVICE_RESULT="success"), capture_output=True, text=True, timeout=60)
        assert cleanup.returncode == 0, cleanup.stderr
        assert groups_alive({engine, proxy.pid, stubborn.pid}) == set()
    finally:
        for proc in (proxy, stubborn, look_alike):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def test_with_serving_off_a_recorded_child_is_stopped_gracefully(write, daemons, tmp_path):
    """serve.enabled turned off between a crash and the restart: the recorded proxy gets SIGTERM and its grace,
    as a stop gives it, not an instant SIGKILL; the record is empty once it has gone."""
    proxy_port = free_port()
    path = write("gpuwarden.yaml", f"""poll_interval_s: {POLL}
metrics:
  listen: 127.0.0.1:{free_port()}
gpu:
  backend: sim
  scenario: dgx-spark
serve:
  enabled: false
  stop_timeout_s: 20
""")
    env, folder = env_with_state(tmp_path)
    argv = [sys.executable, "-m", "gpuwarden", "proxy", "-c", "none", "--upstream", "http://127.0.0.1:1",
            "--listen", f"127.0.0.1:{proxy_port}"]
    proxy, ticks = start_recordable(argv, env=env)
    try:
        wait_until(lambda: answers(f"http://127.0.0.1:{proxy_port}/health") == 200, timeout=120)
        handover.save(folder, handover.Record((handover.Recorded("proxy", proxy.pid, ticks, os.geteuid(),
                                                                 handover.argv_digest(argv)),)))
        d = daemons(path, env=env)
        d.wait_for(f"proxy pid {proxy.pid}: recorded by the daemon before, serving is off in this config: "
                   "stopping it (SIGTERM to its process group, SIGKILL after 20 s)", timeout=30)
        assert proxy.wait(60) == 0, "its own SIGTERM handling ended it, not a SIGKILL"
        wait_until(lambda: handover.load(folder).children == (), timeout=10)
        assert d.stop() == 0
    finally:
        if proxy.poll() is None:
            os.killpg(proxy.pid, signal.SIGKILL)
            proxy.wait()


def test_with_serving_off_and_nothing_recorded_no_record_is_written(write, daemons, tmp_path):
    """Nothing ran and nothing was recorded: the start writes no children.json (it wrote an empty one, every
    start); a record left on disk is still rewritten (the test above)."""
    path = write("gpuwarden.yaml", f"poll_interval_s: {POLL}\nmetrics:\n  listen: 127.0.0.1:{free_port()}\n"
                 "gpu:\n  backend: sim\n  scenario: dgx-spark\nserve:\n  enabled: false\n")
    env, folder = env_with_state(tmp_path)
    d = daemons(path, env=env)
    d.wait_for("serving /metrics and /status on", timeout=30)
    assert d.stop() == 0  # signals wait until the start is over: it has run stop_unnamed by now
    assert not (folder / handover.RECORD).exists(), (folder / handover.RECORD).read_text()
