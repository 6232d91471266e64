"""Roofline input: NVML-derived memory bandwidth against a measured device-to-device copy, on a real GPU.

    python3 benchmarks/roofline.py [--gib 4] [--iters 50]

gpuwarden's efficiency figures assume bandwidth = 2 x memory clock x bus width / 8
from NVML. This copies a buffer on the GPU with torch (read + write) and reports
both figures and their ratio. Read-only for the card's settings.
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "hardware"))

from nvml_readonly import ReadOnlyNvml  # noqa: E402

from gpuwarden.gpu.nvml import NvmlBackend  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gib", type=float, default=4.0, help="buffer size")
    parser.add_argument("--iters", type=int, default=50)
    args = parser.parse_args()
    try:
        import torch
    except ImportError:
        raise SystemExit("roofline: needs PyTorch with CUDA on a GPU host") from None
    if not torch.cuda.is_available():
        raise SystemExit("roofline: needs a CUDA GPU (torch.cuda.is_available() is false)")
    n = int(args.gib * 2**30) // 4
    src = torch.ones(n, dtype=torch.float32, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(5):
        dst.copy_(src)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(args.iters):
        dst.copy_(src)
    end.record()
    torch.cuda.synchronize()
    seconds = start.elapsed_time(end) / 1e3
    measured = 2 * src.numel() * 4 * args.iters / seconds  # each copy reads and writes the buffer
    backend = NvmlBackend(ReadOnlyNvml())
    sample = backend.gpus()[torch.cuda.current_device()].sample()  # memory clock while the GPU is awake
    backend.close()
    derived = sample.memory_bandwidth_bytes_per_s
    print(f"GPU: {sample.name}, memory clock {sample.memory_clock_mhz} MHz, bus {sample.memory_bus_width_bits} bit")
    print(f"NVML-derived peak (2 x clock x bus / 8): {derived / 1e12:.3f} TB/s")
    print(f"measured device-to-device copy ({args.gib:g} GiB x {args.iters}): {measured / 1e12:.3f} TB/s")
    print(f"measured / derived: {measured / derived:.3f}")


if __name__ == "__main__":
    main()
