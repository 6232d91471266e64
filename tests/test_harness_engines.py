"""The budget's count of real engine starts (tests/harness/engines.py): a start of the CPU vLLM from its own venv counts
once, for the test running then; a planted fake `vllm` package on the same entry point, or the fake engine, does not."""

from collections import defaultdict

from harness import engines

LINE = "2026-12-02 18:00:00 INFO vLLM starting (pid 4242, profile cpu-tiny, user gpuwarden-test): {argv}"


def counted(monkeypatch, *argvs: str) -> dict:
    counts: dict = defaultdict(int)
    monkeypatch.setattr(engines, "COUNTS", counts)
    monkeypatch.setattr(engines, "current", lambda: "tests/test_x.py::test_y")
    for argv in argvs:
        engines.seen(LINE.format(argv=argv))
    return dict(counts)


def test_the_cpu_vllm_from_its_venv_counts_once_per_start_for_the_running_test(monkeypatch):
    python = engines.VENV + "bin/python"
    assert counted(monkeypatch, f"{python} -m vllm.entrypoints.openai.api_server --model /m",
                   f"{python} /src/tests/vllm/vllm_cli.py serve /m --nnodes 2") == {"tests/test_x.py::test_y": 2}


def test_a_planted_vllm_package_or_the_fake_engine_is_no_engine_start(monkeypatch):
    assert counted(monkeypatch, "/tmp/planted/venv/bin/python -m vllm.entrypoints.openai.api_server --model /m",
                   f"{engines.VENV}bin/python /src/tests/harness/fakechild.py serve",
                   engines.VENV.rstrip("/") + "-other/bin/python -m vllm.entrypoints.openai.api_server") == {}
