"""The GPU's temperature. Its rules are the thermal slowdowns the card itself asserts (slowdown.py): the card
knows its own limits better than a fixed threshold here would."""

from __future__ import annotations

from ..rows import gpu_row

RULES = ()

ROWS = (
    gpu_row("gpuwarden_gpu_temperature_celsius", "GPU temperature", "sample.temperature_c"),
)
