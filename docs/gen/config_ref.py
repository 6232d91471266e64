"""The configuration reference, docs/reference/configuration.md, and the man page gpuwarden.yaml(5),
packaging/man/gpuwarden.yaml.5: both from the parser itself (daemon/gpuwarden/config.py, tune/, base/webconfig.py),
so neither can drift from what `gpuwarden check` accepts.

    python3 docs/gen/config_ref.py     # rewrite both; tests/test_ref_config.py fails while they differ

The keys are not copied by hand: the parser is run once over a document that enables every conditional part
(serve.nodes, serve.proxy, a tuning.gpus override) with a Reader that records each read: its key, its type,
default, range or choices and unit. The web config file is read the same way. A key's meaning is its comment in
the shipped example, etc/gpuwarden/gpuwarden.yaml (MEANINGS where it has none), its example the value there
(EXAMPLES, else the default). What a reload does with it follows service/reload.py's RESTART_ONLY and the
serving runtime's child kinds (serving/run/kinds.py). A key read without a typed call (an address, a clock lock)
needs its shape in SHAPES, and a key with neither a comment nor a meaning stops the generator: both fail the test.
"""

from __future__ import annotations

import re
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from unittest import mock

import yaml

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT / "daemon") not in sys.path:
    sys.path.insert(0, str(ROOT / "daemon"))

from gpuwarden import config as configmod  # noqa: E402
from gpuwarden.base import schema, webconfig  # noqa: E402
from gpuwarden.base.yamlfile import InvalidConfig  # noqa: E402
from gpuwarden.gpu.sim.scenario import builtin_scenarios  # noqa: E402
from gpuwarden.service.daemon import SIDE_KINDS  # noqa: E402
from gpuwarden.serving.compose import engines  # noqa: E402
from gpuwarden.serving.compose.flagcheck import TIMEOUT_S as FLAGCHECK_S  # noqa: E402
from gpuwarden.service.reload import RESTART_ONLY  # noqa: E402
from gpuwarden.tune import tunables  # noqa: E402
from roff import ManPage, Roff, bold, join, release  # noqa: E402

PAGE = Path("docs/reference/configuration.md")
MAN = Path("packaging/man/gpuwarden.yaml.5")
EXAMPLE = Path("etc/gpuwarden/gpuwarden.yaml")
CONFIG, WEB = "gpuwarden.yaml", "web config"
ID = "ID"  # a tuning.gpus key: a GPU's index or UUID

# What a reload (SIGHUP, systemctl reload gpuwarden) does with a changed key.
AT_ONCE = "applies at once"
REPLANS = "re-plans the tuning"
ENGINE = "restarts the engine"
RESTART = "needs a restart of the daemon"
RELOADS = (
    (AT_ONCE, "from the next poll on; nothing restarts."),
    (REPLANS, ("the tuning is planned again and applied at once: what the new config no longer wants is put back, "
               "what it wants is set. Nothing restarts.")),
    (ENGINE, ("where serving runs, the engine (and the children beside it, such as the proxy) stops and starts "
              "again with the new config, which is checked first as a start checks it: lint, and where the engine's "
              "command, environment or user changes (or another version is installed under it), the engine's own "
              "parser on its flags (as `gpuwarden check --deep` runs it: as serve.user, off the daemon's loop, at "
              f"most {FLAGCHECK_S:g} s; the engine serves meanwhile, and the reload takes effect once the parser "
              "has answered). A config that would not start "
              "is refused in one line (`reload failed, still running the previous config: FILE:LINE: serve.args: "
              "vLLM rejects the flags: ...`) and the running engine serves on. A handover (SIGUSR2) checks the same "
              "way before it re-executes.")),
    ("restarts the proxy only", "the engine serves on; only the proxy is stopped and started with its new settings."),
    (RESTART, ("a reload keeps the running value and logs that it only changes on restart "
               "(systemctl restart gpuwarden).")),
)
# Where a key's reload is more than its section's rule.
RELOAD_NOTES = {
    "serve.enabled": "starts or stops the engine",
}

# The keys the parser reads without a typed call (Reader.get and its own checks): (type, what it accepts).
_CLOCK = f"[MIN_MHZ, MAX_MHZ] with 1 <= MIN <= MAX <= {tunables.MAX_MHZ}"
_THRESHOLD = ("clock threshold",
              f"MHz (1-{tunables.MAX_MHZ}), or a percentage of the locked (else max) clock such as \"50%\"")
SHAPES = {
    "metrics.listen": ("address", "HOST:PORT (an IPv6 host in brackets), or none: no HTTP endpoint"),
    "serve.proxy.listen": ("address", "IP:PORT, the IP numeric and canonical (an IPv6 address in brackets)"),
    "alerts.sm_clock_min_mhz": _THRESHOLD,
    "alerts.memory_clock_min_mhz": _THRESHOLD,
    **{f"{base}{t.key}": ("clock lock", ("auto, " if t.auto else "") + "max, none, or " + _CLOCK)
       for t in tunables.TUNABLES if isinstance(t, tunables.ClockLock) for base in ("tuning.", f"tuning.gpus.{ID}.")},
    "serve.command": ("list of strings", "an entry point, then flags of its own; not empty"),
    "serve.args": ("list of strings", "quote numbers: [\"--max-num-seqs\", \"8\"]"),
    "serve.gpus": ("list", "all, or GPU indices (PCI order) or UUIDs"),
    "serve.proxy.remove_patterns": ("list of strings", "Python regular expressions"),
    "serve.nodes.hosts": ("list of IP addresses", "count numeric addresses, head first; a name is never looked up"),
    "serve.nodes.head": ("IP address", "a numeric address; a name is never looked up"),
    "serve.container.mounts": ("list of strings", "HOST:CONTAINER, HOST:CONTAINER:ro (the default) or "
                               "HOST:CONTAINER:rw; both absolute paths of letters, digits and ._@+-/"),
}
# Defaults the walk cannot see: derived from other keys, or "not set".
DEFAULTS = {
    "serve.model": "unset",
    "serve.command": "the engine's own",
    "serve.nodes.rank": "this host's place in hosts",
    "serve.nodes.hosts": "[]",
    "serve.nodes.head": "hosts[0]",
    "serve.container.image": "unset (required)",
    "serve.container.socket": "the runtime's: /run/podman/podman.sock, /run/docker.sock",
    "serve.container.mounts": "[] (the model's folder is mounted read-only at its own path)",
    "tls_server_config.cert_file": "unset",
    "tls_server_config.key_file": "unset",
    "basic_auth_users": "{}",
    **{f"tuning.gpus.{ID}.{t.key}": f"tuning.{t.key}" for t in tunables.TUNABLES},
}
# What a key accepts where the parser checks it elsewhere (a file exists, an engine is known) or against another key.
RANGES = {
    "serve.nodes.rank": "0 to count - 1 (0: the head)",
    "gpu.scenario": ", ".join(builtin_scenarios()) + ", or a scenario file",
    "serve.engine": ", ".join(engines.names()),
    "serve.profile": "auto, or a profile name (gpuwarden profiles list)",
    "serve.python": "auto, or a path",
    "serve.user": "a user name, not root",
    "metrics.web_config": "a file (relative to the config's folder), or none",
    "serve.env_file": "a root-only file, or none",
    "serve.proxy.dump_dir": "a folder, or none",
    "serve.nodes.interface": "a network interface, or none",
    "serve.container.image": "an image reference: [REGISTRY/]PATH[:TAG][@sha256:DIGEST]",
    "serve.container.socket": "an absolute path",
    "serve.env": "variable name to a string value",
    "tuning.gpus": "GPU index or UUID to its settings",
    "basic_auth_users": "user name to bcrypt hash",
    "tls_server_config.cert_file": "a file (relative to the web config's folder)",
    "tls_server_config.key_file": "a file (relative to the web config's folder)",
}
# Meanings for keys the example file does not comment (or comments only in passing).
MEANINGS = {
    **{f"tuning.gpus.{ID}.{t.key}": f"tuning.{t.key} for this GPU alone." for t in tunables.TUNABLES},
    "serve.nodes.count": "How many nodes the one engine spans, this one included.",
    "serve.container.image": "The image the engine runs from (serve.command is then the command inside it); a local "
                             "image: nothing is pulled unless pull says so.",
    "serve.container.runtime": "podman (its libpod API: CDI GPUs) or docker (DeviceRequests, its --gpus).",
    "serve.container.socket": "The runtime's API socket (root's): the daemon's shim talks to it, no CLI is run.",
    "serve.container.mounts": "Host folders the engine sees, read-only unless :rw (a Hugging Face cache, compiled "
                              "kernels).",
    "serve.container.pull": "Pull the image at a start where the runtime does not have it.",
    "serve.container.shm_gib": "The size of /dev/shm inside (a limit, not a reservation): NCCL between the GPUs of "
                               "one container needs more than the runtimes' 64 MiB.",
    "serve.nodes.rank": "This node's rank (0 is the head, which serves the API). Set it, or leave it out and give "
                        "hosts: each node finds its rank among its own addresses.",
    "serve.nodes.head": "The head's address (its rendezvous port is serve.nodes.port): with rank, instead of hosts.",
    "tls_server_config.cert_file": "The server's certificate (PEM), relative to the web config file's folder. "
                                   "With key_file, /metrics and /status are served over TLS.",
    "tls_server_config.key_file": "The certificate's private key (PEM), relative to the web config file's folder.",
    "basic_auth_users": "Basic auth: each user's bcrypt hash (`htpasswd -nBC 12 USER` prints it after the colon); "
                        "needs python3-bcrypt. Empty: no authentication.",
}
# What a group of keys is, where the example file says nothing above it (by the mapping it is; WEB: the web config).
GROUP_NOTES = {
    "": "How often the daemon samples the GPUs, reads their slow counters and logs a summary.",
    f"tuning.gpus.{ID}": "One GPU's settings, under tuning.gpus by its index (\"0\", in PCI bus order) or its UUID: "
                         "each key left out is tuning's own. A UUID key wins over an index key.",
    WEB: "The file metrics.web_config names: TLS and basic auth for /metrics and /status, with the keys of the "
         "Prometheus exporter toolkit's --web.config.file (as node_exporter reads it).",
}
# Examples for keys the example file leaves at the default or does not show (a value as the file writes it).
EXAMPLES = {
    "gpu.scenario": "dgx-spark",
    "tuning.power_limit_w": "300",
    "tuning.memory_clocks": "max",
    "tuning.gpus": "{\"1\": {gpu_clocks: [2400, 2400]}}",
    f"tuning.gpus.{ID}.persistence_mode": "false",
    f"tuning.gpus.{ID}.gpu_clocks": "[2400, 2400]",
    f"tuning.gpus.{ID}.memory_clocks": "max",
    f"tuning.gpus.{ID}.power_limit_w": "130",
    "metrics.web_config": "/etc/gpuwarden/web.yml",
    "serve.gpus": "[0, 1]",
    "serve.args": "[\"--max-model-len\", \"8192\"]",
    "serve.env": "{VLLM_LOGGING_LEVEL: \"WARNING\"}",
    "serve.env_file": "/etc/gpuwarden/credentials/vllm.env",
    "serve.proxy.dump_dir": "/var/lib/gpuwarden/proxy-dumps",
    "serve.proxy.remove_patterns": "['^Timestamp: [^\\n]*\\n']",
    "serve.nodes.head": "10.0.0.1",
    "serve.container.image": "localhost/vllm-cpu:v0.32",
    "serve.container.socket": "/run/podman/podman.sock",
    "serve.container.mounts": "[\"/srv/hf-cache:/hf\", \"/srv/build:/dsv4:ro\"]",
    "tls_server_config.cert_file": "tls/server.crt",
    "tls_server_config.key_file": "tls/server.key",
    "basic_auth_users": "{prometheus: $2b$12$...}",
}

# What makes every conditional key read: multi-node serving, the proxy, and a per-GPU override of every setting.
ENABLING = {
    "serve": {"enabled": True, "model": "m", "proxy": {"enabled": True},
              "nodes": {"count": 2, "hosts": ["10.0.0.1", "10.0.0.2"], "rank": 0},
              "container": {"image": "localhost/vllm-cpu:v0.32"}},
    "tuning": {"gpus": {"0": {t.key: t.config_value(t.default) for t in tunables.TUNABLES}}},
}
# What serve.nodes excludes: an engine that rests while idle (serve.idle needs one host, and the proxy).
ENABLING_ONE_HOST = {"serve": {"enabled": True, "model": "m", "proxy": {"enabled": True},
                               "idle": {"action": "stop", "after_s": 600}}}
WEB_ENABLING = {"tls_server_config": {"cert_file": "c", "key_file": "k"}, "basic_auth_users": {}}


@dataclass(frozen=True)
class Entry:
    key: str  # dotted, as an error line names it; tuning.gpus.ID.x for a per-GPU setting
    file: str  # CONFIG, or WEB: the file metrics.web_config names
    type: str
    default: str  # as the file writes it
    allowed: str  # the range or the choices; "" where the type says it all
    unit: str
    example: str  # a value as the file writes it
    reload: str
    meaning: str

    @property
    def group(self) -> str:
        """The mapping the key sits in ("" for the top level)."""
        return self.key.rpartition(".")[0]

    @property
    def accepts(self) -> str:
        bound = f"{self.allowed} {self.unit}".strip() if self.allowed else self.unit
        return f"{self.type}: {bound}" if bound else self.type


@dataclass
class _Read:
    kind: str  # number, optional_number, string, boolean, mapping, sequence; get: read without a typed call
    default: Any = None
    low: float | None = None
    high: float | None = None
    integer: bool = False
    unit: str = ""
    choices: tuple[str, ...] | None = None
    keys: tuple[str, ...] | None = None  # a mapping's allowed keys (None: any)


class _Recorder(schema.Reader):
    """A Reader that notes every key read and how: a typed read replaces a plain get of the same key, and the
    first typed read wins (optional_number reads through number)."""

    def __init__(self, doc):
        super().__init__(doc)
        self.reads: dict[str, _Read] = {}

    def _note(self, path, read: _Read) -> None:
        key = _dotted(path)
        if key not in self.reads or self.reads[key].kind == "get":
            self.reads[key] = read

    def get(self, path):
        self._note(path, _Read("get"))
        return super().get(path)

    def mapping(self, path, keys, required=()):
        self._note(path, _Read("mapping", keys=None if keys is None else tuple(keys)))
        return super().mapping(path, keys, required)

    def sequence(self, path):
        self._note(path, _Read("sequence"))
        return super().sequence(path)

    def boolean(self, path, default):
        self._note(path, _Read("boolean", default))
        return super().boolean(path, default)

    def number(self, path, default, low, high, integer=False, unit=""):
        self._note(path, _Read("number", default, low, high, integer, unit.strip()))
        return super().number(path, default, low, high, integer, unit)

    def optional_number(self, path, default, low, high, unit=""):
        self._note(path, _Read("optional_number", default, low, high, False, unit.strip()))
        return super().optional_number(path, default, low, high, unit)

    def string(self, path, default, choices=None):
        self._note(path, _Read("string", default, choices=None if choices is None else tuple(choices)))
        return super().string(path, default, choices)


def _dotted(path) -> str:
    parts = list(path)
    if parts[:2] == ["tuning", "gpus"] and len(parts) > 2:
        parts[2] = ID
    return ".".join(parts)


def _record(module, run) -> dict[str, _Read]:
    """The reads of run() with module's Reader recording them; a parse that fails (as the web config's does, its
    files being made up) has read its keys all the same."""
    made: list[_Recorder] = []

    def reader(doc):
        made.append(_Recorder(doc))
        return made[-1]
    with mock.patch.object(module, "Reader", reader):
        try:
            run()
        except InvalidConfig:
            pass
    reads: dict[str, _Read] = {}
    for recorder in made:
        reads.update(recorder.reads)
    return reads


def config_reads() -> dict[str, _Read]:
    """Every key of gpuwarden.yaml the parser reads, in the order it reads them: those of ENABLING, and those only
    ENABLING_ONE_HOST enables placed after the key read before them there."""
    reads: dict[str, _Read] = {}
    for doc in (ENABLING, ENABLING_ONE_HOST):
        assert configmod.parse_text(yaml.safe_dump(doc)), "an enabling document must parse"
        more = _record(configmod, lambda: configmod.parse_text(yaml.safe_dump(doc)))
        order, before = list(reads), None
        for key in more:
            if key not in reads:
                order.insert(order.index(before) + 1 if before in order else len(order), key)
            if key not in reads or reads[key].kind == "get":  # a typed read of a section the other left out
                reads[key] = more[key]
            before = key
        reads = {key: reads[key] for key in order}
    return reads


def web_reads() -> dict[str, _Read]:
    with tempfile.TemporaryDirectory() as folder:
        file = Path(folder) / "web.yml"
        file.write_text(yaml.safe_dump(WEB_ENABLING))
        return _record(webconfig, lambda: webconfig.load(file))


def leaves(reads: dict[str, _Read]) -> list[str]:
    """The keys that are settings, not sections: all but the mappings of named keys. A section's every key must
    be read (a key allowed and never read would have no entry)."""
    sections = {key: read for key, read in reads.items() if read.kind == "mapping" and read.keys is not None}
    for section, read in sections.items():
        for name in read.keys:
            child = f"{section}.{name}" if section else name
            if child not in reads:
                raise LookupError(f"{child} is allowed but never read: the walk (ENABLING) misses it")
    return [key for key in reads if key not in sections]


# -- the example file's comments and values ----------------------------------------------------------------------
_KEY_LINE = re.compile(r"^(?P<indent> *)(?P<key>[A-Za-z_]\w*):(?P<rest>.*)$")


@dataclass
class _Said:
    comment: str = ""
    value: str = ""


def example_notes(text: str, known: set[str]) -> dict[str, _Said]:
    """What the example file says of each key: the comment lines just above it (or after it on its line) and its
    value. A commented-out key (`# command: [...]`, the `# nodes:` block) counts where it is a known key, so that
    prose such as `#   gpus:` inside another key's comment is not taken for one."""
    said: dict[str, _Said] = {}
    stack: list[tuple[int, str]] = []
    prose: list[str] = []
    last: _Said | None = None  # the key a continued inline comment belongs to
    for line in text.splitlines():
        stripped = line.strip()
        commented = stripped.startswith("#")
        body = line.split("#", 1)[1][1:] if commented else line
        indent = line.index("#") if commented else 0
        match = _KEY_LINE.match(body)
        if commented and match is None:
            inner = body.strip()
            if inner.startswith("#") and last is not None:  # `#     # more of the comment above`
                last.comment += " " + inner.lstrip("# ")
            elif inner:
                prose.append(inner)
                last = None
            continue
        if match is None:  # a blank line
            prose, last = [], None
            continue
        depth = indent + len(match["indent"])
        while stack and stack[-1][0] >= depth:
            stack.pop()
        key = ".".join([k for _, k in stack] + [match["key"]])
        value, _, inline = match["rest"].partition("  #")
        if commented and key not in known:
            prose.append(body.strip())
            continue
        stack.append((depth, match["key"]))
        last = said.setdefault(key, _Said())
        last.comment = " ".join(prose + [inline.strip()]).strip()
        last.value = value.strip()
        prose = []
    return said


def _sentence(comment: str) -> str:
    """A comment as one line of text: spaces made single, its own YAML example left out (the entry has one)."""
    text = " ".join(comment.split()).split(" Example:")[0]
    return text + "." if text and not text.endswith(".") else text


def _written(value: Any) -> str:
    """A value as the config file writes it."""
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return str(int(value)) if value.is_integer() else f"{value:g}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_written(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_written(v)}" for k, v in value.items()) + "}"
    return str(value)


def flatten(value: dict, prefix: str = "") -> dict[str, Any]:
    """A nested mapping as dotted keys; an empty mapping is a value of its own (serve.env: {})."""
    out: dict[str, Any] = {}
    for key, item in value.items():
        dotted = f"{prefix}{key}"
        if isinstance(item, dict) and item:
            out.update(flatten(item, dotted + "."))
        else:
            out[dotted] = item
    return out


def _shape(key: str, read: _Read) -> tuple[str, str, str]:
    """(type, range or choices, unit) of one key."""
    if read.kind == "get":
        if key not in SHAPES:
            raise LookupError(f"{key} is read without a typed call: say its type in SHAPES ({__file__})")
        return SHAPES[key] + ("",)
    if read.kind in ("number", "optional_number"):
        kind = "integer" if read.integer else "number"
        span = f"{_written(float(read.low))}-{_written(float(read.high))}"
        return kind + (" or none" if read.kind == "optional_number" else ""), span, read.unit
    if read.kind == "string":
        return "string", ", ".join(read.choices or ()), ""
    if read.kind == "mapping":
        return "mapping", "", ""
    if read.kind == "sequence":
        return "list", "", ""
    return "boolean", "", ""


def _reload(key: str, file: str) -> str:
    top = key.split(".")[0]
    if key in RELOAD_NOTES:
        return RELOAD_NOTES[key]
    if file == WEB or top in RESTART_ONLY:  # the web config file is metrics.web_config's
        return RESTART
    if top == "serve":
        for kind in SIDE_KINDS:
            if any(key.startswith(f"serve.{section}.") for section in (kind.section, *kind.also) if section):
                return f"restarts the {kind.name} only"
        return ENGINE
    if top == "tuning":
        return REPLANS
    return AT_ONCE


def _entries(reads: dict[str, _Read], file: str, defaults: dict[str, Any], said: dict[str, _Said]) -> list[Entry]:
    out = []
    for key in leaves(reads):
        read = reads[key]
        kind, allowed, unit = _shape(key, read)
        allowed = RANGES.get(key, allowed)
        if key in DEFAULTS:
            default = DEFAULTS[key]
        elif key in defaults:
            default = _written(defaults[key])
        else:
            default = _written(read.default)
        note = said.get(key, _Said())
        meaning = MEANINGS.get(key) or _sentence(note.comment)
        if not meaning:
            raise LookupError(f"{key} has no meaning: comment it in {EXAMPLE}, or add it to MEANINGS ({__file__})")
        example = EXAMPLES.get(key) or note.value or default
        out.append(Entry(key, file, kind, default, allowed, unit, example, _reload(key, file), meaning))
    return out


def entries(root: Path = ROOT) -> list[Entry]:
    """One entry per key: gpuwarden.yaml's, in the order the parser reads them, then the web config file's."""
    reads = config_reads()
    said = example_notes((root / EXAMPLE).read_text(), set(reads))
    defaults = flatten(configmod.Config().as_dict())
    return _entries(reads, CONFIG, defaults, said) + _entries(web_reads(), WEB, {}, {})


def section_notes(root: Path = ROOT) -> dict[str, str]:
    """The example file's comment above each section (gpu:, tuning:, the commented-out serve.nodes:, ...)."""
    said = example_notes((root / EXAMPLE).read_text(), set(config_reads()))
    return {**GROUP_NOTES, **{key: _sentence(note.comment) for key, note in said.items() if not note.value}}


# -- the page and the man page -----------------------------------------------------------------------------------
def _groups(items: list[Entry]) -> dict[str, list[Entry]]:
    """The entries by the mapping they sit in, titled, in the order the parser reads them; the web config file's
    keys are one group of their own."""
    groups: dict[str, list[Entry]] = {}
    for entry in items:
        title = "The web config file (metrics.web_config)" if entry.file == WEB else entry.group or "Top level"
        groups.setdefault(title, []).append(entry)
    return groups


def _note(notes: dict[str, str], first: Entry) -> str:
    """What the group of this entry is: its section's note."""
    return notes.get(first.group if first.file == CONFIG else first.file, "")


def _man_text(text: str) -> Roff:
    """Markdown's `code` as bold, the rest escaped."""
    parts = text.split("`")
    return join(*(bold(part) if i % 2 else part for i, part in enumerate(parts)))


def _md(text: str) -> str:
    """Text as Markdown: outside code, < may open a tag and * may start emphasis."""
    parts = text.split("`")
    for i in range(0, len(parts), 2):  # outside code spans
        parts[i] = parts[i].replace("<", "&lt;").replace("*", "\\*")
    return "`".join(parts)


def markdown(items: list[Entry], notes: dict[str, str]) -> str:
    out = [
        "<!-- Generated by docs/gen/config_ref.py from the parser; do not edit. -->",
        "# Configuration reference",
        "",
        (f"Every key of `{configmod.DEFAULT_PATH}` (and of `conf.d/*.yaml` beside it, merged in lexical order), "
         "with its type, default, what a reload does with it and what it means, generated from the parser, so it is "
         "what `gpuwarden check` accepts. A value of `none` (or `null`) leaves a setting alone. How the files merge "
         "and what the settings are for: [Configuration](../configuration.md). Also `man 5 gpuwarden.yaml`."),
        "",
        "What a reload (`systemctl reload gpuwarden`, SIGHUP) does with a changed key:",
        "",
    ]
    out += [f"- **{what}**: {_md(how)}" for what, how in RELOADS] + [""]
    for title, members in _groups(items).items():
        out += [f"## {title}", ""]
        if _note(notes, members[0]):
            out += [_md(_note(notes, members[0])), ""]
        for e in members:
            out += [f"### `{e.key}`", "", f"{_md(e.accepts)} · default `{e.default}` · reload: **{e.reload}**", "",
                    _md(e.meaning), "", f"Example: `{e.key.rpartition('.')[2]}: {e.example}`", ""]
    return "\n".join(out).rstrip("\n") + "\n"


def man_page(items: list[Entry], notes: dict[str, str], root: Path = ROOT) -> str:
    source, date = release(root)
    page = ManPage("gpuwarden.yaml", "5", date, source, "File Formats")
    page.section("Name")
    page.paragraph("gpuwarden.yaml - the configuration of gpuwarden")
    page.section("Synopsis")
    page.paragraph(bold(str(configmod.DEFAULT_PATH)), "\n", bold(str(configmod.DEFAULT_PATH.parent / "conf.d")),
                   bold("/*.yaml"))
    page.section("Description")
    page.paragraph(
        "gpuwarden(8) reads its configuration from ", str(configmod.DEFAULT_PATH), ", then the files conf.d/*.yaml "
        "beside it in lexical order: mappings merge key by key, any other value replaces. A value of none (or null) "
        "leaves a setting alone. Check a change with ", bold("gpuwarden check"), " (exit 0: valid; 78: an error, "
        "printed as FILE:LINE: key: what is wrong) and see what the tuning would change with ", bold("gpuwarden plan"),
        ".\n\nEach key below gives its type and range, its default, what a reload (systemctl reload gpuwarden, "
        "SIGHUP) does when it changes, its meaning and an example.")
    page.section("Reload")
    for what, how in RELOADS:
        page.tagged(bold(what), how)
    page.section("Keys")
    for title, members in _groups(items).items():
        page.subsection(title)
        if _note(notes, members[0]):
            page.paragraph(_man_text(_note(notes, members[0])))
        for e in members:
            page.tagged(bold(e.key), f"{e.accepts}; default {e.default}; reload: {e.reload}.\n\n",
                        _man_text(e.meaning), f"\n\nExample: {e.key.rpartition('.')[2]}: {e.example}")
    page.section("Files")
    page.tagged(bold(str(configmod.DEFAULT_PATH)), "The configuration; the package's own explains every key.")
    page.tagged(bold(str(configmod.DEFAULT_PATH.parent / "conf.d") + "/*.yaml"),
                "Drop-ins merged on top, in lexical order; names starting with a dot are skipped.")
    page.tagged(bold(str(configmod.DEFAULT_PATH.parent / "profiles.d") + "/*.yaml"),
                "Serving profiles that override the built-in ones by name.")
    page.tagged(bold(str(configmod.DEFAULT_PATH.parent / "rules.d") + "/*.yaml"),
                "Lint rules added or overridden by id.")
    page.section("See also")
    page.paragraph(bold("gpuwarden"), "(8), ", bold("systemctl"), "(1)")
    return page.text()


def pages(root: Path = ROOT) -> dict[Path, str]:
    """What write() writes: the reference page and the man page, by path under root."""
    items, notes = entries(root), section_notes(root)
    return {PAGE: markdown(items, notes), MAN: man_page(items, notes, root)}


def write(root: Path = ROOT) -> list[Path]:
    written = []
    for path, text in pages(root).items():
        target = root / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)
        written.append(target)
    return written


if __name__ == "__main__":
    for path in write():
        print(path)
