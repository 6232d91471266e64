"""`gpuwarden tune`: sweep the power limit (or a locked SM clock) under bench's workload, find the knee.

Each step is one bench step (sweep.run: the same workload, client, watch and energy figures) at one setting,
which the running daemon sets through its control channel (tune/channel.py) under a lease; the configured setting
comes back however the sweep ends. The knee is the step with the most tokens per joule among those that keep
--keep of the peak tok/s.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import sys
import time
from pathlib import Path

from .. import __version__
from ..serving.compose.enginesock import configured_url
from ..config import Config
from ..tune.channel import ChannelLost, ControlError, SweepClient, Unreachable, socket_path
from ..base.safetext import visible_lines
from ..base.systemd import print_error
from ..base.exits import EX_CONFIG, EX_FAIL, EX_INTERRUPTED, EX_NOPERM, EX_UNAVAILABLE
from .command import _gpu_reader, _raise_fd_limit, _serving_facts
from .options import comma_numbers, out_of_range
from .report import energy_notes
from .watch import Watch



def _values(text: str) -> list[float]:
    values = comma_numbers(text, float)
    if not values or any(not 0 < v < 100_000 for v in values):
        raise ValueError(f"--values {text!r}: expected positive numbers, e.g. 700,600,500")
    return values


def _gpus(text: str | None) -> list[int] | None:
    if text is None:
        return None
    try:
        return [int(v) for v in text.split(",") if v.strip()] or None
    except ValueError:
        raise ValueError(f"--gpus {text!r}: expected GPU indices, e.g. 0,1") from None


def settings_to_try(limits: dict, clocks: bool, steps: int) -> list[float]:
    """Evenly spaced from the highest value every GPU accepts down to the lowest: the power-limit constraints,
    or the supported clocks (each step a clock the card lists). A GPU that reports none (a card without power
    management answers None for its constraints) is one line (ControlError), not a TypeError."""
    if not isinstance(limits, dict) or not limits:
        raise ControlError(f"the daemon's answer names no GPU's limits ({limits!r})")
    for gpu, values in limits.items():
        if not isinstance(values, list) or not _numbers(values) or (not clocks and len(values) != 2):
            raise ControlError(f"GPU {gpu} lists no supported clocks" if clocks else
                               f"GPU {gpu} reports no power-limit constraints: its power limit cannot be swept")
    if clocks:
        common = sorted(set.intersection(*(set(v) for v in limits.values())), reverse=True)
        if not common:
            raise ControlError("the GPUs list no common supported clock")
        picks = [common[round(i * (len(common) - 1) / max(1, steps - 1))] for i in range(steps)]
        return list(dict.fromkeys(picks))
    low = max(v[0] for v in limits.values())
    high = min(v[1] for v in limits.values())
    return [round(high - i * (high - low) / max(1, steps - 1)) for i in range(steps)]


def _numbers(values: list) -> bool:
    return bool(values) and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)


def find_knee(steps: list[dict], keep: float) -> dict | None:
    """The step with the most tok/J among those keeping `keep` of the peak tok/s."""
    rated = [s for s in steps if s.get("system_tokens_per_s") and s.get("tokens_per_joule")]
    if not rated:
        return None
    peak = max(s["system_tokens_per_s"] for s in rated)
    return max((s for s in rated if s["system_tokens_per_s"] >= keep * peak), key=lambda s: s["tokens_per_joule"])


def config_lines(setting: str, value: float, gpus: list[int] | None) -> str:
    shown = f"[{int(value)}, {int(value)}]" if setting == "gpu_clocks" else f"{value:g}"
    if gpus is None:
        return f"tuning:\n  {setting}: {shown}\n"
    return "tuning:\n  gpus:\n" + "".join(f'    "{g}": {{{setting}: {shown}}}\n' for g in gpus)


class Progress:
    """Step i of n, the setting, and the time left, on a terminal only."""

    def __init__(self, out, values: list[float], unit: str, step_s: float):
        self.out, self.values, self.unit, self.step_s = out, values, unit, step_s
        self.on, self.step, self.started = out.isatty(), 0, time.monotonic()

    def begin(self, index: int) -> None:
        self.step, self.started = index, time.monotonic()

    def update(self, concurrency, done, total, elapsed) -> None:
        if not self.on:
            return
        left = (len(self.values) - self.step) * self.step_s - (time.monotonic() - self.started)
        self.out.write(f"\rstep {self.step + 1}/{len(self.values)}: {self.values[self.step]:g} {self.unit}, "
                       f"{done} requests, about {max(0, left):.0f} s left  ")
        self.out.flush()

    def clear(self) -> None:
        if self.on:
            self.out.write("\r\033[K")
            self.out.flush()


def _f(value, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def render(result: dict) -> str:
    unit = result["unit"]
    head = ["setting", "tok/s", "TTFT p50 ms", "p99", "ITL p50 ms", "p99", "GPUs W", "tok/J", "tok/J >idle"]
    rows = [head]
    for s in result["steps"]:
        ms = [_f(s.get(k) and s[k] * 1e3, ".0f") for k in ("ttft_p50_s", "ttft_p99_s", "itl_p50_s", "itl_p99_s")]
        rows.append([f"{s['setting']:g} {unit}", _f(s.get("system_tokens_per_s"), ".1f"), *ms,
                     _f(s.get("gpu_watts_mean"), ".0f"), _f(s.get("tokens_per_joule"), ".4g"),
                     _f(s.get("tokens_per_joule_above_idle"), ".4g")])
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    out = [f"{result['model']} at {result['url']}: {result['setting']} sweep, C={result['concurrency']}, "
           f"{result['input_len']} in / {result['output_len']} out, {result['duration_s']:g} s a step"]
    out += ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows]
    out += energy_notes(result["steps"], lambda s: f"{s['setting']:g} {unit}")
    if result.get("idle_w") is not None:
        out.append(f"idle draw before the first step: {result['idle_w']:.0f} W")
    knee = result.get("knee")
    if knee:
        out.append(f"knee: {knee['setting']:g} {unit}: {knee['tokens_per_joule']:.4g} tok/J, "
                   f"{knee['share_of_peak'] * 100:.0f}% of the peak {knee['peak_tokens_per_s']:.1f} tok/s "
                   f"(--keep {result['keep']:g}); in the config:")
        out.append(result["config"].rstrip())
    else:
        out.append("knee: none (no step reported both tok/s and tok/J)")
    out += [f"! {n}" for n in result.get("notes", [])]
    return "\n".join(out)


def cmd_tune(args: argparse.Namespace, config: Config) -> int:
    from .plot import PlotUnavailable, plot_tune
    from .sweep import BenchError, Settings, Sweep, run
    from .workload import Workload

    try:
        values = _values(args.values) if args.values else None
        gpus = _gpus(args.gpus)
        if not 0 < args.keep <= 1:
            raise ValueError(f"--keep {args.keep:g}: expected a share of the peak, above 0 and at most 1")
        if out_of_range(args, ("steps", "concurrency", "duration", "input_len", "output_len", "warmup", "idle")):
            raise ValueError("--steps 2-64, --concurrency 1-4096, --duration, --input-len and --output-len "
                             "positive, --warmup not negative, --idle 0-600")
        if not 1 <= args.lease <= 300:
            raise ValueError(f"--lease {args.lease:g}: expected 1-300 seconds")
        if args.plot is not None:
            from .plot import chart_path
            args.plot = chart_path(args.plot)  # before the sweep: a bad name is one line now, not after it
    except (ValueError, PlotUnavailable) as exc:
        print_error(f"gpuwarden tune: {exc}")
        return EX_CONFIG
    setting, unit = ("gpu_clocks", "MHz") if args.clocks else ("power_limit_w", "W")
    base = (args.url or configured_url(config.serve)).rstrip("/").removesuffix("/v1")
    read_gpus, gpu_source, note = _gpu_reader(config)
    if read_gpus is None or not gpu_source.startswith("the daemon"):
        print_error(f"gpuwarden tune: no daemon answers at {config.metrics.url}: tune needs the running daemon "
                    "(its /status for the power readings, its control socket for the settings)")
        return EX_UNAVAILABLE
    try:
        client = SweepClient(socket_path(), setting, gpus, args.lease, args.force)
    except Unreachable as exc:
        print_error(f"gpuwarden tune: {exc}")
        return EX_NOPERM if "permission denied" in str(exc) else EX_UNAVAILABLE
    except ControlError as exc:  # the daemon answered, and refused the sweep (or went away while answering)
        print_error(f"gpuwarden tune: {exc}")
        return EX_FAIL
    restored: list[str] = []
    code = 0
    sweep = None
    try:
        if values is None:
            values = settings_to_try(client.limits, args.clocks, args.steps)
        _, _, _, names = _serving_facts(config)
        watch = Watch(read_gpus, base + "/metrics", names, engine_interval_s=0)
        workload = Workload(args.model or "", args.api, args.input_len, args.output_len, True,
                            seed=random.SystemRandom().randrange(2**31))
        settings = Settings(base, workload, [args.concurrency] * len(values), None, args.duration, args.warmup,
                            grace_s=min(args.duration, 30.0), idle_s=args.idle)
        sweep = Sweep(settings)
        progress = Progress(sys.stderr, values, unit, args.duration + 1)

        def before_step(index: int) -> None:
            progress.begin(index)
            client.set(values[index])

        _raise_fd_limit(args.concurrency)
        try:
            asyncio.run(run(sweep, watch, progress.update, before_step))
        except KeyboardInterrupt:
            sweep.interrupted = True
        except BenchError as exc:
            progress.clear()
            print_error(f"gpuwarden tune: {exc}")
            code = exc.exit_code
        progress.clear()
    except ChannelLost as exc:  # the daemon gone while tune asked it something
        if sweep is None:
            print_error(f"gpuwarden tune: {exc}")
            return EX_FAIL
        client.lost = client.lost or str(exc)
    except ControlError as exc:  # a step the daemon refused: the steps before it stand
        if sweep is not None:
            progress.clear()
        print_error(f"gpuwarden tune: {exc}")
        if sweep is None:
            return EX_FAIL
        code = EX_FAIL
    finally:
        try:
            restored = client.end()
        except ControlError as exc:
            client.lost = client.lost or str(exc)
    if code and not sweep.steps:
        return code  # the server failed before the first step: its one line said why; nothing was swept
    steps = [dict(s, setting=values[i]) for i, s in enumerate(sweep.steps)]
    result = {"version": __version__, "url": base, "model": sweep.model, "setting": setting, "unit": unit,
              "concurrency": args.concurrency, "input_len": args.input_len, "output_len": args.output_len,
              "duration_s": args.duration, "keep": args.keep, "idle_w": sweep.idle_w, "gpus": gpus,
              "interrupted": sweep.interrupted, "notes": sweep.notes, "steps": steps, "restored": restored}
    knee = find_knee(steps, args.keep)
    if knee is not None:
        peak = max(s["system_tokens_per_s"] for s in steps if s.get("system_tokens_per_s"))
        result["knee"] = {"setting": knee["setting"], "tokens_per_joule": knee["tokens_per_joule"],
                          "system_tokens_per_s": knee["system_tokens_per_s"], "peak_tokens_per_s": peak,
                          "share_of_peak": knee["system_tokens_per_s"] / peak}
        result["config"] = config_lines(setting, knee["setting"], gpus)
    print(json.dumps(result, indent=2) if args.json else visible_lines(render(result)))  # quotes the server
    if client.lost is None:
        print("the daemon put the configured setting back: " + ("; ".join(restored) or "nothing had changed"),
              file=sys.stderr)
    if args.plot is not None and steps:
        try:
            plot_tune(result, args.plot)
            print(f"chart: {args.plot}", file=sys.stderr)
        except (PlotUnavailable, OSError, ValueError) as exc:
            print_error(f"gpuwarden tune: --plot {args.plot}: {getattr(exc, 'strerror', None) or exc}")
            code = code or EX_FAIL
    if client.lost is not None:
        print_error(f"gpuwarden tune: {client.lost}: the sweep lost its lease mid-step (the daemon puts the "
                    "configured setting back: at once, at the lease's end, or at its next start); the steps above "
                    "are partial")
        return EX_FAIL
    if sweep.interrupted:
        print("gpuwarden tune: interrupted; the steps above are partial", file=sys.stderr)
        return EX_INTERRUPTED
    if args.apply and knee is not None and code == 0:
        code = _apply(result["config"], Path(args.config), client.daemon_pid, setting, knee["setting"],
                      client.uuids)
    return code


def _apply(lines: str, config_path: Path, pid: int, setting: str, value: float, uuids: dict) -> int:
    """Write the knee as a drop-in beside the config and reload the daemon (SIGHUP to the pid the control socket's
    SO_PEERCRED named). Before the reload, the merged config is loaded as the daemon will load it: where a later
    drop-in or a per-GPU key overrides the knee, the drop-in is removed again and tune says which file wins."""
    from .. import config as config_mod
    from ..base.yamlfile import ConfigError, ConfigErrors

    dropin = config_path.parent / "conf.d" / "50-tune.yaml"
    try:
        dropin.parent.mkdir(parents=True, exist_ok=True)
        dropin.write_text("# written by `gpuwarden tune --apply`: the knee of its sweep\n" + lines)
    except OSError as exc:
        print_error(f"gpuwarden tune: --apply: {dropin}: {exc.strerror or exc}")
        return EX_FAIL
    try:
        merged = config_mod.load(config_path)
        wanted = (int(value), int(value)) if setting == "gpu_clocks" else float(value)
        overridden = []
        for index, uuid in sorted(uuids.items(), key=lambda item: int(item[0])):
            effective = getattr(merged.tuning.for_gpu(int(index), uuid), setting)
            if (tuple(effective) if isinstance(effective, (list, tuple)) else effective) != wanted:
                key = merged.tuning.override_source(int(index), uuid, setting)
                overridden.append(f"GPU {index} gets {effective} from {_who_sets(config_path, key)} "
                                  f"({'.'.join(key)})")
    except (ConfigError, ConfigErrors, OSError) as exc:
        overridden = [f"the merged config does not load: {exc}"]
    if overridden:
        dropin.unlink(missing_ok=True)
        print_error(f"gpuwarden tune: --apply: not applied, and {dropin} removed again: the knee would not take "
                    "effect: " + "; ".join(overridden))
        return EX_FAIL
    try:
        os.kill(pid, signal.SIGHUP)
    except OSError as exc:
        print_error(f"gpuwarden tune: --apply: wrote {dropin}, but the reload (SIGHUP to pid {pid}) failed: "
                    f"{exc.strerror or exc}")
        return EX_FAIL
    print(f"applied: wrote {dropin} and reloaded the daemon (pid {pid}); `gpuwarden status` shows the setting",
          file=sys.stderr)
    return 0


def _who_sets(config_path: Path, key: tuple) -> str:
    """The last of the config and its drop-ins (the order the loader merges them) that sets `key`."""
    from .. import config as config_mod
    from ..base import yamlfile

    found = "the config"
    for file in [config_path, *config_mod.dropin_files(config_path)]:
        try:
            value = yamlfile.load(file, empty_ok=True).value
        except Exception:  # it loaded as part of the merge; this is only to name it
            continue
        for part in key:
            value = value.get(part) if isinstance(value, dict) else None
        if value is not None:
            found = str(file)
    return found
