"""Lint rules as data: serving/lint/rules/builtin.yaml, then /etc/gpuwarden/rules.d/*.yaml adding rules or
overriding them by id (a key given replaces the built-in's; `severity: off` turns one off).

A rule says when it can apply (compute capability and the installed vLLM, FlashInfer, torch or SGLang,
as PEP 440 specifiers; a VLLM_* variable the installed vLLM still reads) and what it matches in the
command (flags present or absent, flag values, variables set or not, the command, the model name, the
tensor-parallel size, the GPU count) and in the facts of serving/lint/facts.py (`values`: a JSON flag's
fields, numbers compared, the model's config.json, the host's driver, nodes and GPU memory; a product of
numeric facts, `--speculative-config.num_speculative_tokens * --max-num-seqs: ">=64"`, and a comparison with
another fact, `--max-model-len: ">model.sliding_window"`, each checked when the rules are loaded). Rules that
cannot be said as data name a `check:` instead, a function the engine module (or serving/lint/checks.py)
registers; they keep every other field. Each evaluation says, per rule, whether it applied (and the facts it
matched on), was skipped and why, or matched nothing: `profiles show` prints it. An installed version that is unknown
(the probe could not run) never blocks: such a rule still applies, as a warning that says so. A fact that
cannot be read (a remote model's config.json, a driver with no GPU readable, a flag in a product that is
absent with no `defaults:` value) skips the rule, saying why; a finding says the values it compared.
"""

from __future__ import annotations

import functools
import math
import re
from itertools import combinations
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ...base import yamlfile
from ...base.schema import Reader, type_name
from ...base.yamlfile import ConfigError, ConfigErrors, InvalidConfig
from . import facts as F
from .flags import flag_value, has_flag
from .packages import PACKAGES, Installed
from .findings import ERROR, WARNING, LintFinding, read_specifier, version_in
from .model import ModelFacts, not_read
from .flags import SECRET_FLAGS, is_secret, is_secret_flag

BUILTIN = Path(__file__).resolve().parent / "rules" / "builtin.yaml"
OFF = "off"
SEVERITIES = (ERROR, WARNING, OFF)
ENGINES_ANY = "any"
RULE_KEYS = ("id", "severity", "engine", "message", "fix", "source", "link", "traps", "when", "match", "check",
             "examples")
WHEN_KEYS = ("compute_capability", *PACKAGES, "reads_env")
MATCH_KEYS = ("flags_present", "flags_absent", "flag_values", "flag_not", "env_set", "env_not", "command",
              "model", "tp_size", "gpu_count", "values", "values_not", "defaults")
UNREAD = not_read("", "not read")
NEW_RULE_NEEDS = ("severity", "message", "fix", "source")


@dataclass(frozen=True)
class Composed:
    """A command line as a profile composed it: argv (the command, then the engine's flags) and the environment.
    The final command (command.ServeCommand) and what a lint rule looks at (rules.LintContext) are each one."""

    argv: tuple[str, ...]
    env: Mapping[str, str]
    profile: Any  # compose/profiles.Profile: the lint reads its name, notes and versions, and imports no composer


@dataclass(frozen=True)
class LintContext(Composed):
    """What a rule looks at: the final command and environment, and where it will run."""

    compute_capabilities: tuple[str, ...]
    model: str
    engine: Any  # engines.Engine (not imported: engines import this module)
    installed: Installed
    prefix: int = 0  # argv[:prefix] is the command itself, before the engine's flags
    driver: str | None = None  # the host's driver, and the CUDA NVML says it runs (facts.driver_cuda)
    nvml_cuda: str | None = None
    unified: bool = False  # the GPUs share the system's memory (DGX Spark)
    model_facts: ModelFacts = UNREAD  # the local model directory's config.json and headers
    iommu: str | None = None  # the host's IOMMU as the GPU backend read it (None: not known, read the host's)
    peer_paths: tuple[tuple[int, int, str], ...] = ()  # (gpu, gpu, gpu.base.PEER_PATHS key or "unknown")
    gpu_memory: int | None = None  # bytes of the smallest GPU's memory (the system's where unified)

    @property
    def flags(self) -> tuple[str, ...]:
        """The engine's arguments, after the command (as ServeCommand.flags)."""
        return self.argv[self.prefix:]

    @classmethod
    def of(cls, command, model: str, installed: Installed, model_facts: ModelFacts = UNREAD) -> LintContext:
        """The context of a serving.command.ServeCommand (duck-typed: that module imports the engines,
        which import this one)."""
        gpus = command.gpus
        pairs = tuple((a.index, b.index, a.peer_paths.get(b.index, "unknown")) for a, b in combinations(gpus, 2))
        return cls(command.argv, command.env, command.profile,
                   tuple(g.compute_capability or "" for g in gpus), model, command.engine, installed,
                   command.prefix, next((g.driver_version for g in gpus if g.driver_version), None),
                   next((g.cuda_driver_version for g in gpus if g.cuda_driver_version), None),
                   any(g.memory_unified for g in gpus), model_facts,
                   next((g.iommu for g in gpus if g.iommu), None), pairs,
                   min((g.memory_total_bytes for g in gpus if g.memory_total_bytes), default=None))

    @property
    def tp_size(self) -> int:
        return self.engine.tensor_parallel_size(self.argv)

    @property
    def gpu_count(self) -> int:
        return len(self.compute_capabilities)

    def fact(self, name: str) -> tuple[Any, str]:
        """(value, how it reads in a finding) of a fact of serving/lint/facts.py; facts.Unknown says why not."""
        kind, _, key = name.partition(".")
        if name.startswith("-"):
            value = F.flag_fact(self.flags, name)
            return value, _flag_text(name, None if value is None else F.show(value))
        if kind == "model":
            mf = self.model_facts
            if not mf.known:
                raise F.Unknown(f"the model's config.json: {mf.why}")
            value = getattr(mf, key)
            if key == "params_b" and value is not None:
                return value, f"{value:.1f}B parameters ({mf.params_note})"
            if key == "params_b":
                raise F.Unknown(f"the parameter count: {mf.params_note}")
            return value, f"config.json {key} {F.show(value) if value is not None else 'not set'}"
        if kind == "host":
            return self._host(key)
        if not self.installed.known:
            raise F.Unknown(f"the engine's {key}: {self.installed.error}")
        if key == "torch_cuda":
            value = F.cuda_of_torch(self.installed.version("torch"), self.installed.torch_cuda)
            return value, f"torch {self.installed.version('torch')} is built for CUDA {value or 'none'}"
        toolkit = self.installed.toolkit
        return (toolkit[0] if toolkit else None), (f"CUDA toolkit {toolkit[0]} ({toolkit[1]})" if toolkit
                                                   else "no CUDA toolkit in the engine's environment")

    def _host(self, key: str) -> tuple[Any, str]:
        if key == "gpus":
            return self.gpu_count, f"{self.gpu_count} GPU(s) here"
        if key == "unified":
            return self.unified, "memory shared with the system" if self.unified else "discrete GPU memory"
        if key == "nodes":
            count, why = F.nodes(self.flags, self.tp_size, self.gpu_count)
            return count, f"{count} node(s): {why}"
        if key == "gpu_memory_gib":
            if self.gpu_memory is None:
                raise F.Unknown("the GPUs' memory (no GPU readable here)")
            gib = round(self.gpu_memory / 2**30, 1)
            return gib, f"{gib:g} GiB on the smallest GPU{' (the system memory it shares)' if self.unified else ''}"
        if self.driver is None:
            raise F.Unknown("the driver version (no GPU readable here)")
        if key == "driver":
            return self.driver, f"driver {self.driver}"
        cuda, how = F.driver_cuda(self.driver, self.nvml_cuda)
        if cuda is None:
            raise F.Unknown(f"the CUDA version driver {self.driver} runs: {how}")
        return cuda, f"driver {self.driver} supports CUDA {cuda}"


Check = Callable[[LintContext], "Mapping[str, Any] | None"]  # values for the message, or None: no finding


@dataclass(frozen=True)
class Rule:
    id: str
    severity: str
    engine: str
    message: str
    fix: str
    source: str
    where: str  # FILE:LINE of the entry that last set it
    when: Mapping[str, Any] = field(default_factory=dict)
    match: Mapping[str, Any] = field(default_factory=dict)
    check: str | None = None
    examples: tuple = ()  # test cases from the source: tests/test_rules.py runs each one
    link: str = ""  # where the source can be read
    traps: tuple[str, ...] = ()  # the community registry's trap ids it names (model-serving-minefield)

    def as_dict(self) -> dict:
        return {"id": self.id, "severity": self.severity, "engine": self.engine, "message": self.message,
                "fix": self.fix, "source": self.source, "link": self.link, "traps": list(self.traps),
                "where": self.where, "check": self.check, "when": {k: str(v) for k, v in self.when.items()}}


@dataclass(frozen=True)
class Rules:
    rules: tuple[Rule, ...]
    written_against: Mapping[str, str]  # the newest release of each package the built-in rules were written for

    def for_engine(self, engine: str) -> list[Rule]:
        return [r for r in self.rules if r.engine in (engine, ENGINES_ANY)]


@dataclass(frozen=True)
class Outcome:
    rule: Rule
    status: str  # "applied", "skipped" or "clear" (could apply, matched nothing)
    reason: str = ""
    finding: LintFinding | None = None
    unknown: str = ""  # skipped for want of this fact (facts.Unknown's words): lint.unknown_facts makes it a finding

    def line(self) -> str:
        if self.status == "applied":
            return f"{self.rule.id}: applied ({self.finding.severity}){self.reason and ', ' + self.reason}"
        return f"{self.rule.id}: {self.status}, {self.reason}" if self.reason else f"{self.rule.id}: {self.status}"


# -- loading -----------------------------------------------------------------------------------------------

def load_rules(user_dir: Path | None, checks: Mapping[str, set[str]]) -> Rules:
    """The built-in rules, then rules.d's by file name. checks: engine -> the check names it registers (and
    "any" -> the shared ones). Raises ConfigErrors (FILE:LINE) for every problem in every file."""
    budget = yamlfile.DirBudget(user_dir, "rules.d") if user_dir is not None and user_dir.is_dir() else None
    files = [BUILTIN] + (budget.files() if budget is not None else [])
    merged: dict[str, dict] = {}
    written_against: dict[str, str] = {}
    problems: list[ConfigError] = []
    for file in files:
        try:
            entries, against = _builtin() if file == BUILTIN else _read_file(file, budget)
        except InvalidConfig as exc:
            problems.extend(exc.errors)
            continue
        if file == BUILTIN:
            written_against = against
        for entry, error in entries:
            known = merged.get(entry["id"])
            if known is None:
                missing = [k for k in NEW_RULE_NEEDS if k not in entry]
                if missing:
                    problems.append(error(f"a new rule needs {', '.join(missing)} (no built-in or earlier rule "
                                          f"has id {entry['id']!r} to override)"))
                    continue
                known = {"engine": "vllm", "when": {}, "match": {}, "check": None, "examples": (), "link": "",
                         "traps": ()}
            merged[entry["id"]] = {**known, **entry}
            engine, check = merged[entry["id"]]["engine"], merged[entry["id"]]["check"]
            if engine not in checks:
                problems.append(error(f"engine {engine!r} is not installed (known: {', '.join(sorted(checks))})"))
                continue
            allowed = checks[engine] | checks.get(ENGINES_ANY, set())
            if check is not None and check not in allowed:
                problems.append(error(f"check {check!r} is not a check of engine {engine} (known: "
                                      f"{', '.join(sorted(allowed))})"))
    if problems:
        raise ConfigErrors(problems)
    return Rules(tuple(Rule(**entry) for entry in merged.values()), written_against)


@functools.cache
def _builtin() -> tuple[list, dict[str, str]]:
    """The shipped file, read once per process (entries are copied, never changed, when merged)."""
    return _read_file(BUILTIN)


def _read_file(file: Path, budget: yamlfile.DirBudget | None = None) -> tuple[list, dict[str, str]]:
    doc = budget.load(file) if budget is not None else yamlfile.load(file)
    if not isinstance(doc.value, dict):
        raise ConfigError(doc.file, 1, "(top level)", f"expected a mapping with rules:, got {type_name(doc.value)}")
    r = Reader(doc)
    r.mapping((), ("rules", "written_against") if file == BUILTIN else ("rules",))
    against = {k: str(v) for k, v in r.mapping(("written_against",), PACKAGES).items()}
    entries, seen = [], set()
    for i, _ in enumerate(r.sequence(("rules",))):
        path = ("rules", str(i))
        raw = r.mapping(path, RULE_KEYS, required=("id",))
        rule_id = r.string(path + ("id",), "")
        if not isinstance(rule_id, str) or not re.fullmatch(r"[a-z0-9][a-z0-9-]*", rule_id or ""):
            r.fail(path + ("id",), f"expected an id of lower-case letters, digits and -, got {rule_id!r}")
            continue
        if rule_id in seen:
            r.fail(path + ("id",), f"rule {rule_id} is given twice in this file")
            continue
        seen.add(rule_id)
        file_name, line = doc.locate(path)
        entry: dict[str, Any] = {"id": rule_id, "where": f"{file_name}:{line}"}
        for key in ("message", "fix", "source", "engine", "check", "link"):
            if key in raw:
                value = r.get(path + (key,))
                if not isinstance(value, str) or not value.strip():
                    r.fail(path + (key,), f"expected a non-empty string, got {type_name(value)}")
                elif key in ("message", "fix") and template_problem(value):
                    r.fail(path + (key,), template_problem(value))
                entry[key] = str(value).strip()
        if "severity" in raw:
            if r.get(path + ("severity",)) is False:  # YAML reads a bare `off` as false
                entry["severity"] = OFF
            else:
                entry["severity"] = r.string(path + ("severity",), ERROR, SEVERITIES)
        if "traps" in raw:
            items = r.sequence(path + ("traps",))
            if not all(isinstance(x, (str, int)) and re.fullmatch(r"[0-9]{1,4}", str(x)) for x in items):
                r.fail(path + ("traps",), "expected a list of the registry's trap ids, e.g. ['08', '122']")
            entry["traps"] = tuple(str(x).zfill(2) for x in items)
        if "when" in raw:
            entry["when"] = _when(r, path + ("when",))
        if "match" in raw:
            entry["match"] = _match(r, path + ("match",))
        if "examples" in raw:
            entry["examples"] = tuple(r.sequence(path + ("examples",)))
        entries.append((entry, lambda message, p=path: doc.error(p + ("id",), message)))
    r.raise_if_errors()
    return entries, against


def _when(r: Reader, path: tuple[str, ...]) -> dict:
    out = {}
    for key in r.mapping(path, WHEN_KEYS):
        if key == "reads_env":
            out[key] = r.string(path + (key,), "")
        else:
            spec = read_specifier(r, path + (key,))
            if spec is not None:
                out[key] = spec
    return out


def _pattern(r: Reader, path: tuple[str, ...]) -> re.Pattern | None:
    value = r.get(path)
    try:
        return re.compile(str(value))
    except (re.error, OverflowError, RecursionError) as exc:  # a{4294967295}, 1,000 nested groups
        r.fail(path, f"{value!r} is not a regular expression: {exc}")
        return None


def _match(r: Reader, path: tuple[str, ...]) -> dict:
    out: dict[str, Any] = {}
    for key in r.mapping(path, MATCH_KEYS):
        where = path + (key,)
        if key in ("flags_present", "flags_absent"):
            items = r.sequence(where)
            if not all(isinstance(x, str) and x.startswith("-") for x in items):
                r.fail(where, "expected a list of flags, e.g. [--enforce-eager]")
            out[key] = tuple(str(x) for x in items)
        elif key in ("flag_values", "flag_not", "env_set", "env_not"):
            out[key] = tuple((name, _pattern(r, where + (name,))) for name in r.mapping(where, None))
        elif key in ("command", "model"):
            out[key] = _pattern(r, where)
        elif key in ("values", "values_not"):
            out[key] = tuple(_value(r, where + (name,), name) for name in r.mapping(where, None))
        elif key == "defaults":
            out[key] = {name: r.get(where + (name,)) for name in r.mapping(where, None)
                        if _fact_name(r, where + (name,), name)}
        else:  # tp_size, gpu_count: [MIN, MAX]
            value = r.get(where)
            if not (isinstance(value, list) and len(value) == 2 and all(isinstance(v, int) for v in value)
                    and 0 < value[0] <= value[1]):
                r.fail(where, f"expected [MIN, MAX], got {value!r}", "e.g. [2, 64]")
                continue
            out[key] = (value[0], value[1])
    _numeric_defaults(r, path, out)
    return out


def _numeric_defaults(r: Reader, path: tuple[str, ...], match: Mapping[str, Any]) -> None:
    """A default a product or a fact comparison multiplies or compares must be a number."""
    used = set()
    for key in ("values", "values_not"):
        for name, cond in match.get(key, ()):
            products = (*cond.products, name) if cond is not None else (name,)
            used.update(n for p in products if isinstance(p, F.Product) for n in p.names)
            if cond is not None and cond.products:
                used.add(name)
    for name, value in match.get("defaults", {}).items():
        if name in used and F.operand(value) is None:
            r.fail(path + ("defaults", name), f"{name} is multiplied or compared with a fact: its default must be "
                   f"a number, got {value!r}")


def _fact_name(r: Reader, path: tuple[str, ...], name: str) -> bool:
    """Whether name is a fact serving/lint/facts.py knows; a FILE:LINE error when not."""
    problem = F.fact_problem(name)
    if problem:
        r.fail(path, problem, F.FACT_HINT)
    return problem is None


def _value(r: Reader, path: tuple[str, ...], name: str) -> tuple[str | F.Product, F.Condition | None]:
    """(the fact, or product of facts, that a values: key names; its condition), None where either is wrong
    (a FILE:LINE error says why)."""
    if "*" not in name:
        cond = _condition(r, path) if _fact_name(r, path, name) else None
        problem = F.number_problem(name) if cond is not None and cond.products else None
        if problem:
            r.fail(path, f"{name} is compared with a fact: {problem}")
        return name, cond
    try:
        product = F.product(name)
    except ValueError as exc:
        r.fail(path, str(exc), F.FACT_HINT if isinstance(exc, F.NotAFact) else None)
        return name, None
    if not product.names:
        r.fail(path, f"{name!r} multiplies no fact: write the number")
        return name, None
    cond = _condition(r, path)
    if cond is not None and cond.kind != "compare":
        r.fail(path, f"{name!r} is a number: compare it (e.g. '>=64'), not {type_name(r.get(path))}")
        return name, None
    return product, cond


def _condition(r: Reader, path: tuple[str, ...]) -> F.Condition | None:
    value = r.get(path)
    if isinstance(value, (list, dict)):
        r.fail(path, f"expected a regular expression, a comparison, true/false or null, got {type_name(value)}")
        return None
    try:
        return F.condition(value)
    except ValueError as exc:
        r.fail(path, str(exc), F.FACT_HINT if isinstance(exc, F.NotAFact) else None)
        return None


# -- evaluating --------------------------------------------------------------------------------------------

def evaluate(rules: Sequence[Rule], ctx: LintContext, checks: Mapping[str, Check]) -> list[Outcome]:
    return [_evaluate(rule, ctx, checks) for rule in rules]


def _evaluate(rule: Rule, ctx: LintContext, checks: Mapping[str, Check]) -> Outcome:
    if rule.severity == OFF:
        return Outcome(rule, "skipped", f"turned off ({rule.where})")
    skip, unknown, seen = _when_fails(rule.when, ctx)
    if skip:
        return Outcome(rule, "skipped", skip)
    try:
        matched = _matches(rule.match, ctx)
        values: Mapping[str, Any] | None = checks[rule.check](ctx) if matched is not None and rule.check else {}
    except F.Unknown as exc:
        return Outcome(rule, "skipped", f"needs {exc}", unknown=str(exc))
    except (ValueError, ArithmeticError) as exc:
        # A check reading serve.args' value its own way (int() of --max-num-seqs '9' * 5000 raises past 4,300
        # digits) skips, saying so: the lint runs on the daemon's start, which an odd flag must not stop with a
        # traceback; the engine's own parser is the one that refuses the value.
        return Outcome(rule, "skipped", f"needs values it can read: {str(exc)[:120]}")
    if matched is None or values is None:
        return Outcome(rule, "clear", "")
    severity, note = rule.severity, ""
    if unknown:
        note = f"{' and '.join(unknown)} unknown"
        severity = WARNING  # a guess never blocks a start
    values = dict(values)
    matched_on = tuple(dict.fromkeys([*seen, *matched, *values.pop("facts", ())]))  # in order, once each
    message, fix = render(rule.message, values), render(rule.fix, values)
    if note:
        message += f" (if it applies: {note})"
    return Outcome(rule, "applied", note, LintFinding(severity, rule.id, message, rule.source, fix, rule.link,
                                                      matched_on, rule.traps))


# A rule's message and fix name a check's values as {name}; {{ and }} are braces. Nothing else: rules.d is
# written by people, and str.format would follow {x.__class__}, expand {x:>99999999} into memory, and
# raise on a lone brace at lint time, in the daemon.
TEMPLATE_PART = re.compile(r"\{\{|\}\}|\{([A-Za-z_][A-Za-z0-9_]*)\}|[{}]")


def template_problem(text: str) -> str | None:
    """Why text is not a template the lint can render, or None."""
    for part in TEMPLATE_PART.finditer(text):
        if part.group(0) in ("{", "}"):
            near = text[max(0, part.start() - 10):part.start() + 11]
            return (f"a lone '{part.group(0)}' at character {part.start() + 1} (near {near!r}): write {{name}} for "
                    f"a check's value (no format spec, conversion, index or attribute), or {{{{ }}}} for a brace")
    return None


def render(text: str, values: Mapping[str, Any]) -> str:
    """text with each {name} replaced by its value (left as it is when the check gave none)."""
    def one(part: re.Match) -> str:
        name = part.group(1)
        if name is None:
            return part.group(0)[0]  # {{ or }}
        return str(values[name]) if name in values else part.group(0)
    return TEMPLATE_PART.sub(one, text)


def _when_fails(when: Mapping[str, Any], ctx: LintContext) -> tuple[str | None, list[str], list[str]]:
    """(why the rule cannot apply here, or None; what it depends on that is unknown; the facts it holds on)."""
    unknown: list[str] = []
    seen: list[str] = []
    spec = when.get("compute_capability")
    if spec is not None:
        ccs = [cc for cc in ctx.compute_capabilities if cc]
        if not ccs:
            unknown.append("compute capability")
        elif not any(version_in(spec, cc) for cc in ccs):
            return f"compute capability {', '.join(sorted(set(ccs)))} is outside {spec}", [], []
        else:
            seen.append(f"compute capability {', '.join(sorted(set(ccs)))}")
    for module, title in PACKAGES.items():
        spec = when.get(module)
        if spec is None:
            continue
        if not ctx.installed.known:
            unknown.append(f"{title} version")
            continue
        version = ctx.installed.version(module)
        if version is None and module == ctx.engine.name:
            # The engine itself missing from the interpreter found means the probe looked in the wrong place
            # (a container, a wrapper script): its version is unknown, not absent.
            unknown.append(f"{title} version (not in {ctx.installed.python})")
            continue
        if version is None:
            return f"{title} is not installed", [], []
        if not version_in(spec, version):
            return f"{title} {version} is outside {spec}", [], []
        seen.append(f"{title} {version}")
    name = when.get("reads_env")
    if name:
        if ctx.installed.env_names is None:
            unknown.append(f"whether vLLM reads {name}")
        elif name not in ctx.installed.env_names:
            return f"vLLM {ctx.installed.version('vllm')} does not read {name}", [], []
        else:
            seen.append(f"vLLM reads {name}")
    return None, unknown, seen


def _env_text(name: str, env: Mapping[str, str]) -> str:
    if name not in env:
        return f"{name} not set"
    return f"{name} set" if is_secret(name) else f"{name}={env[name]}"


def _flag_text(flag: str, value: str | None) -> str:
    if value is None:
        return f"{flag} not given"
    return f"{flag} set" if is_secret_flag(flag) else f"{flag} {value}"


def _secret_present(flags: Sequence[str], flag: str) -> bool:
    """A secret flag in any spelling its parser takes, a prefix included, but never another flag of its own that is
    a prefix of it (--ssl-keyfile, a path, before --ssl-keyfile-password): flags.is_secret_flag's reading."""
    return any(is_secret_flag(word) and has_flag([word], flag, prefix=True) for word in flags)


def _matches(match: Mapping[str, Any], ctx: LintContext) -> list[str] | None:
    """The facts the match holds on, in words; None when it does not hold. facts.Unknown: a fact it needs
    cannot be read here."""
    flags, seen = ctx.flags, []
    # A secret flag is present in any spelling its parser takes, prefixes included (serving/lint/flags.py).
    if not all(_secret_present(flags, f) if f in SECRET_FLAGS else has_flag(flags, f)
               for f in match.get("flags_present", ())):
        return None
    seen += match.get("flags_present", ())
    if any(has_flag(flags, f) for f in match.get("flags_absent", ())):
        return None
    seen += [f"no {f}" for f in match.get("flags_absent", ())]
    for flag, pattern in match.get("flag_values", ()):
        value = flag_value(flags, flag)
        if value is None or not pattern.fullmatch(value):
            return None
        seen.append(_flag_text(flag, value))
    for flag, pattern in match.get("flag_not", ()):
        value = flag_value(flags, flag)
        if value is not None and pattern.fullmatch(value):
            return None
        seen.append(_flag_text(flag, value))
    for name, pattern in match.get("env_set", ()):
        if name not in ctx.env or not pattern.fullmatch(ctx.env[name]):
            return None
        seen.append(_env_text(name, ctx.env))
    for name, pattern in match.get("env_not", ()):
        if name in ctx.env and pattern.fullmatch(ctx.env[name]):
            return None
        seen.append(_env_text(name, ctx.env))
    command = match.get("command")
    if command is not None and not command.search(" ".join(ctx.argv[:ctx.prefix])):
        return None
    if command is not None:
        seen.append(f"command {' '.join(ctx.argv[:ctx.prefix])}")
    model = match.get("model")
    if model is not None and not model.search(ctx.model):
        return None
    if model is not None:
        seen.append(f"model {ctx.model}")
    for key, value, words in (("tp_size", ctx.tp_size, "tensor parallel"), ("gpu_count", ctx.gpu_count, "GPUs")):
        bounds = match.get(key)
        if bounds is not None and not bounds[0] <= value <= bounds[1]:
            return None
        if bounds is not None:
            seen.append(f"{words} {value}")
    defaults = match.get("defaults", {})
    for key, wanted in (("values", True), ("values_not", False)):
        for name, cond in match.get(key, ()):
            if isinstance(name, F.Product) or cond.products:
                value, text = _number(name, ctx, defaults)
            else:
                value, text = _fact(name, ctx, defaults)
            limits: dict[F.Product, float] = {}
            for op, limit in cond.bounds:
                if isinstance(limit, F.Product):
                    limits[limit], right = _number(limit, ctx, defaults)
                    text += f"{'' if wanted else ' not'} {op} {right}"
            if cond.holds(value, limits) is not wanted:
                return None
            seen.append(text)
    return seen


def _fact(name: str, ctx: LintContext, defaults: Mapping[str, Any]) -> tuple[Any, str]:
    """(value, how it reads) of a fact, the rule's default where the launch does not give it."""
    value, text = ctx.fact(name)
    if value is None and name in defaults:
        value = defaults[name]
        text = f"{name} {F.show(value)} ({ctx.engine.title}'s default)"
    return value, text


def _number(term: str | F.Product, ctx: LintContext, defaults: Mapping[str, Any]) -> tuple[float, str]:
    """(value, how it reads: "A 4 x B 256 (vLLM's default) = 1024") of a numeric fact or a product of them;
    facts.Unknown when a factor is absent with no default, unreadable or not a number."""
    factors = term.factors if isinstance(term, F.Product) else (term,)
    total, texts = 1.0, []
    for factor in factors:
        if not isinstance(factor, str):
            total, texts = total * factor, texts + [F.show(factor)]
            continue
        value, text = _fact(factor, ctx, defaults)
        if value is None:
            raise F.Unknown(f"{factor}, which is not given and has no default in the rule" if factor.startswith("-")
                            else f"{factor}, which the model's config.json does not set")
        number = F.operand(value)
        if number is None:
            raise F.Unknown(f"{factor} as a number: {text}")
        total, texts = total * number, texts + [text]
    if math.isnan(total):  # an infinite factor ('9' * 400 reads as one) times 0
        raise F.Unknown(f"a number for {' x '.join(texts)}")
    if len(factors) == 1:
        return total, texts[0]
    return total, f"{' x '.join(texts)} = {F.show(round(total, 3))}"

