"""`gpuwarden bench`: the run, from the config and the options (cli/bench.py) to the report."""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import resource
import sys
import time
from pathlib import Path

from .. import __version__
from ..serving.compose.enginesock import configured_url
from ..config import Config
from ..base.safetext import visible_lines
from ..base.statedir import state_dir
from ..base.systemd import print_error
from ..base.exits import EX_CONFIG, EX_FAIL, EX_INTERRUPTED, EX_NOT_RUNNING, EX_OK
from .options import concurrency_steps, out_of_range
from .watch import Watch, checked_gpus

DEFAULT_GRACE_MAX_S = 30.0


def _raise_fd_limit(concurrency: int) -> None:
    """Each stream is a socket: 1,024 of them need more than the usual soft limit of 1,024 descriptors."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = min(hard, max(soft, concurrency + 256)) if hard != resource.RLIM_INFINITY else max(soft, concurrency + 256)
    if want > soft:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))


def _gpu_reader(config: Config):
    """(reader, where from, note): the daemon's /status when it answers, else NVML (or the configured
    simulator), else nothing."""
    from ..backends import open_configured
    from ..gpu import errors
    from ..web.status import StatusError, fetch_status

    if config.metrics.url is not None:
        try:
            if fetch_status(config.metrics, timeout_s=2.0) is not None:  # whatever answers there: each poll checked
                return (lambda: checked_gpus((fetch_status(config.metrics, timeout_s=2.0) or {}).get("gpus"),
                                             config.metrics.url),
                        f"the daemon's /status at {config.metrics.url}", None)
        except StatusError:
            pass
    try:
        backend = open_configured(config)
    except errors.GpuError as exc:
        return None, "nowhere", f"no GPU view: no daemon answers and {exc}"
    return (lambda: [g.sample().as_dict() for g in backend.gpus()],
            "NVML" if config.gpu.backend == "nvml" else f"the {config.gpu.backend} backend", None)


def _serving_facts(config: Config) -> tuple[Path | None, int, str | None, object]:
    """(model dir, TP size, KV cache dtype, metric names) from the serving config, where it says."""
    from ..serving.compose.engines import engine_for
    from ..serving.lint.flags import flag_value
    from ..serving.lint.hfcache import locate

    engine = engine_for(config.serve.engine)
    args = list(config.serve.args)
    model = Path(config.serve.model) if config.serve.model and Path(config.serve.model).is_dir() else None
    if model is None and config.serve.model:  # a Hugging Face id: the snapshot the engine reads, in its user's cache
        model = locate(config.serve.model, args, {**_user_env(config.serve.user), **dict(config.serve.env)}).path
    tp = engine.tensor_parallel_size(args) if engine else 1
    return model, tp, flag_value(args, "--kv-cache-dtype"), engine.metric_names if engine else None


def _user_env(user: str | None) -> dict[str, str]:
    """HOME, USER and LOGNAME of serve.user, as the engine gets them; {} where it cannot be resolved here."""
    from ..serving.compose.identity import IdentityError, resolve

    try:
        return resolve(user).env()
    except IdentityError:
        return {}


def cmd_bench(args: argparse.Namespace, config: Config) -> int:
    from .report import load, render_compare, render_markdown, render_table, roofline, save
    from .sweep import BenchError, Settings, Sweep, run
    from .workload import Workload

    saved_dir = state_dir() / "bench"
    if args.compare:
        try:
            a, b = (load(ref, saved_dir) for ref in args.compare)
        except ValueError as exc:
            print_error(f"gpuwarden bench: {exc}")
            return EX_NOT_RUNNING
        print(visible_lines(render_compare(a, b, *args.compare)))
        return EX_OK
    try:
        steps = concurrency_steps(args.concurrency)
        if out_of_range(args, ("input_len", "output_len", "requests", "duration", "warmup", "engine_interval", "idle",
                               "request_timeout", "grace")):
            raise ValueError("--input-len, --output-len, --requests, --duration and --request-timeout must be "
                             "positive, --warmup, --engine-interval and --grace not negative, --idle 0-600")
        if args.grace is not None and args.duration is None:
            raise ValueError("--grace is for steps of a --duration")
        if args.plot is not None:
            from .plot import chart_path
            args.plot = chart_path(args.plot)  # before the steps: a bad name is one line now, not after them
    except (ValueError, ImportError) as exc:
        print_error(f"gpuwarden bench: {exc}")
        return EX_CONFIG
    engine_base = configured_url(config.serve)  # its port, or its Unix socket (serving/compose/enginesock.py)
    base = (args.url or engine_base).rstrip("/").removesuffix("/v1")
    model_dir, tp, kv_dtype, names = _serving_facts(config)
    if base != engine_base:
        model_dir, tp = None, 1  # another server: its model and TP are not the config's
    model_dir, tp = args.model_path or model_dir, args.tp or tp
    read_gpus, gpu_source, gpu_note = _gpu_reader(config)
    watch = Watch(read_gpus, base + "/metrics", names, engine_interval_s=args.engine_interval)
    # A new seed each run: the same prompts twice would be served from the first run's prefix cache.
    workload = Workload(args.model or "", args.api, args.input_len, args.output_len, not args.no_ignore_eos,
                        seed=random.SystemRandom().randrange(2**31))
    grace = args.grace if args.grace is not None else min(args.duration or 0, DEFAULT_GRACE_MAX_S)
    settings = Settings(base, workload, steps, None if args.duration else args.requests, args.duration,
                        args.warmup, args.request_timeout, grace, args.idle if read_gpus is not None else 0.0)
    sweep = Sweep(settings)
    if gpu_note:
        sweep.notes.append(gpu_note)
    progress = Progress(sys.stderr)
    _raise_fd_limit(max(steps))
    started = time.time()
    code = 0
    try:
        asyncio.run(run(sweep, watch, progress.update))
    except BenchError as exc:
        progress.clear()
        print_error(f"gpuwarden bench: {exc}")
        if not sweep.steps:
            return exc.exit_code
        code = EX_FAIL
    except KeyboardInterrupt:
        sweep.interrupted = True
    progress.clear()
    result = {"version": __version__, "started_at": started, "url": base, "model": sweep.model, "api": args.api,
              "input_len": args.input_len, "output_len": args.output_len,
              "ignore_eos": sweep.settings.workload.ignore_eos, "gpu_source": gpu_source,
              "interrupted": sweep.interrupted, "notes": sweep.notes, "idle_w": sweep.idle_w, "steps": sweep.steps}
    result["roofline"] = roofline(result, model_dir, tp, kv_dtype)
    if sweep.steps:
        try:
            path = save(result, saved_dir, args.label)
            result["saved_as"] = str(path)
        except OSError as exc:
            sweep.notes.append(f"not saved: {saved_dir}: {exc.strerror}")
    if args.json:
        print(json.dumps(result, indent=2))
    elif args.markdown:  # the reports quote the server (its model's name, its errors): escaped for the terminal
        print(visible_lines(render_markdown(result)))
    else:
        print(visible_lines(render_table(result)))
        if result.get("saved_as"):
            print(f"saved: {result['saved_as']} (gpuwarden bench --compare A B)")
    if args.plot is not None and sweep.steps:
        from .plot import plot_bench
        try:
            plot_bench(result, args.plot)
            print(f"chart: {args.plot}", file=sys.stderr)
        except (OSError, ValueError) as exc:
            print_error(f"gpuwarden bench: --plot {args.plot}: {getattr(exc, 'strerror', None) or exc}")
            code = code or EX_FAIL
    if sweep.interrupted:
        print("gpuwarden bench: interrupted; the result above is partial", file=sys.stderr)
        return EX_INTERRUPTED
    if any(s["ok"] == 0 for s in sweep.steps):
        return EX_FAIL
    return code


class Progress:
    """One status line on a terminal (step, requests done, elapsed), nothing when stderr is not one."""

    def __init__(self, out):
        self.out, self.on = out, out.isatty()
        self._last = 0.0

    def update(self, concurrency: int, done: int, total: int | None, elapsed: float) -> None:
        if not self.on or time.monotonic() - self._last < 0.2:
            return
        self._last = time.monotonic()
        of = f"/{total}" if total else ""
        self.out.write(f"\rC={concurrency}: {done}{of} requests, {elapsed:.1f} s  ")
        self.out.flush()

    def clear(self) -> None:
        if self.on:
            self.out.write("\r\033[K")
            self.out.flush()
