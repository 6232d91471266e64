"""No RESOLVED about a GPU nobody watches, with the shipped timings (test_fleet.py divides them by six).

One daemon on the simulator, read-only (tuning.apply: false), two busy GPUs: GPU 0 under a power brake (a page,
GpuHardwareSlowdown) and GPU 1 at its idle clocks (a ticket, GpuClocksLowWhileBusy: a headless card nobody
locked). Debian's Prometheus with the shipped rules, scraping and evaluating every 5 s; Debian's Alertmanager with
the shipped configuration, only its webhook URLs pointed here. Once both are notified, the daemon is SIGKILLed.

Before the rules held a silent host's alerts, both resolved at the next scrape, and each group's next flush (its
group_interval, 5 minutes after its first notification) sent a RESOLVED before the GpuwardenDown page, which
comes 5 minutes (its `for:`) and 30 s (the page's group_wait) after the death. Now nothing resolves, the page
comes, and it mutes both. About 9 minutes, nearly all of them the shipped waits: it runs on an xdist worker of
its own beside the vLLM tests (tests/harness/workers.py).
"""

import signal
import threading
import time

import pytest
import yaml

from conftest import free_port, subprocess_env
from test_fleet import (ALERTMANAGER, LOAD, PAGE, PRO4000, RULES, TICKET, Webhook, am_alerts, key,
                        scenario, start_servers, wait)

pytestmark = [pytest.mark.process, pytest.mark.fleet]
SCRAPE_S = 5


def alertmanager_config(folder, webhook: str):
    config = yaml.safe_load(ALERTMANAGER.read_text())
    for receiver in config["receivers"]:
        for hook in receiver["webhook_configs"]:
            hook["url"] = f"{webhook}/{receiver['name']}"
    path = folder / "alertmanager.yml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def test_a_daemon_killed_while_its_alerts_fire_pages_before_any_of_them_resolves(tmp_path, daemons):
    webhook = Webhook()
    threading.Thread(target=webhook.serve_forever, daemon=True).start()
    prom_port, am_port, metrics_port = free_port(), free_port(), free_port()
    am_base = f"http://127.0.0.1:{am_port}"
    (tmp_path / "scenario.yaml").write_text(scenario(PRO4000, 2, [LOAD, {"at_s": 0, "event": "power_brake",
                                                                         "gpus": [0]}], "brake-and-idle-2"))
    config = tmp_path / "gpuwarden.yaml"
    config.write_text(yaml.safe_dump({"poll_interval_s": 1, "log_interval_s": 3600, "alerts": {"for_s": 0},
                                      "tuning": {"apply": False}, "metrics": {"listen": f"127.0.0.1:{metrics_port}"}}))
    prom_config = tmp_path / "prometheus.yml"
    prom_config.write_text(yaml.safe_dump({
        "global": {"scrape_interval": f"{SCRAPE_S}s", "evaluation_interval": f"{SCRAPE_S}s"},
        "rule_files": [str(RULES)],  # the shipped file itself
        "alerting": {"alertmanagers": [{"static_configs": [{"targets": [f"127.0.0.1:{am_port}"]}]}]},
        "scrape_configs": [{"job_name": "gpuwarden", "static_configs": [
            {"targets": [f"127.0.0.1:{metrics_port}"], "labels": {"instance": "h1"}}]}],
    }))
    servers = []
    try:
        am_config = alertmanager_config(tmp_path, f"http://127.0.0.1:{webhook.server_address[1]}")
        start_servers(servers, tmp_path, am_config, am_port, prom_config, prom_port)
        host = tmp_path / "h1"
        for sub in ("state", "run"):
            (host / sub).mkdir(parents=True)
        env = dict(subprocess_env(), STATE_DIRECTORY=str(host / "state"), RUNTIME_DIRECTORY=str(host / "run"))
        d = daemons(config, "--sim", str(tmp_path / "scenario.yaml"), env=env)

        def arrivals():
            return [key(*n) for n in webhook.notifications()]

        firing = {(PAGE, "firing", "GpuHardwareSlowdown", "h1", "0"),
                  (TICKET, "firing", "GpuClocksLowWhileBusy", "h1", "1")}
        # the rule's for: 1m, then the page's group_wait 30 s and the ticket's 2 minutes, on a busy box
        wait("the page and the ticket", lambda: firing <= set(arrivals()), 420, every=1,
             detail=lambda: f"got {arrivals()}; the daemon said:\n" + "\n".join(d.lines[-20:]))
        assert set(arrivals()) == firing, arrivals()  # one cause, one notification: no clock ticket for GPU 0

        d.proc.kill()
        killed = time.monotonic()
        assert d.proc.wait(10) == -signal.SIGKILL
        down = (PAGE, "firing", "GpuwardenDown", "h1", "")
        # GpuwardenDown's for: 5m after the first failed scrape, its group_wait 30 s, and the evaluation
        wait("the GpuwardenDown page", lambda: down in arrivals(), 300 + 30 + 120, every=1,
             detail=lambda: f"got {arrivals()}")
        paged = time.monotonic() - killed
        got = arrivals()
        assert got[:got.index(down)] == [k for k in got if k in firing], f"a RESOLVED came before the page: {got}"
        print(f"paged {paged:.0f} s after the SIGKILL; notifications in order: {got}")

        # From the page on, the host's held alerts are muted by it.
        received = am_alerts(am_base)
        names = {a["fingerprint"]: k[0] for k, a in received.items()}
        for alert in (("GpuHardwareSlowdown", "h1", "0"), ("GpuClocksLowWhileBusy", "h1", "1")):
            status = received[alert]["status"]
            assert status["state"] == "suppressed", (alert, status)
            assert {names.get(f) for f in status["inhibitedBy"]} == {"GpuwardenDown"}, (alert, status)
    finally:
        for server in reversed(servers):
            server.stop()
        webhook.shutdown()
        webhook.server_close()
