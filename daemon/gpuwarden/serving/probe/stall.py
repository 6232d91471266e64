"""Is the engine making progress? What /health cannot say.

vLLM's /health answers 200 while its EngineCore is frozen (SIGSTOP of it kept
/health at 200 and vllm:num_requests_running at 8 while
vllm:generation_tokens_total stopped moving, on the real CPU vLLM 0.32). So:

- With work (requests running or waiting), the engine is stalled when neither
  its generated- nor its prompt-token counter has moved for stall_after_s.
- Without work, the counters cannot tell a frozen engine from an idle one (its
  gauges come from the engine, and a frozen engine reports 0 running while
  requests pile up in the API server). After probe_after_s without progress, a
  one-token completion is sent; if it does not finish within probe_timeout_s,
  the engine is stalled.

Why the default stall_after_s is 300 s: a lone request's chunked prefill moves
no counter until its first token (vLLM 0.32 records iteration stats only for
steps with outputs: v1/engine/async_llm.py), and the longest prefill reported
in the seeds is 393,216 tokens at about 2,000 tok/s, about 200 s. The CPU vLLM
also counted eight requests running and no token for over 5 s while torch
compiled the graph for a batch shape it had not seen.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass

from ...base import httpget
from ...base.background import Background

log = logging.getLogger("gpuwarden")

PROBE_MAX_BYTES = 256 * 1024


@dataclass(frozen=True)
class Progress:
    """One read of the engine's counters and queue."""

    tokens: float | None  # generated + prompt tokens so far (None: not reported)
    running: float | None
    waiting: float | None

    @property
    def has_work(self) -> bool:
        return bool(self.running) or bool(self.waiting)


class NotAuthorized(httpget.HttpError):
    """The engine refused the probe's credentials: it answered, so it is alive."""


def probe(url: str, model: str, timeout_s: float, key: str | None = None, owner: int | None = None) -> None:
    """A one-token completion, authenticated as clients are when the engine asks for a key, and sent only to a
    socket of owner (the engine's uid: httpget.request); raises NotAuthorized on 401/403 and httpget.HttpError
    unless it comes back 200 in time."""
    body = json.dumps({"model": model, "prompt": "ok", "max_tokens": 1, "temperature": 0}).encode()
    headers = {"Authorization": f"Bearer {key}"} if key else None
    reply = httpget.post_json(url, body, timeout_s, PROBE_MAX_BYTES, headers, owner)
    if reply.code in (401, 403):
        raise NotAuthorized(f"{url} answered {reply.code}")
    if reply.code != 200:
        raise httpget.HttpError(f"{url} answered {reply.code}")


class StallWatch:
    def __init__(self, stall_after_s: float, probe_after_s: float, probe_timeout_s: float, probe_url: str,
                 model: str, clock: Callable[[], float], background: Background | None = None,
                 key: str | None = None, owner: int | None = None):
        self.stall_after_s = stall_after_s
        self.probe_after_s = probe_after_s  # 0: no probe
        self.probe_timeout_s = probe_timeout_s
        self.probe_url, self.model = probe_url, model
        self.key = key  # the engine's API key, when it asks for one (never logged)
        self.owner = owner  # the engine's uid: the probe goes only to its socket
        self.unauthorized_said = False
        self.job = background or Background("stall-probe", clock)
        self.probes = 0  # sent so far
        self._tokens: float | None = None
        self._moved_at: float | None = None  # when the counters last moved (or the watch began)
        self._work_since: float | None = None  # since when work is seen without progress
        self.stalled: str | None = None  # why, from the moment it is seen until the counters move again

    def reset(self, now: float) -> None:
        """A new child: start over."""
        self._tokens, self._moved_at, self._work_since, self.stalled = None, now, None, None
        self.job.discard()

    def update(self, now: float, progress: Progress | None) -> str | None:
        """Take this poll's read (None: none finished this poll); return why the engine is stalled, or None."""
        if self._moved_at is None:
            self._moved_at = now
        if progress is None:
            return self.stalled
        if progress.tokens is not None and progress.tokens != self._tokens:
            self._tokens, self._moved_at, self._work_since, self.stalled = progress.tokens, now, None, None
        if self.stalled is not None:
            return self.stalled
        if progress.has_work:
            if self._work_since is None:
                self._work_since = now
            quiet = now - max(self._moved_at, self._work_since)
            if quiet >= self.stall_after_s:
                self.stalled = (f"no token generated or prefilled for {quiet:.0f} s with {progress.running or 0:g} "
                                f"running and {progress.waiting or 0:g} waiting (serve.stall_after_s "
                                f"{self.stall_after_s:g})")
            return self.stalled
        self._work_since = None
        self.stalled = self._probe(now)
        return self.stalled

    def _probe(self, now: float) -> str | None:
        """Idle: after probe_after_s without progress, one completion must come back within probe_timeout_s."""
        outcome = self.job.take()
        if outcome is not None and outcome.started_at >= self._moved_at:  # else the counters moved since
            if isinstance(outcome.error, NotAuthorized) and not self.unauthorized_said:
                self.unauthorized_said = True
                log.warning("the stall probe cannot authenticate (%s): the engine answers, so it counts as alive; "
                            "give the engine's key through serve.env_file or the vllm.env credential", outcome.error)
            if outcome.error is None or isinstance(outcome.error, NotAuthorized):
                self._moved_at = outcome.finished_at  # it answered: alive, and idle
                return None
            return (f"nothing generated for {now - self._moved_at:.0f} s, and the stall probe (a one-token "
                    f"completion, serve.probe_timeout_s {self.probe_timeout_s:g}) failed: {outcome.error}")
        if self.probe_after_s > 0 and not self.job.busy and now - self._moved_at >= self.probe_after_s:
            self.probes += 1
            self.job.start(probe, self.probe_url, self.model, self.probe_timeout_s, self.key, self.owner)
        return None
