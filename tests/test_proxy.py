"""The prefix-cache proxy: its rules on real request shapes, and the proxy as a real process between a client
and a fake engine (tests/harness/fake_upstream.py), also a real process."""

import base64
import copy
import http.client
import json
import os
import resource
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
import urllib.request
from collections import Counter
from pathlib import Path

import pytest

from conftest import free_port, gpuwarden_cmd, subprocess_env
from gpuwarden.config import parse_text
from gpuwarden.proxy import diff
from gpuwarden.proxy.normalize import Rules, apply

HERE = Path(__file__).parent
ALL = Rules(date_line=True)

TOOLS = [{"name": n, "description": f"the {n} tool", "input_schema": {"type": "object", "properties": {}}}
         for n in ("Read", "Bash", "Edit", "mcp__git__log")]


def claude_code_request(turn: int, tools=TOOLS) -> dict:
    """The shape Claude Code sends to /v1/messages: the billing block first, cache_control on the last system
    block and on the newest message, the environment with today's date."""
    messages = []
    for i in range(turn):
        messages += [{"role": "user", "content": [{"type": "text", "text": f"step {i}"}]},
                     {"role": "assistant", "content": [{"type": "text", "text": f"done {i}"},
                                                       {"type": "tool_use", "id": f"t{i}", "name": "Read",
                                                        "input": {"path": "/x", "cache_control": "keep"}}]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": f"t{i}",
                                                   "content": [{"type": "text", "text": "file"}]}]}]
    messages.append({"role": "user", "content": [{"type": "text", "text": "next", "cache_control": {"type": "ephemeral"}}]})
    return {"model": "tiny", "max_tokens": 64, "stream": True, "metadata": {"user_id": "user_abc_session_42"},
            "system": [{"type": "text", "text": f"x-anthropic-billing-header: cc_version=2.0.14; cch={90000 + turn};"},
                       {"type": "text", "text": "You are Claude Code.\nToday's date is 2026-11-26.\nBe brief.",
                        "cache_control": {"type": "ephemeral"}}],
            "tools": [dict(t, cache_control={"type": "ephemeral"}) if i == len(tools) - 1 else dict(t)
                      for i, t in enumerate(tools)],
            "messages": messages}


# -- the rules -----------------------------------------------------------------------------------------------

def test_claude_code_shape_loses_exactly_its_cache_busters():
    body = claude_code_request(3, TOOLS[::-1])
    applied = apply(body, "anthropic", ALL)
    assert applied == Counter(billing_header=1, cache_control=3, sort_tools=1, date_line=1)
    assert [b["text"] for b in body["system"]] == ["You are Claude Code.\nBe brief."]
    assert [t["name"] for t in body["tools"]] == ["Bash", "Edit", "Read", "mcp__git__log"]
    assert "cache_control" not in json.dumps(body).replace('"cache_control": "keep"', "")
    assert body["messages"][1]["content"][1]["input"] == {"path": "/x", "cache_control": "keep"}  # tool input: data
    assert len(body["messages"]) == 10


def test_two_turns_normalize_to_a_shared_prefix():
    a, b = claude_code_request(2), claude_code_request(3, TOOLS[1:] + TOOLS[:1])
    for body in (a, b):
        apply(body, "anthropic", ALL)
    assert a["system"] == b["system"] and a["tools"] == b["tools"] and a["messages"][:6] == b["messages"][:6]


def test_each_rule_can_be_switched_off():
    body = claude_code_request(1, TOOLS[::-1])
    untouched = copy.deepcopy(body)
    assert apply(body, "anthropic", Rules(False, False, False, False)) == Counter()
    assert body == untouched
    only_sort = apply(body, "anthropic", Rules(billing_header=False, cache_control=False))
    assert only_sort == Counter(sort_tools=1)


def test_openai_shape_user_pattern_and_tools_by_function_name():
    from gpuwarden.base.timedregex import compile_pattern

    body = {"model": "tiny", "messages": [
        {"role": "system", "content": "[2026-11-26T13:05:09.123Z] session start\nYou are a coding agent."},
        {"role": "user", "content": "hi"}],
        "tools": [{"type": "function", "function": {"name": n, "parameters": {}}} for n in ("write", "read")]}
    rules = Rules(remove_patterns=(compile_pattern(r"^\[\d{4}-\d\d-\d\dT[\d:.]+Z\] [^\n]*\n"),))
    assert apply(body, "openai", rules) == Counter(remove_patterns=1, sort_tools=1)
    assert body["messages"][0]["content"] == "You are a coding agent."
    assert body["messages"][1]["content"] == "hi"  # user text is never touched
    assert [t["function"]["name"] for t in body["tools"]] == ["read", "write"]


def test_a_pattern_slower_than_linear_runs_out_of_its_time_and_the_text_goes_as_it_came():
    """The attacker's F2 (2026-12-02): `\\s+$` is quadratic on a long run of spaces (45 s on 150 KB with Python's
    re). The operator's patterns share normalize.PATTERNS_S a request; past it the system texts go as they came,
    counted under PATTERNS_LATE, and the other rules still apply."""
    from gpuwarden.base.timedregex import compile_pattern
    from gpuwarden.proxy.normalize import PATTERNS_LATE, PATTERNS_TEXT_MAX

    evil = " " * 150_000 + "x"
    body = {"model": "tiny", "messages": [
        {"role": "system", "content": evil}, {"role": "system", "content": "Today's date is 2026-12-02.\nhi  "},
        {"role": "user", "content": "hi"}],
        "tools": [{"type": "function", "function": {"name": n, "parameters": {}}} for n in ("write", "read")]}
    rules = Rules(date_line=True, remove_patterns=(compile_pattern(r"\s+$"),))
    assert apply(body, "openai", rules) == Counter({PATTERNS_LATE: 2, "date_line": 1, "sort_tools": 1})
    assert body["messages"][0]["content"] == evil and body["messages"][1]["content"] == "hi  "
    # the same pattern on an ordinary system text: done, well within the time
    body = {"model": "tiny", "messages": [{"role": "system", "content": "You are a coding agent.  \nBe brief. "}]}
    assert apply(body, "openai", rules) == Counter(remove_patterns=2)
    assert body["messages"][0]["content"] == "You are a coding agent.\nBe brief."
    # a system text past PATTERNS_TEXT_MAX goes as it came, however fast the pattern (one greedy scan is one step
    # of regex's time limit: 30 M spaces took 8.7 s of CPU past it)
    long = "a  \n" * (PATTERNS_TEXT_MAX // 4 + 1)
    body = {"model": "tiny", "messages": [{"role": "system", "content": long}]}
    assert apply(body, "openai", rules) == Counter({PATTERNS_LATE: 1}) and body["messages"][0]["content"] == long


def test_a_request_without_busters_is_not_changed():
    body = {"model": "m", "system": "plain", "tools": [{"name": "a"}, {"name": "b"}],
            "messages": [{"role": "user", "content": "Today's date is 2026-11-26."}]}
    before = copy.deepcopy(body)
    assert apply(body, "anthropic", ALL) == Counter() and body == before


def test_diff_names_the_shuffled_tools_and_the_nonce():
    a, b = claude_code_request(1), claude_code_request(2, TOOLS[::-1])
    text = diff.first_difference(a, b)
    assert text.startswith("first difference in tools[0]"), text
    a["tools"], b["tools"] = [], []
    text = diff.first_difference(a, b)
    same = len("x-anthropic-billing-header: cc_version=2.0.14; cch=9000")
    assert text.startswith(f"first difference in system[0], at character {same} "), text
    assert "cch=90001" in text and "cch=90002" in text
    apply(a, "anthropic", ALL), apply(b, "anthropic", ALL)
    assert "first difference in messages[" in diff.first_difference(a, b)


def test_a_pattern_that_would_compile_to_gigabytes_is_refused_in_one_line_before_it_is_compiled(tmp_path, cli):
    """The attackers' findings 2 and 4 of 2026-12-02: `(?:a{100000}){100000}` in a drop-in took the daemon to 9.1 GB
    in 20 s at a reload (`regex` compiles a counted repeat as copies), and `check` ended in a MemoryError traceback;
    then repeats side by side ("[ab]{99999}" 90 times over) in three patterns passed a bound on nesting alone and took
    it to 7 GB. The copies are counted from the patterns' text first (timedregex.repeats), all patterns together,
    and a pattern is at most MAX_CHARS long."""
    from gpuwarden.base.timedregex import (MAX_CHARS, MAX_REPEATS, PatternError, compile_pattern, compile_patterns,
                                           repeats)

    assert [repeats(p) for p in ("a{3}", "(a{3}b){4}", "a{5}b{5}", "((a{10}){10}){10}", "[{]{9}", "x{2,}",
                                 "a(b{3})c{2}", "abc", "")] == [3, 16, 10, 1000, 9, 2, 6, 3, 0]
    assert repeats("(?:a{100000}){100000}") > MAX_REPEATS and repeats("[ab]{99999}" * 90) > MAX_REPEATS
    assert repeats(r"^\[\d{4}-\d\d-\d\dT[\d:.]+Z\] [^\n]*\n") < 100  # an ordinary one
    compile_pattern("a{65535}")
    for bad, says in (("(?:a{100000}){100000}", "more than the 100,000"), ("[ab]{99999}" * 9, "more than the"),
                      ("a" * (MAX_CHARS + 1), "characters")):
        with pytest.raises(ValueError, match=says):
            compile_pattern(bad)
    with pytest.raises(PatternError, match=r"20,000 copies \(with the 90,000 of the patterns before it\)") as caught:
        compile_patterns(["a{60000}", "b{30000}", "c{20000}"])  # each alone would pass
    assert caught.value.index == 2
    path = tmp_path / "g.yaml"
    path.write_text("gpu: {backend: sim, scenario: dgx-spark}\nserve:\n  proxy:\n"
                    "    remove_patterns: ['(?:a{100000}){100000}']\n")
    status, _, err = cli("check", "-c", path)
    assert status == 78 and "Traceback" not in err, err
    assert "g.yaml:4: serve.proxy.remove_patterns.0: not a regular expression: its counted repeats make " in err, err


def test_the_verbose_flag_is_refused_and_spaces_in_braces_still_count():
    """Attacker 6's finding 6: under (?x) `regex` takes "{99999 }" (a space, a newline, even a #-comment inside the
    braces) as a counted repeat, which repeats() did not count: 40 of "[ab]{99999 }" took the daemon and the proxy to
    1.5 GB each at a reload. The verbose flag is refused, however it is set inline; spaces in braces count anyway
    (where they are literal text, counting them costs nothing but a refusal of an absurd pattern). The review's B1:
    a "[" in a (?#...) comment was read as a class, which hid the flag and the repeats after it."""
    from gpuwarden.base.timedregex import compile_pattern, repeats

    for verbose in ("(?x)[ab]{99999 }", "(?ix)a", "(?x-i:a{5})", "b(?x)c", "(?#[)(?x)[ab]{9#c\n9999}"):
        with pytest.raises(ValueError, match=r"the verbose flag \(\?x\) is not taken here"):
            compile_pattern(verbose)
    # Attacker 7's finding 3: `regex` reads an escaped ")" as part of a comment, which ended the scanner's comment
    # early, and a "[" after it hid 514 MB of repeats. Comments are refused; the scanner reads escapes in them too.
    for commented in (r"(?#\)[)(?:\w{1000}){2000}(?#])", "a(?#note)b"):
        with pytest.raises(ValueError, match=r"an inline comment \(\?#\.\.\.\) is not taken here"):
            compile_pattern(commented)
    assert repeats(r"(?#\)[)(?:\w{1000}){2000}(?#])") > 2_000_000
    assert repeats("a{ 99999 }") == 99999 and repeats("a{5 , 6}") == 6
    # a comment is read as `regex` reads it, to its first ")": a "[" in it opens no class that hides what follows
    assert repeats("(?#[)(?:a{99999}){99999}(?#])") > 10**9 and repeats("(?#x)a{3}") == 3
    for fine in ("(?i)abc", "(?P<x>a)", "(?<=x)a", r"[(?#]a", r"\(?x"):
        compile_pattern(fine)


def test_config_section_is_validated_with_file_and_line(tmp_path):
    from gpuwarden.base.yamlfile import InvalidConfig

    with pytest.raises(InvalidConfig) as caught:
        parse_text("serve:\n  enabled: true\n  model: /m\n  proxy:\n    enabled: true\n    listen: 127.0.0.1:8000\n"
                   "    remove_patterns: ['(', '--']\n    sort: yes\n", str(tmp_path / "g.yaml"))
    text = "\n".join(str(e) for e in caught.value.errors)
    # the re-check's N3: argparse takes "--remove-pattern=--" for the end of options, and the proxy never started
    assert "g.yaml:7: serve.proxy.remove_patterns.1: '--' cannot reach the proxy's command line" in text
    assert "g.yaml:6: serve.proxy.listen: 127.0.0.1:8000 (the proxy) collides with serve.port 127.0.0.1:8000" in text
    assert "g.yaml:7: serve.proxy.remove_patterns.0: not a regular expression" in text
    assert "g.yaml:8: serve.proxy.sort: unknown key" in text
    ok = parse_text("serve:\n  proxy: {enabled: true, listen: '0.0.0.0:9001', dump_dir: d}\n", str(tmp_path / "g.yaml"))
    assert ok.serve.proxy.listen == ("0.0.0.0", 9001) and ok.serve.proxy.dump_dir == tmp_path / "d"
    assert parse_text("serve: {}", "x.yaml").serve.proxy.enabled is False


# -- the proxy as a process ----------------------------------------------------------------------------------

class Process:
    def __init__(self, argv, port, health="/health", nofile=None, word=False):
        self.port = port
        self.lines: list[str] = []
        # nofile: the process's own fd limit, as a unit's LimitNOFILE= would set it
        limit = (lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))) if nofile else None
        env, fds, self.word = subprocess_env(), (), None
        if word:  # a word pipe, as the daemon gives a front (serving/run/word.py): self.word reads it
            from gpuwarden.serving.run.word import WORD_ENV, WordReader, make_pipe

            read, write = make_pipe()
            env, fds, self.word = dict(env, **{WORD_ENV: str(write)}), (write,), WordReader(read)
        try:
            self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                         env=env, preexec_fn=limit, pass_fds=fds)
        finally:
            for fd in fds:
                os.close(fd)
        threading.Thread(target=lambda: [self.lines.append(line.rstrip()) for line in self.proc.stdout],
                         daemon=True).start()
        deadline = time.monotonic() + 60  # a bound for a hang: at load 14 a start took over 30 s
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}{health}", timeout=2):
                    return
            except OSError:
                if self.proc.poll() is not None:
                    raise AssertionError("\n".join(self.lines)) from None
                time.sleep(0.05)
        self.proc.kill()  # the caller never gets it to stop: not left behind
        self.proc.wait(10)
        raise AssertionError("not up:\n" + "\n".join(self.lines))

    def get_json(self, path):
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=5) as reply:
            return json.loads(reply.read())

    def stop(self):
        self.proc.terminate()
        try:
            code = self.proc.wait(timeout=30)  # a bound for a hang (a stop takes 2 s at most; longer on a busy box)
        except subprocess.TimeoutExpired:
            self.proc.kill()  # never left behind, even when it did not stop in time
            self.proc.wait(timeout=10)
            raise AssertionError(f"{self.proc.args[:4]} ignored SIGTERM for 30 s") from None
        assert code == 0 or code < 0, code


@pytest.fixture
def rig(tmp_path):
    started = []

    def start(*proxy_args, chunk_delay=0.05, nofile=None, rcvbuf=0):
        up_port, proxy_port = free_port(), free_port()
        upstream = Process([sys.executable, str(HERE / "harness" / "fake_upstream.py"), "--port", str(up_port),
                            "--chunk-delay", str(chunk_delay), "--rcvbuf", str(rcvbuf)], up_port, "/v1/models")
        started.append(upstream)
        proxy = Process([*gpuwarden_cmd(), "proxy", "-c", "none", "--upstream", f"http://127.0.0.1:{up_port}",
                         "--listen", f"127.0.0.1:{proxy_port}", *proxy_args], proxy_port, nofile=nofile)
        started.append(proxy)
        return upstream, proxy

    yield start
    failures = []
    for p in reversed(started):  # every one stopped, whatever the others do
        try:
            p.stop()
        except AssertionError as exc:
            failures.append(str(exc))
    assert not failures, failures


def send(port, method, path, body=b"", headers=None):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.request(method, path, body=body, headers=headers or {})
    reply = conn.getresponse()
    data = reply.read()
    conn.close()
    return reply, data


def last_upstream(upstream):
    last = upstream.get_json("/debug/last")
    return base64.b64decode(last["body"]), dict(last["headers"])


@pytest.mark.process
def test_a_request_without_busters_reaches_the_engine_byte_for_byte(rig):
    upstream, proxy = rig()
    raw = b'{ "model":"tiny",\n  "messages": [{"role":"user","content":"caf\\u00e9 \xe2\x82\xac"}], "max_tokens" : 5}'
    headers = {"Authorization": "Bearer sk-1", "anthropic-version": "2023-06-01", "X-Custom": "a b",
               "Content-Type": "application/json"}
    for path in ("/v1/messages", "/v1/chat/completions", "/v1/completions?x=1"):
        send(upstream.port, "POST", path, raw, headers)
        direct = last_upstream(upstream)[1]
        reply, data = send(proxy.port, "POST", path, raw, headers)
        assert reply.status == 200 and json.loads(data)["echo_bytes"] == len(raw)
        assert reply.getheader("X-Engine") == "fake"
        body, got = last_upstream(upstream)
        assert body == raw
        assert {k: v for k, v in got.items() if k != "Host"} == {k: v for k, v in direct.items() if k != "Host"}
        assert upstream.get_json("/debug/last")["path"] == path


@pytest.mark.process
def test_the_rules_change_what_reaches_the_engine_and_are_counted(rig):
    upstream, proxy = rig("--rules", "billing_header,cache_control,sort_tools,date_line")
    body = claude_code_request(2, TOOLS[::-1])
    body["stream"] = False
    reply, _ = send(proxy.port, "POST", "/v1/messages", json.dumps(body).encode())
    assert reply.status == 200
    sent = json.loads(last_upstream(upstream)[0])
    expected = copy.deepcopy(body)
    apply(expected, "anthropic", ALL)
    assert sent == expected
    metrics = urllib.request.urlopen(f"http://127.0.0.1:{proxy.port}/metrics", timeout=5).read().decode()
    for rule, n in (("billing_header", 1), ("cache_control", 3), ("sort_tools", 1), ("date_line", 1)):
        assert f'gpuwarden_proxy_normalizations_total{{rule="{rule}"}} {n}.0' in metrics
    assert 'gpuwarden_proxy_requests_total{api="anthropic",code="200"} 1.0' in metrics
    assert "gpuwarden_proxy_engine_prefix_cache_hits_tokens_total 40.0" in metrics
    assert "gpuwarden_proxy_upstream_up 1.0" in metrics


@pytest.mark.process
def test_streams_pass_chunk_by_chunk_with_tool_call_deltas(rig):
    upstream, proxy = rig(chunk_delay=0.3)
    direct = send(upstream.port, "POST", "/v1/chat/completions", b'{"stream": true}')[1]
    conn = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=10)
    began = time.monotonic()
    conn.request("POST", "/v1/chat/completions", body=b'{"stream": true}')
    reply = conn.getresponse()
    assert reply.status == 200 and reply.getheader("Content-Type").startswith("text/event-stream")
    first = reply.readline()
    first_at = time.monotonic() - began
    rest = reply.read()
    total = time.monotonic() - began
    assert first.startswith(b"data: ") and first_at < 0.25 < total  # the first event before the last is made
    assert first + rest == direct  # tool-call deltas and [DONE] as the engine sent them
    assert b'"tool_calls"' in rest


@pytest.mark.process
def test_bad_bodies_get_their_status_and_one_log_line_per_kind(rig):
    upstream, proxy = rig("--max-body-bytes", "100000")
    before = upstream.get_json("/debug/open")["requests"]
    reply, data = send(proxy.port, "POST", "/v1/messages", b"{not json")
    assert reply.status == 400 and json.loads(data)["type"] == "error"
    assert "not JSON" in json.loads(data)["error"]["message"]
    reply, data = send(proxy.port, "POST", "/v1/chat/completions", b"[" * 100000 + b"]" * 100000)
    assert reply.status in (400, 413)
    reply, data = send(proxy.port, "POST", "/v1/chat/completions", b"[1]")
    assert reply.status == 400 and "not an object" in json.loads(data)["error"]["message"]
    reply, _ = send(proxy.port, "POST", "/v1/chat/completions", b"{" + b" " * 200000 + b"}")
    assert reply.status == 413
    assert upstream.get_json("/debug/open")["requests"] == before  # none of them reached the engine
    time.sleep(0.2)
    warnings = [line for line in proxy.lines if line.startswith("WARNING")]
    assert len(warnings) == 2 and all("Traceback" not in line for line in proxy.lines), proxy.lines
    assert "400 body is not JSON" in warnings[0] and "413 request body over 100000 bytes" in warnings[1]
    reply, data = send(proxy.port, "POST", "/fail", b"{}")
    assert reply.status == 500 and json.loads(data) == {"error": {"message": "engine is asleep"}}
    reply, data = send(proxy.port, "GET", "/v1/models")
    assert reply.status == 200 and json.loads(data)["data"][0]["id"] == "tiny"


@pytest.mark.process
def test_upstream_down_is_502_and_health_still_answers(rig):
    upstream, proxy = rig("--hold-s", "0")  # no hold (test_proxy_hold.py holds)
    upstream.stop()
    reply, data = send(proxy.port, "POST", "/v1/messages", b'{"model": "tiny"}')
    assert reply.status == 502 and "unreachable" in json.loads(data)["error"]["message"]
    reply, data = send(proxy.port, "GET", "/health")
    assert reply.status == 200


@pytest.mark.process
def test_a_client_that_leaves_mid_stream_ends_the_upstream_stream(rig):
    upstream, proxy = rig(chunk_delay=0.02)
    sock = socket.create_connection(("127.0.0.1", proxy.port))
    body = b'{"stream": true, "endless": true}'
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
    seen = b""
    while b"data: " not in seen:
        seen += sock.recv(4096)
    assert upstream.get_json("/debug/open")["open"] == 1
    sock.close()
    deadline = time.monotonic() + 20  # generous: a busy machine, not the proxy, may take seconds
    while upstream.get_json("/debug/open")["open"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert upstream.get_json("/debug/open")["open"] == 0
    assert any("left POST /v1/chat/completions" in line for line in proxy.lines), proxy.lines
    assert send(proxy.port, "GET", "/health")[0].status == 200


@pytest.mark.process
def test_dumps_are_private_bounded_and_diffable(rig, tmp_path):
    dumps = tmp_path / "dumps"
    upstream, proxy = rig("--dump-dir", str(dumps), "--dump-keep", "3", "--rules", "none")
    for turn in range(5):
        body = claude_code_request(turn, TOOLS if turn % 2 else TOOLS[::-1])
        body["stream"] = False
        assert send(proxy.port, "POST", "/v1/messages", json.dumps(body).encode())[0].status == 200
    session = dumps / "user_abc_session_42"
    files = sorted(session.glob("*.json"))
    assert len(files) == 3
    assert stat.S_IMODE(dumps.stat().st_mode) == 0o700 and stat.S_IMODE(session.stat().st_mode) == 0o700
    assert all(stat.S_IMODE(f.stat().st_mode) == 0o600 for f in files)
    out = subprocess.run([*gpuwarden_cmd(), "proxy", "diff", str(session)], capture_output=True, text=True,
                         env=subprocess_env())
    assert out.returncode == 0, out.stderr
    assert "as received: first difference in tools[0]" in out.stdout
    assert "as sent upstream (after the proxy's rules): first difference in tools[0]" in out.stdout
    bad = subprocess.run([*gpuwarden_cmd(), "proxy", "diff", str(files[0]), str(tmp_path)], capture_output=True,
                         text=True, env=subprocess_env())
    assert bad.returncode == 1 and bad.stderr.count("\n") == 1 and "not a dump file" in bad.stderr


# -- the proxy as the daemon's second child ------------------------------------------------------------------

def test_the_proxy_child_command_carries_every_setting(tmp_path):
    from gpuwarden.proxy.child import proxy_argv

    from gpuwarden.cli.registry import build_parser, find_commands

    cfg = parse_text("serve:\n  port: 8123\n  model: /srv/models/-merged\n  proxy:\n    listen: '[::1]:9001'\n"
                     "    date_line: true\n    sort_tools: false\n    remove_patterns: ['^ts=\\d+ ', '-x']\n"
                     "    dump_dir: -dumps\n    dump_keep: 9\n", str(tmp_path / "g.yaml"))
    argv = proxy_argv(cfg)
    assert argv[1:4] == ("-m", "gpuwarden", "proxy") and argv[argv.index("-c") + 1] == "none"
    # as the proxy's own parser reads it: a value beginning with "-" is a value (attacker 51: the proxy did not start)
    args = build_parser(find_commands()).parse_args(list(argv[3:]))
    assert args.upstream == "http://127.0.0.1:8123" and args.listen == "[::1]:9001"
    assert args.rules == "billing_header,cache_control,date_line"
    assert args.remove_pattern == [r"^ts=\d+ ", "-x"] and str(args.dump_dir) == str(tmp_path / "-dumps")
    assert args.dump_keep == 9 and args.dump_max_bytes == 1 << 30 and args.model == "-merged"
    assert args.client_timeout == 15
    dashes = proxy_argv(parse_text("serve:\n  model: /srv/models/--\n", str(tmp_path / "g.yaml")))
    assert build_parser(find_commands()).parse_args(list(dashes[3:])).model == "/srv/models/--"  # not []
    bare = proxy_argv(parse_text("serve:\n  model: '--'\n", str(tmp_path / "g.yaml")))
    assert build_parser(find_commands()).parse_args(list(bare[3:])).model == "./--"


def test_a_proxy_only_change_restarts_the_proxy_and_leaves_the_engine(tmp_path):
    from test_serving import running_supervisor

    from gpuwarden.proxy.child import PROXY, proxy_spec
    from gpuwarden.serving.run.supervisor import RUNNING, STARTING, STOPPING, Program, Supervisor

    engine, ops, clock = running_supervisor()
    cfg = parse_text("serve:\n  model: /m\n  proxy: {enabled: true}\n", str(tmp_path / "g.yaml"))
    proxy = Program(proxy_spec(cfg, engine.identity), ops=ops, clock=clock)
    both = Supervisor([engine, proxy])
    proxy.start(clock.now)
    both.tick(clock.now)
    assert proxy.state == RUNNING and proxy.gpus == [] and proxy.view().engine == PROXY
    argv, env, _ = ops.children[-1]
    assert "proxy" in argv and env["PYTHONPATH"] and "VLLM_API_KEY" not in env
    engine_group, old_group = engine.child.pgid, proxy.child.pgid
    changed = parse_text("serve:\n  model: /m\n  proxy: {enabled: true, listen: '127.0.0.1:9002'}\n",
                         str(tmp_path / "g.yaml"))
    new = Program(proxy_spec(changed, engine.identity), ops=ops, clock=clock)
    both.replace(PROXY, new, clock.now)
    assert proxy.state == STOPPING and (old_group, signal.SIGTERM) in ops.signals
    assert both.programs[PROXY] is proxy  # the new one waits for the old one to stop
    ops.groups[old_group] = []
    clock.advance(1)
    both.tick(clock.now)
    assert both.programs[PROXY] is new and new.state in (STARTING, RUNNING)
    assert "127.0.0.1:9002" in ops.children[-1][0]
    assert engine.state == RUNNING and not [s for s in ops.signals if s[0] == engine_group]
    assert list(both.programs) == [engine.name, PROXY]  # the engine is still the main program
    both.replace(PROXY, None, clock.now)  # proxy turned off
    ops.groups[new.child.pgid] = []
    both.tick(clock.now)
    assert list(both.programs) == [engine.name]


@pytest.mark.process
def test_big_bodies_and_odd_text_are_normalized_intact(rig, tmp_path):
    upstream, proxy = rig("--dump-dir", str(tmp_path / "d"))
    body = claude_code_request(1, TOOLS[::-1])
    body["stream"] = False
    body["messages"][0]["content"][0]["text"] = "é€😀 \ud800 " + "x" * (600 << 10)  # a lone surrogate, 600 KB
    raw = json.dumps(body).encode()
    reply, _ = send(proxy.port, "POST", "/v1/messages", raw)
    assert reply.status == 200
    sent = json.loads(last_upstream(upstream)[0])
    expected = json.loads(raw)
    apply(expected, "anthropic", Rules())
    assert sent == expected and sent["messages"][0]["content"][0]["text"].startswith("é€😀 \ud800 x")
    assert len(list((tmp_path / "d").glob("*/*.json"))) == 1


@pytest.mark.process
def test_an_upstream_that_dies_mid_stream_cuts_the_clients_stream(rig):
    upstream, proxy = rig(chunk_delay=0.02)
    conn = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=10)
    conn.request("POST", "/v1/chat/completions", body=b'{"stream": true, "endless": true}')
    reply = conn.getresponse()
    assert reply.readline().startswith(b"data: ")
    upstream.proc.kill()
    with pytest.raises(http.client.IncompleteRead):  # cut, not a stream that looks finished
        reply.read()
    time.sleep(0.2)
    assert any(line.startswith("WARNING proxy: upstream broke off POST /v1/chat/completions") for line in proxy.lines)
    assert not any("Traceback" in line for line in proxy.lines), proxy.lines
    assert send(proxy.port, "GET", "/health")[0].status == 200


@pytest.mark.process
def test_given_the_engines_key_the_proxy_asks_it_on_every_path_that_vllm_leaves_open(rig, monkeypatch):
    """vLLM 0.32 asks its key only under /v1, /v2, /inference and /cohere (its middleware's GUARDED_PREFIX): POST
    /invocations (SageMaker's route: a completion or a chat, by its body), /tokenize, /pooling, /score answered
    anyone (attacker 11's note). Given the key (the daemon passes the engine's: proxy/child.engine_key), the proxy
    asks it on every path but /ping, /version and its own /health and /metrics; a request without it, or with
    another, is 401 and never reaches the engine."""
    monkeypatch.setenv("GPUWARDEN_PROXY_API_KEY", "k-7d2e")
    upstream, proxy = rig()

    def seen():
        return upstream.get_json("/debug/open")["requests"]

    before = seen()
    body = json.dumps({"model": "tiny", "prompt": "hi", "max_tokens": 2}).encode()
    for method, path in (("POST", "/invocations"), ("POST", "/tokenize"), ("POST", "/v1/completions"),
                         ("GET", "/v1/models")):
        for given in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic k-7d2e"},
                      {"Authorization": "Bearer k-7d2e-and-more"}, {"Authorization": "k-7d2e"}):
            reply, data = send(proxy.port, method, path, body if method == "POST" else b"",
                               {"Content-Type": "application/json", **given})
            assert reply.status == 401 and b"API key" in data, (method, path, given, reply.status)
    assert seen() == before, "a refused request reached the engine"
    reply, _ = send(proxy.port, "POST", "/invocations", body, {"Content-Type": "application/json",
                                                               "Authorization": "Bearer k-7d2e"})
    assert reply.status == 200 and seen() == before + 1
    for path in ("/ping", "/version", "/health", "/metrics"):
        assert send(proxy.port, "GET", path)[0].status == 200, path


def test_the_proxy_is_given_the_vllm_engines_key_and_no_other_engines(tmp_path):
    from gpuwarden.proxy.child import proxy_spec
    from gpuwarden.serving.compose.identity import resolve

    secrets = tmp_path / "vllm.env"
    secrets.write_text("VLLM_API_KEY=k-from-file\n")
    secrets.chmod(0o600)
    me = resolve("nobody")
    for engine, key in (("vllm", "k-from-file"), ("sglang", None)):
        cfg = parse_text(f"serve:\n  model: /m\n  engine: {engine}\n  env_file: {secrets}\n  proxy: {{enabled: true}}\n",
                         str(tmp_path / "g.yaml"))
        assert proxy_spec(cfg, me).env.get("GPUWARDEN_PROXY_API_KEY") == key, engine
    plain = parse_text("serve:\n  model: /m\n  proxy: {enabled: true}\n", str(tmp_path / "g.yaml"))
    assert "GPUWARDEN_PROXY_API_KEY" not in proxy_spec(plain, me).env


def test_a_key_rotated_or_taken_out_of_the_secrets_file_restarts_the_engine_with_the_proxy(tmp_path):
    """Attacker 13's first: a key rotated in serve.env_file and a SIGHUP restarted the proxy alone (its key read from
    the file again) while the engine kept the old one: every client refused. Now a reload whose secrets differ from
    what the running engine got restarts the engine too (serving/run/replan.Replan.plan), as a handover does."""
    from gpuwarden.serving.run.replan import secrets_changed

    secrets = tmp_path / "vllm.env"
    secrets.write_text("VLLM_API_KEY=k-one\n")
    secrets.chmod(0o600)
    cfg = parse_text(f"serve:\n  model: /m\n  env_file: {secrets}\n", str(tmp_path / "g.yaml"))
    running = {"VLLM_API_KEY": "k-one", "PATH": "/bin"}
    assert not secrets_changed(cfg, running)
    secrets.write_text("VLLM_API_KEY=k-two\n")
    assert secrets_changed(cfg, running)
    secrets.write_text("OTHER=1\n")
    assert secrets_changed(cfg, {**running, "OTHER": "1"})  # the key taken out: the engine still has it
    plain = parse_text("serve:\n  model: /m\n", str(tmp_path / "g.yaml"))
    assert not secrets_changed(plain, {"PATH": "/bin"})


def test_only_a_bodiless_options_passes_without_the_key():
    """Attacker 13's third: keyless OPTIONS requests of 32 MiB took the body budget while the engine was down. A CORS
    preflight has no body; one with a body needs the key."""
    from gpuwarden.proxy.keys import KEYED, KEYLESS, ApiKey

    key = ApiKey("k")
    assert key.lets_in("OPTIONS", "/v1/chat/completions", {})
    assert key.lets_in("OPTIONS", "/v1/chat/completions", {"Content-Length": "0"})
    assert not key.lets_in("OPTIONS", "/v1/chat/completions", {"Content-Length": "33554432"})
    assert not key.lets_in("OPTIONS", "/invocations", {"Transfer-Encoding": "chunked"})
    assert key.lets_in("POST", "/invocations", {"Authorization": "Bearer k"}) == KEYED
    assert key.lets_in("GET", "/ping", {}) == KEYLESS and key.lets_in("OPTIONS", "/x", {}) == KEYLESS
    assert not key.lets_in("POST", "/invocations", {"Authorization": "bearer wrong"})
    # attacker 17: a keyless path with a body needs the key (its F1), and a key that is no UTF-8 is refused (F4)
    assert key.lets_in("POST", "/ping", {"Content-Length": "1000000"}) is None
    assert key.lets_in("POST", "/ping", {"Content-Length": "9", "Authorization": "Bearer k"}) == KEYED
    for given in ("Bearer \udcff", "Bearer \ud800", "Bearer k\udced\udca0\udc80"):
        assert key.lets_in("GET", "/v1/models", {"Authorization": given}) is None, given


def test_a_reload_that_changes_only_the_key_restarts_the_engine_and_the_proxy(tmp_path):
    """Attacker 14: with the key rotated in serve.env_file (the config's text unchanged), the reload's plan was
    'nothing changed' and the old key kept working. key_rotated compares the engine's key and secrets with what the running engine and proxy were given."""
    from types import SimpleNamespace

    from gpuwarden.serving.run.replan import key_rotated

    secrets = tmp_path / "vllm.env"
    secrets.write_text("VLLM_API_KEY=k-one\n")
    secrets.chmod(0o600)
    flags = tmp_path / "flags.yaml"
    flags.write_text("max-model-len: 4096\n")
    cfg = parse_text(f"serve:\n  model: /m\n  env_file: {secrets}\n  args: [--config, {flags}]\n"
                     "  proxy: {enabled: true}\n", str(tmp_path / "g.yaml"))
    proxy = SimpleNamespace(fronts_engine=True, env={"GPUWARDEN_PROXY_API_KEY": "k-one"})
    launch = SimpleNamespace(sides=(proxy,), command=SimpleNamespace(env={"VLLM_API_KEY": "k-one"}))
    assert not key_rotated(cfg, launch)
    secrets.write_text("VLLM_API_KEY=k-two\n")
    assert key_rotated(cfg, launch)  # the file's key: the engine's environment differs
    secrets.write_text("OTHER=1\n")
    launch.command.env = {"OTHER": "1"}
    proxy.env = {}
    assert not key_rotated(cfg, launch)  # no key anywhere, none given
    env = parse_text(f"serve:\n  model: /m\n  env: {{VLLM_API_KEY: k-env}}\n  env_file: {secrets}\n"
                     "  proxy: {enabled: true}\n", str(tmp_path / "g.yaml"))
    assert key_rotated(env, launch)  # serve.env's key: the proxy was given none


def test_a_key_in_vllms_config_file_is_a_digest_in_the_engines_spec_so_a_rotation_replaces_it(tmp_path):
    """Attacker 14: a key rotated in vLLM's --config file and a SIGUSR2 handover adopted the engine on the old key
    (its command line and environment unchanged) and replaced the proxy on the new one. The engine's spec carries a
    digest of such a key (never the key): rotated, the spec differs, and the handover replaces the engine too."""
    from types import SimpleNamespace

    from test_drain import composed

    from gpuwarden.serving.run.kinds import KEY_DIGEST_ENV, main_spec

    flags = tmp_path / "flags.yaml"
    flags.write_text("api-key: k-one\n")
    cfg = parse_text(f"serve:\n  model: /m\n  args: [--config, {flags}]\n", str(tmp_path / "g.yaml"))
    from gpuwarden.serving.compose.identity import resolve

    parts = SimpleNamespace(command=composed().command, identity=resolve("nobody"), gpus=(), version="0.32.0")
    one = main_spec(cfg, parts)
    assert len(one.env[KEY_DIGEST_ENV]) == 16 and "k-one" not in str(one.env)
    flags.write_text("api-key: k-two\n")
    two = main_spec(cfg, parts)
    assert two.env[KEY_DIGEST_ENV] != one.env[KEY_DIGEST_ENV] and two != one
    plain = parse_text("serve:\n  model: /m\n", str(tmp_path / "g.yaml"))
    assert KEY_DIGEST_ENV not in main_spec(plain, parts).env  # a key from the environment adds nothing


def test_a_key_in_vllms_flags_or_a_config_file_the_daemon_cannot_read_is_refused_with_the_proxy_on(tmp_path):
    """Attackers 13 and 15: a key in vLLM's --config file (or --api-key) is read by vLLM again at each start, so
    an edit without a reload, then a crash, split the keys (the proxy asking none, vLLM's unguarded paths open); a
    file root cannot read gave the proxy no key in front of a keyed vLLM. With the proxy on, both are refused in
    one line (the start, the reload, check: prepare.blocking; each later start waits: serving/run/preflight), and
    the proxy asks the environment's key alone."""
    from gpuwarden.proxy.child import proxy_spec
    from gpuwarden.serving.compose.apikey import FLAGS_FIX, KEY_FIX, flags_key, flags_key_problem
    from gpuwarden.serving.compose.identity import resolve

    flags = tmp_path / "flags.yaml"
    flags.write_text("api-key: 20261203\n")
    assert flags_key(["--config", str(flags)]) == "20261203"  # a number is its text, as vLLM reads it
    flags.write_text("api-key: [12345, k2]\n")
    assert flags_key([f"--config={flags}"]) == "12345"
    for words in (["--config", str(flags)], ["--api_key", "k"], ["--api-ke=k"], ["--api-key", "a", "b"]):
        assert flags_key_problem(words) == ("with the proxy on, vLLM's flags give it an API key (--api-key, or "
                                            "api-key in its --config file), which the proxy cannot follow",
                                            FLAGS_FIX), words
    flags.write_text("max-model-len: 4096\n")
    assert flags_key_problem(["--config", str(flags), "--api-server-count", "2"]) is None
    for text in ("api-key: [unclosed\n", "- a list\n"):
        flags.write_text(text)
        what, fix = flags_key_problem(["--config", str(flags)])
        assert "the API key it may set is unknown to the proxy" in what and fix == KEY_FIX
    what, _ = flags_key_problem(["--config", "/nonexistent/flags.yaml"])
    assert what == ("vLLM's --config file /nonexistent/flags.yaml does not exist here: the API key it may set is "
                    "unknown to the proxy")
    flags.write_text("api-key: in-flags\n")
    cfg = parse_text(f"serve:\n  model: /m\n  env: {{VLLM_API_KEY: k-env}}\n  args: [--config, {flags}]\n"
                     "  proxy: {enabled: true}\n", str(tmp_path / "g.yaml"))
    assert proxy_spec(cfg, resolve("nobody")).env["GPUWARDEN_PROXY_API_KEY"] == "k-env"  # never the flags'


@pytest.mark.parametrize("words, flags_file", [
    (["--api-key.x", "K"], None), (["--api-k.x", "K"], None), (["--api_ke=K"], None),
    (["env", "VLLM_API_KEY=K", "vllm", "serve"], None), (["sh", "-c", "exec vllm serve --api-key K \"$@\"", "sh"], None),
    (["sh", "-c", "VLLM_API_KEY=K exec vllm serve"], None),
    ([], "api-k: abbrevkey16\n"), ([], "api_ke: K\n"), ([], "\"api-key=K\": true\n"), ([], "api-key.x: K\n"),
    ([], "api-key: 2026-12-03\n"), ([], "api-key: ['', K]\n"), ([], "api-key: {a: b}\n"), ([], "api-key:\n"),
], ids=lambda v: repr(v)[:40])
def test_every_spelling_vllm_takes_for_its_key_is_seen_in_its_words_and_its_config_file(tmp_path, words, flags_file):
    """Attacker 16: spellings vLLM 0.32's parser takes (argparse's prefixes, `--flag.field`, and the keys of its
    --config file, which it turns into `--KEY VALUE` words before parsing) and wrappers in serve.command (`env
    VLLM_API_KEY=K`, a shell's string) passed `check` with the proxy on, and a crash's restart started on them."""
    from gpuwarden.serving.compose.apikey import flags_key_problem

    if flags_file is not None:
        flags = tmp_path / "flags.yaml"
        flags.write_text(flags_file)
        words = ["--config", str(flags)]
    assert flags_key_problem(words) is not None, words


def test_what_names_no_key_is_not_taken_for_one_and_a_large_config_file_is_refused_unparsed(tmp_path):
    from gpuwarden.serving.compose.apikey import CONFIG_MAX_BYTES, flags_key_problem

    flags = tmp_path / "flags.yaml"
    flags.write_text("max-num-seqs: 4\napi-server-count: 2\nenable-prefix-caching: true\n")
    for words in (["--config", str(flags)], ["--api-server-count", "2"], ["sh", "-c", "exec vllm serve --port 1"],
                  ["env", "CUDA_VISIBLE_DEVICES=0", "vllm"]):
        assert flags_key_problem(words) is None, words
    flags.write_text("# " + "x" * CONFIG_MAX_BYTES + "\n")  # 1 MiB took 11.8 s to parse on the daemon's loop
    what, _ = flags_key_problem(["--config", str(flags)])
    assert what.startswith(f"vLLM's --config file {flags} cannot be read here") and len(what) < 400


def test_secrets_in_a_wrapper_command_never_reach_a_log_whole():
    """Attacker 16: `env VLLM_API_KEY=K vllm ...` and `sh -c '... --api-key K'` in serve.command were printed whole
    in the "vLLM starting" line and by `check`."""
    from gpuwarden.serving.compose.secrets import redact_argv

    shown = redact_argv(["env", "VLLM_API_KEY=sk-1", "HF_TOKEN=hf-2", "vllm", "serve", "--api-key.x", "sk-3",
                         "sh", "-c", "exec vllm serve --api-key sk-4 --hf_token=hf-5 \"$@\""])
    assert not [w for w in shown if any(s in w for s in ("sk-1", "hf-2", "sk-3", "sk-4", "hf-5"))], shown
    assert shown[:2] == ["env", "VLLM_API_KEY=<redacted>"] and "--port" not in " ".join(shown)
