"""Planned restarts under load: `gpuwarden run` serving the tiny model with the real CPU vLLM and the proxy in front,
a steady mix of clients, and reloads that each change the engine's flags. The rig of tests/test_planned_restart_vllm.py
and benchmarks/planned_restarts.py.

The clients, each a thread that sends one request after another until stopped, every answer checked whole by its
token count (ignore_eos: exactly max_tokens, from the usage the answer carries; a stream asks for it in its last
event):
- through the proxy: short streams, short plain requests, and long streams (in flight at a reload);
- to the engine directly: long plain requests (in flight at a reload: the drain without the proxy) and short ones
  (what a new request meets while the engine drains and restarts).
Each reload's figures come from the daemon's journal (its drain lines, the proxy's outage line) and the clients'
records inside the reload's window (from the SIGHUP to the new engine's health).
"""

from __future__ import annotations

import http.client
import json
import os
import pwd
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

try:  # under pytest: the engine starts count toward the test budget (tests/harness/engines.py)
    from harness.engines import seen as _engine_seen
except ImportError:  # run from benchmarks/
    def _engine_seen(line: str) -> None:
        pass

HERE = Path(__file__).resolve().parent
PROFILE = HERE / "cpu-tiny.yaml"
CHILD_USER = "gpuwarden-test"
START_S = 900  # one CPU vLLM start: a minute idle, minutes on a loaded box (tests/conftest.py VLLM_START_S)
FLAGS = (["--uvicorn-log-level", "warning"], ["--uvicorn-log-level", "info"])  # a change that keeps the compile cache
SHORT, LONG = 24, 1500  # tokens


def tiny_model(python: Path, folder: Path) -> Path:
    """The tests' tiny model (make_tiny_model.py) made in folder/tiny with python, readable by the engine's user."""
    os.chmod(folder, 0o755)
    model = folder / "tiny"
    subprocess.run([str(python), str(HERE / "make_tiny_model.py"), str(model)], check=True, capture_output=True,
                   timeout=300)
    for path in [model, *model.iterdir()]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    return model


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def runnable_daemon(python: Path, user: str) -> tuple[list[str], dict, Path | None]:
    """How to start a daemon whose children serve.user can run (the proxy runs on the daemon's interpreter):
    (command, env, folder to remove). As root, where the user cannot run this interpreter (a venv made from a Python
    under /root, as on CI), the daemon runs on `python` (the vLLM venv's, made from /usr/bin/python3) with a copy of
    the package that the user can read."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if os.geteuid() != 0 or subprocess.run(["runuser", "-u", user, "--", sys.executable, "-c", ""],
                                           capture_output=True).returncode == 0:
        return [sys.executable, "-m", "gpuwarden"], env, None
    import gpuwarden

    folder = Path(tempfile.mkdtemp(prefix="gpuwarden-package-"))
    folder.chmod(0o755)
    shutil.copytree(Path(gpuwarden.__file__).parent, folder / "gpuwarden", ignore=shutil.ignore_patterns("__pycache__"))
    try:  # docker-py, for serve.container (the vLLM venv has requests and urllib3, which it needs)
        import docker
        shutil.copytree(Path(docker.__file__).parent, folder / "docker", ignore=shutil.ignore_patterns("__pycache__"))
    except ImportError:
        pass
    for path in folder.rglob("*"):
        path.chmod(0o755 if path.is_dir() else 0o644)
    return [str(python), "-m", "gpuwarden"], dict(env, PYTHONPATH=str(folder)), folder


@dataclass
class Outcome:
    client: str  # "proxy stream", "proxy plain", "direct plain"...
    began: float
    took: float
    ok: bool
    what: str  # "200", or the status and error, or the failure


class UnixHTTPConnection(http.client.HTTPConnection):
    """HTTP to the engine's Unix socket: behind the proxy vLLM listens on one (--uds) and on no TCP port
    (serving/compose/enginesock.py)."""

    def __init__(self, path: str, timeout: float):
        super().__init__("localhost", timeout=timeout)
        self.path = path

    def connect(self):
        import socket
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(self.timeout)
        self.sock.connect(self.path)


def connection(where: int | str, timeout: float) -> http.client.HTTPConnection:
    """To 127.0.0.1:where (a port), or to the Unix socket at where (a path)."""
    return UnixHTTPConnection(where, timeout) if isinstance(where, str) else \
        http.client.HTTPConnection("127.0.0.1", where, timeout=timeout)


class Client(threading.Thread):
    """One client: requests one after another until stopped, each judged whole."""

    def __init__(self, name: str, port: int | str, stream: bool, max_tokens: int, outcomes: list, stop: threading.Event,
                 model: str = "tiny", pause_s: float = 0.0):
        super().__init__(daemon=True)
        self.name_, self.port, self.stream, self.max_tokens, self.model = name, port, stream, max_tokens, model
        self.outcomes, self.stop_event, self.pause_s = outcomes, stop, pause_s
        self.since: float | None = None  # when the request now in flight began; None between requests

    def run(self):
        while not self.stop_event.is_set():
            began = self.since = time.monotonic()
            ok, what = self.once()
            self.since = None
            self.outcomes.append(Outcome(self.name_, began, time.monotonic() - began, ok, what))
            # a client that failed tries again, as a real one would, but not in a tight loop
            self.stop_event.wait(self.pause_s if ok else max(self.pause_s, 0.2))

    def once(self) -> tuple[bool, str]:
        body = {"model": self.model, "messages": [{"role": "user", "content": "the gpu runs"}], "max_tokens":
                self.max_tokens, "ignore_eos": True, "temperature": 0, "stream": self.stream}
        if self.stream:
            body["stream_options"] = {"include_usage": True}
        conn = connection(self.port, 600)
        try:
            conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
            reply = conn.getresponse()
            data = reply.read()
            if reply.status != 200:
                return False, f"{reply.status} {data[:160].decode(errors='replace')}"
            tokens = self.tokens(data)
            if tokens != self.max_tokens:
                return False, f"200 but {tokens} of {self.max_tokens} tokens: {data[-200:]!r}"
            return True, "200"
        except (OSError, http.client.HTTPException, ValueError, LookupError, TypeError) as exc:
            return False, f"{type(exc).__name__}: {exc}"  # TypeError, LookupError: an answer without its usage
        finally:
            conn.close()

    def tokens(self, data: bytes) -> int | None:
        if not self.stream:
            return json.loads(data)["usage"]["completion_tokens"]
        usage, done = None, False
        for line in data.split(b"\n"):
            if line == b"data: [DONE]":
                done = True
            elif line.startswith(b"data: {"):
                usage = json.loads(line[6:]).get("usage") or usage
        return usage["completion_tokens"] if usage and done else None


@dataclass
class Reload:
    number: int
    began: float
    healthy: float = 0.0  # the new engine's health, on the rig's clock
    in_flight: int | None = None  # the daemon's drain line
    drained_s: float | None = None
    drain_outcome: str = ""  # "drained", "timed out", "aborted" (no drain)
    held: int | None = None  # the proxy's outage line: held requests forwarded
    refused: int | None = None
    outcomes: list = field(default_factory=list)  # the clients' requests that began inside this reload's window
    long_since: float | None = None  # when the direct long request in flight at the SIGHUP began

    def long_direct(self) -> list:
        """The direct long requests in flight at the SIGHUP (one; or none, if it has not ended by `Rig.settle`)."""
        return [o for o in self.outcomes if o.client == "direct plain long" and o.began <= self.began]

    def failed(self, through: str) -> list:
        return [o for o in self.outcomes if o.client.startswith(through) and not o.ok]


class Rig:
    def __init__(self, vllm_python: Path, model: Path, workdir: Path, drain_s: float = 60, hold_s: float = 300,
                 user: str = CHILD_USER, long_tokens: int = LONG, pause_s: float = 0.0,
                 idle_after_s: float | None = None):
        """long_tokens, pause_s: the long requests' length and each client's pause between requests (the benchmark
        runs flat out; the CI test lighter, beside the other tests' engines on two cores); idle_after_s: serve.idle's
        stop after this quiet (None: off)."""
        self.workdir, self.drain_s, self.hold_s, self.idle_after_s = workdir, drain_s, hold_s, idle_after_s
        self.long_tokens, self.pause_s = long_tokens, pause_s
        self.port, self.proxy_port, self.metrics_port = free_port(), free_port(), free_port()
        self.engine: int | str = self.port  # where the engine listens, once it is healthy (start)
        self.user = user if os.geteuid() == 0 else pwd.getpwuid(os.geteuid()).pw_name
        (workdir / "profiles.d").mkdir(parents=True, exist_ok=True)
        (workdir / "profiles.d" / "cpu-tiny.yaml").write_text(PROFILE.read_text())
        self.config = workdir / "gpuwarden.yaml"
        self.vllm_python, self.model, self.flags = vllm_python, model, 0
        self.write_config()
        self.command, self.env, self._package = runnable_daemon(vllm_python, self.user)
        # the daemon's RUNTIME_DIRECTORY (its energy file for the proxy), not the host's /run/gpuwarden: under /tmp,
        # where serve.user reaches it (a test's tmp_path is in root's 0700 pytest folder)
        self._runtime = Path(tempfile.mkdtemp(prefix="gpuwarden-run-"))
        self._runtime.chmod(0o755)
        self.env["RUNTIME_DIRECTORY"] = str(self._runtime)
        self.lines: list[str] = []
        self.proc: subprocess.Popen | None = None
        self.outcomes: list[Outcome] = []
        self._stop_clients = threading.Event()
        self.clients: list[Client] = []

    def write_config(self) -> None:
        args = json.dumps(FLAGS[self.flags % 2])
        self.config.write_text(f"""poll_interval_s: 0.5
metrics:
  listen: 127.0.0.1:{self.metrics_port}
gpu:
  backend: sim
  scenario: dgx-spark
serve:
  enabled: true
  profile: cpu-tiny
  model: {self.model}
  command: [{self.vllm_python}, -m, vllm.entrypoints.openai.api_server]
  port: {self.port}
  user: {self.user}
  args: {args}
  startup_timeout_s: {START_S}
  stop_timeout_s: 20
  liveness_interval_s: 2
  drain_s: {self.drain_s:g}
  proxy:
    enabled: true
    listen: 127.0.0.1:{self.proxy_port}
    hold_s: {self.hold_s:g}
""" + (f"  idle: {{action: stop, after_s: {self.idle_after_s:g}}}\n" if self.idle_after_s else ""))

    # -- the daemon --------------------------------------------------------------------------------------------------
    def start(self) -> None:
        self.proc = subprocess.Popen([*self.command, "run", "-c", str(self.config)], stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, env=self.env)
        threading.Thread(target=self._read, daemon=True).start()
        _, healthy = self.wait_for("vLLM healthy after", START_S)
        self.wait_for("the proxy healthy after", 60)
        # where the engine listens: behind the proxy, its Unix socket ("... on unix:PATH"), else its port
        where = re.search(r" on unix:(\S+)", healthy)
        self.engine = where.group(1) if where else self.port

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))
            _engine_seen(line)

    def wait_for(self, text: str, timeout: float, after: int = 0) -> tuple[int, str]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for index in range(after, len(self.lines)):
                if text in self.lines[index]:
                    return index, self.lines[index]
            if self.proc.poll() is not None:
                break
            time.sleep(0.1)
        # The daemon's own lines since `after` first: the engine's statistics every 10 s fill the log's end, and a
        # reload that never comes to a restart says why in them (the parser's check, a refusal, the word).
        own = [line for line in self.lines[after:] if " vllm: " not in line and " GPU0 " not in line][-60:]
        raise AssertionError(f"{text!r} not logged within {timeout:g} s; the daemon's own lines since:\n" +
                             "\n".join(own) + "\n... and the log's end:\n" + "\n".join(self.lines[-20:]))

    def stop(self) -> int:
        self.stop_clients()
        code = None
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                code = self.proc.wait(120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                code = self.proc.wait(30)
        if self._package is not None:
            shutil.rmtree(self._package, ignore_errors=True)
        shutil.rmtree(self._runtime, ignore_errors=True)
        (self.workdir / "daemon.log").write_text("\n".join(self.lines) + "\n")
        return code

    # -- the clients -------------------------------------------------------------------------------------------------
    def start_clients(self) -> None:
        long = self.long_tokens
        mix = [("proxy stream", self.proxy_port, True, SHORT), ("proxy plain", self.proxy_port, False, SHORT),
               ("proxy stream long", self.proxy_port, True, long), ("direct plain long", self.engine, False, long),
               ("direct plain", self.engine, False, SHORT)]
        self.clients = [Client(name, port, stream, tokens, self.outcomes, self._stop_clients, str(self.model),
                               self.pause_s) for name, port, stream, tokens in mix]
        for client in self.clients:
            client.start()

    def stop_clients(self) -> None:
        self._stop_clients.set()
        for client in self.clients:
            client.join(600)

    def engine_running(self) -> int:
        """vLLM's running requests, from its own /metrics."""
        conn = connection(self.engine, 5)
        try:
            conn.request("GET", "/metrics")
            text = conn.getresponse().read().decode()
        finally:
            conn.close()
        return int(sum(float(line.split()[-1]) for line in text.splitlines()
                       if line.startswith("vllm:num_requests_running")))

    # -- a reload ----------------------------------------------------------------------------------------------------
    def long_direct_since(self) -> float | None:
        """When the direct long client's request now in flight began; None between its requests."""
        return next(c.since for c in self.clients if c.name_ == "direct plain long")

    def reload(self, number: int, in_flight: int = 2) -> Reload:
        """Change the engine's flags and SIGHUP once `in_flight` requests run on the engine, the direct long one
        among them; back once the new engine is healthy and the proxy's outage is over."""
        time.sleep(3)  # serving a while: the daemon has read the engine's /metrics (its drain line counts them)
        self.flags += 1
        self.write_config()  # read only at the SIGHUP
        deadline = time.monotonic() + 180
        while True:
            running = self.engine_running()
            # The reload's moment is taken before the direct long request is looked at, not before the engine's
            # /metrics (a busy engine answers it in a second or more): a request seen in flight after that moment
            # was in flight at it. Looked at first, it could end while /metrics answered, and the reload then had no
            # long request in flight (ci44: reloads 1 and 3 "0 / 0"; CI at 0bafc08: reloads 1-3).
            began = time.monotonic()
            since = self.long_direct_since()
            if since is not None and began - since > 0.1 and running >= in_flight:
                break
            if began > deadline:
                # what each client was doing, so that a failure on a busy box explains itself (ci41: reload 5)
                clients = "; ".join(f"{c.name_}: {'idle' if c.since is None else f'{time.monotonic() - c.since:.0f} s'}"
                                    f"{'' if c.is_alive() else ' (ended)'}" for c in self.clients)
                last = [f"{o.client} {o.what}" for o in self.outcomes[-5:]]
                raise AssertionError(f"reload {number}: no direct long request with {in_flight} on the engine in "
                                     f"180 s (the engine ran {running} at the last look; {clients}; last outcomes "
                                     f"{last})")
            time.sleep(0.05)
        mark = len(self.lines)
        reload = Reload(number, began, long_since=since)
        self.proc.send_signal(signal.SIGHUP)
        self.wait_for("vLLM healthy after", START_S, after=mark)
        reload.healthy = time.monotonic()
        log = self.lines[mark:]
        for line in log:
            if m := re.search(r"draining vLLM: (\d+) requests? in flight", line):
                reload.in_flight = int(m.group(1))
            elif m := re.search(r"vLLM drained in ([\d.]+) s", line):
                reload.drained_s, reload.drain_outcome = float(m.group(1)), "drained"
            elif m := re.search(r"vLLM drain timed out: (\d+)", line):
                reload.drain_outcome = "timed out"
            elif m := re.search(r"vLLM stops without a drain .*?: (\d+) requests?", line):
                reload.in_flight = int(m.group(1))
        if not self.drain_s:
            reload.drain_outcome = "aborted (no drain)"
        if self.hold_s:
            index, line = self.wait_for("proxy: engine back after", 60, after=mark)
            if m := re.search(r": (\d+) held requests forwarded, (\d+) refused", line):
                reload.held, reload.refused = int(m.group(1)), int(m.group(2))
        return reload

    def settle(self, reloads: list[Reload], seconds: float = 3.0) -> None:
        """Let the clients run on the new engine a while, then give each reload the requests that ran at its SIGHUP or
        began after it, before the next one's (the last: before now). A long request in flight at a reload may have
        begun a minute earlier on CI's busy box (ci34 left two such out and judged no drain)."""
        time.sleep(seconds)
        for reload, after in zip(reloads, [*reloads[1:], None]):
            end = after.began if after else time.monotonic()
            reload.outcomes = [o for o in list(self.outcomes) if o.began < end and o.began + o.took >= reload.began]


def table(reloads: list[Reload]) -> str:
    """Markdown: a row a reload."""
    rows = ["| reload | in flight at it | drain | held at the proxy | longest through the proxy (s) | "
            "failed through the proxy | direct: long ones finished / failed | direct: new ones failed |",
            "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in reloads:
        proxied = [o for o in r.outcomes if o.client.startswith("proxy")]
        longest = max((o.took for o in proxied), default=0.0)
        drain = f"{r.drain_outcome} in {r.drained_s:.1f} s" if r.drained_s is not None else r.drain_outcome or "?"
        long_direct = r.long_direct()
        new_direct = [o for o in r.outcomes if o.client == "direct plain" and o.began >= r.began]
        failures = sorted({o.what.split(":")[0][:40] for o in new_direct if not o.ok})
        rows.append(f"| {r.number} | {r.in_flight} | {drain} | {r.held if r.held is not None else '-'} | "
                    f"{longest:.1f} | {len(r.failed('proxy'))} | {sum(o.ok for o in long_direct)} / "
                    f"{sum(not o.ok for o in long_direct)} | {sum(not o.ok for o in new_direct)} of "
                    f"{len(new_direct)} ({', '.join(failures) or 'none'}) |")
    return "\n".join(rows)
