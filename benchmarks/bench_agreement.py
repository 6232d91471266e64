"""`gpuwarden bench` against vLLM's own serving benchmark, on the same CPU vLLM, shapes and concurrency.

    python3 benchmarks/bench_agreement.py [--venv /opt/gpuwarden-test/venv-vllm] [--rounds 3]
        [--concurrency 1,4] [--prompts 32] [--input-len 48] [--output-len 128] [--prefix-caching]

Starts the CPU build of vLLM (tests/vllm/install) serving the tiny test model, then, per round and per
concurrency, runs `vllm.benchmarks.serve` (random dataset, --ignore-eos, completions API) and `gpuwarden
bench` (--requests = the prompt count) one after the other, each going first in turn. The random dataset
decodes random token ids and the tiny model's tokenizer re-encodes them longer, so a first, discarded vLLM run
measures the prompt length it really sends, and gpuwarden bench is given that length (which it builds exactly with
vLLM's /tokenize): the same shapes. vLLM runs in this script's session (see RESULTS.md, section 9, for why).

vLLM serves without prefix caching unless --prefix-caching: its random dataset builds each prompt from
consecutive token ids after a random offset, and the tiny model has 310 tokens, so most of its prompts begin
where an earlier one did and 58-79 % of their tokens came from the cache (gpuwarden bench's prompts differ in
their first words: none). Each run's hit rate, from vLLM's counters, is printed beside it.

vLLM's benchmark runs twice per round: as it is, and with its aiohttp session's trust_env=True turned off (the
only change). With trust_env, aiohttp 3.14 looks up the proxy variables and ~/.netrc in a worker thread for
every request (aiohttp/client.py: run_in_executor(_get_netrc_auth), to_thread(get_env_proxy_for_url)), after
the benchmark started the request's clock; on this 2-core box that adds 0.6-0.8 ms to each TTFT.
Prints output tok/s and mean TTFT from all three, the ratios, and the medians over rounds.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from _common import free_port

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "daemon"))
from gpuwarden.serving.probe.metrics import fetch  # noqa: E402  (the daemon's bounded read of /metrics)

TOOLS = ("vllm", "vllm_noenv", "ours")  # vLLM's benchmark as it ships, the same with trust_env off, gpuwarden bench
VLLM_SERVE = """
import argparse, os, sys
import aiohttp
from vllm.benchmarks.serve import add_cli_args, main
if os.environ.get("AGREEMENT_TRUST_ENV") == "0":  # its one session, as it is but for trust_env (see the docstring)
    session_init = aiohttp.ClientSession.__init__
    def without_env(self, *args, **kwargs):
        session_init(self, *args, **{**kwargs, "trust_env": False})
    aiohttp.ClientSession.__init__ = without_env
parser = argparse.ArgumentParser()
add_cli_args(parser)
main(parser.parse_args(sys.argv[1:]))
"""


def start_vllm(python: Path, model: Path, port: int, log, prefix_caching: bool) -> subprocess.Popen:
    cmd = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--port", str(port),
           "--host", "127.0.0.1", "--gpu-memory-utilization", "0.3", "--max-model-len", "512",
           "--enable-prefix-caching" if prefix_caching else "--no-enable-prefix-caching"]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, process_group=0)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"vLLM exited with {proc.returncode}; see {log.name}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                return proc
        except OSError:
            time.sleep(1)
    raise SystemExit("vLLM did not become healthy in 600 s")


def prefix_cache_counters(port: int) -> tuple[float, float]:
    """vLLM's (hits, queries) prefix-cache token counters."""
    counters = fetch(f"http://127.0.0.1:{port}/metrics")
    return counters.get("vllm:prefix_cache_hits_total", 0.0), counters.get("vllm:prefix_cache_queries_total", 0.0)


def with_hit_rate(port: int, run) -> dict:
    """run()'s figures, and the share of prompt tokens vLLM served from its prefix cache during it."""
    hits, queries = prefix_cache_counters(port)
    got = run()
    hits_after, queries_after = prefix_cache_counters(port)
    return {**got, "hit_rate": (hits_after - hits) / (queries_after - queries) if queries_after > queries else 0.0}


def vllm_bench(python: Path, model: Path, port: int, c: int, args, out_dir: Path, trust_env: bool = True) -> dict:
    name = f"vllm-c{c}-{time.monotonic_ns()}.json"
    cmd = [str(python), "-c", VLLM_SERVE, "--backend", "openai", "--base-url", f"http://127.0.0.1:{port}",
           "--endpoint", "/v1/completions", "--model", str(model), "--dataset-name", "random",
           "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len),
           "--num-prompts", str(args.prompts), "--max-concurrency", str(c), "--ignore-eos", "--num-warmups", "2",
           "--save-result", "--result-dir", str(out_dir), "--result-filename", name, "--disable-tqdm",
           "--seed", str(time.monotonic_ns() % 2**31)]  # new prompts each run (which still share starts: see above)
    env = {**os.environ, "AGREEMENT_TRUST_ENV": "1" if trust_env else "0"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"vllm.benchmarks.serve failed:\n{proc.stderr[-3000:]}")
    result = json.loads((out_dir / name).read_text())
    if not result["completed"]:
        raise SystemExit(f"vllm.benchmarks.serve: every request failed: {result.get('errors', [])[:1]}")
    return {"tok_s": result["output_throughput"], "ttft_ms": result["mean_ttft_ms"],
            "input_tokens": result["total_input_tokens"] / result["completed"]}


def our_bench(port: int, c: int, args, state: Path, input_len: int) -> dict:
    config = state.parent / "bench.yaml"
    config.write_text("metrics: {listen: none}\n")  # no daemon: the GPU view is not what is compared here
    cmd = [sys.executable, "-m", "gpuwarden", "bench", "-c", str(config), "--url", f"http://127.0.0.1:{port}",
           "--concurrency", str(c), "--requests", str(args.prompts), "--input-len", str(input_len),
           "--output-len", str(args.output_len), "--warmup", "2", "--json",
           "--engine-interval", str(args.engine_interval)]
    env = {**os.environ, "STATE_DIRECTORY": str(state), "PYTHONPATH": str(ROOT / "daemon")}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"gpuwarden bench failed:\n{proc.stderr[-3000:]}")
    step = json.loads(proc.stdout)["steps"][0]
    return {"tok_s": step["system_tokens_per_s"], "ttft_ms": step["ttft_mean_s"] * 1e3,
            "input_tokens": step["input_tokens_mean"]}


def compare(python: Path, model: Path, port: int, args, tools=TOOLS) -> list[dict]:
    """Per round and concurrency, each of tools run once (each going first in turn), with vLLM's prefix-cache
    hit rate over each run: one row of {tool}_{figure} per (round, C)."""
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        sent = vllm_bench(python, model, port, 1, args, Path(tmp))["input_tokens"]
        every = {"vllm": lambda c: vllm_bench(python, model, port, c, args, Path(tmp)),
                 "vllm_noenv": lambda c: vllm_bench(python, model, port, c, args, Path(tmp), trust_env=False),
                 "ours": lambda c: our_bench(port, c, args, Path(tmp) / "state", round(sent))}
        runs = {who: every[who] for who in tools}
        for r in range(args.rounds):
            for i, c in enumerate(args.concurrency):
                shift = (r + i) % len(runs)  # each tool goes first, second and third in turn
                order = list(runs)[shift:] + list(runs)[:shift]
                got = {who: with_hit_rate(port, lambda: runs[who](c)) for who in order}
                rows.append({"round": r, "concurrency": c, **{f"{w}_{k}": v for w in got for k, v in got[w].items()}})
    return rows


def median_ratio(rows: list[dict], mine: str, theirs: str) -> float:
    return statistics.median(r[mine] / r[theirs] for r in rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--venv", type=Path, default=Path(os.environ.get("GPUWARDEN_VLLM_VENV",
                                                                        "/opt/gpuwarden-test/venv-vllm")))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4])
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=48, help="vLLM's random dataset length (the tiny "
                        "tokenizer re-encodes it about 3x longer)")
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--engine-interval", type=float, default=2.0, help="gpuwarden bench's gauge polling")
    parser.add_argument("--prefix-caching", action="store_true", help="serve with vLLM's prefix cache on (its "
                        "random prompts then hit it; see the docstring)")
    args = parser.parse_args()
    python = args.venv / "bin" / "python"
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "tiny"
        subprocess.run([str(python), str(ROOT / "tests" / "vllm" / "make_tiny_model.py"), str(model)], check=True,
                       capture_output=True, timeout=300)
        port = free_port()
        with open(Path(tmp) / "vllm.log", "w") as log:
            server = start_vllm(python, model, port, log, args.prefix_caching)
            try:
                rows = compare(python, model, port, args)
            finally:
                os.killpg(server.pid, 15)
                server.wait(timeout=60)
    print("| round | C | vllm tok/s | gpuwarden tok/s | ratio | vllm TTFT ms | vllm TTFT ms, trust_env off "
          "| gpuwarden TTFT ms | ratio | ratio to trust_env off | input tokens vllm / gpuwarden "
          "| prefix-cache hits vllm / gpuwarden |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        print(f"| {row['round']} | {row['concurrency']} | {row['vllm_tok_s']:.1f} | {row['ours_tok_s']:.1f} | "
              f"{row['ours_tok_s'] / row['vllm_tok_s']:.3f} | {row['vllm_ttft_ms']:.2f} | "
              f"{row['vllm_noenv_ttft_ms']:.2f} | {row['ours_ttft_ms']:.2f} | "
              f"{row['ours_ttft_ms'] / row['vllm_ttft_ms']:.3f} | "
              f"{row['ours_ttft_ms'] / row['vllm_noenv_ttft_ms']:.3f} | "
              f"{row['vllm_input_tokens']:.1f} / {row['ours_input_tokens']:.1f} | "
              f"{row['vllm_hit_rate']:.0%} / {row['ours_hit_rate']:.0%} |")
    for c in args.concurrency:
        at_c = [r for r in rows if r["concurrency"] == c]
        tok_s = median_ratio(at_c, "ours_tok_s", "vllm_tok_s"), median_ratio(at_c, "ours_tok_s", "vllm_noenv_tok_s")
        ttft = (median_ratio(at_c, "ours_ttft_ms", "vllm_ttft_ms"),
                median_ratio(at_c, "ours_ttft_ms", "vllm_noenv_ttft_ms"))
        print(f"C={c}: median ratios (gpuwarden / vllm): output tok/s {tok_s[0]:.3f} ({tok_s[1]:.3f} to trust_env "
              f"off), mean TTFT {ttft[0]:.3f} ({ttft[1]:.3f} to trust_env off)")
    print(json.dumps(rows), file=sys.stderr)


if __name__ == "__main__":
    main()
