"""Issue 28 on a real multi-GPU host, read-only: NVLink, the fabric, the topology, the counters' schedule,
STATUS, alerts idle and under load, and the daemon's RSS with real NVML (run by hand on a GPU host).

    PYTHONPATH=daemon python3 tests/hardware/nvlink_readonly.py OUTDIR [--fake]

Everything goes through nvml_readonly.ReadOnlyNvml (a setter raises instead of reaching a card); the only
nvidia-smi calls are queries (nvlink -s, nvlink -e, topo -m, -q). It writes OUTDIR/report.json and the raw
outputs beside it, and prints a summary. The load is NCCL all-reduce plus matmuls from torch in child
processes. --fake runs the same on tests/harness/fake_nvml.py (four NVSwitch H100s), without nvidia-smi or torch, to
check the script itself. Not collected by pytest.
"""

from __future__ import annotations

import json
import re
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

POLL_S, COUNTERS_S = 1.0, 10.0  # the defaults: counters every 10th poll
IDLE_S, LOAD_S, RUN_S = 30, 60, 150  # idle, then the load (plus its start-up, ~20 s), then idle to the end
CONFIG = (f"poll_interval_s: {POLL_S}\ncounters_interval_s: {COUNTERS_S}\nlog_interval_s: 3600\n"
          "metrics:\n  listen: 127.0.0.1:{port}\ntuning:\n  apply: false\n")

LOAD = r'''
import os, sys, time, torch, torch.distributed as dist, torch.multiprocessing as mp
def work(rank, world, seconds, port):
    torch.cuda.set_device(rank)
    nccl = None
    try:
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    except Exception as exc:
        nccl = f"{type(exc).__name__}: {exc}"
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    buf = torch.ones(64 << 20, device="cuda", dtype=torch.float32)  # 256 MB a step over NVLink
    end, steps = time.monotonic() + seconds, 0
    while time.monotonic() < end:
        for _ in range(8):
            a = (a @ a).clamp_(-1, 1)
        if nccl is None:
            dist.all_reduce(buf)
        torch.cuda.synchronize()
        steps += 1
    print(f"rank {rank}: {steps} steps, nccl {'ok' if nccl is None else nccl}", flush=True)
    if nccl is None:
        dist.destroy_process_group()
if __name__ == "__main__":
    world = torch.cuda.device_count()
    mp.spawn(work, args=(world, float(sys.argv[1]), int(sys.argv[2])), nprocs=world)
'''


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def smi(out: Path, name: str, *args: str) -> str:
    """A read-only nvidia-smi query, saved."""
    try:
        text = subprocess.run(["nvidia-smi", *args], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.TimeoutExpired) as exc:
        text = f"nvidia-smi failed: {exc}"
    (out / f"{name}.txt").write_text(text)
    return text


def smi_by_uuid(text: str) -> dict[str, dict[int, list[str]]]:
    """nvidia-smi nvlink -s / -e: {uuid: {link: [what follows "Link N: ", one per line]}}."""
    found: dict[str, dict[int, list[str]]] = {}
    current = None
    for line in text.splitlines():
        gpu = re.match(r"GPU \d+: .*\(UUID: (GPU-[0-9a-fA-F-]+)\)", line)
        if gpu:
            current = found.setdefault(gpu.group(1), {})
            continue
        link = re.match(r"\s*Link (\d+): (.*)$", line)
        if link and current is not None:
            current.setdefault(int(link.group(1)), []).append(link.group(2).strip())
    return found


def compare(samples, speeds_text: str, errors_text: str) -> dict:
    """Each link's state and speed against `nvidia-smi nvlink -s`, its counters against `nvlink -e`."""
    speeds, errors = smi_by_uuid(speeds_text), smi_by_uuid(errors_text)
    checked, mismatches, unknown = Counter(), [], set()
    for s in samples:
        for n in s.health.nvlinks:
            said = speeds.get(s.uuid, {}).get(n.link, [])
            if said:
                checked["state"] += 1
                inactive = "inactive" in said[0].lower()
                speed = re.match(r"([\d.]+) GB/s", said[0])
                if inactive != (n.state == "down") or (speed and n.speed_mbps is not None and
                                                        abs(float(speed.group(1)) * 1000 - n.speed_mbps) > 1):
                    mismatches.append(f"GPU{s.index} link {n.link}: nvidia-smi {said[0]!r}, gpuwarden {n.state} "
                                      f"{n.speed_mbps} MB/s")
            for entry in errors.get(s.uuid, {}).get(n.link, []):
                name, _, value = entry.rpartition(": ")
                low = name.lower()
                kind = "replay" if "replay" in low else "recovery" if "recovery" in low else \
                    "crc" if "crc" in low and "data" not in low else None
                if kind is None or not value.strip().isdigit():
                    unknown.add(name)
                    continue
                checked[kind] += 1
                if getattr(n, kind) != int(value):
                    mismatches.append(f"GPU{s.index} link {n.link} {kind}: nvidia-smi {value}, gpuwarden "
                                      f"{getattr(n, kind)}")
    return {"checked": dict(checked), "mismatches": mismatches, "counters_not_compared": sorted(unknown)}


def probe(nvml, handles) -> dict:
    """What each way of asking answers on this driver (GPU 0, link 0), with its median cost: the evidence for
    the calls gpu/nvml.py makes."""
    import ctypes

    h, other = handles[0], handles[1] if len(handles) > 1 else handles[0]

    def ask(fn, *args):
        """fn: a pynvml function's name, or a callable."""
        costs, result = [], None
        for _ in range(20):
            started = time.perf_counter()
            try:
                result = (getattr(nvml, fn) if isinstance(fn, str) else fn)(*args)
            except Exception as exc:  # evidence, not control: an NVML error or a call this pynvml lacks
                result = f"{type(exc).__name__} {getattr(exc, 'value', '')}: {exc}"
            costs.append((time.perf_counter() - started) * 1e6)
        return {"result": result if isinstance(result, (int, str, float, bool, type(None))) else repr(result)[:200],
                "median_us": round(statistics.median(costs), 1)}

    out = {}
    fields = {"replay": 161, "recovery": 162, "crc": 163, "speed": 164, "state": 165, "link_count": 91}
    for name, fid in fields.items():
        v = nvml.nvmlDeviceGetFieldValues(h, [(fid, 0)] if name != "link_count" else [fid])[0]
        out[f"field {fid} ({name})"] = {"return": v.nvmlReturn, "type": v.valueType,
                                        "value": getattr(v.value, ("dVal", "uiVal", "ulVal", "ullVal", "sllVal",
                                                                   "siVal", "usVal")[v.valueType])
                                        if v.nvmlReturn == 0 and v.valueType < 7 else None}
    for total in (38, 45, 52, 59):  # the _COUNT_TOTAL fields the issue found NOT_SUPPORTED
        out[f"field {total} (total)"] = nvml.nvmlDeviceGetFieldValues(h, [total])[0].nvmlReturn
    batch = [(f, link) for link in range(18) for f in (161, 162, 163, 164, 165)]
    out["batch of 90 per-link fields"] = ask(lambda: len(nvml.nvmlDeviceGetFieldValues(h, batch)))
    for counter in range(5):
        out[f"ErrorCounter(link 0, {counter})"] = ask("nvmlDeviceGetNvLinkErrorCounter", h, 0, counter)
    out["NvLinkState(link 0)"] = ask("nvmlDeviceGetNvLinkState", h, 0)
    out["NvLinkVersion(link 0)"] = ask("nvmlDeviceGetNvLinkVersion", h, 0)
    out["RemotePciInfo(link 0)"] = ask(lambda: nvml.nvmlDeviceGetNvLinkRemotePciInfo(h, 0).busId)
    out["RemoteDeviceType(link 0)"] = ask("nvmlDeviceGetNvLinkRemoteDeviceType", h, 0)
    out["P2PStatus(0, 1, NVLINK)"] = ask("nvmlDeviceGetP2PStatus", h, other, 2)
    out["TopologyCommonAncestor(0, 1)"] = ask("nvmlDeviceGetTopologyCommonAncestor", h, other)
    out["Brand"] = ask("nvmlDeviceGetBrand", h)
    out["ModuleId"] = ask("nvmlDeviceGetModuleId", h)
    out["DefaultApplicationsClock(GRAPHICS)"] = ask("nvmlDeviceGetDefaultApplicationsClock", h, 0)
    out["C2cModeInfoV"] = ask(lambda: nvml.nvmlDeviceGetC2cModeInfoV(h).isC2cEnabled)
    struct = getattr(nvml, "c_nvmlGpuFabricInfoV_t", None)
    if struct is not None:
        info = struct()
        out["GpuFabricInfoV"] = ask(lambda: (nvml.nvmlDeviceGetGpuFabricInfoV(h, ctypes.byref(info)),
                                             int(info.state), int(info.status)) and
                                    f"state {int(info.state)} status {int(info.status)}")
    old = getattr(nvml, "c_nvmlGpuFabricInfo_t", None)
    if old is not None:
        info_old = old()
        out["GpuFabricInfo (old)"] = ask(lambda: nvml.nvmlDeviceGetGpuFabricInfo(h, ctypes.byref(info_old)) or
                                         f"state {int(info_old.state)} status {int(info_old.status)}")
    return out


def cost(nvml, backend) -> dict:
    """What one counters read costs per GPU, by part (median of 10, ms): where the milliseconds go."""
    from gpuwarden.gpu.nvml_counters import COUNTER_FIELDS, NVLINK_FIELDS

    gpu = backend.gpus()[0]
    h, links = gpu.handle, gpu.links

    def ms(fn):
        costs = []
        for _ in range(10):
            started = time.perf_counter()
            fn()
            costs.append((time.perf_counter() - started) * 1e3)
        return round(statistics.median(costs), 3)

    import ctypes
    out = {"links": len(links),
           "sample, counters read": ms(lambda: gpu.sample(counters=True)),
           "sample, no counters": ms(lambda: gpu.sample(counters=False)),
           "batch: the counter fields before NVLink": ms(lambda: nvml.nvmlDeviceGetFieldValues(
               h, list(COUNTER_FIELDS.values())))}
    for name, fid in NVLINK_FIELDS.items() if links else ():  # NVML refuses an empty batch (one GPU, no links up)
        out[f"batch: field {fid} ({name}) x {len(links)} links"] = ms(
            lambda fid=fid: nvml.nvmlDeviceGetFieldValues(h, [(fid, link) for link in links]))
    out["nvmlDeviceGetNvLinkErrorCounter x links x 3"] = ms(
        lambda: [nvml.nvmlDeviceGetNvLinkErrorCounter(h, link, c) for link in links for c in range(3)])
    out["nvmlDeviceGetNvLinkState x links"] = ms(lambda: [nvml.nvmlDeviceGetNvLinkState(h, link) for link in links])
    info = nvml.c_nvmlGpuFabricInfoV_t()
    out["nvmlDeviceGetGpuFabricInfoV"] = ms(lambda: nvml.nvmlDeviceGetGpuFabricInfoV(h, ctypes.byref(info)))
    out["PCIe gen/width x4 calls"] = ms(lambda: [getattr(nvml, f)(h) for f in (
        "nvmlDeviceGetCurrPcieLinkGeneration", "nvmlDeviceGetMaxPcieLinkGeneration",
        "nvmlDeviceGetCurrPcieLinkWidth", "nvmlDeviceGetMaxPcieLinkWidth")])
    return out


def watch_status(sock: socket.socket, into: list) -> None:
    while True:
        try:
            data = sock.recv(65536).decode()
        except OSError:
            return
        for line in data.splitlines():
            if line.startswith("STATUS="):
                into.append((time.monotonic(), line[7:]))


def rss_of(pid: int) -> dict:
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return {}
    return {k: v.strip() for k, v in (line.split(":", 1) for line in text.splitlines()) if k in ("VmRSS", "VmHWM")}


def main(out: Path, fake: bool) -> int:
    import logging

    from gpuwarden import config
    from gpuwarden.service.daemon import Daemon, run
    from gpuwarden.watch.doctor import diagnose
    from gpuwarden.gpu.nvml import NvmlBackend
    from gpuwarden.base.systemd import Notifier, setup_logging
    from gpuwarden.tune.tuning import make_plan

    out.mkdir(parents=True, exist_ok=True)
    report: dict = {"fake": fake}
    if fake:
        from harness.fake_nvml import FakeNvml, device, nvlink

        buses = [f"00000000:{b}:00.0" for b in ("18", "2A", "3A", "5D")]
        nvml = FakeNvml([device(f"GPU-{i}", bus, nvlinks=[nvlink("00000000:C0:00.0", remote_type=2)] * 18,
                                fabric=(3, 0)) for i, bus in enumerate(buses)])
        speeds_text = errors_text = ""
    else:
        from nvml_readonly import ReadOnlyNvml

        nvml = ReadOnlyNvml()
        speeds_text = smi(out, "nvlink-s", "nvlink", "-s")
        errors_text = smi(out, "nvlink-e", "nvlink", "-e")
        smi(out, "topo-m", "topo", "-m")
        smi(out, "q", "-q")

    # 1. The backend's reading of every link, the fabric, the board and the topology, against nvidia-smi.
    read_on: list[tuple[int, int]] = []  # (monitor poll, gpu) of every batched counters read
    monitor_ref: list = []
    batch = nvml.nvmlDeviceGetFieldValues
    index_of: dict = {}

    def recording(handle, ids):
        if monitor_ref:
            read_on.append((monitor_ref[0].polls, index_of.get(id(handle), -1)))
        return batch(handle, ids)

    backend = NvmlBackend(nvml, counters_interval_s=COUNTERS_S)
    for gpu in backend.gpus():
        index_of[id(gpu.handle)] = gpu.index
    nvml.nvmlDeviceGetFieldValues = recording  # an instance attribute: ReadOnlyNvml's __getattr__ is not asked
    samples = [g.sample(counters=True) for g in backend.gpus()]
    report["gpus"] = [{"index": s.index, "uuid": s.uuid, "name": s.name, "bus": s.pci_bus_id,
                       "board": s.as_dict()["board"], "peer_paths": s.as_dict()["peer_paths"], "iommu": s.iommu,
                       "fabric": [s.health.fabric, s.health.fabric_error],
                       "links": [[n.link, n.state, n.peer, n.speed_mbps, n.replay, n.recovery, n.crc]
                                 for n in s.health.nvlinks]} for s in samples]
    report["persistenced"] = backend.persistenced_state()
    report["against_nvidia_smi_before"] = compare(samples, speeds_text, errors_text)
    report["probe"] = probe(nvml, [g.handle for g in backend.gpus()])
    report["cost_ms"] = cost(nvml, backend)
    if "--cost" in sys.argv:
        (out / "report.json").write_text(json.dumps(report, indent=1, default=str))
        print(json.dumps({k: report[k] for k in ("probe", "cost_ms")}, indent=1, default=str))
        return 0

    # 2. doctor and plan, read-only, in this process.
    port = free_port()
    cfg = config.parse_text(CONFIG.replace("{port}", str(port)), name="nvlink.yaml")
    report["doctor"] = [str(d) for d in diagnose(cfg, backend, deep=False)]
    report["plan"] = [a.describe() for a in make_plan(backend, cfg).actions] + list(make_plan(backend, cfg).notes)

    # 3. The daemon's loop in this process (the defaults: 1 s polls, counters every 10th), idle, under NCCL
    # and matmul load, idle again; a notify socket counts the STATUS messages; a second daemon in its own
    # process (the CLI through the guard) gives the RSS with real NVML.
    notify = out / "notify.sock"
    notify.unlink(missing_ok=True)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(notify))
    statuses: list = []
    threading.Thread(target=watch_status, args=(sock, statuses), daemon=True).start()
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record)

    setup_logging()
    logging.getLogger("gpuwarden").addHandler(Keep(logging.INFO))
    daemon = Daemon(cfg, backend, notifier=Notifier({"NOTIFY_SOCKET": str(notify)}))
    monitor_ref.append(daemon.monitor)
    durations: list[tuple[int, float]] = []
    busiest: dict[int, float] = {}
    tick = daemon.monitor.tick

    def timed_tick(now, *args, **kwargs):
        snap = tick(now, *args, **kwargs)
        durations.append((snap.sequence - 1, snap.sample_duration_s))
        for v in snap.gpus:
            busiest[v.sample.index] = max(busiest.get(v.sample.index, 0), v.sample.utilization_pct or 0)
        return snap

    daemon.monitor.tick = timed_tick
    second = None
    if not fake:
        cfg2, port2 = out / "second.yaml", free_port()
        cfg2.write_text(CONFIG.replace("{port}", str(port2)))
        second = subprocess.Popen([sys.executable, str(HERE / "nvml_readonly.py"), "guard", "run", "-c", str(cfg2),
                                   "--duration", str(RUN_S - 10)],
                                  stdout=subprocess.DEVNULL, stderr=open(out / "second-daemon.log", "w"))
    load = {}

    def phases():
        time.sleep(IDLE_S)
        load["start_poll"] = daemon.monitor.polls
        if fake:
            time.sleep(LOAD_S)
        else:
            script = out / "load.py"
            script.write_text(LOAD)
            proc = subprocess.run(["timeout", str(LOAD_S + 60), sys.executable, str(script), str(LOAD_S),
                                   str(free_port())], capture_output=True, text=True)
            load["output"] = (proc.stdout + proc.stderr)[-3000:]
            load["rc"] = proc.returncode
        load["end_poll"] = daemon.monitor.polls

    loader = threading.Thread(target=phases, daemon=True)
    loader.start()
    rss = []
    started = time.monotonic()

    def sample_rss():
        while second is not None and second.poll() is None:
            time.sleep(15)
            rss.append({"t": round(time.monotonic() - started), **rss_of(second.pid)})
            if len(rss) == 4:  # its /metrics with real NVML, once
                import urllib.request
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port2}/metrics", timeout=5) as reply:
                        (out / "metrics.txt").write_bytes(reply.read())
                except OSError as exc:
                    (out / "metrics.txt").write_text(f"scrape failed: {exc}")

    threading.Thread(target=sample_rss, daemon=True).start()
    run(daemon, duration_s=RUN_S if not fake else 12)
    loader.join(timeout=5)
    if second is not None:
        second.wait(60)
    sock.close()

    every = daemon.monitor.counters_every()
    polls = daemon.monitor.polls
    by_poll: dict[int, list[int]] = {}
    for poll, gpu in read_on:
        by_poll.setdefault(poll - 1, []).append(gpu)  # .polls counts the poll in progress already
    counter_polls = sorted(by_poll)
    gpus = sorted(g.index for g in backend.gpus())
    report["counters"] = {
        "every": every, "polls": polls, "read_on_polls": counter_polls,
        "exactly_every_nth": counter_polls == list(range(0, polls, every)),
        "all_gpus_each_time": all(sorted(by_poll[p]) == gpus for p in counter_polls)}
    costs = dict(durations)
    counted = [costs[p] * 1e3 for p in counter_polls if p in costs]
    others = [v * 1e3 for p, v in costs.items() if p not in by_poll]
    report["poll_cost_ms"] = {
        "counter_polls": [round(min(counted), 2), round(statistics.median(counted), 2), round(max(counted), 2)]
        if counted else None,
        "other_polls": [round(min(others), 2), round(statistics.median(others), 2), round(max(others), 2)]
        if others else None}
    levels = Counter(r.levelname for r in records)
    report["log"] = {"levels": dict(levels),
                     "warnings": [r.getMessage() for r in records if r.levelno >= logging.WARNING][:20],
                     "notes": [r.getMessage() for r in records if "nvidia-persistenced" in r.getMessage()]}
    report["alerts_fired"] = sorted({f"{a}/{g}" for (a, g, to), n in daemon.monitor.transitions.items()
                                     if to == "firing"})
    report["status_messages"] = {"count": len(statuses), "lines": [s for _, s in statuses][:10],
                                 "seconds": RUN_S}
    report["load"] = load
    last = daemon.monitor.snapshot
    report["max_utilization_pct"] = busiest
    report["last_status"] = last.summary_line() if last else None
    report["rss_second_daemon"] = rss
    after = [g.sample(counters=True) for g in backend.gpus()]
    if not fake:
        speeds_text = smi(out, "nvlink-s-after", "nvlink", "-s")
        errors_text = smi(out, "nvlink-e-after", "nvlink", "-e")
    report["against_nvidia_smi_after"] = compare(after, speeds_text, errors_text)
    backend.close()
    (out / "report.json").write_text(json.dumps(report, indent=1, default=str))
    summary = {k: report[k] for k in ("persistenced", "against_nvidia_smi_before", "against_nvidia_smi_after",
                                       "counters", "poll_cost_ms", "alerts_fired", "status_messages")}
    summary["doctor_peer"] = [d for d in report["doctor"] if "peer" in d]
    summary["rss"] = rss[-1:] if rss else None
    summary["max_utilization_pct"] = busiest
    summary["load_rc"] = load.get("rc")
    print(json.dumps(summary, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]), "--fake" in sys.argv[2:]))
