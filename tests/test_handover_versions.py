"""Issue 35, attacked again: the handover's check (on the old image's loop) reads the engine's installed versions
from the cache only, while the new image's start asked the engine's interpreter. vLLM changed in the engine's
environment after the engine started (a pip install, or serve.user, whose venv it is): the cache is stale, the
old image's check saw the versions unknown (an error rule a guess: a warning) and handed over, and the new
image read vLLM 0.15.1, found lint attention-backend-case an error and exited 78, the engine left unsupervised.
An adopting start checks from the cache as the handover's check did: one verdict for both. Real processes: the
daemon, the fake engine and its interpreter's real installed-versions probe (as serve.user)."""

import signal
import tempfile
from pathlib import Path

import pytest

from gpuwarden.serving.run import handover
from test_adoption import env_with_state, running_pid
from test_faults import FLAGCHECK, fake, fault_config, no_fakes_left  # noqa: F401 (fixtures)

pytestmark = pytest.mark.process


def installed_vllm(site: Path, version: str) -> None:
    """What `pip install vllm==VERSION` leaves for importlib.metadata: one dist-info (the folder's mtime moves)."""
    for old in site.glob("vllm-*.dist-info"):
        (old / "METADATA").unlink()
        old.rmdir()
    info = site / f"vllm-{version}.dist-info"
    info.mkdir(mode=0o755)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n")
    (info / "METADATA").chmod(0o644)


def test_a_handover_after_vllm_changed_under_the_engine_is_adopted_not_refused_by_the_new_image(
        write, fake, daemons, tmp_path, no_fakes_left):
    folder = Path(tempfile.mkdtemp(prefix="gpuwarden-site-", dir=fake["script"].parent))
    folder.chmod(0o755)
    site = folder / "site"
    site.mkdir(mode=0o755)
    installed_vllm(site, "0.32.0")
    python = folder / "python"  # the installed-versions probe runs for real; the flag check answers as vLLM's
    python.write_text(f'#!/bin/sh\ncase "$*" in *GPUWARDEN-INSTALLED*) exec /usr/bin/python3 "$@";; esac\n'
                      f'exec {FLAGCHECK} "$@"\n')
    python.chmod(0o755)
    path, base, port = fault_config(write, fake, "healthy", serve_extra=(
        f"  args: [--attention-backend, triton_attn]\n  env: {{PYTHONPATH: {site}}}\n"))
    path.write_text(path.read_text().replace(f"python: {FLAGCHECK}", f"python: {python}"))
    env, state = env_with_state(tmp_path)
    d = daemons(path, env=env)
    pid = running_pid(base)
    assert "vLLM 0.32.0" in d.log and "attention-backend-case" not in d.log
    installed_vllm(site, "0.15.1")  # the running engine is the 0.32.0 it started with
    mark = len(d.lines)
    d.proc.send_signal(signal.SIGUSR2)
    d.wait_for("adopted after an upgrade (re-exec, same daemon pid)", after=mark, timeout=30)
    adopted = next(i for i in range(mark, len(d.lines)) if "adopted after an upgrade" in d.lines[i])
    d.wait_for("GPU0 sm", after=adopted + 1, timeout=10)  # the new image's loop runs
    assert d.proc.poll() is None, d.log
    assert running_pid(base) == pid
    assert not handover.load(state).keep
    assert d.stop() == 0
    assert handover.start_ticks(pid) is None
