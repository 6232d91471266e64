"""The shipped rules and dashboard against a real Prometheus (Debian's package) scraping a real daemon.

The daemon runs read-only on a two-GPU headless RTX PRO 4000 sim (clocks stuck
at 180 MHz while busy) and serves the tiny model with the CPU build of vLLM, so
every GPU and vLLM series exists.
"""

import json
import os
import re
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from datetime import datetime

import pytest
import yaml

from conftest import CPU_TINY_PROFILE, ROOT, VLLM_START_S, free_port, gpuwarden_cmd
from gpuwarden.gpu.sim.scenario import resolve_scenario

RULES = ROOT / "etc" / "prometheus" / "gpuwarden-rules.yml"
DASHBOARD = ROOT / "etc" / "grafana" / "gpuwarden-dashboard.json"
RULE_TESTS = ROOT / "tests" / "prometheus" / "gpuwarden-rules.test.yml"
# Grafana's variables, as a query with every host and GPU selected sends them.
VARIABLES = {"$instance": ".*", "$gpu": ".*", "$__rate_interval": "1m", "$__interval": "15s"}


def tool(name, package="prometheus"):
    path = shutil.which(name)
    if path is None:
        if os.environ.get("CI") == "true":
            pytest.fail(f"{name} is missing under CI=true: tests/run installs Debian's {package} package")
        pytest.skip(f"{name} not installed (tests/run installs Debian's {package} package)")
    return path


@pytest.mark.process
def test_promtool_checks_and_unit_tests_the_rules():
    promtool = tool("promtool")
    check = subprocess.run([promtool, "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60)
    shipped = sum(len(group["rules"]) for group in yaml.safe_load(RULES.read_text())["groups"])
    assert shipped >= 33  # at least what issue 30 left (ServingNodeDown, ServingNodesDiffer): none dropped by a parse
    assert check.returncode == 0 and f"SUCCESS: {shipped} rules found" in check.stdout, check.stdout + check.stderr
    test = subprocess.run([promtool, "test", "rules", str(RULE_TESTS)], capture_output=True, text=True, timeout=120)
    assert test.returncode == 0 and "SUCCESS" in test.stdout, test.stdout + test.stderr


def test_every_alert_has_a_unit_test_and_its_parts():
    rules = yaml.safe_load(RULES.read_text())
    alerts = [r for g in rules["groups"] for r in g["rules"] if "alert" in r]
    tested = {t["alertname"] for case in yaml.safe_load(RULE_TESTS.read_text())["tests"]
              for t in case["alert_rule_test"] if t["exp_alerts"]}
    assert {a["alert"] for a in alerts} == tested
    for alert in alerts:
        assert "for" in alert or alert["expr"].startswith("(increase(")  # an increase over a window needs no for:
        assert alert["labels"]["severity"] in ("warning", "critical")
        assert alert["annotations"]["summary"] and "Fix:" in alert["annotations"]["description"]


def dashboard_exprs():
    dashboard = json.loads(DASHBOARD.read_text())
    return [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]


def substitute(expr):
    for name, value in VARIABLES.items():
        expr = expr.replace(name, value)
    return expr


def test_dashboard_is_templated_by_datasource_instance_and_gpu():
    dashboard = json.loads(DASHBOARD.read_text())
    names = [v["name"] for v in dashboard["templating"]["list"]]
    assert names == ["datasource", "instance", "gpu"]
    for panel in dashboard["panels"]:
        if panel["type"] != "row":
            assert panel["datasource"]["uid"] == "${datasource}"
    exprs = " ".join(dashboard_exprs())
    for metric in ("gpuwarden_gpu_sm_clock_hertz", "gpuwarden_gpu_sm_clock_lock_hertz", "gpuwarden_gpu_power_watts",
                   "gpuwarden_gpu_power_limit_watts", "gpuwarden_gpu_clock_event_active",
                   "gpuwarden_gpu_temperature_celsius", "gpuwarden_alert_active",
                   "gpuwarden_serving_generation_tokens_per_second", "gpuwarden_serving_requests_running",
                   "gpuwarden_serving_requests_waiting", "gpuwarden_serving_kv_cache_usage_ratio",
                   "gpuwarden_serving_restarts_total", "gpuwarden_serving_state", "gpuwarden_sample_duration_seconds",
                   "gpuwarden_loop_lag_seconds", "gpuwarden_proxy_engine_prefix_cache_hits_tokens_total",
                   "gpuwarden_proxy_requests_total", "gpuwarden_gpu_nvlink_links_up",
                   "gpuwarden_gpu_nvlink_errors_total", "gpuwarden_gpu_nvlink_link_speed_bytes_per_second",
                   "gpuwarden_gpu_fabric_ready", "gpuwarden_serving_tokens_per_joule",
                   "gpuwarden_proxy_request_joules_bucket", "gpuwarden_proxy_gpu_energy_joules_total"):
        assert metric in exprs, metric


def query(base, expr):
    url = f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    try:
        with urllib.request.urlopen(url, timeout=10) as reply:
            return json.load(reply)
    except urllib.error.HTTPError as exc:
        return json.load(exc)


def through_proxy(port, model):
    """One chat request the proxy normalizes (its date line), and one body it refuses. Each answer read whole, as a
    client does: one that leaves at the head is no sample of joules per request (Request.unsampled), and under load
    the proxy may not have relayed a byte of the body before it left, so the joules row would have no series."""
    body = {"model": str(model), "max_tokens": 2, "messages": [
        {"role": "system", "content": "Today's date is 2026-11-26.\nBe brief."}, {"role": "user", "content": "the gpu"}]}
    for data, status in ((json.dumps(body).encode(), 200), (b"{not json", 400)):
        request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data,
                                         {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=60) as reply:
                answer = json.loads(reply.read())
            assert reply.status == status
            assert answer["usage"]["completion_tokens"] >= 1, answer
        except urllib.error.HTTPError as exc:
            assert exc.code == status, exc.read()


MULTI_NODE_ONLY = {"gpuwarden_serving_node_info", "gpuwarden_serving_node_up", "gpuwarden_serving_head_reachable"}


def wait_for_series(base, expr, timeout=120):  # a bound on a hang: a 1 s scrape a busy box times out is stale
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if query(base, expr).get("data", {}).get("result"):
            return
        time.sleep(0.5)
    raise AssertionError(f"no series {expr} within {timeout} s")


def alerts(base):
    with urllib.request.urlopen(f"{base}/api/v1/alerts", timeout=10) as reply:
        return json.load(reply)["data"]["alerts"]


@pytest.mark.vllm
@pytest.mark.podman
def test_real_prometheus_fires_the_clock_alert_and_every_query_has_data(write, daemons, vllm_python, tiny_model,
                                                                       child_user, tmp_path, podman):
    prometheus = tool("prometheus")
    scenario = write("scenario.yaml", resolve_scenario("rtx-pro-4000-headless").read_text()
                     .replace("memory_used_pct: 85", "memory_used_pct: 10"))  # room for vLLM's preflight
    write("profiles.d/cpu-tiny.yaml", CPU_TINY_PROFILE.read_text())
    # Host A watches read-only (its clocks stay at 180 MHz: the alert); host B tunes, locks memory too,
    # and serves; host C has NVLink and NVSwitch (four H100s): so every series the rules and the dashboard
    # read exists. Host B's vLLM runs from a container image (serve.container, on the tests' podman: issue 53),
    # its venv mounted read-only, and answers a completion through the proxy: the real engine in a container, in
    # CI, without an engine start of its own (this test waits a minute for the alert anyway).
    port_a, port_b, prom_port, engine_port, proxy_port = free_port(), free_port(), free_port(), free_port(), free_port()
    port_c = free_port()
    common = f"poll_interval_s: 0.5\nalerts:\n  for_s: 1\ngpu:\n  backend: sim\n  scenario: {scenario}\n"
    config_a = write("a.yaml", common + f"tuning:\n  apply: false\nmetrics:\n  listen: 127.0.0.1:{port_a}\n")
    # counters_interval_s 2: the energy counters, and so the tokens per joule, within seconds of vLLM serving
    config_b = write("gpuwarden.yaml", common + f"""counters_interval_s: 2
tuning:
  memory_clocks: max
metrics:
  listen: 127.0.0.1:{port_b}
serve:
  enabled: true
  profile: cpu-tiny
  model: {tiny_model}
  command: [{vllm_python}, -m, vllm.entrypoints.openai.api_server]
  port: {engine_port}
  user: {child_user}
  startup_timeout_s: {VLLM_START_S}
  stop_timeout_s: 20
  container:
    image: {podman.image()}
    socket: {podman.socket}
    mounts: ["{vllm_python.parent.parent}:{vllm_python.parent.parent}"]
""")
    config_c = write("c.yaml", f"poll_interval_s: 0.5\ngpu:\n  backend: sim\n  scenario: h100-nvswitch\n"
                              f"tuning:\n  apply: false\nmetrics:\n  listen: 127.0.0.1:{port_c}\n")
    targets = [f"127.0.0.1:{port_a}", f"127.0.0.1:{port_b}", f"127.0.0.1:{port_c}"]
    prom_config = write("prometheus.yml", yaml.safe_dump({
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(RULES)],
        "scrape_configs": [{"job_name": "gpuwarden", "static_configs": [{"targets": targets}]},
                           {"job_name": "gpuwarden-proxy", "static_configs": [{"targets": [f"127.0.0.1:{proxy_port}"]}]}],
    }))
    d = daemons(config_b)
    # The proxy in front of host B's vLLM, scraped as docs/fleet.md says, for the dashboard's prefix-cache row.
    # The engine runs as child_user, the proxy as us: it sends only to a socket of --engine-user (proxy/upstream.py).
    # Its energy, for the joules row, from a feed this test writes as a daemon does (test_proxy_vllm.Feed).
    from test_proxy_vllm import Feed

    feed = Feed(tmp_path / "energy.json")
    with open(tmp_path / "proxy.log", "w") as proxy_log:  # read when the joules row has no series
        proxy = subprocess.Popen([*gpuwarden_cmd(), "proxy", "-c", "none",
                                  "--upstream", f"http://127.0.0.1:{engine_port}",
                                  "--listen", f"127.0.0.1:{proxy_port}", "--rules", "date_line",
                                  "--engine-user", child_user, "--energy-file", str(feed.path), "--model", "tiny"],
                                 stdout=subprocess.DEVNULL, stderr=proxy_log)
    host_a = daemons(config_a)
    host_c = daemons(config_c)
    started = time.monotonic()
    prom_log = open(tmp_path / "prometheus.log", "w")  # noqa: SIM115 (closed in the finally below)
    prom = subprocess.Popen([prometheus, f"--config.file={prom_config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                             f"--web.listen-address=127.0.0.1:{prom_port}"], stdout=subprocess.DEVNULL, stderr=prom_log)
    base = f"http://127.0.0.1:{prom_port}"
    try:
        # The daemon fires after for_s (1 s); Prometheus scrapes that, the rule goes pending (its activeAt, on
        # Prometheus's clock) and fires once `for: 1m` has passed. Order and a lower bound only: the test sees the
        # daemon's alert in Prometheus, then the rule firing, and that no sooner than a minute after its activeAt (a
        # busy box only makes the test see it later). How long after is promtool's to prove, on the clock it
        # drives (tests/prometheus/gpuwarden-rules.test.yml, "clocks low while busy": pending at 1m, firing at 2m).
        fired = seen = None
        low = f'gpuwarden_alert_active{{alert="sm_clock_low",instance="{targets[0]}"}} == 1'
        while time.monotonic() - started < 300 and fired is None:  # a bound on a hang
            try:
                if seen is None and len(query(base, low).get("data", {}).get("result", [])) == 2:
                    seen = time.monotonic()
                firing = [a for a in alerts(base) if a["labels"]["alertname"] == "GpuClocksLowWhileBusy"
                          and a["state"] == "firing"]
            except OSError:
                firing = []
            ours = [a for a in firing if a["labels"]["alert"] == "sm_clock_low"
                    and a["labels"]["instance"] == targets[0]]
            if {a["labels"]["gpu"] for a in ours} == {"0", "1"}:
                fired, fired_wall = time.monotonic(), time.time()
            time.sleep(0.5)
        assert fired is not None and seen is not None, "GpuClocksLowWhileBusy never fired for both GPUs"
        assert seen <= fired  # the daemon's alert was in Prometheus before (or as) the rule fired
        # activeAt and time.time() are this machine's wall clock: seen firing no sooner than `for: 1m` after pending
        active_at = max(datetime.fromisoformat(a["activeAt"]).timestamp() for a in ours)
        assert fired_wall - active_at >= 60 - 0.5, (fired_wall - active_at, [a["activeAt"] for a in ours])
        assert not [a for a in firing if a["labels"]["instance"] == targets[1]], "the tuned host is fine"

        d.wait_for("vLLM healthy after", timeout=VLLM_START_S)
        through_proxy(proxy_port, tiny_model)
        wait_for_series(base, 'gpuwarden_proxy_engine_prefix_cache_queries_tokens_total{job="gpuwarden-proxy"}')
        try:
            wait_for_series(base, 'gpuwarden_proxy_request_joules_count{job="gpuwarden-proxy"}')  # settled, scraped
        except AssertionError as exc:
            raise AssertionError(f"{exc}; the proxy said:\n{(tmp_path / 'proxy.log').read_text()[-4000:]}") from None
        wait_for_series(base, "gpuwarden_serving_tokens_per_joule")  # two reads of the energy counters, serving
        rules = yaml.safe_load(RULES.read_text())
        rule_exprs = [r["expr"] for g in rules["groups"] for r in g["rules"]]
        for expr in rule_exprs + [substitute(e) for e in dashboard_exprs()]:
            # until it has data: two reads of vLLM's metrics make a rate, and a scrape a busy box timed out leaves
            # the series stale until the next (a bound on a hang, not a wait for a fixed number of seconds)
            wanted = "alert" not in expr and not re.search(r"(==|[<>]=?) *[0-9.]+$|absent\(|\band\b", expr)
            deadline = time.monotonic() + 120
            while True:
                result = query(base, expr)
                assert result["status"] == "success", (expr, result)
                if not wanted or result["data"]["result"]:
                    break
                assert time.monotonic() < deadline, f"no data for {expr}"
                time.sleep(0.5)
        # Alert expressions are empty while all is well: each metric they read must still exist. A single-node
        # engine exports no node series (the two-node vLLM test reads them; promtool tests the rules on them).
        for name in sorted(set(re.findall(r"\b(gpuwarden[_:][a-z0-9_:]+|up)\b", " ".join(rule_exprs)))):
            if name in MULTI_NODE_ONLY:
                assert not query(base, f'{{__name__="{name}"}}')["data"]["result"], \
                    f"a single-node engine exports {name}"
            else:
                wait_for_series(base, f'{{__name__="{name}"}}')
    finally:
        feed.stopped.set()
        prom.terminate()
        prom.wait(30)
        proxy.terminate()
        proxy.wait(30)
        prom_log.close()
        d.stop()
        host_a.stop()
        host_c.stop()
