"""bench's view of the GPUs and of the engine during each step (bench/watch.py): a daemon's /status from whatever
answers on the metrics port, checked GPU by GPU and kept to the fields bench reads, a refused answer a poll fewer,
said once under the table and never a traceback; the engine's /metrics kept to the counters bench reads. The runs
against a hostile /status (test_status_client.hostile_status) are real processes: bench and the fake server
(tests/harness/fake_openai.py)."""

import json
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from conftest import free_port, gpuwarden_cmd, subprocess_env
from gpuwarden.bench.watch import MAX_GPUS, Watch, checked_gpus
from gpuwarden.web.status import StatusError
from test_status_client import BAD_BODIES, BAD_FIGURES, good_gpu, hostile_status, state_of  # noqa: F401 (fixture)

HERE = Path(__file__).resolve().parent
BIG = int("9" * 400)  # a JSON integer Python reads, and no float holds


def test_bench_checks_each_gpu_of_a_status_and_keeps_only_what_it_reads():
    url = "http://127.0.0.1:1"
    good = json.loads(state_of(good_gpu(junk="x" * 100_000, name="H" * 10_000)))["gpus"]
    kept = checked_gpus(good, url)
    assert kept[0]["sm_active_ratio"] == 0.6 and "junk" not in kept[0] and len(kept[0]["name"]) <= 256
    assert checked_gpus(None, url) is None  # an older daemon, or none: a poll fewer
    assert checked_gpus([{"index": 1, "up": False, "name": "H100"}], url)[0]["power_w"] is None  # a GPU down
    bad = [("gpus", "abc"), ("gpus", 5), ("gpus", {"a": 1}), ("gpus", [5]), ("index", None), ("index", [0]),
           ("index", True), ("index", -1), ("index", MAX_GPUS), ("sm_active_ratio", "x"), ("sm_active_ratio", BIG),
           ("tensor_active_ratio", 1e308), ("dram_bandwidth_ratio", -5), ("sm_active_ratio", True),
           ("sm_active_ratio", float("nan")), ("tensor_active_ratio", [[1]]), ("power_w", 1e308), ("power_w", "x"),
           ("utilization_pct", "x"), ("sm_clock_mhz", float("inf")), ("clock_event_reasons", 5),
           ("clock_event_reasons", [[1]]), ("sm_lock_mhz", "ab"), ("sm_lock_mhz", [1, BIG]), ("name", ["x"])]
    for field, value in bad:
        gpus = value if field == "gpus" else [good_gpu(**{field: value})]
        with pytest.raises(StatusError, match=f"{url}/status") as caught:
            checked_gpus(gpus, url)
        assert len(str(caught.value).splitlines()) == 1 and len(str(caught.value)) < 300, str(caught.value)
        assert field in str(caught.value), (field, str(caught.value))
    with pytest.raises(StatusError, match=f"more than {MAX_GPUS} GPUs"):  # memory: every poll is kept a step
        checked_gpus([good_gpu(index=i % MAX_GPUS) for i in range(100_000)], url)


def test_a_watch_whose_reader_refuses_polls_says_so_once_and_summarizes_the_rest():
    answers = iter([[good_gpu()], "abc"] * 3)
    watch = Watch(lambda: checked_gpus(next(answers), "http://h:1"), None, None, interval_s=0.01)
    for _ in range(6):
        watch._poll_once()
    assert len(watch._polls.gpus[0]) == 3
    assert watch.refusals() == ["the GPU view refused 3 of 6 answers from the daemon's /status, the first: "
                                "http://h:1/status: gpus is 'abc', not a list of GPUs"]


@pytest.mark.process
def test_bench_reading_a_foreign_status_never_crashes_and_says_what_it_refused(hostile_status, tmp_path):
    """bench takes the first answer for a daemon's and then polls it: every bad answer is a poll fewer, said once
    under the table, never a traceback from the poll thread or the step's end. Before: "Exception in thread
    bench-watch" (TypeError, KeyError, OverflowError, RecursionError) on the first, and no GPU figures after it."""
    good = state_of(good_gpu())
    bad = [dict(BAD_FIGURES)[w] for w in ("a string", "400 digits", "1e308", "power of 400 digits")]
    bad += [dict(BAD_BODIES)[w] for w in ("nesting past the recursion limit", "a gigabyte streamed")]
    bad += [state_of(good_gpu(index="0")), b'{"daemon": {}, "gpus": "abc"}', b'{"daemon": {}, "gpus": [5]}']
    answers = [good]
    for answer in bad:
        answers += [answer, good]
    server = hostile_status(answers)
    port = free_port()
    fake = subprocess.Popen([sys.executable, str(HERE / "harness" / "fake_openai.py"), "--port", str(port),
                             "--token-delay", "0.01"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert fake.stdout.readline().strip() == "listening"
        conf = tmp_path / "b.yaml"
        conf.write_text(f"gpu: {{backend: sim, scenario: rtx-pro-4000-headless}}\nmetrics: {{listen: '127.0.0.1:"
                        f"{server.server_address[1]}'}}\n")
        out = subprocess.run([*gpuwarden_cmd(), "bench", "-c", str(conf), "--url", f"http://127.0.0.1:{port}",
                              "--concurrency", "1,2", "--duration", "5", "--idle", "1", "--json"],
                             capture_output=True, text=True, timeout=180,
                             env={**subprocess_env(), "STATE_DIRECTORY": str(tmp_path / "state")})
    finally:
        fake.terminate()
        fake.wait(10)
    assert "Traceback" not in out.stderr and "Exception in thread" not in out.stderr, out.stderr[-4000:]
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout)
    assert result["gpu_source"].startswith("the daemon's /status")
    assert server.RequestHandlerClass.served[0] >= len(answers)  # every answer was read
    for step in result["steps"]:
        gpu = step["gpus"][0]
        assert gpu["polls"] >= 1 and gpu["sm_active_ratio_mean"] == 0.6, gpu  # the good answers only
        assert step["activity"]["bound"] == "memory", step["activity"]
    refused = [n for n in result["notes"] if n.startswith("the GPU view refused")]
    assert len(refused) == 1 and f"127.0.0.1:{server.server_address[1]}/status" in refused[0], result["notes"]


@pytest.mark.process
def test_bench_against_a_status_that_trickles_ends_its_steps_on_time(hostile_status, tmp_path):
    server = hostile_status([state_of(good_gpu()), ("trickle", 30.0)])
    port = free_port()
    fake = subprocess.Popen([sys.executable, str(HERE / "harness" / "fake_openai.py"), "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert fake.stdout.readline().strip() == "listening"
        conf = tmp_path / "b.yaml"
        conf.write_text(f"gpu: {{backend: sim, scenario: rtx-pro-4000-headless}}\nmetrics: {{listen: '127.0.0.1:"
                        f"{server.server_address[1]}'}}\n")
        started = time.monotonic()
        out = subprocess.run([*gpuwarden_cmd(), "bench", "-c", str(conf), "--url", f"http://127.0.0.1:{port}",
                              "--concurrency", "1", "--duration", "2", "--idle", "0", "--json"],
                             capture_output=True, text=True, timeout=120,
                             env={**subprocess_env(), "STATE_DIRECTORY": str(tmp_path / "state")})
        took = time.monotonic() - started
    finally:
        fake.terminate()
        fake.wait(10)
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert took < 60, took  # each poll's 2 s deadline, not the server's 30 s
    notes = json.loads(out.stdout)["notes"]
    # the deadline said as httpget met it: between reads ("within 2 s") or in one ("timed out")
    assert any(n.startswith("the GPU view refused") and ("within 2 s" in n or "timed out" in n) for n in notes), notes


def test_bench_keeps_only_the_engine_counters_it_reads_of_a_huge_metrics_page():
    """A server at bench's --url may answer /metrics with 8 MiB (fetch's cap) of distinct names: 850,000 parsed,
    about 100 MB, and bench kept every scrape until the step's end (one each 2 s: gigabytes over a minute's step)."""
    from gpuwarden.serving.compose.engines import engine_for
    from gpuwarden.serving.probe.metrics import MAX_BYTES

    names = engine_for("vllm").metric_names
    page = [f"{names.generation_tokens} 5\n", f"{names.requests_running} 2\n"]
    size, i = 0, 0
    while size < MAX_BYTES - 4096:
        line = f"junk_{i} 1\n"
        page.append(line)
        size, i = size + len(line), i + 1

    class Metrics(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_GET(self):
            body = "".join(page).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Metrics)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        watch = Watch(None, f"http://127.0.0.1:{server.server_address[1]}/metrics", names)
        scraped = watch._scrape()
    finally:
        server.shutdown()
        server.server_close()
    assert scraped == {names.generation_tokens: 5.0, names.requests_running: 2.0}
