"""The package's layers: every import points down. A new arrow that points up fails here, naming the file,
the line and the two layers, before it turns into a cycle or drags the config into the GPU code."""

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "daemon" / "gpuwarden"

# Lowest first: the wings (and the serving wing's rooms). A module may import from a lower layer and from its own
# wing; nothing else.
LAYERS = [
    {"base"},  # files, YAML, the schema reader, HTTP GET, the journal, early signals, the web config file
    {"gpu"},  # the GPU backends and what their readings mean (throttle): they know nothing of the config
    {"tune"},  # the settings table, plan and Tuner, the tuning life, originals, the sweeps' lease
    {"config"},  # YAML in, frozen dataclasses out; the tuning section is tune's
    {"serving.lint"},  # the lint: findings, rules, facts, the model's facts, the flags as the engines read them
    {"serving.compose", "backends"},  # the serving command, the child's user; the backend a config names
    {"serving.probe"},  # the engine's metrics and its progress
    {"serving.run"},  # the children: specs, supervisor, processes, the serving runtime
    {"watch"},  # one poll: signals, rules, events, the snapshot; the preflight
    {"web"},  # /metrics and /status
    {"proxy", "bench"},
    {"service"},  # the daemon's main loop, the control socket
    {"cli"},
    {"__main__", "entry"},
]
RANK = {unit: rank for rank, units in enumerate(LAYERS) for unit in units}


SERVING_ROOMS = ("lint", "compose", "probe", "run")  # serving/ by job, each a unit of its own


def unit_of(module: str) -> str:
    """gpuwarden.serving.compose.engines.vllm -> serving.compose; gpuwarden.config -> config."""
    parts = module.split(".")
    if parts[1] == "serving" and len(parts) > 2 and parts[2] in SERVING_ROOMS:
        return f"serving.{parts[2]}"
    return parts[1]


def unit_of_path(path: Path) -> str:
    """daemon/gpuwarden/serving/run/supervisor.py -> serving.run; daemon/gpuwarden/__init__.py -> __init__."""
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return unit_of(".".join(("gpuwarden", *parts))) if len(parts) > 1 else parts[0]


def imports(path: Path) -> list[tuple[int, str]]:
    module = ".".join(("gpuwarden", *path.relative_to(PACKAGE).with_suffix("").parts))
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    return imports_in(path.read_text(), package)


def imports_in(source: str, package: str) -> list[tuple[int, str]]:
    """(line, absolute module) of every gpuwarden import in source, a module of package, also those inside
    functions and TYPE_CHECKING blocks."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.startswith("gpuwarden.")]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if not target.startswith("gpuwarden"):
                continue
            if target == "gpuwarden":  # from . import config, tunables
                found += [(node.lineno, f"gpuwarden.{a.name}") for a in node.names]
            else:
                found.append((node.lineno, target))
    return found


def test_every_module_has_a_layer():
    units = {unit_of_path(p) for p in PACKAGE.rglob("*.py")} - {"__init__", "serving"}  # packages' faces
    assert units == set(RANK), f"give these a layer: {units - set(RANK)}; gone: {set(RANK) - units}"


def test_imports_point_down():
    wrong = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == PACKAGE / "__init__.py":
            continue
        here = unit_of_path(path)
        for line, target in imports(path):
            there = unit_of(target)
            if there not in RANK or there == here:
                continue  # the package's face (its version string), or the same package
            if RANK[there] >= RANK[here]:
                wrong.append(f"{path.relative_to(PACKAGE)}:{line}: {here} (layer {RANK[here]}) imports {target} "
                             f"(layer {RANK[there]})")
    assert not wrong, "imports that point up or sideways:\n" + "\n".join(wrong)


def test_the_check_sees_an_upward_import():
    """The test itself: the config imported from GPU code, relatively or not, lands on a higher layer."""
    for source in ("from ..config import Config\n", "import gpuwarden.config\n",
                   "def f():\n    from .. import config\n"):
        [(_, target)] = imports_in(source, "gpuwarden.gpu")
        assert unit_of(target) == "config" and RANK["config"] > RANK["gpu"], source
    assert imports_in("from .base import Gpu\n", "gpuwarden.gpu") == [(1, "gpuwarden.gpu.base")]


TOP_LEVEL_MAX = 6  # entry points, the config and its backend; the rest lives in a wing
CLASS_LINES_MAX = 300


def test_the_package_is_wings_with_few_modules_at_the_top():
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(top) <= TOP_LEVEL_MAX, f"{len(top)} modules directly in daemon/gpuwarden/ (a wing is their home): {top}"


def test_no_class_is_over_300_lines():
    long = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > CLASS_LINES_MAX:
                long.append(f"{path.relative_to(PACKAGE)}:{node.lineno}: {node.name}, "
                            f"{node.end_lineno - node.lineno + 1} lines")
    assert not long, "classes over 300 lines (split by job):\n" + "\n".join(long)


MAP = PACKAGE.parent.parent / "docs" / "architecture.md"


def map_rows(text: str) -> dict[str, str]:
    """The map's table: each wing it names (`serving/run/`, `config.py`) -> the text of its row."""
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[0].isdigit():
            rows.update((wing, cells[2]) for wing in re.findall(r"`([^`]+)`", cells[1]))
    return rows


def unmapped(rows: dict[str, str], modules: list[str]) -> list[str]:
    """The modules (paths under daemon/gpuwarden/) no row names. A wing's row names a module by its name in
    backquotes (`monitor`, `supervisor.Program`, `monitor(...)`) or a folder it is in (`signals/`); a package's
    __init__ is its folder's face, named with the folder."""
    missing = []
    for rel in modules:
        wing = max((w for w in rows if rel == w or rel.startswith(w) and w.endswith("/")), key=len, default=None)
        if wing is None:
            missing.append(f"{rel}: no wing of the map holds it")
            continue
        if rel == wing:
            continue
        parts = rel[len(wing):].split("/")
        named = set(re.findall(r"`([^`]+)`", rows[wing]))
        folders = {"/".join(parts[:i]) + "/" for i in range(1, len(parts))}
        stem = parts[-1].removesuffix(".py")
        if parts[-1] == "__init__.py" and (len(parts) == 1 or folders & named):
            continue
        if folders & named or any(re.fullmatch(rf"{re.escape(stem)}(\.\w+|\(.*\))?", n) for n in named):
            continue
        missing.append(f"{rel}: the row of {wing} does not name `{stem}`")
    return missing


def test_every_module_is_on_the_map():
    """docs/architecture.md is true: each module is named in its wing's row, so a newcomer finds its home (and a
    new module is placed on purpose, not left out)."""
    modules = sorted(p.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("*.py") if p != PACKAGE / "__init__.py")
    rows = map_rows(MAP.read_text())
    missing = unmapped(rows, [m for m in modules if m != "serving/__init__.py"])  # serving/: its rooms are the wings
    assert not missing, "modules docs/architecture.md does not name:\n" + "\n".join(missing)


def test_the_map_check_sees_a_module_left_out():
    rows = map_rows("| 6 | `serving/run/` | the state machine (`supervisor.Program`), its checks (`checks/`) |\n"
                    "| 1 | `gpu/` | the backend (`nvml`) |\n")
    assert unmapped(rows, ["serving/run/supervisor.py", "serving/run/checks/a.py", "serving/run/__init__.py",
                           "gpu/nvml.py"]) == []
    assert unmapped(rows, ["serving/run/stopping.py", "gpu/nvml_more.py", "web/server.py"]) == [
        "serving/run/stopping.py: the row of serving/run/ does not name `stopping`",
        "gpu/nvml_more.py: the row of gpu/ does not name `nvml_more`",
        "web/server.py: no wing of the map holds it"]


def _defined(node: ast.ClassDef) -> set[str]:
    """What a class itself defines: its methods and class attributes, and every self.X it assigns."""
    names = {b.name for b in node.body if isinstance(b, (ast.FunctionDef, ast.AsyncFunctionDef))}
    for sub in ast.walk(node):
        targets = sub.targets if isinstance(sub, ast.Assign) else [sub.target] \
            if isinstance(sub, (ast.AnnAssign, ast.AugAssign)) else []
        for target in targets:
            names |= {t.id for t in ast.walk(target) if isinstance(t, ast.Name) and sub in node.body}
            names |= {t.attr for t in ast.walk(target)
                      if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"}
    return names


def reaching(sources: dict[str, str]) -> list[str]:
    """self._X read in a class that neither defines X nor inherits it from a class of these sources: a mixin
    reaching into its host's privates."""
    classes: dict[str, list[ast.ClassDef]] = {}
    for source in sources.values():
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.ClassDef):
                classes.setdefault(node.name, []).append(node)

    def known(node: ast.ClassDef, seen: frozenset = frozenset()) -> set[str]:
        names = _defined(node)
        for base in node.bases:
            for parent in classes.get(base.id if isinstance(base, ast.Name) else "", []):
                if parent not in seen:
                    names |= known(parent, seen | {node})
        return names

    found = []
    for where, source in sources.items():
        for node in ast.walk(ast.parse(source)):
            if not isinstance(node, ast.ClassDef):
                continue
            names = known(node)
            found += [f"{where}:{a.lineno}: {node.name} reads self.{a.attr}, which it neither defines nor inherits"
                      for a in ast.walk(node) if isinstance(a, ast.Attribute) and isinstance(a.value, ast.Name)
                      and a.value.id == "self" and a.attr.startswith("_") and not a.attr.startswith("__")
                      and a.attr not in names]
            # a part that holds another object and reaches into its privates (self.runtime._replace_all)
            found += [f"{where}:{a.lineno}: {node.name} reads {ast.unparse(a)}, a private of another object"
                      for a in ast.walk(node) if isinstance(a, ast.Attribute) and a.attr.startswith("_")
                      and not a.attr.startswith("__") and isinstance(a.value, ast.Attribute)
                      and isinstance(a.value.value, ast.Name) and a.value.value.id == "self"]
    return sorted(set(found))


def test_no_class_reaches_into_a_private_of_another():
    """A class's parts are composed, not mixed in: a mixin that calls its host's _transition (Program's Holding did)
    couples the two through names neither declares."""
    sources = {str(p.relative_to(PACKAGE)): p.read_text() for p in sorted(PACKAGE.rglob("*.py"))}
    found = reaching(sources)
    assert not found, "\n".join(found)


def test_the_reach_check_sees_a_mixin_calling_its_hosts_private():
    mixin = "class Holding:\n    def hold(self):\n        self._transition('HELD')\n"
    host = "class Program(Holding):\n    def _transition(self, new):\n        self._state = new\n"
    assert reaching({"m.py": mixin, "h.py": host}) == [
        "m.py:3: Holding reads self._transition, which it neither defines nor inherits"]
    part = "class Holding:\n    def __init__(self, p):\n        self._p = p\n    def hold(self):\n        self._p.enter()\n"
    assert reaching({"m.py": part, "h.py": host}) == []
    reaching_part = "class Restart:\n    def go(self):\n        self.runtime._replace_all()\n"
    assert reaching({"r.py": reaching_part}) == [
        "r.py:3: Restart reads self.runtime._replace_all, a private of another object"]
