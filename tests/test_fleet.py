"""A fleet on Prometheus and Alertmanager, with real servers.

Sixteen `gpuwarden run` daemons on the simulator (each its own scenario and port, faults staggered in
time), Debian's prometheus with the shipped rules and Debian's prometheus-alertmanager with the shipped
configuration, which sends to a webhook receiver in this test. The test copies divide every duration of the
rules' `for:` and of Alertmanager's waits by SCALE and point the receivers at the webhook; routes, grouping,
inhibition and expressions are the shipped ones (asserted). The test asserts exactly which notifications
arrive, and that the muted alerts were received and muted by the intended inhibition or silence.
"""

import copy
import datetime
import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml

from conftest import ROOT, free_port, subprocess_env
from gpuwarden.gpu.sim.scenario import resolve_scenario
from test_prometheus import substitute, tool

RULES = ROOT / "etc" / "prometheus" / "gpuwarden-rules.yml"
ALERTMANAGER = ROOT / "etc" / "alertmanager" / "gpuwarden-alertmanager.yml"
FLEET_DASHBOARD = ROOT / "etc" / "grafana" / "gpuwarden-fleet-dashboard.json"
FAKE = ROOT / "tests" / "harness" / "fakechild.py"
FLAGCHECK = ROOT / "tests" / "harness" / "fakechild-flagcheck"
SCALE = 6  # the test copies' durations: a rule's `for: 1m` is 10 s, a warning's group_wait of 2m is 20 s
TIMING_KEYS = ("group_wait", "group_interval", "repeat_interval")
PAGE, TICKET = "gpuwarden-page", "gpuwarden-ticket"


# -- the shipped configuration, checked on its own ------------------------------------------------------------
def shipped_alerts():
    rules = yaml.safe_load(RULES.read_text())
    return {r["alert"]: r for g in rules["groups"] for r in g["rules"] if "alert" in r}


@pytest.mark.process
def test_amtool_checks_the_config_and_routes_every_shipped_alert_by_its_severity():
    amtool = tool("amtool", "prometheus-alertmanager")
    check = subprocess.run([amtool, "check-config", str(ALERTMANAGER)], capture_output=True, text=True, timeout=60)
    assert check.returncode == 0 and "SUCCESS" in check.stdout, check.stdout + check.stderr
    alerts = shipped_alerts()
    assert {a["labels"]["severity"] for a in alerts.values()} == {"warning", "critical"}
    for name, alert in alerts.items():
        severity = alert["labels"]["severity"]
        expected = PAGE if severity == "critical" else TICKET
        test = subprocess.run([amtool, "config", "routes", "test", f"--config.file={ALERTMANAGER}",
                               f"--verify.receivers={expected}", f"alertname={name}", f"severity={severity}",
                               "instance=gpu-host-1:9847", "gpu=0"], capture_output=True, text=True, timeout=60)
        assert test.returncode == 0 and test.stdout.strip() == expected, (name, test.stdout + test.stderr)
    # The daemon's info-level notices are not paged.
    info = subprocess.run([amtool, "config", "routes", "test", f"--config.file={ALERTMANAGER}", "severity=info",
                           "alertname=Anything"], capture_output=True, text=True, timeout=60)
    assert info.stdout.strip() == TICKET, info.stdout + info.stderr


def matcher_names(matchers):
    """The alert names a list of matchers selects: alertname="X" or alertname=~"X|Y"."""
    names = []
    for m in matchers:
        found = re.fullmatch(r'alertname=~?"([^"]*)"', m)
        if found:
            names += found.group(1).split("|")
    return names


def test_inhibition_and_routes_name_only_alerts_the_rules_ship():
    # A renamed alert would silently fall out of an inhibition: every name (or pattern) must match a shipped
    # alert, and each rule must name some (the daemon-down rule names its sources; its targets are
    # "anything from that instance").
    config = yaml.safe_load(ALERTMANAGER.read_text())
    alerts = set(shipped_alerts())
    for rule in config["inhibit_rules"]:
        named = matcher_names(rule["source_matchers"]) + matcher_names(rule["target_matchers"])
        assert named, rule
        for pattern in named:
            assert any(re.fullmatch(pattern, alert) for alert in alerts), pattern
        assert "instance" in rule["equal"]
    routes = [config["route"]]
    while routes:
        route = routes.pop()
        for pattern in matcher_names(route.get("matchers", [])):
            assert any(re.fullmatch(pattern, alert) for alert in alerts), pattern
        routes += route.get("routes", [])


# Alerts about the fleet or the daemon itself: not one host's numbers, so nothing to hold while a daemon is silent.
ACROSS_HOSTS = {"GpuwardenDown", "GpuwardenStale", "GpuwardenTargetMissing", "ServingEngineVersionsDiffer",
                "ServingNodesDiffer"}


def test_every_alert_of_one_host_keeps_firing_while_its_daemon_is_silent():
    """The rules file's hold: each host's alert ends in the same two lines with its own name (the promtool test
    "a daemon that stops answering ..." shows them working on GpuHardwareSlowdown and GpuXid)."""
    alerts = shipped_alerts()
    assert ACROSS_HOSTS < set(alerts)
    for name, alert in alerts.items():
        expr = " ".join(alert["expr"].split())
        if name in ACROSS_HOSTS:
            assert "ALERTS" not in expr, name
        else:
            assert expr.startswith("(") and expr.endswith(
                ') unless on (job, instance) up == 0 or max without (alertstate) '
                f'(ALERTS{{alertname="{name}", alertstate="firing"}}) and on (job, instance) up == 0'), name


def inhibited_pairs():
    """(source, target, the labels they share) for every pair of shipped alerts an inhibit rule mutes."""
    config = yaml.safe_load(ALERTMANAGER.read_text())
    alerts = set(shipped_alerts())
    pairs = []
    for rule in config["inhibit_rules"]:
        sources = [a for a in alerts if any(re.fullmatch(p, a) for p in matcher_names(rule["source_matchers"]))]
        named = matcher_names(rule["target_matchers"])
        targets = [a for a in alerts if any(re.fullmatch(p, a) for p in named)] if named else \
            [a for a in alerts if a not in sources]  # "anything from that instance"
        pairs += [(s, t, tuple(rule["equal"])) for s in sources for t in targets if s != t]
    return pairs


@pytest.mark.process
@pytest.mark.fleet
def test_alertmanager_mutes_every_pair_the_inhibit_rules_name(tmp_path):
    """Each pair of the explanation table (docs/fleet.md, "What it mutes"), through Debian's Alertmanager with the
    shipped inhibit rules: the explained alert is suppressed and names the one that explains it; a lookalike
    on another host, GPU or child is not."""
    alertmanager = tool("prometheus-alertmanager", "prometheus-alertmanager")
    port = free_port()
    server = Server([alertmanager, f"--config.file={ALERTMANAGER}", f"--storage.path={tmp_path / 'am'}",
                     f"--web.listen-address=127.0.0.1:{port}", "--cluster.listen-address="], tmp_path / "am.log")
    base = f"http://127.0.0.1:{port}"
    pairs = inhibited_pairs()
    assert ("GpuHardwareSlowdown", "GpuClocksLowWhileBusy", ("instance", "gpu")) in pairs
    assert ("GpuPowerCapped", "GpuClocksLowWhileBusy", ("instance", "gpu")) in pairs
    try:
        wait("Alertmanager answers", lambda: get(f"{base}/api/v2/status"), 60)
        posted = []
        for n, (source, target, equal) in enumerate(pairs):
            shared = {"instance": f"pair{n}", "gpu": "0", "child": "vllm"}
            posted += [{"labels": {"alertname": source, **shared}},
                       {"labels": {"alertname": target, **shared, "pair": str(n)}},
                       # the same target where one shared label differs: not muted
                       {"labels": {"alertname": target, **shared, equal[-1]: "other", "pair": str(n)}}]
        request = urllib.request.Request(f"{base}/api/v2/alerts", json.dumps(posted).encode(),
                                         {"Content-Type": "application/json"})
        urllib.request.urlopen(request, timeout=10).close()
        # Alertmanager's inhibitor learns of posted alerts from its own subscription, on its own goroutine: on a busy
        # box an explaining alert was not yet known when the API was asked (CI: GpuNeedsReset posted, its
        # VllmQueueGrowing still active). Wait until every explained alert is suppressed, then judge.
        found = {}
        explained = [tuple(sorted({"alertname": target, "instance": f"pair{n}", "gpu": "0", "child": "vllm",
                                   "pair": str(n)}.items())) for n, (_, target, _) in enumerate(pairs)]

        def all_muted() -> bool:
            found.update({tuple(sorted(a["labels"].items())): a for a in get(f"{base}/api/v2/alerts")})
            return all(key in found and found[key]["status"]["state"] == "suppressed" for key in explained)

        def status(**labels):
            return found[tuple(sorted(labels.items()))]

        try:
            wait("every explained alert suppressed", all_muted, 60, every=0.2)
        except AssertionError:
            pass  # the loop below names the pair that is not
        for n, (source, target, equal) in enumerate(pairs):
            shared = {"instance": f"pair{n}", "gpu": "0", "child": "vllm"}
            cause = status(alertname=source, **shared)["fingerprint"]
            muted = status(alertname=target, **shared, pair=str(n))["status"]
            assert muted["state"] == "suppressed" and cause in muted["inhibitedBy"], (source, target, muted)
            other = status(alertname=target, **{**shared, equal[-1]: "other"}, pair=str(n))["status"]
            assert cause not in other["inhibitedBy"], (source, target, equal, other)
    finally:
        server.stop()


def fleet_dashboard_exprs():
    dashboard = json.loads(FLEET_DASHBOARD.read_text())
    return [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]


def test_fleet_dashboard_is_templated_and_reads_the_fleet():
    dashboard = json.loads(FLEET_DASHBOARD.read_text())
    assert [v["name"] for v in dashboard["templating"]["list"]] == ["datasource", "instance"]
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dashboard["panels"]:
        if panel["type"] != "row":
            assert panel["datasource"]["uid"] == "${datasource}"
            assert all('instance=~"$instance"' in t["expr"] for t in panel["targets"]), panel["title"]
    exprs = " ".join(fleet_dashboard_exprs())
    for metric in ("up", "gpuwarden:gpu_count", "gpuwarden_alert_active", "gpuwarden_gpu_power_watts",
                   "gpuwarden_gpu_power_limit_watts", "ALERTS", "gpuwarden:gpu_clock_event_seconds:rate5m",
                   "gpuwarden:gpu_sm_clock:ratio_max", "gpuwarden_serving_generation_tokens_per_second",
                   "gpuwarden_gpu_energy_joules_total"):
        assert re.search(rf"(?<![\w:]){re.escape(metric)}(?![\w:])", exprs), metric


# -- test copies: timings divided by SCALE, nothing else ----------------------------------------------------------
def seconds(duration: str) -> float:
    units = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400}
    parts = re.findall(r"(\d+)(ms|s|m|h|d)", duration)
    assert "".join(n + u for n, u in parts) == duration, duration
    return sum(int(n) * units[u] for n, u in parts)


def scaled(duration: str) -> str:
    return f"{max(1, round(seconds(duration) / SCALE))}s"


def rules_copy(folder: Path) -> Path:
    rules = yaml.safe_load(RULES.read_text())
    for group in rules["groups"]:
        for rule in group["rules"]:
            if "for" in rule:
                rule["for"] = scaled(rule["for"])
    path = folder / "rules.yml"
    path.write_text(yaml.safe_dump(rules, sort_keys=False))
    return path


def alertmanager_copy(folder: Path, webhook: str) -> Path:
    shipped = yaml.safe_load(ALERTMANAGER.read_text())
    config = copy.deepcopy(shipped)
    routes = [config["route"]]
    while routes:
        route = routes.pop()
        for key in TIMING_KEYS:
            if key in route:
                route[key] = scaled(route[key])
        routes += route.get("routes", [])
    for receiver in config["receivers"]:
        for hook in receiver["webhook_configs"]:
            hook["url"] = f"{webhook}/{receiver['name']}"
    # The logic the test exercises is the shipped one: only the timings and the URLs differ.
    assert config["inhibit_rules"] == shipped["inhibit_rules"]
    assert strip(config["route"]) == strip(shipped["route"])
    path = folder / "alertmanager.yml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def strip(route):
    return {k: [strip(r) for r in v] if k == "routes" else v for k, v in route.items() if k not in TIMING_KEYS}


# -- the webhook receiver ---------------------------------------------------------------------------------------
class Webhook(ThreadingHTTPServer):
    """What Alertmanager sends, as (receiver path, payload) in arrival order. Test-only, on loopback."""

    daemon_threads = True

    def __init__(self):
        self.received: list[tuple[str, dict]] = []
        self.lock = threading.Lock()
        super().__init__(("127.0.0.1", 0), WebhookHandler)

    def notifications(self):
        with self.lock:
            return list(self.received)


class WebhookHandler(BaseHTTPRequestHandler):
    def do_POST(self):  # noqa: N802
        length = int(self.headers.get("Content-Length", 0))
        body = json.loads(self.rfile.read(min(length, 1 << 20)))
        with self.server.lock:
            self.server.received.append((self.path.strip("/"), body))
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


def key(path, body):
    """One notification as (receiver, status, alertname, instance, gpu): its group and what it says."""
    group = body["groupLabels"]
    return (path, body["status"], group.get("alertname"), group.get("instance", ""), group.get("gpu", ""))


# -- the fleet ------------------------------------------------------------------------------------------------
def scenario(base: str, count: int, timeline: list, name: str) -> str:
    data = yaml.safe_load(resolve_scenario(base).read_text())
    data["name"] = name
    data["gpus"][0]["count"] = count
    data["timeline"] = timeline
    return yaml.safe_dump(data, sort_keys=False)


LOAD = {"at_s": 0, "event": "load", "utilization_pct": 60, "memory_used_pct": 5}  # room for an engine
PRO4000, PRO6000 = "rtx-pro-4000-headless", "rtx-pro-6000-tp4"
# name: (scenario, read-only, serving). Times are seconds from each daemon's start; the faults are staggered.
HOSTS = {
    "h00": (scenario(PRO4000, 1, [LOAD], "healthy-1"), False, None),
    # Not tuned: a headless card sits at 180/405 MHz while busy, both GPUs (sm and memory clocks low).
    "h01": (scenario(PRO4000, 2, [LOAD], "read-only-2"), True, None),
    # GPU 1 falls off the bus: Xid 79 (a reset is needed) and its clock collapses (the lock is lost).
    "h02": (scenario(PRO4000, 2, [LOAD, {"at_s": 30, "event": "xid", "gpus": [1], "xid": 79},
                                  {"at_s": 30, "event": "clock_collapse", "gpus": [1]}], "reset-2"), False, None),
    # GPU 0 falls off the bus and stays lost: Xid 79, then NVML's GPU_IS_LOST at the next read.
    "h03": (scenario(PRO4000, 2, [LOAD, {"at_s": 40, "event": "xid", "gpus": [0], "xid": 79},
                                  {"at_s": 41, "event": "gpu_lost", "gpus": [0]}], "lost-2"), False, None),
    # Clocks low as h01, under a silence the test creates.
    "h04": (scenario(PRO4000, 1, [LOAD], "silenced-1"), True, None),
    # An application's Xid (13: a warning), then the test kills the daemon with SIGKILL.
    "h05": (scenario(PRO4000, 1, [LOAD, {"at_s": 15, "event": "xid", "gpus": [0], "xid": 13}], "killed-1"),
            False, None),
    # Its engine stalls (requests run, no token) and the restart that follows is one failure too many: FATAL.
    "h06": (scenario(PRO4000, 1, [LOAD], "stall-1"), False, "stall"),
    # Serves well: tokens per second and per joule for the overview.
    "h07": (scenario(PRO4000, 2, [LOAD], "serving-2"), False, "healthy"),
    # Restarted by the test with one GPU fewer.
    "h08": (scenario(PRO6000, 4, [LOAD], "count-4"), False, None),
    # At the cards' own maximum power limit from 30 s: an info notice in the daemon, nothing in Prometheus.
    "h09": (scenario(PRO6000, 8, [LOAD, {"at_s": 30, "event": "load", "utilization_pct": 100}], "busy-8"),
            False, None),
    "h10": (scenario(PRO6000, 4, [LOAD], "healthy-4"), False, None),
    "h11": (resolve_scenario("dgx-spark").read_text(), False, None),  # unified memory, no power limit
    # One cause, one notification: a power brake (a page), a thermal slowdown (a ticket) and a power cap at the limit
    # the config chose (a notice, no ticket), all of which also hold the clocks low; no "clocks low" ticket beside them.
    "h12": (scenario(PRO4000, 1, [LOAD, {"at_s": 20, "event": "power_brake", "gpus": [0]}], "brake-1"), False, None),
    "h13": (scenario(PRO4000, 1, [LOAD, {"at_s": 20, "event": "thermal_slowdown", "gpus": [0], "temperature_c": 88}],
                     "thermal-1"), False, None),
    "h14": (scenario(PRO4000, 1, [{**LOAD, "utilization_pct": 100}], "capped-1"), False, None),
    # Serves /fake/model as h06 and h07 do, with an engine whose version is known: theirs is not ("").
    "h15": (scenario(PRO4000, 1, [LOAD], "versioned-1"), False, "versioned"),
}
TUNING = {"h14": {"power_limit_w": 100}}  # of the card's 70-145 W: a choice, reported as one
EXPECTED = {
    (TICKET, "firing", "GpuClocksLowWhileBusy", "h01", "0"),
    (TICKET, "firing", "GpuClocksLowWhileBusy", "h01", "1"),
    # one fault, one page: the health model's action (issue 42) mutes the Xid, the reset and the lost GPU
    (PAGE, "firing", "GpuActionReboot", "h02", "1"),
    (PAGE, "firing", "GpuActionReboot", "h03", "0"),
    (TICKET, "firing", "GpuXid", "h05", "0"),
    (PAGE, "firing", "GpuwardenDown", "h05", ""),
    (PAGE, "firing", "VllmCrashLoop", "h06", ""),
    (TICKET, "firing", "GpuCountDropped", "h08", ""),
    (PAGE, "firing", "GpuHardwareSlowdown", "h12", "0"),
    (TICKET, "firing", "GpuThermalSlowdown", "h13", "0"),
}  # h14's cap at the limit its config chose is a notice in the daemon (held_at_chosen_limit), no ticket
# Received by Alertmanager and muted: (alertname, instance, gpu) -> the alerts that may inhibit it (Alertmanager
# names one of those firing).
INHIBITED = {
    ("GpuXid", "h02", "1"): {"GpuNeedsReset", "GpuActionReboot"},
    ("GpuNeedsReset", "h02", "1"): {"GpuActionReboot"},
    ("GpuNeedsReset", "h03", "0"): {"GpuActionReboot"},
    # its collapsed clock is a lost lock (tuned, no power or heat reason): that alert, not "clocks low"
    ("GpuClockLockLost", "h02", "1"): {"GpuNeedsReset", "GpuActionReboot"},
    ("GpuXid", "h03", "0"): {"GpuNeedsReset", "GpuLost", "GpuActionReboot"},
    ("GpuLost", "h03", "0"): {"GpuNeedsReset", "GpuActionReboot"},
    ("VllmStalled", "h06", ""): {"VllmCrashLoop"},
    ("GpuXid", "h05", "0"): {"GpuwardenDown"},  # notified before its daemon died, muted since
}
SILENCED = ("GpuClocksLowWhileBusy", "h04", "0")

STALL_ENGINE = '''"""An engine that stalls: /health says 200 and two requests run, but no token counter ever moves."""
import sys
from http.server import BaseHTTPRequestHandler, HTTPServer

METRICS = (b'vllm:generation_tokens_total{model_name="m"} 100\\n'
           b'vllm:prompt_tokens_total{model_name="m"} 50\\n'
           b'vllm:num_requests_running{model_name="m"} 2\\n'
           b'vllm:num_requests_waiting{model_name="m"} 0\\n')


class Handler(BaseHTTPRequestHandler):
    def do_GET(self):
        body = METRICS if self.path == "/metrics" else b""
        self.send_response(200 if self.path in ("/health", "/metrics") else 404)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


args = sys.argv
HTTPServer((args[args.index("--host") + 1], int(args[args.index("--port") + 1])), Handler).serve_forever()
'''

# The engine's interpreter as gpuwarden asks it: its installed versions (vLLM 0.32.0), and the flag check.
VERSIONED_PYTHON = """#!/bin/sh
case "$*" in
  *GPUWARDEN-INSTALLED*) echo 'GPUWARDEN-INSTALLED {"versions": {"vllm": "0.32.0", "flashinfer": null, \
"torch": null, "sglang": null}, "torch_cuda": null, "env_names": null, "dirs": [], "toolkit": null}' ;;
  *) echo 'GPUWARDEN-FLAGCHECK {"ok": true, "error": null, "version": "0.32.0"}' ;;
esac
"""


@pytest.fixture
def engines():
    """The fake engines where serve.user can read them, run by Debian's python3."""
    folder = Path(tempfile.mkdtemp(prefix="gpuwarden-fleet-"))
    folder.chmod(0o755)
    shutil.copy(FAKE, folder / "fakechild.py")
    (folder / "stall.py").write_text(STALL_ENGINE)
    (folder / "versioned-python").write_text(VERSIONED_PYTHON)
    for path in folder.iterdir():
        path.chmod(0o755 if path.name == "versioned-python" else 0o644)
    yield {"healthy": ["/usr/bin/python3", str(folder / "fakechild.py"), "--mode", "healthy"],
           "stall": ["/usr/bin/python3", str(folder / "stall.py")],
           "versioned": ["/usr/bin/python3", str(folder / "fakechild.py"), "--mode", "healthy"],
           "versioned-python": str(folder / "versioned-python")}
    shutil.rmtree(folder, ignore_errors=True)


def host_config(folder: Path, name: str, port: int, read_only: bool, serving: str | None, engines: dict,
                user: str) -> Path:
    config = {"poll_interval_s": 1, "log_interval_s": 3600, "alerts": {"for_s": 0},
              "metrics": {"listen": f"127.0.0.1:{port}"}}
    if read_only:
        config["tuning"] = {"apply": False}
    if name in TUNING:
        config["tuning"] = TUNING[name]
    if serving:
        python = engines["versioned-python"] if serving == "versioned" else str(FLAGCHECK)
        config["serve"] = {"enabled": True, "profile": "generic", "model": "/fake/model",
                           "command": engines[serving], "python": python, "port": free_port(),
                           "user": user, "startup_timeout_s": 60, "stop_timeout_s": 2, "liveness_interval_s": 1,
                           "backoff_max_s": 1, "probe_after_s": 0,
                           # 5 s makes h06's stall quick to see; a healthy engine gets minutes, so that a box
                           # running the suite beside 16 daemons (ci40: h15 paged VllmStalled) is no stall
                           "stall_after_s": 5 if serving == "stall" else 300,
                           "crash_loop_failures": 1 if serving == "stall" else 5}
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


class Fleet:
    def __init__(self, folder: Path, daemons, engines, user):
        self.folder, self.start_daemon, self.engines, self.user = folder, daemons, engines, user
        self.ports = {name: free_port() for name in HOSTS}
        self.running = {}

    def start(self, name: str, scenario_text: str | None = None) -> None:
        text, read_only, serving = HOSTS[name]
        host = self.folder / name
        for sub in ("state", "run"):
            (host / sub).mkdir(parents=True, exist_ok=True)
        (host / "scenario.yaml").write_text(scenario_text or text)
        config = host_config(self.folder, name, self.ports[name], read_only, serving, self.engines, self.user)
        env = dict(subprocess_env(), STATE_DIRECTORY=str(host / "state"), RUNTIME_DIRECTORY=str(host / "run"))
        self.running[name] = self.start_daemon(config, "--sim", str(host / "scenario.yaml"), env=env)


def get(url, timeout=10):
    with urllib.request.urlopen(url, timeout=timeout) as reply:
        return json.load(reply)


def query(base, expr):
    try:
        return get(f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": expr}))
    except urllib.error.HTTPError as exc:
        return json.load(exc)


def values(base, expr):
    return [(r["metric"], float(r["value"][1])) for r in query(base, expr)["data"]["result"]]


def wait(what, condition, timeout, every=0.5, detail=lambda: ""):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            result = condition()
        except OSError:
            result = None
        if result:
            return result
        time.sleep(every)
    raise AssertionError(f"{what}: not within {timeout} s {detail()}")


class Server:
    """A real server we start, its log in a file; stopped by its own PID."""

    def __init__(self, argv, log: Path):
        self.log = log
        with open(log, "w") as out:
            self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=out)

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def start_servers(servers: list, folder: Path, am_config: Path, am_port: int, prom_config: Path, prom_port: int):
    """Debian's Alertmanager and Prometheus on loopback, appended to servers (the caller stops them), once
    Alertmanager answers and Prometheus is ready."""
    # --cluster.listen-address= turns off Alertmanager's gossip port (it would listen on every address).
    servers.append(Server([tool("prometheus-alertmanager", "prometheus-alertmanager"), f"--config.file={am_config}",
                           f"--storage.path={folder / 'am'}", f"--web.listen-address=127.0.0.1:{am_port}",
                           "--cluster.listen-address="], folder / "alertmanager.log"))
    servers.append(Server([tool("prometheus"), f"--config.file={prom_config}", f"--storage.tsdb.path={folder / 'tsdb'}",
                           f"--web.listen-address=127.0.0.1:{prom_port}"], folder / "prometheus.log"))
    wait("Alertmanager answers", lambda: get(f"http://127.0.0.1:{am_port}/api/v2/status"), 60)
    # Prometheus answers 503 "Service Unavailable" until its TSDB is open, which a query would read as its answer;
    # /-/ready says when it is (an HTTPError, an OSError, until then)
    wait("Prometheus is ready", lambda: urllib.request.urlopen(f"http://127.0.0.1:{prom_port}/-/ready",
                                                                timeout=10).status == 200, 120)


def silence(am_base, matchers):
    now = datetime.datetime.now(datetime.timezone.utc)
    body = {"matchers": [{"name": k, "value": v, "isRegex": False} for k, v in matchers.items()],
            "startsAt": now.isoformat(), "endsAt": (now + datetime.timedelta(hours=1)).isoformat(),
            "createdBy": "tests/test_fleet.py", "comment": "the silence under test"}
    request = urllib.request.Request(f"{am_base}/api/v2/silences", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=10) as reply:
        return json.load(reply)["silenceID"]


def am_alerts(am_base):
    """Alertmanager's alerts (active, silenced and inhibited), by (alertname, instance, gpu)."""
    return {(a["labels"]["alertname"], a["labels"].get("instance", ""), a["labels"].get("gpu", "")): a
            for a in get(f"{am_base}/api/v2/alerts")}


def processes_with(text: str) -> list[int]:
    """Processes whose command line names text (our own temporary folder)."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if text.encode() in cmdline.read_bytes():
                found.append(int(cmdline.parent.name))
        except OSError:
            continue
    return found


def fleet_figures(base):
    """Prometheus's own ingestion figures for this fleet (benchmarks/fleet_ingest.py records them)."""
    one = {
        "targets": "count(up{job='gpuwarden'})",
        "head_series": "prometheus_tsdb_head_series",
        "samples_appended_per_s": "rate(prometheus_tsdb_head_samples_appended_total[1m])",
        "scrape_duration_avg_s": "avg(avg_over_time(scrape_duration_seconds{job='gpuwarden'}[1m]))",
        "scrape_duration_max_s": "max(max_over_time(scrape_duration_seconds{job='gpuwarden'}[1m]))",
        "rule_groups_duration_s": "sum(prometheus_rule_group_last_duration_seconds)",
    }
    figures = {}
    for name, expr in one.items():
        found = values(base, expr)
        figures[name] = found[0][1] if found else None
    # The most each host sent in one scrape: h05 is dead by now, h08 came back with a GPU fewer.
    figures["samples_per_scrape"] = {m["instance"]: v for m, v in
                                     values(base, "max_over_time(scrape_samples_scraped{job='gpuwarden'}[10m])")}
    return figures


@pytest.mark.process
@pytest.mark.fleet
def test_a_fleet_of_sixteen_daemons_notifies_once_per_host_and_cause(tmp_path, daemons, engines, child_user):
    webhook = Webhook()
    threading.Thread(target=webhook.serve_forever, daemon=True).start()
    prom_port, am_port = free_port(), free_port()
    prom_base, am_base = f"http://127.0.0.1:{prom_port}", f"http://127.0.0.1:{am_port}"
    fleet = Fleet(tmp_path, daemons, engines, child_user)
    am_config = alertmanager_copy(tmp_path, f"http://127.0.0.1:{webhook.server_address[1]}")
    prom_config = tmp_path / "prometheus.yml"
    prom_config.write_text(yaml.safe_dump({
        # A scrape that times out marks its series stale, and a pending alert starts its `for:` over: a starved box
        # timed out 1 s scrapes, so the reboot page fired after the Xid ticket it mutes went out (ci47, ci51), and
        # with SCALE 4 the longer `for:`s of h08 and h13 never fired in 240 s (ci52). 2 s gives the daemons room.
        "global": {"scrape_interval": "2s", "evaluation_interval": "1s", "scrape_timeout": "2s"},
        "rule_files": [str(rules_copy(tmp_path))],
        "alerting": {"alertmanagers": [{"static_configs": [{"targets": [f"127.0.0.1:{am_port}"]}]}]},
        # instance is the host's name, as docs/fleet.md suggests: alerts and pages read "h05", not a port.
        "scrape_configs": [{"job_name": "gpuwarden", "static_configs": [
            {"targets": [f"127.0.0.1:{port}"], "labels": {"instance": name}} for name, port in fleet.ports.items()]},
            {"job_name": "prometheus", "static_configs": [{"targets": [f"127.0.0.1:{prom_port}"]}]}],
    }))
    servers = []
    try:
        start_servers(servers, tmp_path, am_config, am_port, prom_config, prom_port)
        silence_id = silence(am_base, {"alertname": SILENCED[0], "instance": SILENCED[1]})
        for name in HOSTS:
            fleet.start(name)

        def down():
            return set(HOSTS) - {m["instance"] for m, _ in values(prom_base, "up{job='gpuwarden'} == 1")}

        wait("every daemon scraped", lambda: not down(), 120,
             detail=lambda: "".join(f"\n{h}: " + "\n".join(fleet.running[h].lines[-5:]) for h in down()))
        wait("every host's GPU count recorded", lambda: len(values(prom_base, "gpuwarden:gpu_count")) == len(HOSTS), 30)

        # h05's Xid is told; then its daemon dies without a word. h08 comes back with one GPU fewer.
        wait("h05's Xid notified", lambda: (TICKET, "firing", "GpuXid", "h05", "0") in
             {key(*n) for n in webhook.notifications()}, 120)
        fleet.running["h05"].proc.kill()
        assert fleet.running["h05"].proc.wait(10) == -signal.SIGKILL
        assert fleet.running["h08"].stop() == 0
        fleet.start("h08", scenario(PRO6000, 3, [LOAD], "count-3"))

        def arrivals():
            return {key(*n) for n in webhook.notifications()}

        wait("the expected notifications", lambda: EXPECTED <= arrivals(), 240, every=1,
             detail=lambda: f"missing {EXPECTED - arrivals()}, more {arrivals() - EXPECTED}, "
                            f"in Alertmanager {list(am_alerts(am_base))}")
        # Anything more would arrive within a warning's group_wait of its alert firing: wait that, and more.
        time.sleep(seconds("2m") / SCALE + 10)
        notifications = webhook.notifications()
        got = [key(*n) for n in notifications]
        assert set(got) == EXPECTED, sorted(set(got) ^ EXPECTED)
        assert len(got) == len(set(got)), "one notification per group"
        for path, body in notifications:  # each group holds its own host's alert alone
            group = body["groupLabels"]
            assert {(a["labels"]["alertname"], a["labels"]["instance"]) for a in body["alerts"]} == \
                   {(group["alertname"], group["instance"])}, body
        daemon_down = [b for p, b in notifications if b["groupLabels"]["alertname"] == "GpuwardenDown"]
        assert [a["labels"]["instance"] for a in daemon_down[0]["alerts"]] == ["h05"]
        # Each names its cause and a fix that can work: the brake's is the PSU, the chosen limit's is none.
        said = {(b["groupLabels"]["alertname"], b["groupLabels"]["instance"]):
                b["alerts"][0]["annotations"]["description"] for _, b in notifications}
        assert "asserted the power brake" in said["GpuHardwareSlowdown", "h12"]
        assert "88 C" in said["GpuThermalSlowdown", "h13"]
        assert "reboot" in said["GpuActionReboot", "h03"]
        # h14 held at the 100 W its config chose: the daemon's notice, and no GpuPowerCapped ticket (issue 43)
        # These two look back a while: one scrape the busy box timed out marks a series stale at that instant (ci49).
        assert values(prom_base, 'max_over_time(gpuwarden_alert_active{alert="held_at_chosen_limit",instance="h14"}'
                                 '[1m]) == 1')
        assert not values(prom_base, 'ALERTS{alertname="GpuPowerCapped",instance="h14",alertstate="firing"}')
        # An engine version nobody could read ("" on h06 and h07) beside a known one (h15) is no skew: the
        # rule is not even pending.
        versions = {m["instance"]: m.get("version", "")  # Prometheus keeps no empty label
                    for m, _ in values(prom_base, 'last_over_time(gpuwarden_serving_info{model="/fake/model"}[30s])')}
        assert versions == {"h06": "", "h07": "", "h15": "0.32.0"}, versions
        assert not values(prom_base, 'ALERTS{alertname="ServingEngineVersionsDiffer"}')

        received = am_alerts(am_base)
        names = {a["fingerprint"]: k[0] for k, a in received.items()}
        for alert, sources in INHIBITED.items():
            status = received[alert]["status"]
            assert status["state"] == "suppressed" and status["inhibitedBy"] and not status["silencedBy"], alert
            assert {names.get(f) for f in status["inhibitedBy"]} <= sources, (alert, status)
        status = received[SILENCED]["status"]
        assert status["state"] == "suppressed" and status["silencedBy"] == [silence_id], status

        # The fleet dashboard's queries, with every host selected, all answer with data.
        for expr in fleet_dashboard_exprs():
            expr = substitute(expr)
            result = query(prom_base, expr)
            assert result["status"] == "success", (expr, result)
            assert result["data"]["result"], f"no data for {expr}"

        figures = fleet_figures(prom_base)
        print("fleet figures:", json.dumps(figures))
        if os.environ.get("GPUWARDEN_FLEET_FIGURES"):
            Path(os.environ["GPUWARDEN_FLEET_FIGURES"]).write_text(json.dumps(figures, indent=1))

        # The serving daemons stop their engines: none of the fakes outlives them.
        for name in ("h06", "h07", "h15"):
            assert fleet.running[name].stop() == 0
        assert not processes_with(str(Path(engines["stall"][1]).parent)), "an engine outlived its daemon"
    finally:
        for server in reversed(servers):
            server.stop()
        webhook.shutdown()
        webhook.server_close()
