"""Bench results: the terminal table, --markdown, --json, saved runs under the state directory, --compare.

The activity columns (SM act%, tensor%, DRAM bw%) are GPM's shares over the step, means over the GPUs that served it,
and *bound* what they name (bound.py); "-" where the GPUs give no GPM, said once under the table.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

from .bound import describe
from .roofline import ModelUnreadable, ceiling_tokens_per_s, model_bytes


def _f(value, fmt: str = ".1f", none: str = "-") -> str:
    return none if value is None else format(value, fmt)


def _ms(value) -> str:
    return "-" if value is None else f"{value * 1e3:.0f}"


def roofline(result: dict, model_dir: Path | None, tp: int, kv_cache_dtype: str | None) -> dict:
    """The C = 1 ceiling from the step's own memory clocks, the efficiency measured against it, and the bound the
    step measured (bound.py): a memory ceiling says little about a step the host or the compute held back."""
    step = next((s for s in result["steps"] if s["concurrency"] == 1 and s["ok"]), None)
    if step is None:
        return {"known": False, "why": "no completed step at concurrency 1"}
    return {**_ceiling(result, step, model_dir, tp, kv_cache_dtype), "measured_bound": step.get("activity")}


def _ceiling(result: dict, step: dict, model_dir: Path | None, tp: int, kv_cache_dtype: str | None) -> dict:
    gpus = step.get("gpus") or []
    bandwidths = [g["bandwidth_bytes_per_s_mean"] for g in gpus[:tp] if g.get("bandwidth_bytes_per_s_mean")]
    if len(bandwidths) < tp:
        return {"known": False, "why": f"memory bandwidth of {tp} GPU(s) not reported for the step (no GPU view)"}
    if model_dir is None:
        return {"known": False, "why": "the model is not a local directory here (give --model-path DIR)"}
    try:
        size = model_bytes(model_dir, kv_cache_dtype)
    except ModelUnreadable as exc:
        return {"known": False, "why": str(exc)}
    context = (step["input_tokens_mean"] or 0) + result["output_len"] / 2
    kv = size.kv_per_token or 0
    ceiling = ceiling_tokens_per_s(sum(bandwidths), size.weights, tp, kv, context)
    measured = step["per_request_tokens_per_s_mean"]
    return {"known": True, "bandwidth_bytes_per_s": sum(bandwidths), "tp": tp, "weight_bytes": size.weights,
            "kv_bytes_per_token": size.kv_per_token, "kv_note": size.kv_note, "context_tokens": context,
            "ceiling_tokens_per_s": ceiling, "measured_tokens_per_s": measured,
            "efficiency": measured / ceiling if measured else None}


def roofline_line(r: dict) -> str:
    measured = f"; measured at C=1: {describe(r['measured_bound'])}" if "measured_bound" in r else ""
    return _ceiling_line(r) + measured


def _ceiling_line(r: dict) -> str:
    if not r.get("known"):
        return f"roofline: unknown ({r.get('why')})"
    kv = (f" + KV {r['kv_bytes_per_token'] * r['context_tokens'] / 1e9:.3f} GB at {r['context_tokens']:.0f} tokens"
          if r.get("kv_bytes_per_token") else f" (KV not counted: {r['kv_note']})")
    eff = f" -> measured {_f(r['measured_tokens_per_s'])} tok/s = {r['efficiency'] * 100:.0f}% of the ceiling" \
        if r.get("efficiency") else ""
    return (f"roofline (C=1): {r['bandwidth_bytes_per_s'] / 1e12:.3f} TB/s over {r['tp']} GPU(s) / "
            f"({r['weight_bytes'] / 1e9:.3f} GB of weights{kv}) = {r['ceiling_tokens_per_s']:.1f} tok/s{eff}")


COLUMNS = ("C", "ok/sent", "cut", "system tok/s", "per-req tok/s mean", "p50", "TTFT p50 ms", "p99", "ITL p50 ms",
           "p99", "SM MHz min/mean", "mem MHz", "SM act%", "tensor%", "DRAM bw%", "bound", "W/GPU / limit", "GPUs W",
           "J/tok", "tok/J", "tok/J >idle", "J/req p50/p90/p99", "running", "waiting", "KV max", "prefix hit")


def _values(gpus: list[dict], key: str) -> list[float]:
    return [g[key] for g in gpus if g.get(key) is not None]


def _row(step: dict) -> list[str]:
    """One step; the GPU columns over all its GPUs: the lowest SM clock seen, the mean of the means."""
    gpus, engine = step.get("gpus") or [], step.get("engine") or {}
    lows, means = _values(gpus, "sm_mhz_min"), _values(gpus, "sm_mhz_mean")
    sm = f"{min(lows):.0f}/{sum(means) / len(means):.0f}" if lows and means else "-"
    mem = _values(gpus, "memory_mhz_mean")
    power, limit = _values(gpus, "power_w_mean"), _values(gpus, "power_limit_w")
    mem = f"{sum(mem) / len(mem):.0f}" if mem else "-"
    power = f"{sum(power) / len(power):.0f}/{_f(max(limit) if limit else None, '.0f')}" if power else "-"
    activity = step.get("activity") or {}
    shares = [_f(None if activity.get(key) is None else activity[key] * 100, ".0f")
              for key in ("sm_active", "tensor_active", "dram_bandwidth")]
    kv = engine.get("kv_cache_usage_max")
    hit = engine.get("prefix_cache_hit_rate")
    c = f"{step['concurrency']}" + (" (partial)" if step["interrupted"] else "")
    return [c, f"{step['ok']}/{step['requests']}", str(step["cut"]), _f(step["system_tokens_per_s"]),
            _f(step["per_request_tokens_per_s_mean"]), _f(step["per_request_tokens_per_s_p50"]),
            _ms(step["ttft_p50_s"]), _ms(step["ttft_p99_s"]), _ms(step["itl_p50_s"]), _ms(step["itl_p99_s"]),
            sm, mem, *shares, activity.get("bound") or "-", power, _f(step.get("gpu_watts_mean"), ".0f"),
            _f(step.get("joules_per_token"), ".3g"),
            _f(step.get("tokens_per_joule"), ".3g"), _f(step.get("tokens_per_joule_above_idle"), ".3g"),
            _per_request(step), _f(engine.get("running_mean")), _f(engine.get("waiting_mean")),
            "-" if kv is None else f"{kv * 100:.0f}%", "-" if hit is None else f"{hit * 100:.0f}%"]


def _per_request(step: dict) -> str:
    """Each request's joules, from gpuwarden's proxy (bench/joules.py): p50/p90/p99."""
    figures = [step.get(f"joules_per_request_p{q}") for q in (50, 90, 99)]
    return "-" if figures[0] is None else "/".join(_f(f, ".3g") for f in figures)


def _notes(result: dict) -> list[str]:
    lines = []
    for step in result["steps"]:
        for flag in step.get("flags", []):
            lines.append(f"C={step['concurrency']}: {flag}")
        if step["errors"]:
            lines.append(f"C={step['concurrency']}: {step['errors']} of {step['requests']} requests failed; "
                         f"first: {step['first_error']}")
        if step["cut"]:
            lines.append(f"C={step['concurrency']}: {step['cut']} of {step['requests']} requests cut by bench (not "
                         f"errors of the server; their tokens left out): {step['first_cut']}")
    unreported = [s["activity"]["why"] for s in result["steps"] if (s.get("activity") or {}).get("why")
                  and s["activity"]["sm_active"] is None]
    for why in dict.fromkeys(unreported):  # once, not per step
        lines.append(f"SM, tensor and DRAM activity and the bound not reported: {why}")
    lines += energy_notes(result["steps"], lambda s: f"C={s['concurrency']}")
    if result.get("idle_w") is not None:
        lines.append(f"idle draw before the first step: {result['idle_w']:.0f} W over all GPUs (tok/J >idle: the "
                     "tokens over the energy above it)")
    lines += result.get("notes", [])
    return lines


def energy_notes(steps: list[dict], name) -> list[str]:
    """Why steps give no J/tok or tok/J (bench/energy.py's energy_note): one line per reason, naming its steps."""
    by_note: dict[str, list[str]] = {}
    for step in steps:
        if step.get("energy_note"):
            by_note.setdefault(step["energy_note"], []).append(name(step))
    return [f"J/tok and tok/J not given at {', '.join(names)}: {note}" for note, names in by_note.items()]


def render_table(result: dict) -> str:
    rows = [list(COLUMNS)] + [_row(s) for s in result["steps"]]
    widths = [max(len(r[i]) for r in rows) for i in range(len(COLUMNS))]
    head = (f"{result['model']} at {result['url']} ({result['api']}, {result['input_len']} in / "
            f"{result['output_len']} out, GPUs from {result['gpu_source']})")
    out = [head] + ["  ".join(cell.rjust(w) for cell, w in zip(r, widths)) for r in rows]
    out.append(roofline_line(result["roofline"]))
    out += [f"! {line}" for line in _notes(result)]
    return "\n".join(out)


def render_markdown(result: dict) -> str:
    out = [f"**{result['model']}** ({result['api']}, {result['input_len']} in / {result['output_len']} out), "
           f"GPUs from {result['gpu_source']}", "", "| " + " | ".join(COLUMNS) + " |",
           "|" + "---:|" * len(COLUMNS)]
    out += ["| " + " | ".join(_row(s)) + " |" for s in result["steps"]]
    out += ["", roofline_line(result["roofline"])]
    out += [f"- {line}" for line in _notes(result)]
    return "\n".join(out)


# -- saved runs ----------------------------------------------------------------------------------------------

def save(result: dict, directory: Path, label: str | None) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(result["started_at"]))
    name = stamp + (f"-{re.sub(r'[^A-Za-z0-9._-]+', '-', label)}" if label else "")
    path = directory / f"{name}.json"
    path.write_text(json.dumps(result, indent=2))
    return path


def load(ref: str, directory: Path) -> dict:
    """A saved run by path, name or label (the newest that ends with it); ValueError says what is there."""
    path = Path(ref)
    if not path.is_file():
        found = sorted(directory.glob(f"*{ref}.json")) if directory.is_dir() else []
        if not found:
            known = ", ".join(p.stem for p in sorted(directory.glob("*.json"))) if directory.is_dir() else ""
            raise ValueError(f"no saved bench run {ref!r} in {directory} (saved: {known or 'none'})")
        path = found[-1]
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: not a bench result ({exc})") from None


def render_compare(a: dict, b: dict, name_a: str, name_b: str) -> str:
    lines = [f"A = {name_a} ({a['model']}), B = {name_b} ({b['model']})",
             "    C  A tok/s  B tok/s   B/A  A TTFT p50 ms  B TTFT p50 ms  A SM MHz  B SM MHz  A tok/J  B tok/J"]
    steps_b = {s["concurrency"]: s for s in b["steps"]}
    for sa in a["steps"]:
        sb = steps_b.get(sa["concurrency"])
        if sb is None:
            continue
        ta, tb = sa["system_tokens_per_s"], sb["system_tokens_per_s"]
        ratio = f"{tb / ta:.2f}" if ta and tb else "-"
        sm = [_f((s.get("gpus") or [{}])[0].get("sm_mhz_mean"), ".0f") for s in (sa, sb)]
        lines.append(f"{sa['concurrency']:5d} {_f(ta):>8} {_f(tb):>8} {ratio:>5} {_ms(sa['ttft_p50_s']):>14} "
                     f"{_ms(sb['ttft_p50_s']):>14} {sm[0]:>9} {sm[1]:>9} "
                     f"{_f(sa.get('tokens_per_joule'), '.3g'):>8} {_f(sb.get('tokens_per_joule'), '.3g'):>8}")
    for name, r in ((name_a, a), (name_b, b)):
        lines.append(f"{name}: {roofline_line(r['roofline'])}")
    return "\n".join(lines)
