"""Attacks on issue 43's surfaces: the power budget's config keys, its mover against NVML answers that lie, and
tune's lease-lost signal. Each test is a fault found by the attack, fixed."""

from __future__ import annotations

import dataclasses
import logging

import pytest

from gpuwarden import config
from gpuwarden.base.yamlfile import ConfigErrors
from gpuwarden.gpu import errors
from gpuwarden.tune.channel import LeaseLost, SweepClient
from gpuwarden.tune.tuning import Tuner, TuningLife

from test_power_budget import X2, _backend


def _lying(gpu, **fields):
    """This card's samples answer these fields instead of the truth (a driver or backend that lies)."""
    real = gpu.sample

    def sample(counters=None):
        s = real(counters)
        return dataclasses.replace(s, **fields) if s.up else s
    gpu.sample = sample


def _play(tmp_path, seconds, hook=None, setup=None):
    """The budget's daemon on two 600 W cards under 800 W, polled every 100 ms; the largest enforced sum seen after
    the first few polls (the driver's defaults, 600 + 600 W, are where it starts)."""
    backend, cfg, clock = _backend(tmp_path, X2, 800)
    life = TuningLife(backend, cfg, Tuner(backend))
    if setup is not None:
        setup(backend)
    worst = 0.0
    for n in range(int(seconds * 10)):
        clock.advance(0.1)
        samples = [g.sample() for g in backend.gpus()]
        life.budget_tick(hook(n, samples) if hook else samples, clock())
        if n > 2:
            worst = max(worst, sum(g.power_limit_w for g in backend.gpus()))
    return worst, life


@pytest.mark.parametrize("reading", [float("nan"), -1000.0])
def test_a_limit_read_back_as_nan_or_negative_never_lets_the_sum_pass_the_budget(tmp_path, reading, caplog):
    # Before: a NaN reading made every comparison false: GPU 1 kept its default 600 W beside GPU 0's, 1,200 W in
    # all, and nothing was said. Now a reading that is no watts is unreadable, and counted conservatively.
    worst, life = _play(tmp_path, 20, setup=lambda b: _lying(b.gpus()[1], power_limit_w=reading))
    assert worst <= 800
    assert life.budget.fallback == "GPU 1 did not read back its limit"
    assert caplog.text.count("holding a static split") == 1


def test_constraints_that_make_no_sense_give_no_negative_limit_nor_a_warning_a_second(tmp_path, caplog):
    # Before: a range of -500..-100 W split to -99 W, which the card refused every second (18 warnings in 20 s),
    # while its 600 W default stood beside GPU 0's 600 W. Now such a range is unknown: capabilities() give it.
    worst, life = _play(tmp_path, 20, setup=lambda b: _lying(b.gpus()[1], power_limit_min_w=-500.0,
                                                            power_limit_max_w=-100.0))
    assert worst <= 800 and min(life.budget.alloc.values()) >= 150
    assert "FAILED" not in caplog.text


def test_a_card_whose_set_fails_is_not_set_again_every_second(tmp_path, caplog):
    def refuse(watts):
        raise errors.GpuError("setting the power limit was refused (NVML_ERROR_NO_PERMISSION)")

    def setup(backend):
        backend.gpus()[1].set_power_limit_w = refuse
    with caplog.at_level(logging.INFO):
        worst, life = _play(tmp_path, 60, setup=setup)
    assert caplog.text.count("NVML_ERROR_NO_PERMISSION") <= 1  # before: one warning a second, the sum over budget
    assert life.budget.fallback == "GPU 1 did not read back its limit"


def test_a_gpu_lost_and_back_every_few_seconds_is_one_line_a_minute(tmp_path, caplog):
    def flap(n, samples):  # GPU 1 lost for 3 s, back for 3 s, for 3 minutes
        if n // 30 % 2:
            samples[1] = dataclasses.replace(samples[1], up=False, power_limit_w=None)
        return samples
    with caplog.at_level(logging.INFO):
        worst, life = _play(tmp_path, 180, hook=flap)
    lines = [r for r in caplog.records if "power budget" in r.getMessage()]
    assert 1 <= len(lines) <= 4, [r.getMessage() for r in lines]  # before: a warning and a notice every 6 s
    assert "not logged: a GPU flaps" in lines[-1].getMessage()
    assert worst <= 800


def test_a_card_never_read_counts_at_its_maximum(tmp_path):
    # GPU 0 gives no reading from the first poll (its limit, the driver's 600 W, is unknown): GPU 1 is not raised
    # into room that only exists if GPU 0 enforced nothing.
    def setup(backend):
        backend.gpus()[1].set_power_limit_w(150)
    worst, life = _play(tmp_path, 20, setup=setup,
                        hook=lambda n, s: [dataclasses.replace(s[0], up=False, power_limit_w=None), s[1]])
    assert worst <= 800


@pytest.mark.parametrize("key", ["\u0660", "00", "01"])
def test_a_share_key_no_gpu_index_spells_is_refused(key):
    # "٠" (Arabic-Indic zero) and "00" passed str.isdigit() and weighed no GPU, silently.
    with pytest.raises(ConfigErrors, match="not a GPU index or UUID"):
        config.parse_text(f"tuning:\n  power_budget_w: 800\n  power_shares: {{'{key}': 2}}\n")


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
