"""Issue 35, attacked again: the engine's script is serve.user's (its own venv), and the daemon, as root, reads
its #! line to find the engine's interpreter (flagcheck.engine_python) at every start, reload and handover
check. A FIFO planted there held the daemon's start in open() for good (no log line, no READY); a link to
/dev/zero had readline() take 1.4 GB in 6 s. The line is read without waiting, from a regular file, capped."""

import pytest
import os
import threading

from test_faults import fake  # noqa: F401 (fixture)

from gpuwarden.config import ServeConfig
from gpuwarden.serving.compose.flagcheck import engine_python


def _in_time(fn, seconds=5):
    """fn's answer, or an assertion error when it is still waiting after seconds (the thread is left)."""
    out = {}
    thread = threading.Thread(target=lambda: out.setdefault("v", fn()), daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), "still waiting"
    return out["v"]


def test_a_fifo_or_a_link_to_dev_zero_at_the_engines_script_is_no_interpreter_and_no_wait(tmp_path):
    serve = ServeConfig()
    fifo = tmp_path / "fifo" / "vllm"
    fifo.parent.mkdir()
    os.mkfifo(fifo, 0o755)
    assert _in_time(lambda: engine_python(serve, [str(fifo), "serve"])) is None
    zero = tmp_path / "zero" / "vllm"
    zero.parent.mkdir()
    zero.symlink_to("/dev/zero")
    assert _in_time(lambda: engine_python(serve, [str(zero), "serve"])) is None
    script = tmp_path / "ok" / "vllm"
    script.parent.mkdir()
    script.write_text("#!/opt/venv/bin/python3\nimport sys\n")
    script.chmod(0o755)
    assert engine_python(serve, [str(script), "serve"]) == "/opt/venv/bin/python3"
    long_line = tmp_path / "long" / "vllm"
    long_line.parent.mkdir()
    long_line.write_text("#!/opt/venv/bin/python3 " + "x" * 10_000_000 + "\n")
    assert _in_time(lambda: engine_python(serve, [str(long_line), "serve"])) == "/opt/venv/bin/python3"


@pytest.mark.process
def test_doctor_prints_the_engine_interpreters_text_escaped(write, fake, tmp_path):
    """The engine's interpreter is serve.user's: its stderr reaches doctor's findings (installed versions, flag
    check), which root reads on a terminal. An OSC 52 / clear-screen there was printed raw."""
    import subprocess

    from conftest import gpuwarden_cmd
    from test_faults import fault_config

    python = fake["script"].parent / "python"
    python.write_text("#!/bin/sh\nprintf '\\033]52;c;Zm9yZ2Vk\\007\\033[2J FORGED\\n' >&2\nexit 1\n")
    python.chmod(0o755)
    path, _, _ = fault_config(write, fake, "healthy")
    path.write_text("\n".join(f"  python: {python}" if line.startswith("  python:") else line
                              for line in path.read_text().splitlines()) + "\n")
    done = subprocess.run([*gpuwarden_cmd(), "doctor", "-c", str(path)], capture_output=True, text=True, timeout=120)
    assert "FORGED" in done.stdout, done.stdout + done.stderr
    assert "\x1b" not in done.stdout and "\x07" not in done.stdout
    assert "\\x1b]52" in done.stdout or "\\e]52" in done.stdout or "]52;" in done.stdout


def test_status_reads_metrics_url_past_a_fifo_without_waiting(tmp_path, monkeypatch):
    """`gpuwarden status` reads the runtime directory's metrics-url: a FIFO there (a bad edit as root) held it in
    open() for good; a link to /dev/zero read without end."""
    from gpuwarden.config import MetricsConfig
    from gpuwarden.web.status import running_elsewhere

    monkeypatch.setenv("RUNTIME_DIRECTORY", str(tmp_path))
    os.mkfifo(tmp_path / "metrics-url")
    assert _in_time(lambda: running_elsewhere(MetricsConfig())) is None
    (tmp_path / "metrics-url").unlink()
    (tmp_path / "metrics-url").symlink_to("/dev/zero")
    assert _in_time(lambda: running_elsewhere(MetricsConfig())) is None
    (tmp_path / "metrics-url").unlink()
    (tmp_path / "metrics-url").write_text("http://127.0.0.1:9999\n")
    assert running_elsewhere(MetricsConfig()).listen == ("127.0.0.1", 9999)
