"""run_bounded's children (the installed-versions probe, the flag check) run code from serve.user's venv, and their
output goes to root's temporary files, deleted at once: a .pth that prints without end filled the daemon's disk at
~1 GB/s until the deadline. Each file such a child writes is capped (RLIMIT_FSIZE), the answer says why it is none,
and the engine itself is never capped. Real processes, started as the child user where the tests run as root."""

import os
import resource
import shutil
import signal
import threading
import time
from functools import partial
from types import SimpleNamespace

import pytest
from gpuwarden.serving.compose import flagcheck, identity
from gpuwarden.serving.compose import installed as installed_mod
from gpuwarden.serving.compose.identity import Identity, popen, resolve, run_bounded
from gpuwarden.serving.run.processes import ProcessOps

CAP = 4 << 20  # the tests' limit: a few MiB written (today's code wrote gigabytes before its deadline)
# A bound on a hang: the flood ends at the byte cap long before it (a 5 s deadline could beat a busy box's Python
# start, and the child ended by the deadline, not the cap)
TIMEOUT_S = 60
PYTHON = shutil.which("python3", path=os.defpath)  # one the child user can run (ours may sit under /root)
FLOOD = "import sys\nwhile True: sys.{}.buffer.write(b'x' * 65536)"
LIMITS = "import resource; print(resource.getrlimit(resource.RLIMIT_FSIZE))"

needs_python = pytest.mark.skipif(PYTHON is None, reason="no python3 on the default PATH")


@pytest.fixture
def who(child_user):
    return resolve(child_user)


def _argv(writer, stream):
    if writer == "yes":  # C: SIGXFSZ's default action ends it
        return ["yes"] if stream == "stdout" else ["sh", "-c", "exec yes >&2"]
    return [PYTHON, "-c", FLOOD.format(stream)]  # Python ignores SIGXFSZ: its write fails with EFBIG


@pytest.mark.process
@needs_python
@pytest.mark.parametrize("via", ["popen", "helper"])  # `check --deep`'s path, and a reload's (its own group)
@pytest.mark.parametrize("writer", ["yes", "python"])
@pytest.mark.parametrize("stream", ["stdout", "stderr"])
def test_a_child_that_prints_without_end_is_stopped_at_the_limit(who, via, writer, stream):
    ours = {}

    def spawn(identity, argv, env, **kwargs):
        ours["fd"] = os.dup(kwargs[stream].fileno())  # the temporary file, measured after run_bounded closed it
        return (popen if via == "popen" else ProcessOps().helper)(identity, argv, env, **kwargs)

    done = run_bounded(who, _argv(writer, stream), {"PATH": os.defpath}, TIMEOUT_S, spawn, max_write_bytes=CAP)
    try:
        written = os.fstat(ours["fd"]).st_size
    finally:
        os.close(ours["fd"])
    assert done.returncode is not None  # ended by the limit, long before the deadline
    if writer == "yes":
        assert done.returncode == -signal.SIGXFSZ
    else:  # Python's write raised EFBIG: it exits 1, or 120 where it cannot even flush stderr at exit
        assert done.returncode in (1, 120) and (stream == "stderr" or "[Errno 27] File too large" in done.stderr)
    assert written == CAP
    assert done.stopped == "it wrote more than 4 MiB of output"


@pytest.mark.process
@needs_python
def test_the_limit_is_on_run_bounded_children_never_on_the_engine(who):
    """The engine writes caches and may write large files: ProcessOps.spawn starts it with our own limit."""
    probe = run_bounded(who, [PYTHON, "-c", LIMITS], {"PATH": os.defpath}, TIMEOUT_S)
    assert probe.returncode == 0 and probe.stopped is None
    assert probe.stdout.strip() == str((identity.MAX_WRITE_BYTES,) * 2)
    reload_probe = run_bounded(who, [PYTHON, "-c", LIMITS], {"PATH": os.defpath}, TIMEOUT_S, ProcessOps().helper)
    assert reload_probe.stdout.strip() == str((identity.MAX_WRITE_BYTES,) * 2)

    lines, said = [], threading.Event()

    def on_line(line):
        lines.append(line)
        said.set()

    engine = ProcessOps().spawn((PYTHON, "-c", LIMITS), {"PATH": os.defpath}, who, on_line)
    try:
        assert said.wait(TIMEOUT_S)
    finally:
        engine.process.kill()
        engine.process.wait()
    assert lines == [str(resource.getrlimit(resource.RLIMIT_FSIZE))]


@pytest.fixture
def flooding_python(tmp_path, monkeypatch):
    """serve.user's interpreter, replaced (as a .pth could make it behave) by one that prints without end; the
    callers' run_bounded capped at CAP, so the test writes a few MiB."""
    script = tmp_path / "python"
    script.write_text("#!/bin/sh\nexec yes\n")
    script.chmod(0o755)
    for module in (installed_mod, flagcheck):
        monkeypatch.setattr(module, "run_bounded", partial(run_bounded, max_write_bytes=CAP))
    return str(script)


@pytest.mark.process
def test_a_probe_that_floods_is_no_answer_in_one_line(flooding_python, tmp_path):
    me = Identity("me", os.geteuid(), os.getegid(), str(tmp_path), (), switch=False)
    found = installed_mod.installed(flooding_python, me, {"PATH": os.defpath}, timeout_s=TIMEOUT_S)
    assert not found.known
    assert found.error == f"{flooding_python} stopped: it wrote more than 4 MiB of output"


@pytest.mark.process
def test_a_flag_check_that_floods_is_no_answer_in_one_line(flooding_python, tmp_path):
    me = Identity("me", os.geteuid(), os.getegid(), str(tmp_path), (), switch=False)
    serve = SimpleNamespace(python=flooding_python, container=None)
    command = SimpleNamespace(engine=SimpleNamespace(title="vLLM", flag_probe="pass"), argv=("vllm", "serve"),
                              prefix=2, flags=[], env={"PATH": os.defpath})
    checked = flagcheck.check_flags(serve, command, me, timeout_s=TIMEOUT_S)
    assert not checked.ok
    assert checked.error == "vLLM's flag check stopped: it wrote more than 4 MiB of output"


def test_a_helper_that_cannot_die_is_killed_and_left_never_waited_on_for_ever(monkeypatch):
    """A flag check stuck in the kernel (sched_setaffinity, SIGKILL pending for good: seen twice in the real tier
    under load, fresh13 and fresh16) held its reload for ever: run_bounded waited without a deadline after the kill.
    Now it waits KILLED_WAIT_S and answers that the helper is stuck; the caller's check ends with that reason."""
    import subprocess

    from gpuwarden.serving.compose import identity as identity_mod

    monkeypatch.setattr(identity_mod, "KILLED_WAIT_S", 0.01)
    killed = []

    class Stuck:
        pid = 4242

        def wait(self, timeout=None):
            raise subprocess.TimeoutExpired("python", timeout)

        def kill(self):
            killed.append(True)

    nobody = Identity("nobody", 65534, 65534, "/", (), switch=False)
    done = run_bounded(nobody, ["python", "-c", "pass"], {}, 0.01, lambda *a, **k: Stuck())
    assert killed == [True] and done.returncode is None
    assert done.stopped and "stuck in the kernel" in done.stopped and "4242" in done.stopped


def test_a_flood_of_lines_reaches_on_line_within_the_budget_and_every_line_is_forwarded_or_counted():
    """Attacker 11's F3 (forward_lines): past LINES_BURST, LINES_PER_S a second; the rest read a block at a time and
    counted in lines that say so, so that every line written is one of the two; the pipe is read to its end."""
    from gpuwarden.serving.run.processes import LINES_BURST, LINES_PER_S, forward_lines

    total = 100_000
    read, write = os.pipe()
    stream = os.fdopen(read, "rb")

    def writer():
        with os.fdopen(write, "wb") as out:
            for n in range(total):
                out.write(b"line %d\n" % n)

    began = time.monotonic()
    threading.Thread(target=writer, daemon=True).start()
    got = []
    forward_lines(stream, got.append)
    dropped = [int(line.split()[1]) for line in got if "lines of output dropped" in line]
    forwarded = len(got) - len(dropped)
    assert dropped and forwarded <= LINES_BURST + LINES_PER_S * (time.monotonic() - began) + 1, forwarded
    assert forwarded + sum(dropped) == total
    assert got[0] == "line 0"
