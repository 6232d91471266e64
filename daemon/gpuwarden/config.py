"""The daemon's configuration: YAML in, frozen dataclasses out.

/etc/gpuwarden/gpuwarden.yaml is read first, then conf.d/*.yaml beside it in
lexical order (mappings merge, other values replace). Every problem becomes a
one-line `FILE:LINE: key.path: what is wrong (what is allowed)`.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import os
import re
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .tune import tunables
from .tune.wanted import TuningConfig, parse_tuning
from .base import webconfig, yamlfile
from .base.schema import MISSING, NONE_WORDS, Reader, type_name
from .gpu.throttle import Threshold
from .base.timedregex import PatternError, compile_patterns
from .base.webconfig import WebConfig
from .base.yamlfile import ConfigError, Document, Path_

DEFAULT_PATH = Path("/etc/gpuwarden/gpuwarden.yaml")
# What one load reads, the main file and its drop-ins together: the YAML parser costs about 15 s a MiB of CPU, and a
# reload's or a handover's load runs on the daemon's loop, whose watchdog is 30 s. The example file is 15 KiB.
MAX_CONFIG_BYTES = 256 * 1024
MAX_DROPINS = 100

@dataclass(frozen=True)
class GpuBackendConfig:
    backend: str = "nvml"
    scenario: str = "rtx-pro-4000-headless"  # for backend "sim": a built-in name or a file
    base_dir: Path | None = None  # where a relative scenario file is looked up: the config's directory


@dataclass(frozen=True)
class AlertSettings:
    for_s: float = 2.0
    clear_for_s: float = 10.0
    repeat_s: float = 600.0
    busy_utilization_pct: float = 20.0
    sm_clock_min: Threshold = Threshold(fraction=0.5)
    memory_clock_min: Threshold = Threshold(fraction=0.5)
    reapply_min_interval_s: float = 30.0
    warn_at_design_power: bool = False  # True: SwPowerCap at the card's maximum limit is power_capped too


@dataclass(frozen=True)
class HealthPolicy:
    """health: what the daemon may do by itself when a GPU turns unhealthy (watch/health.py says which GPU and
    what it needs). By default it stops the engine on a GPU that must not serve and waits for the GPU's action;
    each further step is the operator's to turn on."""

    drain_before_stop: bool = False  # drain the engine (serve.drain_s) where the GPU still answers, then stop it
    reset_gpu: bool = False  # reset a GPU whose action is a reset when nobody else's process uses it
    known_answer: bool = False  # after a recovery, a fixed prompt must give the tokens of the first healthy start
    reboots_before_inspect: int = 3  # reboots for one fault on one GPU before the action is "inspect the hardware"


ENGINE_LISTEN = ("auto", "tcp", "unix")  # serve.engine_listen
DEFAULT_LISTEN = ("127.0.0.1", 9847)  # dcgm-exporter uses 9400, nvidia_gpu_exporter 9835


@dataclass(frozen=True)
class MetricsConfig:
    listen: tuple[str, int] | None = DEFAULT_LISTEN  # None: no HTTP endpoint
    web: WebConfig | None = None  # TLS and basic auth (metrics.web_config)

    @property
    def url(self) -> str | None:
        if self.listen is None:
            return None
        host, port = self.listen
        scheme = "https" if self.web is not None and self.web.tls else "http"
        return f"{scheme}://[{host}]:{port}" if ":" in host else f"{scheme}://{host}:{port}"


@dataclass(frozen=True)
class ProxyConfig:
    """serve.proxy: the prefix-cache normalizing proxy (gpuwarden/proxy/), a child beside the engine."""

    enabled: bool = False
    listen: tuple[str, int] = ("127.0.0.1", 8001)
    billing_header: bool = True
    cache_control: bool = True
    sort_tools: bool = True
    date_line: bool = False
    remove_patterns: tuple[str, ...] = ()  # regexes removed from system text
    dump_dir: Path | None = None  # per-session request dumps, for `gpuwarden proxy diff`; None: off
    dump_keep: int = 200
    dump_max_bytes: int = 1 << 30  # the dump directory's bytes, beside the count
    max_body_bytes: int = 32 << 20
    client_timeout_s: float = 15.0  # a request's head and body (plus 1 s per 16 KiB), and an idle connection
    hold_s: float = 300.0  # the longest a request waits for the engine to come back (a big model restarts in minutes)
    hold_max: int = 256  # requests held at once
    refuse_after_ends: int = 2  # a client in flight at this many ends within crash_loop_window_s: 429 (0: never)

    @property
    def address(self) -> str:
        """HOST:PORT, an IPv6 host in brackets."""
        host = f"[{self.listen[0]}]" if ":" in self.listen[0] else self.listen[0]
        return f"{host}:{self.listen[1]}"


NODE_BACKENDS = ("mp", "ray")  # vLLM's own multi-node mode (--nnodes/--node-rank/--headless), or a Ray cluster


CONTAINER_RUNTIMES = {"podman": "/run/podman/podman.sock", "docker": "/run/docker.sock"}  # runtime: its socket
# An image reference as podman and Docker take one: [registry[:port]/]path[:tag][@sha256:digest], nothing else
# (no space, no option-like leading dash).
IMAGE_RE = re.compile(r"[a-z0-9][a-z0-9._-]*(?::[0-9]+)?(?:/[a-z0-9][a-z0-9._-]*)*(?::[A-Za-z0-9_][A-Za-z0-9._-]{0,127})?"
                      r"(?:@sha256:[0-9a-f]{64})?")
MOUNT_PATH_RE = re.compile(r"/[A-Za-z0-9._@+/-]*")  # absolute, no ':' or ',' (the runtimes' own separators)


@dataclass(frozen=True)
class Mount:
    host: str
    container: str
    read_only: bool = True

    def text(self) -> str:
        return f"{self.host}:{self.container}:{'ro' if self.read_only else 'rw'}"


@dataclass(frozen=True)
class ContainerConfig:
    """serve.container: the engine runs from a local image through the runtime's API (serving/compose/container.py);
    serve.command is then the command inside the image."""

    image: str = ""
    runtime: str = "podman"
    socket: str = ""  # the runtime's API socket; not given: the runtime's usual one (CONTAINER_RUNTIMES)
    mounts: tuple[Mount, ...] = ()
    pull: bool = False  # pull the image when it is missing (else a missing image is a config error at check)
    # /dev/shm's size inside: NCCL between the GPUs of one container and PyTorch's DataLoader use it, and the
    # runtimes' 64 MiB breaks tensor parallelism (the seed's `docker run --shm-size=64g`); a limit, not a reservation
    shm_gib: int = 16

    @property
    def api_socket(self) -> str:
        return self.socket or CONTAINER_RUNTIMES[self.runtime]


IDLE_ACTIONS = ("stop", "clocks")  # design/idle-engine.md
# serve.idle's clocks puts the clocks back at the daemon's next tick after the proxy's wake (the word pipes are read
# each poll): the proxy holds a request that long, IDLE_CLOCKS_BACK_S at most (proxy/hold.py), then sends it as it
# is. So the poll must be well inside it, and hold_s must outlast it.
IDLE_CLOCKS_BACK_S = 10.0
IDLE_CLOCKS_POLL_MAX_S = 2.0
IDLE_CLOCKS_HOLD_MIN_S = IDLE_CLOCKS_BACK_S + 5.0  # the hold outlasts the fallback by more than a busy tick


@dataclass(frozen=True)
class IdleConfig:
    """serve.idle: what an engine gives back while no request comes (design/idle-engine.md): after after_s with no
    request and none in flight, `stop` stops it, `clocks` locks its GPUs at their lowest SM clock and keeps it
    running; the proxy holds the next request until it is started again, or its clocks are put back."""

    action: str = "stop"
    after_s: float = 600.0


@dataclass(frozen=True)
class NodesConfig:
    """serve.nodes: one engine across hosts. The same file on every node, but for rank (or hosts, where each
    node finds its own rank among its addresses: serving/compose/nodes.py). gpuwarden adds no cluster protocol:
    the engine's own rendezvous (or Ray's) joins the nodes, each node's daemon supervises its own part."""

    count: int = 1
    rank: int | None = None  # None: the index of this host's address in hosts
    hosts: tuple[str, ...] = ()  # every node's address, in rank order (hosts[0] is the head)
    head: str = ""  # the head's address (default hosts[0]); its rendezvous port is port
    port: int = 29500  # the head's rendezvous: vLLM's --master-port, or Ray's GCS port
    backend: str = "mp"
    interface: str | None = None  # the NIC the collectives use: NCCL_SOCKET_IFNAME and GLOO_SOCKET_IFNAME

    @property
    def address(self) -> str:
        """HEAD:PORT, an IPv6 head in brackets."""
        return f"[{self.head}]:{self.port}" if ":" in self.head else f"{self.head}:{self.port}"


@dataclass(frozen=True)
class ServeConfig:
    """The serving child (vLLM by default): what to run, as whom, and how to supervise it."""

    enabled: bool = False
    engine: str = "vllm"  # a module of serving/compose/engines/
    profile: str = "auto"
    model: str = ""
    command: tuple[str, ...] = ()  # the entry point, then flags; empty: the engine's own (vllm serve)
    python: str | None = None  # the engine's interpreter for the flag check; None: derived from command
    host: str = "127.0.0.1"
    port: int = 8000
    # Where the engine listens: tcp (serve.host:serve.port), unix (a socket only root and serve.user can reach:
    # serving/compose/enginesock.py), or auto: unix where the proxy is in front and the engine can, else tcp.
    engine_listen: str = "auto"
    user: str = "gpuwarden"
    gpus: tuple[str, ...] | None = None  # indices or UUIDs; None: all
    args: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    env_file: Path | None = None  # KEY=VALUE secrets for the child, in a root-only file (serving/compose/secrets.py)
    allow_lint_errors: bool = False
    startup_timeout_s: float = 1800.0
    stop_timeout_s: float = 30.0
    # A planned stop lets the requests in flight finish for this long (vLLM's --shutdown-timeout); 0: they are
    # aborted at SIGTERM, as before (serving/compose/drain.py).
    drain_s: int = 60
    liveness_interval_s: float = 10.0
    liveness_failures: int = 3
    backoff_max_s: float = 60.0
    stable_after_s: float = 300.0
    crash_loop_failures: int = 5
    crash_loop_window_s: float = 600.0
    # A stall: requests running or waiting and no token counted for this long (see serving/watch/stall.py for why 300).
    stall_after_s: float = 300.0
    probe_after_s: float = 60.0  # idle this long: a one-token completion checks the engine (0: never)
    probe_timeout_s: float = 30.0
    restart_on_stall: bool = True
    profiles_dir: Path | None = None  # profiles.d beside the config file
    rules_dir: Path | None = None  # rules.d beside the config file: lint rules added or overridden by id
    proxy: ProxyConfig = ProxyConfig()
    nodes: NodesConfig | None = None  # None: one host
    container: ContainerConfig | None = None  # None: the engine is a process from a Python environment here
    idle: IdleConfig | None = None  # None: the engine is kept as it is while no request comes

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"


@dataclass(frozen=True)
class Config:
    gpu: GpuBackendConfig = GpuBackendConfig()
    poll_interval_s: float = 1.0
    counters_interval_s: float = 10.0
    log_interval_s: float = 60.0
    tuning: TuningConfig = field(default_factory=TuningConfig)
    alerts: AlertSettings = AlertSettings()
    health: HealthPolicy = HealthPolicy()
    metrics: MetricsConfig = MetricsConfig()
    serve: ServeConfig = ServeConfig()
    files: tuple[str, ...] = ()
    document: Document | None = field(default=None, compare=False, repr=False)

    def as_dict(self) -> dict:
        """The effective settings, in the config file's own shape (parses back to an equal Config)."""
        def per_gpu(settings: dict) -> dict:
            return {k: tunables.BY_KEY[k].config_value(v) for k, v in settings.items()}

        t, a = self.tuning, self.alerts
        listen = self.metrics.listen
        return {
            "gpu": {"backend": self.gpu.backend, "scenario": self.gpu.scenario},
            "poll_interval_s": self.poll_interval_s,
            "counters_interval_s": self.counters_interval_s,
            "log_interval_s": self.log_interval_s,
            "alerts": {
                "for_s": a.for_s, "clear_for_s": a.clear_for_s, "repeat_s": a.repeat_s,
                "busy_utilization_pct": a.busy_utilization_pct,
                "sm_clock_min_mhz": _threshold_value(a.sm_clock_min),
                "memory_clock_min_mhz": _threshold_value(a.memory_clock_min),
                "reapply_min_interval_s": a.reapply_min_interval_s,
                "warn_at_design_power": a.warn_at_design_power,
            },
            "health": dataclasses.asdict(self.health),
            "metrics": {"listen": "none" if listen is None else self.metrics.url.split("//", 1)[1],
                        "web_config": "none" if self.metrics.web is None else self.metrics.web.file},
            "serve": _serve_dict(self.serve),
            "tuning": {
                "apply": t.apply, "restore_on_stop": t.restore_on_stop,
                "power_budget_w": "none" if t.power_budget_w is None else t.power_budget_w,
                "power_shares": dict(t.power_shares),
                **per_gpu(dict(t.default.wanted)),
                "gpus": {key: per_gpu(dict(settings)) for key, settings in t.overrides},
            },
        }

    @property
    def reapply_min_interval_s(self) -> float:
        return self.alerts.reapply_min_interval_s

    def error(self, path: Path_, message: str, allowed: str | None = None) -> ConfigError:
        """A ConfigError pointing at the file and line that set `path`."""
        if self.document is None:
            return ConfigError("(defaults)", 0, yamlfile.key_name(path), message, allowed)
        return self.document.error(path, message, allowed)


def dropin_files(path: Path) -> list[Path]:
    """conf.d/*.yaml in lexical order. As systemd and sudo do with their drop-in directories, names that
    start with "." (editor lock files such as .#x.yaml, hidden files) are skipped; backups (x.yaml~,
    x.yaml.bak, x.yaml.dpkg-old) do not end in .yaml. A conf.d we cannot list is an error, not an empty one."""
    conf_d = path.parent / "conf.d"
    try:
        names = sorted(entry.name for entry in os.scandir(conf_d))
    except FileNotFoundError:
        return []
    except NotADirectoryError:
        raise ConfigError(str(conf_d), 1, "(file)", "is not a directory") from None
    except PermissionError:
        raise ConfigError(str(conf_d), 1, "(file)", "permission denied: its drop-ins cannot be checked",
                          "run as root") from None
    return [conf_d / name for name in names if name.endswith(".yaml") and not name.startswith(".")]


def load(path: str | Path = DEFAULT_PATH) -> Config:
    """Read, merge and validate; raise ConfigErrors listing every problem."""
    path = Path(path)
    files = [path, *dropin_files(path)]
    if len(files) - 1 > MAX_DROPINS:
        raise ConfigError(str(path.parent / "conf.d"), 1, "(file)", f"{len(files) - 1} drop-ins, more than "
                          f"{MAX_DROPINS}", "merge them: a drop-in is a few settings")
    doc, left = None, MAX_CONFIG_BYTES
    for file in files:
        part, size = _load_mapping(file, dropin=file != path, max_bytes=left)
        left -= size
        doc = part if doc is None else yamlfile.merge(doc, part)
    return _validate(doc, tuple(str(f) for f in files))


def parse_text(text: str, name: str = "<config>") -> Config:
    """Validate config text (used by tests and `check` on stdin-like input)."""
    return _validate(_mapping_or_error(yamlfile.parse(text, name)), (name,))


def config_warnings(config: Config) -> list[ConfigError]:
    """Settings the config accepts that undo what another is for: the user's choice, so `check` prints each as a
    warning, one line naming the key, and nothing refuses to start."""
    found = []
    serve, proxy = config.serve, config.serve.proxy
    if proxy.enabled and proxy.refuse_after_ends >= serve.crash_loop_failures:
        found.append(config.error(
            ("serve", "proxy", "refuse_after_ends"),
            f"{proxy.refuse_after_ends} is not below serve.crash_loop_failures ({serve.crash_loop_failures}): one "
            "client whose requests end the engine can take it to FATAL (no engine for anyone until SIGHUP) before "
            "the proxy refuses it", f"1 to {serve.crash_loop_failures - 1} refuses it first"
            if serve.crash_loop_failures > 1 else None))
    return found


def _load_mapping(file: Path, dropin: bool, max_bytes: int) -> tuple[Document, int]:
    """The file's mapping (a drop-in of only comments is fine) and its size in bytes."""
    text = yamlfile.read_text(file, max_bytes, f"the config and its drop-ins are {MAX_CONFIG_BYTES // 1024} KiB "
                                               "at most in all (a config is a few KiB)")
    return _mapping_or_error(yamlfile.parse(text, str(file), empty_ok=dropin)), len(text.encode())


def _mapping_or_error(doc: Document) -> Document:
    if not isinstance(doc.value, dict):
        raise ConfigError(doc.file, doc.root_line, "(top level)",
                          f"expected a mapping of settings, got {type_name(doc.value)}")
    return doc


BESIDE_CONFIG = ("profiles_dir", "rules_dir")  # directories found beside the config file, not keys in it


def _serve_dict(s: ServeConfig) -> dict:
    out = {f.name: getattr(s, f.name) for f in dataclasses.fields(s) if f.name not in BESIDE_CONFIG}
    out.update(command=list(s.command), args=list(s.args), env=dict(s.env),
               gpus="all" if s.gpus is None else list(s.gpus), python=s.python or "auto",
               env_file="none" if s.env_file is None else str(s.env_file), proxy=_proxy_dict(s.proxy))
    if s.container is None:
        del out["container"]
    else:
        c = s.container
        out["container"] = {"image": c.image, "runtime": c.runtime, "socket": c.api_socket, "pull": c.pull,
                            "mounts": [m.text() for m in c.mounts], "shm_gib": c.shm_gib}
    if s.idle is None:
        del out["idle"]
    else:
        out["idle"] = {"action": s.idle.action, "after_s": s.idle.after_s}
    if s.nodes is None:
        del out["nodes"]
    else:
        n = s.nodes
        out["nodes"] = {"count": n.count, "hosts": list(n.hosts), "head": n.head, "port": n.port,
                        "backend": n.backend, "interface": n.interface or "none"}
        if n.rank is not None:
            out["nodes"]["rank"] = n.rank
    if not s.model:
        del out["model"]  # unset is not an empty string
    if not s.command:
        del out["command"]  # the engine's own
    return out


def _proxy_dict(p: ProxyConfig) -> dict:
    out = {f.name: getattr(p, f.name) for f in dataclasses.fields(p)}
    out.update(listen=p.address, remove_patterns=list(p.remove_patterns),
               dump_dir="none" if p.dump_dir is None else str(p.dump_dir))
    return out


def _threshold_value(t: Threshold) -> Any:
    return t.mhz if t.mhz is not None else f"{t.fraction * 100:g}%"


def _validate(doc: Document, files: tuple[str, ...]) -> Config:
    r = Reader(doc)
    r.mapping((), ("gpu", "poll_interval_s", "counters_interval_s", "log_interval_s", "tuning", "alerts",
                   "health", "metrics", "serve"))
    d = Config()
    gpu = _gpu_section(r, Path(doc.file).parent)
    poll = r.number(("poll_interval_s",), d.poll_interval_s, 0.05, 3600, unit=" s")
    counters = r.number(("counters_interval_s",), d.counters_interval_s, 1, 86400, unit=" s")
    log_interval = r.number(("log_interval_s",), d.log_interval_s, 0, 86400, unit=" s")
    tuning = parse_tuning(r)
    alerts = _alerts_section(r)
    health = _health_section(r)
    metrics = MetricsConfig(_listen(r, ("metrics", "listen")), _web_config(r, Path(doc.file).parent))
    r.mapping(("metrics",), ("listen", "web_config"))
    serve = _serve_section(r, Path(doc.file).parent)
    _listeners_apart(r, listeners(metrics, serve))
    _idle_fits(r, serve, tuning.apply, float(poll))
    r.raise_if_errors()
    return Config(gpu=gpu, poll_interval_s=float(poll), counters_interval_s=float(counters),
                  log_interval_s=float(log_interval), tuning=tuning, alerts=alerts, health=health, metrics=metrics,
                  serve=serve, files=files, document=doc)


def _serve_section(r: Reader, base_dir: Path) -> ServeConfig:
    base = ("serve",)
    d = ServeConfig()
    r.mapping(base, [f.name for f in dataclasses.fields(ServeConfig) if f.name not in BESIDE_CONFIG])
    enabled = r.boolean(base + ("enabled",), d.enabled)
    model = r.string(base + ("model",), d.model)
    if enabled and not model:
        r.fail(base + ("enabled",), "serving is enabled but serve.model is not set", "a model path or name")
    command = tuple(_string_list(r, base + ("command",), d.command))
    if not command and r.get(base + ("command",)) is not MISSING:
        r.fail(base + ("command",), "the command is empty", "an entry point such as [vllm, serve], or leave it out")
    python = r.string(base + ("python",), "auto")
    user = r.string(base + ("user",), d.user)
    if user == "root":
        r.fail(base + ("user",), "the serving engine never runs as root", "an unprivileged user such as gpuwarden")
    gpus = r.get(base + ("gpus",))
    if gpus is MISSING or gpus == "all":
        gpus = None
    elif not (isinstance(gpus, list) and gpus and all(isinstance(g, (int, str)) and not isinstance(g, bool)
                                                      for g in gpus)):
        r.fail(base + ("gpus",), f"expected all or a list of GPU indices or UUIDs, got {gpus!r}")
        gpus = None
    else:
        gpus = tuple(str(g) for g in gpus)
    env = r.mapping(base + ("env",), None)
    for key, value in env.items():
        if not isinstance(value, str):
            r.fail(base + ("env", key), f"expected a string, got {type_name(value)} {value!r}", 'quote it: "1"')
        elif "\0" in value:
            r.fail(base + ("env", key), "contains a NUL byte, which no process environment can hold")
        if not key or "=" in key or "\0" in key:
            r.fail(base + ("env", key), f"{key!r} cannot be an environment variable name",
                   "a name without '=' or NUL, such as VLLM_LOGGING_LEVEL")
    args = tuple(_string_list(r, base + ("args",), d.args))
    for name, values in (("command", command), ("args", args), ("model", (model,))):
        for i, value in enumerate(values):
            if "\0" in value:
                path = base + (name,) if name == "model" else base + (name, str(i))
                r.fail(path, "contains a NUL byte, which no command line can hold")
    env_file = r.string(base + ("env_file",), "none")
    env_file = None if str(env_file).lower() in NONE_WORDS else base_dir / env_file
    number = r.number
    return ServeConfig(
        enabled=enabled, engine=r.string(base + ("engine",), d.engine),
        profile=r.string(base + ("profile",), d.profile), model=model, command=command,
        python=None if python == "auto" else python,
        host=r.string(base + ("host",), d.host),
        port=r.number(base + ("port",), d.port, 1, 65535, integer=True),
        engine_listen=r.string(base + ("engine_listen",), d.engine_listen, ENGINE_LISTEN),
        user=user, gpus=gpus, args=args,
        env=tuple((k, str(v)) for k, v in env.items()), env_file=env_file,
        allow_lint_errors=r.boolean(base + ("allow_lint_errors",), d.allow_lint_errors),
        startup_timeout_s=float(number(base + ("startup_timeout_s",), d.startup_timeout_s, 1, 86400, unit=" s")),
        stop_timeout_s=float(number(base + ("stop_timeout_s",), d.stop_timeout_s, 1, 3600, unit=" s")),
        drain_s=number(base + ("drain_s",), d.drain_s, 0, 3600, integer=True, unit=" s"),
        liveness_interval_s=float(number(base + ("liveness_interval_s",), d.liveness_interval_s, 0.1, 3600,
                                         unit=" s")),
        liveness_failures=number(base + ("liveness_failures",), d.liveness_failures, 1, 100, integer=True),
        backoff_max_s=float(number(base + ("backoff_max_s",), d.backoff_max_s, 1, 3600, unit=" s")),
        stable_after_s=float(number(base + ("stable_after_s",), d.stable_after_s, 1, 86400, unit=" s")),
        crash_loop_failures=number(base + ("crash_loop_failures",), d.crash_loop_failures, 1, 1000, integer=True),
        crash_loop_window_s=float(number(base + ("crash_loop_window_s",), d.crash_loop_window_s, 1, 86400,
                                         unit=" s")),
        stall_after_s=float(number(base + ("stall_after_s",), d.stall_after_s, 1, 86400, unit=" s")),
        probe_after_s=float(number(base + ("probe_after_s",), d.probe_after_s, 0, 86400, unit=" s")),
        probe_timeout_s=float(number(base + ("probe_timeout_s",), d.probe_timeout_s, 1, 3600, unit=" s")),
        restart_on_stall=r.boolean(base + ("restart_on_stall",), d.restart_on_stall),
        profiles_dir=base_dir / "profiles.d",
        rules_dir=base_dir / "rules.d",
        proxy=_proxy_section(r, base_dir),
        nodes=_nodes_section(r),
        container=_container_section(r),
        idle=_idle_section(r),
    )


IDLE_MIN_S, IDLE_MAX_S = 10, 86400


def _idle_section(r: Reader) -> IdleConfig | None:
    base = ("serve", "idle")
    if r.get(base) in (MISSING, None):  # `idle:` with every key commented out: off, as it reads
        return None
    d = IdleConfig()
    r.mapping(base, [f.name for f in dataclasses.fields(IdleConfig)])
    return IdleConfig(action=r.string(base + ("action",), d.action, IDLE_ACTIONS),
                      after_s=float(r.number(base + ("after_s",), d.after_s, IDLE_MIN_S, IDLE_MAX_S, unit=" s")))


def _idle_fits(r: Reader, serve: ServeConfig, tuning_applies: bool, poll_s: float) -> None:
    """serve.idle against the rest of the config: the proxy must be in front (it sees every request and holds the
    first one while the engine wakes); one host only; `clocks` sets the GPUs' clocks, which a read-only daemon
    does not."""
    idle = serve.idle
    if idle is None:
        return
    if idle.action == "clocks" and not tuning_applies:
        r.fail(("serve", "idle", "action"), "serve.idle's clocks locks the GPUs' clocks while the engine rests, and "
               "this daemon is read-only (tuning.apply: false)", "tuning.apply: true, or action: stop")
    elif idle.action == "clocks" and poll_s > IDLE_CLOCKS_POLL_MAX_S:
        r.fail(("serve", "idle", "action"), f"serve.idle's clocks puts the clocks back at the daemon's next poll, "
               f"and poll_interval_s is {poll_s:g} s: the request that wakes the engine would wait that long "
               f"(past {IDLE_CLOCKS_BACK_S:g} s it is sent at the lowest clock)",
               f"poll_interval_s at most {IDLE_CLOCKS_POLL_MAX_S:g}, or action: stop")
    if idle.action == "clocks" and serve.container is not None:
        r.fail(("serve", "idle", "action"), "serve.idle's clocks does not rest GPUs where processes that are not the "
               "daemon's compute, and a container engine's processes are the container runtime's", "action: stop")
    if idle.action == "clocks" and serve.proxy.enabled and 0 < serve.proxy.hold_s < IDLE_CLOCKS_HOLD_MIN_S:
        r.fail(("serve", "idle", "action"), f"serve.idle's clocks holds the request that wakes the engine up to "
               f"{IDLE_CLOCKS_BACK_S:g} s, and serve.proxy.hold_s is {serve.proxy.hold_s:g} s: it could be refused "
               "while the engine serves", f"serve.proxy.hold_s at least {IDLE_CLOCKS_HOLD_MIN_S:g}")
    if not serve.proxy.enabled:
        r.fail(("serve", "idle"), "serve.idle needs the proxy in front of the engine: it sees every request, and "
               "holds the first one while the engine wakes", "serve.proxy.enabled: true")
    elif serve.proxy.hold_s <= 0:
        r.fail(("serve", "idle"), "serve.idle needs serve.proxy.hold_s above 0: the request that wakes the engine "
               "waits at the proxy until it is healthy", "serve.proxy.hold_s longer than a start of the engine")
    if serve.nodes is not None:
        r.fail(("serve", "idle"), "an engine that spans hosts does not rest (not yet with serve.nodes)",
               "leave out serve.idle, or serve.nodes")


def _container_section(r: Reader) -> ContainerConfig | None:
    base = ("serve", "container")
    if r.get(base) is MISSING:
        return None
    d = ContainerConfig()
    r.mapping(base, [f.name for f in dataclasses.fields(ContainerConfig)], required=("image",))
    image = r.string(base + ("image",), "")
    if image and (not isinstance(image, str) or not IMAGE_RE.fullmatch(image)):
        r.fail(base + ("image",), f"not an image reference: {image!r}",
               "a local image such as localhost/vllm-cpu:v0.32 or docker.io/vllm/vllm-openai:v0.32.0")
    runtime = r.string(base + ("runtime",), d.runtime, tuple(CONTAINER_RUNTIMES))
    socket_path = r.string(base + ("socket",), "")
    if socket_path and (not isinstance(socket_path, str) or not MOUNT_PATH_RE.fullmatch(socket_path)):
        r.fail(base + ("socket",), f"not an absolute path: {socket_path!r}",
               "the runtime's API socket, such as /run/podman/podman.sock")
    mounts = []
    for i, text in enumerate(_string_list(r, base + ("mounts",), ())):
        mount = _mount(text)
        if isinstance(mount, str):
            r.fail(base + ("mounts", str(i)), mount, "HOST:CONTAINER, or HOST:CONTAINER:ro (the default) or :rw, "
                   "both absolute paths")
        elif any(m.container == mount.container for m in mounts):
            r.fail(base + ("mounts", str(i)), f"{mount.container} is mounted twice", "one mount per path inside")
        else:
            mounts.append(mount)
    socket_path = socket_path if isinstance(socket_path, str) and socket_path else CONTAINER_RUNTIMES.get(runtime, "")
    return ContainerConfig(image=image if isinstance(image, str) else "", runtime=runtime, socket=socket_path,
                           mounts=tuple(mounts),
                           pull=r.boolean(base + ("pull",), d.pull),
                           shm_gib=r.number(base + ("shm_gib",), d.shm_gib, 1, 4096, integer=True, unit=" GiB"))


def _mount(text: str) -> Mount | str:
    """HOST:CONTAINER[:ro|:rw] as a Mount, or why not."""
    parts = text.split(":")
    mode = "ro"
    if len(parts) == 3:
        mode = parts.pop()
    if len(parts) != 2 or mode not in ("ro", "rw"):
        return f"not HOST:CONTAINER[:ro|:rw]: {text!r}"
    for part in parts:
        if not MOUNT_PATH_RE.fullmatch(part) or "/../" in part + "/" or part.endswith("/.."):
            return f"{part!r} is not an absolute path of letters, digits and ._@+-/ (no '..')"
    return Mount(parts[0], parts[1], mode == "ro")


def node_address(text: Any) -> str | None:
    """The canonical text of a numeric IP address (as the kernel's tables give it back: 'FD00:0::2' is
    'fd00::2', '::ffff:10.0.0.2' is '10.0.0.2'); None if text is not one. Names are refused, not resolved: a
    lookup would block the daemon's loop at a reload, and /proc/net/tcp, which the lost-rank watch reads,
    holds numbers only."""
    if not isinstance(text, str):
        return None
    try:
        address = ipaddress.ip_address(text)
    except ValueError:  # also a name, '', '127.1', a NUL or a newline: none of them reaches a socket or argv
        return None
    if isinstance(address, ipaddress.IPv6Address):
        if address.scope_id:  # 'fe80::1%eth1': the kernel's tables hold 'fe80::1', so it would never match
            return None
        if address.ipv4_mapped:
            return str(address.ipv4_mapped)
        return socket.inet_ntop(socket.AF_INET6, address.packed)  # as ports reads the tables ('::1.2.3.4')
    return str(address)


def _node_address(r: Reader, path: Path_, value: Any) -> str:
    address = node_address(value)
    if address is None and isinstance(value, str) and "%" in value:
        r.fail(path, f"a scoped address ({value!r}) is not taken", "a global or unique-local address of the node; "
               "the interface goes in serve.nodes.interface")
        return ""
    if address is None:
        r.fail(path, f"not a numeric IP address: {value!r}", "the node's IP address, e.g. 10.0.0.2; a name is never looked up")
        return ""
    ip = ipaddress.ip_address(address)
    if ip.is_unspecified or ip.is_multicast:
        r.fail(path, f"{address} is not one node's address", "the address this node is reached at, e.g. 10.0.0.2")
        return ""
    return address


def _nodes_section(r: Reader) -> NodesConfig | None:
    base = ("serve", "nodes")
    if r.get(base) is MISSING:
        return None
    d = NodesConfig()
    r.mapping(base, [f.name for f in dataclasses.fields(NodesConfig)])
    count = r.number(base + ("count",), 2, 1, 1024, integer=True)
    hosts = tuple(_node_address(r, base + ("hosts", str(i)), host)
                  for i, host in enumerate(_string_list(r, base + ("hosts",), ())))
    for i, host in enumerate(hosts):
        if host and host in hosts[:i]:
            r.fail(base + ("hosts", str(i)), f"{host} is also entry {hosts.index(host)}", "one address per node")
    if hosts and len(hosts) != count:
        r.fail(base + ("hosts",), f"{len(hosts)} hosts for count {count}", "one address per node, head first")
    rank = r.get(base + ("rank",))
    if rank is MISSING:
        rank = None
        if not hosts:
            r.fail(base + ("rank",), "this node's rank is not set, and no hosts list to find it in",
                   f"rank: 0-{count - 1} (0 is the head), or hosts: [HEAD, ...]")
    else:
        rank = r.number(base + ("rank",), 0, 0, count - 1, integer=True)
    head = r.get(base + ("head",))
    if head is MISSING:
        head = hosts[0] if hosts else ""
        if not head and not hosts:
            r.fail(base + ("head",), "the head's address is not set", "head: ADDRESS, or hosts: [HEAD, ...]")
    else:  # numeric, as hosts: it goes into argv (--master-addr) and into a PromQL label matcher in the rules
        head = _node_address(r, base + ("head",), head)
    port = r.number(base + ("port",), d.port, 1, 65535, integer=True)  # apart from the other listeners: listeners()
    interface = r.string(base + ("interface",), "none")
    return NodesConfig(count=count, rank=rank, hosts=hosts, head=head,
                       port=port,
                       backend=r.string(base + ("backend",), d.backend, NODE_BACKENDS),
                       interface=None if str(interface).lower() in NONE_WORDS else interface)


def _proxy_section(r: Reader, base_dir: Path) -> ProxyConfig:
    base = ("serve", "proxy")
    d = ProxyConfig()
    r.mapping(base, [f.name for f in dataclasses.fields(ProxyConfig)])
    listen = _listen(r, base + ("listen",), d.listen, "HOST:PORT such as 127.0.0.1:8001; 0.0.0.0:8001 opens it to "
                     "the network")
    if listen is None:
        r.fail(base + ("listen",), "the proxy needs an address to listen on", "HOST:PORT such as 127.0.0.1:8001")
        listen = d.listen
    elif (mapped := _ipv4_mapped(listen[0])) is not None:
        # The kernel names such a socket '::ffff:127.0.0.1', Python's ipaddress (before 3.13) '::ffff:7f00:1': no
        # one spelling to compare the kept socket by, and an IPv6 socket at all where an IPv4 one is meant.
        r.fail(base + ("listen",), f"'{r.get(base + ('listen',))}' is an IPv4-mapped IPv6 address",
               f"the IPv4 address itself, {mapped}:{listen[1]}")
        listen = d.listen
    elif _not_canonical(listen[0]):  # compared with the kept socket's getsockname() (base/keptlistener.py)
        r.fail(base + ("listen",), f"'{r.get(base + ('listen',))}' is not a numeric IP address in canonical form",
               f"an IP literal such as 127.0.0.1:{listen[1]} or [::1]:{listen[1]}" + (
                   f", i.e. {_bracket(_canonical(listen[0]))}:{listen[1]}" if _canonical(listen[0]) else
                   "; the proxy takes no host name"))
        listen = d.listen
    patterns = tuple(_string_list(r, base + ("remove_patterns",), ()))
    for index, pattern in enumerate(patterns):
        if pattern == "--":  # argparse takes "--remove-pattern=--" for the end of options: the proxy would not start
            r.fail(base + ("remove_patterns", str(index)), "'--' cannot reach the proxy's command line",
                   "the same pattern written '-{2}'")
    try:
        compile_patterns(patterns)  # as the proxy compiles them (base/timedregex: each match within a time limit)
    except PatternError as exc:  # a{4294967295}, 1,000 nested groups, copies past MAX_REPEATS in all
        r.fail(base + ("remove_patterns", str(exc.index)), f"not a regular expression: {exc}",
               r"a Python regex, e.g. '^Timestamp: [^\n]*\n'")
    dump_dir = r.string(base + ("dump_dir",), "none")
    flag = r.boolean
    return ProxyConfig(
        enabled=flag(base + ("enabled",), d.enabled), listen=listen,
        billing_header=flag(base + ("billing_header",), d.billing_header),
        cache_control=flag(base + ("cache_control",), d.cache_control),
        sort_tools=flag(base + ("sort_tools",), d.sort_tools), date_line=flag(base + ("date_line",), d.date_line),
        remove_patterns=patterns,
        dump_dir=None if str(dump_dir).lower() in NONE_WORDS else base_dir / dump_dir,
        dump_keep=r.number(base + ("dump_keep",), d.dump_keep, 2, 100_000, integer=True),
        dump_max_bytes=r.number(base + ("dump_max_bytes",), d.dump_max_bytes, 1 << 20, 1 << 40, integer=True),
        max_body_bytes=r.number(base + ("max_body_bytes",), d.max_body_bytes, 1 << 10, 1 << 30, integer=True),
        client_timeout_s=r.number(base + ("client_timeout_s",), d.client_timeout_s, 0.1, 3600),
        hold_s=r.number(base + ("hold_s",), d.hold_s, 0, 3600),
        hold_max=r.number(base + ("hold_max",), d.hold_max, 1, 4096, integer=True),
        refuse_after_ends=r.number(base + ("refuse_after_ends",), d.refuse_after_ends, 0, 1000, integer=True),
    )


@dataclass(frozen=True)
class Listener:
    """A socket the daemon or one of its children listens on, as the config sets it."""

    key: str  # the key that sets its port
    paths: tuple[Path_, ...]  # the keys that set its address and port, the one an error points at first
    what: str
    host: str  # "*": every address of the port
    port: int

    @property
    def address(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    def takes(self, other: Listener) -> bool:
        """Would the two contend for one socket? An address is part of a port: 127.0.0.1:P and 127.0.0.2:P are two
        sockets; a wildcard (0.0.0.0, ::, every address) takes P on every address, IPv4's and IPv6's (a dual-stack
        :: holds 0.0.0.0 too); a name is never looked up, so it may be any address of its port."""
        if self.port != other.port:
            return False
        mine, theirs = _bound_address(self.host), _bound_address(other.host)
        return mine in (None, "*") or theirs in (None, "*") or mine == theirs


def _bound_address(host: str) -> str | None:
    """The canonical address ("*" for every one), or None for a name."""
    if host == "*":
        return "*"
    address = node_address(host.split("%")[0])
    return "*" if address is not None and ipaddress.ip_address(address).is_unspecified else address


def listeners(metrics: MetricsConfig, serve: ServeConfig) -> list[Listener]:
    """Everything the config makes listen on TCP: the metrics endpoint, and while serving, the engine's API, the
    proxy, and the head's rendezvous of a multi-node engine (vLLM's --master-port, Ray's GCS: bound on every
    address, and the file is the head's too)."""
    out = []
    if metrics.listen is not None:
        out.append(Listener("metrics.listen", (("metrics", "listen"),), "the metrics endpoint", *metrics.listen))
    if serve.enabled and serve.engine_listen != "unix":  # on a Unix socket it listens on no port
        out.append(Listener("serve.port", (("serve", "port"), ("serve", "host")), "the engine's API, on serve.host",
                            serve.host, serve.port))
        if serve.proxy.enabled:
            out.append(Listener("serve.proxy.listen", (("serve", "proxy", "listen"),), "the proxy",
                                *serve.proxy.listen))
        if serve.nodes is not None:
            out.append(Listener("serve.nodes.port", (("serve", "nodes", "port"),),
                                "the head's rendezvous, on every address", "*", serve.nodes.port))
    return out


def _listeners_apart(r: Reader, found: list[Listener]) -> None:
    """Two listeners on one address and port: one line, at the later one's key where the config sets it (else at
    the earlier's), naming the other and where it is set."""
    def set_at(listener: Listener) -> Path_ | None:
        return next((path for path in listener.paths if path in r.doc.where), None)

    def where(listener: Listener) -> str | None:
        path = set_at(listener)
        return None if path is None else "{}:{}".format(*r.doc.where[path])

    for i, first in enumerate(found):
        for later in found[i + 1:]:
            if not first.takes(later):
                continue
            at, other = (later, first) if set_at(later) is not None or set_at(first) is None else (first, later)
            file, line = r.doc.locate(set_at(at) or at.paths[0])
            r.errors.append(ConfigError(
                file, line, at.key, f"{at.address} ({at.what}) collides with {other.key} {other.address} "
                f"({other.what}; {where(other) or 'the default'}): two listeners cannot share one address and port",
                "another port, or another address: 127.0.0.1 and 127.0.0.2 are two, 0.0.0.0 and :: are every "
                "address of the port"))


def _string_list(r: Reader, path: Path_, default: tuple[str, ...]) -> list[str]:
    value = r.get(path)
    if value is MISSING:
        return list(default)
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        r.fail(path, f"expected a list of strings, got {value!r}", 'quote numbers: ["--max-num-seqs", "8"]')
        return list(default)
    return value


def _alerts_section(r: Reader) -> AlertSettings:
    base = ("alerts",)
    r.mapping(base, ("for_s", "clear_for_s", "repeat_s", "busy_utilization_pct", "sm_clock_min_mhz",
                     "memory_clock_min_mhz", "reapply_min_interval_s", "warn_at_design_power"))
    d = AlertSettings()
    return AlertSettings(
        for_s=float(r.number(base + ("for_s",), d.for_s, 0, 86400, unit=" s")),
        clear_for_s=float(r.number(base + ("clear_for_s",), d.clear_for_s, 0, 86400, unit=" s")),
        repeat_s=float(r.number(base + ("repeat_s",), d.repeat_s, 1, 604800, unit=" s")),
        busy_utilization_pct=float(r.number(base + ("busy_utilization_pct",), d.busy_utilization_pct, 0, 100,
                                            unit=" %")),
        sm_clock_min=_threshold(r, base + ("sm_clock_min_mhz",), d.sm_clock_min),
        memory_clock_min=_threshold(r, base + ("memory_clock_min_mhz",), d.memory_clock_min),
        reapply_min_interval_s=float(r.number(base + ("reapply_min_interval_s",), d.reapply_min_interval_s,
                                              1, 86400, unit=" s")),
        warn_at_design_power=r.boolean(base + ("warn_at_design_power",), d.warn_at_design_power),
    )


def _health_section(r: Reader) -> HealthPolicy:
    base = ("health",)
    r.mapping(base, [f.name for f in dataclasses.fields(HealthPolicy)])
    d = HealthPolicy()
    return HealthPolicy(
        drain_before_stop=r.boolean(base + ("drain_before_stop",), d.drain_before_stop),
        reset_gpu=r.boolean(base + ("reset_gpu",), d.reset_gpu),
        known_answer=r.boolean(base + ("known_answer",), d.known_answer),
        reboots_before_inspect=int(r.number(base + ("reboots_before_inspect",), d.reboots_before_inspect, 1, 100,
                                            integer=True)),
    )


def _threshold(r: Reader, path: Path_, default: Threshold) -> Threshold:
    value = r.get(path)
    allowed = f"MHz (1-{tunables.MAX_MHZ}), or a percentage of the locked (else max) clock such as \"50%\""
    if value is MISSING:
        return default
    if isinstance(value, str) and value.endswith("%"):
        try:
            pct = float(value[:-1])
        except ValueError:
            pct = -1.0
        if 0 < pct <= 100:
            return Threshold(fraction=pct / 100)
        r.fail(path, f"'{value}' is not a percentage between 0 and 100", allowed)
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 1 <= value <= tunables.MAX_MHZ:
        r.fail(path, f"expected MHz or a percentage, got {type_name(value)} {value!r}", allowed)
        return default
    return Threshold(mhz=float(value))


def _web_config(r: Reader, base_dir: Path) -> WebConfig | None:
    value = r.string(("metrics", "web_config"), "none")
    if str(value).lower() in NONE_WORDS:
        return None
    if "\0" in str(value):  # no path has one (attacker 17's F5: a traceback and exit 1, restarted every 5 s)
        r.fail(("metrics", "web_config"), "the path has a NUL byte", "a file's path")
        return None
    try:
        return webconfig.load(base_dir / value)
    except yamlfile.InvalidConfig as exc:
        r.errors.extend(exc.errors)
    return None


def _listen(r: Reader, path: Path_, default: tuple[str, int] = DEFAULT_LISTEN,
            allowed: str = "HOST:PORT such as 127.0.0.1:9847 or [::1]:9847, or none to serve no metrics",
            ) -> tuple[str, int] | None:
    value = r.get(path)
    if value is MISSING:
        return default
    if value is None or (isinstance(value, str) and value.lower() in NONE_WORDS):
        return None
    if not isinstance(value, str) or ":" not in value:
        r.fail(path, f"expected HOST:PORT, got {type_name(value)} {value!r}", allowed)
        return default
    address = parse_address(value)
    if address is None:
        r.fail(path, f"'{value}' is not a valid HOST:PORT", allowed)
        return default
    return address


def _canonical(host: str) -> str | None:
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        return None


def _ipv4_mapped(host: str) -> str | None:
    """The IPv4 address an IPv4-mapped IPv6 address (::ffff:a.b.c.d, however spelled) stands for, else None."""
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return None
    mapped = getattr(address, "ipv4_mapped", None)
    return str(mapped) if mapped is not None else None


def _not_canonical(host: str) -> bool:
    return _canonical(host) != host


def _bracket(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def parse_address(value: str) -> tuple[str, int] | None:
    """HOST:PORT (an IPv6 host in brackets) as (host, port); None if it is not one."""
    host, _, port = value.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not port.isdigit() or not 1 <= int(port) <= 65535 or not host:
        return None
    return host, int(port)


def _gpu_section(r: Reader, base_dir: Path) -> GpuBackendConfig:
    """The scenario name is checked where the backend is opened (backends.py): the simulator's files are
    the gpu package's business, not the config's."""
    d = GpuBackendConfig()
    r.mapping(("gpu",), ("backend", "scenario"))
    backend = r.string(("gpu", "backend"), d.backend, ("nvml", "sim"))
    scenario = r.string(("gpu", "scenario"), d.scenario)
    return GpuBackendConfig(backend, scenario, base_dir)
