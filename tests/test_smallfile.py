"""base/smallfile.py: the one capped, non-blocking small-file read and the one atomic write."""

import errno
import os
import threading

import pytest

from gpuwarden.base import smallfile


def test_a_write_that_fails_halfway_leaves_the_old_file_whole_and_no_temp(tmp_path, monkeypatch):
    path = tmp_path / "state.json"
    smallfile.write_atomic(path, b"old" * 1000)
    real_write = os.write

    def half_then_full_disk(fd, data):
        if len(data) > 100:
            return real_write(fd, bytes(data[:100]))  # a short write, as on a full disk: the rest comes next turn
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "write", half_then_full_disk)
    with pytest.raises(OSError):
        smallfile.write_atomic(path, b"new" * 1000)
    monkeypatch.undo()
    assert path.read_bytes() == b"old" * 1000
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state.json"]


@pytest.mark.process
def test_readers_see_the_old_file_or_the_new_never_half_while_processes_write_it(tmp_path):
    """Two processes (the shared temp name of each its own) and a thread of this one write big files in turn;
    every read is one of them whole."""
    path = tmp_path / "gpus.json"
    bodies = [bytes([65 + i]) * 200_000 for i in range(3)]
    smallfile.write_atomic(path, bodies[0], shared=True)
    stop = threading.Event()
    children = []
    for body in bodies[1:]:
        pid = os.fork()
        if pid == 0:  # pragma: no cover (the child)
            code = 0
            try:
                for _ in range(300):
                    smallfile.write_atomic(path, body, shared=True)
            except BaseException:
                code = 1  # one writer's temp file taken by the other's (a shared temp name): its rename fails
            finally:
                os._exit(code)
        children.append(pid)
    seen = set()

    def read() -> None:
        while not stop.is_set():
            seen.add(smallfile.read(path, 1 << 20))

    reader = threading.Thread(target=read)
    reader.start()
    codes = [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in children]
    stop.set()
    reader.join()
    assert codes == [0, 0] and seen <= set(bodies) and len(seen) >= 1
    assert [p.name for p in tmp_path.iterdir()] == ["gpus.json"]  # each writer's temp went over the file


def test_read_refuses_a_link_a_fifo_and_too_much_unless_told(tmp_path):
    target = tmp_path / "target"
    target.write_bytes(b"#!/usr/bin/python3\n" + b"x" * 100)
    (tmp_path / "link").symlink_to(target)
    os.mkfifo(tmp_path / "fifo")
    assert smallfile.read(tmp_path / "missing", 10) is None
    with pytest.raises(smallfile.Unreadable) as link:
        smallfile.read(tmp_path / "link", 1000)
    assert link.value.errno == errno.ELOOP and link.value.st is None
    assert smallfile.read(tmp_path / "link", 1000, follow=True) == target.read_bytes()
    with pytest.raises(smallfile.Unreadable, match="not a regular file") as fifo:
        smallfile.read(tmp_path / "fifo", 1000, follow=True)  # never waits for a writer
    assert fifo.value.errno is None and fifo.value.st is not None
    with pytest.raises(smallfile.Unreadable, match="more than 10 bytes"):
        smallfile.read(target, 10)
    assert smallfile.read(target, 10, head=True) == b"#!/usr/bin"
    with pytest.raises(smallfile.Unreadable, match="NUL"):  # attacker 17's F5: a ValueError and a traceback
        smallfile.read(str(target) + "\0x", 1000)


def test_read_lets_the_caller_refuse_the_open_file_before_a_byte_is_read(tmp_path, monkeypatch):
    path = tmp_path / "secret"
    path.write_bytes(b"KEY=x")
    path.chmod(0o644)
    reads = []
    real_read = os.read
    monkeypatch.setattr(os, "read", lambda fd, n: reads.append(n) or real_read(fd, n))

    def private(st: os.stat_result) -> None:
        if st.st_mode & 0o077:
            raise PermissionError("others may read it")

    with pytest.raises(PermissionError):
        smallfile.read(path, 100, check=private)
    assert reads == []
    path.chmod(0o600)
    assert smallfile.read(path, 100, check=private) == b"KEY=x"
