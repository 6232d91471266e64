"""The look for leftovers once nothing of ours runs any more (serving/run/runtime.py): due when the last of an
earlier daemon's unnamed children is gone, even where it was gone by this daemon's first tick (the unit tier's
half of tests/test_unit_cgroup_strays.py, whose straggler a busy box's slow start once left running for good)."""

import dataclasses

from gpuwarden.serving.run import handover
from gpuwarden.serving.run.leftovers import _Unnamed
from gpuwarden.serving.run.runtime import ServingRuntime
from gpuwarden.gpu.sim.backend import ManualClock
from test_serving import FakeOps


@dataclasses.dataclass
class Leader:
    pid: int
    pgid: int


def runtime_stopping(alive_at_first_tick: bool):
    """A runtime with serving off, stopping an earlier daemon's engine (pid 4242) as stop_unnamed leaves it; its
    looks for leftovers counted."""
    clock = ManualClock(100.0)
    ops = FakeOps(clock)
    ops.groups[4242] = [4242] if alive_at_first_tick else []
    runtime = ServingRuntime(None, ops=ops, clock=clock)
    entry = handover.Recorded("vllm", 4242, 1, 999, "digest")
    runtime.leftovers.unnamed.append(_Unnamed(entry, Leader(4242, 4242), clock.now + 2))
    looks = []
    runtime._sweep = lambda record, grace, now: looks.append(now)
    return runtime, ops, clock, looks


def test_the_look_is_due_once_the_unnamed_child_is_gone_even_if_it_was_gone_by_the_first_tick():
    for alive_at_first_tick in (True, False):
        runtime, ops, clock, looks = runtime_stopping(alive_at_first_tick)
        runtime.tick(clock.now)
        if alive_at_first_tick:  # still stopping: nothing to look for yet
            assert looks == [] and runtime.leftovers.unnamed
            ops.groups[4242] = []
            clock.advance(0.5)
            runtime.tick(clock.now)
        assert looks == [clock.now] and not runtime.leftovers.unnamed, alive_at_first_tick
        clock.advance(0.5)
        runtime.tick(clock.now)
        assert looks == [clock.now - 0.5], "once, not at every idle tick"
        assert runtime.stopped
