"""`gpuwarden proxy diff A B`: where two turns' prompts first differ, in the order a chat template renders
them (tools first, as GLM and Qwen templates do, then the system text, then the messages).

A prefix cache serves a turn only up to the first token that differs from an earlier prompt; whatever differs
there is the cache buster. The diff is shown for the requests as received and as sent upstream, so the user
sees both the buster and whether the proxy's rules already remove it.
"""

from __future__ import annotations

import json
from pathlib import Path

CONTEXT = 60


def segments(body: dict) -> list[tuple[str, str]]:
    """(where, text) in render order."""
    out: list[tuple[str, str]] = []
    for i, tool in enumerate(body.get("tools") or ()):
        out.append((f"tools[{i}]", json.dumps(tool, sort_keys=False, ensure_ascii=False)))
    system = body.get("system")
    if isinstance(system, str):
        out.append(("system", system))
    elif isinstance(system, list):
        for i, block in enumerate(system):
            out.append((f"system[{i}]", json.dumps(block, ensure_ascii=False) if not isinstance(block, dict)
                        or "text" not in block else block["text"]))
    for i, message in enumerate(body.get("messages") or ()):
        role = message.get("role", "?") if isinstance(message, dict) else "?"
        content = message.get("content") if isinstance(message, dict) else message
        if isinstance(content, str):
            out.append((f"messages[{i}] ({role})", content))
        else:
            out.append((f"messages[{i}] ({role})", json.dumps(content, ensure_ascii=False)))
    return out


def first_difference(a: dict, b: dict) -> str:
    """One paragraph: where the rendered prompts of a and b first differ, with both sides around it."""
    sa, sb = segments(a), segments(b)
    shared = 0
    for (wa, ta), (wb, tb) in zip(sa, sb):
        if wa == wb and ta == tb:
            shared += len(ta)
            continue
        at = _common_prefix(ta, tb) if wa == wb else 0
        lines = [f"first difference in {wa}" + (f" / {wb}" if wb != wa else "") +
                 f", at character {at} of it (about {shared + at} characters into the prompt):",
                 f"  before: {_snippet(ta, at)}", f"  after:  {_snippet(tb, at)}"]
        return "\n".join(lines)
    if len(sa) == len(sb):
        return "identical: the whole prompt can be served from the prefix cache"
    longer = "after" if len(sb) > len(sa) else "before"
    return (f"no difference in the {min(len(sa), len(sb))} shared parts; the {longer} turn adds "
            f"{abs(len(sb) - len(sa))} more: a prefix-cache hit up to there")


def _common_prefix(a: str, b: str) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _snippet(text: str, at: int) -> str:
    start = max(0, at - CONTEXT // 3)
    piece = text[start:at + CONTEXT]
    shown = piece.replace("\\", "\\\\").replace("\n", "\\n").replace("\t", "\\t")  # one line, readable
    return ("…" if start else "") + shown + ("…" if at + CONTEXT < len(text) else "")


def turns(path: Path) -> list[Path]:
    """A dump file is itself; a session folder is its files, oldest first (their names are UTC times)."""
    if path.is_dir():
        return sorted(path.glob("*.json"))
    return [path]


def load(path: Path, max_bytes: int = 64 << 20) -> dict:
    if not path.is_file():
        raise ValueError(f"{path}: not a dump file")
    if path.stat().st_size > max_bytes:
        raise ValueError(f"{path}: larger than {max_bytes >> 20} MiB, not a dump of ours")
    try:
        dump = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: not JSON ({exc})") from None
    if not isinstance(dump, dict) or not isinstance(dump.get("received"), dict):
        raise ValueError(f"{path}: not a gpuwarden proxy dump (no 'received' request)")
    return dump


def report(a: Path, b: Path) -> str:
    da, db = load(a), load(b)
    out = [f"{a.name} -> {b.name}"]
    out.append("as received: " + first_difference(da["received"], db["received"]))
    if isinstance(da.get("sent"), dict) and isinstance(db.get("sent"), dict):
        out.append("as sent upstream (after the proxy's rules): " + first_difference(da["sent"], db["sent"]))
    applied = db.get("applied") or {}
    out.append("rules applied to the later turn: " + (", ".join(f"{k} x{v}" for k, v in applied.items()) or "none"))
    return "\n".join(out)
