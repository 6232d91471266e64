"""Joules per request, the ledger (proxy/energy.py, design/joules-per-request.md): each interval's whole millijoules
split over the requests in flight by their tokens in it, the rest idle, with exact figures; the conservation law
over a seeded random schedule; the bounds. Unit tests: no clock but the figures given."""

import random

import pytest

from gpuwarden.proxy.energy import GONE_S, Interval, Ledger, Request, split


def run(ledger: Ledger, request: Request) -> list[Request]:
    ledger.begin(request.rid, request.sent)
    return ledger.end(request)


def test_two_requests_overlapping_share_the_interval_by_their_tokens_the_remainder_to_the_larger():
    ledger = Ledger()
    a = Request(1, sent=0.0, first=0.0, end=1.0, output=200)
    b = Request(2, sent=0.0, first=0.0, end=1.0, output=100)
    run(ledger, a), run(ledger, b)
    finals = ledger.add(Interval(0.0, 1.0, {"0": 1000, "1": 900}))
    assert {r.rid for r in finals} == {1, 2}
    assert (a.mj["0"], b.mj["0"]) == (667, 333)  # 666.67 and 333.33: the larger remainder gets the last mJ
    assert (a.mj["1"], b.mj["1"]) == (600, 300)
    assert ledger.apportioned == {"0": 1000, "1": 900} and not ledger.idle


def test_prompt_tokens_weigh_over_the_prefill_and_output_tokens_over_the_decode():
    ledger = Ledger()
    # A's prefill is [0, 1) with 100 prompt tokens, its decode [1, 3) with 100 output tokens: 100 in the first
    # second, 50 in each of the next two; B decodes 50 tokens over [0, 3): 16.67 a second
    a = Request(1, sent=0.0, first=1.0, end=3.0, prompt=100, output=100)
    b = Request(2, sent=0.0, first=0.0, end=3.0, output=50)
    run(ledger, a), run(ledger, b)
    for t in range(3):
        ledger.add(Interval(float(t), t + 1.0, {"0": 700}))
    assert a.mj["0"] == 600 + 525 + 525 and b.mj["0"] == 100 + 175 + 175
    assert a.mj["0"] + b.mj["0"] == 2100


def test_twice_the_tokens_over_the_same_span_get_twice_the_joules():
    ledger = Ledger()
    small = Request(1, sent=0.2, first=0.7, end=4.3, prompt=30, output=60)
    large = Request(2, sent=0.2, first=0.7, end=4.3, prompt=60, output=120)
    run(ledger, small), run(ledger, large)
    for t in range(5):
        ledger.add(Interval(float(t), t + 1.0, {"0": 77_777}))
    assert large.joules == pytest.approx(2 * small.joules, rel=0.05)
    assert large.joules == pytest.approx(2 * small.joules, abs=0.005)  # one mJ of rounding an interval at most


def test_an_interval_with_nothing_in_flight_is_idle_and_one_waits_for_the_requests_that_overlap_it():
    ledger = Ledger()
    assert ledger.add(Interval(0.0, 1.0, {"0": 500})) == []
    assert ledger.idle == {"0": 500}
    ledger.begin(7, 1.5)
    assert ledger.add(Interval(1.0, 2.0, {"0": 800})) == []  # 7 is in flight: its tokens are not known yet
    assert ledger.add(Interval(2.0, 3.0, {"0": 800})) == []
    assert ledger.measured == {"0": 500}
    finals = ledger.end(Request(7, sent=1.5, first=1.5, end=2.5, output=10))
    assert [r.rid for r in finals] == [7] and finals[0].mj["0"] == 800 + 800
    assert ledger.measured == {"0": 2100} and ledger.idle == {"0": 500} and ledger.apportioned == {"0": 1600}


def test_a_request_ended_is_final_once_the_intervals_up_to_its_end_settled_and_late_ones_with_what_they_have():
    ledger = Ledger()
    r = Request(1, sent=0.5, first=0.6, end=1.5, output=10)
    assert run(ledger, r) == []
    assert ledger.add(Interval(0.0, 1.0, {"0": 100})) == []  # half of it: not final
    assert [x.rid for x in ledger.add(Interval(1.0, 2.0, {"0": 100}))] == [1]
    late = Request(2, sent=10.0, first=10.0, end=11.0, output=5)
    run(ledger, late)
    assert ledger.expire(11.0 + GONE_S - 1) == []
    (final,) = ledger.expire(11.0 + GONE_S + 1)  # the daemon sent nothing since: final, marked partial
    assert final.rid == 2 and final.partial and final.joules == 0


def test_intervals_backwards_or_overlapping_or_negative_are_refused_and_counted():
    ledger = Ledger()
    ledger.add(Interval(5.0, 6.0, {"0": 10}))
    for bad in (Interval(4.0, 5.5, {"0": 1}), Interval(7.0, 7.0, {"0": 1}), Interval(6.0, 7.0, {"0": -1}),
                Interval(8.0, 7.5, {"0": 1})):
        assert ledger.add(bad) == []
    assert ledger.rejected == 4 and ledger.measured == {"0": 10}


def test_a_long_request_in_flight_holds_back_nobodys_joules_its_intervals_settle_with_its_tokens_so_far():
    """Attacker 48's F1: a stream of ten minutes held every interval it overlapped, so the short requests beside it
    were made final with 0 J and it took nearly all. Now an interval waits LATE_S at most: then the long one weighs
    by its tokens so far (its estimated prompt over its prefill so far, its events over its decode so far)."""
    ledger = Ledger()
    ledger.begin(1, 0.0, prompt=100)  # the long one: its body's bytes over 4
    ledger.progress(1, 1.0, 0)
    finals = []
    for t in range(40):  # a short request each second beside it, 10 prompt + 10 output tokens
        short = Request(100 + t, sent=t + 0.1, first=t + 0.3, end=t + 0.9, prompt=10, output=10)
        ledger.begin(short.rid, short.sent)
        finals += ledger.end(short)
        ledger.progress(1, 1.0, 20 * (t + 1))  # it streams 20 tokens a second
        finals += ledger.add(Interval(float(t), t + 1.0, {"0": 1000}), now=t + 1.0)
        finals += ledger.expire(t + 1.0)
    assert len(finals) >= 25 and all(r.joules > 0 and not r.partial for r in finals), \
        [(r.rid, r.joules, r.partial) for r in finals if r.joules == 0 or r.partial]
    # each short one weighed 20 tokens against the long one's 20 a second: about half of its second; the first
    # against the long one's prefill, 100 prompt tokens in that second: a sixth
    assert all(0.3 <= r.joules <= 0.7 for r in finals if r.sent > 1), sorted(r.joules for r in finals)
    assert next(r for r in finals if r.rid == 100).joules == pytest.approx(1 / 6, abs=0.002)
    finals += ledger.end(Request(1, sent=0.0, first=1.0, end=40.0, prompt=100, output=800)) + \
        ledger.add(Interval(40.0, 41.0, {"0": 1000}), now=41.0) + ledger.expire(100.0)
    long = next(r for r in finals if r.rid == 1)
    assert long.estimated and 10 < long.joules < 30 and len(finals) == 41
    assert ledger.measured == {"0": 41_000} and ledger.apportioned["0"] + ledger.idle["0"] == 41_000


def test_an_answer_not_streamed_spreads_all_its_tokens_over_its_span_and_in_flight_weighs_at_the_rate_seen():
    """The re-check's N2: a non-streamed answer's first byte is its end, so its output tokens sat on its last instant,
    and in flight it weighed its estimated prompt alone: a 30 s answer of 3,000 tokens beside streams of 200 tokens
    a second got 2 % of its share. Now its tokens spread over its span (`whole`), and in flight, with no byte back,
    it weighs at the output rate the ended requests had: within 2x of its share by the tokens."""
    ledger = Ledger()
    ledger.begin(1, 0.0, prompt=3)  # the long one, not streamed: 10 prompt + 3,000 output tokens over 30 s
    finals = []
    for t in range(30):  # a stream a second beside it: 100 prompt + 100 output tokens over its second
        stream = Request(100 + t, sent=t + 0.0, first=t + 0.1, end=t + 1.0, prompt=100, output=100)
        ledger.begin(stream.rid, stream.sent)
        finals += ledger.end(stream)
        finals += ledger.add(Interval(float(t), t + 1.0, {"0": 1000}), now=t + 1.0) + ledger.expire(t + 1.0)
    finals += ledger.end(Request(1, sent=0.0, first=30.0, end=30.0, prompt=10, output=3000, whole=True))
    finals += ledger.add(Interval(30.0, 31.0, {"0": 1000}), now=31.0) + ledger.expire(100.0)
    long = next(r for r in finals if r.rid == 1)
    streams = sum(r.joules for r in finals if r.rid != 1)
    share = 30.0 * 3010 / (3010 + 30 * 200)  # its tokens of all tokens over the 30 s
    assert share / 2 <= long.joules <= share * 2, (long.joules, share)
    assert long.joules + streams == pytest.approx(30.0, abs=0.001) and len(finals) == 31
    # once ended within LATE_S of its intervals, the model's own figure: 2 tokens in each of two equal intervals
    ledger = Ledger()
    finals = run(ledger, Request(1, sent=0.0, first=2.0, end=2.0, prompt=1, output=3, whole=True))
    finals += run(ledger, Request(2, sent=0.0, first=0.1, end=2.0, prompt=1, output=3))
    finals += ledger.add(Interval(0.0, 1.0, {"0": 1000})) + ledger.add(Interval(1.0, 2.0, {"0": 1000}))
    whole = next(r for r in finals if r.rid == 1)
    # its 4 tokens, 2 in each interval, against the other's prompt (in the first) and output (over both)
    expect = 1000 * 2 / (2 + 1 + 3 * 0.9 / 1.9) + 1000 * 2 / (2 + 3 * 1.0 / 1.9)
    assert whole.mj["0"] == pytest.approx(expect, abs=1)


def test_joules_given_in_flight_stay_with_a_try_sent_again_and_go_to_nobody_when_it_ends_unanswered():
    """The re-check's N7: a try sent anew lost what it had been given in flight, and a request ended with no answer
    kept its share in the requests' book that no request's joules summed to."""
    ledger = Ledger()
    ledger.begin(1, 0.0, prompt=10)
    ledger.begin(2, 0.0, prompt=10)
    ledger.add(Interval(0.0, 1.0, {"0": 1000}), now=20.0)  # past LATE_S: settled with both in flight
    assert ledger.flight[1].mj["0"] == 500 and ledger.flight[2].mj["0"] == 500
    ledger.begin(1, 1.5, prompt=10)  # sent again: the engine went down and came back
    assert ledger.flight[1].mj["0"] == 500
    ledger.forget(2)  # given up: no answer
    assert ledger.apportioned["0"] == 500 and ledger.unattributed["0"] == 500
    finals = ledger.end(Request(1, sent=1.5, first=1.6, end=1.9, prompt=10, output=10))
    finals += ledger.add(Interval(1.0, 2.0, {"0": 1000}), now=21.0)
    assert [r.joules for r in finals] == [1.5]
    assert ledger.apportioned["0"] == 1500 and ledger.measured["0"] == 2000 and ledger.unattributed["0"] == 500


def test_ended_requests_are_final_in_the_order_of_their_ends_and_the_bound_takes_the_first_ended(monkeypatch):
    """The re-check's N8: the ended requests were scanned at every end (0.9 ms an end at the bound, a feed stalled);
    they wait in a heap by their end now. Whatever order they end in, each is final once the intervals reach its
    end, the bound makes the first ended final (partial), and a rid that ends again is not taken by its old entry."""
    from gpuwarden.proxy import energy

    monkeypatch.setattr(energy, "MAX_DONE", 3)
    ledger = Ledger()
    finals = []
    for rid, end in ((1, 5.0), (2, 2.0), (3, 4.0)):
        finals += run(ledger, Request(rid, sent=0.5, first=0.6, end=end, prompt=1, output=1))
    finals += ledger.add(Interval(0.0, 3.0, {"0": 300}))
    assert [r.rid for r in finals] == [2] and set(ledger.done) == {1, 3}
    finals += run(ledger, Request(4, sent=3.5, first=3.6, end=6.0, prompt=1, output=1))
    finals += run(ledger, Request(5, sent=3.5, first=3.6, end=7.0, prompt=1, output=1))  # past the bound of 3
    assert [r.rid for r in finals] == [2, 3] and finals[-1].partial and set(ledger.done) == {1, 4, 5}
    finals += ledger.add(Interval(3.0, 6.5, {"0": 350}))
    assert [r.rid for r in finals] == [2, 3, 1, 4] and list(ledger.done) == [5]
    finals += run(ledger, Request(1, sent=6.6, first=6.7, end=9.0, prompt=1, output=1))  # rid 1 again, later
    finals += ledger.add(Interval(6.5, 8.0, {"0": 150}))
    assert [r.rid for r in finals] == [2, 3, 1, 4, 5] and list(ledger.done) == [1]
    assert sum(ledger.measured.values()) == 800 == sum(ledger.apportioned.values()) + sum(ledger.idle.values()) + \
        sum(ledger.unattributed.values())


def test_the_shares_idle_and_unattributed_sum_to_the_measured_energy_exactly_over_five_minutes_of_random_work():
    rng = random.Random(56)
    ledger, finals, rid = Ledger(), [], 0
    events = []
    for _ in range(400):  # requests of 0.05 to 20 s over 300 s, some of no tokens
        sent = rng.uniform(0, 300)
        first = sent + rng.choice([0.0, rng.uniform(0.001, 2.0)])
        end = first + rng.choice([0.0, rng.uniform(0.001, 18.0)])
        rid += 1
        events.append((sent, "begin", Request(rid, sent, first, end, rng.randint(0, 4000), rng.randint(0, 900))))
        events.append((end, "end", events[-1][2]))
    t = 0.0
    while t < 320:  # the daemon's polls, 0.5 to 1.5 s apart, 8 GPUs of 50 W to 700 W
        t1 = t + rng.uniform(0.5, 1.5)
        events.append((t1, "interval", Interval(t, t1, {str(g): rng.randint(25_000, 1_050_000) for g in range(8)})))
        t = t1
    for _, kind, what in sorted(events, key=lambda e: (e[0], e[1] != "begin")):
        if kind == "begin":
            ledger.begin(what.rid, what.sent)
        elif kind == "end":
            finals += ledger.end(what)
        else:
            finals += ledger.add(what)
    finals += ledger.expire(10_000.0)
    assert len(finals) == 400 and not ledger.open and not ledger.flight and not ledger.done
    for g in map(str, range(8)):
        assert ledger.measured[g] == ledger.apportioned[g] + ledger.idle[g] + ledger.unattributed[g]
        assert sum(r.mj[g] for r in finals) == ledger.apportioned[g]
    assert sum(ledger.idle.values()) > 0 and sum(ledger.apportioned.values()) > 0


def test_split_is_exact_and_gives_a_tie_to_the_earlier():
    assert split(10, [1, 1, 1]) == [4, 3, 3]
    assert split(0, [5, 7]) == [0, 0]
    assert split(1_000_003, [333, 333, 334]) == [333_001, 333_001, 334_001]  # remainders .999, .999, .002
    parts = split(987_654_321, [3, 11, 13, 101])
    assert sum(parts) == 987_654_321 and all(p >= 0 for p in parts)
