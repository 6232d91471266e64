"""The folders made for serve.user (its home when it has none, the proxy's dump directory) as the unit runs the
daemon: root without CAP_CHOWN or CAP_DAC_OVERRIDE, which cannot give a folder away."""

import os
import pwd
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from conftest import subprocess_env

UNIT_CAPS = ["setpriv", "--bounding-set", "-all,+sys_admin,+setuid,+setgid,+kill", "--no-new-privs"]
AS_NOBODY = ["setpriv", "--reuid", "nobody", "--regid", "nogroup", "--clear-groups"]
MAKE = """
import sys
from pathlib import Path
from gpuwarden.proxy.child import prepare_dump_dir
from gpuwarden.serving.compose.homes import child_home
from gpuwarden.serving.compose.identity import resolve

user = resolve("nobody")
env, why = child_home(user, create=True)
print(env["HOME"])
prepare_dump_dir(Path(sys.argv[1]), user)
"""


@pytest.fixture
def reachable():
    """A folder every user can pass through (pytest's own tmp is root's 0700)."""
    base = Path(tempfile.mkdtemp(prefix="gpuwarden-userdirs-", dir="/tmp"))
    base.chmod(0o755)
    yield base
    shutil.rmtree(base)


@pytest.mark.process
@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv"), reason="needs root and setpriv")
def test_a_user_without_a_home_gets_its_own_and_a_dump_dir_under_the_units_capabilities(reachable):
    nobody = pwd.getpwnam("nobody")
    assert not os.path.exists(nobody.pw_dir)  # /nonexistent: a user without a home
    env = dict(subprocess_env(), STATE_DIRECTORY=str(reachable / "state"))
    dumps = reachable / "state" / "proxy-dumps"
    for _ in range(2):  # and again, with both there: kept
        made = subprocess.run([*UNIT_CAPS, sys.executable, "-c", MAKE, str(dumps)], capture_output=True,
                              text=True, env=env, timeout=60)
        assert made.returncode == 0 and "cannot be prepared" not in made.stderr, made.stderr
    home = Path(made.stdout.strip())
    assert home == reachable / "state" / "home" / "nobody"
    for folder in (home, home / ".cache" / "vllm", home / ".cache" / "huggingface"):
        st = folder.lstat()
        assert stat.S_ISDIR(st.st_mode) and st.st_uid == nobody.pw_uid and st.st_mode & 0o777 == 0o700, folder
    homes = home.parent.lstat()  # root's, only nobody's group may add to it
    assert (homes.st_uid, homes.st_gid, homes.st_mode & 0o7777) == (0, nobody.pw_gid, 0o1730)
    st = dumps.lstat()
    assert (st.st_uid, st.st_gid, st.st_mode & 0o777) == (0, nobody.pw_gid, 0o770)
    # the proxy, as nobody, makes its session folder and a turn there
    turn = subprocess.run([*AS_NOBODY, "sh", "-c", f"mkdir -m 0700 {dumps}/s && echo x > {dumps}/s/t.json"],
                          capture_output=True, text=True, timeout=30)
    assert turn.returncode == 0, turn.stderr
    # and the engine, as nobody, writes its caches
    cache = subprocess.run([*AS_NOBODY, "sh", "-c", f"echo x > {home}/.cache/vllm/c"], capture_output=True,
                           text=True, timeout=30)
    assert cache.returncode == 0, cache.stderr


@pytest.mark.process
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root")
@pytest.mark.parametrize("squat", ["link", "file"])
def test_what_serve_user_puts_where_its_home_goes_is_moved_aside_and_the_home_made(reachable, tmp_path, caplog, squat):
    """Attacker 6's finding 5: serve.user may add entries to home/ (its group's, 1730), so it could put a link or a
    file where its home goes; every start then refused it, and the daemon with it (exit 78, not restarted). Root
    moves it aside (never following it) and the user makes its home anew."""
    from gpuwarden.serving.compose.homes import child_home
    from gpuwarden.serving.compose.identity import resolve

    nobody = resolve("nobody")
    home = reachable / "state" / "home" / "nobody"
    target = tmp_path / "elsewhere"
    target.mkdir()
    home.parent.mkdir(parents=True)
    home.symlink_to(target) if squat == "link" else home.write_text("x")
    with caplog.at_level("WARNING", logger="gpuwarden"):
        env, why = child_home(nobody, create=True, environ={"STATE_DIRECTORY": str(reachable / "state")})
    st = home.lstat()
    assert stat.S_ISDIR(st.st_mode) and st.st_uid == nobody.uid and env["HOME"] == str(home)
    [line] = [r.getMessage() for r in caplog.records if "moved aside" in r.getMessage()]
    assert ("a symbolic link" if squat == "link" else "a file") in line
    assert list(target.iterdir()) == [], "the link was never followed"
    assert [p.name.startswith(".nobody.not-a-home.") for p in home.parent.iterdir() if p != home] == [True]


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root")
def test_a_folder_another_user_owns_where_the_home_goes_is_refused(reachable, tmp_path):
    """A folder of another uid (serve.user made anew under another uid: its old caches and models in it) is not
    serve.user's to plant nor ours to move: refused, in one line."""
    from gpuwarden.serving.compose.homes import HomeError, child_home
    from gpuwarden.serving.compose.identity import resolve

    squatted = reachable / "state" / "home" / "nobody"
    squatted.mkdir(parents=True)  # root's: not nobody's own
    with pytest.raises(HomeError, match="is there and is a folder of uid 0, not nobody's"):
        child_home(resolve("nobody"), create=True, environ={"STATE_DIRECTORY": str(reachable / "state")})


@pytest.mark.process
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root (serve.user nobody)")
def test_the_main_loop_runs_nothing_as_serve_user_for_its_home(reachable, monkeypatch):
    """A reload and SIGUSR2's check (on_loop) only check that the home made at the daemon's start is there: a
    mkdir or chgrp run as serve.user could hold the loop for MAKE_TIMEOUT_S. The start (off the loop) makes it."""
    from gpuwarden import config
    from gpuwarden.backends import open_configured
    from gpuwarden.serving.run.runtime import prepare_launch
    from gpuwarden.base.yamlfile import InvalidConfig

    monkeypatch.setenv("STATE_DIRECTORY", str(reachable / "state"))
    cfg = config.parse_text("gpu:\n  backend: sim\n  scenario: dgx-spark\nserve:\n  enabled: true\n"
                            "  profile: generic\n  model: /fake/model\n  command: [/usr/bin/python3, /fake/child.py]\n"
                            "  port: 18765\n  user: nobody\n")
    backend = open_configured(cfg)
    spawned = []
    real_popen = subprocess.Popen

    def popen(*args, **kwargs):
        spawned.append(args[0] if args else kwargs.get("args"))
        return real_popen(*args, **kwargs)

    monkeypatch.setattr(subprocess, "Popen", popen)
    try:
        with pytest.raises(InvalidConfig, match="is made only at the daemon's start .*restart the daemon"):
            prepare_launch(cfg, backend, (), deep=False, on_loop=True)
        assert spawned == [] and not (reachable / "state" / "home" / "nobody").exists()
        prepare_launch(cfg, backend, (), deep=False)  # the daemon's start: made here, as serve.user
        assert {"chgrp", "mkdir"} <= {argv[0] for argv in spawned}
        spawned.clear()
        launch = prepare_launch(cfg, backend, (), deep=False, on_loop=True)  # made before: used, nothing run
        assert spawned == []
        assert launch.engine.env["HOME"] == str(reachable / "state" / "home" / "nobody")
    finally:
        backend.close()


@pytest.mark.process
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root (serve.user nobody)")
def test_a_folder_let_into_the_group_is_the_one_checked_never_what_a_link_put_in_its_place_names(reachable):
    """Attacker 8's finding 5: let_group_in checked the folder by lstat, then ran chgrp and chmod by name, both
    following links: serve.user swapped a link to a root-only file in between, which became root:its group 0770."""
    from gpuwarden.serving.compose.homes import let_group_in
    from gpuwarden.serving.compose.identity import resolve

    user = resolve("nobody")
    secret = reachable / "root-only"
    secret.write_text("ROOT-ONLY")
    secret.chmod(0o600)
    folder = reachable / "dumps"
    folder.mkdir()
    let_group_in(folder, user, 0o770)
    st = os.stat(folder)
    assert (st.st_gid, stat.S_IMODE(st.st_mode)) == (user.gid, 0o770)
    folder.rmdir()
    folder.symlink_to(secret)  # what the swap leaves at the name
    with pytest.raises(OSError):
        let_group_in(folder, user, 0o770)
    st = os.stat(secret)
    assert (st.st_gid, stat.S_IMODE(st.st_mode)) == (0, 0o600)
