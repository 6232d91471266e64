"""How fast a simulated card serves at a given SM clock, and the small file channel that lets a served workload
(the test's fake OpenAI server, the demo) see the simulated cards' settings and tell them when it is busy.

The curve follows the published power sweeps: memory-bound decode keeps its speed down to about two
thirds of the card's TDP (the max power limit) and falls in proportion below; compute-bound prefill slows roughly
with the clock all the way (speed = clock fraction ** PREFILL_EXPONENT). The clock fraction is what the card runs
at under load: a locked clock, or the clock a binding power limit lets it keep (sim/backend.py's power model), so
the same curve answers a power-limit sweep and a clock sweep.

The channel is a directory (GPUWARDEN_SIM_STATE): the simulator writes `gpus.json` (each card's power limit,
clock lock and loaded clock fraction) whenever a setter changes a card, and reads `load.json` ({"open": N}, the
streams the server serves now) on each sample: a card is fully busy while N > 0. The server may name the cards its
streams run on, "gpus": [indices] (at most MAX_LOAD_GPUS entries; an entry that is no index in 0..MAX_LOAD_GPUS-1
is left out): only those are busy, the others idle; without the key every card is the server's. It may add
"prefill_share" (0..1, the share of its busy time spent on prefill): sim/gpm.py mixes the GPM figures by it. A real
card keeps its power limit and clock locks while the driver stays loaded, so a simulator with a channel reads its
settings back at start: a daemon killed mid-sweep finds the swept setting, as it would on real hardware.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ...base import smallfile

ENV = "GPUWARDEN_SIM_STATE"
DECODE_KNEE_OF_TDP = 2 / 3  # decode keeps full speed down to this share of TDP (RTX PRO 6000: 400 of 600 W)
PREFILL_EXPONENT = 0.85  # prefill: "roughly proportional" to the clock
MAX_FILE_BYTES = 64 * 1024
# A card stays loaded this long after its last stream closed. A client re-sends within milliseconds, and a real
# card's power reading does not fall to idle in that gap (its power readings are averaged over a window); without
# the hold a sample that lands between two rounds of requests reads idle draw mid-step (one poll of three at 70 W
# makes a 700 W step look like 483 W, and moves tune's knee).
BUSY_HOLD_S = 0.5
MAX_LOCK_MHZ = 10_000  # a clock lock read back from gpus.json: no GPU clocks near it
MAX_LOAD_GPUS = 64  # load.json's "gpus": the entries read and the indices taken (the scenarios hold a few cards)
MAX_CLOCK_S = 1e12  # clock.json's to_s and at (a monotonic clock's seconds): 30,000 years


def move_clock(directory: Path, to_s: float) -> None:
    """The test's side: move the simulated timeline on to to_s now (a fault scripted at to_s happens now), as a
    test waits for its engine to be up before the fault. Later moves only go forward."""
    _write(directory / "clock.json", {"to_s": to_s, "at": time.monotonic()})


def movable(clock: Callable[[], float], directory: Path) -> Callable[[], float]:
    """The simulator's clock through the channel: clock(), or where the last move_clock() put the timeline plus
    the time since, whichever is later (the timeline never runs backwards)."""
    latest = [float("-inf")]

    def now() -> float:
        base = clock()
        data = _read(directory / "clock.json")
        to, at = (data or {}).get("to_s"), (data or {}).get("at")
        # seconds a clock can hold: the folder may be another user's, and an "at" of 400 digits raised
        # OverflowError out of every sample, Infinity put the timeline at infinity for good (NaN fails the test)
        if all(type(v) in (int, float) and abs(v) <= MAX_CLOCK_S for v in (to, at)):
            base = max(base, to + max(0.0, time.monotonic() - at))
        latest[0] = max(latest[0], base)  # a move back (or a file taken away) never turns the timeline back
        return latest[0]
    return now


def decode_knee_fraction(idle_w: float, full_w: float, tdp_w: float) -> float:
    """The loaded clock fraction at which the card draws DECODE_KNEE_OF_TDP of its TDP (draw = idle + (full -
    idle) x fraction, the simulator's model)."""
    return min(1.0, max(0.05, (DECODE_KNEE_OF_TDP * tdp_w - idle_w) / (full_w - idle_w)))


def speed(kind: str, fraction: float, knee: float) -> float:
    """Relative serving speed (1.0 = the card unrestricted) of "decode" or "prefill" at this clock fraction."""
    fraction = min(1.0, max(0.0, fraction))
    if kind == "decode":
        return min(1.0, fraction / knee)
    return fraction ** PREFILL_EXPONENT


def channel() -> Path | None:
    value = os.environ.get(ENV)
    return Path(value) if value else None


def _read(path: Path) -> dict | None:
    try:
        raw = smallfile.read(path, MAX_FILE_BYTES)
        data = json.loads(raw) if raw is not None else None
    except (smallfile.Unreadable, ValueError, RecursionError):
        return None
    return data if isinstance(data, dict) else None


def _write(path: Path, data: dict) -> None:
    # readers see a whole file, never half of one; a served workload as another user reads the simulator's
    smallfile.write_atomic(path, json.dumps(data).encode(), 0o644, shared=True)


def write_gpus(directory: Path, gpus: list[dict]) -> None:
    _write(directory / "gpus.json", {"gpus": gpus})


def read_gpus(directory: Path) -> list[dict]:
    """Each card's saved settings; a gpu_lock that is not [low, high] whole MHz in 1..MAX_LOCK_MHZ, or a
    power_limit_w that is not a finite number, is left out (the folder may be another user's: a lock of 400 digits
    made every sample's arithmetic raise, and -5 MHz read as the card's clock). The card's own range is the
    simulator's check."""
    data = _read(directory / "gpus.json") or {}
    gpus = data.get("gpus")
    return [_settings(g) for g in gpus if isinstance(g, dict)] if isinstance(gpus, list) else []


def _settings(saved: dict) -> dict:
    lock, limit = saved.get("gpu_lock"), saved.get("power_limit_w")
    if not (isinstance(lock, list) and len(lock) == 2 and all(type(v) is int for v in lock)
            and 1 <= lock[0] <= lock[1] <= MAX_LOCK_MHZ):
        lock = None
    if not (type(limit) is int or (type(limit) is float and math.isfinite(limit))):  # a bool is no int here
        limit = None
    return {**saved, "gpu_lock": lock, "power_limit_w": limit}


def write_load(directory: Path, open_streams: int, prefill_share: float | None = None,
               gpus: list[int] | None = None) -> None:
    # CLOCK_MONOTONIC is one clock for every process of the host: the simulator compares it with its own
    data = {"open": open_streams, "at": time.monotonic()}
    if prefill_share is not None:
        data["prefill_share"] = round(prefill_share, 4)
    if gpus is not None:
        data["gpus"] = list(gpus)
    _write(directory / "load.json", data)


@dataclass(frozen=True)
class Load:
    busy: bool
    prefill_share: float | None  # None: not said, or not a number in 0..1 (the figures then follow the load alone)
    gpus: frozenset[int] | None = None  # the cards the server's streams run on; None: every card

    def serves(self, index: int) -> bool:
        """The server's load is on this card (busy while it serves); a card it does not name idles."""
        return self.gpus is None or index in self.gpus


def read_load(directory: Path) -> Load | None:
    """What the server says it does; None: it says nothing (the scenario's load holds). A server that went idle
    less than BUSY_HOLD_S ago still counts as serving."""
    data = _read(directory / "load.json")
    if data is None or not isinstance(data.get("open"), int):
        return None
    at = data.get("at")
    now = time.monotonic()  # compared, never subtracted: an "at" of 400 digits has no float
    recent = type(at) in (int, float) and now - BUSY_HOLD_S < at <= now
    share = data.get("prefill_share")
    valid = isinstance(share, (int, float)) and not isinstance(share, bool) and 0 <= share <= 1
    return Load(data["open"] > 0 or recent, float(share) if valid else None, _load_gpus(data.get("gpus")))


def _load_gpus(value) -> frozenset[int] | None:
    """load.json's "gpus": the indices in 0..MAX_LOAD_GPUS-1 among its first MAX_LOAD_GPUS entries (a bool, a
    float or -1 is no index); None when the key is absent or not a list (the folder may be another user's: a list
    of 30,000 entries is read no further than the bound)."""
    if not isinstance(value, list):
        return None
    return frozenset(v for v in value[:MAX_LOAD_GPUS] if type(v) is int and 0 <= v < MAX_LOAD_GPUS)


def busy(directory: Path) -> bool | None:
    """The server says it serves (True) or idles (False); None: it says nothing."""
    load = read_load(directory)
    return None if load is None else load.busy
