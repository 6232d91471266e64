"""base/faultlog.py: one FaultLog for the proxy (a period for each kind) and the metrics endpoint (one period for
all kinds, every line a count for each kind)."""

import logging

from gpuwarden.base.faultlog import FaultLog

log = logging.getLogger("gpuwarden.test-faultlog")


def test_a_flood_of_one_kind_is_its_first_line_then_a_count_a_period(caplog):
    now = [0.0]
    faults = FaultLog(log, "x: {last}", "x: {count} more {kind} in {period:g} s; the last: {last}", 10,
                      lambda: now[0])
    with caplog.at_level(logging.INFO, logger=log.name):
        for i in range(50):
            faults.note("bad", f"bad {i}")
        faults.note("worse", "worse 0", logging.ERROR)
        faults.flush()  # the period is not over
        now[0] = 10
        faults.flush()
        faults.flush()  # said once
        now[0] = 15
        faults.note("bad", "bad 50")  # within the period the count line opened: counted
        now[0] = 20
        faults.flush()
        now[0] = 31
        faults.note("bad", "bad 51")  # a quiet period went by: told at once
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [
        (logging.WARNING, "x: bad 0"), (logging.ERROR, "x: worse 0"),
        (logging.WARNING, "x: 49 more bad in 10 s; the last: bad 49"),
        (logging.WARNING, "x: 1 more bad in 10 s; the last: bad 50"), (logging.WARNING, "x: bad 51")]


def test_one_period_for_all_kinds_counts_each_kind_in_one_line(caplog):
    now = [0.0]
    line = "faults: {counts} (the last from {last})"
    faults = FaultLog(log, line, line, 60, lambda: now[0], level=logging.INFO, by_kind=False)
    with caplog.at_level(logging.INFO, logger=log.name):
        faults.note("hung up", "a")
        faults.note("hung up", "b")
        faults.note("unauthorized", "c")
        faults.note("unauthorized", "d")
        faults.note("unauthorized", "e")
        now[0] = 59
        faults.flush()
        now[0] = 60
        faults.flush()
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [
        (logging.INFO, "faults: 1 hung up (the last from a)"),
        (logging.INFO, "faults: 3 unauthorized, 1 hung up (the last from e)")]


def test_a_traceback_only_the_first_time_a_kind_is_seen(caplog):
    now = [0.0]
    faults = FaultLog(log, "{last}", "{count} more", 1, lambda: now[0])
    try:
        raise ValueError("ours")
    except ValueError as exc:
        info = (type(exc), exc, exc.__traceback__)
    with caplog.at_level(logging.INFO, logger=log.name):
        faults.note("bug", "one", exc_info=info)
        now[0] = 5
        faults.note("bug", "two", exc_info=info)  # a new period, but not a new kind
    assert [r.exc_info is not None for r in caplog.records] == [True, False]


def test_without_a_count_line_a_kind_is_said_at_most_once_a_period(caplog):
    now = [0.0]
    errors = FaultLog(log, "{last}", None, 60, lambda: now[0], level=logging.ERROR)
    with caplog.at_level(logging.INFO, logger=log.name):
        for t in (0, 1, 30, 59.9, 60, 61):
            now[0] = t
            errors.note("poll failed: X", "poll failed: X")
            errors.flush()
        errors.note("serving: Y", "serving: Y")
    assert [r.getMessage() for r in caplog.records] == ["poll failed: X", "poll failed: X", "serving: Y"]


def test_admit_tells_a_caller_that_words_its_own_line_when_and_how_many_since(caplog):
    # the GPU events' book: its own line, with the count the period dropped inside the kind's next one
    quiet = FaultLog(log, period_s=600)
    assert quiet.admit("0 xid 13", 0.0) == 0  # the first: said, nothing before it
    assert [quiet.admit("0 xid 13", t) for t in (0.5, 599.9)] == [None, None]  # counted
    assert quiet.admit("0 xid 31", 1.0) == 0  # another kind has its own period
    assert quiet.admit("0 xid 13", 600.0) == 2  # a new period: said, with the two dropped since the last line
    assert quiet.admit("0 xid 13", 1200.0) == 0
    assert not caplog.records  # admit logs nothing itself
