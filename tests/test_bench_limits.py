"""`gpuwarden bench` against servers that misbehave (tests/harness/fake_openai.py's modes), as real processes: every
read is capped, every request and step ends within its stated deadline, and --url needs no config file."""

import json
import subprocess
import sys
import time

import pytest

from conftest import free_port, gpuwarden_cmd, subprocess_env
from gpuwarden.config import DEFAULT_PATH
from test_bench import server  # noqa: F401 (the fixture)


MiB = 1 << 20
# Runs its command and prints the peak RSS of it (its only child), in KiB.
PEAK_RSS = "import resource, subprocess, sys; subprocess.run(sys.argv[1:]); " \
           "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, file=sys.stderr)"


@pytest.fixture
def bench(tmp_path, write):
    """gpuwarden bench with simulated GPUs (config: other -c arguments); a bench that hangs fails the test at its
    timeout (and is killed)."""
    conf = write("b.yaml", "gpu: {backend: sim, scenario: rtx-pro-4000-headless}\nmetrics: {listen: none}\n")

    def run(*args, timeout=60, wrap=(), config=None):
        env = {**subprocess_env(), "STATE_DIRECTORY": str(tmp_path / "state")}
        config = ("-c", str(conf)) if config is None else config
        return subprocess.run([*wrap, *gpuwarden_cmd(), "bench", *config, *args], capture_output=True, text=True,
                              env=env, timeout=timeout)
    return run


def no_stream_left(fake) -> bool:
    deadline = time.monotonic() + 10
    while json.loads(fake.get("/debug/open"))["open"] and time.monotonic() < deadline:
        time.sleep(0.1)
    return json.loads(fake.get("/debug/open"))["open"] == 0


def one_line(err: str) -> str:
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    return err.strip()


@pytest.mark.process
def test_a_huge_error_body_is_read_to_its_cap_and_no_further(server, bench):
    fake = server("--error-bytes", str(300 * MiB))
    out = bench("--url", fake.url, wrap=(sys.executable, "-c", PEAK_RSS))
    *err, peak_kib = out.stderr.strip().splitlines()
    # Read whole, the body alone is 300 MiB (600 as text); capped, bench is its interpreter and aiohttp.
    assert int(peak_kib) * 1024 < 150 * MiB, f"peak RSS {int(peak_kib) // 1024} MiB"
    # The server could hand the socket only what the kernel's buffers hold: bench stopped reading, and hung up.
    assert json.loads(fake.get("/debug/open"))["error_bytes_sent"] < 64 * MiB
    assert one_line("\n".join(err)) == "gpuwarden bench: the first request failed: HTTP 500: (a body of more than " \
                                       "64 KiB, not read)"


@pytest.mark.process
def test_a_stream_that_never_ends_is_cut_at_the_duration_plus_the_grace(server, bench):
    fake = server("--endless", "--token-delay", "0.2", "--good-first", "1")  # the calibration is served whole
    start = time.monotonic()
    out = bench("--url", fake.url, "--concurrency", "2", "--duration", "1", "--warmup", "0",
                "--output-len", "64", "--json")
    wall = time.monotonic() - start
    assert out.returncode == 1, out.stderr  # a step without one finished request
    step = json.loads(out.stdout)["steps"][0]
    assert (step["ok"], step["cut"], step["errors"], step["requests"]) == (0, 2, 0, 2)
    assert step["first_cut"] == "still streaming 1 s after the step's 1 s (--grace)"  # default: as long as --duration
    assert 2 - 0.05 <= step["duration_s"] < 2 + 5  # 1 s + 1 s of grace (the margin for a busy machine)
    assert step["output_tokens"] == 0 and step["system_tokens_per_s"] is None  # a cut request's tokens are left out
    assert wall < 30
    assert no_stream_left(fake), "a stream was left open"
    fake = server("--endless", "--token-delay", "0.2", "--good-first", "1")
    out = bench("--url", fake.url, "--concurrency", "1", "--duration", "0.5", "--grace", "0.25", "--warmup", "0",
                "--output-len", "64", "--json")
    step = json.loads(out.stdout)["steps"][0]
    assert step["cut"] == 1 and step["first_cut"] == "still streaming 0.25 s after the step's 0.5 s (--grace)"
    assert 0.75 - 0.05 <= step["duration_s"] < 0.75 + 5


@pytest.mark.process
def test_a_server_that_ignores_max_tokens_is_an_error_at_its_chunk_cap(server, bench):
    fake = server("--endless", "--token-delay", "0", "--good-first", "1")  # a flood of tokens, never ending
    out = bench("--url", fake.url, "--concurrency", "1", "--requests", "2", "--warmup", "0",
                "--output-len", "4", "--json")
    assert out.returncode == 1, out.stderr
    step = json.loads(out.stdout)["steps"][0]
    assert (step["ok"], step["cut"], step["errors"]) == (0, 0, 2)
    assert step["first_error"] == "more than 24 chunks for max_tokens 4"  # 2 x 4 + 16
    assert no_stream_left(fake), "a stream was left open"


@pytest.mark.process
def test_a_token_every_ten_minutes_is_cut_at_the_step_or_the_request_deadline(server, bench):
    fake = server("--token-delay", "600", "--good-first", "1")
    table = bench("--url", fake.url, "--concurrency", "2", "--duration", "1", "--warmup", "0")
    assert table.returncode == 1, table.stderr
    lines = table.stdout.splitlines()
    assert lines[1].split()[:3] == ["C", "ok/sent", "cut"] and lines[2].split()[:3] == ["2", "0/2", "2"]
    assert "! C=2: 2 of 2 requests cut by bench (not errors of the server; their tokens left out): still streaming " \
           "1 s after the step's 1 s (--grace)" in lines
    fake = server("--token-delay", "600", "--good-first", "1")
    md = bench("--url", fake.url, "--concurrency", "1", "--requests", "1", "--request-timeout", "1",
               "--warmup", "0", "--markdown")
    assert md.returncode == 1 and "| C | ok/sent | cut |" in md.stdout and "\n| 1 | 0/1 | 1 |" in md.stdout
    assert "cut by bench (not errors of the server; their tokens left out): no end of stream within 1 s " \
           "(--request-timeout)" in md.stdout
    slow = server("--token-delay", "600")  # the first request too: bench fails in one line, within the deadline
    first = bench("--url", slow.url, "--request-timeout", "1")
    assert first.returncode == 1
    assert one_line(first.stderr) == "gpuwarden bench: the first request failed: no end of stream within 1 s " \
                                     "(--request-timeout)"
    assert no_stream_left(fake) and no_stream_left(slow), "a stream was left open"


@pytest.mark.process
@pytest.mark.parametrize("event,error", [
    ("[1]", "ValueError: an event that is not a JSON object: [1]"),
    ('{"usage": {"completion_tokens": [1]}}', "TypeError: int() argument must be a string"),
    ("[" * 100_000, "RecursionError: maximum recursion depth exceeded"),
])
def test_a_malformed_event_is_one_line_not_a_traceback(server, bench, event, error):
    fake = server("--usage-event", event)
    out = bench("--url", fake.url)
    assert out.returncode == 1
    assert one_line(out.stderr).startswith(f"gpuwarden bench: the first request failed: {error}")


@pytest.mark.process
@pytest.mark.parametrize("body,says", [("[1]", "did not answer a list of models"),
                                       ('{"data": 5}', "did not answer a list of models"),
                                       ('{"data": [{"id": [1]}]}', "lists no model"),
                                       ("[" * 100_000, "did not answer JSON")])
def test_a_malformed_model_list_is_one_line_not_a_traceback(server, bench, body, says):
    fake = server("--models-body", body)
    out = bench("--url", fake.url)
    assert out.returncode == 69
    assert one_line(out.stderr).startswith(f"gpuwarden bench: {fake.url}/v1/models {says}")


@pytest.mark.process
def test_with_url_no_config_file_is_needed(server, bench, tmp_path):
    fake = server()
    args = ("--url", fake.url, "--concurrency", "1", "--requests", "2", "--output-len", "4", "--json")
    none = bench(*args, config=("-c", "none"))
    assert none.returncode == 0, none.stderr
    assert json.loads(none.stdout)["steps"][0]["ok"] == 2
    if not DEFAULT_PATH.exists():  # where gpuwarden is configured, the default config is read (as it should be)
        default = bench(*args, config=())
        assert default.returncode == 0, default.stderr
        compare = bench("--compare", "nothing", "saved", config=())  # --compare reads saved runs, no config
        assert compare.returncode == 3 and "no saved bench run 'nothing'" in one_line(compare.stderr)
    named = bench(*args[:-1], config=("-c", str(tmp_path / "missing.yaml")))  # a named config must exist
    assert named.returncode == 78
    assert one_line(named.stderr).startswith(f"{tmp_path}/missing.yaml:1: (file): file not found")
    for bad, why in ((("--grace", "1"), "--grace is for steps of a --duration"),
                     (("--request-timeout", "0"), "must be positive")):
        out = bench("--url", f"http://127.0.0.1:{free_port()}", *bad)
        assert out.returncode == 78 and why in one_line(out.stderr)


def test_the_tokenize_calibration_has_one_deadline_for_all_its_calls(monkeypatch):
    """33 /tokenize calls of 30 s each could hold a sweep for a quarter of an hour against a server that answers
    each just in time; they share one deadline, and bench then estimates the prompt's size instead. Each call here
    takes over half the deadline and well within its own 30 s: a deadline of each call's own would let all 34 through
    (their sizes add up: a Workload), one shared ends it at the second at the latest. A busy box only ends it sooner."""
    import asyncio

    import aiohttp
    from aiohttp import web

    from gpuwarden.bench import sweep
    from gpuwarden.bench.workload import Workload

    calls = []

    async def slow(request):
        calls.append(time.monotonic())
        prompt = (await request.json())["prompt"]
        await asyncio.sleep(1.2)
        return web.json_response({"count": len(prompt.split())})

    async def run():
        app = web.Application()
        app.router.add_post("/tokenize", slow)
        runner = web.AppRunner(app)
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        try:
            async with aiohttp.ClientSession() as session:
                return await sweep._word_sizes(session, f"http://127.0.0.1:{port}", Workload("m", "completions",
                                                                                            64, 8), 64, 16)
        finally:
            await runner.cleanup()

    monkeypatch.setattr(sweep, "WORD_SIZES_DEADLINE_S", 2.0)
    found = asyncio.run(run())
    assert found is None and 1 <= len(calls) <= 2, len(calls)
