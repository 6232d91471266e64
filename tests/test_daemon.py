"""The daemon as a real process: journal lines, sd_notify, /metrics, /status and signals."""

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from conftest import DEFAULT_CONFIG, free_port, gpuwarden_cmd, subprocess_env
from gpuwarden.base.systemd import JournalFormatter, stderr_is_journal


def write_config(write, text="", name="gpuwarden.yaml"):
    port = free_port()
    path = write(name, f"poll_interval_s: 0.5\nalerts:\n  for_s: 1\nmetrics:\n  listen: 127.0.0.1:{port}\n{text}")
    return path, f"http://127.0.0.1:{port}"


def get(url, timeout=5.0):
    with urllib.request.urlopen(url, timeout=timeout) as reply:
        return reply.read().decode()


def scrape(base):
    return {m.name: m for m in text_string_to_metric_families(get(base + "/metrics"))}


def value_becomes(base, metric, want, timeout=60, **labels):
    """Scrape until metric{labels} reads want (a poll publishes it: when, on a busy box, is not the test's to say);
    a bound on a hang."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            seen = value(scrape(base), metric, **labels)
        except KeyError:
            seen = None
        if seen == want:
            return
        assert time.monotonic() < deadline, f"{metric}{labels} is {seen}, not {want}"
        time.sleep(0.1)


def value(families, metric, **labels):
    for family in families.values():
        for s in family.samples:
            if s.name == metric and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    raise KeyError(f"{metric}{labels}")


@pytest.mark.process
def test_done_when_read_only_warns_after_for_s_and_metrics_agree(write, daemons):
    """A read-only daemon on busy cards at 180 MHz warns sm_clock_low for both GPUs, after its first poll's
    reading and no sooner than for_s (1 s) after it started: a busy box can only make that later. When it fires
    is proven on the clock the test drives (test_monitor.py's
    test_read_only_headless_card_fires_clock_low_for_each_busy_gpu: at t=1.0 s exactly)."""
    path, base = write_config(write, "tuning:\n  apply: false\n")
    started = time.monotonic()
    d = daemons(path, "--sim", "rtx-pro-4000-headless")
    served = d.wait_index("serving /metrics", timeout=60)
    reading = d.wait_index("INFO GPU0 sm ", after=served, timeout=60)  # the first poll's reading of both GPUs
    first = d.wait_index("sm_clock_low firing", after=reading, timeout=60)
    second = d.wait_index("sm_clock_low firing", after=first + 1, timeout=60)
    assert time.monotonic() - started >= 1.0  # for_s: a lower bound only (the start-up alone takes about that)
    assert sorted(d.lines[i].split()[3] for i in (first, second)) == ["GPU0", "GPU1"], d.lines[first:second + 1]
    families = scrape(base)
    assert value(families, "gpuwarden_alert_active", alert="sm_clock_low", gpu="0") == 1
    assert value(families, "gpuwarden_alert_active", alert="sm_clock_low", gpu="1") == 1
    assert d.stop() == 0


@pytest.mark.process
def test_done_when_applied_locks_raise_no_clock_alert(write, daemons):
    path, base = write_config(write)
    d = daemons(path, "--sim", "rtx-pro-4000-headless")
    d.wait_for("serving /metrics")
    time.sleep(3)  # six polls, well past for_s
    families = scrape(base)
    assert "sm_clock_low firing" not in d.log
    assert value(families, "gpuwarden_alert_active", alert="sm_clock_low", gpu="0") == 0
    assert value(families, "gpuwarden_gpu_sm_clock_hertz", gpu="0") == 3090e6
    assert value(families, "gpuwarden_gpu_sm_clock_lock_hertz", gpu="0") == 3090e6
    assert d.stop() == 0


@pytest.mark.process
def test_metrics_cover_the_contract(write, daemons):
    path, base = write_config(write, "counters_interval_s: 1\n")
    d = daemons(path, "--sim", "rtx-pro-4000-headless")
    d.wait_for("serving /metrics")
    names = ("gpuwarden_build_info", "gpuwarden_gpu_info", "gpuwarden_gpu_up", "gpuwarden_gpu_sm_clock_hertz",
                 "gpuwarden_gpu_sm_clock_max_hertz", "gpuwarden_gpu_memory_clock_hertz",
                 "gpuwarden_gpu_power_watts", "gpuwarden_gpu_power_limit_watts", "gpuwarden_gpu_energy_joules",
                 "gpuwarden_gpu_temperature_celsius", "gpuwarden_gpu_utilization_ratio",
                 "gpuwarden_gpu_memory_used_bytes", "gpuwarden_gpu_memory_total_bytes",
                 "gpuwarden_gpu_clock_event_active", "gpuwarden_gpu_clock_event_seconds",
                 "gpuwarden_gpu_persistence_mode", "gpuwarden_alert_active", "gpuwarden_alert_transitions",
                 "gpuwarden_tuning_reapplies", "gpuwarden_sample_duration_seconds", "gpuwarden_loop_lag_seconds")
    deadline = time.monotonic() + 60  # until the first polls and the first energy reading are published: a bound
    while True:  # on a hang (how soon is the box's business)
        families = scrape(base)
        missing = [name for name in names if name not in families]
        try:
            energy = value(families, "gpuwarden_gpu_energy_joules_total", gpu="0")
        except KeyError:
            energy = None
        if not missing and energy:
            break
        assert time.monotonic() < deadline, (missing, energy)
        time.sleep(0.1)
    assert families["gpuwarden_gpu_energy_joules"].type == "counter"
    assert value(families, "gpuwarden_gpu_info", gpu="0", name="NVIDIA RTX PRO 4000 Blackwell",
                 compute_capability="12.0") == 1
    assert value(families, "gpuwarden_gpu_power_limit_watts", gpu="0") == 145
    assert value(families, "gpuwarden_gpu_utilization_ratio", gpu="1") == pytest.approx(0.6)
    assert value(families, "gpuwarden_gpu_persistence_mode", gpu="0") == 1
    assert value(families, "gpuwarden_gpu_clock_event_active", gpu="0", reason="SwPowerCap") == 0
    assert value(families, "gpuwarden_gpu_energy_joules_total", gpu="0") > 0
    d.stop()


@pytest.mark.process
def test_promtool_accepts_the_scrape(write, daemons, tmp_path):
    promtool = shutil.which("promtool")
    if promtool is None:
        if os.environ.get("CI") == "true":
            pytest.fail("promtool is missing under CI=true: tests/run installs Debian's prometheus package")
        pytest.skip("promtool not installed (tests/run installs it)")
    path, base = write_config(write, "tuning:\n  apply: false\n")
    d = daemons(path, "--sim", "thermal")
    d.wait_for("WARNING GPU0")
    text = get(base + "/metrics")
    proc = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.strip() == "" and proc.stderr.strip() == "", "promtool found lint problems"
    d.stop()


@pytest.mark.process
def test_status_command_shows_the_daemons_view(write, daemons, cli):
    path, base = write_config(write, "tuning:\n  apply: false\n")
    d = daemons(path, "--sim", "rtx-pro-4000-headless")
    d.wait_for("WARNING GPU1")
    status, out, _ = cli("status", "-c", path)
    assert status == 0
    assert "2 GPUs · read-only" in out.splitlines()[0]
    assert re.search(r"^0\s+NVIDIA RTX PRO 4000 Blackwell\s+healthy\s+180 / max 3090\s+405 / max 14001\s+27 / 145 W", out, re.M)
    assert "[warning] GPU1 sm_clock_low: SM clock 180 MHz while busy" in out
    status, out, _ = cli("status", "--json", "-c", path)
    state = json.loads(out)
    assert state["daemon"]["pid"] == d.proc.pid and len(state["gpus"]) == 2
    d.stop()
    status, out, _ = cli("status", "-c", path)
    assert status == 3 and out.strip() == f"gpuwarden is not running (nothing answers on {base})"


@pytest.mark.process
def test_journal_priority_prefixes_when_stderr_is_the_journal(write, tmp_path):
    path, _ = write_config(write, "tuning:\n  apply: false\nlog_interval_s: 3600\n")
    log_file = tmp_path / "journal"
    with open(log_file, "w") as stderr:
        st = os.fstat(stderr.fileno())
        env = dict(subprocess_env(), JOURNAL_STREAM=f"{st.st_dev}:{st.st_ino}")
        proc = subprocess.run(gpuwarden_cmd() + ["run", "-c", str(path), "--sim", "rtx-pro-4000-headless",
                                                  "--duration", "2"], stderr=stderr, env=env, timeout=60)
    assert proc.returncode == 0
    lines = log_file.read_text().splitlines()
    assert lines and all(re.match(r"<[2-7]>", line) for line in lines), lines
    warnings = [line for line in lines if line.startswith("<4>")]
    assert len(warnings) == 4  # sm and memory clock low on each GPU (read-only: persistence is not wanted)
    assert all(re.match(r"<4>GPU[01] GPU-\S+ (sm|memory)_clock_low firing: ", w) for w in warnings)
    # `journalctl -p warning` would show exactly the <0>-<4> lines: nothing chatty among them.
    assert not [line for line in lines if re.match(r"<[0-4]>", line) and "firing" not in line]


@pytest.mark.process
def test_plain_log_lines_without_journal(write):
    path, _ = write_config(write, "tuning:\n  apply: false\n")
    proc = subprocess.run(gpuwarden_cmd() + ["run", "-c", str(path), "--sim", "rtx-pro-4000-headless",
                                             "--duration", "6"], capture_output=True, text=True,
                          env=dict(subprocess_env(), JOURNAL_STREAM="1:2"), timeout=60)
    lines = proc.stderr.splitlines()
    assert lines and not any(line.startswith("<") for line in lines)
    assert any(re.match(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d WARNING GPU0 ", line) for line in lines)


def test_journal_formatter_and_detection(tmp_path):
    import logging

    record = logging.LogRecord("gpuwarden", logging.CRITICAL, __file__, 1, "GPU0 lost", None, None)
    assert JournalFormatter("%(message)s").format(record) == "<2>GPU0 lost"
    record.levelno = 25
    assert JournalFormatter("%(message)s").format(record) == "<5>GPU0 lost"
    with open(tmp_path / "f", "w") as f:
        st = os.fstat(f.fileno())
        assert stderr_is_journal({"JOURNAL_STREAM": f"{st.st_dev}:{st.st_ino}"}, f.fileno())
        assert not stderr_is_journal({"JOURNAL_STREAM": f"{st.st_dev}:{st.st_ino + 1}"}, f.fileno())
        assert not stderr_is_journal({}, f.fileno())


@pytest.fixture
def notify_socket(tmp_path):
    """A real AF_UNIX datagram socket, as systemd's NOTIFY_SOCKET is."""
    path = str(tmp_path / "notify.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    sock.settimeout(60)  # a bound on a hang
    yield sock, path
    sock.close()


@pytest.mark.process
def test_sd_notify_ready_status_watchdog_stopping(write, notify_socket):
    path, _ = write_config(write)
    sock, sock_path = notify_socket
    env = dict(subprocess_env(), NOTIFY_SOCKET=sock_path, WATCHDOG_USEC="400000")
    proc = subprocess.Popen(gpuwarden_cmd() + ["run", "-c", str(path), "--sim", "rtx-pro-4000-headless"],
                            stderr=subprocess.DEVNULL, env=env)
    try:
        messages = []
        deadline = time.monotonic() + 60  # a bound on a hang: the start and four pings take a second or two
        while time.monotonic() < deadline and sum(m == "WATCHDOG=1" for m in messages) < 4:
            messages.append(sock.recv(4096).decode())
        # The metrics socket goes to the fd store first (test_metrics_listener.py), before anything is tuned.
        assert messages.pop(0) == "FDSTORE=1\nFDNAME=metrics"
        first = messages[0].splitlines()
        # the sim's RTX PRO reports GPM: its SM, tensor and DRAM activity to the nearest 10%
        assert first[0] == "READY=1" and re.fullmatch(
            r"STATUS=2 GPUs · locked 3090 MHz · SM \d*0%, tensor \d*0%, DRAM \d*0% · ok", first[1]), first
        assert messages.count("WATCHDOG=1") >= 4
        proc.send_signal(signal.SIGTERM)
        while (m := sock.recv(4096).decode()) != "STOPPING=1":
            assert m == "WATCHDOG=1" or m.startswith("STATUS=")
        assert proc.wait(60) == 0
    finally:
        proc.kill()


@pytest.mark.process
def test_watchdog_pings_at_half_the_timeout(write, notify_socket):
    """WATCHDOG_USEC of 1 s and a poll every 5 s: the daemon pings between its polls, not only with them. Counted,
    not timed: when the tenth ping has come, at least three of them came between polls (a loop that pinged only
    when it polled would have polled nine times or ten by then). The cadence itself, a ping every 0.5 s, is proven
    on the clock the test drives (test_service_parts.py's
    test_the_loop_pings_the_watchdog_at_half_its_timeout_between_polls_and_reloads_at_the_next_poll)."""
    path, base = write_config(write, "poll_interval_s: 5\n")  # the poll alone would be far too slow
    path.write_text(path.read_text().replace("poll_interval_s: 0.5\n", ""))
    sock, sock_path = notify_socket
    env = dict(subprocess_env(), NOTIFY_SOCKET=sock_path, WATCHDOG_USEC="1000000")
    proc = subprocess.Popen(gpuwarden_cmd() + ["run", "-c", str(path), "--sim", "lock-lost"],
                            stderr=subprocess.DEVNULL, env=env)
    try:
        sock.settimeout(60)  # a bound on a hang: each message comes or the test fails
        pings = 0
        while pings < 10:
            pings += sock.recv(4096) == b"WATCHDOG=1"
        polls = json.loads(get(base + "/status"))["sequence"]
        assert 1 <= polls <= pings - 3, (polls, pings)
    finally:
        proc.kill()
        proc.wait(10)


@pytest.mark.process
def test_sighup_with_a_good_config_applies_new_tuning(write, daemons):
    path, base = write_config(write)
    d = daemons(path, "--sim", "rtx-pro-4000-headless")
    d.wait_for("serving /metrics")
    path.write_text(path.read_text() + "tuning:\n  gpu_clocks: [2400, 2400]\n")
    d.proc.send_signal(signal.SIGHUP)
    d.wait_for("config reloaded")
    d.wait_for("gpu_clocks: 3090 MHz now -> lock 2400-2400 MHz: verified")
    value_becomes(base, "gpuwarden_gpu_sm_clock_lock_hertz", 2400e6, gpu="1")
    assert d.stop() == 0 and "Traceback" not in d.log


@pytest.mark.process
def test_sighup_with_a_bad_config_keeps_running(write, daemons):
    path, base = write_config(write)
    d = daemons(path, "--sim", "rtx-pro-4000-headless")
    d.wait_for("serving /metrics")
    good = path.read_text()
    path.write_text(good + "tuning:\n  power_limit_w: 160\n")
    d.proc.send_signal(signal.SIGHUP)
    line = d.wait_for("reload failed")
    assert line.endswith(f"reload failed, still running the previous config: {path}:7: tuning.power_limit_w: "
                         "GPUs 0, 1 (NVIDIA RTX PRO 4000 Blackwell): "
                         "160 W is outside this GPU's power constraints (allowed 70-145 W)")
    path.write_text(good + "tuning: [\n")
    d.proc.send_signal(signal.SIGHUP)
    line = d.wait_for("(yaml): invalid YAML", after=len(d.lines) - 1)
    assert f"reload failed, still running the previous config: {path}:" in line
    assert value(scrape(base), "gpuwarden_gpu_up", gpu="0") == 1  # still serving
    assert d.stop() == 0 and "Traceback" not in d.log


def catches(pid, sig) -> bool:
    """Whether the process has a handler for sig (/proc's SigCgt mask)."""
    try:
        fields = dict(line.split(":\t", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
    except (OSError, ValueError):
        return False
    return bool(int(fields.get("SigCgt", "0"), 16) >> (sig - 1) & 1)


@pytest.mark.process
def test_a_sighup_during_start_up_is_a_reload_not_death(write, daemons):
    """Before the loop exists (imports, config, NVML: seconds on a busy host), SIGHUP used to end the daemon
    with 129 and no log line. Now it is held from the entry point on and carried out as a reload once the loop
    runs. The signal is sent the moment the process holds it: the daemon lives, serves, and then reloads, once.
    That the entry points hold it before any slow import, and that a held SIGHUP is the loop's first signal and a
    reload, is proven in the unit tier (test_service_parts.py: test_each_entry_point_holds_the_signals_before_any_
    slow_import, test_a_sighup_held_during_start_up_is_the_loops_first_signal_and_asks_for_a_reload)."""
    path, base = write_config(write)
    d = daemons(path, "--sim", "rtx-pro-4000-headless")
    deadline = time.monotonic() + 60  # a bound on a hang, not on a speed
    while not catches(d.proc.pid, signal.SIGHUP):
        assert time.monotonic() < deadline and d.proc.poll() is None, d.log
        time.sleep(0.002)
    d.proc.send_signal(signal.SIGHUP)
    served = d.wait_index("serving /metrics", timeout=60)
    d.wait_for("config reloaded", after=served, timeout=60)  # carried out by the loop, after the start
    assert d.proc.poll() is None
    assert d.stop() == 0 and "Traceback" not in d.log and d.log.count("config reloaded") == 1


@pytest.mark.process
def test_a_storm_of_sighups_costs_at_most_one_reload_per_poll(write, daemons):
    """100 SIGHUPs with the config flipping between two tunings: reloads are coalesced to at most one per poll,
    the polls stay on schedule, and the watchdog never goes hungry."""
    path, base = write_config(write)
    d = daemons(path, "--sim", "rtx-pro-4000-headless")
    d.wait_for("serving /metrics")
    texts = [path.read_text(), path.read_text() + "tuning:\n  gpu_clocks: [2400, 2400]\n"]
    began = time.monotonic()
    for i in range(100):
        path.write_text(texts[i % 2])
        d.proc.send_signal(signal.SIGHUP)
        time.sleep(0.01)
    path.write_text(texts[1])
    d.proc.send_signal(signal.SIGHUP)
    elapsed = time.monotonic() - began
    d.wait_for("lock 2400-2400 MHz: verified", after=0)
    value_becomes(base, "gpuwarden_gpu_sm_clock_lock_hertz", 2400e6, gpu="1")  # the last one won
    reloads = d.log.count("config reloaded")
    polls = elapsed / 0.5 + 4  # polls every 0.5 s while the storm lasted, and the ones after it
    assert 1 <= reloads <= polls, (reloads, elapsed)
    assert "no poll published" not in d.log
    assert d.stop() == 0 and "Traceback" not in d.log


@pytest.mark.process
def test_sighup_dropping_a_lock_resets_it(write, daemons):
    path, base = write_config(write)
    d = daemons(path, "--sim", "lock-lost")
    d.wait_for("serving /metrics")
    path.write_text(path.read_text() + "tuning:\n  gpu_clocks: none\n")
    d.proc.send_signal(signal.SIGHUP)
    d.wait_for("reload: no longer wanted, GPU 0 gpu_clocks")
    d.wait_for("config reloaded")
    value_becomes(base, "gpuwarden_gpu_sm_clock_hertz", 180e6, gpu="0")
    d.stop()


@pytest.mark.process
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_stop_signals_restore_when_configured_and_exit_0(write, daemons, sig):
    path, _ = write_config(write, "tuning:\n  restore_on_stop: true\n")
    d = daemons(path, "--sim", "rtx-pro-4000-headless")
    d.wait_for("serving /metrics")
    assert d.stop(sig) == 0
    assert "restore GPU 0 gpu_clocks" in d.log and "Traceback" not in d.log


@pytest.mark.process
def test_signals_at_start_up_leave_no_traceback(write):
    path, _ = write_config(write)
    cmd = gpuwarden_cmd() + ["run", "-c", str(path), "--sim", "rtx-pro-4000-headless"]
    # SIGTERM (what systemd sends) at any moment, from interpreter start on.
    for delay in (0.0, 0.05, 0.2, 0.4, 0.8):
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=subprocess_env())
        time.sleep(delay)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
        assert "Traceback" not in out, out
        assert proc.returncode in (0, -signal.SIGTERM), out
    # SIGINT (Ctrl-C) once our code runs: during start-up, and in the loop.
    for wait_for in ("before tuning", "serving /metrics"):
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=subprocess_env())
        out = ""
        while wait_for not in out:
            out += proc.stdout.readline()
        proc.send_signal(signal.SIGINT)
        rest, _ = proc.communicate(timeout=30)
        assert "Traceback" not in out + rest and proc.returncode in (0, 130), out + rest


# A local user holding the metrics port: the daemon starts anyway, and serves once the port is free.
HOLDER = ("import socket, sys; s = socket.create_server(('127.0.0.1', int(sys.argv[1]))); print('bound', flush=True); "
          "sys.stdin.readline()")


def notices(sock, want, unless=None):
    """The next sd_notify datagram that contains want (and not unless); the socket's timeout bounds the wait."""
    while True:
        data = sock.recv(4096).decode()
        if want in data and (unless is None or unless not in data):
            return data


@pytest.mark.process
def test_a_held_metrics_port_is_waited_for_while_the_daemon_tunes_and_runs(write, daemons, tmp_path):
    port = free_port()
    holder = subprocess.Popen(["setpriv", "--reuid", "nobody", "--regid", "nogroup", "--clear-groups",
                               "/usr/bin/python3", "-c", HOLDER, str(port)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        assert holder.stdout.readline() == "bound\n"
        notify.bind(str(tmp_path / "notify.sock"))
        notify.settimeout(30)
        runtime = tmp_path / "run"
        runtime.mkdir()
        path = write("g.yaml", f"poll_interval_s: 0.5\nmetrics:\n  listen: 127.0.0.1:{port}\n")
        env = dict(subprocess_env(), NOTIFY_SOCKET=str(tmp_path / "notify.sock"), RUNTIME_DIRECTORY=str(runtime))
        d = daemons(path, "--sim", "rtx-pro-4000-headless", env=env)
        line = d.wait_for(f"cannot serve metrics on 127.0.0.1:{port}: Address already in use")
        assert "user nobody" in line and " ERROR " in line, line
        ready = notices(notify, "READY=1")  # it started: tuned, polling, the watchdog fed
        assert "metrics not served" in ready and str(port) in ready, ready
        d.wait_for("tuning GPU 0 gpu_clocks:")  # tuned meanwhile
        assert not (runtime / "metrics-url").exists()
        holder.stdin.close()  # the holder lets go
        assert holder.wait(10) == 0
        line = d.wait_for(f"serving /metrics and /status on http://127.0.0.1:{port}")
        assert re.search(r"\(the port was held for \d+ s\)", line), line
        assert scrape(f"http://127.0.0.1:{port}")["gpuwarden_gpu_sm_clock_hertz"]
        assert (runtime / "metrics-url").read_text() == f"http://127.0.0.1:{port}\n"
        notices(notify, "STATUS=", unless="metrics not served")  # STATUS= says so no more
        assert d.log.count("cannot serve metrics") == 1, "one line, not one per try"
        assert "Traceback" not in d.log
        assert d.stop() == 0
    finally:
        holder.kill()
        holder.wait(10)
        notify.close()


@pytest.mark.process
def test_a_metrics_address_that_cannot_be_bound_is_one_line(write):
    path = write("g.yaml", "metrics:\n  listen: 192.0.2.1:9999\n")  # TEST-NET-1: no address of this host
    proc = subprocess.run(gpuwarden_cmd() + ["run", "-c", str(path), "--sim", "lock-lost"],
                          capture_output=True, text=True, env=subprocess_env(), timeout=60)
    assert proc.returncode == 1
    assert "gpuwarden: cannot serve metrics on 192.0.2.1:9999: Cannot assign requested address" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert "before tuning" not in proc.stderr and "gpu_clocks:" not in proc.stderr, "no GPU was touched"


def test_default_listen_is_loopback_off_the_other_exporters_ports():
    from gpuwarden import config

    host, port = config.load(DEFAULT_CONFIG).metrics.listen
    assert host == "127.0.0.1" and port not in (9400, 9835)


@pytest.mark.process
def test_persistence_left_to_nvidia_persistenced_raises_no_alert(write, daemons):
    # nvidia-persistenced runs with --no-persistence-mode: persistence reads off on every GPU, for good.
    path, base = write_config(write)
    path.write_text(path.read_text().replace("alerts:\n  for_s: 1\n", "alerts:\n  for_s: 0.5\n  reapply_min_interval_s: 1\n"))
    d = daemons(path, "--sim", "persistenced-no-persistence")
    d.wait_for("leaves persistence mode to it")
    time.sleep(3)  # many polls past for_s and the re-apply interval
    families = scrape(base)
    assert value(families, "gpuwarden_gpu_persistence_mode", gpu="0") == 0
    assert value(families, "gpuwarden_alert_active", alert="persistence_off", gpu="0") == 0
    assert "persistence_off" not in d.log and "re-applied tuning" not in d.log
    assert d.stop() == 0


def test_status_says_so_when_something_else_answers(write, cli):
    import http.server
    import threading

    class NotUs(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.send_header("Content-Length", "5")
            self.end_headers()
            self.wfile.write(b"hello")

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), NotUs)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        path = write("g.yaml", f"metrics:\n  listen: 127.0.0.1:{server.server_address[1]}\n")
        status, out, err = cli("status", "-c", path)
    finally:
        server.shutdown()
    assert status == 3 and out == ""
    assert err.strip() == (f"gpuwarden: something other than gpuwarden answers on "
                           f"http://127.0.0.1:{server.server_address[1]} (HTTP 200)")


@pytest.mark.process
def test_a_flapping_hardware_slowdown_alerts_through_the_daemon(write, daemons):
    path, base = write_config(write, "counters_interval_s: 1\ntuning:\n  apply: false\n")
    path.write_text(path.read_text().replace("alerts:\n  for_s: 1\n", "alerts:\n  for_s: 2\n"))
    d = daemons(path, "--sim", "hw-slowdown-flapping")
    line = d.wait_for("hw_slowdown firing", timeout=30)
    assert "held the clocks down" in line and "% of the last" in line
    assert value(scrape(base), "gpuwarden_alert_active", alert="hw_slowdown", gpu="0") == 1
    assert d.stop() == 0


@pytest.mark.process
def test_a_gpu_unreadable_at_start_is_locked_once_it_answers(write, daemons):
    path, base = write_config(write)
    d = daemons(path, "--sim", "gpu-lost-at-start")
    d.wait_for("is down, nothing planned for it")  # the plan's note
    line = d.wait_for("is back: planned and applied its tuning", timeout=15)
    assert line.split(" is back")[0].split()[-2] == "GPU1"
    assert re.search(r"gpu_clocks: 180 MHz now -> lock 3090-3090 MHz( \(auto: [^)]*\))?: ok", line), line
    value_becomes(base, "gpuwarden_gpu_sm_clock_hertz", 3090e6, gpu="1")
    value_becomes(base, "gpuwarden_gpu_sm_clock_lock_hertz", 3090e6, gpu="1")
    assert d.stop() == 0


@pytest.mark.process
def test_status_finds_the_daemon_after_a_reload_changed_metrics_listen(write, daemons, tmp_path):
    runtime = tmp_path / "run"
    runtime.mkdir()
    env = dict(subprocess_env(), RUNTIME_DIRECTORY=str(runtime))
    path, base = write_config(write)
    d = daemons(path, "--sim", "lock-lost", env=env)
    d.wait_for("serving /metrics")
    path.write_text(path.read_text().replace(base.rsplit(":", 1)[1], str(free_port())))  # a new port...
    d.proc.send_signal(signal.SIGHUP)
    d.wait_for("only change on restart")  # ...which a reload cannot apply
    proc = subprocess.run(gpuwarden_cmd() + ["status", "-c", str(path)], capture_output=True, text=True, env=env,
                          timeout=30)
    assert proc.returncode == 0 and proc.stdout.startswith("gpuwarden ")
    assert f"note: the daemon serves {base}, not metrics.listen" in proc.stderr
    assert d.stop() == 0 and not (runtime / "metrics-url").exists()
