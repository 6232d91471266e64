"""Who code from vLLM's install runs as, and the one way such a process is started.

gpuwarden runs as root with CAP_SYS_ADMIN; vLLM's venv is often writable by the
account that serves it. So everything executed from that install (the child,
vLLM's flag parser in `run`, `check --deep` and `doctor`) starts here: as
serve.user, with only the video/render groups, with no capabilities (a switch
from uid 0 to another uid clears them), and with no_new_privs set, so that no
setuid or file-capability binary can win them back. serve.user is checked by
uid and groups, not by name: uid 0, or membership of a group that grants root,
is refused whatever the name.
"""

from __future__ import annotations

import ctypes
import grp
import os
import pwd
import resource
import subprocess
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

DEVICE_GROUPS = ("video", "render")  # /dev/nvidia* and /dev/dri access; the only extra groups the child gets
ROOT_GROUPS = ("root", "sudo", "wheel", "admin")  # gid 0, and the groups sudo gives root to on Debian/RHEL/Ubuntu
PR_SET_NO_NEW_PRIVS = 38
MAX_OUTPUT_BYTES = 1024 * 1024  # what run_bounded reads of each stream: the probes print one line
# The largest file a run_bounded child may write (RLIMIT_FSIZE, soft and hard): its output goes to our temporary
# files, root's and already deleted, which serve.user's venv (a .pth runs at start) could fill at ~1 GB/s until the
# deadline. The probes print a line, but the flag check imports vLLM, which may write caches of its own: 256 MiB a
# file is far above both and still leaves the disk alone. The engine itself is not limited (identity.popen's default).
MAX_WRITE_BYTES = 256 * 1024 * 1024


class IdentityError(Exception):
    """serve.user cannot be used; the message is one line for the user."""


@dataclass(frozen=True)
class Identity:
    name: str
    uid: int
    gid: int
    home: str
    groups: tuple[int, ...]  # the supplementary groups the process gets
    switch: bool  # False: we are not root, so the process runs as ourselves
    drop_caps: bool = False  # the process keeps our uid but no capability (the container engine's shim)

    def popen_kwargs(self) -> dict:
        """What subprocess needs to start a process as this identity."""
        if not self.switch:
            return {}
        return {"user": self.uid, "group": self.gid, "extra_groups": list(self.groups)}

    def env(self) -> dict[str, str]:
        return {"HOME": self.home, "USER": self.name, "LOGNAME": self.name}


def resolve(user: str) -> Identity:
    """serve.user as the identity to start vLLM's code with; IdentityError when it must not be used.
    Only root can switch users, so anyone else runs it as themselves (and is not root)."""
    if os.geteuid() != 0:
        me = pwd.getpwuid(os.geteuid())
        return Identity(me.pw_name, me.pw_uid, me.pw_gid, me.pw_dir, (), switch=False)
    try:
        entry = pwd.getpwnam(user)
    except KeyError:
        raise IdentityError(f"user {user} does not exist (create it, or set serve.user)") from None
    if entry.pw_uid == 0:
        raise IdentityError(f"user {user} has uid 0: it is root by another name (the engine never runs as root)")
    member_of = {g.gr_gid: g.gr_name for g in grp.getgrall() if user in g.gr_mem}
    member_of[entry.pw_gid] = _group_name(entry.pw_gid)
    granting = sorted(name for gid, name in member_of.items() if gid == 0 or name in ROOT_GROUPS)
    if granting:
        raise IdentityError(f"user {user} is in group {', '.join(granting)}, which grants root "
                            "(the engine never runs as root): use an account outside it")
    groups = tuple(g.gr_gid for g in grp.getgrall() if g.gr_name in DEVICE_GROUPS)
    return Identity(user, entry.pw_uid, entry.pw_gid, entry.pw_dir, groups, switch=True)


def shim_identity() -> Identity:
    """Who the container engine's shim (cli/container_run.py) runs as: ourselves, root under the unit, without a
    capability and with no_new_privs. Root's uid is what reaches the runtime's root-only API socket (no
    CAP_DAC_OVERRIDE needed: it is root's own); nothing else of root's is needed, and the engine itself runs inside
    the container as serve.user."""
    me = pwd.getpwuid(os.geteuid())
    return Identity(me.pw_name, me.pw_uid, me.pw_gid, me.pw_dir, (), switch=False, drop_caps=True)


def _group_name(gid: int) -> str:
    try:
        return grp.getgrgid(gid).gr_name
    except KeyError:
        return str(gid)


# Resolved here, in the parent: between fork and exec the child only calls it (no import, no lookup).
_prctl = ctypes.CDLL(None, use_errno=True).prctl


def _no_new_privs() -> None:
    if _prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS) failed")


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


_capset = ctypes.CDLL(None, use_errno=True).capset
CAP_VERSION_3 = 0x20080522  # _LINUX_CAPABILITY_VERSION_3: two 32-bit words of each set


def _no_caps() -> None:
    """Every capability set emptied (the ambient set follows the permitted one). With no_new_privs, an exec as
    root then gains none back: the kernel keeps the new permitted set within the old one."""
    header, data = _CapHeader(CAP_VERSION_3, 0), (_CapData * 2)()
    if _capset(ctypes.byref(header), data) != 0:
        raise OSError(ctypes.get_errno(), "capset() failed")


def _file_limit(max_file_bytes: int) -> int:
    """The file size limit a child asked to stay under max_file_bytes gets: never above the hard limit we have
    ourselves (lowering it needs no capability; raising it would fail the start)."""
    hard = resource.getrlimit(resource.RLIMIT_FSIZE)[1]
    return max_file_bytes if hard == resource.RLIM_INFINITY else min(max_file_bytes, hard)


def _preexec(max_file_bytes: int | None, drop_caps: bool = False) -> Callable[[], None]:
    """What the child runs between fork and exec: no_new_privs, no capability where drop_caps asks, and the file
    size limit where one is asked for, soft and hard alike, so that the child cannot raise it again. Computed here,
    in the parent."""
    if max_file_bytes is None and not drop_caps:
        return _no_new_privs
    limit = None if max_file_bytes is None else _file_limit(max_file_bytes)

    def start() -> None:
        _no_new_privs()
        if drop_caps:
            _no_caps()
        if limit is not None:
            resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return start


def popen(identity: Identity, argv: Sequence[str], env: Mapping[str, str],
          kind: type[subprocess.Popen] | None = None, max_file_bytes: int | None = None,
          **kwargs) -> subprocess.Popen:
    """Start argv as identity: its uid, gid and device groups only, no capabilities, no_new_privs (the unit
    sets NoNewPrivileges=yes too; this covers `check --deep`, `doctor` and `run` outside systemd), in /.
    env may override HOME, USER and LOGNAME; kind: a subclass of Popen (None: Popen itself, looked up at the
    call, as tests that watch subprocess.Popen expect); max_file_bytes: no file it (or
    what it starts) writes grows past this (RLIMIT_FSIZE; None: no limit, as for the engine). Raises OSError,
    ValueError or SubprocessError."""
    return (kind or subprocess.Popen)(list(argv), env={**identity.env(), **env}, cwd="/", close_fds=True,
                preexec_fn=_preexec(max_file_bytes, identity.drop_caps), **identity.popen_kwargs(), **kwargs)


@dataclass(frozen=True)
class Finished:
    returncode: int | None  # None: it ran past its deadline and was killed
    stdout: str  # the first MAX_OUTPUT_BYTES
    stderr: str  # the last MAX_OUTPUT_BYTES (where a traceback's last line is)
    stopped: str | None = None  # why its answer is none whatever it says: it wrote as much as it may


KILLED_WAIT_S = 10.0  # how long a killed helper is waited for before it is left to end by itself


def run_bounded(identity: Identity, argv: Sequence[str], env: Mapping[str, str], timeout_s: float,
                spawn: Callable[..., subprocess.Popen] = popen, max_write_bytes: int = MAX_WRITE_BYTES) -> Finished:
    """popen (or spawn, popen's stand-in: the daemon's, from a worker thread), waited for at most timeout_s (then
    killed), with at most MAX_OUTPUT_BYTES of each stream read: the output goes to temporary files, so a child
    that prints without end neither blocks on a full pipe nor fills our memory, and no file it writes grows past
    max_write_bytes, so it cannot fill our disk either (it gets SIGXFSZ, or EFBIG where it ignores that, as Python
    does). Raises what popen raises."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        proc = spawn(identity, argv, env, stdout=out, stderr=err, stdin=subprocess.DEVNULL,
                     max_file_bytes=max_write_bytes)
        stuck = False
        try:
            code = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            # Killed, and waited for only so long: a process stuck in the kernel cannot die (a flag check sat in
            # sched_setaffinity with SIGKILL pending for good, under load on this CI's VM), and waiting for it
            # held a reload for ever. It is left to end when the kernel lets it (the daemon reaps its children).
            try:
                proc.wait(KILLED_WAIT_S)
            except subprocess.TimeoutExpired:
                stuck = True
            code = None
        # A stream at the limit was cut short: whatever it holds is not the child's whole answer.
        limit = _file_limit(max_write_bytes)
        full = max(os.fstat(out.fileno()).st_size, os.fstat(err.fileno()).st_size) >= limit
        stopped = f"it wrote more than {_size(limit)} of output" if full else None
        if stuck:
            stopped = (f"it did not finish within {timeout_s:g} s, nor end within {KILLED_WAIT_S:g} s of SIGKILL (pid "
                       f"{proc.pid}, stuck in the kernel)")
        out.seek(0)
        stdout = out.read(MAX_OUTPUT_BYTES)
        err.seek(max(0, err.seek(0, os.SEEK_END) - MAX_OUTPUT_BYTES))
        stderr = err.read()
    return Finished(code, stdout.decode("utf-8", "replace"), stderr.decode("utf-8", "replace"), stopped)


def _size(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 and n % (1 << 20) == 0 else f"{n} bytes"
