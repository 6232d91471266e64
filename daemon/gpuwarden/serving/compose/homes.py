"""A home the child can write: vLLM, Hugging Face, Triton and torch write caches under $HOME.

A system user made with `useradd -r -M` has no home, and under the unit's
ProtectHome=read-only every /home is read-only: vLLM then crash-loops on a
PermissionError 40 lines into its traceback. When serve.user's home is missing
or not writable, the child gets one under gpuwarden's state directory, owned
by serve.user, with the caches pointed into it. A home that works is left
alone, so caches (and downloaded models) already there are kept.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from ...statedir import state_dir
from .identity import Identity

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


def child_home(identity: Identity, create: bool, environ=os.environ) -> tuple[dict[str, str], str | None]:
    """(environment for the child, why it got one) -- {} and None when its own home works. With create,
    makes the home and cache directories under the state directory, owned by the user. Raises HomeError."""
    why = home_problem(identity)
    if why is None:
        return {}, None
    home = state_dir(environ) / "home" / identity.name
    env = {"HOME": str(home), **{name: str(home / sub) for name, sub in CACHES.items()}}
    if create:
        try:
            for path in [home, *(home / sub for sub in CACHES.values())]:
                path.mkdir(mode=0o700, parents=True, exist_ok=True)
                if identity.switch:
                    os.chown(path, identity.uid, identity.gid)
        except OSError as exc:
            raise HomeError(f"serve.user {identity.name}: {why}, and {home} cannot be made for it "
                            f"({exc.strerror}): give it a writable home") from None
    return env, f"{identity.name}: {why}; the engine's home and caches are {home}"
