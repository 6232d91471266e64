"""The lint against the community registry of serving traps (github.com/Blackwellboy/model-serving-minefield):
its recall over the traps judged visible before the start, and its false findings on their near misses.

    PYTHONPATH=daemon python3 benchmarks/lint_registry.py [--smoke] [--check] [--verbose] [--cases FILE]

The traps, their classification and the launches are tests/minefield_cases.yaml (its comments say how each case is
built). Every case's launch goes through compose(), as `gpuwarden profiles show` runs it, in-process: the engine's
argv from the config (profile generic or sglang-generic), the simulated GPUs of the case's scenario, the installed
versions given as the installed-versions probe would answer them (no engine Python is asked), and the model's
config.json and headers written where the registry's launch reads them: in the serving user's Hugging Face cache
(HF_HOME) under the registry's id, or a local directory where the launch names one; read by the same reader as a
real one.

It prints the registry version the cases were judged against; the counts of visible, not-visible and out-of-scope
traps; recall (visible traps whose own launch draws a finding naming the trap, over the visible traps) with every
miss; the near misses (the launch with one of the trap's documented workarounds, otherwise the same) that draw a
warning or an error, with the rule, and those whose finding names their own trap. A finding at info level (rules not
judged for want of a fact: a model in no cache) is no flag; their count is printed.

--smoke runs the first few cases only (for CI) and fails only on a crash; --check exits 1 when recall is below
0.9 or any near miss draws a warning or an error. Without either, it measures and exits 0.
"""

from __future__ import annotations

import argparse
import json
import struct
import sys
import tempfile
from pathlib import Path

import yaml

from gpuwarden import config
from gpuwarden.gpu.sim.backend import SimBackend
from gpuwarden.gpu.sim.scenario import load_scenario, resolve_scenario
from gpuwarden.serving.lint.packages import Installed
from gpuwarden.serving.compose.prepare import compose

ROOT = Path(__file__).resolve().parent.parent
CASES = ROOT / "tests" / "minefield_cases.yaml"
RECALL_BAR = 0.9  # issue 44's bar for --check
SMOKE_CASES = 4


def write_model(folder: Path, spec: dict) -> Path:
    """A local model directory as tests/test_lint_minefield.py writes one: config.json, an optional
    hf_quant_config.json, other small files, and safetensors files holding only their header."""
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(spec["config"]))
    if "hf_quant_config" in spec:
        (folder / "hf_quant_config.json").write_text(json.dumps(spec["hf_quant_config"]))
    for name, text in spec.get("files", {}).items():
        (folder / name).write_text(text)
    for name, tensors in spec.get("safetensors", {}).items():
        header = json.dumps(tensors).encode()
        (folder / name).write_bytes(struct.pack("<Q", len(header)) + header)
    return folder


def write_hub(home: Path, repo_id: str, spec: dict) -> Path:
    """The model of spec in a Hugging Face cache under home (an HF_HOME), as huggingface_hub lays one out: the
    snapshot's files links into blobs/, refs/main naming the snapshot. Returns home."""
    commit = "5" * 40
    repo = home / "hub" / ("models--" + repo_id.replace("/", "--"))
    written = write_model(repo / "blobs-src", spec)
    (repo / "blobs").mkdir()
    (repo / "snapshots" / commit).mkdir(parents=True)
    for file in sorted(written.iterdir()):
        blob = repo / "blobs" / f"{commit[:8]}-{file.name}"
        file.rename(blob)
        (repo / "snapshots" / commit / file.name).symlink_to(f"../../blobs/{blob.name}")
    written.rmdir()
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    return home


def model_of(run: dict, tmp: Path) -> tuple[str, dict]:
    """(serve.model, serve.env) of a launch: the registry's Hugging Face id with the model in the serving user's
    cache (HF_HOME) where the case gives one, else a local directory where the trap's launch used one, else the
    model as named (the engine would download it: its config.json facts are unknown)."""
    env = {k: str(v) for k, v in run.get("env", {}).items()}
    if "model_dir" not in run:
        return run.get("model"), env
    if "hf_id" in run:
        return run["hf_id"], {**env, "HF_HOME": str(write_hub(tmp / "hf", run["hf_id"], run["model_dir"]))}
    return str(write_model(tmp / "model", run["model_dir"])), env


def scenario_path(case: dict, tmp: Path) -> Path:
    """The case's built-in scenario, or one written from its gpus: (name, count, compute capability, driver and,
    where the trap depends on it, memory)."""
    if case.get("scenario"):
        found = resolve_scenario(case["scenario"])
        if found is None:
            raise SystemExit(f"trap {case['trap']}: no scenario {case['scenario']}")
        return found
    gpus = case["gpus"]
    gpu = {"name": gpus["name"], "count": gpus["count"], "compute_capability": gpus["compute_capability"],
           "memory_clocks_mhz": [14001], "graphics_clocks_mhz": [180, 3090, 15]}
    if "memory_total_mib" in gpus:
        gpu["memory_total_mib"] = gpus["memory_total_mib"]
    path = tmp / f"scenario-{case['trap']}.yaml"
    path.write_text(yaml.safe_dump({"name": "case", "driver_version": gpus["driver"], "gpus": [gpu]}))
    return path


def sides(case: dict) -> list[tuple[str, dict]]:
    """("trap", its launch) and ("fix N", each near miss): a fix is merged over the case, its versions over the
    case's versions, as tests/test_lint_minefield.py does."""
    fixes = case.get("fix", [])
    fixes = fixes if isinstance(fixes, list) else [fixes]
    out = [("trap", dict(case))]
    for i, fix in enumerate(fixes, 1):
        run = {**case, **fix, "versions": {**case["versions"], **fix.get("versions", {})}}
        if "model_dir" in fix:
            run.pop("model", None)
        elif "model" in fix:
            run.pop("model_dir", None)
        out.append((f"fix {i}", run))
    return out


def findings(case: dict, run: dict, tmp: Path) -> list[dict]:
    """The lint's findings on one launch, as `profiles show --json` lists them."""
    engine = case.get("engine", "vllm")
    model, env = model_of(run, tmp)
    serve = {"enabled": True, "engine": engine, "profile": "sglang-generic" if engine == "sglang" else "generic",
             "model": model, "args": [str(a) for a in run.get("args", [])], "env": env}
    cfg = config.parse_text(yaml.safe_dump({"tuning": {"apply": False}, "serve": serve}), name=f"{case['trap']}.yaml")
    gpus = [gpu.sample() for gpu in SimBackend(load_scenario(scenario_path(case, tmp))).gpus()]
    versions = {"vllm": None, "flashinfer": None, "torch": None, "sglang": None, **run["versions"]}
    found = Installed("/srv/venv/bin/python", True, versions, run.get("torch_cuda"))
    composed = compose(cfg, gpus, base_env={"PATH": "/usr/bin:/bin"}, found=found, ask=True)
    return [f.as_dict() for f in composed.findings]


def measure(doc: dict, limit: int | None = None, verbose: bool = False) -> dict:
    cases = doc["cases"][:limit] if limit else doc["cases"]
    named, missed, noisy, own, unjudged = [], [], [], [], 0
    with tempfile.TemporaryDirectory(prefix="gpuwarden-lint-registry-") as tmp:
        for n, case in enumerate(cases):
            for side, run in sides(case):
                where = Path(tmp) / f"{n}-{side.replace(' ', '')}"
                where.mkdir()
                got = findings(case, run, where)
                if verbose:
                    print(f"trap {case['trap']} {side}: " + (", ".join(f"{f['rule']} {f['traps']}" for f in got)
                                                             or "no finding"))
                if side == "trap":
                    (named if any(case["trap"] in f["traps"] for f in got) else missed).append(case["trap"])
                    continue
                unjudged += any(f["severity"] == "info" for f in got)
                flagged = [f for f in got if f["severity"] != "info"]
                if flagged:
                    noisy.append((case["trap"], side, [f"{f['rule']} ({f['severity']})" for f in flagged]))
                if any(case["trap"] in f["traps"] for f in got):
                    own.append((case["trap"], side))
    traps = sorted({c["trap"] for c in cases}, key=int)
    hit = sorted(set(named) - set(missed), key=int)  # a trap with several launches counts when each draws it
    near = sum(len(sides(c)) - 1 for c in cases)
    return {"traps": traps, "hit": hit, "missed": sorted(set(traps) - set(hit), key=int), "near_misses": near,
            "noisy": noisy, "own": own, "unjudged": unjudged, "recall": len(hit) / len(traps) if traps else 0.0}


def report(doc: dict, result: dict, smoke: bool) -> None:
    reg = doc.get("registry", {})
    print(f"registry: {reg.get('repo', '?')} at {reg.get('commit', '?')}; date: {reg.get('date', '?')}")
    print(f"registry: canonical_trap_count {reg.get('canonical_trap_count', '?')}, content_sha256 "
          f"{reg.get('content_sha256', '?')}")
    counts = {k: len(doc.get(k, [])) for k in ("visible", "not_visible", "out_of_scope")}
    print(f"traps: visible {counts['visible']}, not_visible {counts['not_visible']}, "
          f"out_of_scope {counts['out_of_scope']} (total {sum(counts.values())})")
    if smoke:
        print(f"smoke: the first {len(result['traps'])} visible traps' cases only")
    print(f"recall: {len(result['hit'])}/{len(result['traps'])} = {result['recall']:.2f} "
          f"(bar {RECALL_BAR})")
    print(f"missed ({len(result['missed'])}): {', '.join(result['missed']) or 'none'}")
    print(f"near misses: {result['near_misses']}; drawing a warning or an error: {len(result['noisy'])}; "
          f"naming their own trap: {len(result['own'])}; with rules not judged for want of a fact (info): "
          f"{result['unjudged']}")
    for trap, side, rules in result["noisy"]:
        mark = " <- names its own trap" if (trap, side) in result["own"] else ""
        print(f"  trap {trap} {side}: {', '.join(rules)}{mark}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help=f"the first {SMOKE_CASES} cases only; fail only on "
                                                              "a crash")
    parser.add_argument("--check", action="store_true", help=f"exit 1 when recall < {RECALL_BAR} or any near miss "
                                                             "draws a warning or an error")
    parser.add_argument("--cases", type=Path, default=CASES, help="the cases file (default: %(default)s)")
    parser.add_argument("--verbose", action="store_true", help="every launch's findings and the traps they name")
    args = parser.parse_args()
    doc = yaml.safe_load(args.cases.read_text())
    result = measure(doc, SMOKE_CASES if args.smoke else None, args.verbose)
    report(doc, result, args.smoke)
    if args.check and not args.smoke and (result["recall"] < RECALL_BAR or result["noisy"]):
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
