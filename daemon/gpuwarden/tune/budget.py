"""The power budget (tuning.power_budget_w): one wall-power limit the GPUs share, split by demand, and the mover that
puts a new split on the cards without the sum of the enforced limits ever passing the budget.

The split is pure data (split, static_split): each card's NVML constraints, its demand and its weight in, watts
out. The mover (PowerBudget) runs on the daemon's loop every MOVE_EVERY_S: it lowers the cards that give watts
first, reads each back (the limit NVML enforces), and only then raises the others, each raise no more than the
readings leave room for. A card lost, or a limit that does not read back, ends the moving: a static split that
fits (budget x weight, minimums first) is set instead, and said once. A lost card counts at its maximum limit until
it answers (lost_at_most): it may come back at any limit up to that (a reset or a driver reload leaves the
default), and the sum of the limits must fit the budget the moment it does.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from ..base.systemd import NOTICE
from ..gpu import errors
from ..gpu.base import ClockEventReason as R
from ..gpu.base import Gpu, GpuSample
from ..gpu.throttle import reasons
from .tunables import BUSY_PCT, power_limit_is

log = logging.getLogger("gpuwarden")
MOVE_EVERY_S = 5.0  # how often the split follows the demand: a card that starts working waits at most this long
HEADROOM_W = 50.0  # a card neither capped nor idle wants its draw plus this, so a rising load is not capped at once
URGENT_W = 50.0  # a card the new split gives this much more moves at once (a card started working), not at the period
MIN_MOVE_S = 1.0  # but no more often than this
LINE_S = 60.0  # a fall-back or resume line at most once in this (a GPU lost and back every few polls)
WATT = 1.0  # allocations are whole watts (NVML takes milliwatts; a card verifies within POWER_TOLERANCE_W)


@dataclass(frozen=True)
class Card:
    index: int
    uuid: str
    min_w: float  # NVML's power-limit constraints
    max_w: float
    demand_w: float  # what it would use now (demand())
    weight: float = 1.0  # tuning.power_shares
    fixed_w: float | None = None  # a sweep holds this card's limit here: it gets exactly this


def watts(value: float | None) -> float | None:
    """A reading of watts the budget can count with: NaN, infinite or negative (a driver or a backend that lies)
    is unreadable, and so counted as conservatively as a card that cannot be read."""
    return value if value is not None and math.isfinite(value) and value >= 0 else None


def _range(low: float | None, high: float | None) -> tuple[float, float] | None:
    """NVML's power-limit constraints, where they are watts (finite, not negative); else None: unknown. A minimum
    above the maximum stays: the split holds the card at its minimum, and the budget's floor counts it."""
    low, high = watts(low), watts(high)
    return (low, high) if low is not None and high is not None else None


def demand(sample: GpuSample, min_w: float, max_w: float) -> float:
    """What a card would use: held at its limit by SwPowerCap while it works, its maximum; idle, its minimum;
    otherwise its draw plus HEADROOM_W, within its constraints."""
    busy = (sample.utilization_pct or 0) >= BUSY_PCT
    if busy and R.SwPowerCap in reasons(sample):
        return max_w
    if not busy or sample.power_w is None:
        return min_w
    return min(max_w, max(min_w, sample.power_w + HEADROOM_W))


def minimum_w(cards: Iterable[Card]) -> float:
    """The least the cards can be held at: each at its minimum, a swept one at its step."""
    return sum(c.fixed_w if c.fixed_w is not None else c.min_w for c in cards)


def split(cards: list[Card], budget_w: float) -> dict[int, float]:
    """Each card's limit: its minimum (a swept card its step) first, then what is left of the budget shared by
    weight, each card up to its demand. Watts nobody wants stay unallocated. Raises ValueError when the
    minimums alone pass the budget."""
    return _fill(cards, budget_w, lambda c: c.demand_w)


def static_split(cards: list[Card], budget_w: float, lost: Iterable[int] = ()) -> dict[int, float]:
    """The fallback: no demand read, budget x weight within each card's constraints, minimums first; the lost cards
    counted at their maximum limits (lost_at_most)."""
    return _fill(lost_at_most(cards, lost, budget_w)[0], budget_w, lambda c: c.max_w)


def lost_at_most(cards: list[Card], lost: Iterable[int], budget_w: float) -> tuple[list[Card], str | None]:
    """The cards with each lost one held (fixed_w) at its maximum limit, the most it can come back at (a reset or a
    driver reload leaves its default), so that the others are split over what is left and the sum of the limits
    fits the budget when it answers. Where the others' minimums leave less than the lost cards' maximums, those
    get what is left, shared by their maximums (never below their minimums), and the text says so; else None."""
    lost = set(lost)
    held = [c for c in cards if c.index in lost and c.fixed_w is None]
    if not held:
        return cards, None
    room = budget_w - minimum_w(c for c in cards if c not in held)
    need = sum(c.max_w for c in held)
    share = 1.0 if need <= room else max(0.0, room) / need
    counted = {c.index: max(c.min_w, float(int(c.max_w * share + 1e-6))) for c in held}
    short = None if share >= 1.0 else "; ".join(
        f"GPU {c.index} counted at {counted[c.index]:g} W of its {c.max_w:g} W maximum" for c in held) + \
        (": the other GPUs' minimums leave no more, so its return at a higher limit passes the budget until the "
         "next move")
    return [dataclasses.replace(c, fixed_w=counted[c.index]) if c.index in counted else c for c in cards], short


def _fill(cards: list[Card], budget_w: float, want: Callable[[Card], float]) -> dict[int, float]:
    floor = minimum_w(cards)
    if floor > budget_w:
        raise ValueError(f"the minimums come to {floor:g} W, above the budget of {budget_w:g} W")
    alloc = {c.index: (c.fixed_w if c.fixed_w is not None else c.min_w) for c in cards}
    left = budget_w - floor
    hungry = [c for c in cards if c.fixed_w is None and min(want(c), c.max_w) > alloc[c.index]]
    while left >= WATT and hungry:  # water-filling: a card that reaches its want leaves its share to the rest
        weights = sum(c.weight for c in hungry)
        given = 0.0
        for c in hungry:
            more = min(left * c.weight / weights, min(want(c), c.max_w) - alloc[c.index])
            alloc[c.index] += more
            given += more
        left -= given
        hungry = [c for c in hungry if min(want(c), c.max_w) - alloc[c.index] >= WATT / 2]
        if given < WATT / 2:
            break
    # whole watts, rounded down, so rounding never passes the budget; a minimum is a whole watt on every card
    return {i: max(float(int(w + 1e-6)), _card(cards, i).min_w) for i, w in alloc.items()}


def _card(cards: list[Card], index: int) -> Card:
    return next(c for c in cards if c.index == index)


def describe(alloc: dict[int, float], budget_w: float) -> str:
    return ", ".join(f"GPU {i} {w:g} W" for i, w in sorted(alloc.items())) + \
        f" (sum {sum(alloc.values()):g} of {budget_w:g} W)"


def cards_of(gpus: list[Gpu], samples: dict[int, GpuSample], weight: Callable[[int, str], float],
             fixed: dict[int, float], ranges: dict[str, tuple[float, float]] | None = None) \
        -> tuple[list[Card], list[int]]:
    """The cards to split over, from a poll's readings, and the indices of those lost (no reading, no
    constraints): a lost card keeps the share of a static split.

    Each card's constraints come from its sample (NVML reads them with the slow counters, every
    counters_interval_s: they change only when the card's range does), else from `ranges` (uuid -> (min, max),
    the last ones seen: a card lost for now keeps its range), else from gpu.capabilities() once (it also reads
    the supported clocks, too slow for every poll); what is found is kept in `ranges`."""
    ranges = {} if ranges is None else ranges
    cards, lost = [], []
    for gpu in gpus:
        sample = samples.get(gpu.index)
        up = sample is not None and sample.up
        read = _range(sample.power_limit_min_w, sample.power_limit_max_w) if up else None
        if read is not None:
            ranges[gpu.uuid] = read
        elif gpu.uuid not in ranges:
            caps = _range(*_caps(gpu))
            if caps is not None:
                ranges[gpu.uuid] = caps
        low, high = ranges.get(gpu.uuid, (None, None))
        if low is None or high is None:
            lost.append(gpu.index)
            continue
        if not up:
            lost.append(gpu.index)
        want = demand(sample, low, high) if up else high
        cards.append(Card(gpu.index, gpu.uuid, low, high, want, weight(gpu.index, gpu.uuid), fixed.get(gpu.index)))
    return cards, lost


def _caps(gpu: Gpu) -> tuple[float | None, float | None]:
    try:
        caps = gpu.capabilities()
    except errors.GpuError:  # a card lost since before its first reading: no range yet, it counts as lost
        return None, None
    return caps.power_limit_min_w, caps.power_limit_max_w


class Mover:
    """Puts a split on the cards: lowers first and reads each back, then raises within the room the readings
    leave. set_limit(gpu, watts) sets through the tuner (so the original is recorded); read_limit(gpu) is the
    enforced limit (None: unreadable). Returns the indices whose limit did not read back."""

    def __init__(self, set_limit: Callable[[Gpu, float], None], read_limit: Callable[[Gpu], float | None]):
        self.set_limit, self.read_limit = set_limit, read_limit

    def move(self, gpus: list[Gpu], target: dict[int, float], budget_w: float,
             known: dict[int, float]) -> tuple[int, list[int]]:
        """(limits set, GPUs that did not read back). known: the last enforced limit of each card, the
        conservative count for a card that cannot be read now; updated here with what is read."""
        enforced = known
        for gpu in gpus:
            reading = watts(self.read_limit(gpu))
            if reading is not None:
                enforced[gpu.index] = reading
        sets, bad = 0, []
        by_index = {g.index: g for g in gpus}
        lowers = [i for i, w in target.items() if i in enforced and w < enforced[i] - WATT / 2]
        raises = [i for i, w in target.items() if i in enforced and w > enforced[i] + WATT / 2]
        for i in lowers + raises:
            want = target[i]
            if want > enforced[i]:  # a raise: only into the room the readings leave
                room = budget_w - sum(w for j, w in enforced.items() if j != i)
                want = min(want, float(int(room + 1e-6)))
                if want <= enforced[i] + WATT / 2:
                    continue
            try:
                self.set_limit(by_index[i], want)
                sets += 1
            except errors.GpuError as exc:
                log.warning("power budget: GPU%d power limit %g W not set: %s", i, want, exc)
            reading = watts(self.read_limit(by_index[i]))
            if reading is not None:
                enforced[i] = reading
            if not power_limit_is(reading, want):
                bad.append(i)
                if reading is None:  # unreadable: counted at the higher of the two, whichever it enforces
                    enforced[i] = max(enforced[i], want)
        return sets, bad


class PowerBudget:
    """The budget's life on a running daemon: every MOVE_EVERY_S, the split from the latest readings, put on the
    cards by the Mover; the static fallback once a card is lost or a limit does not read back; what it chose, for
    the alerts (chosen) and the metrics and status (view)."""

    def __init__(self, budget_w: float, weight: Callable[[int, str], float], mover: Mover):
        self.budget_w, self.weight, self.mover = budget_w, weight, mover
        self.alloc: dict[int, float] = {}  # the split in force (or planned, read-only)
        self.enforced: dict[int, float] = {}  # the last enforced limits read
        self.moves = 0  # limits set by the budget
        self.fallback: str | None = None  # why the split is static now
        self.short: str | None = None  # the minimums pass the budget (a GPU added): the alert's text
        self._last = float("-inf")
        self._read_back_failed = False  # latched until a reload: a card that ignores a set is not moved again
        self._deaf: set[int] = set()  # those cards (a set retried every second was a warning every second)
        self._now = float("-inf")  # the last tick's time
        self._said = (float("-inf"), 0)  # (the last fall-back or resume line, changes unsaid since): LINE_S apart
        self.ranges: dict[str, tuple[float, float]] = {}  # uuid -> its power-limit constraints (cards_of)

    def tick(self, gpus: list[Gpu], samples: dict[int, GpuSample], now: float, fixed: dict[int, float],
             apply: bool) -> None:
        """One poll's look: the split, and (apply) the moves, every MOVE_EVERY_S, or at once (MIN_MOVE_S apart) where
        a card needs URGENT_W more than it has or the enforced limits pass the budget (a card back at its default)."""
        cards, lost = cards_of(gpus, samples, self.weight, fixed, self.ranges)
        if now - self._last < MOVE_EVERY_S and not (now - self._last >= MIN_MOVE_S and
                                                    self._urgent(cards, samples, lost, fixed)):
            return
        self._last = self._now = now
        self._read(gpus, samples, cards)
        try:
            if lost or self._read_back_failed:
                cards, short = lost_at_most(cards, lost, self.budget_w)
                self.enforced.update({c.index: c.fixed_w for c in cards if c.index in lost})  # until it answers
                self._fall_back(f"GPU {', '.join(map(str, lost))} lost" if lost else None, short)
                target = static_split(cards, self.budget_w)
            else:
                self._resume()
                target = split(cards, self.budget_w)
        except ValueError as exc:
            self.short = f"{exc}: raise tuning.power_budget_w to at least {minimum_w(cards):g} W"
            return  # the rule power_budget_short (watch/signals/budget.py) says it, once
        self.short = None
        self.alloc = target
        if not apply:
            return
        up = [g for g in gpus if g.index not in lost]
        skip = set(lost) | set(fixed) | self._deaf
        sets, bad = self.mover.move(up, {i: w for i, w in target.items() if i not in skip}, self.budget_w,
                                    self.enforced)
        self.moves += sets
        self._did_not_read_back(bad)

    def _read(self, gpus: list[Gpu], samples: dict[int, GpuSample], cards: list[Card]) -> None:
        """The enforced limits from the samples; a card never read (lost since the start, or its reading NaN)
        counts at its maximum limit, or at the whole budget without a range: the others are raised only into room
        that is there whatever it enforces."""
        for s in samples.values():
            if s.up and watts(s.power_limit_w) is not None:
                self.enforced[s.index] = s.power_limit_w
        high = {c.index: c.max_w for c in cards}
        for gpu in gpus:
            self.enforced.setdefault(gpu.index, high.get(gpu.index, self.budget_w))

    def _did_not_read_back(self, bad: list[int]) -> None:
        if bad:
            self._read_back_failed = True
            self._deaf.update(bad)
            self._fall_back(f"GPU {', '.join(map(str, bad))} did not read back its limit")

    def _urgent(self, cards: list[Card], samples: dict[int, GpuSample], lost: list[int], fixed: dict) -> bool:
        limits = [w for s in samples.values() if s.up and (w := watts(s.power_limit_w)) is not None]
        # a card just lost counts at once at what it may come back at: a reset takes a second, not the period
        counted = sum(c.fixed_w for c in lost_at_most(cards, lost, self.budget_w)[0] if c.index in lost)
        if sum(limits) + counted > self.budget_w + WATT / 2:
            return True
        if lost or self._read_back_failed:
            return False
        try:
            target = split(cards, self.budget_w)
        except ValueError:
            return False
        return any(w - self.alloc.get(i, w) >= URGENT_W for i, w in target.items() if i not in fixed)

    def _fall_back(self, why: str | None, short: str | None = None) -> None:
        if why is None or self.fallback == why:
            return
        self.fallback = why
        self._say(logging.WARNING, f"power budget: {why}: holding a static split that fits {self.budget_w:g} W "
                  f"until {'a reload' if self._read_back_failed else 'every GPU answers again'}"
                  + (f"; {short}" if short else ""))

    def _resume(self) -> None:
        if self.fallback is not None:
            self._say(NOTICE, "power budget: every GPU answers again: the split follows the demand again")
            self.fallback = None

    def _say(self, level: int, line: str) -> None:
        """One line per LINE_S: a GPU lost and back every few polls was a warning and a notice every few seconds.
        status and gpuwarden_power_budget_static say the state in between."""
        said, unsaid = self._said
        if self._now - said < LINE_S:
            self._said = (said, unsaid + 1)
            return
        self._said = (self._now, 0)
        log.log(level, "%s%s", line, f" ({unsaid} changes before this one not logged: a GPU flaps)" if unsaid else "")

    def chosen(self, index: int) -> tuple[float, str] | None:
        """This card's allocation and who chose it, for the power rules."""
        if index not in self.alloc:
            return None
        return self.alloc[index], f"set by the power budget ({self.budget_w:g} W over {len(self.alloc)} GPUs)"

    def room_for(self, swept: dict[int, float], gpus: list[Gpu], samples: dict[int, GpuSample]) -> str | None:
        """A sweep asks to hold these cards at these limits: None when the rest of the budget still covers the
        other cards' minimums, else the one line that refuses the step."""
        cards, _ = cards_of(gpus, samples, self.weight, swept, self.ranges)
        floor = minimum_w(cards)
        if floor > self.budget_w:
            return (f"{', '.join(f'{w:g} W on GPU {i}' for i, w in sorted(swept.items()))} would take the power "
                    f"budget to {floor:g} W with the other GPUs at their minimums, above tuning.power_budget_w "
                    f"{self.budget_w:g} W")
        return None

    def sweep_ceiling(self, swept: list[int], gpus: list[Gpu], samples: dict[int, GpuSample]) -> float | None:
        """The highest limit a sweep may hold each of these cards at: what the budget leaves above the other
        cards' minimums, shared among the swept ones (tune's steps stop there, so its knee respects the budget);
        None when the budget leaves nothing to sweep over."""
        cards, _ = cards_of(gpus, samples, self.weight, {i: 0.0 for i in swept}, self.ranges)
        left = self.budget_w - minimum_w(cards)
        return float(int(left / len(swept) + 1e-6)) if swept and left > 0 else None

    def make_room(self, swept: dict[int, float], gpus: list[Gpu], samples: dict[int, GpuSample]) -> str | None:
        """A sweep's step is about to hold these cards at these limits (tune/sweeps.py sets it after this). The
        other cards are lowered first, each read back, to their share of what the step leaves; None when the
        readings then leave room for the step, else the one line that refuses it (nothing of the step is set)."""
        refused = self.room_for(swept, gpus, samples)
        if refused is not None:
            return refused
        cards, lost = cards_of(gpus, samples, self.weight, swept, self.ranges)
        target = static_split(cards, self.budget_w, lost) if lost or self._read_back_failed else \
            split(cards, self.budget_w)
        self.alloc = target
        self._read(gpus, samples, cards)
        self.enforced.update({i: target[i] for i in lost if i in target})  # a lost card at its maximum until it answers
        others = [g for g in gpus if g.index not in swept and g.index not in lost and g.index not in self._deaf]
        lowers = {g.index: min(target[g.index], self.enforced.get(g.index, target[g.index])) for g in others
                  if g.index in target}  # only lowers now: the step takes the room, the next poll shares the rest
        sets, bad = self.mover.move(others, lowers, self.budget_w, self.enforced)
        self.moves += sets
        self._did_not_read_back(bad)
        held = sum(w for i, w in self.enforced.items() if i not in swept)
        if held + sum(swept.values()) > self.budget_w + WATT / 2:
            return (f"the other GPUs still hold {held:g} W (read back), which leaves "
                    f"{max(0.0, self.budget_w - held):g} W of tuning.power_budget_w {self.budget_w:g} W for "
                    f"{', '.join(f'{w:g} W on GPU {i}' for i, w in sorted(swept.items()))}")
        self._last = float("-inf")  # the cards the step leaves room to get it at the next poll
        return None

    def wake(self) -> None:
        """The next poll splits and moves (a sweep ended: its cards are the budget's again)."""
        self._last = float("-inf")

    def view(self) -> dict:
        return {"budget_w": self.budget_w, "alloc": dict(self.alloc), "moves": self.moves,
                "fallback": self.fallback, "short": self.short}
