"""A planned restart with the real CPU vLLM: a reload that changes the engine's flags under a steady mix of clients
(tests/vllm/restart_rig.py) fails no request through the proxy, every answer whole by its token count, and the
requests in flight straight to the engine finish. One reload, two engine starts: the soak (five reloads in a row)
and the control (without the drain and the hold, a reload fails requests) are benchmarks/planned_restarts.py's,
with their figures in benchmarks/RESULTS.md."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "vllm"))
from restart_rig import Rig, table  # noqa: E402

pytestmark = pytest.mark.vllm
# Lighter than the benchmark's flat-out clients: the test's own clients must not be the load it suffers from.
LIGHT = {"long_tokens": 400, "pause_s": 0.3}


def run(rig: Rig, reloads: int) -> list:
    try:
        rig.start()
        rig.start_clients()
        done = [rig.reload(number) for number in range(1, reloads + 1)]
        rig.settle(done)
        rig.stop_clients()
    finally:
        code = rig.stop()
    assert code == 0, "\n".join(rig.lines[-40:])
    print(table(done))
    return done


def test_a_reload_fails_no_request_through_the_proxy_and_drains_what_runs_on_the_engine(vllm_python,
                                                                                         tiny_model, tmp_path):
    tmp_path.chmod(0o755)
    rig = Rig(vllm_python, tiny_model, tmp_path, **LIGHT)
    reloads = run(rig, 1)
    proxied = [o for o in rig.outcomes if o.client.startswith("proxy")]
    failed = [o for o in proxied if not o.ok]
    assert len(proxied) >= 6 and not failed, (failed[:5], [line for line in rig.lines if "proxy" in line][-30:])
    restart = max(r.healthy - r.began for r in reloads)
    assert all(r.drain_outcome == "drained" for r in reloads), table(reloads)
    # The drain line's count is the daemon's last /metrics read before the stop, which a reload's own checks precede
    # by seconds (CI read 0 at all five with 400-token requests): what ran at the reload is judged by its answers.
    for r in reloads:
        # without the proxy: what ran on the engine at the reload finished, whole
        long_direct = r.long_direct()
        near = [(round(o.began - r.began, 2), round(o.took, 2), o.what) for o in rig.outcomes
                if o.client == "direct plain long" and abs(o.began - r.began) < 120]
        assert long_direct and all(o.ok for o in long_direct), (
            f"reload {r.number}: the direct long request seen in flight began {r.long_since - r.began:.2f} s before "
            f"it; that client's requests near it (began, took, answer): {near}\n{table(reloads)}")
    # the longest request through the proxy waited about one restart (and its own generation), not more
    assert max(o.took for o in proxied) < restart + 20, (restart, table(reloads))
    assert sum(r.held for r in reloads) >= 1, table(reloads)  # the hold did work: requests came meanwhile
    # New requests straight to the engine meanwhile fail (500 while it drains, refused while it restarts): what the
    # proxy's hold is for.
    assert [o for o in rig.outcomes if o.client == "direct plain" and not o.ok], table(reloads)
