"""serve.idle's watts saved (issue 54, design/idle-engine.md "What is shown"): watch/signals/serving.RestSavings, the
rows it feeds and the status line that says it. Unit tests: polls fed by hand, a clock the test holds."""

import pytest

from gpuwarden.gpu.base import GpuSample
from gpuwarden.serving.probe.metrics import ServingStats
from gpuwarden.serving.run.supervisor import ServingView
from gpuwarden.watch.signals.serving import RestSavings

QUIET, BUSY = ServingStats(requests_running=0, requests_waiting=0), ServingStats(requests_running=3, requests_waiting=1)


def engine(state="RUNNING", clocks_rest=False, gpus=(0, 1)):
    return ServingView(state, "/m/Qwen3-4B", "generic", None, 0, None, 30.0, None, gpus=gpus, clocks_rest=clocks_rest)


def cards(*watts, limit=700.0):
    """GPU0, GPU1, ... at these watts; None: a GPU that did not answer the poll."""
    return [GpuSample(i, f"GPU-{i}", "H200", f"0000:{i:02x}:00.0", "9.0", up=w is not None, power_w=w,
                      power_limit_w=limit, utilization_pct=0 if w is not None and w < 300 else 95)
            for i, w in enumerate(watts)]


def test_a_rest_saves_the_cards_own_quiet_awake_draw_minus_its_draw_now_and_not_the_first_quiet_poll_after_work():
    s = RestSavings()
    assert s.add(engine(), BUSY, cards(400.0, 380.0), 0.0) == ()
    assert s.add(engine(), QUIET, cards(200.0, 190.0), 1.0) == ()  # the clock still coming down: not taken
    assert s.add(engine(), QUIET, cards(116.0, 110.0), 2.0) == ()
    assert s.add(engine(), QUIET, cards(118.0, 112.0), 3.0) == ()
    saved = s.add(engine("RESTING"), None, cards(77.0, 76.0), 4.0)
    assert saved == ((0, pytest.approx(40.0), "seen"), (1, pytest.approx(35.0), "seen"))
    # the clocks action: the engine runs, its GPUs at rest; what it draws is the same question
    assert s.add(engine(clocks_rest=True), QUIET, cards(80.0, 76.0), 5.0)[0] == (0, pytest.approx(37.0), "seen")


def test_the_awake_draw_is_the_last_minute_of_quiet_polls_and_a_card_drawing_more_at_rest_saves_nothing():
    s = RestSavings()
    s.add(engine(), QUIET, cards(300.0), 0.0)
    s.add(engine(), QUIET, cards(300.0), 1.0)  # a minute and more before the rest: dropped
    for t in range(70, 75):
        s.add(engine(), QUIET, cards(100.0), float(t))
    assert s.add(engine("RESTING", gpus=(0,)), None, cards(90.0), 75.0) == ((0, pytest.approx(10.0), "seen"),)
    assert s.add(engine("RESTING", gpus=(0,)), None, cards(130.0), 76.0) == ((0, 0.0, "seen"),)


def test_a_card_busy_by_its_own_reading_is_not_quiet_whatever_the_engine_says_nor_a_draw_seen_an_hour_ago():
    """Attacker 47's F6: an engine that says 0 running while it keeps its card busy made its busy draw the awake one
    (573 W saved where 43 W were); an awake draw from long ago is not today's."""
    s = RestSavings()
    for t in range(4):
        s.add(engine(gpus=(0,)), QUIET, cards(573.0), float(t))  # 95 % busy: the engine's 0 is not believed
    assert s.add(engine("RESTING", gpus=(0,)), None, cards(77.0), 5.0)[0][2] == "h200"
    for t in range(10, 14):
        s.add(engine(gpus=(0,)), QUIET, cards(120.0), float(t))
    assert s.add(engine("RESTING", gpus=(0,)), None, cards(77.0), 15.0)[0] == (0, pytest.approx(43.0), "seen")
    assert s.add(engine("RESTING", gpus=(0,)), None, cards(77.0), 13.0 + RestSavings.STALE_S + 1)[0][2] == "h200"


def test_with_no_quiet_poll_seen_the_saving_is_the_h200s_context_cost_scaled_by_the_cards_limit_and_within_it():
    s = RestSavings()
    s.add(engine(), None, cards(116.0), 0.0)  # no counters from the engine: nothing known of its requests
    s.add(engine(), None, cards(116.0), 1.0)
    (gpu, watts, source), = s.add(engine("RESTING", gpus=(0,)), None, cards(40.0, limit=300.0), 2.0)
    assert (gpu, source) == (0, "h200") and watts == pytest.approx((116.2 - 76.9) * 300 / 700)
    # a card at rest drawing near its limit (a sensor's lie, or another's load the check missed): awake it could
    # draw no more than the limit, so the estimate is no more than what is left under it
    (_, watts, source), = s.add(engine("RESTING", gpus=(0,)), None, cards(290.0, limit=300.0), 3.0)
    assert source == "h200" and watts == pytest.approx(10.0)
    (_, watts, _), = s.add(engine("RESTING", gpus=(0,)), None, cards(310.0, limit=300.0), 4.0)
    assert watts == 0.0


def test_only_the_engines_gpus_that_answered_count_and_the_joules_add_up_over_each_rests_polls():
    s = RestSavings()
    for t in range(3):
        s.add(engine(gpus=(1,)), QUIET, cards(500.0, 120.0, None), float(t))
    assert s.add(engine("RESTING", gpus=(1, 2)), None, cards(500.0, 80.0, None), 10.0) == \
        ((1, pytest.approx(40.0), "seen"),)  # GPU0 is not the engine's; GPU2 did not answer
    assert s.joules == 0.0  # one poll of a rest: no interval yet
    s.add(engine("RESTING", gpus=(1, 2)), None, cards(500.0, 80.0, None), 20.0)
    assert s.joules == pytest.approx(400.0)
    assert s.add(engine(gpus=(1,)), BUSY, cards(500.0, 300.0, None), 30.0) == ()  # awake: the wake's poll saves none
    s.add(engine("RESTING", gpus=(1, 2)), None, cards(500.0, 80.0, None), 100.0)  # the next rest's first poll
    assert s.joules == pytest.approx(400.0)  # the awake span between two rests is not counted
    assert s.add(None, None, cards(80.0), 101.0) == ()


def test_the_rows_and_the_status_line_say_the_saving_and_where_its_awake_draw_came_from():
    from gpuwarden.watch.monitor import Snapshot
    from gpuwarden.watch.signals.serving import ROWS

    view = ServingView("RESTING", "/m/Qwen3-4B", "generic", None, 0, None, 30.0, None, rests=2, wake_s=31.2)
    snap = Snapshot(0.0, 0.0, (), (), children=(view,), idle_saved=((0, 39.6, "seen"), (1, 20.1, "h200")),
                    idle_saved_joules=1234.5)
    rows = {row.name: row for row in ROWS}
    watts = rows["gpuwarden_serving_idle_saved_watts"]
    assert watts.shown(snap) and list(watts.samples(snap)) == [(("0", "seen"), 39.6), (("1", "h200"), 20.1)]
    assert list(rows["gpuwarden_serving_idle_saved_joules"].samples(snap)) == [((), 1234.5)]
    assert snap._serving_part(True).endswith("its last wake took 31 s; saving 60 W (seen awake and estimated)")
    assert "saving" not in snap._serving_part(False)  # STATUS= moves with the state, not with each poll's watts
    awake = Snapshot(0.0, 0.0, (), (), children=(ServingView("RUNNING", "/m/Qwen3-4B", "generic", None, 0, None, 30.0,
                                                             None, rests=2),))
    assert not watts.shown(awake) and rows["gpuwarden_serving_idle_saved_joules"].shown(awake)
    assert snap.as_dict()["idle_saved"][1] == {"gpu": 1, "watts": 20.1, "source": "h200"}
