"""A home the child can write: vLLM, Hugging Face, Triton and torch write caches under $HOME.

A system user made with `useradd -r -M` has no home, and under the unit's
ProtectHome=read-only every /home is read-only: vLLM then crash-loops on a
PermissionError 40 lines into its traceback. When serve.user's home is missing
or not writable, the child gets one under gpuwarden's state directory, owned
by serve.user, with the caches pointed into it. A home that works is left
alone, so caches (and downloaded models) already there are kept.

The unit gives root no CAP_CHOWN, so root cannot give a folder away: serve.user
makes its own home (`mkdir` run as it), in home/ under the state directory,
which root lets the user's group into (root's, that group, 1730: a member may
add an entry, not list the others nor remove one that is not its own).
"""

from __future__ import annotations

import errno
import logging
import os
import stat
import subprocess
import time
from pathlib import Path

from ...base.statedir import state_dir
from .identity import Identity, popen

log = logging.getLogger("gpuwarden")

MAKE_TIMEOUT_S = 10.0  # mkdir and chgrp on a local disk: far less
TOOLS_PATH = {"PATH": "/usr/bin:/bin"}

# The cache variables, relative to the home they get.
CACHES = {
    "XDG_CACHE_HOME": ".cache",
    "VLLM_CACHE_ROOT": ".cache/vllm",
    "HF_HOME": ".cache/huggingface",
    "TRITON_CACHE_DIR": ".cache/triton",
    "TORCHINDUCTOR_CACHE_DIR": ".cache/torchinductor",
}


class HomeError(Exception):
    """No writable home can be given; the message names the user and the path."""


def home_problem(identity: Identity) -> str | None:
    """Why identity's home cannot hold its caches, or None when it can."""
    home = Path(identity.home or "/nonexistent")
    try:
        st = home.stat()
    except FileNotFoundError:
        return f"its home {home} does not exist"
    except OSError as exc:
        return f"its home {home} cannot be read ({exc.strerror})"
    if not stat.S_ISDIR(st.st_mode):
        return f"its home {home} is not a directory"
    if os.statvfs(home).f_flag & os.ST_RDONLY:
        return f"its home {home} is on a read-only mount (ProtectHome=read-only under the unit)"
    if not _writable_by(st, identity):
        return f"its home {home} is not writable by {identity.name}"
    return None


def _writable_by(st: os.stat_result, identity: Identity) -> bool:
    if st.st_uid == identity.uid:
        return bool(st.st_mode & stat.S_IWUSR)
    if st.st_gid == identity.gid or st.st_gid in identity.groups:
        return bool(st.st_mode & stat.S_IWGRP)
    return bool(st.st_mode & stat.S_IWOTH)


def child_home(identity: Identity, create: bool, environ=os.environ, on_loop: bool = False
               ) -> tuple[dict[str, str], str | None]:
    """(environment for the child, why it got one) -- {} and None when its own home works. With create,
    makes the home and cache directories under the state directory, owned by the user; on_loop (the daemon's
    main loop: a reload, SIGUSR2's check), which must not wait on a process run as the user, only checks that
    a home made before (at the daemon's start) is there. Raises HomeError."""
    why = home_problem(identity)
    if why is None:
        return {}, None
    home = state_dir(environ) / "home" / identity.name
    env = {"HOME": str(home), **{name: str(home / sub) for name, sub in CACHES.items()}}
    if create and on_loop:
        if not _made_for(identity, home):
            raise HomeError(f"serve.user {identity.name}: {why}, and {home} is made only at the daemon's start "
                            "(the main loop runs nothing as serve.user): restart the daemon, or give it a "
                            "writable home")
    elif create:
        try:
            _make_own(identity, home, [home / sub for sub in CACHES.values()])
        except OSError as exc:
            raise HomeError(f"serve.user {identity.name}: {why}, and {home} cannot be made for it "
                            f"({exc.strerror}): give it a writable home") from None
    return env, f"{identity.name}: {why}; the engine's home and caches are {home}"


def _made_for(identity: Identity, home: Path) -> bool:
    """home is identity's own folder, in a home/ it may pass through: what _make_own left (the caches inside
    are the user's to make again, as the engine's libraries do)."""
    try:
        st, parent = os.lstat(home), os.stat(home.parent)
    except OSError:
        return False
    reachable = not identity.switch or parent.st_gid == identity.gid  # home/ is 1730, root's, in the user's group
    return stat.S_ISDIR(st.st_mode) and st.st_uid == identity.uid and reachable


def _make_own(identity: Identity, top: Path, inside: list[Path]) -> None:
    """top and the folders inside it, 0700, made by identity itself so that they are its own. Raises OSError."""
    top.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
    if identity.switch:
        try:
            st = os.lstat(top)
        except FileNotFoundError:
            st = None
        if st is not None and stat.S_ISDIR(st.st_mode) and st.st_uid != identity.uid:
            # A folder of another uid (serve.user made anew with another uid, whose old home holds its caches and
            # models): not this user's to take, nor ours to move; an operator's to settle.
            raise OSError(errno.EEXIST, f"{top} is there and is a folder of uid {st.st_uid}, not {identity.name}'s")
        if st is not None and not stat.S_ISDIR(st.st_mode):
            # A link or a file serve.user put there (its group may add entries to home/, not folders of another):
            # moved aside, never followed, by root, whose folder home/ is. Refusing would fail the whole daemon's
            # start (exit 78, not restarted): tuning and monitoring down with serving, by one local user.
            aside = top.with_name(f".{top.name}.not-a-home.{time.time_ns()}")
            os.rename(top, aside)
            log.warning("%s was not %s's own folder (%s): moved aside to %s; its home is made anew", top,
                        identity.name, _kind(st), aside.name)
            st = None
        if st is None:
            let_group_in(top.parent, identity, 0o1730)
    _run(popen(identity, ["mkdir", "-p", "--", str(top), *map(str, inside)], TOOLS_PATH, umask=0o077,
               stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE))


def _kind(st: os.stat_result) -> str:
    if stat.S_ISLNK(st.st_mode):
        return "a symbolic link"
    if stat.S_ISDIR(st.st_mode):
        return f"a folder of uid {st.st_uid}"
    return "a file" if stat.S_ISREG(st.st_mode) else "not a folder"


def let_group_in(folder: Path, identity: Identity, mode: int) -> None:
    """root's folder into identity's group, with mode. The owner may give its file to a group it is in without
    CAP_CHOWN, so chgrp runs as root with that one group. Everything is done on the folder opened once, without
    following a link: a path checked and then changed by name let serve.user, where it may rename entries beside
    the folder, swap in a link to a root-only file between the check and the chgrp (attacker 8's finding 5).
    Raises OSError."""
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
            raise OSError(errno.EPERM, f"{folder} is not root's folder")
        if st.st_gid != identity.gid:
            # the opened folder itself, through the fd the tool inherits (its /proc/self/fd link names that inode)
            _run(subprocess.Popen(["chgrp", "--dereference", "--", str(identity.gid), f"/proc/self/fd/{fd}"],
                                  env=TOOLS_PATH, cwd="/", pass_fds=(fd,), extra_groups=[identity.gid],
                                  stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE))
        os.fchmod(fd, mode)
    finally:
        os.close(fd)


def _run(proc: subprocess.Popen) -> None:
    """Waits for a short tool; OSError with its last line when it fails."""
    try:
        _, err = proc.communicate(timeout=MAKE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise OSError(errno.ETIMEDOUT, f"{proc.args[0]} took more than {MAKE_TIMEOUT_S:g} s") from None
    if proc.returncode != 0:
        lines = err.decode("utf-8", "replace").strip().splitlines()
        raise OSError(errno.EPERM, lines[-1] if lines else f"{proc.args[0]} exited {proc.returncode}")
