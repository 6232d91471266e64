"""The one rule both servers close a connection by at their cap (base/conncap.py): from the source that holds the
most, one already replied to, else the one that waited longest; none while every connection is being answered."""

from gpuwarden.base.conncap import to_close


def test_the_busiest_source_loses_first_a_replied_connection_before_an_older_one():
    # (name, source, replied), the longest waiting first
    waiting = [("a-old", "10.0.0.1", False), ("crowd-1", "127.0.0.0/8", False), ("crowd-2", "127.0.0.0/8", True),
               ("crowd-3", "127.0.0.0/8", False)]
    sources = ["10.0.0.1", "10.0.0.1", "127.0.0.0/8", "127.0.0.0/8", "127.0.0.0/8"]  # one 10.0.0.1 being answered
    pick = lambda ws, srcs: to_close(srcs, ws, lambda c: c[1], lambda c: c[2])  # noqa: E731
    assert pick(waiting, sources)[0] == "crowd-2"  # the crowd's, and of its own the one already replied to
    assert pick([w for w in waiting if w[0] != "crowd-2"], sources)[0] == "crowd-1"  # else its longest waiting
    assert pick([waiting[0]], sources)[0] == "a-old"  # only one waits: that one
    assert pick([], sources) is None  # every connection is being answered: none to close


def test_a_tie_between_sources_goes_to_the_one_waiting_longest():
    waiting = [("first", "a", False), ("second", "b", False)]
    assert to_close(["a", "b"], waiting, lambda c: c[1], lambda c: c[2])[0] == "first"
