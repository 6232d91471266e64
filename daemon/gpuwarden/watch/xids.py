"""What an Xid means and what it asks for.

From NVIDIA's Xid catalog for Ampere and later
(docs.nvidia.com/deploy/xid-errors/analyzing-xid-catalog.html, "Resolution
Bucket (Immediate Action)": RESTART_APP, RESET_GPU, RESTART_BM), for the Xids
inference servers meet. Unlisted ones are named by number and point to the
catalog. The driver's own recovery action (the GPU_RECOVERY_ACTION event,
Xid 154) overrides this table when it comes.
"""

from __future__ import annotations

from dataclasses import dataclass

CATALOG = "NVIDIA Xid catalog, docs.nvidia.com/deploy/xid-errors/analyzing-xid-catalog.html"
NONE, RESTART_APP, RESET_GPU, REBOOT = "none", "restart the application", "reset the GPU", "reboot the node"
NEEDS_RESET = (RESET_GPU, REBOOT)


@dataclass(frozen=True)
class Xid:
    number: int
    meaning: str
    action: str  # one of NONE, RESTART_APP, RESET_GPU, REBOOT

    @property
    def app_fault(self) -> bool:
        """An application's fault (13, 31, 43...): it may come from any process on the GPU."""
        return self.action == RESTART_APP

    @property
    def needs_reset(self) -> bool:
        return self.action in NEEDS_RESET


TABLE = {x.number: x for x in (
    Xid(8, "GPU stopped processing (a channel timed out)", RESTART_APP),
    Xid(13, "Graphics Engine Exception", RESTART_APP),
    Xid(31, "GPU memory page fault", RESTART_APP),
    Xid(43, "GPU stopped processing", RESTART_APP),
    Xid(45, "preemptive cleanup after an earlier error", NONE),
    Xid(48, "double-bit ECC error", RESET_GPU),
    Xid(61, "internal micro-controller breakpoint", RESET_GPU),
    Xid(62, "internal micro-controller halt", RESET_GPU),
    Xid(63, "ECC page retirement or row remap recorded (takes effect at a reset)", RESET_GPU),
    Xid(64, "ECC page retirement or row remap failed", RESET_GPU),
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
