"""What the proxy changes in a request, and nothing else: each rule on a parsed JSON body, counted.

The rules target prefix-cache busters that clients put where the chat template renders first:
- billing_header: Claude Code's first system block `x-anthropic-billing-header: ...; cch=NNNNN;`, a new
  nonce per request at token 0 (vLLM 0.32's /v1/messages drops it itself; its OpenAI path does not);
- cache_control: Anthropic cache markers that move forward every turn (vLLM renders only text, but a
  template or an OpenAI-path client may see them);
- sort_tools: tools in a new order on every MCP reconnect, rendered at the top by GLM and Qwen templates;
- date_line: `Today's date is YYYY-MM-DD.`, which changes at midnight (off by default: a model that is told
  the date loses it);
- remove_patterns: the operator's regexes, removed from system text, for clients not listed here. They share
  PATTERNS_S of matching a request (base/timedregex: a pattern can be quadratic or worse on what a client sends);
  past it, or on a text past PATTERNS_TEXT_MAX, the rest of that request's system text is sent as it came, and
  `apply` counts it under PATTERNS_LATE.
A body that none of them changes is forwarded byte for byte (server.py): `apply` says whether anything changed.
"""

from __future__ import annotations

import re
import time
from collections import Counter
from dataclasses import dataclass, field

from ..base.timedregex import Pattern, remove_within

BILLING_PREFIX = "x-anthropic-billing-header:"
BILLING_LINE = re.compile(r"^x-anthropic-billing-header:[^\n]*\n?", re.MULTILINE)
DATE_LINE = re.compile(r"^[ \t]*Today's date is \d{4}-\d{2}-\d{2}\.?[ \t]*\n?", re.MULTILINE)
SWITCHES = ("billing_header", "cache_control", "sort_tools", "date_line")  # the rules that are on or off
RULES = (*SWITCHES, "remove_patterns")
# The operator's patterns' time for one request, all its system texts together: a linear pattern takes microseconds
# on a long system prompt; `\s+$` took 0.8 s on 20 KB of spaces and 45 s on 150 KB.
PATTERNS_S = 0.25
# A system text longer than this goes as it came: `regex` checks its time limit between steps of a scan, and one
# greedy scan of a long run is one step (\s+$ on 30 M spaces: 8.7 s of CPU past a 0.25 s limit). Long system
# prompts are tens of KB.
PATTERNS_TEXT_MAX = 256 << 10
PATTERNS_LATE = "remove_patterns_late"  # apply()'s count of system texts the patterns ran out of time on


@dataclass(frozen=True)
class Rules:
    billing_header: bool = True
    cache_control: bool = True
    sort_tools: bool = True
    date_line: bool = False
    remove_patterns: tuple[Pattern, ...] = field(default=())  # base/timedregex.compile_pattern's


def apply(body: dict, api: str, rules: Rules, clock=time.monotonic) -> Counter:
    """Normalize body in place ("anthropic": /v1/messages, "openai": chat completions); rule -> changes made, and
    PATTERNS_LATE -> the system texts the operator's patterns ran out of their PATTERNS_S on."""
    applied: Counter = Counter()
    texts = _Texts(rules, applied, clock() + PATTERNS_S, clock)
    if api == "anthropic":
        _anthropic_system(body, rules, texts)
    else:
        _openai_system(body, texts)
    if rules.cache_control:
        for key in ("system", "messages", "tools"):
            if isinstance(body.get(key), list):
                applied["cache_control"] += _strip_cache_control(body[key])
    if rules.sort_tools and isinstance(body.get("tools"), list):
        tools = body["tools"]
        ordered = sorted(tools, key=_tool_name)
        if ordered != tools:
            body["tools"] = ordered
            applied["sort_tools"] += 1
    return +applied


def _tool_name(tool) -> str:
    if isinstance(tool, dict):
        function = tool.get("function")
        name = function.get("name") if isinstance(function, dict) else tool.get("name")
        if isinstance(name, str):
            return name
    return ""  # not a tool we can name: sorts first, keeps its relative order (the sort is stable)


def _anthropic_system(body: dict, rules: Rules, texts: _Texts) -> None:
    system = body.get("system")
    if isinstance(system, str):
        body["system"] = texts(system)
    elif isinstance(system, list):
        kept = []
        for block in system:
            text = block.get("text") if isinstance(block, dict) else None
            if rules.billing_header and isinstance(text, str) and text.startswith(BILLING_PREFIX):
                texts.applied["billing_header"] += 1
                continue
            if isinstance(text, str):
                block["text"] = texts(text)
            kept.append(block)
        body["system"] = kept


def _openai_system(body: dict, texts: _Texts) -> None:
    messages = body.get("messages")
    if not isinstance(messages, list):  # not the API's shape: the engine answers it, unchanged
        return
    for message in messages:
        if not isinstance(message, dict) or message.get("role") not in ("system", "developer"):
            continue
        content = message.get("content")
        if isinstance(content, str):
            message["content"] = texts(content)
        elif isinstance(content, list):
            for part in content:
                if isinstance(part, dict) and isinstance(part.get("text"), str):
                    part["text"] = texts(part["text"])


class _Texts:
    """One request's system texts, each with the billing line, the date line and the operator's patterns removed,
    as enabled; the patterns within the request's deadline (PATTERNS_S in all)."""

    def __init__(self, rules: Rules, applied: Counter, deadline: float, clock):
        self.rules, self.applied, self.deadline, self.clock = rules, applied, deadline, clock

    def __call__(self, text: str) -> str:
        for name, pattern in (("billing_header", BILLING_LINE if self.rules.billing_header else None),
                              ("date_line", DATE_LINE if self.rules.date_line else None)):
            if pattern is not None:  # ours: linear in the text
                text, n = pattern.subn("", text)
                self.applied[name] += n
        for pattern in self.rules.remove_patterns:
            done = remove_within(pattern, text, self.deadline - self.clock()) if len(text) <= PATTERNS_TEXT_MAX \
                else None
            if done is None:  # out of time: this text as it is now, the rest of the request's untouched
                self.applied[PATTERNS_LATE] += 1
                self.deadline = float("-inf")
                break
            text, n = done
            self.applied["remove_patterns"] += n
        return text


def _strip_cache_control(items: list) -> int:
    """Remove cache_control from content blocks (dicts with a type or a text), tool entries and the blocks
    nested in tool results; the inputs of tool calls are the client's data and are left alone."""
    removed = 0
    for item in items:
        if not isinstance(item, dict):
            continue
        if "cache_control" in item:
            del item["cache_control"]
            removed += 1
        content = item.get("content")
        if isinstance(content, list):
            removed += _strip_cache_control(content)
    return removed
