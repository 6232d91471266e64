"""A reload (SIGHUP) or a handover (SIGUSR2) checks what a start checks, the engine's own parser included, before it
stops anything that serves (issue 51): a drop-in whose flags the parser refuses leaves the engine serving, the same
process, with one line that names the flag and the file. Real processes: the daemon, the fake engine
(tests/harness/fakechild.py, which refuses a --no-such- flag as vLLM's parser does) and the fake flag check
(tests/harness/fakechild-flagcheck, which refuses it too, as serve.user).
"""

import shutil
import signal
import tempfile
from pathlib import Path

import pytest

from gpuwarden.serving.run import handover
from test_adoption import env_with_state, running_pid
from test_faults import FLAGCHECK, assert_polls_go_on, fault_config, status, wait_until
from test_faults import fake, no_fakes_left  # noqa: F401 (fixtures)
from test_handover_safety import parent_of
from test_reload_probe import tagged, token  # noqa: F401 (fixture)

pytestmark = pytest.mark.process

REFUSED = "serve:\n  args: [--no-such-flag, '1']\n"  # the parser refuses it; the fake engine would exit 2
ACCEPTED = "serve:\n  args: [--max-num-seqs, '8']\n"  # a change of the engine's flags that its parser accepts
WAIT_S = 60  # a bound on a hang, never a measure


def _lines_after(d, mark, text):
    return [line for line in d.lines[mark:] if text in line]


def _refused_serving_on(d, base, mark, pid, text, dropin):
    """The refusal's one line (text) names the drop-in and the flag; after it the engine serves on: its output still
    read, the same process, the daemon's child, nothing stopped. The line."""
    refused = d.wait_index(text, after=mark, timeout=WAIT_S)
    line = d.lines[refused]
    assert f"{dropin}:2: serve.args: vLLM rejects the flags: unrecognized arguments: --no-such-flag" in line, line
    d.wait_for("vllm: INFO fakechild tick", after=refused + 1, timeout=WAIT_S)
    assert running_pid(base) == pid and parent_of(pid) == d.proc.pid, "the engine is still the daemon's child"
    assert not _lines_after(d, mark, "vLLM stopping")
    assert len([x for x in d.lines[mark:] if "--no-such-flag" in x and "vllm: " not in x]) == 1, d.lines[mark:]
    return line


def test_a_reload_with_flags_the_engines_parser_refuses_keeps_the_engine_serving(write, fake, daemons, tmp_path,
                                                                                  no_fakes_left):
    path, base, _ = fault_config(write, fake, "healthy,chatty")
    d = daemons(path)
    pid = running_pid(base)
    dropin = write("conf.d/flags.yaml", REFUSED)
    mark = len(d.lines)
    d.proc.send_signal(signal.SIGHUP)
    _refused_serving_on(d, base, mark, pid, "reload failed, still running the previous config", dropin)
    assert not _lines_after(d, mark, "config reloaded")
    # Another SIGHUP on the same drop-in: refused again, once more, nothing stopped.
    mark = len(d.lines)
    d.proc.send_signal(signal.SIGHUP)
    d.wait_for("reload failed, still running the previous config", after=mark, timeout=WAIT_S)
    assert running_pid(base) == pid and not _lines_after(d, mark, "vLLM stopping")
    # Fixed on disk, the reload goes ahead: the parser accepts, and only then is the engine stopped.
    dropin.write_text(ACCEPTED)
    mark = len(d.lines)
    d.proc.send_signal(signal.SIGHUP)
    accepted = d.wait_index("accepts the flags", after=mark, timeout=WAIT_S)
    stopping = d.wait_index("vLLM stopping", after=mark, timeout=WAIT_S)
    assert accepted < stopping, d.lines[mark:]
    d.wait_for("config reloaded", after=mark, timeout=WAIT_S)
    d.wait_for("vLLM healthy after", after=stopping, timeout=WAIT_S)
    assert running_pid(base) != pid
    assert d.stop() == 0 and "Traceback" not in d.log


def test_a_handover_with_flags_the_engines_parser_refuses_keeps_the_engine_and_the_image(write, fake, daemons,
                                                                                          tmp_path, no_fakes_left):
    path, base, _ = fault_config(write, fake, "healthy,chatty")
    env, _ = env_with_state(tmp_path)
    d = daemons(path, env=env)
    pid = running_pid(base)
    began = status(base)["daemon"]["started_at"]
    dropin = write("conf.d/flags.yaml", REFUSED)
    mark = len(d.lines)
    d.proc.send_signal(signal.SIGUSR2)
    # The engine's next lines are still read by this image, which was not replaced: no exec came.
    assert "keeps running" in _refused_serving_on(d, base, mark, pid, "SIGUSR2: no handover", dropin)
    assert not _lines_after(d, mark, "handing over to the installed")
    assert not _lines_after(d, mark, "adopted after an upgrade")
    assert d.proc.poll() is None and status(base)["daemon"]["started_at"] == began, "the same image"
    # Fixed on disk, the handover goes ahead, and the engine is the same process.
    dropin.unlink()
    mark = len(d.lines)
    d.proc.send_signal(signal.SIGUSR2)
    d.wait_for("adopted after an upgrade (re-exec, same daemon pid)", after=mark, timeout=WAIT_S)
    assert running_pid(base) == pid
    assert d.stop() == 0 and "Traceback" not in d.log


# The engine's interpreter as a config author may name it (serve.python): the installed-versions probe answers at
# once (nothing: the version unknown); the flag check does what the test asks.
INTERPRETER = """#!/bin/sh
case "$2" in *GPUWARDEN-INSTALLED*) exit 0 ;; esac
{check}
"""
HANG = "trap '' TERM; exec /bin/sh -c 'sleep 1000; : {token}'"  # deaf to SIGTERM, found by its token
CRASH = ("echo 'Traceback (most recent call last):' >&2; echo 'RuntimeError: the parser crashed' >&2; exit 1")


@pytest.fixture
def interpreter():
    """Write the engine's interpreter where serve.user can run it (it cannot enter /root, nor pytest's tmp_path)."""
    folder = Path(tempfile.mkdtemp(prefix="gpuwarden-flagcheck-"))
    folder.chmod(0o755)

    def write(check):
        path = folder / "python"
        path.write_text(INTERPRETER.format(check=check))
        path.chmod(0o755)
        return path
    yield write
    shutil.rmtree(folder, ignore_errors=True)


def _dropin(python, *flags):
    return f"serve:\n  python: {python}\n  args: [{', '.join(repr(f) for f in flags)}]\n"


def test_a_flag_check_that_hangs_holds_up_no_poll_no_engine_and_no_fixed_config(write, fake, daemons, interpreter,
                                                                                  token, no_fakes_left):
    """A drop-in whose flag check hangs (deaf to SIGTERM): the loop polls on schedule, the engine serves on, a storm
    of SIGHUPs on the same drop-in runs no second check, and a fixed drop-in ends the hung check and is carried out.
    """
    path, base, _ = fault_config(write, fake, "healthy,chatty")
    d = daemons(path)
    pid = running_pid(base)
    dropin = write("conf.d/flags.yaml", _dropin(interpreter(HANG.format(token=token)), "--max-num-seqs", "8"))
    mark = len(d.lines)
    d.proc.send_signal(signal.SIGHUP)
    wait_until(lambda: len(tagged(token)) == 1, timeout=WAIT_S)
    assert_polls_go_on(base, 12)
    for _ in range(20):  # a storm on the same drop-in: joined to the check that runs, none started beside it
        d.proc.send_signal(signal.SIGHUP)
    assert_polls_go_on(base, 8)
    assert len(tagged(token)) == 1 and running_pid(base) == pid
    assert not _lines_after(d, mark, "vLLM stopping") and not _lines_after(d, mark, "reload failed")
    # Fixed on disk (the interpreter that answers): the hung check is ended, the new flags checked and carried out.
    dropin.write_text(_dropin(FLAGCHECK, "--max-num-seqs", "8"))
    mark = len(d.lines)
    d.proc.send_signal(signal.SIGHUP)
    ended = d.wait_index("flag check of an earlier config ended", after=mark, timeout=WAIT_S)
    accepted = d.wait_index("accepts the flags", after=mark, timeout=WAIT_S)
    stopping = d.wait_index("vLLM stopping", after=mark, timeout=WAIT_S)
    assert ended < accepted < stopping
    d.wait_for("vLLM healthy after", after=stopping, timeout=WAIT_S)
    wait_until(lambda: not tagged(token), timeout=WAIT_S)
    assert running_pid(base) != pid and not _lines_after(d, mark, "reload failed")
    assert d.stop() == 0 and "Traceback" not in d.log


def test_a_flag_check_that_hangs_does_not_outlive_the_daemons_stop(write, fake, daemons, interpreter, token,
                                                                   no_fakes_left):
    path, base, _ = fault_config(write, fake, "healthy")
    d = daemons(path)
    running_pid(base)
    write("conf.d/flags.yaml", _dropin(interpreter(HANG.format(token=token)), "--max-num-seqs", "8"))
    mark = len(d.lines)
    d.proc.send_signal(signal.SIGHUP)
    wait_until(lambda: tagged(token), timeout=WAIT_S)
    assert d.stop() == 0
    assert not tagged(token), "the flag check outlived the daemon"
    d.wait_for("reload was waiting: not carried out, the daemon stops", after=mark,
               timeout=1)
    assert not _lines_after(d, mark, "reload failed") and not _lines_after(d, mark, "vLLM starting")


def test_a_flag_check_that_crashes_refuses_the_reload_in_one_line(write, fake, daemons, interpreter, no_fakes_left):
    path, base, _ = fault_config(write, fake, "healthy,chatty")
    d = daemons(path)
    pid = running_pid(base)
    dropin = write("conf.d/flags.yaml", _dropin(interpreter(CRASH), "--max-num-seqs", "8"))
    mark = len(d.lines)
    d.proc.send_signal(signal.SIGHUP)
    refused = d.wait_index("reload failed, still running the previous config", after=mark, timeout=WAIT_S)
    line = d.lines[refused]
    assert f"{dropin}:3: serve.args: vLLM rejects the flags: vLLM's flag check failed to run: RuntimeError: the " \
           "parser crashed" in line, line
    d.wait_for("vllm: INFO fakechild tick", after=refused + 1, timeout=WAIT_S)
    assert running_pid(base) == pid and not _lines_after(d, mark, "vLLM stopping")
    assert len([x for x in d.lines[mark:] if "the parser crashed" in x]) == 1
    assert d.stop() == 0 and "Traceback" not in d.log


def test_a_handover_waiting_across_a_reload_that_fixes_the_flags_hands_over_the_engine_that_reload_started(
        write, fake, daemons, interpreter, token, tmp_path, no_fakes_left):
    """SIGUSR2 waits for a flag check that hangs; a SIGHUP on a fixed drop-in goes first and restarts the engine; the
    handover reads the files again and goes ahead only once that restart is done: the new image adopts the new
    engine (a handover in the middle of the restart lost the stopping engine's pipe: EBADF, no handover)."""
    path, base, _ = fault_config(write, fake, "healthy,chatty")
    env, _ = env_with_state(tmp_path)
    d = daemons(path, env=env)
    pid = running_pid(base)
    dropin = write("conf.d/flags.yaml", _dropin(interpreter(HANG.format(token=token)), "--max-num-seqs", "8"))
    mark = len(d.lines)
    d.proc.send_signal(signal.SIGUSR2)
    wait_until(lambda: tagged(token), timeout=WAIT_S)
    dropin.write_text(_dropin(FLAGCHECK, "--max-num-seqs", "9"))
    d.proc.send_signal(signal.SIGHUP)
    adopted = d.wait_index("adopted after an upgrade (re-exec, same daemon pid)", after=mark, timeout=WAIT_S)
    reloaded = d.wait_index("config reloaded", after=mark, timeout=1)
    starting = d.wait_index("vLLM starting", after=reloaded, timeout=1)
    handing = d.wait_index("SIGUSR2: handing over to the installed gpuwarden", after=mark, timeout=1)
    assert reloaded < starting < handing < adopted
    new = running_pid(base)
    assert new != pid and f"pid {new}" in d.lines[adopted] and "--max-num-seqs 9" in d.lines[starting]
    assert not tagged(token) and not _lines_after(d, mark, "ERROR")
    assert d.stop() == 0 and "Traceback" not in d.log


def test_a_restart_after_a_crash_with_flags_the_parser_refuses_leaves_the_engine_serving(write, fake, daemons,
                                                                                          tmp_path, no_fakes_left):
    """The daemon dies, a drop-in is edited meanwhile, systemd starts it again: it would replace the engine it adopts
    (another command), so its parser checks the flags first, and a refusal fails the start before the engine is
    touched: the engine serves on for the next daemon, which adopts it once the drop-in is fixed."""
    path, base, _ = fault_config(write, fake, "healthy")
    env, folder = env_with_state(tmp_path)
    first = daemons(path, env=env)
    pid = running_pid(base)
    first.proc.kill()  # the engine serves on, its record not "stopping"
    first.proc.wait(WAIT_S)
    dropin = write("conf.d/flags.yaml", REFUSED)
    failing = daemons(path, env=env)
    assert failing.proc.wait(WAIT_S) == 78
    failing.stop()
    assert f"{dropin}:2: serve.args: vLLM rejects the flags: unrecognized arguments: --no-such-flag" in failing.log
    assert "keeps serving unsupervised" in failing.log and "vLLM stopping" not in failing.log
    assert handover.proven(handover.load(folder).children[0]) is None, "the engine still serves"
    dropin.unlink()
    second = daemons(path, env=env)
    second.wait_for("adopted after a restart of the daemon", timeout=WAIT_S)
    assert running_pid(base) == pid
    assert second.stop() == 0


def _command_dropin(fake, *flags):
    """A drop-in whose serve.command gives flags of its own after the fake engine's entry point (its script)."""
    return f"serve:\n  command: [{fake['python']}, {fake['script']}, --mode, killer, {', '.join(flags)}]\n"


def test_check_deep_runs_the_parser_on_the_flags_serve_command_gives_too(write, fake, cli):
    """The words after the engine's entry point in serve.command are flags its parser reads: `check --deep` checks
    them, and a refused one fails the check at serve.command, naming it."""
    path, _, _ = fault_config(write, fake, "healthy")
    write("conf.d/flags.yaml", _command_dropin(fake, "--no-such-cmdflag"))
    status, _, err = cli("check", "--deep", "-c", path)
    assert status == 78, err
    assert "serve.command: vLLM rejects the flags: unrecognized arguments: --no-such-cmdflag" in err, err
    write("conf.d/flags.yaml", _command_dropin(fake, "--max-num-seqs", "'8'"))
    status, out, err = cli("check", "--deep", "-c", path)
    assert status == 0 and "accepts" in out, (out, err)


def test_a_reload_with_a_refused_flag_in_serve_command_keeps_the_engine_serving(write, fake, daemons, no_fakes_left):
    """A drop-in that moves a flag the parser refuses into serve.command (another command: the engine would start
    anew) is refused as one in serve.args is, before anything is stopped: the same engine process serves on."""
    path, base, _ = fault_config(write, fake, "healthy,chatty")
    d = daemons(path)
    pid = running_pid(base)
    dropin = write("conf.d/flags.yaml", _command_dropin(fake, "--no-such-cmdflag"))
    mark = len(d.lines)
    d.proc.send_signal(signal.SIGHUP)
    refused = d.wait_index("reload failed, still running the previous config", after=mark, timeout=WAIT_S)
    line = d.lines[refused]
    assert f"{dropin}:2: serve.command: vLLM rejects the flags: unrecognized arguments: --no-such-cmdflag" in line, line
    d.wait_for("vllm: INFO fakechild tick", after=refused + 1, timeout=WAIT_S)
    assert running_pid(base) == pid and parent_of(pid) == d.proc.pid, "the engine is still the daemon's child"
    assert not _lines_after(d, mark, "vLLM stopping") and not _lines_after(d, mark, "config reloaded")
    assert d.stop() == 0 and "Traceback" not in d.log
