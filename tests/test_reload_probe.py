"""The reload's read of the installed versions, attacked as serve.user would: its venv's interpreter (or a .pth it
runs at start) hangs, forks what outlives it, or prints a forged answer. The daemon runs as the unit runs it (root
under the unit's capabilities only), the probe as the child user."""

import json
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest
from conftest import DaemonProcess, gpuwarden_cmd, subprocess_env
from test_faults import (  # noqa: F401 (fixtures)
    FLAGCHECK,
    fake,
    fault_config,
    metrics,
    no_fakes_left,
    status,
    wait_until,
)
from test_reload_version import venv  # noqa: F401 (fixture)

pytestmark = pytest.mark.process

UNIT_CAPS = ["setpriv", "--bounding-set", "-all,+sys_admin,+setuid,+setgid,+kill", "--no-new-privs"]


class UnitDaemon(DaemonProcess):
    """`gpuwarden run` as root under the unit's capabilities only."""

    def __init__(self, config_path, env):
        self.lines = []
        self.proc = subprocess.Popen([*UNIT_CAPS, *gpuwarden_cmd(), "run", "-c", str(config_path)],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()


def tagged(token):
    """Live (non-zombie) processes whose command line holds token: what the probe left, found by a name only this
    test uses."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            argv = cmdline.read_bytes()
            state = Path(cmdline.parent, "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if token.encode() in argv and state != "Z":
            found.append(int(cmdline.parent.name))
    return found


@pytest.fixture
def token():
    """A name for the probe's processes; any the test leaves are killed (by PID) and fail it."""
    name = f"gpuwarden-probe-{os.getpid()}-{time.monotonic_ns()}"
    yield name
    left = tagged(name)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left, f"the probe's processes outlived the test: {left}"


@pytest.fixture
def unit_daemon(write, fake, venv, tmp_path):
    if os.geteuid() != 0:
        pytest.skip("needs root (the daemon switches to the child user)")
    started = []

    def start(extra=""):
        path, base, _ = fault_config(write, fake, "healthy", extra=extra)
        path.write_text(path.read_text().replace(f"python: {FLAGCHECK}", f"python: {venv.python}"))
        state = tmp_path / "state"
        state.mkdir(exist_ok=True)
        d = UnitDaemon(path, env={**subprocess_env(), "STATE_DIRECTORY": str(state)})
        started.append(d)
        d.wait_for("vLLM healthy after", timeout=120)
        return d, base

    yield start
    for d in started:
        d.end()


def test_a_probe_that_hangs_does_not_outlive_the_daemons_stop(unit_daemon, venv, token, no_fakes_left):
    d, _ = unit_daemon()
    # serve.user's interpreter hangs on the probe, deaf to SIGTERM
    venv.interpreter(answer=f"trap '' TERM; exec /bin/sh -c 'sleep 1000; : {token}'")
    venv.install("0.32.1")
    d.proc.send_signal(signal.SIGHUP)
    wait_until(lambda: tagged(token), timeout=60)
    assert d.stop() == 0
    left = tagged(token)
    assert not left, f"the probe outlived the daemon: {left}"


def test_a_tree_the_probe_forks_off_does_not_outlive_the_daemons_stop(unit_daemon, venv, token, no_fakes_left):
    d, _ = unit_daemon()
    # a sleeper in its own session with a child of its own: killing the sleeper alone re-parents the child to us
    venv.interpreter(answer=f"setsid /bin/sh -c '/bin/sh -c \"sleep 1000; : {token}\"; : {token}' "
                            f'</dev/null >/dev/null 2>&1 & PYTHONPATH={venv.folder}/site exec /usr/bin/python3 "$@"')
    venv.install("0.32.0")
    mark = len(d.lines)
    d.proc.send_signal(signal.SIGHUP)
    d.wait_for("config reloaded", after=mark, timeout=120)
    wait_until(lambda: len(tagged(token)) == 2, timeout=60)
    assert d.stop() == 0
    left = tagged(token)
    assert not left, f"the probe's tree outlived the daemon: {left}"


FORGED = "0.32.1\x1b[2J\r\n<0>gpuwarden: forged\" } 1\n" + "9" * 200_000


def test_a_forged_version_is_no_answer(unit_daemon, venv, token, no_fakes_left):
    """serve.user's interpreter answers a version with control characters, a forged record and 200 kB: no answer,
    so the engine keeps running (an unknown version restarts nothing), one short line says why, and neither a log
    line nor gpuwarden_serving_info's label carries it."""
    d, base = unit_daemon()
    first = status(base)["serving"]["pid"]
    answer = venv.folder / "answer"
    answer.write_text("GPUWARDEN-INSTALLED " + json.dumps({
        "versions": {"vllm": FORGED, "torch": None, "flashinfer": None, "sglang": None}, "torch_cuda": None,
        "env_names": None, "dirs": [], "toolkit": None}) + "\n")
    answer.chmod(0o644)
    venv.interpreter(answer=f"exec cat {answer}")
    venv.install("0.32.1")  # the site folder changed: the cache is stale, the reload asks
    mark = len(d.lines)
    d.proc.send_signal(signal.SIGHUP)
    d.wait_for("config reloaded", after=mark, timeout=120)
    assert any(line.endswith(f"WARNING reload: installed versions unknown: {venv.python} answered nonsense (a "
                             "version that is not one); the engine's version is not compared")
               for line in d.lines[mark:]), d.lines[mark:]
    assert max(len(line) for line in d.lines[mark:]) < 4096
    assert status(base)["serving"]["pid"] == first
    info = next(line for line in metrics(base).splitlines() if line.startswith("gpuwarden_serving_info{"))
    assert 'version="0.32.0"' in info, info[:300]
    assert d.stop() == 0
