"""The thread that waits for the GPUs' Xid and fatal events, started with the daemon where the backend reports
them; it queues them and wakes the main loop, which logs and counts them (Daemon.handle_gpu_events)."""

from __future__ import annotations

import logging
from collections.abc import Callable

from ..gpu.base import GpuBackend
from ..watch.eventwatch import EventWatcher

log = logging.getLogger("gpuwarden")


def start_event_thread(backend: GpuBackend, wake: Callable[[], None] | None) -> EventWatcher | None:
    """Start the thread that waits for Xid and fatal events (where the backend reports them); None without."""
    try:
        source = backend.events()
    except Exception as exc:  # the events are extra: polling goes on without them
        log.warning("GPU events unavailable: %s: %s", type(exc).__name__, exc)
        return None
    if source is None:
        log.info("GPU events: this backend reports none; Xids show only in the kernel log")
        return None
    kinds = "; ".join(f"GPU{gpu} {','.join(names)}" for gpu, names in sorted(source.registered.items()))
    log.info("GPU events: waiting for %s", kinds or "none (no GPU reports events)")
    watcher = EventWatcher(source, wake)
    watcher.start()
    return watcher
