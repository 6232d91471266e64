"""A toy GPU signal with a window, registered only in tests (test_signals.py): the recipe for a new signal with
history, done in one module and without a line in alerts.py, monitor.py or web/exposition.py.

Its window keeps each GPU's utilization over the poll's window; its rule fires while the average is 50% or more;
its row shows the average on /metrics."""

from collections import deque

from gpuwarden.watch.alerts import INACTIVE, INFO, Check, Rule
from gpuwarden.watch.rows import gpu_row

BUSY_PCT = 50.0


class AverageUtilization:
    """The window: each GPU's (time, utilization) over the last poll.window_s; its reading is their average."""

    EMPTY = None  # no reading: the rule stays quiet

    def __init__(self):
        self.seen = {}

    def read(self, sample, poll):
        history = self.seen.setdefault(sample.index, deque())
        if sample.utilization_pct is not None:
            history.append((poll.now, sample.utilization_pct))
        while history and poll.now - history[0][0] > poll.window_s:
            history.popleft()
        return sum(pct for _, pct in history) / len(history) if history else None


WINDOW = AverageUtilization


def toy_busy(s, ctx):
    average = ctx.window(AverageUtilization)
    if average is None:
        return INACTIVE
    return Check(average >= BUSY_PCT, f"utilization {average:.0f}% on average", f">= {BUSY_PCT:.0f}%",
                 f"{average:.0f}%")


RULES = (Rule("toy_busy", INFO, "nothing to do: a toy", toy_busy, for_s=0.0),)

ROWS = (gpu_row("gpuwarden_toy_utilization_average_ratio", "The toy's average utilization over its window",
                lambda v: None if v.windows.get(AverageUtilization) is None else v.windows[AverageUtilization] / 100),)
