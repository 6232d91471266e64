"""`gpuwarden bench` against vLLM's own serving benchmark, on the same CPU vLLM, shapes and concurrency.

    python3 benchmarks/bench_agreement.py [--venv /opt/gpuwarden-test/venv-vllm] [--rounds 3]
        [--concurrency 1,4] [--prompts 16] [--input-len 128] [--output-len 64]

Starts the CPU build of vLLM (tests/vllm/install) serving the tiny test model, then, per round and per
concurrency, runs `vllm.benchmarks.serve` (random dataset, --ignore-eos, completions API) and `gpuwarden
bench` (--requests = the prompt count) one after the other, alternating which goes first. The random dataset
decodes random token ids and the tiny model's tokenizer re-encodes them longer, so a first, discarded vLLM run
measures the prompt length it really sends, and gpuwarden bench is given that length (which it builds exactly with
vLLM's /tokenize): the same shapes. vLLM runs in this script's session (see RESULTS.md, section 9, for why).
Prints output tok/s and mean TTFT from both, with the ratio, and the medians over rounds.
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

ROOT = Path(__file__).resolve().parent.parent
VLLM_SERVE = """
import argparse, sys
from vllm.benchmarks.serve import add_cli_args, main
parser = argparse.ArgumentParser()
add_cli_args(parser)
main(parser.parse_args(sys.argv[1:]))
"""


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_vllm(python: Path, model: Path, port: int, log) -> subprocess.Popen:
    cmd = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--port", str(port),
           "--host", "127.0.0.1", "--gpu-memory-utilization", "0.3", "--max-model-len", "512"]
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


def vllm_bench(python: Path, model: Path, port: int, c: int, args, out_dir: Path) -> dict:
    name = f"vllm-c{c}-{time.monotonic_ns()}.json"
    cmd = [str(python), "-c", VLLM_SERVE, "--backend", "openai", "--base-url", f"http://127.0.0.1:{port}",
           "--endpoint", "/v1/completions", "--model", str(model), "--dataset-name", "random",
           "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len),
           "--num-prompts", str(args.prompts), "--max-concurrency", str(c), "--ignore-eos", "--num-warmups", "2",
           "--save-result", "--result-dir", str(out_dir), "--result-filename", name, "--disable-tqdm",
           "--seed", str(time.monotonic_ns() % 2**31)]  # new prompts each run: none served from the prefix cache
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
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


def compare(python: Path, model: Path, port: int, args) -> list[dict]:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        sent = vllm_bench(python, model, port, 1, args, Path(tmp))["input_tokens"]
        for r in range(args.rounds):
            for c in args.concurrency:
                order = ("vllm", "ours") if (r + c) % 2 == 0 else ("ours", "vllm")
                got = {}
                for who in order:
                    got[who] = (vllm_bench(python, model, port, c, args, Path(tmp)) if who == "vllm"
                                else our_bench(port, c, args, Path(tmp) / "state", round(sent)))
                rows.append({"round": r, "concurrency": c, **{f"{w}_{k}": v for w in got for k, v in got[w].items()}})
    return rows


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
    args = parser.parse_args()
    python = args.venv / "bin" / "python"
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "tiny"
        subprocess.run([str(python), str(ROOT / "tests" / "vllm" / "make_tiny_model.py"), str(model)], check=True,
                       capture_output=True, timeout=300)
        port = free_port()
        with open(Path(tmp) / "vllm.log", "w") as log:
            server = start_vllm(python, model, port, log)
            try:
                rows = compare(python, model, port, args)
            finally:
                os.killpg(server.pid, 15)
                server.wait(timeout=60)
    print("| round | C | vllm bench tok/s | gpuwarden bench tok/s | ratio | vllm mean TTFT ms | gpuwarden mean TTFT ms "
          "| ratio | vllm input tokens | gpuwarden input tokens |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        print(f"| {row['round']} | {row['concurrency']} | {row['vllm_tok_s']:.1f} | {row['ours_tok_s']:.1f} | "
              f"{row['ours_tok_s'] / row['vllm_tok_s']:.3f} | {row['vllm_ttft_ms']:.1f} | {row['ours_ttft_ms']:.1f} | "
              f"{row['ours_ttft_ms'] / row['vllm_ttft_ms']:.3f} | {row['vllm_input_tokens']:.1f} | "
              f"{row['ours_input_tokens']:.1f} |")
    for c in args.concurrency:
        mine = [r for r in rows if r["concurrency"] == c]
        tok = statistics.median(r["ours_tok_s"] / r["vllm_tok_s"] for r in mine)
        ttft = statistics.median(r["ours_ttft_ms"] / r["vllm_ttft_ms"] for r in mine)
        print(f"C={c}: median ratios (gpuwarden / vllm): output tok/s {tok:.3f}, mean TTFT {ttft:.3f}")
    print(json.dumps(rows), file=sys.stderr)


if __name__ == "__main__":
    main()
