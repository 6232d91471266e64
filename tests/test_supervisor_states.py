"""The supervisor's state table: the states a child may be in (serving/run/states.py) and which may follow which
(ALLOWED_FROM in serving/run/supervisor.py). Every change goes through Program.enter, which refuses one the
table does not allow (TransitionError) and counts each one taken. The supervisor on fake process calls
(test_serving.supervisor); how it moves between the states (backoff, FATAL, STOPPING) is in test_serving.py."""

import pytest

from gpuwarden.serving.run.supervisor import RUNNING
from test_serving import supervisor


def test_transitions_go_through_the_table_and_are_counted():
    from gpuwarden.serving.run.supervisor import TransitionError

    sup, ops, clock = supervisor()
    with pytest.raises(TransitionError):
        sup.enter(RUNNING)  # STOPPED -> RUNNING skips STARTING
    ops.health_ok = True
    sup.start(clock.now)
    sup.tick(clock.now)
    assert sup.transitions == {("STOPPED", "STARTING"): 1, ("STARTING", "RUNNING"): 1}
