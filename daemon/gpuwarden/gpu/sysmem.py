"""The system's memory, for GPUs that share it (DGX Spark's GB10: NVML answers NOT_SUPPORTED for memory).

The kernel's MemAvailable is what a new allocation can get without swapping,
so used = MemTotal - MemAvailable is what the serving preflight compares
against the engine's memory fraction.
"""

from __future__ import annotations

from pathlib import Path

MEMINFO = Path("/proc/meminfo")


def system_memory(path: Path = MEMINFO) -> tuple[int, int] | None:
    """(used, total) bytes of the system's memory, or None when /proc/meminfo cannot say."""
    fields = {}
    try:
        for line in path.read_text().splitlines():
            name, _, rest = line.partition(":")
            parts = rest.split()
            if parts and parts[0].isdigit():
                fields[name] = int(parts[0]) * 1024  # kB
    except OSError:
        return None
    if "MemTotal" not in fields or "MemAvailable" not in fields:
        return None
    return fields["MemTotal"] - fields["MemAvailable"], fields["MemTotal"]
