"""The power budget's done-when on the simulator: two 600 W RTX PRO 6000 Server cards (minimum limit 150 W) under
tuning.power_budget_w 800 W, the load moving from one card to the other every 20 s for 5 minutes, the daemon's
budget polled (and the sum of the enforced limits checked) every 100 ms of simulated time.

    PYTHONPATH=daemon python3 benchmarks/power_budget.py [--seconds 300] [--every 20] [--budget 800] [--smoke]

It records the largest sum of the enforced limits seen (at every check and right after every set NVML took), the
moves, and the busy card's served speed against the operator's static 400/400 split, for decode and prefill: the
speed model the simulator's fake OpenAI server serves at (gpu/sim/power.speed over the card's published clock
fraction under full load), averaged over every check. In-process, simulated time: it takes about a second.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from gpuwarden import config
from gpuwarden.backends import open_configured
from gpuwarden.gpu.sim import power
from gpuwarden.gpu.sim.backend import ManualClock
from gpuwarden.gpu.sim.scenario import resolve_scenario
from gpuwarden.tune.tuning import Tuner, TuningLife

SCENARIO = "rtx-pro-6000-server-x2"
CHECK_S = 0.1


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=int, default=300)
    parser.add_argument("--every", type=int, default=20, help="the load moves every this many seconds")
    parser.add_argument("--budget", type=float, default=800)
    parser.add_argument("--smoke", action="store_true", help="60 s of simulated time")
    args = parser.parse_args()
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
