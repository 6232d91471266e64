"""What an Xid means and what it asks for.

From NVIDIA's Xid catalog for Ampere and later
(docs.nvidia.com/deploy/xid-errors/analyzing-xid-catalog.html, "Resolution
Bucket (Immediate Action)": RESTART_APP, RESET_GPU, RESTART_BM), for the Xids
inference servers meet. Unlisted ones are named by number and point to the
catalog. The driver's own recovery action (the GPU_RECOVERY_ACTION event,
Xid 154) overrides this table when it comes.

Two rows say more than their bucket, in NVIDIA's own words: Xid 63 (a row remap
or page retirement recorded) lets work continue, the remap taking effect at the
next reset, so its GPU serves on (degraded) until then; Xid 64 (a remap that
failed) leaves a row that cannot be repaired in the field: the card is inspected.
watch/health.xid_verdict says what each row makes of its GPU's health, and
docs/health.md's Xid table is generated from both (docs/gen/xids_ref.py).
"""

from __future__ import annotations

from dataclasses import dataclass

CATALOG = "NVIDIA Xid catalog, docs.nvidia.com/deploy/xid-errors/analyzing-xid-catalog.html"
NONE, RESTART_APP, RESET_GPU, REBOOT = "none", "restart the application", "reset the GPU", "reboot the node"
INSPECT = "inspect the hardware"
# An event that asks for one of these stops the engine on its GPU, which waits (HELD) until it is done; an Xid that
# serves (Xid.serves) waits for its action without stopping anything.
HOLDS = (RESET_GPU, REBOOT, INSPECT)


@dataclass(frozen=True)
class Xid:
    number: int
    meaning: str
    action: str  # NONE, RESTART_APP, RESET_GPU, REBOOT (the catalog's buckets), or INSPECT (a card to replace)
    serves: bool = False  # its GPU serves on until the action is done (at the next maintenance window)

    @property
    def app_fault(self) -> bool:
        """An application's fault (13, 31, 43...): it may come from any process on the GPU."""
        return self.action == RESTART_APP

    @property
    def needs_reset(self) -> bool:
        """Its GPU must not serve until the action is done: the engine on it is stopped and waits (HELD)."""
        return self.action in HOLDS and not self.serves

    @property
    def pending(self) -> bool:
        """Its GPU serves on, degraded, and waits for the action (Xid 63: the remap takes effect at a reset)."""
        return self.action in HOLDS and self.serves


TABLE = {x.number: x for x in (
    Xid(8, "GPU stopped processing (a channel timed out)", RESTART_APP),
    Xid(13, "Graphics Engine Exception", RESTART_APP),
    Xid(31, "GPU memory page fault", RESTART_APP),
    Xid(43, "GPU stopped processing", RESTART_APP),
    Xid(45, "preemptive cleanup after an earlier error", NONE),
    Xid(48, "double-bit ECC error", RESET_GPU),
    Xid(61, "internal micro-controller breakpoint", RESET_GPU),
    Xid(62, "internal micro-controller halt", RESET_GPU),
    Xid(63, "ECC page retirement or row remap recorded (takes effect at a reset)", RESET_GPU, serves=True),
    Xid(64, "ECC page retirement or row remap failed", INSPECT),
    Xid(74, "NVLink error", RESET_GPU),
    Xid(79, "GPU has fallen off the bus", REBOOT),
    Xid(92, "high single-bit ECC error rate", NONE),
    Xid(94, "contained ECC error (the application was stopped)", RESTART_APP),
    Xid(95, "uncontained ECC error", RESET_GPU),
    Xid(109, "context switch timeout", RESTART_APP),
    Xid(119, "GSP RPC timeout", RESET_GPU),
    Xid(120, "GSP error", RESET_GPU),
    Xid(154, "GPU recovery action changed", NONE),
)}


def lookup(number: int) -> Xid:
    return TABLE.get(number, Xid(number, "see the Xid catalog", NONE))
