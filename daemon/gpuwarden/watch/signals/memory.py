"""Device memory: how much is used, and its health (ECC errors, remapped rows, retired pages). Rules: an
uncorrected ECC error (ecc_uncorrected), a remap or retirement waiting for a reset (row_remap_pending) and a
row that could not be remapped (row_remap_failure)."""

from __future__ import annotations

from ...gpu.base import GpuSample
from ..alerts import CRITICAL, WARNING, Check, GpuContext, Rule
from ..rows import flag, gpu_row


def ecc_uncorrected(s: GpuSample, ctx: GpuContext) -> Check:
    count = s.health.ecc_uncorrected
    return Check(bool(count), f"{count} uncorrected ECC error(s) since the driver loaded", "0", f"{count} ECC")


def row_remap_pending(s: GpuSample, ctx: GpuContext) -> Check:
    h = s.health
    pending = bool(h.remap_pending) or bool(h.retire_pending)
    what = "a remapped memory row" if h.remap_pending else "a retired memory page"
    return Check(pending, f"{what} waits for a GPU reset", "none pending", "reset pending")


def row_remap_failure(s: GpuSample, ctx: GpuContext) -> Check:
    return Check(bool(s.health.remap_failure), "a memory row could not be remapped", "no remap failure",
                 "remap failed")


RULES = (
    Rule("ecc_uncorrected", CRITICAL, "drain the GPU and reset it (or reboot); if it recurs, the card needs "
         "replacing", ecc_uncorrected),
    Rule("row_remap_pending", WARNING, "drain the GPU and reset it (or reboot): the remap takes effect then",
         row_remap_pending),
    Rule("row_remap_failure", CRITICAL, "the card needs replacing: a memory row could not be remapped",
         row_remap_failure),
)

ROWS = (
    gpu_row("gpuwarden_gpu_ecc_uncorrected_errors", "Uncorrected ECC errors since the driver loaded (volatile)",
            "sample.health.ecc_uncorrected"),
    gpu_row("gpuwarden_gpu_remapped_rows_correctable", "Memory rows remapped for correctable errors",
            "sample.health.remapped_rows_correctable"),
    gpu_row("gpuwarden_gpu_remapped_rows_uncorrectable", "Memory rows remapped for uncorrectable errors",
            "sample.health.remapped_rows_uncorrectable"),
    gpu_row("gpuwarden_gpu_row_remap_pending", "1 while a remapped row waits for a GPU reset",
            lambda v: flag(v.sample.health.remap_pending)),
    gpu_row("gpuwarden_gpu_row_remap_failure", "1 once a row could not be remapped (replace the card)",
            lambda v: flag(v.sample.health.remap_failure)),
    gpu_row("gpuwarden_gpu_retired_pages", "Memory pages retired (GPUs before Ampere)", "sample.health.retired_pages"),
    gpu_row("gpuwarden_gpu_memory_used_bytes", "Device memory in use", "sample.memory_used_bytes"),
    gpu_row("gpuwarden_gpu_memory_total_bytes", "Device memory in total", "sample.memory_total_bytes"),
    gpu_row("gpuwarden_gpu_memory_reserved_bytes", "Device memory the driver reserves (not in used)",
            "sample.memory_reserved_bytes"),
    gpu_row("gpuwarden_gpu_memory_unified", "1 if the memory figures are the system's, which the GPU shares "
            "(DGX Spark: NVML reports none of its own)", lambda v: int(v.sample.memory_unified)),
)
