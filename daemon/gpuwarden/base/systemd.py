"""systemd integration: sd_notify messages and journal priority prefixes on log lines.

Both are no-ops outside systemd: without NOTIFY_SOCKET nothing is sent, and
without a JOURNAL_STREAM that matches our stderr, log lines stay plain text.
Neither may stall the main loop: notifications are non-blocking datagrams, and
log records go through a bounded queue to a writer thread, so a journal that
stops reading costs dropped (and counted) lines, never a frozen poll.
"""

from __future__ import annotations

import array
import logging
import os
import queue
import socket
import sys
import threading
import time
from collections.abc import Mapping

from .safetext import visible

NOTICE = 25  # syslog's "notice", between INFO and WARNING
logging.addLevelName(NOTICE, "NOTICE")
# Python level -> syslog priority, as journald reads it from a "<N>" prefix.
PRIORITY = {logging.CRITICAL: 2, logging.ERROR: 3, logging.WARNING: 4, NOTICE: 5, logging.INFO: 6,
            logging.DEBUG: 7}


def stderr_is_journal(env: Mapping[str, str] = os.environ, fd: int = 2) -> bool:
    """True when stderr is the journal stream systemd set up (JOURNAL_STREAM=DEV:INODE)."""
    value = env.get("JOURNAL_STREAM", "")
    dev, _, ino = value.partition(":")
    if not (dev.isdigit() and ino.isdigit()):
        return False
    try:
        st = os.fstat(fd)
    except OSError:
        return False
    return (st.st_dev, st.st_ino) == (int(dev), int(ino))


def print_error(text: str) -> None:
    """One error line on stderr, at priority err when stderr is the journal; its text may quote a server or a
    file, so control characters are escaped (safetext.visible)."""
    prefix = "<3>" if stderr_is_journal() else ""
    print(f"{prefix}{visible(text)}", file=sys.stderr)


class LineFormatter(logging.Formatter):
    """Each record as one line with every control character escaped (safetext.visible): the one place every log
    line passes, so a request path, a header or a child's output quoted in a message can never end the record
    (NUL, CR, LF), start a forged one with its own `<N>` priority, or drive a terminal (ESC). A traceback stays
    in its record, its line ends written as `\\n`."""

    def format(self, record: logging.LogRecord) -> str:
        return visible(super().format(record))


class JournalFormatter(LineFormatter):
    """`<N>message`: journald stores N as the priority, so `journalctl -p warning` works."""

    def format(self, record: logging.LogRecord) -> str:
        priority = PRIORITY.get(record.levelno, 6 if record.levelno < logging.WARNING else 3)
        return f"<{priority}>{super().format(record)}"


# At most one STATUS= per this many seconds: a 1 s poll with a flapping alert sent 33 in 40 s.
STATUS_MIN_INTERVAL_S = 5.0
LOG_QUEUE_RECORDS = 10_000  # about a minute of the chattiest vLLM start-up


class QueuedLog(logging.Handler):
    """Hands records to a writer thread through a bounded queue; a full queue drops and counts.

    The writer formats and calls os.write() itself rather than through a StreamHandler: a write
    blocked on a stalled pipe then holds no lock that logging.shutdown() or the interpreter's exit
    would wait for, so even a daemon whose stderr nobody reads still exits on SIGTERM.
    """

    def __init__(self, formatter: logging.Formatter, fd: int = 2, capacity: int = LOG_QUEUE_RECORDS):
        super().__init__()
        self.setFormatter(formatter)
        self.fd = fd
        self.queue: queue.Queue = queue.Queue(capacity)
        self.dropped = 0  # records lost because the sink did not keep up
        self._reported = 0
        self._thread = threading.Thread(target=self._write, name="log-writer", daemon=True)
        self._thread.start()

    def handle(self, record: logging.LogRecord) -> bool:
        self.emit(record)  # no handler lock: the queue is the only shared state, and it has its own
        return True

    def emit(self, record: logging.LogRecord) -> None:
        try:
            record.msg, record.args = record.getMessage(), None  # format here: args may change later
            if record.exc_info:
                record.msg += "\n" + logging.Formatter().formatException(record.exc_info)
                record.exc_info = None
            self.queue.put_nowait(record)
        except queue.Full:
            self.dropped += 1

    def drain(self, timeout_s: float) -> bool:
        """Wait, at most timeout_s, until what is queued now has been written; False if the sink is slow."""
        written = threading.Event()
        try:
            self.queue.put(written, timeout=timeout_s)
        except queue.Full:
            return False
        return written.wait(timeout_s)

    def _write(self) -> None:
        while (record := self.queue.get()) is not None:
            if isinstance(record, threading.Event):  # a flush marker: everything before it is written
                record.set()
                continue
            if self.dropped > self._reported and self.queue.empty():
                lost, self._reported = self.dropped - self._reported, self.dropped
                self._out(logging.LogRecord("gpuwarden", logging.WARNING, __file__, 0,
                                            "%d log lines were dropped: the log sink was too slow", (lost,), None))
            self._out(record)

    def _out(self, record: logging.LogRecord) -> None:
        data = (self.format(record) + "\n").encode("utf-8", "replace")
        try:
            while data:
                data = data[os.write(self.fd, data):]
        except OSError:
            self.dropped += 1  # stderr closed or broken: nothing to tell

    def close(self, timeout_s: float = 2.0) -> None:
        """Flush what is queued, waiting at most timeout_s for a stalled sink."""
        try:
            self.queue.put(None, timeout=timeout_s)
        except queue.Full:
            pass
        self._thread.join(timeout_s)
        super().close()


def flush_logs(timeout_s: float = 0.5) -> None:
    """Let the queued log lines reach stderr first (bounded): before READY=1, so that the journal shows
    what led to it before systemd's "Started"."""
    for handler in logging.getLogger().handlers:
        if isinstance(handler, QueuedLog):
            handler.drain(timeout_s)


def setup_logging(level: int = logging.INFO, journal: bool | None = None) -> QueuedLog:
    """Log to stderr, with priority prefixes when stderr is the journal, through a bounded queue."""
    if journal is None:
        journal = stderr_is_journal()
    queued = QueuedLog(JournalFormatter("%(message)s") if journal else
                       LineFormatter("%(asctime)s %(levelname)s %(message)s", "%Y-%m-%d %H:%M:%S"))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(queued)
    root.setLevel(level)
    return queued


class Notifier:
    """READY / STATUS / WATCHDOG / STOPPING for a Type=notify unit."""

    def __init__(self, env: Mapping[str, str] = os.environ):
        path = env.get("NOTIFY_SOCKET", "")
        self.enabled = bool(path)
        self._address = "\0" + path[1:] if path.startswith("@") else path  # "@": the abstract namespace
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) if self.enabled else None
        self.dropped = 0  # messages systemd's socket did not take at once
        self._status: str | None = None
        self._status_at = float("-inf")  # monotonic seconds of the last STATUS= sent
        self.watchdog_interval_s: float | None = None
        usec, pid = env.get("WATCHDOG_USEC", ""), env.get("WATCHDOG_PID", "")
        if self.enabled and usec.isdigit() and int(usec) > 0 and (not pid or pid == str(os.getpid())):
            self.watchdog_interval_s = int(usec) / 1e6 / 2  # ping at half the timeout, as systemd advises
        self._next_watchdog = 0.0

    def _send(self, message: str) -> None:
        if self._sock is None:
            return
        try:  # never wait for systemd: a full socket buffer costs this message, not a poll
            self._sock.sendto(message.encode("utf-8"), socket.MSG_DONTWAIT, self._address)
        except OSError:
            self.dropped += 1

    def ready(self, status: str, now: float) -> None:
        status = visible(status)  # a line of its own in the datagram: a newline would add a field (STOPPING=1)
        self._status, self._status_at = status, now
        self._send(f"READY=1\nSTATUS={status}")

    def status(self, status: str, now: float) -> None:
        """Send a changed status, at most once per STATUS_MIN_INTERVAL_S: a state that flaps costs one
        message per interval, and its last value is sent once the interval has passed (called every poll)."""
        status = visible(status)  # it may quote a process name or a child's line: one field, never a second
        if status != self._status and now - self._status_at >= STATUS_MIN_INTERVAL_S:
            self._status, self._status_at = status, now
            self._send(f"STATUS={status}")

    def watchdog(self, now: float) -> None:
        if self.watchdog_interval_s is not None and now >= self._next_watchdog:
            self._next_watchdog = now + self.watchdog_interval_s
            self._send("WATCHDOG=1")

    def next_watchdog_in(self, now: float) -> float | None:
        return None if self.watchdog_interval_s is None else max(0.0, self._next_watchdog - now)

    def stopping(self) -> None:
        self._send("STOPPING=1")

    def reloading(self) -> None:
        """A handover (re-exec) begins; the new image's READY=1 ends it."""
        self._send(f"RELOADING=1\nMONOTONIC_USEC={time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000}")

    def keep_fd(self, name: str, fd: int | None) -> None:
        """Put fd in systemd's file descriptor store under name (FileDescriptorStoreMax= in the unit), or with
        None take the named one out: a restarted daemon gets it back as LISTEN_FDS."""
        if self._sock is None:
            return
        message = f"FDSTORE=1\nFDNAME={name}" if fd is not None else f"FDSTOREREMOVE=1\nFDNAME={name}"
        # sendmsg itself: socket.send_fds drops its flags and address (CPython 3.11), and this socket is not
        # connected, so every FDSTORE through it failed (ENOTCONN) and the store never held a thing.
        rights = [] if fd is None else [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))]
        try:
            self._sock.sendmsg([message.encode()], rights, socket.MSG_DONTWAIT, self._address)
        except OSError:
            self.dropped += 1

    def extend_timeout(self, seconds: float) -> None:
        """Ask systemd for seconds more before its start/stop timeout (a long vLLM drain)."""
        self._send(f"EXTEND_TIMEOUT_USEC={int(seconds * 1e6)}")
