"""NVLink: each link's state and speed, and its data-link error counters. Rules: a link down or slower than the
GPU's fastest (nvlink_degraded) and errors growing (nvlink_errors), over the window LinkErrors keeps."""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass

from ...gpu.base import NVLINK_ERRORS, GpuSample
from ..alerts import INACTIVE, WARNING, Check, GpuContext, Poll, Rule
from ..rows import COUNTER, gpu_row, per_gpu_row

NVLINK_CRC_PER_S = 100.0  # DCGM: "RM has informed us that CRC errors only matter at rates of 100+ per second"
UP = ("up", "sleep")  # a sleeping link wakes on traffic


def nvlink_degraded(s: GpuSample, ctx: GpuContext) -> Check:
    """A link that was up (or knows its far end) is down, or runs slower than the GPU's fastest link."""
    h = s.health
    problems = h.nvlink_problems(ctx.window(LinkErrors).seen_up)
    if not problems:
        return INACTIVE
    up = sum(n.state in UP for n in h.nvlinks)
    return Check(True, f"NVLink {'; '.join(problems)}; {up} of {len(h.nvlinks)} links up",
                 "every link up at the GPU's full speed", f"{up}/{len(h.nvlinks)} links", value=float(up))


def nvlink_errors(s: GpuSample, ctx: GpuContext) -> Check:
    """Replays or recoveries since the window began (any: DCGM's health check fails on one), or CRC errors
    at 100/s or more."""
    window = ctx.window(LinkErrors)
    grew = window.growth
    seconds = max(window.seconds, 1e-9)
    bad = {key: n for key, n in grew.items() if n and (key[1] != "crc" or n / seconds >= NVLINK_CRC_PER_S)}
    if not bad:
        return INACTIVE
    text = ", ".join(f"link {link} {kind} +{n}" + (f" ({n / seconds:.0f}/s)" if kind == "crc" else "")
                     for (link, kind), n in sorted(bad.items()))
    total = sum(bad.values())
    return Check(True, f"NVLink errors in the last {window.seconds:.0f} s: {text}",
                 f"no replay or recovery; CRC below {NVLINK_CRC_PER_S:.0f}/s", f"+{total} errors",
                 value=-float(total))


RULES = (
    Rule("nvlink_degraded", WARNING, "look for Xid 74 in `dmesg` and at `nvidia-smi nvlink -s`; drain the GPU "
         "and reset it (or reboot): a link that stays down after that needs the vendor (the board or its NVLink "
         "connectors); meanwhile tensor parallelism runs on the links that are left", nvlink_degraded),
    Rule("nvlink_errors", WARNING, "`nvidia-smi nvlink -e` shows the counters per link; replays and recoveries "
         "mean the link retrains: drain and reset the GPU, and if they go on, have the board serviced",
         nvlink_errors, for_s=0.0),
)


@dataclass(frozen=True)
class Links:
    """What LinkErrors read for one GPU on one poll."""

    # The links seen up since the start: a link never up and with no far end is not cabled (not a fault).
    seen_up: frozenset[int]
    growth: Mapping[tuple[int, str], int]  # each link's error counters' growth over the window: {(link, kind): n}
    seconds: float  # the time that growth spans (between two reads of the counters)


class LinkErrors:
    """Per GPU, how much each NVLink link's error counters grew over a recent window, from the polls that read
    the counters (so a rate is errors over the time between two real reads), and the links seen up. The signal's
    window (alerts.Window)."""

    EMPTY = Links(frozenset(), {}, 0.0)

    def __init__(self) -> None:
        self._reads: dict[int, deque[tuple[float, dict[tuple[int, str], int]]]] = {}
        self._growth: dict[int, tuple[dict[tuple[int, str], int], float]] = {}
        self.seen_up: dict[int, frozenset[int]] = {}

    def read(self, sample: GpuSample, poll: Poll) -> Links:
        growth, seconds = self.update(sample, poll.now, poll.window_s, poll.fresh)
        return Links(self.seen_up.get(sample.index, frozenset()), growth, seconds)

    def update(self, sample: GpuSample, now: float, window_s: float,
               fresh: bool) -> tuple[dict[tuple[int, str], int], float]:
        """({(link, kind): growth}, the seconds it spans); fresh: this poll read the counters. A counter that
        went back (a driver reload) counts 0."""
        links = sample.health.nvlinks
        if not links:
            return {}, 0.0
        up = {n.link for n in links if n.state in UP}
        self.seen_up[sample.index] = self.seen_up.get(sample.index, frozenset()) | up
        if fresh:
            reads = self._reads.setdefault(sample.index, deque())
            reads.append((now, {(n.link, kind): getattr(n, kind) for n in links for kind in NVLINK_ERRORS
                                if getattr(n, kind) is not None}))
            while len(reads) > 1 and now - reads[1][0] >= window_s:  # the base: the newest read a window old
                reads.popleft()
            (t0, first), (t1, last) = reads[0], reads[-1]
            self._growth[sample.index] = ({key: max(0, n - first[key]) for key, n in last.items() if key in first},
                                          t1 - t0)
        return self._growth.get(sample.index, ({}, 0.0))


WINDOW = LinkErrors

ROWS = (
    gpu_row("gpuwarden_gpu_nvlink_links", "NVLink links the GPU has (where it has NVLink)",
            lambda v: len(v.sample.health.nvlinks) or None),
    gpu_row("gpuwarden_gpu_nvlink_links_up", "NVLink links up (or asleep, which wakes on traffic)",
            lambda v: sum(n.state in UP for n in v.sample.health.nvlinks) if v.sample.health.nvlinks else None),
    per_gpu_row("gpuwarden_gpu_nvlink_link_up", "1 while the NVLink link is up (or asleep)", ("link",),
                lambda v: [((str(n.link),), int(n.state in UP)) for n in v.sample.health.nvlinks
                           if n.state != "unknown"]),
    per_gpu_row("gpuwarden_gpu_nvlink_link_speed_bytes_per_second", "NVLink link speed per direction", ("link",),
                lambda v: [((str(n.link),), n.speed_mbps * 1e6) for n in v.sample.health.nvlinks
                           if n.speed_mbps is not None]),
    per_gpu_row("gpuwarden_gpu_nvlink_errors", "NVLink data-link errors since the driver loaded, summed over the "
                "GPU's links (replay, recovery, crc)", ("kind",),
                lambda v: [((kind,), count) for kind, count in v.sample.health.nvlink_errors().items()], COUNTER),
)
