"""GPM with the daemon running, read-only, on real Hopper (or newer) GPUs (run by hand on a GPU host; not collected
by pytest, no GPU in CI). Two checks of issue 41:

    PYTHONPATH=daemon python3 tests/hardware/gpm_daemon_readonly.py agree [--seconds 75]
    PYTHONPATH=daemon python3 tests/hardware/gpm_daemon_readonly.py lag [--seconds 45]

agree: `gpuwarden run` (tuning.apply false, NVML wrapped by nvml_readonly.py's guard so only reads pass) reads GPM
every --counters seconds while gpm_readonly.py's loads run on GPU 0 one after another (a bf16 matmul, a
device-to-device copy, a sleep kernel, each --seconds, then idle), and `nvidia-smi dmon --gpm-metrics 1,2,3,5,10
-d 1` runs beside it. The daemon's /status is read every 0.2 s; each time GPU 0's GPM figures change, the daemon
has read a new window (the interval since its last read), which is compared with the mean of dmon's one-second
lines inside it. Windows that straddle a load's start (its --settle seconds) are left out. It prints, per load and
figure, the windows compared and the largest difference in points, and whether busy_but_idle fired.

lag: the daemon on every GPU of the host, idle, for --seconds with GPM and again without (GPM's calls hidden, as an
nvidia-ml-py without them): each poll's sample duration (the polls that read the counters, GPM among them, apart)
and the loop's lag, from /status's sequence of polls.

Nothing is set on the card; a call that would set something is refused and printed from the daemon's log.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import queue
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from gpm_readonly import COMPARED, dmon, dmon_rows, start_load  # tests/hardware/, beside this script
from nvml_readonly import HIDE_GPM

HERE = Path(__file__).resolve().parent
FIELDS = {metric: field for metric, (_, field) in COMPARED.items()}
LIMIT_POINTS = 5.0


class Daemon:
    """`gpuwarden run` under the read-only guard, on a config of its own, and its /status."""

    def __init__(self, workdir: Path, poll_s: float, counters_s: float, hide_gpm: bool = False):
        port = 19000 + os.getpid() % 1000
        self.url = f"http://127.0.0.1:{port}/status"
        config = workdir / f"gpuwarden-{int(hide_gpm)}.yaml"
        config.write_text(f"poll_interval_s: {poll_s}\ncounters_interval_s: {counters_s}\nlog_interval_s: 3600\n"
                          f"metrics:\n  listen: 127.0.0.1:{port}\ntuning:\n  apply: false\n")
        env = dict(os.environ, **({HIDE_GPM: "1"} if hide_gpm else {}))
        self.log = workdir / f"daemon-{int(hide_gpm)}.log"
        self.proc = subprocess.Popen([sys.executable, str(HERE / "nvml_readonly.py"), "guard", "run", "-c",
                                      str(config)], stdout=self.log.open("w"), stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + 60
        while self.status() is None:
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise SystemExit(f"the daemon did not answer /status:\n{self.log.read_text()[-3000:]}")
            time.sleep(0.2)

    def status(self) -> dict | None:
        try:
            with urllib.request.urlopen(self.url, timeout=2) as reply:
                return json.load(reply)
        except (OSError, ValueError):
            return None

    def stop(self) -> str:
        self.proc.terminate()
        self.proc.wait(30)
        text = self.log.read_text()
        return "\n".join(line for line in text.splitlines() if "read-only probe" in line)


# -- agree --------------------------------------------------------------------------------------------------------

def gpm_of(gpu: dict) -> tuple:
    return tuple(gpu.get(field) for field in FIELDS.values())


def agree(args, workdir: Path) -> int:
    daemon = Daemon(workdir, 0.5, args.counters)
    deadline = time.monotonic() + 60
    while (state := daemon.status()) is None or not state.get("gpus") or gpm_of(state["gpus"][0])[0] is None:
        # primed: a first pair
        if time.monotonic() > deadline:
            print("GPU 0 reports no GPM through the daemon:", ((state or {}).get("gpus") or [{}])[0])
            print(daemon.stop())
            return 2
        time.sleep(0.5)
    gpu0 = state["gpus"][0]
    print(f"GPU 0: {gpu0['name']} ({gpu0['pci_bus_id']}); the daemon reads GPM every {args.counters:g} s")
    lines: queue.Queue = queue.Queue()
    smi = dmon(lines)
    ctx = multiprocessing.get_context("spawn")
    phases, reads = [], []  # (load, steady from, end); (time seen, figures, util, firing on GPU 0)
    try:
        for name, seconds in (("matmul", args.seconds), ("copy", args.seconds), ("sleep", args.seconds),
                              ("idle", min(args.seconds, 30.0))):
            if (started := start_load(ctx, name)) is None:
                return 1
            child, stop = started
            start = time.time()
            while time.time() < start + args.settle + seconds:
                if (state := daemon.status()) is not None and state.get("gpus"):
                    gpu = state["gpus"][0]
                    firing = sorted(a["alert"] for a in state["alerts_firing"] if a["gpu"] == 0)
                    reads.append((time.time(), gpm_of(gpu), gpu.get("utilization_pct"), firing))
                time.sleep(0.2)
            phases.append((name, start + args.settle, time.time()))
            stop.set()
            child.join(30)
    finally:
        time.sleep(1.5)  # dmon's last line
        smi.terminate()
        smi.wait(10)
        refused = daemon.stop()
        if os.environ.get("OUT"):  # the raw reads and the daemon's log, to look at afterwards
            Path(os.environ["OUT"], "agree-reads.json").write_text(json.dumps({"phases": phases, "reads": reads}))
            Path(os.environ["OUT"], "agree-daemon.log").write_text(daemon.log.read_text()[-200_000:])
    received = []
    while not lines.empty():
        received.append(lines.get())
    theirs, other = dmon_rows(received)
    # A share over 100 % is no reading: one dmon line in a copy load once printed gract as 329,529,269 %
    impossible = sum(1 for _, v in theirs for m in FIELDS if v.get(m, 0) > 100)
    theirs = [(at, {k: x for k, x in v.items() if k == "util" or x <= 100}) for at, v in theirs]
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "agree-dmon.txt").write_text("".join(f"{at:.3f} {line}\n" for at, line in received))
    # a line stamped T (whole seconds, printed within the second after) covers about (T - 0.5, T + 0.5]: its stamp
    # is its middle
    changes = [reads[0]] + [r for prev, r in zip(reads, reads[1:]) if r[1] != prev[1]]

    print(f"\nEach window is the daemon's interval between two GPM reads ({args.counters:g} s); dmon's lines inside "
          f"it are averaged. Loads of {args.seconds:g} s after {args.settle:g} s settling.\n")
    print("| load | figure | windows | gpuwarden mean % | dmon mean % | largest difference in a window (points) |")
    print("| --- | --- | --- | --- | --- | --- |")
    worst, notice = 0.0, {}
    for name, low, high in phases:
        # fired: turned on during this load (one still firing from the load before, while it clears, is not)
        inside = [(t, "busy_but_idle" in firing) for t, _, _, firing in reads if low - args.settle <= t <= high]
        notice[name] = next((t - low + args.settle for (_, was), (t, now) in zip(inside, inside[1:])
                             if now and not was), None)
        windows = [(a[0], b[0], b[1]) for a, b in zip(changes, changes[1:]) if a[0] >= low and b[0] <= high]
        print(f"{name}: {sum(low <= r[0] <= high for r in reads)} /status reads, {len(windows)} windows")
        for metric, field in FIELDS.items():
            diffs, mine, smis = [], [], []
            for began, ended, figures in windows:
                inside = [v[metric] for at, v in theirs if began < at <= ended and metric in v]
                value = figures[list(FIELDS).index(metric)]
                if inside and value is not None:
                    mine.append(value * 100)
                    smis.append(statistics.fmean(inside))
                    diffs.append(mine[-1] - smis[-1])
            largest = max(diffs, key=abs) if diffs else None
            if largest is not None:
                worst = max(worst, abs(largest))
            print(f"| {name} | {COMPARED[metric][0]} | {len(diffs)} | "
                  f"{statistics.fmean(mine) if mine else float('nan'):.1f} | "
                  f"{statistics.fmean(smis) if smis else float('nan'):.1f} | "
                  f"{'-' if largest is None else f'{largest:+.1f}'} |")
    print(f"\nLargest difference in any window: {worst:.1f} points ({'within' if worst <= LIMIT_POINTS else 'OVER'} "
          f"{LIMIT_POINTS:g}).")
    if impossible:
        print(f"{impossible} dmon figures over 100 % left out (not a share).")
    for name, at in notice.items():
        print(f"busy_but_idle during {name}: " + ("not fired" if at is None else f"fired {at:.0f} s after it began"))
    if not theirs:
        print("nvidia-smi dmon gave no data lines; it printed:\n" + "\n".join(other[:20]))
    if refused:
        print("REFUSED NVML calls:\n" + refused, file=sys.stderr)
        return 1
    quiet = all(notice[n] is None for n in ("matmul", "copy", "idle"))
    return 0 if worst <= LIMIT_POINTS and notice["sleep"] is not None and quiet else 1


# -- lag ----------------------------------------------------------------------------------------------------------

def polls(daemon: Daemon, seconds: float) -> list[dict]:
    """Each poll's /status once (by its sequence number), for `seconds`."""
    seen: dict[int, dict] = {}
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if (state := daemon.status()) is not None:
            seen.setdefault(state["sequence"], state)
        time.sleep(0.05)
    return [seen[k] for k in sorted(seen)]


def lag(args, workdir: Path) -> int:
    every = max(1, round(args.counters / 0.5))  # Monitor.counters_every: polls 1, 1 + every, ... read them
    rows, refused = [], ""
    for hide in (False, True):
        daemon = Daemon(workdir, 0.5, args.counters, hide_gpm=hide)
        time.sleep(2 * args.counters)  # primed
        seen = polls(daemon, args.seconds)
        refused += daemon.stop()
        gpus = len(seen[-1]["gpus"]) if seen else 0
        with_gpm = sum(g.get("sm_active_ratio") is not None for g in seen[-1]["gpus"]) if seen else 0
        counters = [s["sample_duration_seconds"] * 1e3 for s in seen if (s["sequence"] - 1) % every == 0]
        plain = [s["sample_duration_seconds"] * 1e3 for s in seen if (s["sequence"] - 1) % every != 0]
        lags = [s["loop_lag_seconds"] * 1e3 for s in seen]
        rows.append((("without" if hide else "with") + f" GPM ({with_gpm} of {gpus} GPUs read it)", len(seen),
                     counters, plain, lags))
    print(f"\nThe daemon on every GPU, idle, {args.seconds:g} s each way; poll 0.5 s, counters every {args.counters:g}"
          " s.\n")
    print("| run | polls | counters poll: sample ms, median / max | other polls: median / max | loop lag ms: "
          "median / p99 / max |")
    print("| --- | --- | --- | --- | --- |")
    for name, count, counters, plain, lags in rows:
        def mm(v):
            return f"{statistics.median(v):.1f} / {max(v):.1f}" if v else "-"
        q = sorted(lags)
        p99 = q[min(len(q) - 1, int(0.99 * len(q)))] if q else float("nan")
        print(f"| {name} | {count} | {mm(counters)} | {mm(plain)} | {mm(lags).split(' / ')[0]} / {p99:.1f} / "
              f"{max(lags) if lags else float('nan'):.1f} |")
    if rows[0][2] and rows[1][2]:
        added = statistics.median(rows[0][2]) - statistics.median(rows[1][2])
        print(f"\nGPM adds {added:.2f} ms to a counters poll (median against median).")
    if refused:
        print("REFUSED NVML calls:\n" + refused, file=sys.stderr)
        return 1
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("check", choices=("agree", "lag"))
    parser.add_argument("--seconds", type=float, help="each load's (agree, default 75) or run's (lag, default 45) "
                        "measured time")
    parser.add_argument("--counters", type=float, default=5.0, help="the daemon's counters_interval_s (default 5)")
    parser.add_argument("--settle", type=float, default=3.0, help="seconds left out at each load's start (agree)")
    args = parser.parse_args()
    args.seconds = args.seconds or (75.0 if args.check == "agree" else 45.0)
    with tempfile.TemporaryDirectory(prefix="gpuwarden-gpm-") as workdir:
        return (agree if args.check == "agree" else lag)(args, Path(workdir))


if __name__ == "__main__":
    sys.exit(main())
