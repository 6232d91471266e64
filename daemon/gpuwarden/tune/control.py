"""The root-only control channel: `gpuwarden tune` asks the running daemon to set each step of a sweep, under a
lease, and the daemon puts the configured setting back however the sweep ends.

Why the daemon sets it: it owns the GPUs, and would undo a change made behind its back as drift. So a sweep
holds a lease on a setting of some GPUs (`Sweeps`, on the main loop): while it runs, the tuning does not re-apply
those GPUs; at its end (the client says so, its connection closes, or no message came for the lease's seconds:
a tune that was stopped or hangs) the setting goes back to what the config wants, else to the value found before
gpuwarden changed it (tuning.Tuner.restore, from the originals). Each set goes through Tuner.apply, which
records the original on disk before the first change (originals.py); a marker file names the swept GPUs, so a
daemon killed mid-sweep restores them at its next start (`recover`).

The wire: a unix stream socket in the runtime directory, mode 0600 (created under umask 0177, so never wider),
and each peer's SO_PEERCRED uid checked (root, or the daemon's own user). One JSON object per line, one answer
line each: {"op": "begin", "setting": "power_limit_w" | "gpu_clocks", "gpus": [0, 1] | null, "lease_s": 15,
"force": false}, {"op": "set", "value": 450}, {"op": "renew"}, {"op": "end"}. Limits: LINE_MAX bytes a line,
MESSAGES_MAX lines a connection, CONNECTIONS_MAX connections at once, one lease at a time and only its own
connection may use it, each whole line within the lease (or HELLO_S before a begin), a set at most every SET_MIN_S,
and one wake of the main loop answers only what was queued when it woke (the loop's polls come first).
"""

from __future__ import annotations

import _thread
import contextlib
import errno
import json
import logging
import os
import queue
import socket
import struct
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..base import smallfile
from . import tunables
from ..gpu import errors
from .originals import boot_id
from ..base.statedir import state_dir
from ..base.systemd import NOTICE
from .tuning import Action, GpuPlan, Plan, TuningLife, make_plan
from ..base.yamlfile import ConfigErrors

log = logging.getLogger("gpuwarden")

SETTINGS = ("power_limit_w", "gpu_clocks")  # what a sweep may change
LINE_MAX = 4096
MESSAGES_MAX = 10_000
CONNECTIONS_MAX = 4
HELLO_S = 10.0  # a connection says begin within this
LEASE_MIN_S, LEASE_MAX_S = 1.0, 300.0
ANSWER_S = 60.0  # the most the main loop may take to answer one message (the setters and their read-back)
SEND_S = 5.0  # an answer line not taken within this: the peer is not reading, the connection is closed
SET_MIN_S = 0.5  # a lease's sets at most this often: a real sweep sets once a step, seconds apart; each set and
# its read-back costs the main loop ~25 ms a GPU, so a flood of them would starve the polls (and the watchdog)
SERVE_MAX = 8  # requests one wake of the main loop answers; the rest wait for the next wake
MARKER = "sweep.json"
MARKER_MAX = 4096  # a marker is a boot id, a setting and a few UUIDs


def socket_path(environ=os.environ) -> Path:
    """systemd's RuntimeDirectory= (the unit makes /run/gpuwarden, root's), else /run/gpuwarden."""
    return Path(environ.get("RUNTIME_DIRECTORY", "").split(":")[0] or "/run/gpuwarden") / "control.sock"


class ControlError(Exception):
    """One line for the user of `tune`: the daemon refused, or (ChannelLost) is gone."""


class Unreachable(ControlError):
    """No daemon to ask: no control socket, or it cannot be connected to (`tune` exits 69, or 77 for root's)."""


class ChannelLost(ControlError):
    """The connection failed or closed mid-sweep: the lease is gone with it."""


# -- the main loop's side: leases and restores ---------------------------------------------------------------

@dataclass
class Lease:
    setting: str
    gpus: list[int]
    lease_s: float
    deadline: float
    peer: str
    owner: object = None  # the connection that began it: only it may set, renew or end it, its loss ends it
    sets: int = 0
    last_set: float = float("-inf")
    last: dict = field(default_factory=dict)


class Sweeps:
    """The one sweep lease of a daemon, and what puts its setting back. Called on the main loop only."""

    def __init__(self, tuning: TuningLife, clock=time.monotonic, marker: Path | None = None):
        self.tuning, self.clock = tuning, clock
        self.marker = marker or state_dir() / MARKER
        self.lease: Lease | None = None

    def recover(self, handover: bool = False) -> None:
        """At start: a sweep the last daemon did not end (it was killed) has its GPUs put back now. Whatever the
        marker holds, the daemon starts: a bad one is one logged line."""
        try:
            data = _read_marker(self.marker)
            if data is None:
                return
            if data.get("boot_id") == boot_id():  # after a reboot the card is at its defaults again
                by_uuid = {g.uuid: g.index for g in self.tuning.backend.gpus()}
                gpus = [by_uuid[u] for u in data["gpus"] if u in by_uuid]
                log.log(NOTICE, "a sweep of %s on GPU %s did not end (%s): putting the setting back",
                        data["setting"], ", ".join(map(str, gpus)),
                        "the daemon handed over to the installed code mid-sweep; the sweep's lease ended with "
                        "its connection" if handover else "the daemon before this one was killed mid-sweep")
                self._put_back(data["setting"], gpus)
        except MarkerError as exc:
            log.warning("sweep marker %s ignored: %s", self.marker, exc)
        except Exception as exc:  # a bug or a GPU error here must not stop the daemon from starting
            log.error("sweep marker %s: putting its setting back failed: %s: %s", self.marker,
                      type(exc).__name__, exc)
        self._clear_marker()

    def handle(self, message: dict, peer: str, owner: object = None) -> dict:
        """One message from the connection `owner` (a token per connection)."""
        op = message.get("op")
        if op == "begin":
            return self._begin(message, peer, owner)
        if self.lease is None or self.lease.owner is not owner:  # never another connection's lease
            return {"ok": False, "error": "no sweep is running on this connection: send begin first"}
        self.lease.deadline = self.clock() + self.lease.lease_s  # every message renews
        if op == "renew":
            return {"ok": True}
        if op == "set":
            wait = self.lease.last_set + SET_MIN_S - self.clock()
            if wait > 0:
                return {"ok": False, "error": f"sets too fast: at most one every {SET_MIN_S:g} s (a sweep sets "
                        "once a step)"}
            return self._set(message.get("value"))
        if op == "end":
            return {"ok": True, "restored": self.end("the sweep ended")}
        return {"ok": False, "error": f"unknown op {op!r} (begin, set, renew, end)"}

    def lost(self, owner: object, why: str) -> list[str]:
        """The connection `owner` is gone: its lease (only its own) ends."""
        if self.lease is None or self.lease.owner is not owner:
            return []
        return self.end(why)

    def _begin(self, message: dict, peer: str, owner: object = None) -> dict:
        if self.lease is not None:
            return {"ok": False, "error": f"a sweep of {self.lease.setting} runs already ({self.lease.peer})"}
        if not self.tuning.config.tuning.apply:
            return {"ok": False, "error": "this daemon is read-only (tuning.apply: false): it sets nothing"}
        setting, lease_s, wanted = message.get("setting"), message.get("lease_s"), message.get("gpus")
        if setting not in SETTINGS:
            return {"ok": False, "error": f"setting {setting!r}: expected one of {', '.join(SETTINGS)}"}
        if not isinstance(lease_s, (int, float)) or isinstance(lease_s, bool) or not LEASE_MIN_S <= lease_s <= LEASE_MAX_S:
            return {"ok": False, "error": f"lease_s {lease_s!r}: expected {LEASE_MIN_S:g}-{LEASE_MAX_S:g} seconds"}
        indices = [g.index for g in self.tuning.backend.gpus()]
        if wanted is None:
            wanted = indices
        if not isinstance(wanted, list) or not wanted or \
                any(type(g) is not int or g not in indices for g in wanted):  # True == 1: no bools
            return {"ok": False, "error": f"gpus {wanted!r}: expected a list of GPU indices ({indices})"}
        if not message.get("force"):
            others = self._other_processes(wanted)
            if others:
                return {"ok": False, "error": f"other processes than the engine use the GPUs ({others}): their load "
                        "would skew every step (tune --force sweeps anyway)"}
        wanted = sorted(set(wanted))
        try:  # no marker, no sweep: a daemon killed mid-sweep would leave the swept setting on the GPUs for good
            self._write_marker(setting, wanted)
        except OSError as exc:
            log.error("sweep refused: its marker cannot be saved to %s: %s", self.marker, exc.strerror or exc)
            return {"ok": False, "error": f"the daemon cannot save the sweep's marker {self.marker} "
                    f"({exc.strerror or exc}): a crash mid-sweep would leave the setting swept, so no sweep"}
        self.lease = Lease(setting, wanted, float(lease_s), self.clock() + lease_s, peer, owner)
        self.tuning.held |= set(wanted)
        self.tuning.held_setting, self.tuning.held_step = setting, None
        log.log(NOTICE, "sweep of %s on GPU %s begins (%s, lease %g s): the configured setting comes back at its "
                "end", setting, ", ".join(map(str, wanted)), peer, lease_s)
        uuids = {str(g.index): g.uuid for g in self.tuning.backend.gpus() if g.index in wanted}
        return {"ok": True, "limits": self._limits(setting, wanted), "uuids": uuids}

    def _other_processes(self, gpus: list[int]) -> list[int]:
        """Compute processes on these GPUs that are not the daemon's descendants (its engine and workers)."""
        mine = os.getpid()
        return sorted({pid for gpu in self.tuning.backend.gpus() if gpu.index in gpus
                       for pid, _ in gpu.compute_processes() if not _descends_from(pid, mine)})

    def _limits(self, setting: str, gpus: list[int]) -> dict:
        """What each GPU accepts: the power-limit constraints (nvmlDeviceGetPowerManagementLimitConstraints) or
        the supported graphics clocks (nvmlDeviceGetSupportedGraphicsClocks)."""
        out = {}
        for gpu in self.tuning.backend.gpus():
            if gpu.index in gpus:
                caps = gpu.capabilities()
                out[str(gpu.index)] = ([caps.power_limit_min_w, caps.power_limit_max_w] if setting == "power_limit_w"
                                       else list(caps.graphics_clocks_mhz))
        return out

    def _set(self, value) -> dict:
        lease = self.lease
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 < value < 100_000:
            return {"ok": False, "error": f"value {value!r}: expected watts or MHz, a positive number"}
        actions = []
        for gpu in self.tuning.backend.gpus():
            if gpu.index not in lease.gpus:
                continue
            sample, caps = gpu.sample(), gpu.capabilities()
            if lease.setting == "power_limit_w":
                low, high = caps.power_limit_min_w, caps.power_limit_max_w
                if low is None or high is None:
                    return {"ok": False, "error": f"GPU {gpu.index} reports no power-limit constraints"}
                current, target = sample.power_limit_w, float(value)
            else:
                clocks = caps.graphics_clocks_mhz
                low, high = (min(clocks), max(clocks)) if clocks else (None, None)
                if low is None:
                    return {"ok": False, "error": f"GPU {gpu.index} reports no supported graphics clocks"}
                current, target = sample.sm_clock_mhz, (int(value), int(value))
            if not low <= value <= high:
                return {"ok": False, "error": f"GPU {gpu.index}: {value:g} is outside what it accepts ({low:g}-{high:g})"}
            actions.append(Action(gpu.index, gpu.uuid, lease.setting, current, target, True, "sweep"))
        plan = Plan(tuple(GpuPlan(a.gpu, a.uuid, "", (a,)) for a in actions))
        lease.last_set = self.clock()  # a set that reaches the GPUs counts for the rate; a refused value does not
        self.tuning.held_step = value  # the sweep's choice now (a GPU that failed to take it reads otherwise)
        failed = [o.describe() for o in self.tuning.tuner.apply(plan) if not o.ok]
        checks = self.tuning.tuner.verify(plan)  # read back, as the tuning verifies every set
        failed += [o.describe("verified") for o in checks if not o.ok]
        lease.sets += 1
        if failed:
            return {"ok": False, "error": "; ".join(failed)}
        return {"ok": True, "verified": [o.describe("verified") for o in checks]}

    def tick(self) -> None:
        if self.lease is not None and self.clock() > self.lease.deadline:
            log.warning("sweep of %s: no word from %s for %g s (the lease): putting the setting back",
                        self.lease.setting, self.lease.peer, self.lease.lease_s)
            self.end("the lease ran out")

    def end(self, why: str) -> list[str]:
        """The lease ends: the configured setting (or the original) back on its GPUs."""
        lease, self.lease = self.lease, None
        if lease is None:
            return []
        self.tuning.held -= set(lease.gpus)  # first: the config's value goes on these GPUs now
        self.tuning.held_step = None
        done = self._put_back(lease.setting, lease.gpus)
        self._clear_marker()
        log.log(NOTICE, "sweep of %s ended (%s, %d steps set): %s", lease.setting, why, lease.sets,
                "; ".join(done) or "nothing to put back")
        return done

    def _put_back(self, setting: str, gpus: list[int]) -> list[str]:
        """The configured value where the config sets one (straight from the step: never the original first,
        which would put the card at a third value for a moment); the original elsewhere."""
        tuner, show = self.tuning.tuner, tunables.BY_KEY[setting].show
        try:
            plan = make_plan(self.tuning.backend, self.tuning.config)
        except ConfigErrors as exc:
            plan, done = Plan(()), [f"the configured tuning no longer fits: {exc.errors[0]}"]
        else:
            done = []
        configured = {a.gpu for a in plan.actions if a.setting == setting and a.target is not None} \
            if self.tuning.config.tuning.apply else set()
        done += [f"GPU {o.action.gpu} {setting}: "
                 f"{'unlocked' if o.action.target is None else show(o.action.target, False)} as before gpuwarden: "
                 f"{'ok' if o.ok else 'FAILED, ' + o.message}"
                 for o in tuner.restore(only={(g, setting) for g in gpus if g not in configured})]
        mine = tuple(GpuPlan(g.index, g.uuid, g.name, tuple(a for a in g.actions if a.setting == setting))
                     for g in plan.gpus if g.index in gpus and g.index in configured)
        if mine:
            mine_plan = Plan(mine)
            done += [o.describe() for o in tuner.apply(mine_plan) if o.action.change]
            done += [o.describe("verified") for o in tuner.verify(mine_plan)]
        return done

    def _write_marker(self, setting: str, gpus: list[int]) -> None:
        """The marker, on disk for good (file and folder fsynced) before the first set; OSError if not."""
        by_index = {g.index: g.uuid for g in self.tuning.backend.gpus()}
        self.marker.parent.mkdir(parents=True, exist_ok=True)
        smallfile.write_atomic(self.marker, json.dumps({"boot_id": boot_id(), "setting": setting,
                                                        "gpus": [by_index[i] for i in gpus]}).encode(),
                               durable=True)

    def _clear_marker(self) -> None:
        try:
            self.marker.unlink()
        except OSError:
            pass


class MarkerError(Exception):
    """The marker is not one this daemon wrote."""


def _read_marker(path: Path) -> dict | None:
    """The marker's content, checked; None when there is none. Read through smallfile (no link, no FIFO's
    wait, a regular file only, at most MARKER_MAX bytes)."""
    try:
        raw = smallfile.read(path, MARKER_MAX)
    except smallfile.Unreadable as exc:
        raise MarkerError(str(exc)) from None
    if raw is None:
        return None
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError):
        raise MarkerError("not JSON") from None
    if not (isinstance(data, dict) and data.get("setting") in SETTINGS and isinstance(data.get("boot_id"), str)
            and isinstance(data.get("gpus"), list) and all(isinstance(u, str) for u in data["gpus"])):
        raise MarkerError('expected {"boot_id": "...", "setting": "power_limit_w" | "gpu_clocks", "gpus": '
                          '["GPU-uuid", ...]}')
    return data


def _descends_from(pid: int, root: int) -> bool:
    for _ in range(64):  # a process tree deeper than this is not an engine's
        if pid == root:
            return True
        if pid <= 1:
            return False
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            pid = int(stat.rsplit(")", 1)[1].split()[1])  # the field after the state: ppid
        except (OSError, ValueError, IndexError):
            return False
    return False


# -- the socket: threads that read and answer, the main loop that decides ------------------------------------

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
            uid, pid = _peer(conn)
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

    def serve(self, sweeps: Sweeps) -> None:
        """On the main loop: answer what was queued when it woke (at most SERVE_MAX), then back to the loop:
        connections that ask again at once must not keep it here."""
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


def _peer(conn: socket.socket) -> tuple[int, int]:
    """(uid, pid) of the process at the other end, from the kernel (SO_PEERCRED: struct ucred)."""
    pid, uid, _ = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    return uid, pid


def _send(conn: socket.socket, answer: dict, timeout: float = SEND_S) -> None:
    """One answer line; OSError (TimeoutError) if the peer does not take it within timeout: the caller closes the
    connection, since a line sent in part would garble the next."""
    conn.settimeout(timeout)
    try:
        conn.sendall(json.dumps(answer).encode() + b"\n")
    except TimeoutError:  # not the lease's silence: the peer stopped reading
        raise ConnectionError("the peer did not take its answer") from None


# -- the client: `gpuwarden tune` ----------------------------------------------------------------------------

class SweepClient:
    """A sweep's lease, renewed by a thread every third of it while the steps run."""

    def __init__(self, path: Path, setting: str, gpus: list[int] | None, lease_s: float, force: bool):
        try:
            self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self.sock.settimeout(ANSWER_S + 5)
            self.sock.connect(str(path))
        except FileNotFoundError:
            raise Unreachable(f"no control socket at {path}: is the daemon running (`systemctl status gpuwarden`)?")\
                from None
        except PermissionError:
            raise Unreachable(f"{path}: permission denied: the control channel is root's (run tune as root)") from None
        except OSError as exc:
            raise Unreachable(f"cannot connect to {path}: {exc.strerror or exc}") from None
        self.reader = self.sock.makefile("rb")
        self.daemon_pid = _peer(self.sock)[1]  # the kernel's word on who listens: the pid --apply reloads
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.lost: str | None = None  # why the lease was lost mid-sweep (the daemon stopped or died)
        self._last_set = float("-inf")
        began = self.ask({"op": "begin", "setting": setting, "gpus": gpus, "lease_s": lease_s, "force": force})
        self.limits, self.uuids = began["limits"], began.get("uuids", {})
        self._renewer = threading.Thread(target=self._renew, args=(lease_s / 3,), daemon=True)
        self._renewer.start()

    def ask(self, message: dict) -> dict:
        with self._lock:
            try:
                self.sock.sendall(json.dumps(message).encode() + b"\n")
                line = self.reader.readline(1 << 20)
            except OSError as exc:
                raise ChannelLost(f"the daemon's control channel failed: {exc.strerror or exc}") from None
        if not line:
            raise ChannelLost("the daemon closed the control channel (did it stop?)")
        answer = json.loads(line)
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
                    _thread.interrupt_main()  # the sweep ends as on Ctrl-C
                return

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
