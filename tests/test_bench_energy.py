"""bench's and tune's energy figures: none where the GPUs' draw did not rise above idle by more than the readings
can tell apart (bench/energy.py), the reason said instead, in --json and under the tables."""

import pytest

from gpuwarden.bench.energy import ABOVE_IDLE_MIN_SHARE, ABOVE_IDLE_MIN_W, NOT_ABOVE_IDLE, above_idle_measurable, \
    step_energy
from gpuwarden.bench.report import energy_notes
from gpuwarden.bench.tune import find_knee, render

FIGURES = ("joules_per_token", "tokens_per_joule", "joules_per_token_above_idle", "tokens_per_joule_above_idle")


def step(watts, tokens=600, duration=2.0):
    return {"output_tokens": tokens, "duration_s": duration, "gpus": [{"power_w_mean": w} for w in watts]}


def test_the_floor_is_a_watt_a_gpu_or_a_percent_of_the_draw_whichever_is_larger():
    assert (ABOVE_IDLE_MIN_W, ABOVE_IDLE_MIN_SHARE) == (1.0, 0.01)
    assert not above_idle_measurable(31.9, 31.9 - 8.1e-18, 1)  # the 8.1e-18 J/token: equal to idle
    assert not above_idle_measurable(31.5, 31.0, 1) and above_idle_measurable(32.0, 31.0, 1)  # 1 W for one GPU
    assert not above_idle_measurable(61.5, 60.0, 2) and above_idle_measurable(62.0, 60.0, 2)  # 1 W each for two
    assert not above_idle_measurable(600.0, 595.0, 1) and above_idle_measurable(600.0, 594.0, 1)  # 1 % of 600 W
    assert not above_idle_measurable(30.0, 31.0, 1)  # below idle


def test_no_rise_above_idle_gives_no_figure_and_the_reason():
    e = step_energy(step([31.9]), idle_w=31.9)
    assert [e[k] for k in FIGURES] == [None] * 4 and e["energy_note"] == NOT_ABOVE_IDLE
    assert e["gpu_watts_mean"] == 31.9 and e["energy_j"] == pytest.approx(63.8)  # the reading stays
    served = step_energy(step([250.0, 350.0]), idle_w=100.0)
    assert served["energy_note"] is None and served["tokens_per_joule_above_idle"] == 0.6
    # no idle measured (--idle 0): nothing to judge the rise against, the figures with the idle draw stand
    unjudged = step_energy(step([31.9]), idle_w=None)
    assert unjudged["tokens_per_joule"] == pytest.approx(600 / 63.8) and unjudged["energy_note"] is None
    # no tokens served: nothing divided, and nothing to explain
    assert step_energy(step([31.9], tokens=0), idle_w=31.9)["energy_note"] is None


def test_tunes_table_says_why_and_finds_no_knee_on_such_steps():
    steps = [dict(step_energy(step([70.0]), 70.0), setting=v, system_tokens_per_s=300.0) for v in (400, 300)]
    assert find_knee(steps, 0.9) is None
    text = render({"unit": "W", "steps": steps, "model": "m", "url": "u", "setting": "power_limit_w",
                   "concurrency": 4, "input_len": 8, "output_len": 32, "duration_s": 2, "idle_w": 70.0})
    rows = text.splitlines()[2:4]
    assert [r.split()[-2:] for r in rows] == [["-", "-"], ["-", "-"]]  # tok/J, tok/J >idle
    assert f"J/tok and tok/J not given at 400 W, 300 W: {NOT_ABOVE_IDLE}" in text.splitlines()
    assert "knee: none (no step reported both tok/s and tok/J)" in text
    assert energy_notes([{"concurrency": 1, "energy_note": None}], str) == []
