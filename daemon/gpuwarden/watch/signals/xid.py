"""GPU events: Xids and the driver's other fatal events (eventwatch.py keeps the book, xids.py says what each
means). Rules: an Xid in the last five minutes (gpu_xid) and an event that asked for a reset or a reboot that has
not happened yet (gpu_needs_reset)."""

from __future__ import annotations

from dataclasses import dataclass

from ...gpu.base import GpuSample
from ..alerts import CRITICAL, INACTIVE, WARNING, Check, GpuContext, Poll, Rule
from ..rows import COUNTER, Row
from ..xids import lookup


def gpu_xid(s: GpuSample, ctx: GpuContext) -> Check:
    xids = ctx.window(RecentEvents).xids
    if not xids:
        return INACTIVE
    seen = ", ".join(f"Xid {x} ({lookup(x).meaning}) x{n}" for x, n in xids)
    return Check(True, f"{seen} in the last 5 minutes", "no Xid", f"Xid {xids[0][0]}")


def gpu_needs_reset(s: GpuSample, ctx: GpuContext) -> Check:
    why = ctx.window(RecentEvents).reset_needed
    return Check(why is not None, why or "", "no reset or reboot pending", "needs reset")


RULES = (
    Rule("gpu_xid", WARNING, "the journal line names the Xid, its meaning and the processes on the GPU; an "
         "application fault (13, 31, 43) restarts only what died", gpu_xid, for_s=0.0),
    Rule("gpu_needs_reset", CRITICAL, "drain the GPU, then reset it (nvidia-smi -r) or reboot as the line says; "
         "the engine held for it starts again by itself once the GPU answers (or `systemctl reload gpuwarden`)",
         gpu_needs_reset, for_s=0.0),
)


@dataclass(frozen=True)
class Events:
    """What RecentEvents read for one GPU on one poll."""

    xids: tuple[tuple[int, int], ...]  # (xid, count) of the GPU's recent Xids (eventwatch.RECENT_S), most first
    reset_needed: str | None  # an event asked for a GPU reset or a reboot, and none happened yet


class RecentEvents:
    """The signal's window (alerts.Window): the events' book (eventwatch.EventBook) keeps the history, fed by the
    event thread between polls; this reads it for one GPU."""

    EMPTY = Events((), None)

    def read(self, sample: GpuSample, poll: Poll) -> Events:
        return Events(tuple(poll.events.recent_xids(sample.index, poll.now)),
                      poll.events.needs_reset.get(sample.index))


WINDOW = RecentEvents


def _totals(snap):
    for view in snap.gpus:
        index = view.sample.index
        yield (str(index),), sum(n for (gpu, _, kind), n in snap.event_counts.items() if gpu == index and kind == "xid")


def _events(snap, xids: bool):
    """The book's counts (gpu, xid or -1, kind): the Xids by number, or the other events by kind."""
    for (gpu, number, kind), count in sorted(snap.event_counts.items()):
        if (kind == "xid") == xids:
            yield (str(gpu) if gpu >= 0 else "unknown", str(number) if xids else kind), count


ROWS = (
    Row("gpuwarden_gpu_xids", "All Xid errors of this GPU (0 until one comes: a series to alert and graph on)",
        ("gpu",), _totals, COUNTER),
    Row("gpuwarden_gpu_xid_errors", "Xid errors reported by NVML's event set", ("gpu", "xid"),
        lambda snap: _events(snap, True), COUNTER),
    Row("gpuwarden_gpu_events", "Other fatal GPU events (double-bit ECC, GPU unavailable, recovery action, DRAM "
        "retirement, poisoned memory)", ("gpu", "kind"), lambda snap: _events(snap, False), COUNTER),
)
