"""`gpuwarden bench`'s GPU view and roofline on a real GPU, without a server (read-only; needs torch + CUDA).

    PYTHONPATH=daemon python3 benchmarks/bench_gpu_view.py [--gib 4] [--seconds 10]

Writes a small safetensors model (a header and sparse data: only the header is read) with a config.json, then
records three "steps" with bench's own Watch reading NVML (wrapped read-only): the GPU idle, a decode-like
GEMV loop that reads every weight once per "token" (memory-bound, as single-stream decode is), and a bf16
matmul loop (compute-bound, to draw power). For each: SM/memory clocks, power against its limit, the reasons
seen and bench's flags. The roofline line is computed exactly as `gpuwarden bench` computes it, from the
GEMV step's real memory clocks and the model's header bytes, with the GEMV's tokens/s as "measured".
"""

import argparse
import json
import struct
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "hardware"))

from nvml_readonly import ReadOnlyNvml  # noqa: E402

from gpuwarden.bench.report import roofline, roofline_line  # noqa: E402
from gpuwarden.bench.watch import Watch, step_flags  # noqa: E402
from gpuwarden.gpu.nvml import NvmlBackend  # noqa: E402

ROWS, COLS = 8192, 8192  # one bf16 matrix: 128 MiB


def write_model(folder: Path, matrices: int) -> int:
    header, offset = {}, 0
    for i in range(matrices):
        nbytes = ROWS * COLS * 2
        header[f"model.layers.{i}.weight"] = {"dtype": "BF16", "shape": [ROWS, COLS],
                                              "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header).encode()
    path = folder / "model.safetensors"
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        f.truncate(8 + len(raw) + offset)  # sparse: the roofline reads the header only
    (folder / "config.json").write_text(json.dumps({"num_hidden_layers": matrices, "num_attention_heads": 64,
                                                    "num_key_value_heads": 8, "hidden_size": COLS,
                                                    "torch_dtype": "bfloat16"}))
    return offset


def step(watch: Watch, seconds: float, work=None) -> tuple[list, float | None]:
    import torch

    watch.begin()
    start, tokens = time.perf_counter(), 0
    if work is None:
        time.sleep(seconds)
    else:
        while time.perf_counter() - start < seconds:
            work()
            tokens += 1
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    gpus, _ = watch.end()
    return gpus, tokens / elapsed if work is not None else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gib", type=float, default=4.0, help="model size")
    parser.add_argument("--seconds", type=float, default=10.0, help="per step")
    args = parser.parse_args()
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("bench_gpu_view: needs a CUDA GPU")
    backend = NvmlBackend(ReadOnlyNvml())
    watch = Watch(lambda: [g.sample().as_dict() for g in backend.gpus()], None, None, interval_s=0.5)
    matrices = max(1, int(args.gib * 2**30 // (ROWS * COLS * 2)))
    weights = [torch.randn(ROWS, COLS, device="cuda", dtype=torch.bfloat16) for _ in range(matrices)]
    x = torch.randn(COLS, 1, device="cuda", dtype=torch.bfloat16)
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)

    def decode_token():  # every weight read once, as one decode step of one stream reads them
        for w in weights:
            torch.mm(w, x)

    def matmul():
        torch.mm(a, a)

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        stored = write_model(folder, matrices)
        results = {}
        for name, work in (("idle", None), ("decode-like GEMV", decode_token), ("bf16 matmul", matmul)):
            gpus, rate = step(watch, args.seconds, work)
            results[name] = (gpus[:1], rate)
            g = gpus[0]
            print(f"{name}: SM {g['sm_mhz_min']}-{g['sm_mhz_mean']:.0f} MHz (min-mean), memory {g['memory_mhz_mean']:.0f} "
                  f"MHz, power {g['power_w_mean']:.0f} W mean / {g['power_w_max']:.0f} W max of {g['power_limit_w']:.0f} W, "
                  f"util {g['utilization_pct_mean']:.0f}%, reasons {g['reasons_seen']}, polls {g['polls']}; flags: "
                  f"{step_flags(gpus[:1], None) or 'none'}" + (f"; {rate:.1f} tokens/s" if rate else ""))
        gpus, rate = results["decode-like GEMV"]
        fake_result = {"output_len": 0, "steps": [{"concurrency": 1, "ok": 1, "gpus": gpus, "input_tokens_mean": 0,
                                                   "per_request_tokens_per_s_mean": rate}]}
        line = roofline_line(roofline(fake_result, folder, 1, None))
        print(f"model: {matrices} x {ROWS}x{COLS} bf16 = {stored / 1e9:.3f} GB as stored (header read)")
        print(line)
    backend.close()


if __name__ == "__main__":
    main()
