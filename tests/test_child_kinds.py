"""The registry of child kinds (serving/run/kinds.py): a reload restarts only the kind whose spec changed. With
real processes: the fake engine, the proxy, and a toy kind registered only in tests/harness/toy_kind.py."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import free_port, subprocess_env
from test_faults import fake, fault_config  # noqa: F401 (fixtures)

pytestmark = pytest.mark.process

TOY_KIND = Path(__file__).resolve().parent / "harness" / "toy_kind.py"


def test_a_reload_that_changes_one_side_kind_restarts_that_child_only(write, fake, tmp_path, passable_state):
    proxy_port, toy_port = free_port(), free_port()
    proxy = f"  proxy: {{enabled: true, listen: '127.0.0.1:{proxy_port}'}}\n"
    path, _, _ = fault_config(write, fake, "healthy", extra=proxy)
    out = subprocess.run([sys.executable, str(TOY_KIND), str(path), str(fake["script"]), str(toy_port)],
                         capture_output=True, text=True, timeout=240,
                         env={**subprocess_env(), "STATE_DIRECTORY": str(passable_state)})
    assert out.returncode == 0, out.stderr[-4000:]
    seen = json.loads(out.stdout)
    start, toy, proxy = seen["start"], seen["toy"], seen["proxy"]
    assert set(start) == {"vllm", "proxy", "toy"}
    # the toy's spec changed: the toy restarted, the engine and the proxy kept their processes
    assert toy["toy"] != start["toy"] and toy["vllm"] == start["vllm"] and toy["proxy"] == start["proxy"]
    assert "reload: toy changed; restarting the toy only" in out.stderr
    # only serve.proxy changed: the proxy restarted (its line as before the registry), the engine and the toy not
    assert proxy["proxy"] != toy["proxy"] and proxy["vllm"] == start["vllm"] and proxy["toy"] == toy["toy"]
    assert "reload: serve.proxy changed; restarting the proxy only" in out.stderr
    assert seen["unchanged"]  # the same config again: nothing to restart
    assert "vLLM stopping" not in out.stderr.split("restarting the proxy only")[0]  # the engine stopped only at the end
