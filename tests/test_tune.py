"""`gpuwarden tune` on the simulator: the knee of a decode-heavy and a prefill-heavy workload, every way a sweep
ends leaving the configured setting in place (real processes: the daemon, tune, the fake server sharing the
simulated card through GPUWARDEN_SIM_STATE), and the control channel's limits."""

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from conftest import free_port, gpuwarden_cmd, matplotlib_here, subprocess_env
from gpuwarden import config
from gpuwarden.service import control
from gpuwarden.tune.channel import CONNECTIONS_MAX, SET_MIN_S, ControlError
from gpuwarden.tune.sweeps import MARKER, Sweeps
from gpuwarden.base import smallfile
from gpuwarden.backends import open_configured
from gpuwarden.bench.tune import find_knee, settings_to_try
from gpuwarden.gpu.sim import power
from gpuwarden.gpu.sim.backend import ManualClock
from gpuwarden.tune.tuning import Tuner, TuningLife

HERE = Path(__file__).resolve().parent
SCENARIO = """\
name: h100-tune
description: one H100 whose load is the served workload's (GPUWARDEN_SIM_STATE)
as_root: true
gpus:
  - name: NVIDIA H100 80GB HBM3
    brand: NVIDIA
    form_factor: sxm
    compute_capability: "9.0"
    memory_total_mib: 81559
    memory_bus_width_bits: 5120
    memory_clocks_mhz: [2619]
    graphics_clocks_mhz: [345, 1980, 15]
    idle_clocks_mhz: {sm: 345, memory: 2619}
    boost_under_load: true
    power: {idle_w: 70, full_load_w: 690, default_limit_w: 700, min_limit_w: 200, max_limit_w: 700}
timeline:
  - {at_s: 0, event: load, utilization_pct: 0}
"""
TOKEN_DELAY_S, PREFILL_MS = 0.01, 0.25


class Rig:
    """A daemon on the simulated H100, the fake server serving at its speed, and tune against both."""

    def __init__(self, tmp: Path, daemons, tuning: str = ""):
        self.tmp, self.daemons = tmp, daemons
        self.chan = tmp / "chan"
        self.chan.mkdir(parents=True)
        (tmp / "h100.yaml").write_text(SCENARIO)
        self.metrics = free_port()
        self.conf = tmp / "conf.yaml"
        self.conf.write_text(f"gpu: {{backend: sim, scenario: h100.yaml}}\npoll_interval_s: 0.25\n"
                             f"metrics: {{listen: '127.0.0.1:{self.metrics}'}}\n{tuning}")
        self.env = {**subprocess_env(), power.ENV: str(self.chan), "STATE_DIRECTORY": str(tmp / "state"),
                    "RUNTIME_DIRECTORY": str(tmp / "run")}
        self.port = free_port()
        self.server = subprocess.Popen([sys.executable, str(HERE / "harness" / "fake_openai.py"), "--port",
                                        str(self.port), "--sim-state", str(self.chan), "--token-delay",
                                        str(TOKEN_DELAY_S), "--prefill-ms", str(PREFILL_MS)],
                                       stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=self.env)
        assert self.server.stdout.readline().strip() == "listening"
        self.daemon = None

    def start_daemon(self):
        self.daemon = self.daemons(self.conf, env=self.env)
        self.daemon.wait_for("serving /metrics")
        return self.daemon

    def limit(self) -> float:
        return power.read_gpus(self.chan)[0]["power_limit_w"]

    def tune_argv(self, *args):
        return [*gpuwarden_cmd(), "tune", "-c", str(self.conf), "--url", f"http://127.0.0.1:{self.port}",
                "--concurrency", "4", "--idle", "0.5", "--lease", "2", *args]

    def tune(self, *args, timeout=120):
        return subprocess.run(self.tune_argv(*args), capture_output=True, text=True, env=self.env, timeout=timeout)

    def popen_tune(self, *args):
        return subprocess.Popen(self.tune_argv(*args), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env=self.env)

    def wait_limit(self, predicate, timeout=20.0):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = self.limit()
            if predicate(value):
                return value
            time.sleep(0.05)
        raise AssertionError(f"power limit {self.limit()} never matched; daemon log:\n{self.daemon.log}")

    def close(self):
        self.server.terminate()
        self.server.wait(10)


@pytest.fixture
def rig(tmp_path, daemons):
    rigs = []

    def make(tuning=""):
        rigs.append(Rig(tmp_path / f"r{len(rigs)}", daemons, tuning))
        return rigs[-1]

    yield make
    for r in rigs:
        r.close()


# -- the knee against the curve (benchmarks/tune_knee.py: a wall-clock figure, measured on a quiet host) ----

def expected_knee(values, input_len, output_len, keep):
    """The knee the curve itself has at these settings: each step's speed from the simulated card's loaded clock
    (sim/power.py), its draw from the simulator at full load, the request time as the fake server serves it."""
    steps = []
    for value in values:
        backend = _sim_backend(value)
        gpu = backend.gpus()[0]
        published = gpu.published()
        f, knee = published["loaded_fraction"], published["decode_knee_fraction"]
        seconds = (input_len + 1) * PREFILL_MS / 1e3 / power.speed("prefill", f, knee) + \
            output_len * TOKEN_DELAY_S / power.speed("decode", f, knee)
        gpu.utilization = 100.0
        watts = gpu.sample().power_w
        steps.append({"setting": value, "system_tokens_per_s": output_len / seconds,
                      "tokens_per_joule": output_len / seconds / watts, "seconds": seconds})
    return values.index(find_knee(steps, keep)["setting"]), [s["seconds"] for s in steps]


def _sim_backend(limit_w):
    from gpuwarden.gpu.sim.backend import SimBackend
    from gpuwarden.gpu.sim.scenario import load_scenario
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "h100.yaml"
        path.write_text(SCENARIO)
        backend = SimBackend(load_scenario(path), clock=ManualClock())
    backend.gpus()[0].set_power_limit_w(limit_w)
    return backend


@pytest.mark.process
@pytest.mark.parametrize("shape", ["decode", "prefill"])
def test_tune_finds_the_curves_knee_and_draws_the_chart(rig, tmp_path, shape):
    r = rig()
    r.start_daemon()
    lengths = ("8", "32") if shape == "decode" else ("400", "2")
    chart = tmp_path / f"{shape}.png"
    plot = ["--plot", str(chart)] if matplotlib_here() else []
    apply = ["--apply"] if shape == "decode" else []
    out = r.tune("--steps", "6", "--duration", "1.5", "--input-len", lengths[0], "--output-len", lengths[1],
                 "--json", *plot, *apply)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    values = [s["setting"] for s in result["steps"]]
    assert values == settings_to_try({"0": [200, 700]}, False, 6) == [700, 600, 500, 400, 300, 200]
    for step in result["steps"]:  # every figure present, and the watts follow the limit down
        assert step["tokens_per_joule"] > 0 and step["gpu_watts_mean"] <= step["setting"] + 1
        assert step["ttft_p99_s"] >= step["ttft_p50_s"] > 0 and step["itl_p99_s"] >= step["itl_p50_s"] > 0
    assert 60 < result["idle_w"] < 80  # the card idles at 70 W before the first step
    # tune's knee is its own table's. Where it lies on the curve is a wall-clock figure a busy host moves (a client-side
    # gap on every request flattens the curve): benchmarks/tune_knee.py measures that on a quiet host.
    assert result["knee"]["setting"] == find_knee(result["steps"], 0.95)["setting"]
    knee = result["knee"]["setting"]
    assert f"power_limit_w: {knee:g}" in result["config"]
    assert "sweep of power_limit_w ended (the sweep ended, 6 steps set): GPU 0 power_limit_w: 700 W as before " \
           "gpuwarden: ok" in r.daemon.wait_for("sweep of power_limit_w ended")  # nothing configured: the card's own
    # the sweep's low limits trip no power or clock alert: they are the sweep's, not a fault
    assert "power_capped firing" not in r.daemon.log and "sm_clock_low firing" not in r.daemon.log
    if apply:  # the knee written as a drop-in beside the config, the daemon reloaded: it sets the knee
        dropin = r.conf.parent / "conf.d" / "50-tune.yaml"
        assert dropin.read_text().endswith(result["config"]) and "reloaded the daemon" in out.stderr
        r.daemon.wait_for("config reloaded")
        r.wait_limit(lambda w: w == knee)
    else:
        assert r.limit() == 700
    if plot:
        assert chart.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and chart.stat().st_size > 10_000


@pytest.mark.process
def test_a_plot_without_matplotlib_is_one_line(tmp_path):
    shim = tmp_path / "shim" / "matplotlib"
    shim.mkdir(parents=True)
    (shim / "__init__.py").write_text("raise ImportError('No module named matplotlib')\n")
    env = {**subprocess_env(), "PYTHONPATH": f"{shim.parent}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    conf = tmp_path / "c.yaml"
    conf.write_text("gpu: {backend: sim, scenario: h100-nvswitch}\n")
    for command in ("tune", "bench"):
        out = subprocess.run([*gpuwarden_cmd(), command, "-c", str(conf),
                              "--url", "http://127.0.0.1:9", "--plot", str(tmp_path / "c.png")],
                             capture_output=True, text=True, env=env, timeout=60)
        assert out.returncode == 78, out.stderr
        assert out.stderr.strip().splitlines() == [
            f"gpuwarden {command}: --plot needs matplotlib, which is not installed (Debian: apt install "
            "python3-matplotlib; pip: pip install matplotlib)"]


# -- every end of a sweep ------------------------------------------------------------------------------------

@pytest.mark.process
def test_every_end_of_a_sweep_leaves_the_configured_limit(rig):
    r = rig("tuning: {power_limit_w: 650}\n")
    daemon = r.start_daemon()
    r.wait_limit(lambda w: w == 650)
    long_sweep = ("--values", "400,300", "--duration", "60", "--input-len", "8", "--output-len", "32")

    # Ctrl-C: tune ends the lease itself and says so
    tune = r.popen_tune(*long_sweep)
    r.wait_limit(lambda w: w == 400)
    mark = len(daemon.lines)
    tune.send_signal(signal.SIGINT)
    _, err = tune.communicate(timeout=60)
    assert tune.returncode == 130, err
    assert "the daemon put the configured setting back: GPU 0 power_limit_w" in err and r.limit() == 650
    assert "(the sweep ended, 1 steps set)" in daemon.wait_for("sweep of power_limit_w ended", after=mark)

    # SIGKILL: the connection closes, the daemon puts it back
    tune = r.popen_tune(*long_sweep)
    r.wait_limit(lambda w: w == 400)
    mark = len(daemon.lines)
    tune.kill()
    tune.wait(10)
    r.wait_limit(lambda w: w == 650, timeout=10)
    assert "(its connection closed" in daemon.wait_for("sweep of power_limit_w ended", after=mark)

    # stopped (a hung tune): no word for the lease's 2 s, the setting comes back
    tune = r.popen_tune(*long_sweep)
    r.wait_limit(lambda w: w == 400)
    mark = len(daemon.lines)
    tune.send_signal(signal.SIGSTOP)
    try:
        stopped = time.monotonic()
        r.wait_limit(lambda w: w == 650, timeout=15)
        assert time.monotonic() - stopped >= 1.5  # not before the lease ran out
        # Two clocks of the same lease end it, whichever comes first on a busy box: the connection's deadline
        # ("no word from it") or the main loop's (the lease ran out); either is the hung tune's lease.
        ended = daemon.wait_for("sweep of power_limit_w ended", after=mark)
        assert "(no word from it for the lease's 2 s" in ended or "(the lease ran out" in ended, ended
    finally:
        tune.kill()
        tune.wait(10)

    # the daemon killed mid-sweep: the card keeps the swept limit (as a real one does); the next daemon restores
    tune = r.popen_tune(*long_sweep)
    r.wait_limit(lambda w: w == 400)
    daemon.proc.kill()
    daemon.proc.wait(10)
    _, err = tune.communicate(timeout=30)  # its lease gone, tune stops at once and says so
    assert tune.returncode == 1 and err.count("the sweep lost its lease mid-step") == 1, err
    assert r.limit() == 400
    again = r.start_daemon()
    assert "did not end" in again.wait_for("a sweep of power_limit_w on GPU 0")
    r.wait_limit(lambda w: w == 650, timeout=10)
    assert not (r.tmp / "state" / MARKER).exists()
    assert again.stop() == 0 and r.limit() == 650  # restore_on_stop is off by default: the tuning stays

    # With no limit configured, only the recovery can put the card's own 700 W back (the plan sets nothing):
    # from the originals this boot recorded before gpuwarden's first change, kept on disk.
    r.conf.write_text(r.conf.read_text().replace("tuning: {power_limit_w: 650}\n", ""))
    unconfigured = r.start_daemon()
    tune = r.popen_tune(*long_sweep)
    r.wait_limit(lambda w: w == 400)
    unconfigured.proc.kill()
    unconfigured.proc.wait(10)
    tune.communicate(timeout=30)
    assert r.limit() == 400
    last = r.start_daemon()
    assert "did not end" in last.wait_for("a sweep of power_limit_w on GPU 0")
    r.wait_limit(lambda w: w == 700, timeout=10)


def _ignored_signals(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith("SigIgn:")), 16)


@pytest.mark.process
def test_tune_started_as_a_script_starts_it_ends_at_once_when_its_daemon_dies(rig):
    # A script's background job: bash without job control starts it with SIGINT ignored, so the lease's loss
    # cannot reach the sweep through SIGINT (it took a whole step, 37 s in the case).
    r = rig("tuning: {power_limit_w: 650}\n")
    daemon = r.start_daemon()
    r.wait_limit(lambda w: w == 650)
    argv = r.tune_argv("--values", "400,300", "--duration", "60", "--input-len", "8", "--output-len", "32")
    script = subprocess.Popen(["bash", "-c", '"$@" & echo $!; wait $!', "bash", *argv], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=r.env)
    tune_pid = int(script.stdout.readline())
    r.wait_limit(lambda w: w == 400)
    assert _ignored_signals(tune_pid) & (1 << (signal.SIGINT - 1))  # started as a script starts it
    daemon.proc.kill()
    daemon.proc.wait(10)
    killed = time.monotonic()
    _, err = script.communicate(timeout=30)
    took = time.monotonic() - killed
    # The lease (2 s) is renewed every third of it: the loss is seen within about 0.7 s, the step cut at once, not
    # run to its 60 s (30: a bound a busy box cannot cross the wrong way).
    assert took < 30, (took, err)
    assert script.returncode == 1, err
    lost = [line for line in err.splitlines() if "the sweep lost its lease mid-step" in line]
    assert len(lost) == 1 and "Traceback" not in err, err
    # The dead daemon could put nothing back: the card keeps the step, and the next daemon restores the choice.
    assert r.limit() == 400
    again = r.start_daemon()
    assert "did not end" in again.wait_for("a sweep of power_limit_w on GPU 0")
    r.wait_limit(lambda w: w == 650, timeout=10)
    print(f"tune ended {took:.2f} s after its daemon's SIGKILL")


# -- the control channel's limits (in-process: the same server and sweeps, a fake loop) ----------------------

@pytest.fixture
def channel(tmp_path, monkeypatch):
    cfg = config.parse_text("gpu: {backend: sim, scenario: h100-nvswitch}\n", name="x.yaml")
    backend = open_configured(cfg, ManualClock(20))
    monkeypatch.setenv("STATE_DIRECTORY", str(tmp_path / "state"))
    sweeps = Sweeps(TuningLife(backend, cfg, Tuner(backend)))
    wake = threading.Event()
    server = control.ControlServer(tmp_path / "run" / "control.sock", wake.set)
    server.start()
    stop = threading.Event()

    def loop():  # the daemon's loop: answer when woken
        while not stop.is_set():
            if wake.wait(0.05):
                wake.clear()
                server.serve(sweeps)
            sweeps.tick()

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    yield server, sweeps, backend
    stop.set()
    thread.join(2)
    server.stop()


def _connect(path):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(10)
    s.connect(str(path))
    return s, s.makefile("rb")


def _ask(s, f, message):
    s.sendall((message if isinstance(message, bytes) else json.dumps(message).encode()) + b"\n")
    line = f.readline()
    return json.loads(line) if line else None


@pytest.mark.process
def test_the_socket_is_root_only_and_born_so(channel):
    server, _, _ = channel
    assert (server.path.stat().st_mode & 0o777) == 0o600
    if os.geteuid() != 0:
        pytest.skip("checking another uid's refusal needs root to become one")
    # The file's mode stops another user at connect(); SO_PEERCRED stops one that got past it (say, handed an fd
    # or a path made wider by hand): a second socket in a folder anyone may enter, widened, for this one check.
    import tempfile

    folder = Path(tempfile.mkdtemp(prefix="gpuwarden-peercred-"))
    try:
        folder.chmod(0o755)
        wide = control.ControlServer(folder / "control.sock", lambda: None)
        wide.start()
        os.chmod(wide.path, 0o666)
        code = ("import socket, os; os.setgid(65534); os.setuid(65534); s = socket.socket(socket.AF_UNIX); "
                f"s.connect({str(wide.path)!r}); print(s.makefile().readline())")
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
        wide.stop()
        assert "the control channel is root's (run tune as root)" in out.stdout, out.stderr
    finally:
        import shutil
        shutil.rmtree(folder)


def test_the_channels_limits_each_end_a_connection(channel, monkeypatch):
    server, sweeps, backend = channel
    s, f = _connect(server.path)
    assert "at most 4096 bytes" in _ask(s, f, b'{"op": "' + b"x" * 5000 + b'"}')["error"]
    assert f.readline() == b""  # and closed
    s, f = _connect(server.path)
    assert _ask(s, f, b"[1, 2]")["error"] == "a message is one JSON object" and f.readline() == b""
    # connections past CONNECTIONS_MAX are told so at once
    held = [_connect(server.path) for _ in range(CONNECTIONS_MAX)]
    s, f = _connect(server.path)
    assert "4 connections are open already" in json.loads(f.readline())["error"]
    for h, hf in held:
        hf.close()
        h.close()
    deadline = time.monotonic() + 5
    while server._open and time.monotonic() < deadline:  # their threads see the close
        time.sleep(0.02)
    # a second sweep while one runs; values outside the card's constraints; a set before a begin
    s, f = _connect(server.path)
    assert "send begin first" in _ask(s, f, {"op": "set", "value": 300})["error"]
    begin = {"op": "begin", "setting": "power_limit_w", "gpus": [0], "lease_s": 5}
    assert _ask(s, f, begin)["limits"] == {"0": [200, 700]}
    t, g = _connect(server.path)
    assert "runs already" in _ask(t, g, begin)["error"]
    assert "outside what it accepts (200-700)" in _ask(s, f, {"op": "set", "value": 900})["error"]
    assert _ask(s, f, {"op": "set", "value": 450})["ok"] and backend.gpus()[0].power_limit_w == 450
    f.close()
    s.close()  # the connection lost: the limit back at once
    deadline = time.monotonic() + 5
    while backend.gpus()[0].power_limit_w != 700 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert backend.gpus()[0].power_limit_w == 700 and sweeps.lease is None
    # a connection that says nothing is closed after HELLO_S
    monkeypatch.setattr(control, "HELLO_S", 0.3)
    s, f = _connect(server.path)
    assert f.readline() == b""


@pytest.mark.process
def test_a_sweep_the_daemon_refuses_exits_1_as_its_help_says(rig):
    r = rig("tuning: {power_limit_w: 650}\n")
    r.start_daemon()
    first = r.popen_tune("--values", "400,300", "--duration", "60", "--input-len", "8", "--output-len", "32")
    try:
        r.wait_limit(lambda w: w == 400)  # the first sweep holds the lease: the daemon refuses a second
        second = r.tune("--values", "400", "--duration", "1")
    finally:
        first.send_signal(signal.SIGINT)
        first.communicate(timeout=60)
    assert second.returncode == 1, second.stderr  # 69 is for no daemon to ask: this one answered
    assert second.stderr.startswith("gpuwarden tune: a sweep of power_limit_w runs already (") and \
        second.stderr.count("\n") == 1, second.stderr
    assert "1 the daemon refused the sweep" in subprocess.run([*gpuwarden_cmd(), "tune", "--help"],
                                                              capture_output=True, text=True, env=r.env).stdout


@pytest.mark.process
def test_a_card_without_power_limit_constraints_is_one_line_not_a_traceback(rig):
    # DGX Spark's GB10 answers NOT_SUPPORTED for the power limit: the daemon's begin names its constraints None
    r = rig()
    r.conf.write_text(r.conf.read_text().replace("scenario: h100.yaml", "scenario: dgx-spark"))
    daemon = r.start_daemon()
    out = r.tune("--duration", "1")
    assert out.returncode == 1 and out.stderr == ("gpuwarden tune: GPU 0 reports no power-limit constraints: its "
                                                  "power limit cannot be swept\n"), out.stderr
    daemon.wait_for("sweep of power_limit_w ended (the sweep ended, 0 steps set): nothing to put back")


@pytest.mark.parametrize("limits, clocks, said", [
    ({"0": [200, 700], "1": [None, None]}, False, "GPU 1 reports no power-limit constraints"),
    ({"0": [True, 700]}, False, "GPU 0 reports no power-limit constraints"),
    ({"0": [1980, 1965], "1": []}, True, "GPU 1 lists no supported clocks"),
    ({}, False, "the daemon's answer names no GPU's limits ({})"),
    (None, True, "the daemon's answer names no GPU's limits (None)")])
def test_limits_a_sweep_cannot_use_are_one_line(limits, clocks, said):
    with pytest.raises(ControlError) as raised:
        settings_to_try(limits, clocks, 4)
    assert str(raised.value).startswith(said)


def test_a_sweep_is_refused_while_others_use_the_gpus_unless_forced(channel):
    server, sweeps, backend = channel
    # A process that is not this (daemon) process's descendant: its parent. (An orphan is no stranger here: a test
    # that ran a daemon in this process made it a child subreaper, so orphans come back to it.)
    stranger = os.getppid()
    backend.gpus()[1].processes = [(stranger, 1 << 30), (os.getpid(), 1 << 30)]  # and the engine: ours
    s, f = _connect(server.path)
    begin = {"op": "begin", "setting": "gpu_clocks", "gpus": [1], "lease_s": 5}
    answer = _ask(s, f, begin)
    assert f"other processes than the engine use the GPUs ([{stranger}])" in answer.get("error", ""), answer
    assert _ask(s, f, {**begin, "force": True})["ok"]
    assert _ask(s, f, {"op": "set", "value": 1410})["ok"] and backend.gpus()[1].gpu_lock == (1410, 1410)
    ended = _ask(s, f, {"op": "end"})
    assert ended["restored"] == ["GPU 1 gpu_clocks: unlocked as before gpuwarden: ok"]
    assert backend.gpus()[1].gpu_lock is None


# -- energy in bench and the daemon --------------------------------------------------------------------------

def test_a_steps_energy_with_and_without_the_idle_draw():
    from gpuwarden.bench.energy import step_energy

    step = {"output_tokens": 600, "duration_s": 2.0, "gpus": [{"power_w_mean": 250.0}, {"power_w_mean": 350.0}]}
    e = step_energy(step, idle_w=100.0)
    assert e["gpu_watts_mean"] == 600 and e["energy_j"] == 1200
    assert e["joules_per_token"] == 2.0 and e["tokens_per_joule"] == 0.5
    assert e["joules_per_token_above_idle"] == pytest.approx(1000 / 600) and e["tokens_per_joule_above_idle"] == 0.6
    assert step_energy({**step, "gpus": [{"power_w_mean": None}]}, 100.0)["tokens_per_joule"] is None


def test_the_daemons_tokens_per_joule_spans_a_minute_of_counter_reads():
    from gpuwarden.watch.signals.serving import EnergyWindow

    window = EnergyWindow()
    assert window.tokens_per_joule() is None
    for second in range(0, 121, 10):  # 50 tok/s at 500 W for the first minute, then 100 tok/s at 400 W
        fast = second > 60
        tokens = 50 * min(second, 60) + 100 * max(0, second - 60)
        joules = 500 * min(second, 60) + 400 * max(0, second - 60)
        window.add(second, tokens, joules)
        if second == 60:
            assert window.tokens_per_joule() == pytest.approx(0.1)
    assert fast and window.tokens_per_joule() == pytest.approx(0.25)  # the last minute only
    window.add(130, 5, joules + 10)  # the engine restarted: its counter began again
    assert window.tokens_per_joule() is None


def test_a_second_daemon_never_takes_the_live_socket_over(channel):
    server, _, _ = channel
    with pytest.raises(OSError, match="another gpuwarden listens there"):
        control.ControlServer(server.path, lambda: None)
    assert server.path.is_socket() and control._answers(server.path)


# -- the channel under attack: each of these failed before its fix -------------------------------------------

def _begin(s, f, **more):
    return _ask(s, f, {"op": "begin", "setting": "power_limit_w", "gpus": [0], "lease_s": 5, **more})


def test_one_wake_answers_only_what_was_queued_and_sets_are_rate_limited(channel, monkeypatch):
    server, sweeps, backend = channel

    class Asker:  # a client that asks again the moment it is answered, as a flood of connections does
        answered = 0

        def handle(self, message, peer, owner=None):
            Asker.answered += 1
            if Asker.answered < 1000:
                server.requests.put((message, peer, owner, {}, threading.Event()))
            return {"ok": True}

    quiet = control.ControlServer(server.path.parent / "quiet.sock", lambda: None)  # no loop of its own
    quiet.start()
    try:
        server = quiet
        for _ in range(3):
            quiet.requests.put(({"op": "renew"}, "x", None, {}, threading.Event()))
        quiet.serve(Asker())
        assert Asker.answered == 3  # the three queued on entry; the rest at the next wake, after a poll
    finally:
        quiet.stop()
    # the lease's holder sets at most once every SET_MIN_S: a flood of sets costs the loop little
    s, f = _connect(channel[0].path)
    assert _begin(s, f)["ok"]
    assert _ask(s, f, {"op": "set", "value": 450})["ok"]
    assert "sets too fast" in _ask(s, f, {"op": "set", "value": 400})["error"]
    assert backend.gpus()[0].power_limit_w == 450
    time.sleep(SET_MIN_S)
    assert _ask(s, f, {"op": "set", "value": 400})["ok"] and backend.gpus()[0].power_limit_w == 400
    assert _ask(s, f, {"op": "end"})["ok"]


def test_a_lease_is_its_connections_alone(channel):
    server, sweeps, backend = channel
    a, af = _connect(server.path)
    assert _begin(a, af)["ok"]
    b, bf = _connect(server.path)  # never began: it may neither set nor end A's sweep
    assert "send begin first" in _ask(b, bf, {"op": "set", "value": 300})["error"]
    assert "send begin first" in _ask(b, bf, {"op": "end"})["error"]
    assert sweeps.lease is not None and backend.gpus()[0].power_limit_w == 700
    # A's lease ends without A (its lease ran out); C begins; A's connection closing must not end C's sweep
    sweeps.end("the lease ran out")
    c, cf = _connect(server.path)
    assert _begin(c, cf)["ok"] and _ask(c, cf, {"op": "set", "value": 450})["ok"]
    af.close()
    a.close()
    time.sleep(0.5)  # A's thread sees the close and reports it
    assert sweeps.lease is not None and backend.gpus()[0].power_limit_w == 450
    assert _ask(c, cf, {"op": "end"})["ok"] and backend.gpus()[0].power_limit_w == 700


def test_a_trickled_line_is_cut_at_its_deadline(channel, monkeypatch):
    server, _, _ = channel
    monkeypatch.setattr(control, "HELLO_S", 0.6)
    s, f = _connect(server.path)
    started = time.monotonic()
    with pytest.raises(OSError):  # a byte every 0.2 s: each read is quick, the line never whole; cut, or the loop's
        while time.monotonic() - started < 60:  # bound on a hang ends it without an OSError
            s.sendall(b" ")
            time.sleep(0.2)
    # nor do whole lines that are not a begin: HELLO_S counts from connecting
    s, f = _connect(server.path)
    started = time.monotonic()
    with pytest.raises(OSError):
        while time.monotonic() - started < 60:  # a bound on a hang, as above
            s.sendall(b'{"op": "renew"}\n')
            f.readline()
            time.sleep(0.2)


def test_no_marker_no_sweep(channel):
    server, sweeps, backend = channel
    # the marker cannot be written (as on a full disk): a folder with something in it at its temp name
    (smallfile.temp_name(sweeps.marker) / "inside").mkdir(parents=True)
    s, f = _connect(server.path)
    answer = _begin(s, f)
    assert not answer["ok"] and "cannot save the sweep's marker" in answer["error"]
    assert sweeps.lease is None and not sweeps.tuning.held


@pytest.mark.parametrize("bad", ["int", "nested", "bool", "fifo", "zero", "huge"])
def test_a_bad_marker_is_one_line_and_the_daemon_starts(tmp_path, bad, caplog):
    from gpuwarden.tune.originals import boot_id

    cfg = config.parse_text("gpu: {backend: sim, scenario: h100-nvswitch}\n", name="x.yaml")
    backend = open_configured(cfg, ManualClock(20))
    marker = tmp_path / "sweep.json"
    good = {"boot_id": boot_id(), "setting": "power_limit_w"}
    if bad == "fifo":
        os.mkfifo(marker)
    elif bad == "zero":
        marker.symlink_to("/dev/zero")
    elif bad == "huge":
        marker.write_text(json.dumps({**good, "gpus": ["GPU-x" * 10]}) + " " * 10_000_000)
    else:
        marker.write_text(json.dumps({**good, "gpus": {"int": 5, "nested": [[1]], "bool": [True]}[bad]}))
    sweeps = Sweeps(TuningLife(backend, cfg, Tuner(backend)), marker=marker)
    thread = threading.Thread(target=sweeps.recover, daemon=True)
    thread.start()
    thread.join(5)
    assert not thread.is_alive()  # a FIFO never hangs the start
    assert [r.getMessage() for r in caplog.records if "sweep marker" in r.getMessage()][0].startswith(
        f"sweep marker {marker} ignored: ")
    assert not marker.exists() and not marker.is_symlink()


def test_a_reload_mid_sweep_leaves_the_step_and_its_end_sets_the_new_value(channel):
    server, sweeps, backend = channel
    s, f = _connect(server.path)
    assert _begin(s, f)["ok"] and _ask(s, f, {"op": "set", "value": 300})["ok"]
    new = config.parse_text("gpu: {backend: sim, scenario: h100-nvswitch}\ntuning: {power_limit_w: 600}\n",
                            name="x.yaml")
    sweeps.tuning.reload(new, sweeps.tuning.check(new))  # SIGHUP: the new config wants 600 W
    assert backend.gpus()[0].power_limit_w == 300  # the step stands while it is measured
    assert backend.gpus()[1].power_limit_w == 600  # GPUs the sweep does not hold take it at once
    assert _ask(s, f, {"op": "end"})["ok"] and backend.gpus()[0].power_limit_w == 600


def test_bools_are_not_gpus_nor_seconds(channel):
    server, sweeps, _ = channel
    s, f = _connect(server.path)
    assert "gpus [True]" in _begin(s, f, gpus=[True])["error"]
    assert "lease_s True" in _begin(s, f, lease_s=True)["error"]
    assert sweeps.lease is None


def test_the_sim_channel_never_waits_on_a_fifo(tmp_path):
    os.mkfifo(tmp_path / "load.json")
    box = []
    thread = threading.Thread(target=lambda: box.append(power._read(tmp_path / "load.json")), daemon=True)
    thread.start()
    thread.join(5)
    assert box == [None]


def test_the_sim_card_stays_loaded_between_two_rounds_of_requests(tmp_path, monkeypatch):
    now = [1000.0]
    monkeypatch.setattr(power.time, "monotonic", lambda: now[0])
    assert power.busy(tmp_path) is None  # no server: the scenario's load holds
    power.write_load(tmp_path, 4)
    assert power.busy(tmp_path) is True
    power.write_load(tmp_path, 0)  # every stream of a round closed together; the client re-sends within ms
    now[0] += power.BUSY_HOLD_S / 2
    assert power.busy(tmp_path) is True
    now[0] += power.BUSY_HOLD_S
    assert power.busy(tmp_path) is False  # idle for longer than the gap between two rounds


def test_apply_says_which_file_overrides_the_knee(tmp_path):
    from gpuwarden.bench.tune import _apply

    conf = tmp_path / "gpuwarden.yaml"
    conf.write_text("gpu: {backend: sim, scenario: h100-nvswitch}\n")
    (tmp_path / "conf.d").mkdir()
    site = tmp_path / "conf.d" / "90-site.yaml"
    site.write_text("tuning: {power_limit_w: 650}\n")
    hups = []
    signal.signal(signal.SIGHUP, lambda *_: hups.append(1))
    try:
        assert _apply("tuning:\n  power_limit_w: 400\n", conf, os.getpid(), "power_limit_w", 400,
                      {"0": "GPU-0"}) == 1
        assert not (tmp_path / "conf.d" / "50-tune.yaml").exists() and not hups
        site.write_text("tuning: {gpus: {'0': {power_limit_w: 650}}}\n")  # a per-GPU key wins too
        assert _apply("tuning:\n  power_limit_w: 400\n", conf, os.getpid(), "power_limit_w", 400,
                      {"0": "GPU-0"}) == 1
        site.unlink()
        assert _apply("tuning:\n  power_limit_w: 400\n", conf, os.getpid(), "power_limit_w", 400,
                      {"0": "GPU-0"}) == 0
        assert hups and (tmp_path / "conf.d" / "50-tune.yaml").exists()
    finally:
        signal.signal(signal.SIGHUP, signal.SIG_DFL)


def test_apply_names_the_overriding_file(tmp_path, capsys):
    from gpuwarden.bench.tune import _apply

    conf = tmp_path / "gpuwarden.yaml"
    conf.write_text("gpu: {backend: sim, scenario: h100-nvswitch}\n")
    (tmp_path / "conf.d").mkdir()
    (tmp_path / "conf.d" / "90-site.yaml").write_text("tuning: {power_limit_w: 650}\n")
    assert _apply("tuning:\n  power_limit_w: 400\n", conf, os.getpid(), "power_limit_w", 400, {"0": "GPU-0"}) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"GPU 0 gets 650 from {tmp_path / 'conf.d' / '90-site.yaml'}" in err, err


@pytest.mark.process
@pytest.mark.skipif(not matplotlib_here(), reason="needs matplotlib")
def test_a_plot_name_is_checked_before_the_sweep(tmp_path):
    from gpuwarden.bench.plot import chart_path

    conf = tmp_path / "c.yaml"
    conf.write_text("gpu: {backend: sim, scenario: h100-nvswitch}\n")
    for command in ("tune",):  # no daemon nor server: the name is refused before anything is asked (bench's
        # --plot goes through the same chart_path)
        out = subprocess.run([*gpuwarden_cmd(), command, "-c", str(conf), "--url", "http://127.0.0.1:9",
                              "--plot", str(tmp_path / "out.foo")], capture_output=True, text=True,
                             env=subprocess_env(), timeout=60)
        assert out.returncode == 78 and out.stderr.count("\n") == 1, out.stderr
        assert "matplotlib cannot write .foo files" in out.stderr
    assert chart_path(tmp_path / "chart") == tmp_path / "chart.png"
    assert chart_path(tmp_path / "c.SVG") == tmp_path / "c.SVG"


def test_a_peer_that_does_not_read_its_answers_is_closed(channel, monkeypatch):
    server, sweeps, _ = channel
    monkeypatch.setattr(control, "SEND_S", 0.3)
    s, f = _connect(server.path)
    assert _begin(s, f)["ok"]
    big = json.dumps({"op": "x" * 4000}).encode() + b"\n"  # each answer ~4 KB, never read: the buffers fill
    s.settimeout(0.2)
    deadline = time.monotonic() + 5
    try:
        while sweeps.lease is not None and time.monotonic() < deadline:
            s.sendall(big)
    except OSError:
        pass  # closed by the daemon (or our own buffer full): either way the lease must end now
    while sweeps.lease is not None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert sweeps.lease is None  # closed, its lease ended: no half-sent answer left to garble the next


def test_a_request_its_caller_gave_up_on_is_dropped(tmp_path, monkeypatch):
    # the main loop came back after ANSWER_S: the connection that asked begin has gone; a late begin would leave
    # a lease nobody holds (and the GPUs held) until it ran out
    cfg = config.parse_text("gpu: {backend: sim, scenario: h100-nvswitch}\n", name="x.yaml")
    backend = open_configured(cfg, ManualClock(20))
    monkeypatch.setenv("STATE_DIRECTORY", str(tmp_path / "state"))
    sweeps = Sweeps(TuningLife(backend, cfg, Tuner(backend)))
    server = control.ControlServer(tmp_path / "run" / "control.sock", lambda: None)
    server.start()
    try:
        monkeypatch.setattr(control, "ANSWER_S", 0.1)
        answer = server._ask({"op": "begin", "setting": "power_limit_w", "gpus": [0], "lease_s": 5}, "x", object())
        assert "did not answer in time" in answer["error"]
        server.serve(sweeps)  # the loop, late
        assert sweeps.lease is None and not sweeps.tuning.held
    finally:
        server.stop()
