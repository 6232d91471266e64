"""gpuwarden bench's joules per request (bench/joules.py): the proxy's histogram read before and after a step, the
step's quantiles as Prometheus reads buckets. Unit tests on the proxy's own exposition."""

import math

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from gpuwarden.bench.joules import parse, quantile, step_joules
from gpuwarden.proxy.joules import Joules


def page(observations: dict[str, list[float]]) -> str:
    """The proxy's /metrics with these joules observed, by model (the histogram proxy/joules.py registers)."""
    registry = CollectorRegistry()
    joules = Joules(None, "m", registry)
    for model, values in observations.items():
        for v in values:
            joules.joules.labels(model).observe(v)
    return generate_latest(registry).decode()


def test_the_histogram_is_read_whole_and_summed_over_models_and_a_page_without_it_is_none():
    reading = parse(page({"a": [3.0, 7.0], "b": [60.0]}))
    assert reading["count"] == 3 and reading["sum"] == pytest.approx(70.0)
    assert reading["buckets"][5] == 1 and reading["buckets"][10] == 2 and reading["buckets"][math.inf] == 3
    assert parse("vllm:num_requests_running 0\n# HELP x\n") is None  # an engine's own page


def test_a_steps_quantiles_come_from_the_difference_of_two_readings():
    before = parse(page({"m": [1000.0] * 4}))  # an earlier step's requests, far above
    after = parse(page({"m": [1000.0] * 4 + [3.0] * 50 + [7.0] * 40 + [40.0] * 10}))
    step = step_joules(before, after)
    assert step["joules_requests"] == 100
    assert step["joules_per_request_mean"] == pytest.approx((150 + 280 + 400) / 100)
    assert 2.5 <= step["joules_per_request_p50"] <= 5  # in the bucket of the 3 J requests, interpolated
    assert 5 <= step["joules_per_request_p90"] <= 10 and 25 <= step["joules_per_request_p99"] <= 50
    assert step_joules(before, before) == {"joules_requests": 0}
    assert step_joules(None, after) == {}


def test_quantile_reads_buckets_as_prometheus_does():
    assert quantile({1.0: 0, 2.0: 10, math.inf: 10}, 0.5) == pytest.approx(1.5)
    assert quantile({1.0: 5, math.inf: 10}, 0.9) == 1.0  # past the last finite bucket: its bound
    assert quantile({1.0: 0, math.inf: 0}, 0.5) is None and quantile({}, 0.5) is None
