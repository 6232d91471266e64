"""How the engine lets the requests in flight finish when a planned stop sends it SIGTERM: serve.drain_s, told to
the engine where its installed version takes the flag (engines: drain_flag, drain_versions), or the engine's own
drain (drains_itself), or none. The supervisor then waits that long plus DRAIN_MARGIN_S before SIGKILL
(serving/run/spec.py) and says how the drain went (serving/run/supervisor.py).

A flag is never passed to a version that lacks it, nor where the version is unknown: the engine's parser would
refuse the start. A user's own flag in serve.args wins, and a finding says where it disagrees with drain_s.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

from packaging.specifiers import SpecifierSet

from ...config import ServeConfig
from ..lint.flags import flag_value
from ..lint.packages import Installed
from ..lint.findings import WARNING, LintFinding, version_in

# Beyond the drain, before SIGKILL: the engine's own teardown once its last request finished (vLLM's engine core
# and workers give back the GPUs' memory).
DRAIN_MARGIN_S = 10.0


@dataclass(frozen=True)
class Drain:
    seconds: float  # how long a SIGTERM lets the requests in flight finish; 0: they are aborted
    args: tuple[str, ...] = ()  # what gpuwarden adds to the engine's argv
    note: str = ""  # one line for the journal at a start, where the drain is not plainly serve.drain_s ("": none)
    level: int = logging.INFO
    finding: LintFinding | None = None  # the user's own flag disagrees with serve.drain_s


def plan_drain(engine, serve: ServeConfig, flags: Sequence[str], installed: Installed) -> Drain:
    """The drain of this engine, its flags (after the command) and its installed version, for serve.drain_s."""
    wanted = serve.drain_s
    if engine.drains_itself:
        if not wanted:
            return Drain(0)
        return Drain(wanted, note=f"{engine.title} drains on SIGTERM by itself (no flag to pass): the requests in "
                                  f"flight get serve.drain_s {wanted} s, then SIGKILL {DRAIN_MARGIN_S:g} s later")
    flag = engine.drain_flag
    if flag is None:
        return Drain(0, note=f"{engine.title} has no drain: a stop aborts the requests in flight" if wanted else "")
    own = flag_value(flags, flag)
    if own is not None:
        return _own(engine.title, flag, own, wanted)
    if not wanted:
        return Drain(0)
    version = installed.version(engine.name) if installed.known else None
    if not version:
        return Drain(0, note=f"{engine.title}'s version is unknown: {flag} is not passed, and a stop aborts the "
                             f"requests in flight (serve.drain_s {wanted} s unused)", level=logging.WARNING)
    if not version_in(SpecifierSet(engine.drain_versions), version):
        return Drain(0, note=f"{engine.title} {version} has no {flag} ({engine.drain_versions}): a stop aborts the "
                             f"requests in flight (serve.drain_s {wanted} s unused)", level=logging.WARNING)
    return Drain(wanted, (flag, str(wanted)))


def _own(title: str, flag: str, own: str, wanted: int) -> Drain:
    """serve.args (or the profile) give the flag: it wins, as the engine's parser reads it."""
    try:
        seconds = max(0.0, float(own))
    except ValueError:
        seconds = 0.0  # the engine's parser refuses it: the start does not happen
    if seconds == wanted:
        return Drain(seconds)
    finding = LintFinding(WARNING, "drain-differs", f"{flag} {own} in the engine's flags differs from "
                                                    f"serve.drain_s {wanted}: the flag wins, so a stop lets the "
                                                    f"requests in flight finish for {seconds:g} s",
                          "gpuwarden's serve.drain_s", f"drop {flag} from serve.args, or set serve.drain_s: "
                                                       f"{seconds:g}", facts=(f"{flag} {own}",
                                                                               f"serve.drain_s {wanted}"))
    return Drain(seconds, note=f"{title} drains for {seconds:g} s ({flag} {own} in its flags, not serve.drain_s)",
                 finding=finding)


def hold_finding(serve: ServeConfig, seconds: float) -> LintFinding | None:
    """The proxy holds new requests while the engine drains and starts again: a hold no longer than the drain
    refuses them (503) before the new engine can answer. None where the hold outlasts it, or either is off."""
    hold = serve.proxy.hold_s
    if not (serve.proxy.enabled and hold and seconds and hold <= seconds):
        return None
    return LintFinding(WARNING, "hold-within-drain",
                       f"serve.proxy.hold_s {hold:g} s is not longer than the engine's drain ({seconds:g} s): a "
                       "request the proxy holds while the engine restarts gets 503 before the new engine can answer",
                       "gpuwarden's serve.proxy.hold_s and serve.drain_s",
                       f"set serve.proxy.hold_s above {seconds:g} s and an engine start (300 s by default), or "
                       "shorten serve.drain_s", facts=(f"serve.proxy.hold_s {hold:g}", f"drain {seconds:g} s"))
