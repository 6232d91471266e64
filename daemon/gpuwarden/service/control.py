"""The control socket: the daemon's end of `gpuwarden tune`'s channel (the wire: tune/channel.py) and of
`gpuwarden health clear`'s one request. Threads accept, read and answer; the main loop decides (tune/sweeps.py's
Sweeps, watch/health_record.answer_clear), woken for each message.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import queue
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path

from ..gpu import errors
from ..tune.channel import ANSWER_S, CONNECTIONS_MAX, HELLO_S, LINE_MAX, MESSAGES_MAX, peer_of, socket_path
from ..tune.sweeps import Sweeps

log = logging.getLogger("gpuwarden")

SEND_S = 5.0  # an answer line not taken within this: the peer is not reading, the connection is closed
HEALTH_CLEAR = "health_clear"  # `gpuwarden health clear`'s one request: a GPU repaired, its reboot counts reset
SERVE_MAX = 8  # requests one wake of the main loop answers; the rest wait for the next wake


class ControlServer:
    """Accepts on the socket; each connection's messages go to the main loop through a queue (wake() wakes it),
    and the answer comes back here. A connection that closes, or says nothing for its lease, ends its sweep."""

    def __init__(self, path: Path, wake, clock=time.monotonic):
        self.path, self.wake, self.clock = path, wake, clock
        self.requests: queue.Queue = queue.Queue()
        self._open = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.is_socket():
            if _answers(path):  # another daemon's (one run by hand beside the service): never take it over
                raise OSError(errno.EADDRINUSE, "another gpuwarden listens there")
            path.unlink()  # a daemon before this one left it
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)  # born 0600: there is no moment at which another user could connect
        try:
            self.sock.bind(str(path))
        finally:
            os.umask(old)
        self.sock.listen(CONNECTIONS_MAX)
        self.sock.settimeout(0.5)
        self._thread = threading.Thread(target=self._accept, name="control", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(2.0)
        self.sock.close()
        try:
            self.path.unlink()
        except OSError:
            pass

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except (TimeoutError, socket.timeout):
                continue
            except OSError:
                return
            uid, pid = peer_of(conn)
            with self._lock:
                full = self._open >= CONNECTIONS_MAX
                if not full:
                    self._open += 1
            if full or uid not in (0, os.geteuid()):
                why = (f"{CONNECTIONS_MAX} connections are open already" if full
                       else "the control channel is root's (run tune as root)")
                with contextlib.suppress(OSError):
                    _send(conn, {"ok": False, "error": why}, timeout=0.5)  # the accept thread never waits long
                conn.close()
                if not full:
                    with self._lock:
                        self._open -= 1
                continue
            threading.Thread(target=self._serve, args=(conn, f"pid {pid}, uid {uid}"), daemon=True).start()

    def _serve(self, conn: socket.socket, peer: str) -> None:
        # Each line must be whole by an absolute deadline (HELLO_S from connecting for the first, then the lease
        # from the last answer): a peer trickling a byte at a time cannot hold a connection slot past it.
        owner = object()  # this connection's token: the lease it begins is its own
        lease_s, began, why = None, False, "its connection closed"
        buffer = bytearray()
        deadline = self.clock() + HELLO_S
        try:
            for _ in range(MESSAGES_MAX):
                line = _read_line(conn, buffer, deadline, self.clock)
                if line is None:
                    break  # closed: the sweep ended or died
                if len(line) > LINE_MAX or not line.endswith(b"\n"):
                    _send(conn, {"ok": False, "error": f"a message is one line of at most {LINE_MAX} bytes"})
                    break
                try:
                    message = json.loads(line)
                    if not isinstance(message, dict):
                        raise ValueError
                except (ValueError, RecursionError):
                    _send(conn, {"ok": False, "error": "a message is one JSON object"})
                    break
                answer = self._ask(message, peer, owner)
                if message.get("op") == "begin" and answer.get("ok"):
                    began, lease_s = True, float(message["lease_s"])
                _send(conn, answer)
                if message.get("op") == "end" and answer.get("ok"):
                    break
                if began:  # until a begin, HELLO_S from connecting stands: other messages do not extend it
                    deadline = self.clock() + lease_s
            else:
                _send(conn, {"ok": False, "error": f"more than {MESSAGES_MAX} messages on one connection"})
        except TimeoutError:
            if began:
                why = f"no word from it for the lease's {lease_s:g} s"  # a tune stopped or hung
        except OSError:
            pass  # went away, or did not take its answer
        finally:
            conn.close()
            # Always: a begin the main loop answered after this thread stopped waiting left a lease it owns.
            self._ask({"op": "end", "lost": why}, peer, owner)
            with self._lock:
                self._open -= 1

    def _ask(self, message: dict, peer: str, owner: object = None) -> dict:
        done = threading.Event()
        box: dict = {}
        self.requests.put((message, peer, owner, box, done))
        self.wake()
        if not done.wait(ANSWER_S):
            box["abandoned"] = True  # the main loop drops it unanswered (its connection is closing)
            return {"ok": False, "error": "the daemon did not answer in time"}
        return box["answer"]

    def serve(self, sweeps: Sweeps, health: Callable[[dict, str], dict] | None = None) -> None:
        """On the main loop: answer what was queued when it woke (at most SERVE_MAX), then back to the loop:
        connections that ask again at once must not keep it here. health: answers `gpuwarden health clear`'s
        {"op": "health_clear", ...} (watch/health_record.answer_clear): the daemon owns the record, so a repair
        is written by it, never behind its back."""
        for _ in range(min(self.requests.qsize(), SERVE_MAX)):
            try:
                message, peer, owner, box, done = self.requests.get_nowait()
            except queue.Empty:
                return
            try:
                if message.get("lost"):
                    box["answer"] = {"ok": True, "restored": sweeps.lost(owner, message["lost"])}
                elif box.get("abandoned"):
                    continue  # its connection gave up on it: a late begin would leave a lease nobody holds
                elif message.get("op") == HEALTH_CLEAR:
                    box["answer"] = health(message, peer) if health is not None else \
                        {"ok": False, "error": "this daemon keeps no health record"}
                else:
                    box["answer"] = sweeps.handle(message, peer, owner)
            except errors.GpuError as exc:
                box["answer"] = {"ok": False, "error": str(exc)}
            except Exception as exc:  # a bug must not leave a client waiting, nor end the loop
                log.error("control: %s: %s", type(exc).__name__, exc)
                box["answer"] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
            finally:
                done.set()
        if not self.requests.empty():
            self.wake()  # the rest at the next wake, after the loop's own work


def _read_line(conn: socket.socket, buffer: bytearray, deadline: float, clock) -> bytes | None:
    """The next line (with its newline) by `deadline`, else TimeoutError; None when the peer closed; a line
    longer than LINE_MAX comes back as it stands (longer than LINE_MAX) for the caller to refuse."""
    while True:
        end = buffer.find(b"\n")
        if end >= 0:
            line = bytes(buffer[:end + 1])
            del buffer[:end + 1]
            return line
        if len(buffer) > LINE_MAX:
            return bytes(buffer)
        left = deadline - clock()
        if left <= 0:
            raise TimeoutError
        conn.settimeout(left)
        chunk = conn.recv(65536)  # all a client sent at once: closing on unread bytes would reset the line we answer
        if not chunk:
            return bytes(buffer) or None  # a line cut short (no newline): the caller refuses it
        buffer += chunk


def _answers(path: Path) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(1.0)
        try:
            probe.connect(str(path))
            return True
        except OSError:
            return False


def _send(conn: socket.socket, answer: dict, timeout: float | None = None) -> None:
    """One answer line; OSError (TimeoutError) if the peer does not take it within timeout (SEND_S, read at the
    call): the caller closes the connection, since a line sent in part would garble the next."""
    conn.settimeout(SEND_S if timeout is None else timeout)
    try:
        conn.sendall(json.dumps(answer).encode() + b"\n")
    except TimeoutError:  # not the lease's silence: the peer stopped reading
        raise ConnectionError("the peer did not take its answer") from None


def open_control(wake: Callable[[], None] | None, apply: bool) -> ControlServer | None:
    """The control socket for `gpuwarden tune`, started, where the runtime directory is ours (and the tuning
    applies); without it there is no sweep, and everything else runs."""
    if wake is None or not apply:
        return None
    path = socket_path()
    try:
        server = ControlServer(path, wake)
    except OSError as exc:
        log.info("no control socket at %s (%s): `gpuwarden tune` cannot sweep this daemon", path,
                 exc.strerror or exc)
        return None
    server.start()
    return server
