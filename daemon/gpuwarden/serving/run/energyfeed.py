"""The engine's GPUs' energy, for the proxy's joules per request (design/joules-per-request.md): on every poll the
daemon reads each of the engine's GPUs' energy counter and writes, whole and at once, one small JSON file in its
runtime directory that the proxy reads:

    {"v": 1, "epoch": "9f2c...", "t": 81235.251, "gpus": {"0": 84211, "1": 83002}, "power": ["1"]}

`gpus` are running sums, whole mJ, since this daemon began (its `epoch`), `t` when they were read on
CLOCK_MONOTONIC (one clock for every process of the host, the proxy's too). Sums, not each poll's energy: a read
the proxy misses costs nothing, the next one covers it, and no pipe need cross a handover (a path is found again).
Each poll adds the counter's step; where the card has no counter, or it went back (a GPU reset, a driver reload),
the trapezoid of the two polls' power readings instead, and the GPU is named in `power` for that reading. The
energy is no secret (any local user may ask NVML for it); only root writes the folder."""

from __future__ import annotations

import json
import logging
import os
import re
import secrets
import stat
import time
from collections.abc import Mapping
from pathlib import Path

from ...base.smallfile import write_atomic

log = logging.getLogger("gpuwarden")
VERSION = 1
FEED_MAX = 16 * 1024  # 64 GPUs' sums at most: the proxy reads no more


def feed_path(host: str, port: int, environ: Mapping[str, str] = os.environ) -> Path:
    """The file for the proxy on this address (one proxy an address, on one host): in systemd's RuntimeDirectory=,
    a tmpfs, so a write a second wears no disk."""
    name = re.sub(r"[^0-9A-Za-z.]", "_", host)[:64]
    return Path(environ.get("RUNTIME_DIRECTORY", "").split(":")[0] or "/run/gpuwarden") / "energy" / \
        f"proxy-{name}-{port}.json"


def safe_folder(folder: Path) -> str | None:
    """Why the daemon (root) must not write there; None: it may. A real folder of its own that no other user may
    write, and above it, every folder up to / (as resolved) root's or the daemon's, none that another may write but a
    sticky one (/tmp): else another could swap a folder on the way for a link (root would write through it) or forge
    the sums."""
    return _own_folder(folder) or _safe_above(folder.parent)


def _own_folder(folder: Path) -> str | None:
    """Why folder itself is not the daemon's to write in: not a real folder, or another's, or others may write."""
    st = os.lstat(folder)
    if not stat.S_ISDIR(st.st_mode):
        return f"{folder} is not a folder"
    if st.st_uid not in (0, os.geteuid()) or st.st_mode & 0o022:
        return f"{folder} is another user's, or others may write in it"
    return None


def _safe_above(path: Path) -> str | None:
    """The first folder on the way to / that another user owns, or may write without a sticky bit: on the path as
    written (a link on it must be root's or the daemon's, in a folder so judged) and on the path it resolves to."""
    written = Path(os.path.abspath(path))
    real = Path(os.path.realpath(path))
    for above, st in [(p, os.lstat(p)) for p in (written, *written.parents)] + \
            [(p, os.stat(p)) for p in (real, *real.parents)]:
        if st.st_uid not in (0, os.geteuid()) or (not stat.S_ISLNK(st.st_mode) and st.st_mode & 0o022
                                                    and not st.st_mode & stat.S_ISVTX):
            return f"{above} is another user's, or others may write in it"
    return None


def prepare(folder: Path) -> str | None:
    """Make the feed's folder, judged before and after: what is above it first (no mkdir through another's link),
    then, once made, the folder and every one above it again: in a sticky folder such as /tmp another user may make
    a missing part between the look and the mkdir, and root's folder would then sit in theirs (a run outside systemd,
    whose RuntimeDirectory= is made before the daemon starts). Readable by the proxy's user whatever the daemon's umask
    (the unit's UMask=0077 made it 0700: the proxy read nothing). Why not, or None."""
    existing = folder.parent
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if unsafe := _safe_above(existing):
        return unsafe
    folder.mkdir(mode=0o755, parents=True, exist_ok=True)
    if unsafe := safe_folder(folder):
        return unsafe
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        os.fchmod(fd, 0o755)
    finally:
        os.close(fd)
    return None


class EnergyFeed:
    def __init__(self, path: Path, clock=time.monotonic):
        self.path, self.clock = path, clock
        self.epoch = secrets.token_hex(8)
        self.sums: dict[int, int] = {}  # gpu -> mJ since this daemon began
        self.last: dict[int, tuple[float, int | None, float | None]] = {}  # gpu -> (when, counter, watts) last read
        self.failed = False  # the write failed: said once, until one works
        self.ready = False  # its folder is made and safe (safe_folder), judged at the first write and after a failure

    def tick(self, gpus, watts: Mapping[int, float | None]) -> None:
        """Read the engine's GPUs (Gpu objects; watts: this poll's power reading of each, for the trapezoid) and
        write the sums."""
        power, now = [], None
        for gpu in gpus:
            counter = gpu.energy_mj()
            now = self.clock()
            w = watts.get(gpu.index)
            was = self.last.get(gpu.index)
            self.last[gpu.index] = (now, counter, w)
            step = 0
            if was is not None:
                then, before, w0 = was
                if counter is not None and before is not None and counter >= before:
                    step = counter - before
                elif w is not None and w0 is not None:
                    step = round((w + w0) / 2 * (now - then) * 1000)
                    power.append(str(gpu.index))
            self.sums[gpu.index] = self.sums.get(gpu.index, 0) + max(0, step)
        # A GPU not read this poll (the engine moved off it) is forgotten: back later, it starts from its next read,
        # not with its whole absence as one step (the re-check's N3: an hour away, 720 kJ to one request)
        ticked = {gpu.index for gpu in gpus}
        self.last = {i: v for i, v in self.last.items() if i in ticked}
        if now is None:
            return
        line = {"v": VERSION, "epoch": self.epoch, "t": now, "gpus": {str(i): mj for i, mj in self.sums.items()},
                "power": power}
        try:
            unsafe = None
            if self.failed or not self.ready:  # the folder made and judged once: no other user may swap it after
                unsafe = prepare(self.path.parent)
                self.ready = unsafe is None
            if unsafe is None:
                write_atomic(self.path, json.dumps(line).encode(), mode=0o644)
        except OSError as exc:
            unsafe = exc.strerror or str(exc)
        if unsafe is not None and not self.failed:
            log.warning("joules per request: the energy for the proxy is not written to %s (%s): the proxy counts no "
                        "joules until it can", self.path, unsafe)
        self.failed = unsafe is not None

    def close(self) -> None:
        """The daemon stops: the file goes (a proxy left running reads no stale sums; the next daemon writes anew)."""
        try:
            self.path.unlink()
        except OSError:
            pass
