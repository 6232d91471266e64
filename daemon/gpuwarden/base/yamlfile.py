"""Read YAML files while remembering the file and line of every key.

Config and scenario errors must name FILE:LINE, and PyYAML's plain loaders drop
that information (and silently keep the last of two duplicate keys), so we
compose the node tree ourselves.

Every input has limits, each reported as one FILE:LINE line: only regular files
are read (a FIFO or /dev/zero in conf.d is refused, not read), up to MAX_BYTES;
nesting is measured on the event stream before anything recurses; aliases may
expand to at most MAX_VALUES values (an alias bomb stops there) and never to
themselves; an integer has at most MAX_DIGITS digits.
"""

from __future__ import annotations

import errno
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from . import smallfile

MAX_BYTES = 1024 * 1024
# libyaml's parser where PyYAML has it (Debian's python3-yaml and PyPI's wheels do): 4 times faster than the
# pure-Python one (195 KiB of a flow list: 0.95 s against 4.09), and a reload parses on the daemon's loop. Same
# events, marks and resolver; the scalars are still made by SafeLoader's constructor (_scalar).
LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
# A directory of YAML files read whole at a load (profiles.d, rules.d), as the config and its drop-ins are
# (config.MAX_CONFIG_BYTES): at most this many files and bytes in all.
MAX_DIR_FILES = 100
MAX_DIR_BYTES = 256 * 1024
MAX_DEPTH = 64
MAX_VALUES = 100_000
MAX_DIGITS = 30

Path_ = tuple[str, ...]


class InvalidConfig(Exception):
    """A config, profile or other file a user wrote is wrong: one problem or several, always as `errors`."""

    errors: list[ConfigError]


class ConfigError(InvalidConfig):
    """One problem in a file a user wrote, rendered as one line."""

    def __init__(self, file: str, line: int, key: str, message: str, allowed: str | None = None):
        self.file, self.line, self.key, self.message, self.allowed = file, line, key, message, allowed
        super().__init__(str(self))

    @property
    def errors(self) -> list[ConfigError]:
        return [self]

    def __str__(self) -> str:
        text = f"{self.file}:{self.line}: {self.key}: {self.message}"
        return f"{text} ({self.allowed})" if self.allowed else text

    def as_dict(self) -> dict:
        return {"file": self.file, "line": self.line, "key": self.key,
                "message": self.message, "allowed": self.allowed}


class ConfigErrors(InvalidConfig):
    """All the problems found in one pass, so a user fixes them in one go."""

    def __init__(self, errors: list[ConfigError]):
        self.errors = errors
        super().__init__("\n".join(str(e) for e in errors))


def key_name(path: Path_) -> str:
    # A key may hold a newline ("--max-num-seqs\n* 2": a quoted YAML key): escaped, so an error stays one line.
    return ".".join(k if k.isprintable() else repr(k)[1:-1] for k in path) if path else "(top level)"


@dataclass
class Document:
    """Plain Python values plus the location that set each key path."""

    value: Any
    file: str
    where: dict[Path_, tuple[str, int]] = field(default_factory=dict)
    root_line: int = 1  # where the top-level value starts

    def locate(self, path: Path_) -> tuple[str, int]:
        # The nearest enclosing key that has a line; the file's start otherwise.
        for cut in range(len(path), -1, -1):
            if path[:cut] in self.where:
                return self.where[path[:cut]]
        return self.file, 1

    def error(self, path: Path_, message: str, allowed: str | None = None) -> ConfigError:
        file, line = self.locate(path)
        return ConfigError(file, line, key_name(path), message, allowed)


def read_text(file: str | Path, max_bytes: int = MAX_BYTES, why: str = "a config file is a few KiB") -> str:
    """A regular file's UTF-8 text, at most max_bytes (why: what the error's fix says of the cap); ConfigError for
    anything else."""
    name = str(file)
    try:
        data = smallfile.read(file, max_bytes, follow=True)  # a FIFO is refused, never waited on
    except smallfile.Unreadable as exc:
        raise ConfigError(name, 1, "(file)", *_unreadable(exc, max_bytes, why)) from None
    if data is None:
        raise ConfigError(name, 1, "(file)", "file not found", "give an existing file, e.g. with --config")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(name, 1, "(file)", f"not UTF-8 text ({exc.reason})") from None


class DirBudget:
    """What one load may read of a directory of YAML files: MAX_DIR_FILES files, MAX_DIR_BYTES in all, each file
    within what is left (ConfigError, FILE:LINE, past either)."""

    def __init__(self, folder: Path, what: str, max_files: int = MAX_DIR_FILES, max_bytes: int = MAX_DIR_BYTES):
        self.folder, self.what, self.max_files, self.left = folder, what, max_files, max_bytes
        self.max_bytes = max_bytes

    def files(self) -> list[Path]:
        """The folder's *.yaml, in lexical order; ConfigError past max_files."""
        found = sorted(self.folder.glob("*.yaml"))
        if len(found) > self.max_files:
            raise ConfigError(str(self.folder), 1, "(file)", f"{len(found)} {self.what} files, more than "
                              f"{self.max_files}", f"merge them: {self.what} files are a few KiB each")
        return found

    def load(self, file: Path) -> Document:
        """One file of the folder, parsed, its bytes counted against what is left."""
        text = read_text(file, max(0, self.left), f"the {self.what} files are {self.max_bytes // 1024} KiB at most "
                                                  "in all")
        self.left -= len(text.encode())
        return parse(text, str(file))


def _unreadable(exc: smallfile.Unreadable, max_bytes: int, why: str) -> tuple[str, str | None]:
    """What is wrong with a config file smallfile would not read, and the fix."""
    if exc.errno == errno.EISDIR or exc.st is not None and stat.S_ISDIR(exc.st.st_mode):
        return "is a directory, not a file", None
    if exc.errno in (errno.EACCES, errno.EPERM):
        return "permission denied", "run as root or make the file readable"
    if exc.errno is not None:
        return f"cannot read: {exc}", None
    if not stat.S_ISREG(exc.st.st_mode):
        return "not a regular file (a FIFO, a device or a socket is never read)", None
    return f"larger than {max_bytes // 1024} KiB", why


def load(file: str | Path, empty_ok: bool = False) -> Document:
    """Parse one YAML file; raise ConfigError for anything unreadable or over a limit."""
    return parse(read_text(file), str(file), empty_ok)


def _one_line(text: object) -> str:
    return " ".join(str(text).split())


def parse(text: str, name: str, empty_ok: bool = False) -> Document:
    """Parse YAML text; empty_ok: a file of only comments is an empty mapping (a drop-in), not an error."""
    try:
        _check_depth(text, name)
        node = yaml.compose(text, Loader=LOADER)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line = mark.line + 1 if mark else 1
        if "maximum nesting depth" in str(exc.problem):  # libyaml's own limit, met while it scans ahead of ours
            raise ConfigError(name, line, "(yaml)", f"nested more than {MAX_DEPTH} levels deep") from None
        raise ConfigError(name, line, "(yaml)", f"invalid YAML: {_one_line(exc.problem or exc.context)}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(name, 1, "(yaml)", f"invalid YAML: {_one_line(exc)}") from None
    if node is None:
        if empty_ok:
            return Document({}, name)
        raise ConfigError(name, 1, "(file)", "file is empty", "expected a mapping of settings")
    doc = Document(None, name, root_line=node.start_mark.line + 1)
    doc.value = _convert(node, (), doc, yaml.SafeLoader(""), _Budget())
    return doc


def _check_depth(text: str, name: str) -> None:
    """Nesting deeper than MAX_DEPTH, found on the event stream (which does not recurse), with its line."""
    depth = 0
    for event in yaml.parse(text, Loader=LOADER):
        if isinstance(event, (yaml.MappingStartEvent, yaml.SequenceStartEvent)):
            depth += 1
            if depth > MAX_DEPTH:
                raise ConfigError(name, event.start_mark.line + 1, "(yaml)",
                                  f"nested more than {MAX_DEPTH} levels deep")
        elif isinstance(event, (yaml.MappingEndEvent, yaml.SequenceEndEvent)):
            depth -= 1


class _Budget:
    """How many values aliases may still expand to; and the nodes being converted (an alias to one of
    them would never end)."""

    def __init__(self) -> None:
        self.left = MAX_VALUES
        self.open: set[int] = set()


STANDARD_COLLECTION_TAGS = ("tag:yaml.org,2002:map", "tag:yaml.org,2002:seq")


def _convert(node: yaml.Node, path: Path_, doc: Document, scalars: yaml.SafeLoader, budget: _Budget) -> Any:
    line = node.start_mark.line + 1
    budget.left -= 1
    if budget.left < 0:  # name the top-level key: deeper lines are the anchors', shared by every copy
        raise ConfigError(doc.file, doc.where.get(path[:1], (doc.file, line))[1], key_name(path[:1]),
                          f"aliases expand to more than {MAX_VALUES} values")
    if id(node) in budget.open:
        raise ConfigError(doc.file, line, key_name(path), "an alias that contains itself")
    if isinstance(node, yaml.ScalarNode):
        return _scalar(node, path, doc, scalars)
    budget.open.add(id(node))
    try:
        return _collection(node, path, doc, scalars, budget)
    finally:
        budget.open.discard(id(node))


def _collection(node: yaml.Node, path: Path_, doc: Document, scalars: yaml.SafeLoader, budget: _Budget) -> Any:
    if node.tag not in STANDARD_COLLECTION_TAGS:
        # Scalars get the same check from SafeLoader below; nothing here ever builds objects.
        raise ConfigError(doc.file, node.start_mark.line + 1, key_name(path), f"unsupported YAML tag {node.tag}")
    if isinstance(node, yaml.MappingNode):
        out: dict[str, Any] = {}
        for key_node, value_node in node.value:
            if not isinstance(key_node, yaml.ScalarNode):
                raise ConfigError(doc.file, key_node.start_mark.line + 1, key_name(path),
                                  "keys must be plain names")
            key = str(key_node.value)
            child = path + (key,)
            if key in out:
                first = doc.where[child][1]
                raise ConfigError(doc.file, key_node.start_mark.line + 1, key_name(child),
                                  f"duplicate key (first set on line {first})")
            doc.where[child] = (doc.file, key_node.start_mark.line + 1)
            out[key] = _convert(value_node, child, doc, scalars, budget)
        return out
    items = []
    for i, item in enumerate(node.value):
        child = path + (str(i),)
        doc.where[child] = (doc.file, item.start_mark.line + 1)
        items.append(_convert(item, child, doc, scalars, budget))
    return items


def _scalar(node: yaml.ScalarNode, path: Path_, doc: Document, scalars: yaml.SafeLoader) -> Any:
    digits = sum(c.isdigit() for c in node.value)
    if node.tag == "tag:yaml.org,2002:int" and digits > MAX_DIGITS:
        raise ConfigError(doc.file, node.start_mark.line + 1, key_name(path),
                          f"a number with {digits} digits", f"at most {MAX_DIGITS}")
    try:
        # The node's tag was resolved while composing; this turns it into a value.
        return scalars.construct_object(node, deep=True)
    except (yaml.YAMLError, ValueError, OverflowError) as exc:
        problem = getattr(exc, "problem", None) or str(exc)
        raise ConfigError(doc.file, node.start_mark.line + 1, key_name(path), f"bad value: {problem}") from None


def merge(base: Document, over: Document) -> Document:
    """Deep-merge `over` into `base`: mappings merge, everything else replaces."""
    if not isinstance(base.value, dict) or not isinstance(over.value, dict):
        return over
    merged = Document(_merge_values(base.value, over.value), base.file, dict(base.where))
    # A replaced subtree must not keep stale locations from the base file: one pass over the base's locations, each
    # looked up among the replaced paths by its prefixes (a scan of every location per replaced path was N x M:
    # 56 KB of config and drop-in held a reload 14.5 s, attacker 8's finding 4).
    replaced = {path for path in over.where if not isinstance(_get(over.value, path), dict)}
    if replaced:
        for stale in [p for p in merged.where if any(p[:n] in replaced for n in range(1, len(p)))]:
            del merged.where[stale]
    merged.where.update(over.where)
    return merged


def _merge_values(a: Any, b: Any) -> Any:
    if isinstance(a, dict) and isinstance(b, dict):
        out = dict(a)
        for key, value in b.items():
            out[key] = _merge_values(a[key], value) if key in a else value
        return out
    return b


def _get(value: Any, path: Path_) -> Any:
    for part in path:
        value = value[part] if isinstance(value, dict) else value[int(part)]
    return value
