"""The hooks a child kind's policy plugs into Program (serving/run/supervisor.py), as supervisord keeps policy
out of its state machine: Program runs any child through the same states, and a kind that needs more (the
multi-node rank watch: serving/run/ranks.py) says so in its ChildSpec (`policy`). A policy never changes the
state itself; it asks its program (end_part, note_problem), whose enter() checks every change against
ALLOWED_FROM.
"""

from __future__ import annotations

PREFLIGHT_RETRY_S = 5.0  # a start that waits (the GPUs, the port, a peer) is tried again this often


class Policy:
    """A child with no policy of its own: every hook says nothing is in the way."""

    def spawned(self) -> None:
        """A new child was spawned: whatever was known of the one before is stale."""

    def blocks(self, now: float) -> str | None:
        """Why a start must wait (as a busy port does: no failure counted); None: it may start."""
        return None

    def watch(self, now: float, starting: bool) -> bool:
        """Each tick while the child starts or runs; True: the policy ended its child."""
        return False

    def liveness_lost(self, now: float, why: str) -> bool:
        """The child failed its liveness probes; True: the policy ended it (no failure counted)."""
        return False

    def failed(self, now: float) -> None:
        """The child failed and is being ended (a restart with backoff follows)."""

    def waiting(self, why: str) -> str:
        """Why the child is not healthy, where its health is that its peer answers and it does not (why)."""
        return why

    def head_up(self, running: bool, probe_failures: int) -> bool | None:
        """The view's head_up: whether the peer this child needs answers (None: it needs none)."""
        return None
