"""What a lint rule can know beyond the argv's words, and how a rule compares it.

A fact has a name:
- a flag, `--max-num-seqs`, or a field of a JSON-valued flag, `--speculative-config.method` or
  `--compilation-config.pass_config.fuse_gemm_comms` (vLLM also takes the dotted spelling on its command line,
  `--speculative-config.method=mtp`, which wins over the JSON as it does in vLLM);
- `model.NAME`: a field of serving/lint/model.ModelFacts, read from a local model's config.json;
- `host.NAME`: gpus (on this host), unified (memory the GPU shares with the system), nodes (the parallel group
  spans several hosts: --nnodes, --data-parallel-size beyond --data-parallel-size-local, a tensor x pipeline
  group larger than this host's GPUs), driver, driver_cuda (the newest CUDA the driver runs), gpu_memory_gib
  (the smallest GPU's total memory);
- `engine.NAME`: torch_cuda (the CUDA torch was built for), cuda_toolkit (a toolkit in the engine's
  environment).
A condition on a fact is a regular expression (matched whole; a list fact matches when one item does), a
comparison (">4", ">=0.85,<1"), a boolean, or null (absent). A text that starts with <, >, = or ! is a
comparison, never a regular expression, so a mistyped one is refused when the rules are loaded.
Arithmetic, bounded (MAX_FACTORS, MAX_EXPRESSION): where a rule names a fact it may name a product of numeric
facts and numbers, `--speculative-config.num_speculative_tokens * --max-num-seqs`, and a comparison's right
side may be one, `>=0.9*model.max_position_embeddings`. A fact that cannot be known (a remote model's config,
a host without a readable driver, a flag absent with no default in the rule) makes the rule skip, with the
reason: serving/lint/rules.py.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .flags import canonical, flag_value
from .model import ModelFacts

MAX_FLAG_JSON = 64 * 1024  # a JSON-valued flag is a few hundred bytes; anything larger is not looked into
MAX_FLAG_DEPTH = 16
COMPARISON = re.compile(r"\s*(<=|>=|==|!=|<|>)(.*)", re.DOTALL)
# ASCII digits only: \d would read '١٢' as 12 where the docs promise -?[0-9]+(.[0-9]+)?
NUMBER = re.compile(r"-?\d+(?:\.\d+)?", re.ASCII)
FLAG_NAME = re.compile(r"--?[A-Za-z0-9][A-Za-z0-9_-]*(\.[A-Za-z0-9_]+)*")
FACT_WORD = re.compile(rf"{FLAG_NAME.pattern}|[a-z]+\.[A-Za-z0-9_]+")
MAX_FACTORS = 4  # K x seqs needs two; a rule wanting more than four is better a check: in Python
MAX_EXPRESSION = 200  # characters of one product or comparison
# A list fact (model.quant_ignore: thousands of module names, read from another user's config.json) is matched
# item by item; the whole list as JSON (how lists matched before) only up to MAX_LIST_JSON characters: a
# pattern like '.*a.*b.*' takes time growing with the square of the text, 25 s on a 1 MB list (model.py bounds
# each item to MAX_NAME characters).
MAX_LIST_JSON = 4096
HOST_FACTS = ("gpus", "unified", "nodes", "driver", "driver_cuda", "gpu_memory_gib")
HOST_NUMBERS = ("gpus", "nodes", "gpu_memory_gib")
ENGINE_FACTS = ("torch_cuda", "cuda_toolkit")
MODEL_FACTS = tuple(f for f in ModelFacts.__dataclass_fields__ if f not in ("path", "known", "why", "stamp"))
# ModelFacts' int and float fields (annotations are text under `from __future__ import annotations`)
MODEL_NUMBERS = tuple(f for f in MODEL_FACTS if str(ModelFacts.__dataclass_fields__[f].type).split(" |")[0]
                      in ("int", "float"))
FACT_HINT = (f"a flag (--max-num-seqs, --speculative-config.method), model.{{{','.join(MODEL_FACTS)}}}, "
             f"host.{{{','.join(HOST_FACTS)}}} or engine.{{{','.join(ENGINE_FACTS)}}}")
# The newest CUDA each driver branch runs (NVIDIA's CUDA toolkit release notes, table 3): used where NVML's
# nvmlSystemGetCudaDriverVersion_v2 is not at hand (the simulator, an old nvidia-ml-py).
DRIVER_CUDA = ((590, "13.1"), (580, "13.0"), (575, "12.9"), (570, "12.8"), (565, "12.7"),
               (560, "12.6"), (555, "12.5"), (550, "12.4"), (545, "12.3"), (535, "12.2"), (530, "12.1"),
               (525, "12.0"), (520, "11.8"))


class Unknown(Exception):
    """A fact this launch cannot know, and why."""


class NotAFact(ValueError):
    """A name in a rule that is no fact: the rules file's error adds FACT_HINT."""


@dataclass(frozen=True)
class Product:
    """Numbers and numeric facts multiplied: "--speculative-config.num_speculative_tokens * --max-num-seqs"."""

    factors: tuple[str | float, ...]

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(f for f in self.factors if isinstance(f, str))


@dataclass(frozen=True)
class Condition:
    """One compiled condition: kind "regex", "compare", "bool" or "absent". A comparison's limit is a number or
    a Product, whose value the caller reads (limits) with the launch's facts."""

    kind: str
    pattern: re.Pattern | None = None
    bounds: tuple[tuple[str, float | Product], ...] = ()
    flag: bool | None = None

    @property
    def products(self) -> tuple[Product, ...]:
        return tuple(limit for _, limit in self.bounds if isinstance(limit, Product))

    def holds(self, value: Any, limits: Mapping[Product, float] | None = None) -> bool:
        if self.kind == "absent":
            return value is None
        if value is None:
            return False
        if self.kind == "bool":
            return as_bool(value) is self.flag
        if self.kind == "compare":
            number = as_number(value)
            return number is not None and all(
                _compare(number, op, limits[limit] if isinstance(limit, Product) else limit)
                for op, limit in self.bounds)
        if isinstance(value, (list, tuple)):
            if any(self.pattern.fullmatch(show(item)) for item in value):
                return True  # model.architectures: "DeepseekV32.*" matches ["DeepseekV32ForCausalLM"]
            text = show(value)
            return len(text) <= MAX_LIST_JSON and bool(self.pattern.fullmatch(text))
        return bool(self.pattern.fullmatch(show(value)))


def condition(value: Any) -> Condition:
    """A condition from a rules file's value; ValueError says what is wrong with it."""
    if value is None:
        return Condition("absent")
    if isinstance(value, bool):
        return Condition("bool", flag=value)
    if isinstance(value, (int, float)):
        # YAML's .nan equals nothing, so a values_not: on it fired on every launch; .inf is no value a fact has
        if not math.isfinite(as_number(value) or math.nan):
            raise ValueError(f"{value!r} is no number a fact can equal: write a finite number")
        return Condition("compare", bounds=(("==", float(value)),))
    text = str(value)
    if text.lstrip()[:1] in ("<", ">", "=", "!"):
        return Condition("compare", bounds=_bounds(text))
    try:
        return Condition("regex", pattern=re.compile(text))
    except (re.error, OverflowError, RecursionError) as exc:  # a{4294967295}, 1,000 nested groups
        raise ValueError(f"{text!r} is neither a comparison (e.g. '>4', '>=2,<8') nor a regular expression: {exc}")


def _bounds(text: str) -> tuple[tuple[str, float | Product], ...]:
    if len(text) > MAX_EXPRESSION:
        raise ValueError(f"a comparison of {len(text)} characters: at most {MAX_EXPRESSION}")
    out: list[tuple[str, float | Product]] = []
    for part in text.split(","):
        match = COMPARISON.fullmatch(part)
        if match is None:
            raise ValueError(f"{text!r}: {part.strip()!r} is not a comparison (<, <=, >, >=, == or != and a number "
                             f"or a product of numeric facts, e.g. '>4', '>=0.9*model.max_position_embeddings')")
        right = match.group(2).strip()
        if NUMBER.fullmatch(right):
            out.append((match.group(1), float(right)))
            continue
        limit = product(right, text)
        out.append((match.group(1), limit if limit.names else math.prod(limit.factors)))
    return tuple(out)


def product(text: str, whole: str | None = None) -> Product:
    """The product text says ("A * B", "0.9*model.max_position_embeddings"); ValueError (NotAFact for a name
    that is no fact) says what is wrong, quoting whole (the comparison it is part of) where given."""
    where = repr(whole if whole is not None else text)
    if len(text) > MAX_EXPRESSION:
        raise ValueError(f"an expression of {len(text)} characters: at most {MAX_EXPRESSION}")
    parts = [part.strip() for part in text.split("*")]
    if len(parts) > MAX_FACTORS:
        raise ValueError(f"{where} multiplies {len(parts)} factors: at most {MAX_FACTORS}")
    factors: list[str | float] = []
    for part in parts:
        if NUMBER.fullmatch(part):
            factors.append(float(part))
        elif FACT_WORD.fullmatch(part):
            if fact_problem(part):
                raise NotAFact(f"{where}: {fact_problem(part)}")
            if number_problem(part):
                raise ValueError(f"{where}: {number_problem(part)}")
            factors.append(part)
        else:
            raise ValueError(f"{where}: {part!r} is neither a number nor a fact" if part else
                             f"{where} is missing a number or a fact{' beside a *' if len(parts) > 1 else ''}")
    return Product(tuple(factors))


def fact_problem(name: str) -> str | None:
    """Why name is no fact this module knows, or None."""
    kind, _, key = name.partition(".")
    if name.startswith("-") and FLAG_NAME.fullmatch(name):
        return None
    known = {"model": MODEL_FACTS, "host": HOST_FACTS, "engine": ENGINE_FACTS}.get(kind, ())
    return None if key in known else f"{name!r} is not a fact"


def number_problem(name: str) -> str | None:
    """Why name cannot be multiplied or compared with a fact (no fact, or not a number), or None. A flag's value
    is only known at lint time: a flag that is not a number then skips the rule."""
    problem = fact_problem(name)
    if problem or name.startswith("-"):
        return problem
    kind, _, key = name.partition(".")
    if (kind == "model" and key in MODEL_NUMBERS) or (kind == "host" and key in HOST_NUMBERS):
        return None
    return (f"{name} is not a number (numeric facts: a flag, model.{{{','.join(MODEL_NUMBERS)}}} or "
            f"host.{{{','.join(HOST_NUMBERS)}}})")


def _compare(number: float, op: str, limit: float) -> bool:
    return {"<": number < limit, "<=": number <= limit, ">": number > limit, ">=": number >= limit,
            "==": number == limit, "!=": number != limit}[op]


def as_number(value: Any) -> float | None:
    """value as a float; None where it is none, or NaN (JSON and float() take 'NaN': it compares false with
    everything, so a product or a bound of it decides nothing). An integer beyond a float's range (10**400 in a
    JSON flag) is an infinity of its sign, as a text of 400 digits already reads: float() raises for it."""
    if isinstance(value, bool):
        return float(value)
    try:
        number = float(value) if isinstance(value, (int, float)) else float(str(value).strip())
    except OverflowError:
        return math.inf if value > 0 else -math.inf
    except ValueError:
        return None
    return None if math.isnan(number) else number


def operand(value: Any) -> float | None:
    """A fact's value as a factor: a number, or a flag's text of one ("32k": vLLM's human_readable_int reads a
    lower-case k as 1,000 in every release that takes suffixes); never a boolean."""
    if isinstance(value, bool):
        return None
    if isinstance(value, str) and re.fullmatch(r"\s*\d+(\.\d+)?k\s*", value):
        return float(value.strip()[:-1]) * 1000
    return as_number(value)


def as_bool(value: Any) -> bool | None:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    return {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}.get(text)


def show(value: Any) -> str:
    """A fact's value as text: JSON for a list or mapping, true/false for a boolean, else as it is."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    if isinstance(value, (list, dict, tuple)):
        return json.dumps(value, separators=(",", ":"))
    return str(value)


# -- flags ---------------------------------------------------------------------------------------------------

def split_name(name: str) -> tuple[str, tuple[str, ...]]:
    """"--speculative-config.method" -> ("--speculative-config", ("method",))."""
    flag, *path = name.split(".")
    return flag, tuple(path)


def json_flag(flags: Sequence[str], flag: str) -> dict | None:
    """The JSON object a flag was given, or None (absent, too large, too deep or not an object)."""
    raw = flag_value(flags, flag)
    if raw is None or len(raw) > MAX_FLAG_JSON or not raw.lstrip().startswith("{"):
        return None
    try:
        value = json.loads(raw)
    except (ValueError, RecursionError):
        return None
    return value if isinstance(value, dict) and _shallow(value) else None


def _shallow(value: Any, depth: int = 0) -> bool:
    if depth > MAX_FLAG_DEPTH:
        return False
    children = value.values() if isinstance(value, dict) else value if isinstance(value, list) else ()
    return all(_shallow(child, depth + 1) for child in children)


def flag_fact(flags: Sequence[str], name: str) -> Any:
    """A flag's value, or a JSON field of it; None when not given."""
    flag, path = split_name(name)
    if not path:
        return flag_value(flags, flag)
    dotted = _dotted(flags, name)
    if dotted is not None:
        return dotted
    value: Any = json_flag(flags, flag)
    for key in path:
        if not isinstance(value, dict):
            return None
        value = value.get(key)
    return value


def _dotted(flags: Sequence[str], name: str) -> str | None:
    """vLLM's --config.field=value spelling (underscores and dashes alike, as its parser takes them)."""
    want = canonical(name)
    found = None
    for i, arg in enumerate(flags):
        word, eq, value = canonical(arg).partition("=")
        if word == want:
            found = value if eq else (flags[i + 1] if i + 1 < len(flags) else None)
    return found


# -- the host ------------------------------------------------------------------------------------------------

def driver_cuda(driver: str | None, nvml_cuda: str | None) -> tuple[str | None, str]:
    """(the newest CUDA this driver runs, where that comes from)."""
    if nvml_cuda:
        return nvml_cuda, "NVML"
    match = re.match(r"(\d+)\.", driver or "")
    if not match:
        return None, "no driver version"
    branch = int(match.group(1))
    if branch > DRIVER_CUDA[0][0] + 4:  # a newer branch may run a newer CUDA: not guessed
        return None, f"driver {driver} is newer than gpuwarden's table of driver branches"
    for first, cuda in DRIVER_CUDA:
        if branch >= first:
            return cuda, f"driver branch {first}"
    return None, f"driver {driver} is older than CUDA 11.8"


def cuda_of_torch(torch_version: str | None, torch_cuda: str | None) -> str | None:
    """torch's CUDA: torch/version.py's cuda, else the +cuNNN of its version ("2.11.0+cu130" -> "13.0")."""
    if torch_cuda:
        return torch_cuda
    match = re.search(r"\+cu(\d+)(\d)$", torch_version or "")
    return f"{int(match.group(1))}.{match.group(2)}" if match else None


def cuda_tuple(version: str | None) -> tuple[int, int] | None:
    match = re.match(r"(\d+)\.(\d+)", version or "")
    return (int(match.group(1)), int(match.group(2))) if match else None


def nodes(flags: Sequence[str], tp: int, gpu_count: int) -> tuple[int, str]:
    """(how many hosts the engine's parallel group spans, as the flags say, and why)."""
    count = _size(flags, "--nnodes")
    if count and count > 1:
        return int(count), f"--nnodes {int(count)}"
    dp, local = _size(flags, "--data-parallel-size", "-dp"), _size(flags, "--data-parallel-size-local", "-dpl")
    if dp and local and dp > local:
        return int(-(-dp // local)), f"--data-parallel-size {int(dp)} over --data-parallel-size-local {int(local)}"
    pp = _size(flags, "--pipeline-parallel-size", "-pp") or 1
    ranks = tp * int(pp)
    if gpu_count and ranks > gpu_count:
        return -(-ranks // gpu_count), f"tensor x pipeline parallel {ranks} over {gpu_count} GPU(s) here"
    return 1, "one host"


def _size(flags: Sequence[str], *names: str) -> float | None:
    """A size flag's number; None where it is absent or infinite ('9' * 400, '1e309': int() of it raises, and no
    engine starts with it)."""
    number = as_number(flag_value(flags, *names))
    return number if number is not None and math.isfinite(number) else None
