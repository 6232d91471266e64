"""A reload after an in-place engine upgrade: the daemon reads the installed version again (off its loop) and
restarts the engine on it, so that gpuwarden_serving_info's version is the one the running engine runs
(ServingEngineVersionsDiffer's fix). With real processes: the daemon, the fake child, and an interpreter whose
site folder holds a vllm dist-info that the installed-versions probe reads.
"""

import os
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path

import pytest

from conftest import subprocess_env
from gpuwarden.serving.compose.identity import Identity
from gpuwarden.serving.run.processes import ProcessOps
from test_faults import fake, no_fakes_left  # noqa: F401 (fixtures)
from test_faults import FLAGCHECK, assert_polls_go_on, fault_config, metrics, own_log, status, wait_until

pytestmark = pytest.mark.process

# The engine's interpreter. For the installed-versions probe: Debian's python3 with site/ first on its path (SLOW
# seconds late, ANSWER replaced by a failure where asked); for the flag check: an answer that accepts every flag.
PYTHON = """#!/bin/sh
case "$2" in
*GPUWARDEN-INSTALLED*) {answer} ;;
esac
echo 'GPUWARDEN-FLAGCHECK {{"ok": true, "error": null, "version": "0.32.0"}}'
"""


@pytest.fixture
def venv():
    """A tiny engine environment serve.user can read (it cannot enter /root, nor pytest's tmp_path)."""
    folder = Path(tempfile.mkdtemp(prefix="gpuwarden-venv-"))
    folder.chmod(0o755)
    (folder / "site").mkdir(mode=0o755)
    env = _Env(folder)
    env.install("0.32.0")
    env.interpreter()
    yield env
    shutil.rmtree(folder, ignore_errors=True)


class _Env:
    def __init__(self, folder):
        self.folder, self.python = folder, folder / "python"

    def install(self, version):
        """As pip does: the old dist-info out, the new one in (the site folder's mtime changes with it)."""
        for old in (self.folder / "site").glob("vllm-*.dist-info"):
            shutil.rmtree(old)
        info = self.folder / "site" / f"vllm-{version}.dist-info"
        info.mkdir(mode=0o755)
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n")
        (info / "METADATA").chmod(0o644)

    def interpreter(self, answer=None, slow_s=0):
        answer = answer or f'PYTHONPATH={self.folder}/site exec /usr/bin/python3 "$@"'
        self.python.write_text(PYTHON.format(answer=f"sleep {slow_s}; {answer}" if slow_s else answer))
        self.python.chmod(0o755)


def _info(base):
    return next(line for line in metrics(base).splitlines() if line.startswith("gpuwarden_serving_info{"))


def _running_anew(base, first):
    """The serving section once it shows a RUNNING engine other than pid first, else None."""
    serving = status(base)["serving"]
    return serving if serving["state"] == "RUNNING" and serving["pid"] != first else None


def _serving(write, fake, daemons, venv, tmp_path):
    """A daemon serving the fake engine with venv's interpreter, healthy: (daemon, config path, metrics base)."""
    path, base, _ = fault_config(write, fake, "healthy")
    path.write_text(path.read_text().replace(f"python: {FLAGCHECK}", f"python: {venv.python}"))
    state = tmp_path / "state"
    state.mkdir()
    d = daemons(path, env={**subprocess_env(), "STATE_DIRECTORY": str(state)})
    d.wait_for("vLLM healthy after", timeout=120)
    return d, path, base


def _mark(d):
    return len(d.lines)


def test_a_reload_after_an_in_place_upgrade_restarts_the_engine_on_the_installed_version(write, fake, daemons, venv,
                                                                                         tmp_path, no_fakes_left):
    d, path, base = _serving(write, fake, daemons, venv, tmp_path)
    first = status(base)["serving"]["pid"]
    assert 'version="0.32.0"' in _info(base)

    # Nothing changed: a reload restarts nothing (and reads nothing: the cache is fresh).
    mark = _mark(d)
    d.proc.send_signal(signal.SIGHUP)
    d.wait_for("config reloaded", after=mark)
    assert status(base)["serving"]["pid"] == first and "vLLM stopping" not in d.log

    # The read fails (its interpreter changed, and answers nothing now): the version is unknown, which never
    # restarts the engine by itself; the label stays what the running engine runs.
    venv.interpreter(answer="exit 3")
    mark = _mark(d)
    d.proc.send_signal(signal.SIGHUP)
    line = d.wait_for("reload: installed versions unknown", after=mark)
    assert line.endswith(f"WARNING reload: installed versions unknown: {venv.python} failed to answer: exit status 3; "
                         "the engine's version is not compared"), line
    d.wait_for("config reloaded", after=mark)
    assert status(base)["serving"]["pid"] == first and "vLLM stopping" not in d.log
    assert 'version="0.32.0"' in _info(base)

    # An in-place upgrade, then SIGHUP: the installed version is read again (slowly, off the loop: the polls keep
    # their schedule), and the engine restarts on it.
    venv.interpreter(slow_s=6)
    venv.install("0.32.1")
    mark = _mark(d)
    d.proc.send_signal(signal.SIGHUP)
    assert_polls_go_on(base, 16)
    line = d.wait_for("is installed, the engine runs", after=mark, timeout=20)
    assert line.endswith("WARNING reload: vLLM 0.32.1 is installed, the engine runs 0.32.0: restarting it on the "
                         "installed version"), line
    stopped = d.wait_for("vLLM stopped after", after=mark, timeout=10)
    d.wait_for("vLLM healthy after", after=d.lines.index(stopped), timeout=120)
    # The log line comes as the state changes; /status and /metrics show it from the next published poll.
    wait_until(lambda: _running_anew(base, first), timeout=10)
    wait_until(lambda: 'version="0.32.1"' in _info(base), timeout=10)
    assert d.log.count("is installed, the engine runs") == 1
    assert d.stop() == 0 and "Traceback" not in own_log(d)


def test_a_helper_started_from_a_worker_thread_is_not_taken_for_an_escaped_process(tmp_path):
    """The reload's read runs its probe as the daemon's own child while the loop may look for processes that left
    an engine's group (a start's preflight, a stop's end): the probe must not be SIGKILLed as one of them."""
    me = Identity("me", os.geteuid(), os.getegid(), str(tmp_path), (), switch=False)
    ops = ProcessOps()
    helper = ops.helper(me, ["sleep", "30"], {"PATH": os.defpath})
    stranger = subprocess.Popen(["sleep", "30"])  # a child of ours nobody registered: what escaped() must find
    try:
        found = ops.escaped()
        assert stranger.pid in found and helper.pid not in found
    finally:
        for process in (helper, stranger):
            process.kill()
            process.wait()


def test_a_reload_that_turns_serving_off_stops_the_engine(write, fake, daemons, venv, tmp_path, no_fakes_left):
    """The version check of a reload reads only a config that still serves: `serve.enabled: false` stops the
    engine as before (a slip in the version change once left it running)."""
    d, path, base = _serving(write, fake, daemons, venv, tmp_path)
    pid = status(base)["serving"]["pid"]
    path.write_text(path.read_text().replace("  enabled: true\n", "  enabled: false\n", 1))
    mark = _mark(d)
    d.proc.send_signal(signal.SIGHUP)
    d.wait_for("vLLM stopped after", after=mark, timeout=20)
    d.wait_for("config reloaded", after=mark)
    assert not Path(f"/proc/{pid}").exists() or Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
    assert d.stop() == 0 and "Traceback" not in own_log(d)
