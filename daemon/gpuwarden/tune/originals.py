"""The GPU settings as they were before gpuwarden first changed them this boot, kept on disk.

Kept in memory only, they are lost when the daemon crashes: systemd restarts it,
and it records the tuned values as "original", so restore_on_stop would put the
tuned state back. As Red Hat tuned keeps its storage, the originals are written
the first time this boot changes a setting, keyed by the kernel's boot id
(/proc/sys/kernel/random/boot_id), and read back by a restarted daemon. A file
from another boot is ignored: a reboot reset the cards.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from ..base import smallfile
from ..base.statedir import state_dir

log = logging.getLogger("gpuwarden")
BOOT_ID = Path("/proc/sys/kernel/random/boot_id")
MAX_BYTES = 1024 * 1024  # a few settings per GPU: far less


def boot_id() -> str:
    try:
        return BOOT_ID.read_text().strip()
    except OSError:
        return "unknown"


def originals_store(config, backend=None) -> OriginalsStore | None:
    """The store for this config's GPUs: real ones, and simulated ones whose settings outlive the process (a
    simulator with a channel, gpu/sim/power.py); a plain simulated card starts afresh with its process."""
    keeps = config.gpu.backend == "nvml" or getattr(backend, "persistent", False)
    return OriginalsStore(state_dir() / "originals.json") if keeps else None


class OriginalsStore:
    """{GPU UUID: {setting: original value}} for this boot, in one JSON file written atomically."""

    def __init__(self, path: Path, boot: str | None = None):
        self.path = path
        self.boot = boot or boot_id()

    def load(self) -> dict[str, dict[str, Any]]:
        try:
            raw = smallfile.read(self.path, MAX_BYTES)  # never a FIFO's wait, a link's target or a huge file
            if raw is None:
                return {}
            data = json.loads(raw)
        except (smallfile.Unreadable, ValueError, RecursionError) as exc:
            log.warning("originals in %s unreadable (%s): recording them afresh", self.path, exc)
            return {}
        if not isinstance(data, dict) or data.get("boot_id") != self.boot or not isinstance(data.get("gpus"), dict):
            return {}  # another boot: the cards came up with their defaults again
        return data["gpus"]

    def save(self, gpus: dict[str, dict[str, Any]]) -> None:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            smallfile.write_atomic(self.path, json.dumps({"boot_id": self.boot, "gpus": gpus}, indent=1,
                                                         sort_keys=True).encode())
        except OSError as exc:  # tuning goes on; only a restart would lose them
            log.warning("originals not saved to %s: %s", self.path, exc.strerror)
