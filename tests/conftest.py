import contextlib
import fcntl
import json
import os
import pwd
import shutil
import signal
import subprocess
import sys
import tempfile
import types
from pathlib import Path

import pytest

from harness import engines, tiers
from harness.budget import Budget, tag
from harness.ports import free_port  # noqa: F401 (the tests import it from here)
from harness.workers import make_scheduler, spread

# A test run started in the background of a non-interactive shell (`cmd &`, as a CI runner or a script may) has
# SIGINT ignored, and every child inherits the ignore across exec: bench and tune then never see the Ctrl-C the
# tests send them and the tests time out (seen on a fresh-clone run started so). A handler, unlike SIG_IGN, is
# reset to the default at exec: the children start as they would from a terminal.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CONFIG = ROOT / "etc" / "gpuwarden" / "gpuwarden.yaml"
CPU_TINY_PROFILE = ROOT / "tests" / "vllm" / "cpu-tiny.yaml"
# CPU features that decide which kernels vLLM's CPU build runs (a missing one means SIGILL, exit -4).
CPU_FLAGS_THAT_MATTER = ("avx2", "avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_fp16", "avx512_vnni",
                         "amx_tile", "amx_bf16", "amx_int8")


def cpu_report() -> str:
    """The CPU, the flags that matter to vLLM's kernels, and what torch in vLLM's venv makes of them."""
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    model = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")), "?")
    flags = set(next((line.split(":", 1)[1].split() for line in info.splitlines() if line.startswith("flags")), []))
    have = [f for f in CPU_FLAGS_THAT_MATTER if f in flags]
    lacks = [f for f in CPU_FLAGS_THAT_MATTER if f not in flags]
    torch_view = "vLLM's venv not found"
    python = VENV / "bin" / "python"
    if python.exists():
        probe = subprocess.run([str(python), "-c", "import torch; print('capability', "
                                "torch.backends.cpu.get_cpu_capability(), 'amx_tile', "
                                "torch.cpu._is_amx_tile_supported())"], capture_output=True, text=True, timeout=120)
        torch_view = (probe.stdout or probe.stderr).strip().splitlines()[-1] if (probe.stdout or probe.stderr) else "?"
    return (f"CPU: {model}; {os.cpu_count()} cores\n  has: {' '.join(have) or 'none'}\n"
            f"  lacks: {' '.join(lacks) or 'none'}\n  torch in vLLM's venv: {torch_view}")


BUDGET = Budget()


def pytest_configure(config):
    tiers.configure(config)


def pytest_sessionstart(session):
    add_child_user()  # before any test: see add_child_user


def pytest_collection_modifyitems(items):
    tiers.collection_modifyitems(items)
    tag(items, tiers.tier_of)
    spread(items)


@pytest.hookimpl(hookwrapper=True)
def pytest_fixture_setup(fixturedef):
    yield from tiers.fixture_setup(fixturedef)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item):
    yield from tiers.runtest_protocol(item)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    yield from tiers.runtest_teardown(nextitem)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    tiers.note_failure(item, call, report)
    tiers.makereport(item, call, report)


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook: only called where xdist runs the tests
def pytest_xdist_make_scheduler(config, log):
    return make_scheduler(config, log)


def pytest_runtest_logreport(report):
    BUDGET.add(report)


@pytest.hookimpl(tryfirst=True)
def pytest_sessionfinish(session):
    """The real tier past its budget of engine starts fails the run (tests/harness/budget.py)."""
    if BUDGET.over_budget() and session.exitstatus == 0:
        session.exitstatus = 1


def pytest_terminal_summary(terminalreporter):
    """The seconds per tier and test file, the real engines started, the real tier's budget
    (tests/harness/budget.py); and when a real-vLLM test failed, which CPU it ran on."""
    if lines := BUDGET.lines():
        terminalreporter.section("time per tier and test file, and the real engines started")
        for line in lines:
            terminalreporter.write_line(line)
    if over := BUDGET.over_budget():
        terminalreporter.section("the real tier is over its budget")
        for line in over:
            terminalreporter.write_line(line, red=True)
    _cpu_when_vllm_failed(terminalreporter)


def _cpu_when_vllm_failed(terminalreporter):
    """When a real-vLLM test failed, say which CPU it ran on: a worker that dies with SIGILL is a kernel
    this CPU (or its hypervisor) does not support."""
    failed = [r for r in terminalreporter.stats.get("failed", []) + terminalreporter.stats.get("error", [])
              if "vllm" in getattr(r, "keywords", {})]
    if failed:
        terminalreporter.section("CPU of this run (a vLLM test failed)")
        terminalreporter.write_line(cpu_report())


@pytest.fixture(autouse=True)
def _no_probe_remembered_across_tests(tmp_path, monkeypatch):
    """The installed-versions probe is remembered per interpreter for the life of a process, and in a file under the
    state directory (compose/installed.py): each test starts without either, so a test starts the same processes
    whichever tests ran before it, on its worker or on this machine (the tier check counts them:
    tests/harness/tiers.py). An in-process command's state directory is the test's own; a daemon the test starts
    keeps the one its environment names."""
    from gpuwarden.serving.compose import installed, prepare

    installed._memory.clear()
    monkeypatch.setattr(prepare, "state_dir", lambda: tmp_path / "probe-state")
    yield


@pytest.fixture
def write(tmp_path):
    """Write a file under tmp_path and return its path."""

    def _write(name: str, text: str) -> Path:
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        return path

    return _write


@pytest.fixture
def cli(capsys):
    """Run gpuwarden's main() in-process; return (status, stdout, stderr)."""
    from gpuwarden.cli.main import main

    def _run(*args: str):
        status = main([str(a) for a in args])
        out, err = capsys.readouterr()
        return status, out, err

    return _run


def gpuwarden_cmd() -> list[str]:
    """The gpuwarden package installed in the interpreter running the tests."""
    return [sys.executable, "-m", "gpuwarden"]


def subprocess_env() -> dict:
    return dict(os.environ, PYTHONUNBUFFERED="1")


def matplotlib_here() -> bool:
    """matplotlib is optional for users (charts); on CI (CI=true) tests/run installs it, so its absence fails."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        if os.environ.get("CI") == "true":
            pytest.fail("matplotlib is missing: tests/run installs it (the charts are tested on CI)")
        return False
    return True




class DaemonProcess:
    """`gpuwarden run` as a real process, with its log collected line by line."""

    def __init__(self, config_path, *args, env=None, command=None):
        import subprocess
        import threading

        self.lines: list[str] = []
        self.proc = subprocess.Popen([*(command or gpuwarden_cmd()), "run", "-c", str(config_path), *args],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env=env or subprocess_env())
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self):
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))
            engines.seen(line)

    def wait_for(self, text: str | tuple[str, ...], timeout: float = 120.0, after: int = 0) -> str:
        """The first log line from index `after` on that contains text. It returns as soon as the line comes and
        fails as soon as the daemon ends, so the timeout only bounds a daemon that hangs."""
        return self.lines[self.wait_index(text, timeout, after)]

    def wait_index(self, text: str | tuple[str, ...], timeout: float = 120.0, after: int = 0) -> int:
        """The index of that line in the log: lines one poll logs together keep the order the daemon decided in,
        which a clock cannot tell apart."""
        import time

        texts = (text,) if isinstance(text, str) else text  # a tuple: the first line with any of them
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for index in range(after, len(self.lines)):
                if any(t in self.lines[index] for t in texts):
                    return index
            if self.proc.poll() is not None and not self._reader.is_alive():
                break
            time.sleep(0.05)
        raise AssertionError(f"{text!r} not logged; log was:\n" + "\n".join(self.lines))

    def stop(self, sig=None, timeout: float = 120.0) -> int:
        """Stop it and wait; the timeout bounds a hang. A daemon serving the CPU vLLM waits for the engine's own
        shutdown, which took over 30 s on a busy box (ci46)."""
        import signal

        if self.proc.poll() is None:
            self.proc.send_signal(sig or signal.SIGTERM)
        code = self.proc.wait(timeout)
        self._reader.join(5)
        return code

    def end(self) -> None:
        """For a test that failed half-way: SIGTERM first, so the daemon stops its engine too (a SIGKILL leaves the
        engine serving, for the next daemon to adopt: ci46 left one behind), then SIGKILL."""
        import subprocess

        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(120)  # a host swapping under a test's load delivers even SIGKILL late

    @property
    def log(self) -> str:
        return "\n".join(self.lines)


@pytest.fixture
def passable_state():
    """A state directory serve.user may pass to its engine's socket (serving/compose/enginesock.py), as
    /var/lib/gpuwarden (0755) is: pytest's own tmp_path sits in a folder only root may enter. Short, so that the
    socket's path fits a Unix socket's 107 bytes."""
    state = Path(tempfile.mkdtemp(prefix="gw-state-"))
    state.chmod(0o755)
    yield state
    shutil.rmtree(state, ignore_errors=True)


@pytest.fixture
def daemons():
    """Start daemons; every one still running at the end of the test is killed."""
    started: list[DaemonProcess] = []

    def _start(config_path, *args, env=None, command=None) -> DaemonProcess:
        d = DaemonProcess(config_path, *args, env=env, command=command)
        started.append(d)
        return d

    def _stop_all():
        for d in started:
            d.end()

    _start.stop_all = _stop_all  # for a fixture that checks what the daemons left, after they are stopped
    yield _start
    _stop_all()


# -- the real CPU build of vLLM (tests/vllm/install) ---------------------------------------------
VENV = Path(os.environ.get("GPUWARDEN_VLLM_VENV", "/opt/gpuwarden-test/venv-vllm"))
# One start of the CPU vLLM (import, weights, torch compile) takes a minute on an idle two-core host and
# passed six minutes at load 9 (CI runs other work beside the tests): the deadline is for a wedged start.
VLLM_START_S = 900
CHILD_USER = "gpuwarden-test"


@pytest.fixture(scope="session")
def vllm_python():
    python = VENV / "bin" / "python"
    if not python.exists():
        if os.environ.get("CI") == "true":
            pytest.fail(f"vLLM is missing under CI=true: {python} (tests/run installs it with tests/vllm/install)")
        pytest.skip(f"vLLM not installed at {VENV} (run bash tests/vllm/install)")
    return python


def _make_tiny_model(vllm_python, *extra: str) -> Path:
    folder = Path(tempfile.mkdtemp(prefix="gpuwarden-tiny-model-"))
    subprocess.run([str(vllm_python), str(ROOT / "tests" / "vllm" / "make_tiny_model.py"), str(folder), *extra],
                   check=True, capture_output=True, timeout=300)
    for path in [folder, *folder.iterdir()]:  # the child user must read it
        path.chmod(0o755 if path.is_dir() else 0o644)
    return folder


@pytest.fixture(scope="session")
def tiny_model(vllm_python):
    """The one model every real-vLLM test serves, with the one context (the cpu-tiny profile's --max-model-len):
    vLLM compiles its graph once per model and context and caches it per user (a minute of both cores at the
    first start, seconds after it), so tests that differ in neither share the compile. 16,384 tokens: eight
    generations of it outlast a frozen-engine test."""
    folder = _make_tiny_model(vllm_python)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def serving_config(write, vllm_python, model, user, vllm_port, extra_args=(), extra=""):
    """A config serving model with the real CPU vLLM on a sim DGX Spark, written with write(name, text)."""
    write("profiles.d/cpu-tiny.yaml", CPU_TINY_PROFILE.read_text())
    args = json.dumps(list(extra_args))
    return write("gpuwarden.yaml", f"""poll_interval_s: 0.5
metrics:
  listen: 127.0.0.1:{free_port()}
gpu:
  backend: sim
  scenario: dgx-spark
serve:
  enabled: true
  profile: cpu-tiny
  model: {model}
  command: [{vllm_python}, -m, vllm.entrypoints.openai.api_server]
  port: {vllm_port}
  user: {user}
  args: {args}
  startup_timeout_s: {VLLM_START_S}
  stop_timeout_s: 20
  liveness_interval_s: 2
{extra}""")


NOHOME_USER = "gw-nohome-test"


@pytest.fixture(scope="session")
def podman(tmp_path_factory):
    """Debian's podman serving its API on a socket of the tests' own, with the tests' image imported
    (tests/harness/podman_rig.py); stopped at the session's end. A real part: missing, it fails the test."""
    from harness.podman_rig import Podman, PodmanUnavailable

    try:
        rig = Podman(tmp_path_factory.mktemp("podman"))
    except PodmanUnavailable as exc:
        pytest.fail(str(exc))
    try:
        rig.image()
        yield rig
    finally:
        rig.stop()


@pytest.fixture(scope="session")
def served(vllm_python, tiny_model, child_user):
    """One daemon serving the tiny model with the real CPU vLLM, healthy, for the tests that only use or watch an
    engine (a vLLM start costs 60-90 s on two cores): bench against vLLM's counters, and a system user without a
    home (as root the engine runs as one, `useradd -r -M`; it gets a home under the state directory). A test that
    kills, freezes or reconfigures its engine, or needs other flags, starts its own."""
    folder = Path(tempfile.mkdtemp(prefix="gpuwarden-served-"))  # not under pytest's 0700 folder: the user
    folder.chmod(0o755)  # reaches its home below the state directory, as below /var/lib/gpuwarden
    user = child_user
    if os.geteuid() == 0:
        user = NOHOME_USER
        with users_locked():
            subprocess.run(["userdel", "-f", user], capture_output=True)
            subprocess.run(["useradd", "-r", "-M", "-s", "/usr/sbin/nologin", user], check=True)
        assert not Path(pwd.getpwnam(user).pw_dir).exists()
        # torch's inductor writes its precompiled headers under /tmp/torchinductor_USER whatever
        # TORCHINDUCTOR_CACHE_DIR says; one an earlier run's user of this name left (useradd may give the name
        # another uid) is that uid's, and vLLM dies at start-up on its PermissionError. The unit's PrivateTmp
        # keeps a real host clear of this.
        stale = Path(tempfile.gettempdir()) / f"torchinductor_{user}"
        if stale.exists() and stale.stat().st_uid != pwd.getpwnam(user).pw_uid:
            shutil.rmtree(stale)
    state = folder / "state"
    state.mkdir()
    state.chmod(0o755)

    def write(name, text):
        path = folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        return path

    port = free_port()
    path = serving_config(write, vllm_python, tiny_model, user, port)
    d = DaemonProcess(path, env=dict(subprocess_env(), STATE_DIRECTORY=str(state)))
    try:
        d.wait_for("vLLM healthy after", timeout=VLLM_START_S)
        yield types.SimpleNamespace(daemon=d, config=path, port=port, model=tiny_model, user=user,
                                    plain_user=child_user, state=state)
        assert d.stop() == 0, d.log[-3000:]
    finally:
        if d.proc.poll() is None:
            d.proc.terminate()
            d.proc.wait(60)
        if user == NOHOME_USER:
            with users_locked():
                subprocess.run(["userdel", "-f", user], capture_output=True)
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="session")
def proxy_daemon(child_user):
    """How to start a daemon whose proxy (its child, as serve.user) can run: (command, env). As root, where serve.user
    cannot run this interpreter, the vLLM venv's with a readable copy of the package (tests/vllm/restart_rig.py)."""
    sys.path.insert(0, str(ROOT / "tests" / "vllm"))
    from restart_rig import runnable_daemon

    python = VENV / "bin" / "python"
    command, env, copy = runnable_daemon(python, child_user)
    if copy is not None and not python.exists():
        pytest.fail(f"{child_user} cannot run {sys.executable}, and there is no {python} to run the proxy on "
                    "(tests/run installs it with tests/vllm/install)")
    yield command, env
    if copy is not None:
        shutil.rmtree(copy, ignore_errors=True)


def add_child_user() -> None:
    """As root, add CHILD_USER if it is missing. Called at the session's start, before any test, so that the
    `useradd` of a fresh machine is no test's process (the tier check would fail the unit test that first asked
    for `child_user`, and only on a fresh machine)."""
    if os.geteuid() != 0:
        return
    with users_locked():  # each xdist worker starts a session: one adds the user
        try:
            pwd.getpwnam(CHILD_USER)
        except KeyError:
            subprocess.run(["useradd", "--system", "--create-home", "--home-dir", f"/var/lib/{CHILD_USER}",
                            "--shell", "/usr/sbin/nologin", CHILD_USER], check=True)


@pytest.fixture(scope="session")
def child_user():
    """An unprivileged user for vLLM when the tests run as root (as in CI); else we are that user."""
    if os.geteuid() != 0:
        return pwd.getpwuid(os.geteuid()).pw_name
    add_child_user()  # added at the session's start; again only if a test removed it meanwhile
    return CHILD_USER


@contextlib.contextmanager
def users_locked():
    """Hold the tests' lock on adding and removing users: useradd and userdel of two xdist workers at once fail
    with "cannot lock /etc/passwd" (exit 10), and the check-then-add of a shared user races."""
    with open("/run/gpuwarden-tests-users.lock" if os.geteuid() == 0 else os.devnull, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield
