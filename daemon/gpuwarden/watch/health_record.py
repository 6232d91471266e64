"""The daemon's record of GPU faults that asked for a reboot, in the state directory (health.json): the count per
(GPU UUID, fault) that survives daemon restarts and reboots, so that the health model can escalate from "reboot"
to "inspect the hardware" after N reboots for the same fault on the same GPU (config.health.reboots_before_inspect).

Keyed by UUID, never by index: a GPU that falls off the bus may come back under another index, or not be listed
at all until the reboot. A count goes up once per boot (/proc/sys/kernel/random/boot_id) in which the fault asked
for a reboot: a fault that flaps, or a daemon restarted within one boot, counts once.

The file is read through smallfile (no link followed, no FIFO waited on, a regular file only, FILE_MAX bytes) and
only when the daemon's own user owns it and nobody else may write it; its shape is checked value by value.
Anything else (garbage, a huge file, a forged entry) is one logged line and an empty record: the daemon starts,
and its next save replaces the file. Everything kept is bounded (GPUS_MAX, FAULTS_MAX, HISTORY_MAX, STRING_MAX),
the oldest dropped first, so a full record always fits FILE_MAX. Strings are kept as printable ASCII, so what
`gpuwarden health` prints from the file can move no terminal.
"""

from __future__ import annotations

import errno
import json
import logging
import math
import os
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from ..base import smallfile
from ..base.systemd import NOTICE
from ..tune.originals import boot_id as kernel_boot_id

log = logging.getLogger("gpuwarden")

NAME = "health.json"
FILE_MAX = 1024 * 1024  # a full record of the worst strings the bounds below allow is ~660 KiB
GPUS_MAX = 64  # GPUs remembered; past it the one whose last fault is oldest goes
FAULTS_MAX = 8  # faults remembered per GPU; past it the oldest goes
HISTORY_MAX = 256  # history entries; past it the oldest goes
STRING_MAX = 96  # a UUID, a fault key, a user name: longer ones are cut
COUNT_MAX = 1_000_000  # a count stops here (one a boot: never reached by a real host)
TIME_MAX = 1e12  # seconds since 1970 (year 33658): a later time is no clock's, and time.localtime() refuses it
EVENTS = ("reboot required", "cleared")


class RecordError(Exception):
    """The file is not a record this daemon wrote; str() says why, in one line."""


def clean(text: object) -> str:
    """text as kept: at most STRING_MAX characters of printable ASCII (anything else becomes "?")."""
    return "".join(c if " " <= c <= "~" else "?" for c in str(text)[:STRING_MAX])


class HealthRecord:
    """{uuid: {fault: {"count", "boot", "first", "last"}}} and a history, in memory; save() writes them."""

    def __init__(self, path: Path, boot_id: Callable[[], str] = kernel_boot_id):
        self.path, self.boot_id = Path(path), boot_id
        self.gpus: dict[str, dict[str, dict]] = {}
        self.entries: list[dict] = []
        self.problem: str | None = None  # why the file on disk was not taken, for `gpuwarden health` to say
        self.save_error: str | None = None  # why the last save failed (None: it did not)

    @classmethod
    def load(cls, path: Path | str, boot_id: Callable[[], str] = kernel_boot_id,
             owner: int | None = None, quiet: bool = False) -> HealthRecord:
        """The record at path: empty when there is none, and empty with one logged line (and .problem) when the
        file is not one to trust. owner: the uid that must own it (default: this process's, the daemon's).
        quiet: .problem only, no line (a command that prints it in its own words)."""
        record = cls(Path(path), boot_id)
        try:
            data = _read(record.path, os.geteuid() if owner is None else owner)
            if data is not None:
                record.gpus, record.entries = _parse(data)
        except RecordError as exc:
            record.problem = str(exc)
            if not quiet:
                log.warning("health record %s ignored, starting empty: %s", record.path, exc)
        return record

    def reboot_required(self, uuid: str, fault: str, now: float) -> int:
        """The fault on this GPU asks for a reboot: counted once per boot. The count, this boot included."""
        uuid, fault, boot, now = clean(uuid), clean(fault), clean(self.boot_id()), _when(now)
        faults = self.gpus.setdefault(uuid, {})
        entry = faults.setdefault(fault, {"count": 0, "boot": "", "first": now, "last": now})
        entry["last"] = now
        if entry["boot"] != boot:  # the first time in this boot; a flapping fault or a restart within it: not again
            entry["boot"], entry["count"] = boot, min(entry["count"] + 1, COUNT_MAX)
            self._note({"time": now, "uuid": uuid, "event": "reboot required", "fault": fault,
                        "count": entry["count"]})
        self._bound(uuid)
        return entry["count"]

    def count(self, uuid: str, fault: str) -> int:
        return self.gpus.get(clean(uuid), {}).get(clean(fault), {}).get("count", 0)

    def counts(self, uuid: str) -> dict[str, int]:
        """{fault: count} of one GPU (the faults a clear left at 0 left out)."""
        return {fault: e["count"] for fault, e in self.gpus.get(clean(uuid), {}).items() if e["count"]}

    def clear(self, uuid: str, who: str, now: float) -> None:
        """A person repaired the GPU: its counts go, and the history says who cleared them and what they were.
        A fault already counted in this boot stays known at 0: one fault is one record, and a GPU cleared while
        it is still off the bus is not counted again by the next poll, only at the next boot it is still lost in."""
        uuid, now, boot = clean(uuid), _when(now), clean(self.boot_id())
        was = self.counts(uuid)
        counted = {fault: {**e, "count": 0} for fault, e in self.gpus.pop(uuid, {}).items() if e["boot"] == boot}
        if counted:
            self.gpus[uuid] = counted
        self._note({"time": now, "uuid": uuid, "event": "cleared", "who": clean(who), "counts": was})

    def history(self, uuid: str | None = None) -> list[dict]:
        """The entries, oldest first (copies), of one GPU or of all."""
        wanted = None if uuid is None else clean(uuid)
        return [dict(e) for e in self.entries if wanted is None or e["uuid"] == wanted]

    def save(self) -> None:
        """Write the record (atomically, 0600, fsynced: a count must survive the reboot it asks for). A failure
        is one logged line and .save_error, never an exception: the counts stay in memory for the next save."""
        data = json.dumps({"version": 1, "gpus": self.gpus, "history": self.entries}, sort_keys=True).encode()
        try:
            smallfile.write_atomic(self.path, data, durable=True)
        except OSError as exc:
            self.save_error = exc.strerror or str(exc)
            log.warning("health record %s not written: %s", self.path, self.save_error)
            return
        self.save_error = None

    def _note(self, entry: dict) -> None:
        self.entries.append(entry)
        del self.entries[:-HISTORY_MAX]

    def _bound(self, uuid: str) -> None:
        faults = self.gpus[uuid]
        while len(faults) > FAULTS_MAX:
            del faults[min(faults, key=lambda f: faults[f]["last"])]
        while len(self.gpus) > GPUS_MAX:
            del self.gpus[min(self.gpus, key=lambda u: max((e["last"] for e in self.gpus[u].values()),
                                                             default=-math.inf))]


def _when(now: float) -> float:
    """A clock's reading as kept: a time the file's check would refuse (NaN, negative) is 0, not a poisoned file."""
    return float(now) if isinstance(now, (int, float)) and 0 <= now <= TIME_MAX else 0.0


def _read(path: Path, owner: int) -> dict | None:
    def trusted(st: os.stat_result) -> None:
        if st.st_uid != owner:
            raise RecordError(f"owned by uid {st.st_uid}, not {owner}: a record someone else wrote is not ours")
        if st.st_mode & 0o022:
            raise RecordError(f"mode {st.st_mode & 0o777:04o} lets others write it")

    try:
        raw = smallfile.read(path, FILE_MAX, check=trusted)
    except smallfile.Unreadable as exc:
        if exc.errno == errno.EACCES:
            raise RecordError("permission denied: the record is root's (run as root to read it)") from None
        raise RecordError(f"{'a symbolic link' if exc.errno == errno.ELOOP else exc}: not read") from None
    if raw is None:
        return None
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError):
        raise RecordError("not JSON") from None
    if not isinstance(data, dict):
        raise RecordError("not a JSON object")
    return data


def _parse(data: dict) -> tuple[dict, list]:
    """(gpus, history) from the file's JSON, every value checked; RecordError at the first that is wrong."""
    gpus, history = data.get("gpus"), data.get("history")
    if data.get("version") != 1 or not isinstance(gpus, dict) or not isinstance(history, list):
        raise RecordError('expected {"version": 1, "gpus": {...}, "history": [...]}')
    if len(gpus) > GPUS_MAX or len(history) > HISTORY_MAX:
        raise RecordError(f"more than {GPUS_MAX} GPUs or {HISTORY_MAX} history entries")
    kept = {}
    for uuid, faults in gpus.items():
        _string(uuid, "a GPU's UUID")
        if not isinstance(faults, dict) or len(faults) > FAULTS_MAX:
            raise RecordError(f"GPU {uuid}: expected at most {FAULTS_MAX} faults")
        kept[uuid] = {}
        for fault, e in faults.items():
            _string(fault, "a fault")
            if not isinstance(e, dict) or set(e) != {"count", "boot", "first", "last"}:
                raise RecordError(f"GPU {uuid} fault {fault}: expected count, boot, first, last")
            kept[uuid][fault] = {"count": _count(e["count"]), "boot": _string(e["boot"], "a boot id"),
                                 "first": _time(e["first"]), "last": _time(e["last"])}
    return kept, [_entry(e) for e in history]


def _entry(e: object) -> dict:
    if not isinstance(e, dict) or e.get("event") not in EVENTS:
        raise RecordError(f"a history entry: expected an event of {', '.join(EVENTS)}")
    entry = {"time": _time(e.get("time")), "uuid": _string(e.get("uuid"), "a UUID"), "event": e["event"]}
    if e["event"] == "reboot required":
        entry.update(fault=_string(e.get("fault"), "a fault"), count=_count(e.get("count")))
    else:
        counts = e.get("counts")
        if not isinstance(counts, dict) or len(counts) > FAULTS_MAX:
            raise RecordError(f"a clear's counts: expected at most {FAULTS_MAX}")
        entry.update(who=_string(e.get("who"), "who cleared"),
                     counts={_string(f, "a fault"): _count(n) for f, n in counts.items()})
    return entry


def _string(value: object, what: str) -> str:
    if not isinstance(value, str) or clean(value) != value:
        raise RecordError(f"{what} is not printable text of at most {STRING_MAX} characters")
    return value


def _count(value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= COUNT_MAX:
        raise RecordError(f"a count is not a whole number of 0-{COUNT_MAX}")
    return value


def _time(value: object) -> float:
    # compared, never converted first: float() of a 400-digit int raises OverflowError (NaN fails both compares)
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 <= value <= TIME_MAX:
        raise RecordError(f"a time is not a finite number of seconds of 0-{TIME_MAX:g}")
    return float(value)


# -- `gpuwarden health clear`'s request, answered on the daemon's loop (service/control.py) --------------------

WHO_MAX = 64  # the name the client gives; the kernel's uid and pid of the peer are added to it


def record_reboots(record: HealthRecord, verdicts: Iterable, now: float) -> None:
    """Each fault a GPU's verdict says asks for a reboot (Verdict.reboot_faults), counted by the record once per boot;
    saved only when a count moved (every poll asks; almost always nothing is new)."""
    moved = False
    for verdict in verdicts:
        for fault in verdict.reboot_faults:
            before = record.count(verdict.uuid, fault)
            moved |= record.reboot_required(verdict.uuid, fault, now) != before
    if moved:
        record.save()


def clear_handler(record: HealthRecord, uuids: Callable[[], dict[int, str]],
                  clock: Callable[[], float] = time.time) -> Callable[[dict, str], dict]:
    """The control socket's answer to a clear (ControlServer.serve's health=), over the GPUs uuids() lists now."""
    return lambda message, peer: answer_clear(record, message, peer, uuids(), clock())


def answer_clear(record: HealthRecord, message: dict, peer: str, uuids: dict[int, str], now: float) -> dict:
    """{"op": "health_clear", "gpu": "0" | "GPU-uuid", "who": "alice"} from `peer` ("pid N, uid U", from
    SO_PEERCRED): that GPU's counts reset, the record saved, one journal line saying who. uuids: the GPUs the
    daemon sees now, {index: UUID}; a UUID it does not see (a GPU off the bus) is cleared when the record knows
    it."""
    gpu, who = message.get("gpu"), message.get("who")
    if not isinstance(gpu, str) or not gpu or clean(gpu) != gpu:
        return {"ok": False, "error": f"gpu: expected an index or a UUID of at most {STRING_MAX} characters"}
    if not isinstance(who, str) or not who or len(who) > WHO_MAX:
        return {"ok": False, "error": f"who: expected the name of who ran it, at most {WHO_MAX} characters"}
    if gpu.isdigit():
        if int(gpu) not in uuids:
            return {"ok": False, "error": f"no GPU {gpu} here now: name it by its UUID (`gpuwarden health` "
                                          "lists the UUIDs the record knows)"}
        uuid = uuids[int(gpu)]
    elif gpu in uuids.values() or gpu in record.gpus or record.history(gpu):
        uuid = gpu
    else:
        return {"ok": False, "error": f"{gpu}: no such GPU here, and none the record knows"}
    index = next((i for i, u in uuids.items() if u == uuid), None)
    was = record.counts(uuid)
    by = f"{clean(who)} ({peer})"
    record.clear(uuid, by, now)
    record.save()
    counts = ", ".join(f"{fault} x{n}" for fault, n in sorted(was.items())) or "none"
    log.log(NOTICE, "health: GPU %s (%s) cleared by %s: a repair recorded; its reboot counts (%s) reset",
            "?" if index is None else index, uuid, by, counts)
    answer = {"ok": True, "uuid": uuid, "index": index, "cleared": was, "who": clean(by)}
    if record.save_error is not None:
        answer["warning"] = f"cleared in the running daemon, but {record.path} was not written: {record.save_error}"
    return answer
