"""bench's and tune's options are checked against one table of ranges (bench/options.py)."""

import argparse
import math

import pytest

from gpuwarden.bench.options import RANGES, concurrency_steps, out_of_range


def test_each_range_takes_its_ends_and_refuses_past_them_and_nan():
    ends = {"concurrency": (1, 4096), "steps": (2, 64), "input_len": (1, None), "output_len": (1, None),
            "requests": (1, None), "warmup": (0, None), "engine_interval": (0, None), "grace": (0, None),
            "idle": (0, 600)}
    for name, (low, high) in ends.items():
        assert RANGES[name](low) and not RANGES[name](low - 1), name
        if high is not None:
            assert RANGES[name](high) and not RANGES[name](high + 1), name
        assert not RANGES[name](math.nan), name
    for name in ("duration", "request_timeout"):  # positive seconds: any fraction above 0
        assert RANGES[name](0.001) and not RANGES[name](0) and not RANGES[name](math.nan)


def test_an_option_not_given_is_not_checked():
    args = argparse.Namespace(requests=None, duration=None, idle=2.0)
    assert not out_of_range(args, ("requests", "duration", "idle"))
    assert out_of_range(argparse.Namespace(requests=None, duration=0.0, idle=2.0), ("requests", "duration", "idle"))
    assert not out_of_range(argparse.Namespace(steps=1, idle=2.0), ("idle",))  # only the names asked for


def test_concurrency_steps():
    assert concurrency_steps("1, 2,4096") == [1, 2, 4096]
    for bad in ("0", "4097", "x", "", "1.5"):
        with pytest.raises(ValueError, match="--concurrency"):
            concurrency_steps(bad)
