"""An idle engine (issue 54, design/idle-engine.md): serve.idle's keys and what they need of the rest of the config.
Each bad one is one line naming the file, its line and the key, and `check` exits 78."""

import pytest

from gpuwarden import config
from gpuwarden.base.yamlfile import ConfigErrors

PROXY = "  proxy: {enabled: true}\n"


def serve(text: str) -> str:
    return f"serve:\n  model: /m/Qwen3-4B\n{text}"


def test_serve_idle_reads_its_keys_with_defaults_and_writes_them_back():
    c = config.parse_text(serve(PROXY + "  idle: {after_s: 120}\n"))
    assert c.serve.idle == config.IdleConfig("stop", 120.0)
    assert config.parse_text(serve(PROXY)).serve.idle is None  # off unless given
    assert config.parse_text(serve(PROXY + "  idle: {}\n")).serve.idle == config.IdleConfig("stop", 600.0)
    effective = c.as_dict()["serve"]["idle"]
    assert effective == {"action": "stop", "after_s": 120.0}
    import yaml

    assert config.parse_text(yaml.safe_dump(c.as_dict())).serve == c.serve  # the effective config parses back


BAD = [
    ("no-proxy", serve("  idle: {after_s: 120}\n"), "serve.idle", "serve.idle needs the proxy in front"),
    ("too-soon", serve(PROXY + "  idle: {after_s: 5}\n"), "serve.idle.after_s", "out of range"),
    ("too-late", serve(PROXY + "  idle: {after_s: 100000}\n"), "serve.idle.after_s", "out of range"),
    ("action", serve(PROXY + "  idle: {action: sleep}\n"), "serve.idle.action", "not a valid choice"),
    ("unknown-key", serve(PROXY + "  idle: {ttl: 60}\n"), "serve.idle.ttl", "unknown key"),
    ("not-mapping", serve(PROXY + "  idle: 60\n"), "serve.idle", "expected a mapping"),
    ("clocks-unlocked", "tuning:\n  gpu_clocks: none\n" + serve(PROXY + "  idle: {action: clocks}\n"),
     "serve.idle.action", "gpuwarden locks no GPU clock here"),
    ("clocks-no-apply", "tuning:\n  apply: false\n" + serve(PROXY + "  idle: {action: clocks}\n"),
     "serve.idle.action", "gpuwarden locks no GPU clock here"),
    ("nodes", serve(PROXY + "  idle: {}\n  nodes: {count: 2, hosts: [10.0.0.1, 10.0.0.2], rank: 0}\n"),
     "serve.idle", "an engine that spans hosts does not rest"),
]


@pytest.mark.parametrize("case, text, key, fragment", BAD, ids=[c[0] for c in BAD])
def test_a_bad_serve_idle_is_one_line_at_its_key(case, text, key, fragment):
    with pytest.raises(ConfigErrors) as raised:
        config.parse_text(text, name="c.yaml")
    lines = [str(e) for e in raised.value.errors]
    assert len(lines) == 1 and f": {key}: " in lines[0] and fragment in lines[0], lines


def test_clocks_is_taken_where_a_clock_may_be_locked():
    assert config.parse_text(serve(PROXY + "  idle: {action: clocks}\n")).serve.idle.action == "clocks"  # auto
    text = "tuning:\n  gpu_clocks: none\n  gpus:\n    '1': {memory_clocks: [1593, 1593]}\n"
    assert config.parse_text(text + serve(PROXY + "  idle: {action: clocks}\n")).serve.idle.action == "clocks"


def test_check_exits_78_on_serve_idle_without_the_proxy(cli, write):
    path = write("gpuwarden.yaml", "gpu: {backend: sim}\n" + serve("  idle: {after_s: 120}\n"))
    status, out, err = cli("check", "--config", path)
    assert status == 78 and f"{path}:4: serve.idle: serve.idle needs the proxy" in err, err
    assert "Traceback" not in out + err


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def test_the_proxy_says_idle_once_after_the_quiet_and_never_with_a_request_in_flight():
    """proxy/quiet.py on a clock the test drives: the word after after_s with nothing in flight, not a second before;
    once per quiet spell; a request in flight for longer than after_s keeps it unsaid, and its end starts the count
    again."""
    from gpuwarden.proxy.quiet import Quiet

    clock, said = Clock(), []
    quiet = Quiet(60, lambda: said.append(clock.now), clock)
    clock.now += 59.9
    assert not quiet.tick() and quiet.due_in() == pytest.approx(0.1)
    clock.now += 0.1
    assert quiet.tick() and said == [1060.0]
    clock.now += 600
    assert not quiet.tick() and quiet.due_in() is None and said == [1060.0]  # once per spell
    quiet.began()  # a request: the spell ends
    clock.now += 3600  # a long stream, in flight all along
    assert not quiet.tick() and quiet.due_in() is None
    quiet.ended()
    clock.now += 59
    assert not quiet.tick()
    clock.now += 1
    assert quiet.tick() and said == [1060.0, 1060.0 + 600 + 3600 + 60]


def test_two_requests_overlapping_keep_the_engine_awake_until_both_ended():
    from gpuwarden.proxy.quiet import Quiet

    clock, said = Clock(), []
    quiet = Quiet(10, lambda: said.append(clock.now), clock)
    quiet.began()
    quiet.began()
    clock.now += 20
    quiet.ended()
    clock.now += 20
    assert not quiet.tick()  # one still in flight
    quiet.ended()
    quiet.ended()  # an end too many (a bug's) never makes a negative count
    assert quiet.in_flight == 0
    clock.now += 10
    assert quiet.tick() and said == [1050.0]
    assert Quiet(0, lambda: said.append(0), clock).due_in() is None  # off
