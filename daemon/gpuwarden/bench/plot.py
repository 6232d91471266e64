"""Charts of a tune or bench result, drawn by matplotlib (an optional dependency: Debian's python3-matplotlib).

Drawn to a file with the Agg backend: no display is needed, and none is opened on a headless server.
"""

from __future__ import annotations

from pathlib import Path


class PlotUnavailable(ImportError):
    """matplotlib is not installed: one line that says how to get it."""


def require():
    try:
        import matplotlib
    except ImportError:
        raise PlotUnavailable("--plot needs matplotlib, which is not installed (Debian: apt install "
                              "python3-matplotlib; pip: pip install matplotlib)") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def chart_path(path: Path) -> Path:
    """The file --plot writes, checked before any step runs: a name without a suffix gets .png (matplotlib would
    add it anyway, and the path printed must be the one written); a suffix matplotlib cannot write is
    ValueError, one line."""
    require()
    if not path.suffix:
        return path.with_name(path.name + ".png")
    from matplotlib.backend_bases import FigureCanvasBase

    formats = FigureCanvasBase.get_supported_filetypes()  # what savefig writes, by suffix
    if path.suffix[1:].lower() not in formats:
        raise ValueError(f"--plot {path}: matplotlib cannot write {path.suffix} files (it writes "
                         f"{', '.join('.' + f for f in sorted(formats))})")
    return path


def plot_tune(result: dict, path: Path) -> None:
    """tok/s and tok/J against the setting, on two axes of one chart."""
    plt = require()
    steps = [s for s in result["steps"] if s.get("system_tokens_per_s")]
    x = [s["setting"] for s in steps]
    fig, speed = plt.subplots(figsize=(8, 4.5))
    try:
        speed.plot(x, [s["system_tokens_per_s"] for s in steps], "o-", color="tab:blue", label="tok/s")
        speed.set_xlabel(f"{result['setting']} ({result['unit']})")
        speed.set_ylabel("output tok/s", color="tab:blue")
        energy = speed.twinx()
        energy.plot(x, [s.get("tokens_per_joule") for s in steps], "s--", color="tab:green", label="tok/J")
        energy.set_ylabel("tokens per joule", color="tab:green")
        knee = result.get("knee")
        if knee:
            speed.axvline(knee["setting"], color="gray", linestyle=":")
            speed.annotate(f"knee {knee['setting']:g} {result['unit']}", (knee["setting"], knee["system_tokens_per_s"]))
        speed.set_title(f"{result['model']}: C={result['concurrency']}, {result['input_len']} in / "
                        f"{result['output_len']} out")
        fig.tight_layout()
        fig.savefig(path)
    finally:
        plt.close(fig)


def plot_bench(result: dict, path: Path) -> None:
    """bench's tok/s and TTFT p50 against concurrency."""
    plt = require()
    steps = [s for s in result["steps"] if s.get("system_tokens_per_s")]
    x = [s["concurrency"] for s in steps]
    fig, speed = plt.subplots(figsize=(8, 4.5))
    try:
        speed.plot(x, [s["system_tokens_per_s"] for s in steps], "o-", color="tab:blue")
        speed.set_xscale("log", base=2)
        speed.set_xlabel("concurrency")
        speed.set_ylabel("output tok/s", color="tab:blue")
        ttft = speed.twinx()
        ttft.plot(x, [(s.get("ttft_p50_s") or 0) * 1e3 for s in steps], "s--", color="tab:red")
        ttft.set_ylabel("TTFT p50 (ms)", color="tab:red")
        speed.set_title(f"{result['model']}: {result['input_len']} in / {result['output_len']} out")
        fig.tight_layout()
        fig.savefig(path)
    finally:
        plt.close(fig)
