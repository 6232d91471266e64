"""`gpuwarden health`: each GPU's health state, action and reasons (the daemon's /status), and the reboots
recorded per GPU and fault (the state directory's health.json); `gpuwarden health clear GPU` records a repair.

Why clear goes through the daemon's control socket rather than editing the file: the daemon holds the record in
memory and writes it whenever a fault asks for a reboot, so a file edited behind its back would be overwritten
by its next save, and its health model would go on counting the reboots the operator just cleared. Asked over the
socket, the daemon resets its own counts, saves, and writes the journal line with the peer's uid and pid as the
kernel gives them (SO_PEERCRED), beside the name the command sends.
"""

from __future__ import annotations

import argparse
import json
import os
import pwd
import time

from ..base.safetext import visible
from ..base.statedir import state_dir
from ..base.systemd import print_error
from ..service.control import HEALTH_CLEAR
from ..tune.channel import Connection, ControlError, socket_path
from ..watch.health_record import NAME, WHO_MAX, HealthRecord
from .common import load_config
from .registry import Command
from ..base.exits import EX_CONFIG, EX_FAIL, EX_NOPERM, EX_NOT_RUNNING, EX_OK, EX_UNAVAILABLE


HELP = """\
Without arguments: each GPU's health as the running daemon judges it (healthy, degraded: serving but act soon,
unhealthy: must not serve), the action it requires (none, restart the engine, reset the GPU, reboot, inspect
the hardware) and the reasons; then what the record in the state directory (/var/lib/gpuwarden/health.json)
keeps: per GPU UUID and fault, the boots in which the fault asked for a reboot, and the history of those and of
repairs. After health.reboots_before_inspect reboots for the same fault on the same GPU the action becomes
"inspect the hardware": rebooting again has not helped.

A GPU is named by its UUID in the record, since a GPU may come back under another index.

`gpuwarden health clear GPU` (GPU: an index the daemon sees now, or a UUID, also of a GPU no longer listed)
records a repair: the running daemon resets that GPU's reboot counts, keeps a history entry "cleared by" who ran
it, and writes one journal line naming them (the user from SUDO_USER or the login name, with the uid and pid the
kernel gives). It goes through the daemon's root-only control socket (/run/gpuwarden/control.sock), so it needs
root and a running daemon with tuning.apply on.

Exit status: 0 shown or cleared, 1 the daemon refused the clear, 3 no daemon answers (the record is still
shown), 69 no control socket to ask, 77 not root (clear), 78 bad arguments."""


def arguments(p: argparse.ArgumentParser) -> None:
    # not choices=: a GPU given without "clear" gets a line that says what was meant, not argparse's usage
    p.add_argument("action", nargs="?", metavar="clear", help="record a repair of GPU (see above)")
    p.add_argument("gpu", nargs="?", metavar="GPU", help="with clear: the GPU's index or UUID")
    p.add_argument("--json", action="store_true", help="the health entries, counts and history as JSON")
    p.add_argument("--user", metavar="NAME", help="basic auth user when metrics.web_config asks for one (the "
                   "password comes from $GPUWARDEN_PASSWORD)")


def cmd_health(args: argparse.Namespace) -> int:
    if args.action == "clear":
        return _clear(args.gpu)
    if args.action is not None:
        print_error(f"gpuwarden: health: unexpected {' '.join(filter(None, (args.action, args.gpu)))!r} (did you "
                    f"mean `gpuwarden health clear {args.action}`?)")
        return EX_CONFIG
    return _show(args)


def invoking_user() -> str:
    """Who ran the command: the user sudo was run by, else the login name, else the uid's name."""
    name = os.environ.get("SUDO_USER")
    if not name:
        try:
            name = os.getlogin()
        except OSError:  # no controlling terminal (a script, a unit)
            try:
                name = pwd.getpwuid(os.getuid()).pw_name
            except KeyError:
                name = f"uid {os.getuid()}"
    return name[:WHO_MAX]


def _clear(gpu: str | None) -> int:
    if not gpu:
        print_error("gpuwarden: health clear: name the GPU, by index or UUID (`gpuwarden health` lists them)")
        return EX_CONFIG
    if os.geteuid() != 0:
        print_error("gpuwarden: health clear asks the daemon over its root-only control socket: run it as root "
                    "(sudo gpuwarden health clear GPU)")
        return EX_NOPERM
    try:
        connection = Connection(socket_path())
        try:
            answer = connection.ask({"op": HEALTH_CLEAR, "gpu": gpu, "who": invoking_user()})
        finally:
            connection.close()
    except ControlError as exc:
        print_error(f"gpuwarden: {exc}")
        return EX_UNAVAILABLE
    if not answer.get("ok"):
        print_error(f"gpuwarden: health clear: {answer.get('error', 'refused')}")
        return EX_FAIL
    cleared = ", ".join(f"{fault} x{n}" for fault, n in sorted((answer.get("cleared") or {}).items())) or "none"
    index = answer.get("index")
    print(visible(f"GPU {'?' if index is None else index} ({answer.get('uuid')}): repair recorded by "
                  f"{answer.get('who')}; reboot counts reset (were: {cleared})"))
    if answer.get("warning"):
        print_error(f"gpuwarden: warning: {answer['warning']}")
    return EX_OK


def _show(args: argparse.Namespace) -> int:
    from ..web.status import StatusError, fetch_status, running_elsewhere

    config = load_config(args)
    state, why = None, None
    if config.metrics.url is None:
        why = "metrics.listen is none, so the daemon serves no /status to read"
    else:
        auth = (args.user, os.environ.get("GPUWARDEN_PASSWORD", "")) if args.user else None
        try:
            state = fetch_status(config.metrics, auth)
            moved = running_elsewhere(config.metrics) if state is None else None
            state = fetch_status(moved, auth) if moved is not None else state
        except StatusError as exc:
            why = str(exc)
        if state is None and why is None:
            why = f"no daemon answers on {config.metrics.url}: the states are not shown"
    record = HealthRecord.load(state_dir() / NAME, quiet=True)  # its problem is printed below
    gpus = _gpus(state)
    if args.json:
        print(json.dumps({"host": _host(state), "gpus": gpus, "record_problem": record.problem,
                          "counts": {u: record.counts(u) for u in record.gpus},
                          "history": record.history()}, indent=2))
    else:
        print("\n".join(visible(line) for line in render(state is not None, _host(state), gpus, record)))
    if why is not None:
        print_error(f"gpuwarden: {why}")
        return EX_NOT_RUNNING
    return EX_OK


def _gpus(state: dict | None) -> list[dict]:
    """[{index, uuid, state, action, reasons}] from /status; a GPU without a health entry says "not reported"."""
    out = []
    for gpu in (state or {}).get("gpus", []) if isinstance((state or {}).get("gpus"), list) else []:
        if not isinstance(gpu, dict):
            continue
        h = gpu.get("health") if isinstance(gpu.get("health"), dict) else {}
        reasons = h.get("reasons") if isinstance(h.get("reasons"), list) else []
        out.append({"index": gpu.get("index"), "uuid": gpu.get("uuid"), "state": h.get("state", "not reported"),
                    "action": h.get("action_text", h.get("action", "-")), "reasons": [str(r) for r in reasons]})
    return out


def _host(state: dict | None) -> dict | None:
    """The host's entry: /status "health" itself, or its "host"."""
    h = (state or {}).get("health")
    if isinstance(h, dict) and isinstance(h.get("host"), dict):
        h = h["host"]
    return h if isinstance(h, dict) and "state" in h else None


def render(answered: bool, host: dict | None, gpus: list[dict], record: HealthRecord) -> list[str]:
    lines = []
    if answered:
        lines.append("host: " + (f"{host.get('state')}, action {host.get('action_text', host.get('action'))}"
                                 if host else "not reported (this daemon reports no health)"))
        rows = [("GPU", "UUID", "STATE", "ACTION", "REASONS")]
        rows += [(str(g["index"]), str(g["uuid"]), str(g["state"]), str(g["action"]), "; ".join(g["reasons"]) or "-")
                 for g in gpus]
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    lines.append("")
    if record.problem:
        lines.append(f"Record {record.path}: not read: {record.problem}")
    counted = any(record.counts(uuid) for uuid in record.gpus)  # a clear leaves this boot's faults known at 0
    lines.append("Reboots recorded (per GPU and fault, one a boot):" if counted else
                 f"No reboots recorded in {record.path}.")
    for uuid in sorted(record.gpus):
        for fault, n in sorted(record.counts(uuid).items()):
            lines.append(f"  {uuid}  {fault}: {n}")
    entries = record.history()
    if entries:
        lines.append("History:")
    for e in entries:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(e["time"]))
        if e["event"] == "cleared":
            was = ", ".join(f"{f} x{n}" for f, n in sorted(e["counts"].items())) or "no counts"
            lines.append(f"  {when}  {e['uuid']}  cleared by {e['who']} (was: {was})")
        else:
            lines.append(f"  {when}  {e['uuid']}  reboot required: {e['fault']} (reboot {e['count']})")
    return lines


EXITS = ((EX_OK, "shown, or cleared"), (EX_FAIL, "the daemon refused the clear"),
         (EX_NOT_RUNNING, "no daemon answers (the record is still shown)"),
         (EX_UNAVAILABLE, "no control socket to ask (clear)"), (EX_NOPERM, "not root (clear)"),
         (EX_CONFIG, "bad arguments or configuration"))
COMMAND = Command("health", help="show each GPU's health state, required action and reasons, and the reboots "
                  "recorded per fault; `health clear GPU` records a repair", run=cmd_health, arguments=arguments,
                  description=HELP, order=85, exits=EXITS)
