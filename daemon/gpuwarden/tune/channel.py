"""The control channel's wire, what both ends speak: `gpuwarden tune` (SweepClient, here) asks the running daemon
to set each step of a sweep, under a lease, and the daemon puts the configured setting back however the sweep
ends; `gpuwarden health clear` asks it to record a repair. The daemon's end: the lease and the putting back in
tune/sweeps.py, the socket in service/control.py. Every client connects and asks through Connection.

The wire: a unix stream socket in the runtime directory, mode 0600 (created under umask 0177, so never wider),
and each peer's SO_PEERCRED uid checked (root, or the daemon's own user). One JSON object per line, one answer
line each: {"op": "begin", "setting": "power_limit_w" | "gpu_clocks", "gpus": [0, 1] | null, "lease_s": 15,
"force": false}, {"op": "set", "value": 450}, {"op": "renew"}, {"op": "end"}. Limits: LINE_MAX bytes a line,
MESSAGES_MAX lines a connection, CONNECTIONS_MAX connections at once, one lease at a time and only its own
connection may use it, each whole line within the lease (or HELLO_S before a begin), a set at most every SET_MIN_S,
and one wake of the main loop answers only what was queued when it woke (the loop's polls come first).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import struct
import threading
import time
from pathlib import Path

SETTINGS = ("power_limit_w", "gpu_clocks")  # what a sweep may change
LINE_MAX = 4096
MESSAGES_MAX = 10_000
CONNECTIONS_MAX = 4
HELLO_S = 10.0  # a connection says begin within this
LEASE_MIN_S, LEASE_MAX_S = 1.0, 300.0
ANSWER_S = 60.0  # the most the main loop may take to answer one message (the setters and their read-back)
ANSWER_WAIT_S = ANSWER_S + 5  # what a client waits for a whole answer line, however it trickles
ANSWER_MAX = 64 * 1024  # an answer line: a sweep's limits and UUIDs, a repair's counts, are a few KiB at most
SET_MIN_S = 0.5  # a lease's sets at most this often: a real sweep sets once a step, seconds apart; each set and
# its read-back costs the main loop ~25 ms a GPU, so a flood of them would starve the polls (and the watchdog)


def socket_path(environ=os.environ) -> Path:
    """systemd's RuntimeDirectory= (the unit makes /run/gpuwarden, root's), else /run/gpuwarden."""
    return Path(environ.get("RUNTIME_DIRECTORY", "").split(":")[0] or "/run/gpuwarden") / "control.sock"


class ControlError(Exception):
    """One line for the user of `tune`: the daemon refused, or (ChannelLost) is gone."""


class Unreachable(ControlError):
    """No daemon to ask: no control socket, or it cannot be connected to (`tune` exits 69, or 77 for root's)."""


class LeaseLost(KeyboardInterrupt):
    """Raised in tune's main thread when its lease is lost: a KeyboardInterrupt, so that asyncio lets it out of a
    running step as it lets Ctrl-C (a plain Exception raised in a task would only fail that task)."""


# The renew thread tells the main thread that the lease is gone with this signal, whose handler tune installs
# itself: SIGINT cannot do it, since a script's background job (`tune ... &`) has SIGINT ignored, and then
# _thread.interrupt_main() does nothing and the sweep ran on for up to a whole step after its daemon died.
LOST_SIGNAL = signal.SIGUSR1


class ChannelLost(ControlError):
    """The connection failed or closed mid-sweep: the lease is gone with it."""


def peer_of(conn: socket.socket) -> tuple[int, int]:
    """(uid, pid) of the process at the other end, from the kernel (SO_PEERCRED: struct ucred)."""
    pid, uid, _ = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    return uid, pid


# -- a client's connection (tune, health clear) ------------------------------------------------------------

class Connection:
    """A client's connection to the daemon's control socket: one JSON line out, one answer line back, whole within
    ANSWER_WAIT_S however it trickles, at most ANSWER_MAX bytes, one JSON object. Every failure is a ControlError
    with a sentence for the user: Unreachable before the connection, ChannelLost after."""

    def __init__(self, path: Path):
        try:
            self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        except OSError as exc:  # out of descriptors
            raise Unreachable(f"cannot connect to {path}: {exc.strerror or exc}") from None
        try:
            self.sock.settimeout(ANSWER_WAIT_S)
            self.sock.connect(str(path))
        except (FileNotFoundError, ConnectionRefusedError):
            self.sock.close()
            raise Unreachable(f"no daemon answers on {path}: is it running (`systemctl status gpuwarden`), with "
                              "tuning.apply on? (a read-only daemon opens no control socket)") from None
        except PermissionError:
            self.sock.close()
            raise Unreachable(f"{path}: permission denied: the control channel is root's (run it as root)") from None
        except OSError as exc:
            self.sock.close()
            raise Unreachable(f"cannot connect to {path}: {exc.strerror or exc}") from None
        self.path = path
        self._buffer = b""

    def ask(self, message: dict) -> dict:
        deadline = time.monotonic() + ANSWER_WAIT_S
        try:
            self.sock.settimeout(ANSWER_WAIT_S)  # the last answer's read may have left a short one
            self.sock.sendall(json.dumps(message).encode() + b"\n")
            while b"\n" not in self._buffer[:ANSWER_MAX + 1]:
                if len(self._buffer) > ANSWER_MAX:
                    break
                self.sock.settimeout(max(0.01, deadline - time.monotonic()))
                chunk = self.sock.recv(65536)
                if not chunk:
                    raise ChannelLost("the daemon closed the control channel (did it stop?)")
                self._buffer += chunk
        except TimeoutError:
            raise ChannelLost(f"the daemon did not answer within {ANSWER_WAIT_S:g} s (is its main loop stuck?)") \
                from None
        except OSError as exc:
            raise ChannelLost(f"the daemon's control channel failed: {exc.strerror or exc}") from None
        line, _, self._buffer = self._buffer.partition(b"\n")
        if len(line) > ANSWER_MAX:
            raise ChannelLost(f"{self.path} answered more than {ANSWER_MAX} bytes in a line (is it gpuwarden's?)")
        try:
            answer = json.loads(line)
        except (ValueError, RecursionError):
            answer = None
        if not isinstance(answer, dict):
            raise ChannelLost(f"{self.path} did not answer with one JSON object (is it gpuwarden's?)")
        return answer

    def close(self) -> None:
        self.sock.close()


# -- the client: `gpuwarden tune` ----------------------------------------------------------------------------

class SweepClient:
    """A sweep's lease, renewed by a thread every third of it while the steps run."""

    def __init__(self, path: Path, setting: str, gpus: list[int] | None, lease_s: float, force: bool):
        self.connection = Connection(path)
        self.sock = self.connection.sock
        self.daemon_pid = peer_of(self.sock)[1]  # the kernel's word on who listens: the pid --apply reloads
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.lost: str | None = None  # why the lease was lost mid-sweep (the daemon stopped or died)
        self._raised = False  # LeaseLost raised once (_on_lost)
        self._last_set = float("-inf")
        began = self.ask({"op": "begin", "setting": setting, "gpus": gpus, "lease_s": lease_s, "force": force})
        self.limits, self.uuids = began["limits"], began.get("uuids", {})
        if threading.current_thread() is threading.main_thread():  # where a signal handler can be installed
            signal.signal(LOST_SIGNAL, self._on_lost)
        self._renewer = threading.Thread(target=self._renew, args=(lease_s / 3,), daemon=True)
        self._renewer.start()

    def ask(self, message: dict) -> dict:
        with self._lock:  # the renew thread asks on the same connection
            answer = self.connection.ask(message)
        if not answer.get("ok"):
            raise ControlError(answer.get("error", "refused"))
        return answer

    def _renew(self, every: float) -> None:
        while not self._stop.wait(every):
            try:
                self.ask({"op": "renew"})
            except ControlError as exc:
                if not self._stop.is_set():  # the lease is gone: the steps after this would measure nothing set
                    self.lost = str(exc)
                    # To the main thread itself: its wait in a step (epoll, a sleep) ends with EINTR and the handler
                    # runs at once; a signal to the process could land on this thread and wake nothing.
                    signal.pthread_kill(threading.main_thread().ident, LOST_SIGNAL)
                return

    def _on_lost(self, signum: int, frame: object) -> None:
        # Left installed after end(): a late signal must find this handler, never SIGUSR1's default (it kills).
        if self.lost is not None and not self._stop.is_set() and not self._raised:
            self._raised = True  # once: a second SIGUSR1 (from outside) during the sweep's cleanup is no traceback
            raise LeaseLost(self.lost)  # the sweep ends as on Ctrl-C, and tune says the lease was lost

    def set(self, value: float) -> dict:
        # The daemon takes a set at most every SET_MIN_S: very short steps wait a moment. Counted from the last
        # answer, which came after the daemon took that set, so the daemon never sees two closer than this.
        wait = self._last_set + SET_MIN_S + 0.05 - time.monotonic()
        if wait > 0:
            time.sleep(wait)
        try:
            return self.ask({"op": "set", "value": value})
        finally:
            self._last_set = time.monotonic()

    def end(self) -> list[str]:
        self._stop.set()
        if self.lost is not None:
            self.sock.close()
            raise ControlError(self.lost)
        try:
            return self.ask({"op": "end"}).get("restored", [])
        finally:
            self.sock.close()
