"""A sweep's lease on a setting of some GPUs, and what puts the setting back: the daemon's side of `gpuwarden
tune` (the wire: channel.py; the socket: service/control.py).

Why the daemon sets it: it owns the GPUs, and would undo a change made behind its back as drift. So a sweep
holds a lease on a setting of some GPUs (`Sweeps`, on the main loop): while it runs, the tuning does not re-apply
those GPUs; at its end (the client says so, its connection closes, or no message came for the lease's seconds:
a tune that was stopped or hangs) the setting goes back to what the config wants, else to the value found before
gpuwarden changed it (tuning.Tuner.restore, from the originals). Each set goes through Tuner.apply, which
records the original on disk before the first change (originals.py); a marker file names the swept GPUs, so a
daemon killed mid-sweep restores them at its next start (`recover`). serve.idle's clocks holds the same lease
while the engine rests (idleclocks.py, `take` and `end`).
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..base import smallfile
from ..gpu import errors
from . import tunables
from .channel import LEASE_MAX_S, LEASE_MIN_S, SET_MIN_S, SETTINGS
from .originals import boot_id
from ..base.statedir import state_dir
from ..base.systemd import NOTICE
from .tuning import Action, GpuPlan, Plan, TuningLife, make_plan
from ..base.yamlfile import ConfigErrors

log = logging.getLogger("gpuwarden")

MARKER = "sweep.json"
MARKER_MAX = 4096  # a marker is a boot id, a setting and a few UUIDs


@dataclass
class Lease:
    setting: str
    gpus: list[int]
    lease_s: float
    deadline: float
    peer: str
    owner: object = None  # the connection that began it: only it may set, renew or end it, its loss ends it
    kind: str = "sweep"  # or "rest": serve.idle's clocks (idleclocks.py)
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
                if data.get("kind") == "rest":
                    log.log(NOTICE, "the engine's rest (serve.idle's clocks) held %s on GPU %s (%s): putting the "
                            "setting back", data["setting"], ", ".join(map(str, gpus)),
                            "the daemon handed over to the installed code during it" if handover
                            else "the daemon before this one was killed during it")
                else:
                    log.log(NOTICE, "a sweep of %s on GPU %s did not end (%s): putting the setting back",
                            data["setting"], ", ".join(map(str, gpus)),
                            "the daemon handed over to the installed code mid-sweep; the sweep's lease ended with "
                            "its connection" if handover else "the daemon before this one was killed mid-sweep")
                self._put_back(data["setting"], gpus, originals=data.get("kind") == "rest")
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
        if self.lease is not None and self.lease.kind == "rest":  # an engine resting its clocks: a sweep ends it
            self.end(f"a tune sweep begins ({peer})")
        if self.lease is not None:
            return {"ok": False, "error": f"a sweep of {self.lease.setting} runs already ({self.lease.peer})"}
        if not self.tuning.config.tuning.apply:
            return {"ok": False, "error": "this daemon is read-only (tuning.apply: false): it sets nothing"}
        setting, lease_s, wanted = message.get("setting"), message.get("lease_s"), message.get("gpus")
        if setting not in SETTINGS:
            return {"ok": False, "error": f"setting {setting!r}: expected one of {', '.join(SETTINGS)}"}
        if not isinstance(lease_s, (int, float)) or isinstance(lease_s, bool) or \
                not LEASE_MIN_S <= lease_s <= LEASE_MAX_S:
            return {"ok": False, "error": f"lease_s {lease_s!r}: expected {LEASE_MIN_S:g}-{LEASE_MAX_S:g} seconds"}
        indices = [g.index for g in self.tuning.backend.gpus()]
        if wanted is None:
            wanted = indices
        if not isinstance(wanted, list) or not wanted or \
                any(type(g) is not int or g not in indices for g in wanted):  # True == 1: no bools
            return {"ok": False, "error": f"gpus {wanted!r}: expected a list of GPU indices ({indices})"}
        if not message.get("force"):
            others = self.other_processes(wanted)
            if others:
                return {"ok": False, "error": f"other processes than the engine use the GPUs ({others}): their load "
                        "would skew every step (tune --force sweeps anyway)"}
        wanted = sorted(set(wanted))
        try:  # no marker, no sweep: a daemon killed mid-sweep would leave the swept setting on the GPUs for good
            self.take(Lease(setting, wanted, float(lease_s), self.clock() + lease_s, peer, owner))
        except OSError as exc:
            log.error("sweep refused: its marker cannot be saved to %s: %s", self.marker, exc.strerror or exc)
            return {"ok": False, "error": f"the daemon cannot save the sweep's marker {self.marker} "
                    f"({exc.strerror or exc}): a crash mid-sweep would leave the setting swept, so no sweep"}
        log.log(NOTICE, "sweep of %s on GPU %s begins (%s, lease %g s): the configured setting comes back at its "
                "end", setting, ", ".join(map(str, wanted)), peer, lease_s)
        uuids = {str(g.index): g.uuid for g in self.tuning.backend.gpus() if g.index in wanted}
        return {"ok": True, "limits": self._limits(setting, wanted), "uuids": uuids}

    def take(self, lease: Lease) -> None:
        """The one lease begins (none holds it): its marker on disk first (OSError when it cannot be, and nothing
        is taken), then the tuning leaves its setting on its GPUs alone until it ends."""
        self._write_marker(lease.setting, lease.gpus, lease.kind)
        self.lease = lease
        self.tuning.held |= set(lease.gpus)
        self.tuning.held_setting, self.tuning.held_step = lease.setting, None

    def _budget_ceiling(self, setting: str, gpus: list[int]) -> float | None:
        """With tuning.power_budget_w, the highest power limit the budget leaves each swept GPU (the others at
        their minimums): tune's steps stop there. None without a budget, or for clocks."""
        budget = self.tuning.budget
        if budget is None or setting != "power_limit_w":
            return None
        backend = self.tuning.backend.gpus()
        return budget.sweep_ceiling(gpus, backend, {g.index: g.sample() for g in backend})

    def other_processes(self, gpus: list[int], engine: tuple[int, ...] = ()) -> list[int]:
        """Compute processes on these GPUs that are neither the daemon's descendants nor those of engine (the pids of
        the engine's processes it supervises: one adopted after a daemon's restart is init's child, not ours)."""
        roots = (os.getpid(), *engine)
        return sorted({pid for gpu in self.tuning.backend.gpus() if gpu.index in gpus
                       for pid, _ in gpu.compute_processes() if not any(_descends_from(pid, r) for r in roots)})

    def _limits(self, setting: str, gpus: list[int]) -> dict:
        """What each GPU accepts: the power-limit constraints (nvmlDeviceGetPowerManagementLimitConstraints) or
        the supported graphics clocks (nvmlDeviceGetSupportedGraphicsClocks)."""
        out = {}
        ceiling = self._budget_ceiling(setting, gpus)
        for gpu in self.tuning.backend.gpus():
            if gpu.index in gpus:
                caps = gpu.capabilities()
                high = caps.power_limit_max_w
                if ceiling is not None and high is not None and caps.power_limit_min_w is not None:
                    high = max(caps.power_limit_min_w, min(high, ceiling))  # the budget's room, never below min
                out[str(gpu.index)] = ([caps.power_limit_min_w, high] if setting == "power_limit_w"
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
                return {"ok": False,
                        "error": f"GPU {gpu.index}: {value:g} is outside what it accepts ({low:g}-{high:g})"}
            actions.append(Action(gpu.index, gpu.uuid, lease.setting, current, target, True, "sweep"))
        if lease.setting == "power_limit_w" and self.tuning.budget is not None:
            # tuning.power_budget_w: the other GPUs go down first (read back), so the step never takes the sum of
            # the enforced limits past the budget. A step with no room is refused, not clamped: tune records its
            # figures against the value it asked for, and a clamped step would put a limit never measured into
            # its table and knee. Its steps stop at the budget's room (_limits), so a refusal means the room
            # shrank mid-sweep (a GPU added, a card that would not go down): tune ends with this one line.
            gpus = self.tuning.backend.gpus()
            refused = self.tuning.budget.make_room({i: float(value) for i in lease.gpus}, gpus,
                                                   {g.index: g.sample() for g in gpus})
            if refused is not None:
                log.warning("sweep step refused: %s", refused)
                return {"ok": False, "error": f"power budget: {refused}"}
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
        # a rest puts back what the tuning planned before it: a plan made now would judge gpu_clocks: auto on a card
        # the rest holds low (it idles low under load, and locks it at its max)
        done = self._put_back(lease.setting, lease.gpus, planned=self.tuning.plan if lease.kind == "rest" else None)
        self._clear_marker()
        if lease.kind == "rest":
            log.info("%s back on GPU %s (%s): %s", lease.setting, ", ".join(map(str, lease.gpus)), why,
                     "; ".join(done) or "nothing to put back")
        else:
            log.log(NOTICE, "sweep of %s ended (%s, %d steps set): %s", lease.setting, why, lease.sets,
                    "; ".join(done) or "nothing to put back")
        return done

    def _put_back(self, setting: str, gpus: list[int], planned: Plan | None = None,
                  originals: bool = False) -> list[str]:
        """The configured value where the config sets one (straight from the step: never the original first,
        which would put the card at a third value for a moment); the original elsewhere. Under a power budget a
        swept power limit is the budget's: it moves the card at the next poll (the card's original limit, often
        its maximum, would take the sum past the budget). planned: the configured values from this plan, not one
        made now; originals: the originals alone (a rest's at a start: the start's tuning then applies its plan,
        made on the cards as they were)."""
        tuner, show = self.tuning.tuner, tunables.BY_KEY[setting].show
        if originals:
            outcomes = tuner.restore(only={(g, setting) for g in gpus})
            done = [f"GPU {o.action.gpu} {setting}: as before gpuwarden: {'ok' if o.ok else 'FAILED, ' + o.message}"
                    for o in outcomes]
            for gpu in self.tuning.backend.gpus():  # killed between the lock and the save of its original: undone
                if gpu.index in gpus and gpu.index not in {o.action.gpu for o in outcomes}:
                    try:
                        tunables.BY_KEY[setting].set(gpu, None)
                        done.append(f"GPU {gpu.index} {setting}: unlocked (no original on record)")
                    except errors.GpuError as exc:
                        done.append(f"GPU {gpu.index} {setting}: unlocking FAILED, {exc}")
            return done
        budget = self.tuning.budget
        if setting == "power_limit_w" and budget is not None and self.tuning.config.tuning.apply:
            budget.wake()
            return [f"GPU {g} {setting}: left to the power budget ({budget.budget_w:g} W), which sets it at the "
                    "next poll" for g in gpus]
        try:
            plan, done = planned or make_plan(self.tuning.backend, self.tuning.config), []
        except ConfigErrors as exc:
            plan, done = Plan(()), [f"the configured tuning no longer fits: {exc.errors[0]}"]
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

    def _write_marker(self, setting: str, gpus: list[int], kind: str = "sweep") -> None:
        """The marker, on disk for good (file and folder fsynced) before the first set; OSError if not."""
        by_index = {g.index: g.uuid for g in self.tuning.backend.gpus()}
        self.marker.parent.mkdir(parents=True, exist_ok=True)
        smallfile.write_atomic(self.marker, json.dumps({"boot_id": boot_id(), "setting": setting, "kind": kind,
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
