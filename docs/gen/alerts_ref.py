"""docs/reference/alerts.md from the code and the shipped rules: every daemon alert (the Rule objects in
watch/signals/, grouped by signal and introduced by its docstring; the settings its check reads, with their defaults
from config.py; the fix it logs), every Prometheus rule in etc/prometheus/*.yml (its meaning and fix from its
annotations, its expression without the hold every per-host alert shares) and the Alertmanager inhibitions in
etc/alertmanager/*.yml.

    PYTHONPATH=daemon .venv/bin/python docs/gen/alerts_ref.py     # writes the page

tests/test_ref_metrics_alerts.py checks the committed page against this and against the rules themselves.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import re
import sys
import textwrap
from pathlib import Path

import yaml

PAGE = Path("docs") / "reference" / "alerts.md"
RULE_FILES, ALERTMANAGER_FILES = "etc/prometheus/*.yml", "etc/alertmanager/*.yml"

# The shipped groups' titles; a group not named here is titled by its name.
GROUP_TITLES = {"gpuwarden-gpu": "Prometheus, per host: the GPUs",
                "gpuwarden-fleet": "Prometheus, per host: the daemon and its engine",
                "gpuwarden-fleet-consistency": "Prometheus, the fleet: across the hosts"}


def _words(text: str) -> str:
    return " ".join(text.split())


def _yaml_value(value) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    return f"{value:g}" if isinstance(value, float) else str(value)


# -- the daemon's rules ------------------------------------------------------------------------------------------

def alert_keys() -> dict[str, tuple[str, str]]:
    """AlertSettings' field -> (its key under alerts:, its default as the config file writes it)."""
    from gpuwarden import config

    written = config.Config().as_dict()["alerts"]
    out = {}
    for f in dataclasses.fields(config.AlertSettings):
        key = f.name if f.name in written else next(k for k in written if k.startswith(f.name + "_"))
        out[f.name] = (key, _yaml_value(written[key]))
    return out


def _constant_note(module, name: str) -> str:
    """A module constant's own comment, on the line that sets it."""
    match = re.search(rf"^{name}\s*=[^#\n]*#\s*(.+)$", inspect.getsource(module), re.M)
    return _words(match[1]) if match else ""


def reads(check, module) -> tuple[list[str], bool, dict[str, object]]:
    """What a rule's check reads, through the functions of its own module that it calls: the AlertSettings fields
    (ctx.settings.X), whether it asks if the GPU is busy (ctx.busy), and the module's numeric constants."""
    from gpuwarden.config import AlertSettings

    fields = {f.name for f in dataclasses.fields(AlertSettings)}
    settings: list[str] = []
    busy, constants, seen, todo = False, {}, set(), [check]
    while todo:
        function = todo.pop()
        seen.add(function)
        for node in ast.walk(ast.parse(textwrap.dedent(inspect.getsource(function)))):
            if isinstance(node, ast.Attribute) and node.attr in fields and \
                    (getattr(node.value, "attr", None) == "settings" or getattr(node.value, "id", None) == "settings"):
                settings += [node.attr] if node.attr not in settings else []
            elif isinstance(node, ast.Attribute) and node.attr == "busy" and getattr(node.value, "id", "") == "ctx":
                busy = True
            elif isinstance(node, ast.Name) and node.id in vars(module):
                value = vars(module)[node.id]
                if inspect.isfunction(value) and value.__module__ == module.__name__ and value not in seen:
                    todo.append(value)
                elif node.id.isupper() and isinstance(value, (int, float)) and not isinstance(value, bool):
                    constants[node.id] = value
    return settings, busy, constants


def daemon_rules() -> list[tuple[object, list]]:
    """(signal module, its rules), in the order the daemon evaluates them; a signal's host-wide rules (HOST_RULES)
    after its per-GPU ones; the host-wide serving rules last."""
    from gpuwarden.watch import signals
    from gpuwarden.watch.signals import serving

    out = [(signal, list(signal.RULES) + list(getattr(signal, "HOST_RULES", ()))) for signal in signals.SIGNALS]
    if serving not in signals.SIGNALS:
        out.append((serving, list(signals.SERVING_RULES)))
    return [(signal, rules) for signal, rules in out if rules]


def _daemon_rule(rule, module, keys, twins, host_wide: bool) -> list[str]:
    from gpuwarden.config import AlertSettings

    lines = [f"#### `{rule.name}`", ""]
    facts = [f"**{rule.severity}**"]
    if host_wide:
        facts.append("host-wide (`gpu=\"all\"`)")
    if rule.for_s is None:
        facts.append(f"fires after holding `alerts.{keys['for_s'][0]}` (default {keys['for_s'][1]} s)")
    elif rule.for_s == 0:
        facts.append("fires at once (its condition is already a duration)")
    else:
        facts.append(f"fires after holding {rule.for_s:g} s (fixed)")
    if twins.get(rule.name):
        facts.append("in Prometheus: " + ", ".join(f"[`{name}`](#{name.lower()})" for name in twins[rule.name]))
    lines += [" · ".join(facts) + ".", ""]
    doc = inspect.getdoc(rule.check)
    if doc and rule.check.__name__ != "check":
        lines += [_words(doc), ""]
    settings, busy, constants = reads(rule.check, module)
    items = []
    if busy:
        key, default = keys["busy_utilization_pct"]
        items.append(f"only while the GPU is busy: utilization at least `alerts.{key}` (default {default}), or the "
                     "engine runs requests")
    items += [f"`alerts.{keys[name][0]}` (default `{keys[name][1]}`)" for name in settings]
    items += [f"`{name} = {value:g}` in `watch/signals/{module.__name__.rsplit('.', 1)[1]}.py`"
              + (f": {note}" if (note := _constant_note(module, name)) else "") for name, value in constants.items()]
    if items:
        lines.append("- **Threshold:** " + "; ".join(items) + ".")
    if rule.reapply:
        key, default = keys["reapply_min_interval_s"]
        lines.append(f"- **The daemon's answer:** it re-applies the tuning, at most every `alerts.{key}` (default "
                     f"{default} s) per GPU.")
    if rule.swept:
        lines.append("- **During a tune sweep:** the sweep's own settings trip it, so it is held as it is on the "
                     "GPUs a sweep holds, and evaluated again once the configured setting is back.")
    lines += [f"- **Fix:** {rule.hint}.", ""]
    assert set(keys) == {f.name for f in dataclasses.fields(AlertSettings)}
    return lines


def _daemon_section(keys, twins) -> list[str]:
    from gpuwarden.watch import alerts
    from gpuwarden.watch.signals import serving

    lines = ["## The daemon's alerts", "",
             "The daemon evaluates each rule on every poll, per GPU (the serving rules once for the host). "
             + _words(inspect.getdoc(alerts).split("\n\n", 1)[1]) + " Each transition is one journal line with "
             "the GPU, the reading, the threshold and the fix; `gpuwarden_alert_active` and "
             "`gpuwarden_alert_transitions_total` carry them on [/metrics](metrics.md#alerts).", "",
             "The settings under `alerts:` (every one of them is in [the configuration reference]"
             "(configuration.md)):", ""]
    lines += [f"- `alerts.{key}`: default `{default}`" for key, default in keys.values()]
    lines.append("")
    for module, rules in daemon_rules():
        short = module.__name__.rsplit(".", 1)[1]
        lines += [f"### `{short}`", "", f"From `watch/signals/{short}.py`: {_words(inspect.getdoc(module))}", ""]
        for rule in rules:
            lines += _daemon_rule(rule, module, keys, twins,
                                  host_wide=module is serving or rule in getattr(module, "HOST_RULES", ()))
    return lines


# -- the Prometheus rules ----------------------------------------------------------------------------------------

ACTION = re.compile(r"\{\{-?\s*(.*?)\s*-?\}\}", re.S)


def _parse_template(text: str) -> list:
    """Go template text as a tree: str, ("action", text), ("if"/"with"/"range", [(condition, nodes)...],
    else nodes)."""
    pieces = ACTION.split(text)  # text, action, text, action, ...
    stack: list[tuple[str, list, list]] = []
    nodes: list = []
    for i, piece in enumerate(pieces):
        if i % 2 == 0:
            if piece:
                nodes.append(piece)
            continue
        word = piece.split(" ", 1)[0]
        if word in ("if", "with", "range"):
            stack.append((word, [(piece[len(word):].strip(), [])], nodes))
            nodes = stack[-1][1][0][1]
        elif word == "else":
            kind, branches, outer = stack[-1]
            branches.append((piece[len("else"):].strip().removeprefix("if").strip(), []))
            nodes = branches[-1][1]
        elif word == "end":
            kind, branches, outer = stack.pop()
            outer.append((kind, branches))
            nodes = outer
        else:
            nodes.append(("action", piece))
    return nodes


def _query(pipeline: str) -> str:
    """The PromQL a template queries, without its selectors: printf "x{instance='%s'}[10m]" ... -> x[10m]."""
    string = re.search(r'"((?:[^"\\]|\\.)*)"', pipeline)
    return re.sub(r"\{[^{}]*\}", "", string[1]).replace("%s", "*") if string else pipeline


def _condition(text: str) -> str:
    if match := re.fullmatch(r'eq \$(?:labels\.)?(\w+) "(.*)"', text):
        return f"`{match[1]}` is `{match[2]}`"
    if "query" in text:
        return f"`{_query(text)}` holds"
    return f"`{text}`"


def _action(text: str) -> str:
    if match := re.match(r"\$labels\.(\w+)", text):
        return "{" + match[1] + "}"
    if text.startswith("$value"):
        return "{value}"
    if re.match(r"\$\w+\s*:?=", text):  # a variable set: said by the conditions that read it
        return ""
    return "…"


def _render(nodes: list, fixing: bool) -> tuple[str, str, bool]:
    """(the meaning, the fix, whether the fix has begun): the text from "Fix:" on is the fix; a condition's
    branches are said one after the other ("Where ...: ... Otherwise: ...")."""
    meaning, fix = [], []
    for node in nodes:
        if isinstance(node, str):
            if not fixing and "Fix:" in node:
                before, node = node.split("Fix:", 1)
                meaning.append(before)
                fixing = True
            (fix if fixing else meaning).append(node)
        elif node[0] == "action":
            (fix if fixing else meaning).append(_action(node[1]))
        elif node[0] in ("with", "range") and "query" in node[1][0][0]:
            query = f"`{_query(node[1][0][0])}`"
            (fix if fixing else meaning).append(query if node[0] == "with" else f" (each of {query})")
        else:
            said = [(condition, *_render(branch, fixing)) for condition, branch in node[1]]
            began = any(began for *_, began in said)
            for part, out in ((0, meaning), (1, fix)):
                texts = [(condition, _words(text[part])) for condition, *text in said]
                if not any(text for _, text in texts):
                    continue
                short = all(len(text) < 40 for _, text in texts)
                if short and len(texts) > 1:  # a word that depends on a label: "SM / memory"
                    out.append(" / ".join(text for _, text in texts))
                elif short:
                    out.append(f" (where {_condition(texts[0][0])}: {texts[0][1].strip(' ,')})")
                else:
                    out.append(" " + " ".join((f"Where {_condition(condition)}: " if condition else "Otherwise: ")
                                              + _sentence(text) for condition, text in texts if text) + " ")
            fixing = fixing or began
    return "".join(meaning), "".join(fix), fixing


def _sentence(text: str) -> str:
    return text if text.endswith((".", "!", "?")) else text + "."


def _describe(template: str) -> tuple[str, str]:
    meaning, fix, _ = _render(_parse_template(template or ""), False)
    return tuple(re.sub(r"\.(\s*\.)+", ".", _words(text)) for text in (meaning, fix))


def _hold(name: str) -> str:
    return (r"\s*unless on \(job, instance\) up == 0\s*or max without \(alertstate\) \(ALERTS\{alertname=\""
            + re.escape(name) + r"\", alertstate=\"firing\"\}\) and on \(job, instance\) up == 0\s*$")


def _expression(rule: dict) -> tuple[str, bool]:
    """The expression without the hold every per-host alert ends with (said once on the page), and whether it
    had it."""
    expr, held = re.subn(_hold(rule["alert"]), "", rule["expr"].strip())
    expr = expr.strip()
    if held and expr.startswith("(") and expr.endswith(")") and _balanced(expr[1:-1]):
        expr = expr[1:-1]
    return expr, bool(held)


def _balanced(text: str) -> bool:
    depth = 0
    for char in text:
        depth += {"(": 1, ")": -1}.get(char, 0)
        if depth < 0:
            return False
    return depth == 0


def _comments(lines: list[str], before: str) -> dict[str, str]:
    """The comment lines right above each line that matches before (a regex with one group, the key)."""
    out = {}
    for i, line in enumerate(lines):
        if match := re.match(before, line):
            j = i
            while j > 0 and lines[j - 1].strip().startswith("#"):
                j -= 1
            out[match[1]] = _words(" ".join(line.strip().lstrip("#") for line in lines[j:i]))
    return out


def rule_files(root: Path) -> list[Path]:
    return sorted(root.glob(RULE_FILES))


def prometheus_groups(root: Path) -> list[tuple[Path, dict, dict[str, str]]]:
    """(file, group, the comments above its rules and itself, by alert, record or group name)."""
    out = []
    for path in rule_files(root):
        text = path.read_text()
        lines = text.splitlines()
        comments = _comments(lines, r"\s*- (?:alert|record|name): (\S+)")
        out += [(path, group, comments) for group in yaml.safe_load(text)["groups"]]
    return out


def _first_term(expr: str) -> str:
    """An expression before its first "unless": the series it fires on, not the ones that keep it quiet."""
    return expr.split(" unless ", 1)[0]


def daemon_twins(root: Path) -> dict[str, list[str]]:
    """Each daemon rule -> the Prometheus alerts whose expression reads its gpuwarden_alert_active series."""
    twins: dict[str, list[str]] = {}
    for _, group, _ in prometheus_groups(root):
        for rule in group["rules"]:
            for names in re.findall(r'alert\s*=~?\s*"([^"]+)"', _first_term(rule["expr"]) if "alert" in rule else ""):
                for name in names.split("|"):
                    twins.setdefault(name, []).append(rule["alert"])
    return twins


def _prometheus_alert(rule: dict, comment: str, path: Path, root: Path, mirrors: list[str]) -> list[str]:
    expr, held = _expression(rule)
    facts = [f"**{rule.get('labels', {}).get('severity', 'no severity')}**",
             f"fires after `for: {rule['for']}`" if "for" in rule else "fires at once"]
    if mirrors:
        facts.append("reads the daemon's " + ", ".join(f"[`{name}`](#{name})" for name in mirrors))
    if held:
        facts.append("held while its daemon does not answer")
    summary, _ = _describe(rule.get("annotations", {}).get("summary", ""))
    meaning, fix = _describe(rule.get("annotations", {}).get("description", ""))
    lines = [f"### `{rule['alert']}`", "", " · ".join(facts) + ".", "", f"*{summary}*", ""]
    if meaning:
        lines += [meaning, ""]
    if comment:
        lines += [f"*From the rule file:* {comment}", ""]
    if fix:
        lines += [f"- **Fix:** {fix}", ""]
    lines += [f"Expression (`{path.relative_to(root)}`):", "", "```promql", re.sub(r" (unless|or) ", r"\n\1 ", expr),
              "```", ""]
    return lines


def _prometheus_section(root: Path, daemon_names: set[str]) -> list[str]:
    lines, records = [], []
    for path, group, comments in prometheus_groups(root):
        alerts = [rule for rule in group["rules"] if "alert" in rule]
        records += [(path, rule, comments.get(rule["record"], "")) for rule in group["rules"] if "record" in rule]
        if not alerts:
            continue
        lines += [f"## {GROUP_TITLES.get(group['name'], group['name'])}", "",
                  f"The group `{group['name']}` of `{path.relative_to(root)}`."
                  + (f" {comments[group['name']]}" if comments.get(group["name"]) else ""), ""]
        for rule in alerts:
            mirrors = [name for name in re.findall(r'alert\s*=~?\s*"([^"]+)"', _first_term(rule["expr"]))
                       for name in name.split("|") if name in daemon_names]
            lines += _prometheus_alert(rule, comments.get(rule["alert"], ""), path, root, list(dict.fromkeys(mirrors)))
    if records:
        lines += ["## Prometheus recording rules", "",
                  "Series the alerts and the dashboards read, computed by Prometheus:", ""]
        for path, rule, comment in records:
            lines += [f"- **`{rule['record']}`** = `{_words(rule['expr'])}`" + (f"  \n  {comment}" if comment else "")]
        lines.append("")
    return lines


# -- Alertmanager ------------------------------------------------------------------------------------------------

def _matchers(matchers: list[str], prometheus_names: set[str]) -> str:
    """alertname="A" or alertname=~"A|B" as links to the alerts; any other matcher as it is."""
    said = []
    for matcher in matchers:
        match = re.fullmatch(r'alertname=~?"?([\w|]+)"?', matcher)
        if match and all(name in prometheus_names for name in match[1].split("|")):
            said.append(" or ".join(f"[`{name}`](#{name.lower()})" for name in match[1].split("|")))
        else:
            said.append(f"`{matcher}`")
    return " and ".join(said)


def _alertmanager_section(root: Path, prometheus_names: set[str]) -> list[str]:
    lines = []
    for path in sorted(root.glob(ALERTMANAGER_FILES)):
        text = path.read_text()
        inhibitions = yaml.safe_load(text).get("inhibit_rules") or []
        if not inhibitions:
            continue
        block = text.split("inhibit_rules:", 1)[1].splitlines()
        notes = [_words(" ".join(line.strip().lstrip("#") for line in comment)) for comment in _entry_comments(block)]
        lines += ["## Alertmanager: which alert mutes which", "",
                  f"The inhibitions of the example `{path.relative_to(root)}`: while a source alert fires, the "
                  "target alerts that share its labels listed under \"equal\" send no notification (one cause, one "
                  "notification).", ""]
        for i, rule in enumerate(inhibitions):
            note = notes[i] if i < len(notes) else ""
            lines += [f"- **While** {_matchers(rule.get('source_matchers', []), prometheus_names)} fires, "
                      f"**mute** {_matchers(rule.get('target_matchers', []), prometheus_names)} with the same "
                      + ", ".join(f"`{label}`" for label in rule.get("equal", [])) + "."
                      + (f"  \n  {note}" if note else "")]
        lines.append("")
    return lines


def _entry_comments(block: list[str]) -> list[list[str]]:
    """The comment lines above each entry of the inhibit_rules list (its lines until the next top-level key)."""
    out, comment = [], []
    for line in block:
        if line and not line[0].isspace() and not line.startswith("#"):
            break
        if line.strip().startswith("#"):
            comment.append(line)
        elif line.strip().startswith("- source_matchers"):
            out.append(comment)
            comment = []
    return out


# -- the page ----------------------------------------------------------------------------------------------------

def render(root: Path) -> str:
    root = Path(root)
    twins = daemon_twins(root)
    daemon_names = {rule.name for _, rules in daemon_rules() for rule in rules}
    prometheus_names = {rule["alert"] for _, group, _ in prometheus_groups(root) for rule in group["rules"]
                        if "alert" in rule}
    lines = ["# Alerts reference", "",
             "<!-- Generated by docs/gen/alerts_ref.py from the code and etc/; do not edit by hand. -->", "",
             "Every alert gpuwarden raises or ships: [the daemon's own](#the-daemons-alerts), logged to the journal "
             "and exported on `/metrics`, grouped by the signal that declares it; the Prometheus rules of "
             "`etc/prometheus/` ([per host](#prometheus-per-host-the-gpus), and [across the fleet]"
             "(#prometheus-the-fleet-across-the-hosts)); and the [Alertmanager inhibitions]"
             "(#alertmanager-which-alert-mutes-which). How alerts behave and how to read their lines: "
             "[Alerts](../alerts.md); setting up Prometheus and Alertmanager: [The fleet](../fleet.md).", "",
             "In the Prometheus sections, `{gpu}`, `{instance}` and the like stand for an alert's labels, `{value}` "
             "for its value, and a query in backticks for the number the annotation reads. Every per-host alert's "
             "expression ends with a hold, left out below: `unless on (job, instance) up == 0 or max without "
             "(alertstate) (ALERTS{alertname=\"<its name>\", alertstate=\"firing\"}) and on (job, instance) up == "
             "0` ([the first Prometheus section](#prometheus-per-host-the-gpus) says why).", ""]
    lines += _daemon_section(alert_keys(), twins)
    lines += _prometheus_section(root, daemon_names)
    lines += _alertmanager_section(root, prometheus_names)
    return "\n".join(lines)


def write(root: Path) -> Path:
    path = Path(root) / PAGE
    path.write_text(render(root))
    return path


if __name__ == "__main__":
    root = Path(__file__).resolve().parents[2]
    sys.path.insert(0, str(root / "daemon"))
    print(write(root))
