"""Every file the daemon keeps in its state and runtime directories is written through smallfile.write_atomic: a
FIFO planted at its temp name (or, for metrics-url, at the file itself) is never waited on, a link planted there
is never followed, and the file still gets its content."""

import json
import os
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest

from conftest import subprocess_env
from test_daemon import write_config

# A bound on a hang: a writer stuck opening a FIFO waits for ever, and a write's fsync on a busy disk can pass 1 s
WITHIN_S = 30.0


def plant(kind: str, at: Path, outside: Path) -> None:
    if kind == "fifo":
        os.mkfifo(at)
    else:
        at.symlink_to(outside)


def temp_names(path: Path) -> list[Path]:
    """Where a writer has put its temp file: the name it used before smallfile (x.json -> x.tmp) and now."""
    return [path.with_suffix(".tmp"), path.with_name(path.name + ".tmp")]


def write_within(write, planted: list[Path]) -> None:
    """write() returns within WITHIN_S; a writer stuck opening a FIFO is let go (a reader opens it) so the
    test fails instead of hanging."""
    done = threading.Event()
    failed: list[BaseException] = []

    def run():
        try:
            write()
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            failed.append(exc)
        done.set()

    threading.Thread(target=run, daemon=True).start()
    finished = done.wait(WITHIN_S)
    if not finished:
        for path in planted:
            if path.is_fifo():
                os.close(os.open(path, os.O_RDONLY | os.O_NONBLOCK))
    assert finished, f"the write waited on what was planted at {', '.join(map(str, planted))}"
    assert not failed, failed


def marker(tmp_path):
    from gpuwarden.tune.sweeps import Sweeps

    tuning = SimpleNamespace(backend=SimpleNamespace(gpus=lambda: [SimpleNamespace(index=0, uuid="GPU-a")]))
    path = tmp_path / "state" / "sweep.json"
    return path, lambda: Sweeps(tuning, marker=path)._write_marker("power_limit", [0]), \
        lambda data: data["gpus"] == ["GPU-a"] and data["setting"] == "power_limit"


def children(tmp_path):
    from gpuwarden.serving.run import handover

    record = handover.Record((handover.Recorded("vllm", 4242, 17, 1000, "ab" * 32),))
    state = tmp_path / "state"
    return state / handover.RECORD, lambda: handover.save(state, record), \
        lambda data: data["children"][0]["pid"] == 4242


def originals(tmp_path):
    from gpuwarden.tune.originals import OriginalsStore

    path = tmp_path / "state" / "originals.json"
    return path, lambda: OriginalsStore(path, boot="b").save({"GPU-a": {"power_limit": 300}}), \
        lambda data: data == {"boot_id": "b", "gpus": {"GPU-a": {"power_limit": 300}}}


def installed_cache(tmp_path):
    from gpuwarden.serving.compose import installed

    state = tmp_path / "state"
    found = installed.Installed("/opt/vllm/bin/python", True, {"vllm": "0.9"}, None, None, None, ("/opt",), (1,))
    installed._memory.pop(found.python, None)
    return installed._cache_file(state, found.python), lambda: installed._to_cache(state, found), \
        lambda data: data["versions"] == {"vllm": "0.9"}


WRITERS = {"sweep marker": marker, "children.json": children, "originals": originals,
           "installed cache": installed_cache}


@pytest.mark.parametrize("kind", ["fifo", "link"])
@pytest.mark.parametrize("writer", list(WRITERS))
def test_a_state_file_is_written_past_a_fifo_or_link_at_its_temp_name(tmp_path, writer, kind):
    path, write, holds = WRITERS[writer](tmp_path)
    path.parent.mkdir(parents=True)
    outside = tmp_path / "outside"
    outside.write_text("not yours")
    planted = temp_names(path)
    for at in planted:
        plant(kind, at, outside)
    write_within(write, planted)
    assert outside.read_text() == "not yours"  # the link was not followed
    assert path.is_file() and not path.is_symlink() and holds(json.loads(path.read_text()))
    assert not any(at.exists() or at.is_symlink() for at in planted[1:])  # nothing left at the temp name


def test_a_planted_folder_at_the_temp_name_is_removed_with_a_line_and_a_full_one_refused(tmp_path, caplog):
    from gpuwarden.base import smallfile

    path = tmp_path / "f"
    smallfile.temp_name(path).mkdir()
    smallfile.write_atomic(path, b"x")
    assert path.read_bytes() == b"x" and "a folder was at" in caplog.text
    (smallfile.temp_name(path) / "inside").mkdir(parents=True)
    with pytest.raises(OSError, match="a folder is at .*cannot be removed"):
        smallfile.write_atomic(path, b"y")
    assert path.read_bytes() == b"x"


def test_write_atomic_gives_the_mode_asked_whatever_the_umask(tmp_path):
    from gpuwarden.base import smallfile

    old = os.umask(0o077)
    try:
        smallfile.write_atomic(tmp_path / "url", b"u", 0o644)
    finally:
        os.umask(old)
    assert (tmp_path / "url").stat().st_mode & 0o777 == 0o644


@pytest.mark.process
@pytest.mark.parametrize("kind", ["fifo", "link"])
def test_the_daemon_writes_metrics_url_past_a_fifo_or_link(write, daemons, tmp_path, kind):
    from gpuwarden.base import smallfile

    runtime = tmp_path / "run"
    runtime.mkdir()
    outside = tmp_path / "outside"
    outside.write_text("not yours")
    url = runtime / "metrics-url"
    for at in (url, runtime / "metrics-url.tmp"):  # the file itself: before, it was written in place
        plant(kind, at, outside)
    path, base = write_config(write)
    d = daemons(path, "--sim", "lock-lost", env=dict(subprocess_env(), RUNTIME_DIRECTORY=str(runtime)))
    d.wait_for("serving /metrics", timeout=30)  # logged once the file is written
    assert outside.read_text() == "not yours"
    assert smallfile.read(url, 4096) == (base + "\n").encode()
    assert d.stop() == 0
