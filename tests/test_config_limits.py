"""Every input has limits: hostile config files get one FILE:LINE line and exit 78 from `gpuwarden check`,
in well under a second, as real processes (a FIFO must not hang, /dev/zero must not be read)."""

import os
import pwd
import resource
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from conftest import gpuwarden_cmd, subprocess_env
from gpuwarden import config
from gpuwarden.base.yamlfile import ConfigError

pytestmark = pytest.mark.process


def bomb(levels):
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, levels)]
    return "\n".join(lines) + "\n"


CASES = {
    "recursive alias": ("a: &x [*x]\n", 1, "a.0: an alias that contains itself"),
    "2000-deep nesting": ("x: " + "[" * 2000 + "]" * 2000 + "\n", 1, "(yaml): nested more than 64 levels deep"),
    "400-digit integer": ("poll_interval_s: 1" + "0" * 399 + "\n", 1, "poll_interval_s: a number with 400 digits"),
    "5000-digit integer": ("\n\npoll_interval_s: 1" + "0" * 4999 + "\n", 3, "a number with 5000 digits"),
    "alias bomb, 7 levels": (bomb(7), 5, "a4: aliases expand to more than 100000 values"),
    "alias bomb, 9 levels": (bomb(9), 5, "a4: aliases expand to more than 100000 values"),
    "50 MB file": ("# " + "x" * (50 * 1024 * 1024) + "\n", 1, "(file): larger than 256 KiB"),
    "a NUL byte": ("poll_interval_s: 1\x00\n", 1, "(yaml): invalid YAML: "),
    "a top-level list": ("# a list, not a mapping\n\n- a\n- b\n", 3, "(top level): expected a mapping of settings"),
}


# `gpuwarden check` of an empty file costs ~0.6 s of CPU (the interpreter and the package); an alias bomb that
# expanded (7 levels: ten million values) costs tens of seconds, and 9 levels never ends.
CPU_BOUND_S = 3.0


def check(path):
    """`gpuwarden check` on path, and the CPU seconds it took: a bomb that expanded would burn seconds of CPU,
    where a busy machine only stretches the wall clock (CI runs other work beside the tests)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.run(gpuwarden_cmd() + ["check", "-c", str(path)], capture_output=True, text=True,
                          env=subprocess_env(), timeout=60)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return proc, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


@pytest.mark.parametrize("case", CASES)
def test_hostile_config_files_are_one_located_line(write, case):
    text, line, says = CASES[case]
    path = write("gpuwarden.yaml", text)
    proc, took = check(path)
    assert proc.returncode == 78, proc.stderr[-2000:]
    (error,) = proc.stderr.splitlines()
    assert error.startswith(f"{path}:{line}: ") and says in error, error
    assert took < CPU_BOUND_S, f"{took:.2f} s of CPU"


@pytest.mark.parametrize("kind", ["fifo", "/dev/zero"])
def test_a_dropin_that_is_not_a_regular_file_is_refused_not_read(write, kind):
    path = write("gpuwarden.yaml", "poll_interval_s: 1\n")
    dropin = path.parent / "conf.d" / "10-x.yaml"
    dropin.parent.mkdir()
    os.mkfifo(dropin) if kind == "fifo" else os.symlink("/dev/zero", dropin)
    proc, took = check(path)
    assert proc.returncode == 78 and took < CPU_BOUND_S, (proc.returncode, took)
    assert proc.stderr.strip() == f"{dropin}:1: (file): not a regular file (a FIFO, a device or a socket is never read)"


def test_dropin_conventions(write):
    path = write("gpuwarden.yaml", "poll_interval_s: 1\n")
    write("conf.d/.#20-edit.yaml", "poll_interval_s: [broken\n")  # an editor's lock file
    write("conf.d/20-edit.yaml~", "poll_interval_s: [broken\n")  # a backup
    write("conf.d/30-notes.yaml", "# only comments, for now\n")
    write("conf.d/40-real.yaml", "poll_interval_s: 2\n")
    proc, _ = check(path)
    assert proc.returncode == 0, proc.stderr
    assert f"config OK: {path}, {path.parent / 'conf.d' / '30-notes.yaml'}, {path.parent / 'conf.d' / '40-real.yaml'}" \
        in proc.stdout


def test_a_conf_d_that_cannot_be_listed_is_an_error_not_skipped(child_user):
    if os.geteuid() != 0:
        pytest.skip("needs root to make a directory the checking user cannot list")
    folder = Path(tempfile.mkdtemp(prefix="gpuwarden-confd-"))  # /tmp: other users can reach it
    try:
        (folder / "conf.d").mkdir()
        (folder / "gpuwarden.yaml").write_text("poll_interval_s: 1\n")
        os.chmod(folder, 0o755)
        os.chmod(folder / "gpuwarden.yaml", 0o644)
        os.chmod(folder / "conf.d", 0o700)
        # A process of another user (forked, so it needs no interpreter it could not reach) loads the config.
        entry = pwd.getpwnam(child_user)
        read, write_end = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(read)
            os.setgid(entry.pw_gid)
            os.setuid(entry.pw_uid)
            try:
                config.load(folder / "gpuwarden.yaml")
                said = "loaded"
            except ConfigError as exc:
                said = str(exc)
            os.write(write_end, said.encode())
            os._exit(0)
        os.close(write_end)
        said = os.read(read, 4096).decode()
        os.waitpid(pid, 0)
        assert said == f"{folder / 'conf.d'}:1: (file): permission denied: its drop-ins cannot be checked (run as root)"
    finally:
        shutil.rmtree(folder)

