"""Where gpuwarden keeps state: systemd's StateDirectory= when the unit sets one, else /var/lib/gpuwarden."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

DEFAULT = Path("/var/lib/gpuwarden")


def state_dir(environ: Mapping[str, str] = os.environ) -> Path:
    return Path(environ.get("STATE_DIRECTORY", "").split(":")[0] or DEFAULT)
