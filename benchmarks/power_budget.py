"""The power budget's done-when on the simulator: two 600 W RTX PRO 6000 Server cards (minimum limit 150 W) under
tuning.power_budget_w 800 W, the load moving from one card to the other every 20 s for 5 minutes, the daemon's
budget polled (and the sum of the enforced limits checked) every 100 ms of simulated time.

    PYTHONPATH=daemon python3 benchmarks/power_budget.py [--seconds 300] [--every 20] [--budget 800] [--smoke]

It records the largest sum of the enforced limits seen (at every check and right after every set NVML took), the
moves, and the busy card's served speed against the operator's static 400/400 split, for decode and prefill: the
speed model the simulator's fake OpenAI server serves at (gpu/sim/power.speed over the card's published clock
fraction under full load), averaged over every check. In-process, simulated time: it takes about a second.

    PYTHONPATH=daemon python3 benchmarks/power_budget.py --through-server [--seconds 20] [--streams 8]

--through-server measures the same through real processes, in real time: `gpuwarden run` on the scenario (one
daemon with tuning.power_budget_w 800, then one with tuning.power_limit_w 400 on both cards), the fake OpenAI
server (tests/harness/fake_openai.py --sim-gpu 0) serving on GPU 0 alone at the speed the simulator publishes for that
card's limit (GPU 1 idles), and a client holding --streams streams open for --seconds, a prefill-heavy workload
and then a decode-heavy one. It prints the busy card's served tok/s both ways, the ratio, and the largest sum of
the enforced limits seen in the daemon's /status and in the simulator's own settings (every 50 ms).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from gpuwarden import config
from gpuwarden.backends import open_configured
from gpuwarden.gpu.sim import power
from gpuwarden.gpu.sim.backend import ManualClock
from gpuwarden.gpu.sim.scenario import resolve_scenario
from gpuwarden.tune.tuning import Tuner, TuningLife

SCENARIO = "rtx-pro-6000-server-x2"
CHECK_S = 0.1
ROOT = Path(__file__).resolve().parent.parent
FAKE_SERVER = ROOT / "tests" / "harness" / "fake_openai.py"
# The fake server's cost model: a prompt token takes PREFILL_MS at full prefill speed, an output token
# TOKEN_DELAY_S at full decode speed (tests/harness/fake_openai.py divides by the card's published speed). Sleeps,
# not work: the speed is the model's, not the host CPU's.
PREFILL_MS, TOKEN_DELAY_S = 2.0, 0.01
# (prompt words, output tokens): a prefill-heavy request spends ~0.4 s on its prompt at full speed, a decode-heavy
# one ~0.64 s on its 64 tokens
SHAPES = {"prefill": (200, 2), "decode": (1, 64)}


def scenario(folder: Path, seconds: int, every: int) -> Path:
    text = resolve_scenario(SCENARIO).read_text()
    lines = []
    for n, at in enumerate(range(0, seconds, every)):
        lines.append(f"  - {{at_s: {at}, event: load, gpus: [{n % 2}], utilization_pct: 100}}\n")
        lines.append(f"  - {{at_s: {at}, event: load, gpus: [{1 - n % 2}], utilization_pct: 0}}\n")
    path = folder / "moving.yaml"
    path.write_text(text[:text.index("timeline:")] + "timeline:\n" + "".join(lines))
    return path


def play(path: Path, seconds: int, budget_w: float, static: tuple[float, float] | None) -> dict:
    cfg = config.parse_text(f"gpu: {{backend: sim, scenario: {path}}}\nmetrics: {{listen: none}}\n"
                            f"tuning: {{power_budget_w: {budget_w:g}, gpu_clocks: none}}\n")
    clock = ManualClock()
    backend = open_configured(cfg, clock)
    gpus = backend.gpus()
    life = TuningLife(backend, cfg, Tuner(backend))
    sums: list[float] = []
    if static is not None:  # the operator's fix: each card's limit once (nvidia-smi -pl), no budget
        life.budget = None
        for gpu, watts in zip(gpus, static):
            gpu.set_power_limit_w(watts)
    else:  # the daemon's first poll finds the driver's defaults (600 + 600 W) and brings them into the budget
        clock.advance(CHECK_S)
        life.budget_tick([g.sample() for g in gpus], clock())
    for gpu in gpus:  # from here on, every set NVML takes is checked too
        original = gpu.set_power_limit_w

        def recorded(watts, original=original):
            original(watts)
            sums.append(sum(g.power_limit_w for g in gpus))
        gpu.set_power_limit_w = recorded
    speeds = {"decode": 0.0, "prefill": 0.0}
    steps = round(seconds / CHECK_S)
    full_after: list[float] = []  # seconds from each switch of the load until the busy card had its 600 W
    switched_at, waiting = 0.0, True
    busy_index = None
    for _ in range(steps):
        clock.advance(CHECK_S)
        life.budget_tick([g.sample() for g in gpus], clock())
        sums.append(sum(g.power_limit_w for g in gpus))
        busy = max(gpus, key=lambda g: g.utilization)
        if busy.index != busy_index:
            busy_index, switched_at, waiting = busy.index, clock(), True
        if waiting and busy.power_limit_w >= busy.model.max_power_limit_w:
            full_after.append(clock() - switched_at)
            waiting = False
        published = busy.published()
        for kind in speeds:
            speeds[kind] += power.speed(kind, published["loaded_fraction"], published["decode_knee_fraction"]) / steps
    return {"max_sum": max(sums), "checks": steps, "sets": life.budget.moves if life.budget else len(gpus),
            "speeds": speeds, "full_after": full_after}


# -- through real processes ----------------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _get(port: int, path: str) -> bytes:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("GET", path)
        return conn.getresponse().read()
    finally:
        conn.close()


def _complete(port: int, words: int, output: int) -> tuple[int, int]:
    """One streamed completion: (prompt tokens, output tokens) from its usage chunk."""
    body = json.dumps({"model": "fake-model", "prompt": " ".join(["word"] * words), "max_tokens": output,
                       "stream": True})
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        text = conn.getresponse().read().decode()
    finally:
        conn.close()
    for line in text.splitlines():
        if line.startswith("data: {") and '"usage"' in line:
            usage = json.loads(line[6:])["usage"]
            return usage["prompt_tokens"], usage["completion_tokens"]
    raise RuntimeError(f"no usage in the stream: {text[-200:]!r}")


def drive(port: int, shape: str, seconds: float, streams: int) -> dict:
    """`streams` clients each sending requests of `shape` back to back for `seconds`: tokens over each client's own
    time to its last answer, summed (a request still open at the end is waited for and counted)."""
    words, output = SHAPES[shape]
    results: list[tuple[int, int, float]] = []

    def client():
        start = time.monotonic()
        prompt = generated = 0
        while time.monotonic() - start < seconds:
            p, g = _complete(port, words, output)
            prompt, generated = prompt + p, generated + g
        results.append((prompt, generated, time.monotonic() - start))

    threads = [threading.Thread(target=client) for _ in range(streams)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    prompt_rate = sum(p / s for p, _, s in results)
    output_rate = sum(g / s for _, g, s in results)
    return {"prompt_tok_s": prompt_rate, "output_tok_s": output_rate,
            "tok_s": prompt_rate if shape == "prefill" else output_rate}


class Watch(threading.Thread):
    """The largest sum of the enforced limits: the daemon's /status (each GPU's power_limit_w, its samples; the
    snapshots taken from `since` on, wall-clock seconds) and the simulator's own settings (gpus.json, written at
    every set), every 50 ms, and the /metrics scraped at the end."""

    def __init__(self, port: int, channel: Path, since: float):
        super().__init__(daemon=True)
        self.port, self.channel, self.since, self.stop = port, channel, since, threading.Event()
        self.status_max = self.sim_max = self.metrics_max = 0.0
        self.status_reads = 0
        self.allocs: list[dict] = []

    def run(self):
        while not self.stop.wait(0.05):
            limits = [g["power_limit_w"] for g in power.read_gpus(self.channel)]
            if limits and None not in limits:
                self.sim_max = max(self.sim_max, sum(limits))
            status = _status(self.port)
            if status is None or status.get("taken_at", 0) < self.since:
                continue
            limits = [g.get("power_limit_w") for g in status.get("gpus", [])]
            if limits and None not in limits:
                self.status_max, self.status_reads = max(self.status_max, sum(limits)), self.status_reads + 1
            if status.get("power_budget"):
                self.allocs.append(status["power_budget"]["alloc"])

    def scrape(self) -> float:
        text = _get(self.port, "/metrics").decode()
        total = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                    if line.startswith("gpuwarden_gpu_power_limit_watts{"))
        self.metrics_max = max(self.metrics_max, total)
        return total


def through_server(folder: Path, split: str, seconds: float, streams: int, budget_w: float = 800,
                   shapes=("prefill", "decode"), python: str = sys.executable) -> dict:
    """One daemon (split "budget": tuning.power_budget_w; "static": tuning.power_limit_w at half the budget on
    both cards) on the scenario, the fake server on GPU 0, each shape driven for `seconds`; the figures."""
    folder.mkdir(parents=True)
    channel = folder / "chan"
    channel.mkdir()
    tuning = f"power_budget_w: {budget_w:g}" if split == "budget" else f"power_limit_w: {budget_w / 2:g}"
    metrics = _free_port()
    conf = folder / "conf.yaml"
    conf.write_text(f"gpu: {{backend: sim, scenario: {SCENARIO}}}\npoll_interval_s: 0.25\n"
                    f"metrics: {{listen: '127.0.0.1:{metrics}'}}\ntuning: {{{tuning}, gpu_clocks: none}}\n")
    env = {**os.environ, "PYTHONUNBUFFERED": "1", power.ENV: str(channel), "STATE_DIRECTORY": str(folder / "state"),
           "RUNTIME_DIRECTORY": str(folder / "run"),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "daemon"), os.environ.get("PYTHONPATH")]))}
    port = _free_port()
    procs: list[subprocess.Popen] = []
    log = folder / "daemon.log"
    try:
        with open(log, "w") as out:
            procs.append(subprocess.Popen([python, "-m", "gpuwarden", "run", "-c", str(conf)], stdout=out,
                                          stderr=subprocess.STDOUT, env=env))
        server = subprocess.Popen([python, str(FAKE_SERVER), "--port", str(port), "--sim-state", str(channel),
                                   "--sim-gpu", "0", "--token-delay", str(TOKEN_DELAY_S), "--prefill-ms",
                                   str(PREFILL_MS)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                                  env=env)
        procs.append(server)
        if server.stdout.readline().strip() != "listening":
            raise RuntimeError("the fake server did not start")
        _wait(lambda: _status(metrics) is not None, 60, "the daemon's /status", log)
        first = _status(metrics)  # the first poll's samples: the driver's defaults (600 + 600 W) before any set
        first_sum = sum(g.get("power_limit_w") or 0 for g in first.get("gpus", []))
        # the load on GPU 0 until the split has settled: the budget's move (GPU 0 600 W, GPU 1 150 W), or the
        # static limits set (the scenario's cards: 600 W at most, 150 W at least)
        want = (600.0, 150.0) if split == "budget" else (budget_w / 2, budget_w / 2)
        warm = threading.Event()

        def warm_up():
            while not warm.is_set():
                _complete(port, 1, 4)
        warmer = threading.Thread(target=warm_up, daemon=True)
        warmer.start()
        try:
            _wait(lambda: tuple(g["power_limit_w"] for g in power.read_gpus(channel)) == want, 60,
                  f"the limits {want}", log)
        finally:
            warm.set()
            warmer.join(10)
        # from here on every limit is the daemon's: the simulator's at every set, /status's snapshots after now
        watch = Watch(metrics, channel, time.time())
        watch.start()
        figures = {shape: drive(port, shape, seconds, streams) for shape in shapes}
        figures["limits"] = [g["power_limit_w"] for g in power.read_gpus(channel)]
        watch.scrape()
        watch.stop.set()
        watch.join(5)
        figures.update(first_status_sum=first_sum, status_max=watch.status_max, sim_max=watch.sim_max,
                       metrics_max=watch.metrics_max,
                       status_reads=watch.status_reads, budget_seen=bool(watch.allocs))
        return figures
    finally:
        for proc in reversed(procs):
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)


def _status(port: int) -> dict | None:
    try:
        return json.loads(_get(port, "/status"))
    except (OSError, ValueError):
        return None


def _wait(predicate, timeout: float, what: str, log: Path) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise RuntimeError(f"{what} never came; daemon log:\n{log.read_text()[-3000:]}")


def main_through_server(seconds: float, streams: int, budget_w: float) -> None:
    with tempfile.TemporaryDirectory() as folder:
        budget = through_server(Path(folder) / "budget", "budget", seconds, streams, budget_w)
        static = through_server(Path(folder) / "static", "static", seconds, streams, budget_w)
    half = budget_w / 2
    print(f"{SCENARIO} through real processes: gpuwarden run, the fake OpenAI server on GPU 0 (GPU 1 idle), "
          f"{streams} streams for {seconds:g} s a workload\n")
    print("| split | GPU limits (W) | prefill-heavy prompt tok/s | decode-heavy output tok/s | max enforced sum, "
          "/status (W) | max sum, simulator (W) | sum in /metrics at the end (W) |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name, f in ((f"power budget {budget_w:g} W", budget), (f"static {half:g}/{half:g}", static)):
        print(f"| {name} | {'/'.join(f'{w:g}' for w in f['limits'])} | {f['prefill']['tok_s']:.1f} | "
              f"{f['decode']['tok_s']:.1f} | {f['status_max']:g} | {f['sim_max']:g} | {f['metrics_max']:g} |")
    print(f"\nthe daemons' first /status (the driver's defaults, before the first set): "
          f"{budget['first_status_sum']:g} W and {static['first_status_sum']:g} W; the sums above are from the "
          f"limits settled on ({budget['status_reads']} and {static['status_reads']} /status reads)")
    print(f"\nbusy card, budget over static: prefill x{budget['prefill']['tok_s'] / static['prefill']['tok_s']:.3f}, "
          f"decode x{budget['decode']['tok_s'] / static['decode']['tok_s']:.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=int, default=300)
    parser.add_argument("--every", type=int, default=20, help="the load moves every this many seconds")
    parser.add_argument("--budget", type=float, default=800)
    parser.add_argument("--smoke", action="store_true", help="60 s of simulated time")
    parser.add_argument("--through-server", action="store_true",
                        help="real processes, real time: the daemon, the fake OpenAI server on GPU 0, a client")
    parser.add_argument("--streams", type=int, default=8, help="with --through-server: the client's streams")
    args = parser.parse_args()
    if args.through_server:
        main_through_server(20 if args.seconds == 300 else args.seconds, args.streams, args.budget)
        return
    seconds = 60 if args.smoke else args.seconds
    with tempfile.TemporaryDirectory() as folder:
        path = scenario(Path(folder), seconds, args.every)
        moving = play(path, seconds, args.budget, None)
        half = args.budget / 2
        fixed = play(path, seconds, args.budget, (half, half))
    lag = moving["full_after"]
    print(f"{SCENARIO}: 2 x 600 W (min 150 W), budget {args.budget:g} W, load moving every {args.every} s for "
          f"{seconds} s, checked every {CHECK_S * 1000:.0f} ms ({moving['checks']} checks)\n")
    print(f"| split | max sum of enforced limits (W) | limits set | busy card decode speed | busy card prefill speed |")
    print("| --- | --- | --- | --- | --- |")
    print(f"| power budget (by demand) | {moving['max_sum']:g} | {moving['sets']} | {moving['speeds']['decode']:.3f} | "
          f"{moving['speeds']['prefill']:.3f} |")
    print(f"| static {half:g}/{half:g} | {fixed['max_sum']:g} | 2 | {fixed['speeds']['decode']:.3f} | "
          f"{fixed['speeds']['prefill']:.3f} |")
    print(f"\nbusy card, budget over static: decode x{moving['speeds']['decode'] / fixed['speeds']['decode']:.3f}, "
          f"prefill x{moving['speeds']['prefill'] / fixed['speeds']['prefill']:.3f}")
    if lag:
        print(f"after each switch the busy card had its 600 W within {min(lag):.1f}-{max(lag):.1f} s "
              f"({len(lag)} switches)")
    print(f"sum of enforced limits at or below the budget at every check: "
          f"{'yes' if moving['max_sum'] <= args.budget else 'NO'}")


if __name__ == "__main__":
    main()
