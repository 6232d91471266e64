"""systemd integration: sd_notify messages and journal priority prefixes on log lines.

Both are no-ops outside systemd: without NOTIFY_SOCKET nothing is sent, and
without a JOURNAL_STREAM that matches our stderr, log lines stay plain text.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Mapping

import sdnotify

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
    """One error line on stderr, at priority err when stderr is the journal."""
    prefix = "<3>" if stderr_is_journal() else ""
    print(f"{prefix}{text}", file=sys.stderr)


class JournalFormatter(logging.Formatter):
    """`<N>message`: journald stores N as the priority, so `journalctl -p warning` works."""

    def format(self, record: logging.LogRecord) -> str:
        priority = PRIORITY.get(record.levelno, 6 if record.levelno < logging.WARNING else 3)
        return f"<{priority}>{super().format(record)}"


def setup_logging(level: int = logging.INFO, journal: bool | None = None) -> logging.Handler:
    """Log to stderr, with priority prefixes when stderr is the journal."""
    if journal is None:
        journal = stderr_is_journal()
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JournalFormatter("%(message)s") if journal else
                         logging.Formatter("%(asctime)s %(levelname)s %(message)s", "%Y-%m-%d %H:%M:%S"))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)
    return handler


class Notifier:
    """READY / STATUS / WATCHDOG / STOPPING for a Type=notify unit."""

    def __init__(self, env: Mapping[str, str] = os.environ):
        self.enabled = bool(env.get("NOTIFY_SOCKET"))
        self._sd = sdnotify.SystemdNotifier() if self.enabled else None
        self._status: str | None = None
        self.watchdog_interval_s: float | None = None
        usec, pid = env.get("WATCHDOG_USEC", ""), env.get("WATCHDOG_PID", "")
        if self.enabled and usec.isdigit() and int(usec) > 0 and (not pid or pid == str(os.getpid())):
            self.watchdog_interval_s = int(usec) / 1e6 / 2  # ping at half the timeout, as systemd advises
        self._next_watchdog = 0.0

    def _send(self, message: str) -> None:
        if self._sd is not None:
            # sdnotify encodes as Latin-1, systemd reads UTF-8: hand it the UTF-8 bytes as Latin-1 text.
            self._sd.notify(message.encode("utf-8").decode("latin-1"))

    def ready(self, status: str) -> None:
        self._status = status
        self._send(f"READY=1\nSTATUS={status}")

    def status(self, status: str) -> None:
        if status != self._status:  # send only changes
            self._status = status
            self._send(f"STATUS={status}")

    def watchdog(self, now: float) -> None:
        if self.watchdog_interval_s is not None and now >= self._next_watchdog:
            self._next_watchdog = now + self.watchdog_interval_s
            self._send("WATCHDOG=1")

    def next_watchdog_in(self, now: float) -> float | None:
        return None if self.watchdog_interval_s is None else max(0.0, self._next_watchdog - now)

    def stopping(self) -> None:
        self._send("STOPPING=1")
