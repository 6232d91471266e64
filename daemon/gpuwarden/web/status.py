"""`gpuwarden status`: read the running daemon's /status and show it as a table."""

from __future__ import annotations

import dataclasses
import json
import os
import ssl
import time
from urllib.parse import urlsplit

from ..base import httpget, smallfile
from ..config import MetricsConfig
from ..gpu.base import GPM_SHOWN, gpm_activity
from ..base.safetext import visible
from ..base.statedir import listen_file
from ..base.webconfig import basic_auth_header


class StatusError(Exception):
    """Something answered, but not with the daemon's /status; the message says what to do."""


class NotShaped(ValueError):
    """A /status value that this gpuwarden's daemon never writes; the message names it (one line, short)."""


def is_share(value) -> bool:
    """A GPM ratio as the daemon writes it: a number 0..1 (not a bool, not NaN)."""
    return type(value) in (int, float) and 0 <= value <= 1


def shown(value) -> str:
    """A value from another process, cut to fit a line."""
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def fetch_status(metrics: MetricsConfig, auth: tuple[str, str] | None = None, timeout_s: float = 3.0) -> dict | None:
    """The daemon's /status JSON; None when nothing answers there; StatusError for any other answer."""
    context = headers = None
    web = metrics.web
    if web is not None and web.tls:
        context = ssl.create_default_context(cafile=str(web.cert_file))  # trust exactly the daemon's certificate
        context.check_hostname = False
    owner = None
    if auth is not None:
        headers = {"Authorization": basic_auth_header(*auth)}
        # Without TLS nothing proves the server is the daemon: the password goes only to a socket of root's (the
        # unit's) or this user's. A local user who held the port at a restart got it (attacker 17's F2).
        owner = None if context is not None else tuple(dict.fromkeys((0, os.geteuid())))
    try:
        reply = httpget.get(f"{metrics.url}/status", timeout_s, 16 * 1024 * 1024, headers, context, owner=owner)
    except httpget.Unasked as exc:
        raise StatusError(f"{metrics.url} is not the daemon's: {exc}; the password was not sent") from None
    except httpget.HttpError as exc:
        if "refused" in str(exc).lower():
            return None
        raise StatusError(f"{metrics.url}: {exc}") from None
    if reply.code == 401:
        raise StatusError(f"{metrics.url} wants basic auth (metrics.web_config): give --user NAME, with the "
                          "password in $GPUWARDEN_PASSWORD")
    try:
        state = json.loads(reply.body)
    except (ValueError, UnicodeDecodeError, RecursionError):  # RecursionError: nested past the interpreter's limit
        state = None
    if reply.code != 200 or not isinstance(state, dict) or "daemon" not in state:
        raise StatusError(f"something other than gpuwarden answers on {metrics.url} (HTTP {reply.code})")
    return state


def running_elsewhere(metrics: MetricsConfig) -> MetricsConfig | None:
    """The address the running daemon recorded (statedir.listen_file), when it differs from the config's."""
    try:  # never a FIFO's wait nor a link's target (smallfile)
        raw = smallfile.read(listen_file(), 4096)
    except smallfile.Unreadable:
        return None
    if raw is None:
        return None
    url = raw.decode("utf-8", "replace").strip()
    parts = urlsplit(url)
    if url == metrics.url or not parts.hostname or not parts.port:
        return None
    return dataclasses.replace(metrics, listen=(parts.hostname, parts.port))


def _mhz(current, lock, maximum) -> str:
    text = "?" if current is None else f"{current}"
    if lock:
        text += f" / lock {lock[1]}"
    return text + (f" / max {maximum}" if maximum is not None else "")


def _power(gpu: dict) -> str:
    draw, limit = gpu.get("power_w"), gpu.get("power_limit_w")
    text = "?" if draw is None else f"{draw:.0f}"
    return text + (f" / {limit:.0f} W" if limit is not None else " W")


def _health(gpu: dict) -> str:
    """The HEALTH cell: "healthy", or the state and the action it requires ("unhealthy: reboot"); "-" from a daemon
    before the health model."""
    health = gpu.get("health")
    if not health:
        return "-"
    state = str(health["state"])
    return state if state == "healthy" else f"{state}: {health['action_text']}"


def _watts(value, what: str) -> float:
    if type(value) not in (int, float) or not 0 <= value <= 1e6:  # no bool, NaN, 1e308 nor a 400-digit integer
        raise NotShaped(f"power_budget: {what} {shown(value)} is not watts")
    return float(value)


def _budget_line(budget) -> str | None:
    """Under the table, tuning.power_budget_w's split: "power budget 800 W: GPU0 600 W, GPU1 150 W (sum 750 W,
    3 moves)", and why it is static or short when it is. None without a budget (or from a daemon before it)."""
    if budget is None:
        return None
    alloc = budget.get("alloc") if isinstance(budget, dict) else None
    if not isinstance(alloc, dict) or len(alloc) > 64 or not all(str(k).isdigit() and len(k) < 4 for k in alloc):
        raise NotShaped(f"power_budget {shown(budget)} is not a split of GPUs")
    total = _watts(budget.get("budget_w"), "budget_w")
    moves = budget.get("moves")
    if type(moves) is not int or not 0 <= moves < 10**15:
        raise NotShaped(f"power_budget: moves {shown(moves)} is not a count")
    shares = {int(k): _watts(w, f"GPU{k}") for k, w in alloc.items()}
    split = ", ".join(f"GPU{i} {w:g} W" for i, w in sorted(shares.items())) or "not split yet"
    line = f"power budget {total:g} W: {split} (sum {sum(shares.values()):g} W, {moves} move" + \
        ("s" if moves != 1 else "") + ")"
    for key, said in (("fallback", "static split"), ("short", "SHORT")):
        if budget.get(key):
            line += f"; {said}: {str(budget[key])[:300] if isinstance(budget[key], str) else shown(budget[key])}"
    return line


def render_status(state: dict) -> str:
    """The table; TypeError, ValueError (NotShaped, naming the value), KeyError, AttributeError or OverflowError (a
    400-digit integer as a reading) when state is not shaped as /status is."""
    daemon = state.get("daemon", {})
    uptime = time.time() - daemon.get("started_at", time.time())
    lines = [f"gpuwarden {daemon.get('version', '?')} (pid {daemon.get('pid', '?')}, up {uptime:.0f} s): "
             f"{state.get('status', 'no sample yet')}"]
    # ACTIVITY: GPM's SM, tensor and DRAM shares beside utilization, which reads ~100 % for a kernel that only
    # sleeps; "-" on a GPU without GPM (before Hopper) or before its second read
    # HEALTH: can it serve, and what must happen to it (watch/health.py); the reasons follow the table
    rows = [("GPU", "NAME", "HEALTH", "SM MHz", "MEM MHz", "POWER", "TEMP", "UTIL", "ACTIVITY", "REASONS")]
    for gpu in state.get("gpus", []):
        if not gpu.get("up", True):
            rows.append((str(gpu["index"]), gpu["name"], _health(gpu), "DOWN", "", "", "", "", "",
                         gpu.get("error") or ""))
            continue
        temp, util = gpu.get("temperature_c"), gpu.get("utilization_pct")
        for name in GPM_SHOWN.values():  # never "SM -500%", "nan%" or a 400-digit integer's OverflowError
            if gpu.get(name) is not None and not is_share(gpu[name]):
                raise NotShaped(f"GPU {shown(gpu.get('index'))}: {name} {shown(gpu[name])} is not a share 0..1")
        rows.append((str(gpu["index"]), gpu["name"], _health(gpu),
                     _mhz(gpu.get("sm_clock_mhz"), gpu.get("sm_lock_mhz"), gpu.get("max_sm_clock_mhz")),
                     _mhz(gpu.get("memory_clock_mhz"), gpu.get("memory_lock_mhz"), gpu.get("max_memory_clock_mhz")),
                     _power(gpu), "?" if temp is None else f"{temp:.0f} C",
                     "?" if util is None else f"{util:.0f}%", gpm_activity(gpu) or "-",
                     ",".join(gpu.get("clock_event_reasons") or []) or "-"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines += ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows]
    for gpu in state.get("gpus", []):
        if gpu.get("health") and gpu["health"]["state"] != "healthy":
            reasons = "; ".join(map(str, gpu["health"]["reasons"]))
            lines.append(f"  GPU{gpu['index']} {_health(gpu)}, because: {reasons}")
    budget = _budget_line(state.get("power_budget"))
    if budget:
        lines.append(budget)
    firing = state.get("alerts_firing", [])
    lines.append("")
    lines.append("Alerts firing:" if firing else "No alerts firing.")
    for alert in firing:
        where = f"GPU{alert['gpu']} " if alert["gpu"] is not None else ""
        lines.append(f"  [{alert['severity']}] {where}{alert['alert']}: {alert['observed']} "
                     f"{alert['threshold']}")
    return "\n".join(visible(line) for line in lines)  # the strings are the server's: no ESC reaches the terminal
