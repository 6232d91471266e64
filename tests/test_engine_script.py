"""Issue 35, attacked again: the engine's script is serve.user's (its own venv), and the daemon, as root, reads
its #! line to find the engine's interpreter (flagcheck.engine_python) at every start, reload and handover
check. A FIFO planted there held the daemon's start in open() for good (no log line, no READY); a link to
/dev/zero had readline() take 1.4 GB in 6 s. The line is read without waiting, from a regular file, capped."""

import os
import threading

from gpuwarden.config import ServeConfig
from gpuwarden.serving.compose.flagcheck import engine_python


def _in_time(fn, seconds=5):
    """fn's answer, or an assertion error when it is still waiting after seconds (the thread is left)."""
    out = {}
    thread = threading.Thread(target=lambda: out.setdefault("v", fn()), daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), "engine_python still waiting"
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
