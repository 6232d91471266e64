"""GPU events as they happen: a thread that only waits on the backend's event source, and the book the main
loop keeps of what arrived.

The thread hands each event to the main loop through the same wake-up pipe the signals use, so an Xid is
logged within moments, not at the next poll. The book writes one journal line per event kind and GPU per
alerts.repeat_s (an Xid storm of 1,000 a second is one line and a count, not 1,000 lines), counts every
event for gpuwarden_gpu_xid_errors_total, and keeps what the alert rules read: the Xids of the last
RECENT_S, and whether a GPU waits for a reset or a reboot.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from . import xids
from ..gpu.events import RECOVERY_ACTIONS, GpuEvent
from ..base.faultlog import FaultLog
from ..base.systemd import NOTICE

log = logging.getLogger("gpuwarden")
RECENT_S = 300.0  # an Xid keeps its GPU's gpu_xid alert on this long
WAIT_S = 0.5  # the thread wakes this often to see whether it should stop


class EventWatcher:
    """Waits on source in a thread; each event is queued and wake() is called (the signal pipe)."""

    def __init__(self, source, wake: Callable[[], None] | None = None):
        self.source = source
        self.wake = wake
        self.events: queue.SimpleQueue[GpuEvent] = queue.SimpleQueue()
        self.failure: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gpu-events", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                arrived = self.source.wait(WAIT_S)
            except Exception as exc:  # the source broke (NVML gone): say so once, the polls go on
                self.failure = f"{type(exc).__name__}: {exc}"
                return
            for event in arrived:
                self.events.put(event)
            if arrived and self.wake is not None:
                self.wake()

    def take(self) -> list[GpuEvent]:
        out = []
        while True:
            try:
                out.append(self.events.get_nowait())
            except queue.Empty:
                return out

    def stop(self, timeout_s: float = 2.0) -> bool:
        """Stop waiting and release the source; True when the thread has ended."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        self.source.close()
        return not self._thread.is_alive()


@dataclass
class EventBook:
    repeat_s: float
    counts: Counter = field(default_factory=Counter)  # (gpu, xid) -> events; kind events use xid -1
    recent: dict[int, list[tuple[float, int]]] = field(default_factory=dict)  # gpu -> [(at, xid)]
    needs_reset: dict[int, str] = field(default_factory=dict)  # gpu -> why it waits for a reset or reboot
    # gpu -> why it waits for a reset while it serves on (Xid 63: a row remap recorded, in effect at the next reset)
    pending: dict[int, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._quiet = FaultLog(log, period_s=self.repeat_s)  # one line per (GPU, event kind) a period, with a count
        self._field_asked: set[int] = set()  # GPUs waiting whose polled recovery-action field has asked (reset_unseen)

    def repeat_every(self, seconds: float) -> None:
        """A reloaded alerts.repeat_s, for the (GPU, event kind) periods running now too."""
        self.repeat_s = seconds
        self._quiet.set_period(seconds)

    def record(self, event: GpuEvent, now: float, processes: Callable[[int], str]) -> str | None:
        """Count and log one event; return the reason when it asks for a reset or a reboot, else None."""
        xid = xids.lookup(event.data) if event.kind == "xid" else None
        key = f"{event.gpu} " + (f"xid {event.data}" if xid else event.kind)
        self.counts[(event.gpu, event.data if xid else -1, event.kind)] += 1
        if xid:
            self.recent.setdefault(event.gpu, []).append((now, event.data))
        what, action, level = self._describe(event, xid)
        pending = xid is not None and xid.pending
        reset = (xid.needs_reset if xid is not None else action in xids.HOLDS) or \
            (event.kind == "recovery_action" and event.data != 0)
        if reset:
            self.needs_reset[event.gpu] = f"{what}: {action}"
            self._field_asked.discard(event.gpu)  # a new wait: only the field read from now on clears it unseen
        elif pending:
            self.pending[event.gpu] = f"{what}: {action}"
        since = self._quiet.admit(key, now)  # None: within its period, counted
        if since is None:
            return self.needs_reset.get(event.gpu) if reset else None
        more = f" ({since} more since the last line)" if since else ""
        done = ("the serving engine on it is stopped and waits (HELD) until the GPU is back"
                if reset else "the GPU serves on, degraded until it is reset (at the next maintenance window)"
                if pending else "its processes' own health decides (the engine restarts if it died)"
                if xid is not None and xid.app_fault else "logged and counted")
        extra = f"; processes on it: {processes(event.gpu)}" if xid is not None and xid.app_fault else ""
        gpu = f"GPU{event.gpu}" if event.gpu >= 0 else "a GPU that cannot be named"
        log.log(level, "%s %s%s; recovery: %s; gpuwarden: %s%s [source: %s]", gpu, what, more, action, done, extra,
                xids.CATALOG)
        return self.needs_reset.get(event.gpu) if reset else None

    @staticmethod
    def _describe(event: GpuEvent, xid: xids.Xid | None) -> tuple[str, str, int]:
        if xid is not None:
            level = logging.CRITICAL if xid.needs_reset else logging.ERROR if xid.app_fault else logging.WARNING
            return f"Xid {xid.number} ({xid.meaning})", xid.action, level
        if event.kind == "recovery_action":
            action = RECOVERY_ACTIONS.get(event.data, f"action {event.data}")
            level = NOTICE if event.data == 0 else logging.CRITICAL
            return "the driver set a recovery action", "none" if event.data == 0 else action, level
        if event.kind == "double_bit_ecc":
            return "double-bit ECC error", xids.RESET_GPU, logging.CRITICAL
        if event.kind == "gpu_unavailable":
            return "GPU unavailable", xids.REBOOT, logging.CRITICAL
        if event.kind == "dram_retirement_failure":  # as Xid 64: a row that cannot be retired or remapped
            return "DRAM retirement failed", xids.INSPECT, logging.CRITICAL
        if event.kind == "nonfatal_poison":  # as Xid 94: contained, only the process that read it was stopped
            return "poisoned memory contained (the process that read it was stopped)", xids.RESTART_APP, \
                logging.ERROR
        if event.kind == "fatal_poison":  # as Xid 95
            return "poisoned memory not contained", xids.RESET_GPU, logging.CRITICAL
        return "DRAM page retired", xids.NONE, logging.WARNING

    def recent_xids(self, gpu: int, now: float) -> list[tuple[int, int]]:
        """(xid, count) of this GPU's Xids in the last RECENT_S, most frequent first."""
        if not self.recent.get(gpu):  # every poll asks, for every GPU; almost always none
            return []
        kept = [(at, x) for at, x in self.recent.get(gpu, []) if now - at <= RECENT_S]
        self.recent[gpu] = kept
        return Counter(x for _, x in kept).most_common()

    def cleared(self, gpu: int) -> None:
        """The GPU came back (a reset or a driver reload): it no longer waits for one."""
        self.needs_reset.pop(gpu, None)
        self.pending.pop(gpu, None)
        self._field_asked.discard(gpu)

    def all_reset(self) -> None:
        """The operator says every GPU was reset: none waits any more."""
        self.needs_reset.clear()
        self.pending.clear()
        self._field_asked.clear()

    def reset_unseen(self, gpu: int, recovery_action: int | None) -> bool:
        """A GPU that waits for the reset its driver asked for in the polled recovery-action field, and whose field,
        read asking while it waited, reads none again: it was reset between two polls (a starved daemon can miss the
        second the GPU is off the bus, and without this the engine would stay HELD for good). A wait from an Xid,
        whose field never asked, is not cleared this way."""
        if gpu not in self.needs_reset or recovery_action is None:
            return False
        if recovery_action:
            self._field_asked.add(gpu)
            return False
        return gpu in self._field_asked


def processes_on(pids: list[int], proc: Path = Path("/proc")) -> str:
    """e.g. "pid 4242 (python3), pid 4243 (VLLM::EngineCor)"; "none" when empty."""
    named = []
    for pid in pids:
        try:
            named.append(f"pid {pid} ({(proc / str(pid) / 'comm').read_text().strip()})")
        except OSError:
            named.append(f"pid {pid}")
    return ", ".join(named) or "none"
