"""Where the engine will read a Hugging Face id's files: the serving user's Hugging Face cache, resolved as
huggingface_hub resolves it (design/hf-cache-facts.md cites each step), at the revision the launch asks for.
Nothing is downloaded, and nothing of the Hub is asked.

The cache is the environment's the engine gets (serve.env and the serving user's HOME, as compose builds them):
HF_HUB_CACHE, else HUGGINGFACE_HUB_CACHE, else HF_HOME/hub, else XDG_CACHE_HOME/huggingface/hub, else
~/.cache/huggingface/hub, with ~ and $VAR expanded in that environment. The repository's folder is
models--ORG--NAME; a revision that is a full commit hash names its snapshot, any other (a branch, a tag, refs/pr/N)
is read from refs/REVISION. The cache is the serving user's to write, and the daemon reads it as root: a ref is a
regular file of at most REF_MAX bytes holding a commit hash, not a link; the snapshot is a folder inside the
repository's; the files in it are then read by model.py's bounded reader, links kept inside the repository.

An id the Hub would refuse, a revision that climbs out of refs/, a cache path that is relative (an empty variable)
or another cache the engine may read instead (ModelScope, TRANSFORMERS_CACHE, VLLM_MODEL_REDIRECT_PATH) is no
place: the facts are then unknown, and Found.why says where it looked and why it stopped.
"""

from __future__ import annotations

import os
import pwd
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from ...base import smallfile
from .flags import flag_value

# huggingface_hub's validate_repo_id, stricter (ASCII only, the whole string, 96 characters a part): an id it
# refuses, vLLM cannot load either. A part starts and ends with a letter, digit or underscore.
_PART = r"[A-Za-z0-9_](?:[A-Za-z0-9_.-]{0,94}[A-Za-z0-9_])?"
REPO_ID = re.compile(rf"(?:{_PART}/)?{_PART}", re.ASCII)
COMMIT = re.compile(r"[0-9a-f]{40}", re.ASCII)
REVISION = re.compile(r"[A-Za-z0-9_.\-/]{1,256}", re.ASCII)
REF_MAX = 128  # a ref file holds a 40-character commit hash
_VAR = re.compile(r"\$(\w+|\{[^}]*\})", re.ASCII)
TRUE = {"1", "ON", "YES", "TRUE"}
# Variables under which the engine reads config.json from somewhere this reader does not follow.
ELSEWHERE = {
    "VLLM_USE_MODELSCOPE": "the engine reads models from ModelScope's cache",
    "SGLANG_USE_MODELSCOPE": "the engine reads models from ModelScope's cache",
    "VLLM_MODEL_REDIRECT_PATH": "VLLM_MODEL_REDIRECT_PATH may map the id to another folder",
    "TRANSFORMERS_CACHE": "TRANSFORMERS_CACHE is set: transformers 4 reads config.json there, 5 from HF_HUB_CACHE",
}


@dataclass(frozen=True)
class Found:
    """The snapshot folder the engine will read the id from (path), or why there is none; where: the place
    looked at, in words, for a finding."""

    path: Path | None
    why: str = ""
    where: str = ""
    roots: tuple[str, ...] = ()  # the snapshot's and the repository's real paths, as checked: every read stays in them


def is_repo_id(model: str) -> bool:
    return "--" not in model and ".." not in model and not model.endswith(".git") and \
        REPO_ID.fullmatch(model) is not None


def expand(value: str, env: Mapping[str, str]) -> str:
    """os.path.expanduser then expandvars, in env rather than in this process's environment."""
    if value == "~" or value.startswith("~/"):
        home = env.get("HOME")
        if home:
            value = home + value[1:]
    elif value.startswith("~"):
        name, _, rest = value[1:].partition("/")
        try:
            value = pwd.getpwnam(name).pw_dir + ("/" + rest if rest else "")
        except KeyError:
            pass

    def var(match: re.Match) -> str:
        name = match.group(1).strip("{}")
        return env.get(name, match.group(0))

    return _VAR.sub(var, value)


def cache_dir(env: Mapping[str, str]) -> tuple[str, str]:
    """(the hub cache folder, which variable chose it) as huggingface_hub's constants.py computes it in env."""
    if "HF_HUB_CACHE" in env:
        return expand(env["HF_HUB_CACHE"], env), "HF_HUB_CACHE"
    if "HUGGINGFACE_HUB_CACHE" in env:
        return expand(env["HUGGINGFACE_HUB_CACHE"], env), "HUGGINGFACE_HUB_CACHE"
    if "HF_HOME" in env:
        return os.path.join(expand(env["HF_HOME"], env), "hub"), "HF_HOME"
    xdg = env.get("XDG_CACHE_HOME")
    home = os.path.join(xdg if xdg is not None else "~/.cache", "huggingface")
    return os.path.join(expand(home, env), "hub"), "XDG_CACHE_HOME" if xdg is not None else "HOME"


def revision_of(flags: Sequence[str]) -> str:
    return flag_value(flags, "--revision") or "main"


def locate(model: str, flags: Sequence[str], env: Mapping[str, str]) -> Found:
    """The snapshot the engine will read `model` (a Hugging Face id, or --hf-config-path's where given) from."""
    target = flag_value(flags, "--hf-config-path") or model
    revision = revision_of(flags)
    for name, why in ELSEWHERE.items():
        value = env.get(name, "")
        if value and (name not in ("VLLM_USE_MODELSCOPE", "SGLANG_USE_MODELSCOPE") or value.upper() in TRUE):
            return Found(None, f"{target}: {why}; not read", f"{name}={value[:100]}")
    if not is_repo_id(target):
        return Found(None, f"{target[:200]!r} is neither a local directory nor a Hugging Face id")
    if REVISION.fullmatch(revision) is None or ".." in revision.split("/") or revision.startswith("/"):
        return Found(None, f"--revision {revision[:100]!r} is no revision the cache can hold")
    cache, chose = cache_dir(env)
    if not os.path.isabs(cache):
        return Found(None, f"the Hugging Face cache {cache!r} (from {chose}) is a relative path: the engine's "
                           "working folder decides it")
    repo = os.path.join(cache, "models--" + target.replace("/", "--"))
    where = f"{target} at revision {revision} in {cache} (from {chose})"
    # Every path is resolved and held inside the cache (then the repository) before anything is opened or stat'ed
    # as root there: a link to a root-only path answered with different words where it existed (attacker 10's
    # F3, an oracle of existence); what is missing and what leads elsewhere now read alike.
    real_repo = os.path.realpath(repo)
    if not smallfile.under(real_repo, os.path.realpath(cache)) or not os.path.isdir(real_repo):
        return Found(None, f"{target} is in no cache the engine reads: no folder {repo}", where)
    commit = revision
    if COMMIT.fullmatch(revision) is None:
        ref = os.path.join(repo, "refs", revision)
        # Read only inside the repository, checked before and on what was opened (refs/ linked to a root-only
        # folder was read as root, attacker 9's F3); the content is never printed.
        if not smallfile.under(os.path.realpath(ref), real_repo):
            return Found(None, f"{ref}: no such file in the repository's folder", where)
        try:
            raw = smallfile.read(ref, REF_MAX, inside=real_repo)
        except smallfile.Unreadable as exc:
            return Found(None, f"{ref}: {exc}", where)
        text = raw.decode("ascii", "replace").strip() if raw is not None else ""
        if raw is None or COMMIT.fullmatch(text) is None:
            return Found(None, f"{ref}: {'no such file in the repository' if raw is None else 'holds no commit hash'}",
                         where)
        commit = text
    snapshot = os.path.join(repo, "snapshots", commit)
    real_snapshot = os.path.realpath(snapshot)
    if not smallfile.under(real_snapshot, real_repo) or not os.path.isdir(real_snapshot):
        shown = commit if commit == revision else f"the one {revision} names"
        return Found(None, f"the snapshot {shown} is not in {repo}/snapshots", where)
    return Found(Path(snapshot), "", where, (real_snapshot, real_repo))

