"""One health verdict per GPU and one for the host: can it serve now, and what must happen to it.

A verdict is a state (healthy; degraded: serving, but act soon; unhealthy: must not serve), its reasons, and the
one action it requires, the most severe of its findings': none, restart the engine, reset the GPU, reboot, or
inspect the hardware. The host takes the worst of its GPUs. Pure: the monitor hands in what it read (the sample,
the events book's entries, the reboot count) and logs the changes; nothing here reads a device or a file.

The mappings follow NVIDIA's own words: the Xid catalog's resolution buckets (RESTART_APP, RESET_GPU, RESTART_BM:
watch/xids.py keeps the table) and NVML's nvmlDeviceGpuRecoveryAction_t (gpu/events.RECOVERY_ACTIONS).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from ..gpu.base import GpuSample
from ..gpu.events import RECOVERY_ACTIONS
from . import xids

HEALTHY, DEGRADED, UNHEALTHY = "healthy", "degraded", "unhealthy"
STATES = (HEALTHY, DEGRADED, UNHEALTHY)  # by severity
# By severity: a GPU with several findings needs the most severe one's action (a reboot also resets the GPU and
# restarts the engine). The keys are metric label values (gpuwarden_gpu_action_required{action}).
NONE, RESTART_ENGINE, RESET_GPU, REBOOT, INSPECT = "none", "restart_engine", "reset_gpu", "reboot", "inspect"
ACTIONS = (NONE, RESTART_ENGINE, RESET_GPU, REBOOT, INSPECT)
ACTION_TEXT = {NONE: "none", RESTART_ENGINE: "restart the engine", RESET_GPU: "reset the GPU",
               REBOOT: "reboot", INSPECT: "inspect the hardware"}

# NVML's nvmlDeviceGpuRecoveryAction_t (nvml.h; cuda.bindings.nvml.DeviceGpuRecoveryAction documents each value),
# read from NVML_FI_DEV_GET_GPU_RECOVERY_ACTION: code -> (state, action). 0 NONE asks for nothing.
RECOVERY = {
    1: (UNHEALTHY, RESET_GPU),  # GPU_RESET: "Reset Gpu"
    2: (UNHEALTHY, REBOOT),  # NODE_REBOOT: "Reboot Node"
    # DRAIN_P2P: the GPU's peer-to-peer traffic must stop; stopping the engine that uses the peers drains it, and
    # it may start again afterwards
    3: (UNHEALTHY, RESTART_ENGINE),
    4: (UNHEALTHY, RESET_GPU),  # DRAIN_AND_RESET: "Drain P2P and Reset Gpu" (the stop drains it)
    5: (UNHEALTHY, REBOOT),  # RECOVER_IMEX_DOMAIN: a multi-node NVLink domain; this host's share of it is a reboot
    6: (UNHEALTHY, RESET_GPU),  # BUS_RESET: "Reset the GPU's PCIe bus"
    7: (UNHEALTHY, REBOOT),  # SYSTEM_REBOOT: "Reboot the system"
}
# An event (eventwatch.EventBook.needs_reset) that asked for one of these, as its reason ends (xids.HOLDS and the
# recovery actions' texts): an Xid's own verdict (xid_verdict); else a reboot where it says so, an inspection
# where it says so, else a reset.
EVENT_REBOOT = re.compile(r"\breboot\b")
EVENT_FROM_FIELD = "the driver set a recovery action"  # the event of the field polled too: said once
# One fault, one key, whichever input saw it: the reboot record (watch/health_record.py) counts a fault once per boot
# by its key, so an event and the polled reading of the same fault are one fault (Xid 79 and the GPU lost from the
# bus were two reboot faults for one fall off the bus). The keys the events' reasons would give -> the fault's key.
SAME_FAULT = {"xid79": "gpu_lost", "GPU_unavailable": "gpu_lost",
              "the_driver_set_a_recovery_action": "recovery_action",
              "xid48": "ecc_uncorrected", "double-bit_ECC_error": "ecc_uncorrected",
              "xid63": "remap_pending", "xid64": "remap_failure", "DRAM_retirement_failed": "remap_failure"}


@dataclass(frozen=True)
class Finding:
    state: str
    action: str
    reason: str  # short, e.g. "Xid 79 (GPU has fallen off the bus)"
    fault: str  # a stable key for the fault ("gpu_lost", "recovery_action", "xid13"; SAME_FAULT): reboots count by it


@dataclass(frozen=True)
class Verdict:
    """One GPU's health (host(): the host's, gpu None)."""

    gpu: int | None
    uuid: str = ""
    state: str = HEALTHY
    action: str = NONE
    reasons: tuple[str, ...] = ()
    faults: tuple[str, ...] = ()  # the findings' fault keys, most severe first (a reboot's record names them)
    reboot_faults: tuple[str, ...] = ()  # those whose finding asked for a reboot: the record counts them per boot

    @property
    def action_text(self) -> str:
        return ACTION_TEXT[self.action]

    def text(self) -> str:
        """e.g. "reboot: Xid 79 (GPU has fallen off the bus)"; "none" when healthy."""
        return self.action_text + (": " + "; ".join(self.reasons) if self.reasons else "")

    def as_dict(self) -> dict:
        return {"state": self.state, "action": self.action, "action_text": self.action_text,
                "reasons": list(self.reasons)}


def no_reboots(uuid: str, fault: str) -> int:
    """The reboot count where none is kept."""
    return 0


@dataclass(frozen=True)
class Inputs:
    """What the monitor read for one GPU on one poll, beside its sample."""

    needs_reset: str | None = None  # eventwatch.EventBook.needs_reset: why it waits for a reset or a reboot
    pending: str | None = None  # eventwatch.EventBook.pending: why it waits for a reset while it serves (Xid 63)
    recent_xids: tuple[tuple[int, int], ...] = ()  # (xid, count) in the last eventwatch.RECENT_S
    busy: bool = False  # a link trained down counts only while busy (idle links train down to save power)
    nvlinks_seen_up: frozenset[int] = field(default_factory=frozenset)  # links seen up since the start


def judge(sample: GpuSample, inputs: Inputs, reboots_before_inspect: int,
          reboots: Callable[[str, str], int] = no_reboots) -> Verdict:
    """The GPU's verdict from its findings. A reboot this GPU already had reboots_before_inspect times for the
    same fault (reboots(uuid, fault), the state directory's count) becomes "inspect the hardware": rebooting
    again would not help (gpud escalates the same way, leptonai/gpud#1075)."""
    found = []
    raw = findings(sample, inputs)
    for f in raw:
        if f.action == REBOOT and (count := reboots(sample.uuid, f.fault)) >= reboots_before_inspect:
            f = Finding(f.state, INSPECT, f"{f.reason}, still after {count} reboots", f.fault)
        found.append(f)
    if not found:
        return Verdict(sample.index, sample.uuid)
    found.sort(key=lambda f: (-STATES.index(f.state), -ACTIONS.index(f.action)))
    return Verdict(sample.index, sample.uuid, max((f.state for f in found), key=STATES.index),
                   max((f.action for f in found), key=ACTIONS.index), tuple(f.reason for f in found),
                   tuple(dict.fromkeys(f.fault for f in found)),
                   tuple(dict.fromkeys(f.fault for f in raw if f.action == REBOOT)))


def waiting(needs_reset: Mapping[int, str], verdicts: Mapping[int, Verdict]) -> dict[int, str]:
    """The GPUs an engine must not run on, and why, each text ending with its action ("...: reset the GPU"): the
    events' book (an Xid or the driver's event that asked for a reset or a reboot) and every GPU judged unhealthy
    (lost from the bus, the polled recovery action, uncorrected ECC, a failed remap...). An engine held for them
    starts again once none of its GPUs is here."""
    out = dict(needs_reset)
    for index, verdict in verdicts.items():
        if verdict.state == UNHEALTHY and index not in out:
            out[index] = "; ".join(verdict.reasons) + ": " + verdict.action_text
    return out


def host(verdicts: Iterable[Verdict]) -> Verdict:
    """The worst state and the most severe action of the GPUs; its reasons name the GPUs."""
    verdicts = list(verdicts)
    state = max((v.state for v in verdicts), key=STATES.index, default=HEALTHY)
    action = max((v.action for v in verdicts), key=ACTIONS.index, default=NONE)
    reasons = tuple(f"GPU{v.gpu} {v.state}: {v.action_text}" for v in verdicts if v.state != HEALTHY)
    return Verdict(None, "", state, action, reasons)


def xid_verdict(number: int) -> tuple[str, str]:
    """What one Xid makes of its GPU's health, (state, action), from its row of xids.TABLE: none asks for nothing;
    an application's fault is degraded (restart the engine) while recent; one that serves on (Xid 63) is degraded
    until its action; any other that asks for an action is unhealthy until it is done. docs/health.md's Xid table
    is generated from this (docs/gen/xids_ref.py); the findings below use it."""
    xid = xids.lookup(number)
    if xid.app_fault:
        return DEGRADED, RESTART_ENGINE
    action = {xids.RESET_GPU: RESET_GPU, xids.REBOOT: REBOOT, xids.INSPECT: INSPECT}.get(xid.action)
    if action is None:
        return HEALTHY, NONE
    return (DEGRADED if xid.serves else UNHEALTHY), action


def fault_of(why: str) -> str:
    """An event's reason ("Xid 79 (...): reboot the node") as its fault's key: one fault, one key (SAME_FAULT)."""
    number = re.match(r"Xid (\d+)", why)
    fault = f"xid{number.group(1)}" if number else why.split(":")[0].replace(" ", "_")[:40]
    return SAME_FAULT.get(fault, fault)


def _event_verdict(why: str) -> tuple[str, str]:
    """An event's (state, action) from its reason: an Xid's own verdict, else what its text asks for."""
    number = re.match(r"Xid (\d+)", why)
    if number:
        return xid_verdict(int(number.group(1)))
    asked = why.rsplit(":", 1)[-1]
    return UNHEALTHY, REBOOT if EVENT_REBOOT.search(asked) else INSPECT if xids.INSPECT in asked else RESET_GPU


def findings(s: GpuSample, inputs: Inputs) -> list[Finding]:
    """Every input's finding, each from its own small rule below."""
    if not s.up:  # nothing of its own is readable; NVML's GPU_IS_LOST is Xid 79's state (catalog: RESTART_BM)
        return [Finding(UNHEALTHY, REBOOT, f"GPU lost from the bus ({s.error or 'unreadable'})", "gpu_lost"),
                *_events(s, inputs)]
    return [f for rule in RULES for f in rule(s, inputs)]


def _recovery_field(s: GpuSample, inputs: Inputs) -> list[Finding]:
    code = s.health.recovery_action
    if not code:
        return []
    state, action = RECOVERY.get(code, (UNHEALTHY, INSPECT))  # a code newer than this table: look at it
    return [Finding(state, action, f"the driver's recovery action: {RECOVERY_ACTIONS.get(code, code)}",
                    "recovery_action")]


def _events(s: GpuSample, inputs: Inputs) -> list[Finding]:
    """An event that asked for a reset or a reboot not done yet: the Xid catalog's RESET_GPU and RESTART_BM
    buckets (xids.TABLE), a double-bit ECC, an unavailable GPU, or the recovery-action event."""
    why = inputs.needs_reset
    if not why or (why.startswith(EVENT_FROM_FIELD) and s.health.recovery_action):
        return []  # the polled field says the same, with its code
    state, action = _event_verdict(why)
    return [Finding(state, action, why, fault_of(why))]


def _pending(s: GpuSample, inputs: Inputs) -> list[Finding]:
    """An Xid whose GPU serves on until its action (Xid 63: a row remap or page retirement recorded, in effect at the
    next reset; NVIDIA's catalog: work may continue): degraded until the GPU is reset. Said once where the polled
    remapped rows say the same."""
    why = inputs.pending
    if not why or s.health.remap_pending or s.health.retire_pending:
        return []
    state, action = _event_verdict(why)
    return [Finding(state, action, why, fault_of(why))]


def _app_xids(s: GpuSample, inputs: Inputs) -> list[Finding]:
    """The catalog's RESTART_APP bucket (13, 31, 43...): the application's fault, not the GPU's. Degraded while
    recent (eventwatch.RECENT_S); a restart of what died clears it."""
    return [Finding(*xid_verdict(x), f"Xid {x} ({xids.lookup(x).meaning}) x{n} recently", f"xid{x}")
            for x, n in inputs.recent_xids if xids.lookup(x).app_fault]


def _memory(s: GpuSample, inputs: Inputs) -> list[Finding]:
    """NVML's remapped rows (nvmlDeviceGetRemappedRows): a pending remap takes effect at the next reset (Xid 63);
    a failed one means the card needs replacing (Xid 64). An uncorrected (double-bit) ECC error since the driver
    loaded leaves the memory suspect until a reset (Xid 48: RESET_GPU)."""
    h, out = s.health, []
    if h.remap_failure:
        out.append(Finding(UNHEALTHY, INSPECT, "a memory row could not be remapped", "remap_failure"))
    if h.ecc_uncorrected:
        out.append(Finding(UNHEALTHY, RESET_GPU, f"{h.ecc_uncorrected} uncorrected ECC error(s)", "ecc_uncorrected"))
    if h.remap_pending or h.retire_pending:
        what = "a remapped row" if h.remap_pending else "a retired page"
        out.append(Finding(DEGRADED, RESET_GPU, f"{what} waits for a GPU reset", "remap_pending"))
    return out


def _fabric(s: GpuSample, inputs: Inputs) -> list[Finding]:
    """The NVSwitch fabric (nvmlDeviceGetGpuFabricInfoV): still registering leaves the GPU without NVLink peers
    (a multi-GPU engine cannot start); a registration that failed needs the hardware looked at."""
    h = s.health
    if h.fabric_ready is not False:
        return []
    if h.fabric_error:
        return [Finding(UNHEALTHY, INSPECT, f"NVSwitch fabric registration failed ({h.fabric_error})", "fabric")]
    return [Finding(DEGRADED, RESTART_ENGINE, f"NVSwitch fabric registration {h.fabric.replace('_', ' ')}",
                    "fabric")]


def _links(s: GpuSample, inputs: Inputs) -> list[Finding]:
    """An NVLink link down or slow (Xid 74's aftermath: tensor parallelism runs on the links left): degraded, and
    a reset retrains it (a link that stays down after one needs the board serviced). A busy PCIe link below its
    generation or width: degraded, and the hardware wants a look (reseat, riser, cable, BIOS)."""
    h, out = s.health, []
    if problems := h.nvlink_problems(inputs.nvlinks_seen_up):
        up = sum(n.state == "up" for n in h.nvlinks)
        out.append(Finding(DEGRADED, RESET_GPU, f"NVLink {'; '.join(problems)} ({up} of {len(h.nvlinks)} up)",
                           "nvlink"))
    if inputs.busy and h.link_degraded:
        out.append(Finding(DEGRADED, INSPECT, f"PCIe link {h.link()} while busy", "pcie"))
    return out


RULES = (_recovery_field, _events, _pending, _memory, _fabric, _links, _app_xids)
