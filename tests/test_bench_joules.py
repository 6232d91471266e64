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
    assert parse(page({}))["count"] == 0  # the proxy's before its first request: the family, no sample


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


def test_a_step_whose_joules_are_not_bench_s_alone_says_why():
    """Attacker 51's finding 6: the histogram is the whole proxy's, and a settle that ran out was silent."""
    from gpuwarden.bench.joules import doubts

    settled = {"pending": 0.0}
    assert doubts({"concurrency": 4, "ok": 8, "joules_requests": 8}, settled) == []
    assert doubts({"concurrency": 4, "ok": 8}, None) == []  # straight to the engine: said once elsewhere
    late, other = doubts({"concurrency": 4, "ok": 8, "joules_requests": 11}, {"pending": 2.0})
    assert late.startswith("step at concurrency 4: the proxy still had 2 requests without their final joules")
    assert "gave joules to 11 requests, 8 of bench's succeeded" in other


def test_quantile_reads_buckets_as_prometheus_does():
    assert quantile({1.0: 0, 2.0: 10, math.inf: 10}, 0.5) == pytest.approx(1.5)
    assert quantile({1.0: 5, math.inf: 10}, 0.9) == 1.0  # past the last finite bucket: its bound
    assert quantile({1.0: 0, math.inf: 0}, 0.5) is None and quantile({}, 0.5) is None


@pytest.mark.process
def test_bench_through_the_proxy_gives_each_steps_joules_per_request_and_straight_to_the_engine_says_why_not(
        tmp_path, write):
    """The fake server behind a standalone proxy whose energy file this test writes as the daemon would (a card at a
    steady 300 W): each step's requests are counted in the proxy's histogram and the table gives their joules; the
    same sweep straight at the server says once that there are none."""
    import json
    import subprocess
    import sys
    import threading
    import time

    from conftest import free_port, gpuwarden_cmd, subprocess_env
    from test_bench import Server

    fake = Server("--token-delay", "0.003")
    feed, proxy_port, stop = tmp_path / "energy.json", free_port(), threading.Event()

    def daemon():  # what serving/run/energyfeed.py writes, a poll every 0.2 s
        began = time.monotonic()
        while not stop.is_set():
            now = time.monotonic()
            feed.write_text(json.dumps({"v": 1, "epoch": "test", "t": now,
                                        "gpus": {"0": round((now - began) * 300_000)}, "power": []}))
            stop.wait(0.2)

    writer = threading.Thread(target=daemon, daemon=True)
    writer.start()
    proxy = subprocess.Popen([*gpuwarden_cmd(), "proxy", "-c", "none", "--upstream", fake.url, "--listen",
                              f"127.0.0.1:{proxy_port}", "--energy-file", str(feed), "--model", "fake-model"],
                             stdout=subprocess.DEVNULL, stderr=(tmp_path / "proxy.log").open("w"),
                             env=subprocess_env())  # a file, not a pipe nobody reads: its lines would fill it and stop it
    conf = write("b.yaml", "gpu: {backend: sim, scenario: rtx-pro-4000-headless}\nmetrics: {listen: none}\n")
    env = {**subprocess_env(), "STATE_DIRECTORY": str(tmp_path / "state")}

    def bench(url):
        try:
            return subprocess.run([*gpuwarden_cmd(), "bench", "-c", str(conf), "--idle", "0", "--url", url,
                                   "--concurrency", "1,4", "--requests", "8", "--input-len", "64", "--output-len",
                                   "32", "--json"], capture_output=True, text=True, env=env, timeout=180)
        except subprocess.TimeoutExpired as exc:  # what bench and the proxy said, for the hang's cause
            raise AssertionError(f"bench's stderr: {(exc.stderr or b'')[-3000:]!r}\nthe proxy's log: "
                                 f"{(tmp_path / 'proxy.log').read_text()[-3000:]}") from None
    try:
        wait = time.monotonic() + 60  # a bound on a hang: the proxy's start
        while True:
            try:
                urllib_get(f"http://127.0.0.1:{proxy_port}/health")
                break
            except OSError:
                assert proxy.poll() is None and time.monotonic() < wait, (tmp_path / "proxy.log").read_text()
                time.sleep(0.2)
        out = bench(f"http://127.0.0.1:{proxy_port}")
        assert out.returncode == 0, out.stderr
        result = json.loads(out.stdout)
        for step in result["steps"]:
            assert step["joules_requests"] == step["requests"] == 8, step
            assert 0 < step["joules_per_request_p50"] <= step["joules_per_request_p90"] <= step["joules_per_request_p99"]
            assert step["joules_per_request_mean"] > 0
        assert not any("no joules per request" in n or "concurrency" in n for n in result["notes"]), result["notes"]
        direct = bench(fake.url)
        assert direct.returncode == 0, direct.stderr
        notes = json.loads(direct.stdout)["notes"]
        assert [n for n in notes if "no joules per request" in n] == [
            "no joules per request: bench did not run through gpuwarden's proxy (the server's /metrics has no "
            "gpuwarden_proxy_request_joules); point --url at the proxy for them"]
        assert "joules_requests" not in json.loads(direct.stdout)["steps"][0]
    finally:
        stop.set()
        proxy.terminate()
        proxy.wait(30)
        fake.stop()
    assert sys.executable  # the proxy ran on this interpreter (gpuwarden_cmd)


def urllib_get(url: str) -> bytes:
    import urllib.request

    with urllib.request.urlopen(url, timeout=5) as reply:
        return reply.read()
