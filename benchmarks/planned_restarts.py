"""Planned restarts under load with the real CPU vLLM (issue 40): `gpuwarden run` with the proxy in front, a steady
mix of streaming and plain clients through the proxy and straight to the engine, and reloads that each change the
engine's flags (tests/vllm/restart_rig.py). Twice: with the drain and the hold (the defaults: serve.drain_s 60,
serve.proxy.hold_s 300), and with `drain_s: 0` and `hold_s: 0` (gpuwarden before issue 40).

    python3 benchmarks/planned_restarts.py [--venv /opt/gpuwarden-test/venv-vllm] [--reloads 5]

Prints a Markdown table a run for benchmarks/RESULTS.md: a row a reload (requests in flight at it, its drain, the
requests the proxy held, the longest request through the proxy, the failed ones; what the clients straight to the
engine saw), and the totals. Run as root, as CI runs the tests (the engine runs as gpuwarden-test).
"""

import argparse
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "vllm"))
from restart_rig import Rig, table, tiny_model  # noqa: E402


def run(python: Path, model: Path, workdir: Path, reloads: int, drain_s: float, hold_s: float) -> list:
    rig = Rig(python, model, workdir, drain_s=drain_s, hold_s=hold_s)
    try:
        began = time.monotonic()
        rig.start()
        print(f"engine and proxy up in {time.monotonic() - began:.0f} s", file=sys.stderr)
        rig.start_clients()
        done = []
        for number in range(1, reloads + 1):
            done.append(rig.reload(number))
            print(f"reload {number}: engine back {done[-1].healthy - done[-1].began:.1f} s after the SIGHUP",
                  file=sys.stderr)
        rig.settle(done)
        rig.stop_clients()
    finally:
        code = rig.stop()
    print(f"daemon exit {code}", file=sys.stderr)
    return done


def totals(reloads: list) -> str:
    outcomes = {id(o): o for r in reloads for o in r.outcomes}.values()
    proxied = [o for o in outcomes if o.client.startswith("proxy")]
    direct = [o for o in outcomes if o.client.startswith("direct")]
    restart = max(r.healthy - r.began for r in reloads)
    return (f"through the proxy: {len(proxied)} requests, {sum(not o.ok for o in proxied)} failed, the longest "
            f"{max(o.took for o in proxied):.1f} s (the longest restart: {restart:.1f} s from SIGHUP to healthy); "
            f"straight to the engine: {len(direct)} requests, {sum(not o.ok for o in direct)} failed" +
            "".join(f"\n- {count} x {client}: {what}" for (client, what), count in failures(outcomes)))


def failures(outcomes) -> list:
    """(client, failure) -> how many, the commonest first, the failures' text cut to their kind."""
    seen = {}
    for o in outcomes:
        if not o.ok:
            key = (o.client, o.what[:90])
            seen[key] = seen.get(key, 0) + 1
    return sorted(seen.items(), key=lambda item: -item[1])[:8]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--venv", type=Path, default=Path(os.environ.get("GPUWARDEN_VLLM_VENV",
                                                                        "/opt/gpuwarden-test/venv-vllm")))
    parser.add_argument("--reloads", type=int, default=5)
    parser.add_argument("--logs", type=Path, help="keep each run's daemon log (the engine's and the proxy's lines "
                        "in it) in this folder")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a kill stops the daemon it started (finally)
    python = args.venv / "bin" / "python"
    with tempfile.TemporaryDirectory() as tmp:
        model = tiny_model(python, Path(tmp))  # the engine's user reads it
        for title, drain_s, hold_s in (("drain 60 s, hold 300 s (the defaults)", 60, 300),
                                       ("drain_s 0, hold_s 0 (as before issue 40)", 0, 0)):
            workdir = Path(tmp) / f"run-{drain_s}"
            workdir.mkdir()
            reloads = run(python, model, workdir, args.reloads, drain_s, hold_s)
            if args.logs:
                args.logs.mkdir(parents=True, exist_ok=True)
                shutil.copy(workdir / "daemon.log", args.logs / f"daemon-drain-{drain_s}.log")
            print(f"\n### {title}\n\n{table(reloads)}\n\n{totals(reloads)}\n", flush=True)


if __name__ == "__main__":
    main()
