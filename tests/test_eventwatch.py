"""Xid and fatal GPU events: the NVML event set, the waiting thread, the journal line, the metric, the alert
and what happens to the engine on that GPU. Through the fake NVML; a real-process run of the sim at the end."""

import dataclasses
import inspect
import threading
import time
import urllib.request

import pytest

from conftest import free_port
from harness.fake_nvml import FakeNvml, device
from gpuwarden import config
from gpuwarden.backends import open_configured
from gpuwarden.web.exposition import make_registry
from gpuwarden.gpu.events import XID, GpuEvent
from gpuwarden.gpu.nvml import NvmlBackend
from gpuwarden.gpu.sim.backend import ManualClock
from gpuwarden.gpu.sim.scenario import resolve_scenario
from gpuwarden.watch import eventwatch
from gpuwarden.watch.eventwatch import EventBook, EventWatcher
from gpuwarden.watch.monitor import Monitor
from gpuwarden.serving.run.supervisor import HELD, Supervisor
from gpuwarden.tune.tuning import Tuner, TuningLife
from test_serving import running_supervisor, supervisor


def two_gpus():
    # NVML's order differs from PCI order on purpose: an event must land on our index, found by UUID.
    fake = FakeNvml([device("GPU-bbb", "00000000:9A:00.0"), device("GPU-aaa", "00000000:18:00.0",
                                                                     event_types=XID)])
    return NvmlBackend(fake, clock=ManualClock(0)), fake


def test_the_event_set_registers_what_each_gpu_supports_and_names_events_by_our_index():
    backend, fake = two_gpus()
    source = backend.events()
    assert source.registered == {0: ["xid"], 1: ["xid", "double_bit_ecc", "gpu_unavailable", "recovery_action",
                                                 "nonfatal_poison", "fatal_poison"]}
    assert fake.event_set.registered[0] == 0x8 | 0x2 | 0x4000 | 0x8000 | 0x1000 | 0x2000  # NVML's index 0: GPU-bbb
    assert source.wait(0.01) == []  # NVML's timeout
    fake.events.append((0, XID, 79))  # NVML's device 0 is GPU-bbb, our GPU 1 (PCI order)
    assert source.wait(0.01) == [GpuEvent(1, "xid", 79)]
    source.close()
    assert fake.event_set.freed


def test_the_thread_only_waits_hands_events_over_with_a_wake_up_and_ends_cleanly():
    backend, fake = two_gpus()
    woken = threading.Event()
    watcher = EventWatcher(backend.events(), woken.set)
    watcher.start()
    fake.events.append((1, XID, 13))
    assert woken.wait(30)  # a bound on a hang
    assert watcher.take() == [GpuEvent(0, "xid", 13)]
    assert watcher.stop(timeout_s=30)  # it wakes every WAIT_S to see the stop (30: a bound on a hang, not a speed)
    # and the daemon's stop (its default) waits for two of those wakes: no clock needed to see that it can
    assert eventwatch.WAIT_S * 2 <= inspect.signature(EventWatcher.stop).parameters["timeout_s"].default
    assert fake.event_set.freed


def sim_monitor(extra=""):
    cfg = config.parse_text("gpu:\n  backend: sim\n  scenario: rtx-pro-6000-tp4\nmetrics:\n  listen: none\n"
                            "tuning:\n  apply: false\nalerts:\n  repeat_s: 600\n" + extra)
    clock = ManualClock()
    backend = open_configured(cfg, clock)
    return Monitor(cfg, backend, TuningLife(backend, cfg, Tuner(backend))), clock


@pytest.mark.parametrize("event,level,text,reset", [
    (GpuEvent(2, "xid", 79), "CRITICAL", "GPU2 Xid 79 (GPU has fallen off the bus); recovery: reboot the node", True),
    (GpuEvent(2, "xid", 48), "CRITICAL", "GPU2 Xid 48 (double-bit ECC error); recovery: reset the GPU", True),
    (GpuEvent(2, "xid", 13), "ERROR", "GPU2 Xid 13 (Graphics Engine Exception); recovery: restart the application; "
     "gpuwarden: its processes' own health decides (the engine restarts if it died); processes on it: ", False),
    (GpuEvent(2, "double_bit_ecc", 0), "CRITICAL", "GPU2 double-bit ECC error; recovery: reset the GPU", True),
    (GpuEvent(2, "gpu_unavailable", 0), "CRITICAL", "GPU2 GPU unavailable; recovery: reboot the node", True),
    (GpuEvent(2, "recovery_action", 3), "CRITICAL", "GPU2 the driver set a recovery action; recovery: drain its "
     "peer-to-peer (NVLink) traffic", True),
    (GpuEvent(2, "recovery_action", 4), "CRITICAL", "GPU2 the driver set a recovery action; recovery: drain its "
     "peer-to-peer traffic, then reset the GPU", True),
    (GpuEvent(2, "recovery_action", 6), "CRITICAL", "GPU2 the driver set a recovery action; recovery: reset the "
     "GPU's PCIe bus", True),
    (GpuEvent(2, "nonfatal_poison", 0), "ERROR", "GPU2 poisoned memory contained (the process that read it was "
     "stopped); recovery: restart the application", False),
    (GpuEvent(2, "fatal_poison", 0), "CRITICAL", "GPU2 poisoned memory not contained; recovery: reset the GPU", True),
])
def test_each_event_reaches_the_journal_the_metric_and_the_alert(event, level, text, reset, caplog):
    caplog.set_level("INFO")
    monitor, clock = sim_monitor()
    holds = monitor.record_events([event], clock.now)
    line = next(r for r in caplog.records if r.getMessage().startswith("GPU2 "))
    assert line.levelname == level and text in line.getMessage()
    assert "[source: NVIDIA Xid catalog" in line.getMessage()
    assert bool(holds) == reset and (not reset or holds[0][0] == 2)
    snapshot = monitor.tick(clock.now)
    firing = {(a.gpu, a.alert) for a in snapshot.firing()}
    assert ((2, "gpu_needs_reset") in firing) == reset
    assert ((2, "gpu_xid") in firing) == (event.kind == "xid")
    families = {m.name: m for m in make_registry(lambda: snapshot).collect()}
    name = "gpuwarden_gpu_xid_errors" if event.kind == "xid" else "gpuwarden_gpu_events"
    [sample] = [s for s in families[name].samples if s.name.endswith("_total")]
    assert sample.labels["gpu"] == "2" and sample.value == 1
    assert sample.labels.get("xid", sample.labels.get("kind")) in (str(event.data), event.kind)


def test_an_xid_storm_is_one_line_per_kind_per_repeat_s(caplog):
    caplog.set_level("INFO")
    book = EventBook(repeat_s=600)
    for i in range(1000):
        book.record(GpuEvent(0, "xid", 13), i / 1000, lambda gpu: "none")
    book.record(GpuEvent(0, "xid", 31), 0.5, lambda gpu: "none")  # another kind has its own line
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and book.counts[(0, 13, "xid")] == 1000
    book.record(GpuEvent(0, "xid", 13), 601, lambda gpu: "none")
    assert "(999 more since the last line)" in caplog.records[-1].getMessage()


def test_a_reload_gives_the_xid_repeat_its_new_period(caplog):
    """alerts.repeat_s reached the events' book only at start: a reload changed the alert reminders, not the Xid
    lines (600 s kept)."""
    caplog.set_level("INFO")
    monitor, clock = sim_monitor()
    monitor.record_events([GpuEvent(0, "xid", 13)], clock.now)
    monitor.record_events([GpuEvent(0, "xid", 13)], clock.now)  # counted: within the period
    reloaded, _ = sim_monitor()
    monitor.reconfigure(dataclasses.replace(reloaded.config, alerts=dataclasses.replace(reloaded.config.alerts,
                                                                                        repeat_s=30.0)))
    clock.advance(31)
    monitor.record_events([GpuEvent(0, "xid", 13)], clock.now)  # the running period ended at 30 s: said, +1 more
    clock.advance(31)
    monitor.record_events([GpuEvent(0, "xid", 13)], clock.now)  # and again 30 s later
    lines = [r.getMessage() for r in caplog.records if "Xid 13" in r.getMessage()]
    assert len(lines) == 3 and "(1 more since the last line)" in lines[1], lines


def test_a_gpu_that_needs_a_reset_stops_the_engine_instead_of_restarting_it():
    sup, ops, clock = running_supervisor()
    pid = sup.child.pid
    sup.hold(clock.now, "waiting for GPU0's action: reboot the node (Xid 79 (GPU has fallen off the bus))")
    assert sup.state == HELD and (pid, 9) in ops.signals  # held for the GPU: not FATAL, the engine is not at fault
    assert "Xid 79" in sup.view().problem
    clock.advance(120)
    sup.tick(clock.now)
    assert sup.state == HELD and len(ops.children) == 1  # no restart loop on a broken GPU


def test_app_xids_name_the_processes_on_that_gpu(caplog):
    caplog.set_level("INFO")
    monitor, clock = sim_monitor()
    monitor.backend.gpus()[1].processes = [(1, None)]  # pid 1 exists everywhere
    monitor.record_events([GpuEvent(1, "xid", 31)], clock.now)
    assert "processes on it: pid 1 (" in caplog.records[-1].getMessage()


@pytest.mark.process
def test_an_xid_is_logged_when_it_happens_not_at_the_next_poll(write, daemons):
    """A real daemon on the simulator, polling every 5 s: the Xid at 2 s is in the journal about then."""
    scenario = write("xid.yaml", resolve_scenario("lock-lost").read_text().split("timeline:")[0] + "timeline:\n  - {at_s: 0, event: load, utilization_pct: 60}\n"
        "  - {at_s: 2, event: xid, xid: 79}\n  - {at_s: 3, event: xid, xid: 13, count: 500}\n")
    metrics = free_port()
    path = write("gpuwarden.yaml", f"poll_interval_s: 5\nmetrics:\n  listen: 127.0.0.1:{metrics}\n"
                                    f"gpu:\n  backend: sim\n  scenario: {scenario}\ntuning:\n  apply: false\n")
    d = daemons(path)
    d.wait_for("GPU events: waiting for GPU0 xid,recovery_action", timeout=20)
    started = time.monotonic()
    d.wait_for("GPU0 Xid 79 (GPU has fallen off the bus)", timeout=10)
    line_after = time.monotonic() - started
    d.wait_for("GPU0 Xid 13 (Graphics Engine Exception)", timeout=10)
    assert line_after < 4.0, f"the Xid waited {line_after:.1f} s: for the next poll, not for the event"
    deadline = time.monotonic() + 12
    while time.monotonic() < deadline:
        text = urllib.request.urlopen(f"http://127.0.0.1:{metrics}/metrics", timeout=5).read().decode()
        if 'gpuwarden_gpu_xid_errors_total{gpu="0",xid="13"} 500.0' in text:
            break
        time.sleep(0.5)
    assert 'gpuwarden_gpu_xid_errors_total{gpu="0",xid="79"} 1.0' in text
    assert 'gpuwarden_gpu_xid_errors_total{gpu="0",xid="13"} 500.0' in text
    events = [line for line in d.lines if "GPU0 Xid 13 (Graphics Engine Exception)" in line and "recovery:" in line]
    assert len(events) == 1, events  # 500 of them, one line
    assert "gpu_xid firing: Xid 13 (Graphics Engine Exception) x500" in d.log
    assert d.stop() == 0
    assert "the GPU event thread did not end" not in d.log


def test_a_gpu_waiting_for_a_reset_holds_an_engine_started_later_until_a_reload_says_it_is_done():
    from gpuwarden.service.daemon import Daemon

    class Watcher:
        failure = None

        def take(self):
            return []

    sup, ops, clock = supervisor()
    cfg = config.parse_text("gpu:\n  backend: sim\n  scenario: rtx-pro-4000-headless\nmetrics:\n  listen: none\n"
                            "tuning:\n  apply: false\n")
    daemon = Daemon(cfg, open_configured(cfg, ManualClock()), reload=lambda: cfg, clock=clock)
    daemon.watcher, daemon.serving.children = Watcher(), Supervisor([sup])
    daemon.monitor.events.needs_reset[0] = "Xid 79 (GPU has fallen off the bus): reboot the node"
    ops.health_ok = True
    sup.start(clock.now)  # started after the event, on that GPU
    daemon.handle_gpu_events()
    assert sup.state == HELD and "waiting for GPU0's action: reboot the node (Xid 79" in sup.view().problem
    daemon.changes.reload()  # the operator rebooted or reset it: SIGHUP leaves HELD and starts again
    assert not daemon.monitor.events.needs_reset and sup.state == "STARTING"
