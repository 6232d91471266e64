"""A child's health, from the latest answer of its probe (asked off the loop, on a Background worker): its
/health, with its port answered by its own process group; or, for a child that serves no HTTP, whether the
peer it needs (a headless part's head) or its own port accepts a connection."""

from __future__ import annotations

import os
from collections.abc import Callable

from ...base.background import Background
from ...base.keptlistener import CAP_REFUSED, LISTENERS
from .processes import Child, ProcessOps
from .spec import ChildSpec


def judge(spec: ChildSpec, probe: Background, ops: ProcessOps, child: Child, started: float,
          waiting: Callable[[str], str]) -> tuple[bool | None, str]:
    """(True healthy / False not / None no answer yet, why): the latest answer about this child (one asked
    before started is stale), a new question asked meanwhile. waiting: why, where its peer does not answer."""
    if not spec.health_path:  # no HTTP: the peer it needs (a headless part's head), or its own port, answers
        probe.start(ops.reachable, *(spec.peer or (spec.host, spec.port)))
        outcome = probe.take()
        if outcome is None or outcome.started_at < started:
            return None, ""
        why = str(outcome.error) if outcome.error is not None else outcome.value
        if why is None:
            return True, ""
        return False, waiting(why) if spec.peer else f"port {spec.port} does not answer: {why}"
    # Only to a socket of the child's user. On the daemon's kept listener (spec.listener) a connection the child has
    # not accepted yet is the listener's, the daemon's user's; accept() makes it the child's (a child adopted from a
    # daemon that kept none listens on its own socket: the child's user's alone).
    kept = spec.listener and LISTENERS[spec.listener].holds(spec.host, spec.port)
    owner = (spec.identity.uid, os.geteuid()) if kept else spec.identity.uid
    probe.start(ops.health, spec.url + spec.health_path, owner)
    outcome = probe.take()
    if outcome is None or outcome.started_at < started:
        return None, ""
    # The proxy's fixed 503 at its connection cap is written by its running event loop: a full proxy, alive (a
    # restart would cut every stream in flight and forget the refused clients). The cap writes it unasked and
    # closes at once, so the probe may find the far end closed before it could name its owner, and writes nothing
    # (httpget.Unasked): on the kept listener, which no one else can hold, that written 503 is the same answer. The
    # port's owner is checked below.
    reply = outcome.value if outcome.error is None else getattr(outcome.error, "reply", None) if kept else None
    if reply is None:
        return False, str(outcome.error)
    full = spec.listener and reply.code == 503 and reply.body == CAP_REFUSED
    if outcome.error is not None and not full:
        return False, str(outcome.error)
    if reply.code != 200 and not full:
        return False, f"/health answered {reply.code}"
    # A container's engine is outside the shim's group (the runtime's conmon started it): its port is judged by
    # the owner of the listening socket alone, serve.user's uid, as under the unit where /proc/PID/fd is unseen.
    group = ops.group_pids(child.pgid) if spec.launcher is None else None
    if spec.port and not ops.owns_port(spec.host, spec.port, group, spec.identity.uid):
        return False, (f"port {spec.port} is answered by {ops.who_listens(spec.host, spec.port)}, "
                       f"not by {spec.title}'s process group")
    return True, ""
