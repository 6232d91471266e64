"""Where gpuwarden keeps state: systemd's StateDirectory= when the unit sets one, else /var/lib/gpuwarden."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

DEFAULT = Path("/var/lib/gpuwarden")


RUNTIME_DEFAULT = Path("/run/gpuwarden")


def state_dir(environ: Mapping[str, str] = os.environ) -> Path:
    return Path(environ.get("STATE_DIRECTORY", "").split(":")[0] or DEFAULT)


def listen_file(environ: Mapping[str, str] = os.environ) -> Path:
    """Where the running daemon says which metrics URL it serves (systemd's RuntimeDirectory=): a reload
    cannot move the port, so `gpuwarden status` may need it when metrics.listen was changed since."""
    return Path(environ.get("RUNTIME_DIRECTORY", "").split(":")[0] or RUNTIME_DEFAULT) / "metrics-url"
