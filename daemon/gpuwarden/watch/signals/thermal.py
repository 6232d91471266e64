"""The GPU's temperature, and its memory's (the HBM's own sensor, NVML_FI_DEV_MEMORY_TEMP, read with the
counters; absent where the card has none). No rule of its own: the thermal slowdowns the card asserts
(slowdown.py) fire, and the card knows its limits better than a fixed threshold here would."""

from __future__ import annotations

from ..rows import gpu_row

RULES = ()

ROWS = (
    gpu_row("gpuwarden_gpu_temperature_celsius", "GPU temperature", "sample.temperature_c"),
    gpu_row("gpuwarden_gpu_memory_temperature_celsius", "GPU memory temperature (its own sensor, on HBM cards), "
            "read every counters_interval_s", "sample.memory_temperature_c"),
)
