"""Attacks on issue 41's new surfaces, as a local user or a foreign server would make them:

- the simulator's served-workload channel (gpu/sim/power.py, GPUWARDEN_SIM_STATE): load.json and gpus.json in a
  folder another local user owns and writes, read by a daemon that runs with the unit's capabilities (no
  CAP_DAC_OVERRIDE), by doctor and by bench's local GPU view;
- the daemon's /status as `gpuwarden status` and `gpuwarden bench` read it, from whatever answers on the metrics
  port: GPM figures that are strings, bools, negative, NaN, 1e308 or 400-digit integers, nesting past Python's
  recursion limit, a gigabyte, a server that trickles.

Each is a real process where the fault is between processes; nothing is left running."""

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from conftest import DaemonProcess, free_port, gpuwarden_cmd, subprocess_env
from gpuwarden import config
from gpuwarden.backends import open_configured
from gpuwarden.bench.watch import MAX_GPUS, Watch, checked_gpus
from gpuwarden.gpu.sim import power
from gpuwarden.gpu.sim.backend import ManualClock
from gpuwarden.web.status import StatusError
from harness.run_queue import CpuWait

HERE = Path(__file__).resolve().parent
UNIT_CAPS = ["setpriv", "--bounding-set", "-all,+sys_admin,+setuid,+setgid,+kill", "--no-new-privs"]
AS_NOBODY = ["setpriv", "--reuid", "nobody", "--regid", "nogroup", "--clear-groups"]
BIG = int("9" * 400)  # a JSON integer Python reads, and no float holds
BIG_TEXT = "9" * 400


def needs_root_and_setpriv():
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root (to act as another local user) and setpriv")


# -- the simulator's channel, written by another local user ---------------------------------------------------------

def as_nobody(script: str, *args: str) -> None:
    """Run a small Python script as the user nobody (the local attacker), its files its own."""
    subprocess.run([*AS_NOBODY, sys.executable, "-c", script, *args], check=True, timeout=30,
                   env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")})


PLANT = """
import os, sys
folder, name, kind, text = sys.argv[1:5]
path = os.path.join(folder, name)
tmp = path + ".planting"
if os.path.lexists(tmp):
    os.unlink(tmp)
if kind == "file":
    with open(tmp, "w") as f:
        f.write(text)
elif kind == "fifo":
    os.mkfifo(tmp)
elif kind == "link":
    os.symlink(text, tmp)
elif kind == "dir":
    os.mkdir(tmp)
    if os.path.lexists(path) and not os.path.isdir(path):
        os.unlink(path)
if os.path.isdir(path) and not os.path.islink(path):
    os.rmdir(path)
os.rename(tmp, path)
"""


def plant(folder: Path, name: str, kind: str, text: str = "") -> None:
    as_nobody(PLANT, str(folder), name, kind, text)


@pytest.fixture
def nobody_channel():
    """A channel folder the user nobody owns (0755), in a folder every user may pass through (pytest's tmp_path
    is root's own, 0700)."""
    needs_root_and_setpriv()
    outer = Path(tempfile.mkdtemp(prefix="gpuwarden-attack41-"))
    try:
        outer.chmod(0o755)
        chan = outer / "chan"
        chan.mkdir()
        shutil.chown(chan, "nobody")
        yield chan
    finally:
        shutil.rmtree(outer, ignore_errors=True)


def sim_config(scenario: str = "h100-nvswitch", listen: str = "none"):
    return config.parse_text(f"gpu:\n  backend: sim\n  scenario: {scenario}\nmetrics:\n  listen: {listen}\n")


HOSTILE_LOADS = [
    '{"open": 0, "at": %s}' % BIG_TEXT,  # OverflowError: int too large to convert to float, in every sample
    '{"open": 0, "at": -%s}' % BIG_TEXT,
    '{"open": 0, "at": NaN}', '{"open": 0, "at": Infinity}', '{"open": 0, "at": true}',
    '{"open": 1, "prefill_share": %s}' % BIG_TEXT, '{"open": 1, "prefill_share": NaN}',
    '{"open": 1, "prefill_share": -5}', '{"open": 1, "prefill_share": true}', '{"open": 1, "prefill_share": "x"}',
    '{"open": 1, "prefill_share": [[0.5]]}', '{"open": %s}' % BIG_TEXT, '{"open": "1"}', '[' * 30000,
    '{"open": 1, "at": 1e308, "prefill_share": 1e308}',
]


def test_the_load_file_is_read_without_arithmetic_on_what_it_says(tmp_path):
    """Every hostile load.json reads as a load or as nothing: never an exception out of read_load (a sample's)."""
    for text in HOSTILE_LOADS:
        (tmp_path / "load.json").write_text(text)
        load = power.read_load(tmp_path)  # before: OverflowError for the 400-digit "at"
        assert load is None or (isinstance(load.busy, bool) and load.prefill_share in (None,)), (text, load)
    # a share the workload may say is still read
    (tmp_path / "load.json").write_text('{"open": 2, "prefill_share": 0.25}')
    assert power.read_load(tmp_path) == power.Load(True, 0.25)
    (tmp_path / "load.json").write_text(json.dumps({"open": 0, "at": time.monotonic()}))
    assert power.read_load(tmp_path) == power.Load(True, None)  # gone idle a moment ago: the busy hold


HOSTILE_GPUS = ['{"gpus": 5}', '{"gpus": "ab"}', '{"gpus": {"0": {}}}', '{"gpus": [5, null, []]}',
                '{"gpus": [{"index": 0, "gpu_lock": [1000, %s]}]}' % BIG_TEXT,
                '{"gpus": [{"index": 0, "gpu_lock": [1000, 1e308]}]}',
                '{"gpus": [{"index": 0, "gpu_lock": [-5, -5]}]}', '{"gpus": [{"index": 0, "gpu_lock": [1500, 1000]}]}',
                '{"gpus": [{"index": 0, "gpu_lock": [true, true]}]}', '{"gpus": [{"index": 0, "gpu_lock": [0, 0]}]}',
                '{"gpus": [{"index": 0, "power_limit_w": true}]}', '{"gpus": [{"index": 0, "power_limit_w": NaN}]}',
                '{"gpus": [{"index": [0], "power_limit_w": 500}]}']


def test_a_hostile_settings_file_is_ignored_and_the_simulated_cards_start_as_the_driver_left_them(tmp_path,
                                                                                                    monkeypatch):
    monkeypatch.setenv(power.ENV, str(tmp_path))
    for text in HOSTILE_GPUS:
        (tmp_path / "gpus.json").write_text(text)
        backend = open_configured(sim_config(), ManualClock())  # before: TypeError, OverflowError at the start
        gpu = backend.gpus()[0]
        sample = gpu.sample()
        assert gpu.gpu_lock is None, (text, gpu.gpu_lock)  # never -5 MHz, a lock past its top, or True MHz
        assert sample.up and sample.sm_clock_mhz > 0 and sample.power_limit_w == gpu.model.default_power_limit_w
    # a lock the card takes still comes back, as after a daemon killed mid-sweep
    (tmp_path / "gpus.json").write_text('{"gpus": [{"index": 0, "gpu_lock": [1000, 1500], "power_limit_w": 500}]}')
    gpu = open_configured(sim_config(), ManualClock()).gpus()[0]
    assert gpu.gpu_lock == (1000, 1500) and gpu.power_limit_w == 500


HOSTILE_CLOCKS = ['{"to_s": 5, "at": %s}' % BIG_TEXT, '{"to_s": %s, "at": 1}' % BIG_TEXT, '{"to_s": Infinity, "at": 1}',
                  '{"to_s": 5, "at": NaN}', '{"to_s": true, "at": true}', '{"to_s": 1e300, "at": -1e300}']


def test_a_hostile_clock_file_never_stops_nor_breaks_the_simulated_timeline(tmp_path):
    """clock.json (a test moves the timeline on, power.move_clock) is in the same folder: a 400-digit "at" raised
    OverflowError out of every sample, Infinity put the timeline at infinity for good."""
    now = power.movable(lambda: 10.0, tmp_path)
    for text in HOSTILE_CLOCKS:
        (tmp_path / "clock.json").write_text(text)
        assert now() == 10.0, text
    power.move_clock(tmp_path, 100.0)
    assert 100.0 <= now() < 101.0  # a real move still moves it


@pytest.mark.process
def test_doctor_on_a_channel_another_user_filled_prints_its_gpm_lines_not_a_traceback(tmp_path, nobody_channel):
    chan = nobody_channel
    conf = tmp_path / "d.yaml"
    conf.write_text("gpu: {backend: sim, scenario: h100-nvswitch}\nmetrics: {listen: none}\n")
    env = {**subprocess_env(), power.ENV: str(chan), "STATE_DIRECTORY": str(tmp_path / "state")}
    for gpus, load in (('{"gpus": 5}', HOSTILE_LOADS[0]),
                       ('{"gpus": [{"index": 0, "gpu_lock": [1000, %s]}]}' % BIG_TEXT, '{"open": 1}')):
        plant(chan, "gpus.json", "file", gpus)
        plant(chan, "load.json", "file", load)
        out = subprocess.run([*UNIT_CAPS, *gpuwarden_cmd(), "doctor", "-c", str(conf)], capture_output=True,
                             text=True, env=env, timeout=120)
        assert "Traceback" not in out.stderr + out.stdout, out.stderr
        assert "GPU0 GPM" in out.stdout and "SM " in out.stdout, out.stdout


@pytest.mark.process
def test_a_channel_another_user_owns_and_rewrites_leaves_the_daemon_polling_under_the_units_capabilities(
        tmp_path, daemons, nobody_channel):
    """The channel's folder is nobody's, so the daemon (root without CAP_DAC_OVERRIDE) cannot write gpus.json there
    and reads whatever nobody puts: a lock no float holds at its start, then every hostile load.json, a FIFO, a
    link to /dev/zero and a folder in its place. Before: the daemon did not start (OverflowError); started on a good
    file, every poll failed from the first hostile load on ("poll failed", "not feeding the watchdog")."""
    chan = nobody_channel
    plant(chan, "gpus.json", "file", '{"gpus": [{"index": 0, "gpu_lock": [1000, %s]}]}' % BIG_TEXT)
    plant(chan, "load.json", "file", HOSTILE_LOADS[0])
    port = free_port()
    conf = tmp_path / "g.yaml"
    conf.write_text(f"gpu: {{backend: sim, scenario: h100-nvswitch}}\npoll_interval_s: 0.25\n"
                    f"metrics: {{listen: '127.0.0.1:{port}'}}\n")
    env = {**subprocess_env(), power.ENV: str(chan), "STATE_DIRECTORY": str(tmp_path / "state"),
           "RUNTIME_DIRECTORY": str(tmp_path / "run")}
    d = daemons(conf, env=env, command=[*UNIT_CAPS, *gpuwarden_cmd()])
    d.wait_for("serving /metrics", timeout=60)
    cpu = CpuWait(d.proc.pid)
    plants = [("file", text) for text in HOSTILE_LOADS[1:]] + [("fifo", ""), ("link", "/dev/zero"), ("dir", ""),
                                                                ("file", HOSTILE_LOADS[0])]
    for kind, text in plants:
        plant(chan, "load.json", kind, text)
        time.sleep(0.3)  # more than a poll
    for text in HOSTILE_CLOCKS:
        plant(chan, "clock.json", "file", text)
        time.sleep(0.3)
    time.sleep(1.0)
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/status", timeout=5) as reply:
        state = json.loads(reply.read())
    assert state["daemon"]["stale"] is False and state["daemon"]["snapshot_age_seconds"] < 2, state["daemon"]
    gpu = state["gpus"][0]
    assert gpu["sm_lock_mhz"] is None and 0 < gpu["sm_clock_mhz"] <= gpu["max_sm_clock_mhz"], gpu
    waited = cpu.since()
    assert d.stop() == 0
    log = "\n".join(d.lines)
    for bad in ("Traceback", "poll failed"):
        assert bad not in log, log[-3000:]
    # A poll the files held up past the watchdog's 2.25 s shows; one the busy box starved is excused by the
    # daemon's wait for a CPU meanwhile (ci49: 2.8 s on a box running the newest pass beside a CPU vLLM).
    stalls = [float(m) for m in re.findall(r"no poll published for ([0-9.]+) s: not feeding the watchdog", log)]
    assert max(stalls, default=0.0) - waited < 2.25, f"polls stalled {stalls} s; the daemon waited {waited:.2f} s " \
                                                      f"for a CPU"
    assert not any(p.name.startswith(".gpus.json.") for p in chan.iterdir())  # no temp file of ours left there


# -- a foreign /status, as `gpuwarden status` and bench read it -----------------------------------------------------

def good_gpu(**fields):
    return {"index": 0, "name": "H100", "up": True, "sm_clock_mhz": 1980, "memory_clock_mhz": 2619,
            "max_sm_clock_mhz": 1980, "power_w": 500.0, "power_limit_w": 700.0, "temperature_c": 60,
            "utilization_pct": 100.0, "memory_bandwidth_bytes_per_s": 3.35e12, "clock_event_reasons": [],
            "sm_lock_mhz": None, "sm_active_ratio": 0.6, "tensor_active_ratio": 0.2, "dram_bandwidth_ratio": 0.8,
            **fields}


def state_of(*gpus, **daemon):
    return json.dumps({"daemon": {"version": "x", "pid": 1, "started_at": time.time(), **daemon},
                       "status": "ok", "gpus": list(gpus), "alerts_firing": []}).encode()


def raw_state(gpu_text: str, daemon_text: str = '{"version": "x"}') -> bytes:
    """A /status written by hand: what json.dumps would not write (NaN, 400-digit integers)."""
    return f'{{"daemon": {daemon_text}, "status": "ok", "gpus": [{gpu_text}], "alerts_firing": []}}'.encode()


def figure(name: str, text: str) -> bytes:
    base = json.dumps(good_gpu())[:-1]
    return raw_state(f'{base}, "{name}": {text}}}')


# (what, the body or a mode): each answered in turn, one per request
BAD_FIGURES = [
    ("a string", figure("sm_active_ratio", '"x"')),
    ("400 digits", figure("sm_active_ratio", BIG_TEXT)),
    ("1e308", figure("tensor_active_ratio", "1e308")),
    ("negative", figure("dram_bandwidth_ratio", "-5")),
    ("a bool", figure("sm_active_ratio", "true")),
    ("NaN", figure("sm_active_ratio", "NaN")),
    ("Infinity", figure("dram_bandwidth_ratio", "-Infinity")),
    ("nested lists", figure("tensor_active_ratio", "[[0.5]]")),
    ("power of 400 digits", figure("power_w", BIG_TEXT)),
    ("started_at of 400 digits", raw_state(json.dumps(good_gpu()), '{"started_at": %s}' % BIG_TEXT)),
]
BAD_BODIES = [
    ("nesting past the recursion limit", b'{"daemon": {}, "gpus": ' + b"[" * 200_000 + b"]" * 200_000 + b"}"),
    ("a gigabyte announced", ("length", 10**9)),
    ("a gigabyte streamed", ("stream", 10**9)),
    ("a trickle", ("trickle", 10.0)),
]


class Hostile(BaseHTTPRequestHandler):
    answers: list = []  # bodies or (mode, n), served in turn
    served = [0]

    def log_message(self, *args):
        pass

    def do_GET(self):
        if self.path != "/status":
            self.send_error(404)
            return
        answer = self.answers[self.served[0] % len(self.answers)]
        self.served[0] += 1
        try:
            if isinstance(answer, bytes):
                self.send_response(200)
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)
                return
            mode, n = answer
            self.send_response(200)
            if mode == "length":
                self.send_header("Content-Length", str(n))
            self.end_headers()
            if mode in ("length", "stream"):
                chunk = b'{"daemon": {}, "gpus": [' + b" " * (1 << 20)
                sent = 0
                while sent < n:
                    self.wfile.write(chunk)
                    sent += len(chunk)
            else:  # a byte a second, for n seconds
                self.wfile.write(b'{"daemon": {},')
                end = time.monotonic() + n
                while time.monotonic() < end:
                    self.wfile.write(b" ")
                    self.wfile.flush()
                    time.sleep(1)
        except OSError:  # the client gave up, as it should
            pass


@pytest.fixture
def hostile_status():
    servers = []

    def start(answers):
        handler = type("H", (Hostile,), {"answers": list(answers), "served": [0]})
        server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        server.daemon_threads = True
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


@pytest.mark.process
@pytest.mark.parametrize("what,answer", BAD_FIGURES + BAD_BODIES, ids=[w for w, _ in BAD_FIGURES + BAD_BODIES])
def test_status_from_a_foreign_server_is_one_line_naming_what_and_where(what, answer, hostile_status, tmp_path):
    server = hostile_status([answer])
    conf = tmp_path / "s.yaml"
    conf.write_text(f"gpu: {{backend: sim, scenario: dgx-spark}}\nmetrics: {{listen: '127.0.0.1:"
                    f"{server.server_address[1]}'}}\n")
    started = time.monotonic()
    out = subprocess.run([*gpuwarden_cmd(), "status", "-c", str(conf)], capture_output=True, text=True,
                         env={**subprocess_env(), "STATE_DIRECTORY": str(tmp_path / "state")}, timeout=60)
    took = time.monotonic() - started
    assert out.returncode == 3 and out.stdout == "", (what, out)
    assert len(out.stderr.splitlines()) == 1 and "Traceback" not in out.stderr, (what, out.stderr)
    assert f"127.0.0.1:{server.server_address[1]}" in out.stderr, out.stderr
    assert took < 20, took  # the read's 3 s deadline, and the interpreter's start
    if answer in dict(BAD_FIGURES).values() and "started_at" not in what and "power" not in what:
        assert "GPU 0" in out.stderr and "is not a share 0..1" in out.stderr, out.stderr  # names the figure


def test_bench_checks_each_gpu_of_a_status_and_keeps_only_what_it_reads():
    url = "http://127.0.0.1:1"
    good = json.loads(state_of(good_gpu(junk="x" * 100_000, name="H" * 10_000)))["gpus"]
    kept = checked_gpus(good, url)
    assert kept[0]["sm_active_ratio"] == 0.6 and "junk" not in kept[0] and len(kept[0]["name"]) <= 256
    assert checked_gpus(None, url) is None  # an older daemon, or none: a poll fewer
    assert checked_gpus([{"index": 1, "up": False, "name": "H100"}], url)[0]["power_w"] is None  # a GPU down
    bad = [("gpus", "abc"), ("gpus", 5), ("gpus", {"a": 1}), ("gpus", [5]), ("index", None), ("index", [0]),
           ("index", True), ("index", -1), ("index", MAX_GPUS), ("sm_active_ratio", "x"), ("sm_active_ratio", BIG),
           ("tensor_active_ratio", 1e308), ("dram_bandwidth_ratio", -5), ("sm_active_ratio", True),
           ("sm_active_ratio", float("nan")), ("tensor_active_ratio", [[1]]), ("power_w", 1e308), ("power_w", "x"),
           ("utilization_pct", "x"), ("sm_clock_mhz", float("inf")), ("clock_event_reasons", 5),
           ("clock_event_reasons", [[1]]), ("sm_lock_mhz", "ab"), ("sm_lock_mhz", [1, BIG]), ("name", ["x"])]
    for field, value in bad:
        gpus = value if field == "gpus" else [good_gpu(**{field: value})]
        with pytest.raises(StatusError, match=f"{url}/status") as caught:
            checked_gpus(gpus, url)
        assert len(str(caught.value).splitlines()) == 1 and len(str(caught.value)) < 300, str(caught.value)
        assert field in str(caught.value), (field, str(caught.value))
    with pytest.raises(StatusError, match=f"more than {MAX_GPUS} GPUs"):  # memory: every poll is kept a step
        checked_gpus([good_gpu(index=i % MAX_GPUS) for i in range(100_000)], url)


def test_a_watch_whose_reader_refuses_polls_says_so_once_and_summarizes_the_rest():
    answers = iter([[good_gpu()], "abc"] * 3)
    watch = Watch(lambda: checked_gpus(next(answers), "http://h:1"), None, None, interval_s=0.01)
    for _ in range(6):
        watch._poll_once()
    assert len(watch._polls.gpus[0]) == 3
    assert watch.refusals() == ["the GPU view refused 3 of 6 answers from the daemon's /status, the first: "
                                "http://h:1/status: gpus is 'abc', not a list of GPUs"]


@pytest.mark.process
def test_bench_reading_a_foreign_status_never_crashes_and_says_what_it_refused(hostile_status, tmp_path):
    """bench takes the first answer for a daemon's and then polls it: every bad answer is a poll fewer, said once
    under the table, never a traceback from the poll thread or the step's end. Before: "Exception in thread
    bench-watch" (TypeError, KeyError, OverflowError, RecursionError) on the first, and no GPU figures after it."""
    good = state_of(good_gpu())
    bad = [dict(BAD_FIGURES)[w] for w in ("a string", "400 digits", "1e308", "power of 400 digits")]
    bad += [dict(BAD_BODIES)[w] for w in ("nesting past the recursion limit", "a gigabyte streamed")]
    bad += [state_of(good_gpu(index="0")), b'{"daemon": {}, "gpus": "abc"}', b'{"daemon": {}, "gpus": [5]}']
    answers = [good]
    for answer in bad:
        answers += [answer, good]
    server = hostile_status(answers)
    port = free_port()
    fake = subprocess.Popen([sys.executable, str(HERE / "harness" / "fake_openai.py"), "--port", str(port),
                             "--token-delay", "0.01"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert fake.stdout.readline().strip() == "listening"
        conf = tmp_path / "b.yaml"
        conf.write_text(f"gpu: {{backend: sim, scenario: rtx-pro-4000-headless}}\nmetrics: {{listen: '127.0.0.1:"
                        f"{server.server_address[1]}'}}\n")
        out = subprocess.run([*gpuwarden_cmd(), "bench", "-c", str(conf), "--url", f"http://127.0.0.1:{port}",
                              "--concurrency", "1,2", "--duration", "5", "--idle", "1", "--json"],
                             capture_output=True, text=True, timeout=180,
                             env={**subprocess_env(), "STATE_DIRECTORY": str(tmp_path / "state")})
    finally:
        fake.terminate()
        fake.wait(10)
    assert "Traceback" not in out.stderr and "Exception in thread" not in out.stderr, out.stderr[-4000:]
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout)
    assert result["gpu_source"].startswith("the daemon's /status")
    assert server.RequestHandlerClass.served[0] >= len(answers)  # every answer was read
    for step in result["steps"]:
        gpu = step["gpus"][0]
        assert gpu["polls"] >= 1 and gpu["sm_active_ratio_mean"] == 0.6, gpu  # the good answers only
        assert step["activity"]["bound"] == "memory", step["activity"]
    refused = [n for n in result["notes"] if n.startswith("the GPU view refused")]
    assert len(refused) == 1 and f"127.0.0.1:{server.server_address[1]}/status" in refused[0], result["notes"]


@pytest.mark.process
def test_bench_against_a_status_that_trickles_ends_its_steps_on_time(hostile_status, tmp_path):
    server = hostile_status([state_of(good_gpu()), ("trickle", 30.0)])
    port = free_port()
    fake = subprocess.Popen([sys.executable, str(HERE / "harness" / "fake_openai.py"), "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert fake.stdout.readline().strip() == "listening"
        conf = tmp_path / "b.yaml"
        conf.write_text(f"gpu: {{backend: sim, scenario: rtx-pro-4000-headless}}\nmetrics: {{listen: '127.0.0.1:"
                        f"{server.server_address[1]}'}}\n")
        started = time.monotonic()
        out = subprocess.run([*gpuwarden_cmd(), "bench", "-c", str(conf), "--url", f"http://127.0.0.1:{port}",
                              "--concurrency", "1", "--duration", "2", "--idle", "0", "--json"],
                             capture_output=True, text=True, timeout=120,
                             env={**subprocess_env(), "STATE_DIRECTORY": str(tmp_path / "state")})
        took = time.monotonic() - started
    finally:
        fake.terminate()
        fake.wait(10)
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert took < 60, took  # each poll's 2 s deadline, not the server's 30 s
    notes = json.loads(out.stdout)["notes"]
    # the deadline said as httpget met it: between reads ("within 2 s") or in one ("timed out")
    assert any(n.startswith("the GPU view refused") and ("within 2 s" in n or "timed out" in n) for n in notes), notes


# -- NVML's own answers ----------------------------------------------------------------------------------------------

def test_a_finite_rate_that_scales_past_a_float_is_no_reading_not_infinity():
    """NVML's MiB/s times 2^20 overflows a double from 1.7e302 on: the finite check came before the scaling, so such a
    rate was exported as +Inf and written into /status as `Infinity` (not JSON to a strict reader)."""
    from harness.fake_nvml import FakeNvml, device
    from gpuwarden.gpu.nvml import NvmlBackend
    from test_gpm import MATMUL

    fake = FakeNvml([device("GPU-aaa", "00000000:18:00.0", gpm={**MATMUL, 20: 1e308, 21: 1e300})])
    gpu = NvmlBackend(nvml=fake, clock=ManualClock()).gpus()[0]
    gpu.sample(True)
    sample = gpu.sample(True)
    assert sample.pcie_tx_bytes_per_s is None  # before: inf
    assert sample.pcie_rx_bytes_per_s == pytest.approx(1e300 * 2**20)
    assert sample.sm_active_ratio == pytest.approx(0.95)
    json.dumps(sample.as_dict(), allow_nan=False)


def test_bench_keeps_only_the_engine_counters_it_reads_of_a_huge_metrics_page():
    """A server at bench's --url may answer /metrics with 8 MiB (fetch's cap) of distinct names: 850,000 parsed,
    about 100 MB, and bench kept every scrape until the step's end (one each 2 s: gigabytes over a minute's step)."""
    from gpuwarden.serving.compose.engines import engine_for
    from gpuwarden.serving.probe.metrics import MAX_BYTES

    names = engine_for("vllm").metric_names
    page = [f"{names.generation_tokens} 5\n", f"{names.requests_running} 2\n"]
    size, i = 0, 0
    while size < MAX_BYTES - 4096:
        line = f"junk_{i} 1\n"
        page.append(line)
        size, i = size + len(line), i + 1

    class Metrics(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_GET(self):
            body = "".join(page).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Metrics)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        watch = Watch(None, f"http://127.0.0.1:{server.server_address[1]}/metrics", names)
        scraped = watch._scrape()
    finally:
        server.shutdown()
        server.server_close()
    assert scraped == {names.generation_tokens: 5.0, names.requests_running: 2.0}
