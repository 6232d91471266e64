"""tune's end of the control channel (tune/channel.py, SweepClient): the lease-lost signal (SIGUSR1) raises
LeaseLost once; a storm's later signals do nothing. The channel against a real daemon is in test_tune.py."""

import pytest

from gpuwarden.tune.channel import LeaseLost, SweepClient


def test_a_second_lease_lost_signal_during_cleanup_raises_nothing():
    # A SIGUSR1 storm from outside after the lease was lost raised LeaseLost again inside the sweep's cleanup:
    # a traceback instead of tune's one line.
    client = SweepClient.__new__(SweepClient)
    import threading
    client._stop, client.lost, client._raised = threading.Event(), "the daemon closed the control channel", False
    with pytest.raises(LeaseLost):
        client._on_lost(10, None)
    client._on_lost(10, None)  # the storm's next signals: nothing
    client._on_lost(10, None)
