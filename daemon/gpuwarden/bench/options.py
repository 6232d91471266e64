"""The values bench's and tune's options take: one table of ranges for both commands, and the comma lists."""

from __future__ import annotations

import argparse

CONCURRENCY_MAX = 4096

# By the option's name in argparse's namespace. Each command says in its own words which ones it checks; a NaN is
# outside every range.
RANGES = {
    "concurrency": lambda v: 1 <= v <= CONCURRENCY_MAX,
    "steps": lambda v: 2 <= v <= 64,
    "input_len": lambda v: v >= 1,
    "output_len": lambda v: v >= 1,
    "requests": lambda v: v >= 1,
    "duration": lambda v: v > 0,
    "request_timeout": lambda v: v > 0,
    "warmup": lambda v: v >= 0,
    "engine_interval": lambda v: v >= 0,
    "grace": lambda v: v >= 0,
    "idle": lambda v: 0 <= v <= 600,
}


def out_of_range(args: argparse.Namespace, names: tuple[str, ...]) -> bool:
    """Whether any of these options, where given (None: not given), is outside its range."""
    return any(getattr(args, name) is not None and not RANGES[name](getattr(args, name)) for name in names)


def comma_numbers(text: str, convert) -> list:
    """"1,2, 4" as numbers (convert: int or float); [] when one is not a number."""
    try:
        return [convert(v) for v in text.split(",") if v.strip()]
    except ValueError:
        return []


def concurrency_steps(text: str) -> list[int]:
    """bench's --concurrency: the steps."""
    values = comma_numbers(text, int)
    if not values or not all(RANGES["concurrency"](v) for v in values):
        raise ValueError(f"--concurrency {text!r}: expected positive integers up to {CONCURRENCY_MAX}, e.g. 1,2,4,8")
    return values
