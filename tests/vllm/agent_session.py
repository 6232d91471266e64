"""A synthetic coding-agent session with the cache busters the user report found, for the proxy's replay
(tests/test_proxy_vllm.py, benchmarks/proxy_replay.py), against the real CPU vLLM.

Anthropic turns (/v1/messages) carry, as Claude Code sends them: a billing-header block with a new nonce per
request at token 0, cache_control on the last system block, the last tool and the newest message (so it moves
every turn), the tools in a new order on every request (as after MCP reconnects), and "Today's date is ..."
in the system text, with midnight passing halfway. OpenAI turns (/v1/chat/completions) carry a timestamp at
the head of the system prompt, as other agents put one, and shuffled tools too. The assistant's replies are
fixed text, so every replay sends the same conversation.
"""

from __future__ import annotations

import json
import random
import time
import urllib.request

TOOL_NAMES = ("Read", "Write", "Edit", "Bash", "Glob", "Grep", "mcp__git__status", "mcp__git__log")
TIMESTAMP_RULE = r"^\[\d{4}-\d\d-\d\dT[\d:.]+Z\] "  # the user-defined rule that removes the OpenAI turns' buster
SYSTEM = ("You are a coding agent working in a repository. Read files before you change them, keep changes "
          "small, run the tests after each change and report what you did in one short paragraph.\n"
          "Environment: linux, a git checkout, python 3.11.\nToday's date is {date}.\n"
          "Answer in plain text. Use the tools when a file must be read or a command run.")


def _tools(rng: random.Random, api: str, last_marked: bool) -> list[dict]:
    names = list(TOOL_NAMES)
    rng.shuffle(names)
    tools = []
    for i, name in enumerate(names):
        schema = {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}
        description = f"{name}: a tool of the agent that acts on the path it is given"
        if api == "anthropic":
            tool = {"name": name, "description": description, "input_schema": schema}
            if last_marked and i == len(names) - 1:
                tool["cache_control"] = {"type": "ephemeral"}
        else:
            tool = {"type": "function", "function": {"name": name, "description": description, "parameters": schema}}
        tools.append(tool)
    return tools


def _history(turn: int) -> list[tuple[str, str]]:
    return [(f"Task {i}: look at module_{i}.py, find why test_{i} fails and fix it; keep the change small.",
             f"Done with task {i}: module_{i}.py had an off-by-one in its loop; fixed, and test_{i} passes now.")
            for i in range(turn)]


def anthropic_turn(model: str, turn: int, turns: int, seed: int = 0) -> dict:
    rng = random.Random(seed * 1000 + turn)
    date = "2026-11-26" if turn < turns // 2 else "2026-11-27"  # midnight passes mid-session
    messages = []
    for user, assistant in _history(turn):
        messages += [{"role": "user", "content": [{"type": "text", "text": user}]},
                     {"role": "assistant", "content": [{"type": "text", "text": assistant}]}]
    messages.append({"role": "user", "content": [{"type": "text", "text": f"Task {turn}: what next?",
                                                  "cache_control": {"type": "ephemeral"}}]})
    return {"model": model, "max_tokens": 4, "temperature": 0,
            "system": [{"type": "text", "text": f"x-anthropic-billing-header: cc_version=2.0.14; "
                                                f"cch={rng.randrange(10**5):05d};"},
                       {"type": "text", "text": SYSTEM.format(date=date), "cache_control": {"type": "ephemeral"}}],
            "tools": _tools(rng, "anthropic", True), "messages": messages}


def openai_turn(model: str, turn: int, turns: int, seed: int = 0) -> dict:
    rng = random.Random(seed * 1000 + turn + 500)
    stamp = f"[2026-11-26T13:{turn:02d}:{rng.randrange(60):02d}.{rng.randrange(1000):03d}Z] "
    messages = [{"role": "system", "content": stamp + SYSTEM.format(date="2026-11-26")}]
    for user, assistant in _history(turn):
        messages += [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]
    messages.append({"role": "user", "content": f"Task {turn}: what next?"})
    return {"model": model, "max_tokens": 4, "temperature": 0, "tools": _tools(rng, "openai", False),
            "messages": messages}


def counters(engine_url: str) -> tuple[float, float]:
    """(queries, hits) of vLLM's prefix cache, in tokens."""
    text = urllib.request.urlopen(engine_url + "/metrics", timeout=30).read().decode()
    found = {}
    for line in text.splitlines():
        for name in ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total"):
            if line.startswith(name):
                found[name] = found.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return found["vllm:prefix_cache_queries_total"], found["vllm:prefix_cache_hits_total"]


def post(url: str, body: dict, timeout: float = 300) -> dict:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as reply:
        return json.loads(reply.read())


def replay(base_url: str, engine_url: str, api: str, model: str, turns: int) -> dict:
    """Send the session's turns in order; the prefix-cache hit rate vLLM counted over them, and the prompt sizes."""
    make, path = (anthropic_turn, "/v1/messages") if api == "anthropic" else (openai_turn, "/v1/chat/completions")
    q0, h0 = counters(engine_url)
    sizes = []
    began = time.monotonic()
    for turn in range(turns):
        reply = post(base_url + path, make(model, turn, turns))
        usage = reply["usage"]
        sizes.append(usage.get("input_tokens", usage.get("prompt_tokens")))
    q1, h1 = counters(engine_url)
    return {"api": api, "turns": turns, "queries": q1 - q0, "hits": h1 - h0,
            "hit_rate": (h1 - h0) / (q1 - q0) if q1 > q0 else 0.0, "first_prompt_tokens": sizes[0],
            "last_prompt_tokens": sizes[-1], "seconds": time.monotonic() - began}


def reset_cache(engine_url: str) -> None:
    """vLLM's /reset_prefix_cache (served with VLLM_SERVER_DEV_MODE=1): each replay starts cold."""
    urllib.request.urlopen(urllib.request.Request(engine_url + "/reset_prefix_cache", b"", method="POST"),
                           timeout=60).read()
