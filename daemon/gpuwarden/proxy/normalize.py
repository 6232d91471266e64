"""What the proxy changes in a request, and nothing else: each rule on a parsed JSON body, counted.

The rules target prefix-cache busters that clients put where the chat template renders first:
- billing_header: Claude Code's first system block `x-anthropic-billing-header: ...; cch=NNNNN;`, a new
  nonce per request at token 0 (vLLM 0.32's /v1/messages drops it itself; its OpenAI path does not);
- cache_control: Anthropic cache markers that move forward every turn (vLLM renders only text, but a
  template or an OpenAI-path client may see them);
- sort_tools: tools in a new order on every MCP reconnect, rendered at the top by GLM and Qwen templates;
- date_line: `Today's date is YYYY-MM-DD.`, which changes at midnight (off by default: a model that is told
  the date loses it);
- remove_patterns: the operator's regexes, removed from system text, for clients not listed here.
A body that none of them changes is forwarded byte for byte (server.py): `apply` says whether anything changed.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field

BILLING_PREFIX = "x-anthropic-billing-header:"
BILLING_LINE = re.compile(r"^x-anthropic-billing-header:[^\n]*\n?", re.MULTILINE)
DATE_LINE = re.compile(r"^[ \t]*Today's date is \d{4}-\d{2}-\d{2}\.?[ \t]*\n?", re.MULTILINE)
SWITCHES = ("billing_header", "cache_control", "sort_tools", "date_line")  # the rules that are on or off
RULES = (*SWITCHES, "remove_patterns")


@dataclass(frozen=True)
class Rules:
    billing_header: bool = True
    cache_control: bool = True
    sort_tools: bool = True
    date_line: bool = False
    remove_patterns: tuple[re.Pattern, ...] = field(default=())


def apply(body: dict, api: str, rules: Rules) -> Counter:
    """Normalize body in place ("anthropic": /v1/messages, "openai": chat completions); rule -> changes made."""
    applied: Counter = Counter()
    if api == "anthropic":
        _anthropic_system(body, rules, applied)
    else:
        _openai_system(body, rules, applied)
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


def _anthropic_system(body: dict, rules: Rules, applied: Counter) -> None:
    system = body.get("system")
    if isinstance(system, str):
        body["system"] = _text(system, rules, applied)
    elif isinstance(system, list):
        kept = []
        for block in system:
            text = block.get("text") if isinstance(block, dict) else None
            if rules.billing_header and isinstance(text, str) and text.startswith(BILLING_PREFIX):
                applied["billing_header"] += 1
                continue
            if isinstance(text, str):
                block["text"] = _text(text, rules, applied)
            kept.append(block)
        body["system"] = kept


def _openai_system(body: dict, rules: Rules, applied: Counter) -> None:
    messages = body.get("messages")
    if not isinstance(messages, list):  # not the API's shape: the engine answers it, unchanged
        return
    for message in messages:
        if not isinstance(message, dict) or message.get("role") not in ("system", "developer"):
            continue
        content = message.get("content")
        if isinstance(content, str):
            message["content"] = _text(content, rules, applied)
        elif isinstance(content, list):
            for part in content:
                if isinstance(part, dict) and isinstance(part.get("text"), str):
                    part["text"] = _text(part["text"], rules, applied)


def _text(text: str, rules: Rules, applied: Counter) -> str:
    """A system text with the billing line, the date line and the operator's patterns removed, as enabled."""
    for name, pattern in (("billing_header", BILLING_LINE if rules.billing_header else None),
                          ("date_line", DATE_LINE if rules.date_line else None),
                          *(("remove_patterns", p) for p in rules.remove_patterns)):
        if pattern is not None:
            text, n = pattern.subn("", text)
            applied[name] += n
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
