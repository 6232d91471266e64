"""A third, toy child kind, registered only here, beside the engine and the proxy: a real run of the serving
runtime that reloads twice, run by test_child_kinds.py in a process of its own (ProcessOps makes its process a
child subreaper, which the test process must not become).

    python tests/harness/toy_kind.py CONFIG TOY_SCRIPT TOY_PORT

It prints one JSON object: the children's PIDs once all are healthy ("start"), after a reload that changes only
the toy's spec ("toy"), and after one that changes only serve.proxy ("proxy"); the log goes to stderr.
"""

import dataclasses
import json
import logging
import os
import pwd
import sys
import time

from gpuwarden import config as configs
from gpuwarden.backends import open_configured
from gpuwarden.proxy.child import PROXY, proxy_spec
from gpuwarden.serving.compose.identity import Identity
from gpuwarden.serving.run.kinds import ChildKind
from gpuwarden.serving.run.processes import ProcessOps
from gpuwarden.serving.run.runtime import ServingRuntime
from gpuwarden.serving.run.spec import ChildSpec, Timing
from gpuwarden.serving.run.supervisor import RUNNING

CONFIG, TOY_SCRIPT, TOY_PORT = sys.argv[1], sys.argv[2], int(sys.argv[3])
generation = 1  # what the toy's spec is built from besides the config: a reload after a change restarts it


def toy_spec(config, identity):
    """The toy: a tiny HTTP server answering /health, as the engine's user; its spec changes with generation."""
    argv = ("/usr/bin/python3", TOY_SCRIPT, "--mode", "healthy", "--port", str(TOY_PORT), "--toy", str(generation))
    return ChildSpec("toy", "the toy", argv, {"PATH": os.defpath}, identity, "127.0.0.1", TOY_PORT, "/health",
                     Timing.of(config.serve), toy_level)


def toy_level(line):  # a function of the module, not a new lambda each time: specs of one config compare equal
    return logging.INFO


TOY = ChildKind("toy", toy_spec)  # the one registry entry the toy needs
me = pwd.getpwuid(os.geteuid())
# The real proxy, as this user: serve.user cannot run this interpreter (the test runs as root under /root).
PROXY_HERE = ChildKind(PROXY, lambda config, identity: proxy_spec(
    config, Identity(me.pw_name, me.pw_uid, me.pw_gid, me.pw_dir, (), False)), section="proxy")


def pids(runtime, changed=(), old=None, timeout=60.0):
    """Tick until every child runs healthy (and those named in changed with a PID other than in old)."""
    deadline = time.monotonic() + timeout
    while True:
        runtime.tick(time.monotonic())
        programs = runtime.children.programs
        now = {name: p.child.pid for name, p in programs.items() if p.state == RUNNING}
        if len(now) == len(programs) and all(now.get(name) != (old or {}).get(name) for name in changed):
            return now
        if time.monotonic() > deadline:
            raise SystemExit(f"not healthy in {timeout:g} s: {[p.view() for p in programs.values()]}")
        time.sleep(0.1)


def main():
    global generation
    logging.basicConfig(stream=sys.stderr, level=logging.INFO, format="%(message)s")
    config = configs.load(CONFIG)
    runtime = ServingRuntime(open_configured(config), sides=(PROXY_HERE, TOY), ops=ProcessOps())
    runtime.start(runtime.prepare(config, deep=False), time.monotonic())
    seen = {"start": pids(runtime)}
    generation = 2
    runtime.reloads.plan(config)(time.monotonic())
    seen["toy"] = pids(runtime, ["toy"], seen["start"])
    proxy = dataclasses.replace(config.serve.proxy, client_timeout_s=config.serve.proxy.client_timeout_s + 1)
    changed = dataclasses.replace(config, serve=dataclasses.replace(config.serve, proxy=proxy))
    runtime.reloads.plan(changed)(time.monotonic())
    seen["proxy"] = pids(runtime, [PROXY], seen["toy"])
    seen["unchanged"] = runtime.reloads.plan(changed) is None
    runtime.stop(time.monotonic())
    while not runtime.stopped:
        runtime.tick(time.monotonic())
        time.sleep(0.1)
    print(json.dumps(seen))


if __name__ == "__main__":
    main()
