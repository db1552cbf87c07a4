"""Running states of the trainer and of each explorer (S4), and the legal moves between them.

The seed's state machine::

    STOPPED ──start──▶ RUNNING ◀──served / timed out── REQUIRE_SYNC
                          │  └──────────request──────────▲
                          └──stop──▶ STOPPED ◀──stop── REQUIRE_SYNC

* MEMORY / CHECKPOINT: the trainer stays RUNNING (it only stores weights); an explorer moves
  to REQUIRE_SYNC when it asks for weights and back to RUNNING once they are applied (or its
  request timed out).
* NCCL: a two-way handshake; the trainer and the explorers it syncs with are all
  REQUIRE_SYNC while the transfer is set up, then all return to RUNNING.

Anything else (e.g. STOPPED → REQUIRE_SYNC, or RUNNING → RUNNING) raises
:class:`aiosync.errors.StateTransitionError`.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import anyio

from ..errors import PeerTimeoutError, StateTransitionError


class RunningStatus(str, enum.Enum):
    """State of a trainer or an explorer, as seen by the synchronizer."""

    STOPPED = "stopped"
    RUNNING = "running"
    REQUIRE_SYNC = "require_sync"

    def __str__(self) -> str:
        return self.name


#: The legal transitions: ``ALLOWED_TRANSITIONS[old]`` is the set of states ``old`` may move to.
ALLOWED_TRANSITIONS: dict[RunningStatus, frozenset[RunningStatus]] = {
    RunningStatus.STOPPED: frozenset({RunningStatus.RUNNING}),
    RunningStatus.RUNNING: frozenset({RunningStatus.REQUIRE_SYNC, RunningStatus.STOPPED}),
    RunningStatus.REQUIRE_SYNC: frozenset({RunningStatus.RUNNING, RunningStatus.STOPPED}),
}


def check_transition(old: RunningStatus, new: RunningStatus, who: str = "component") -> None:
    """Raise :class:`StateTransitionError` unless ``old → new`` is allowed."""
    if new not in ALLOWED_TRANSITIONS[old]:
        allowed = ", ".join(s.name for s in sorted(ALLOWED_TRANSITIONS[old], key=lambda s: s.value))
        raise StateTransitionError(f"{who}: illegal transition {old.name} -> {new.name} (from {old.name} only: {allowed})")


@dataclass(eq=False)
class StatusCell:
    """The observable state of one component: current status, history, and waiting on changes.

    ``history`` records every transition as ``(old, new)``; tests and dashboards read it.
    """

    who: str
    status: RunningStatus = RunningStatus.STOPPED
    history: list[tuple[RunningStatus, RunningStatus]] = field(default_factory=list)
    since: float = field(default_factory=time.monotonic)
    _changed: anyio.Event = field(default_factory=anyio.Event, repr=False)

    def set(self, new: RunningStatus) -> None:
        """Move to ``new``; raises :class:`StateTransitionError` when not allowed."""
        new = RunningStatus(new)
        check_transition(self.status, new, self.who)
        self.history.append((self.status, new))
        self.status = new
        self.since = time.monotonic()
        self._changed.set()
        self._changed = anyio.Event()

    def set_if(self, old: RunningStatus, new: RunningStatus) -> bool:
        """Move ``old → new`` only when currently ``old``; returns whether it moved."""
        if self.status is not old:
            return False
        self.set(new)
        return True

    async def wait_for(self, *statuses: RunningStatus, timeout: float | None) -> RunningStatus:
        """Wait until the status is one of ``statuses``; :class:`PeerTimeoutError` after ``timeout``."""
        try:
            with anyio.fail_after(timeout):
                while self.status not in statuses:
                    await self._changed.wait()
        except TimeoutError as exc:
            wanted = "/".join(s.name for s in statuses)
            raise PeerTimeoutError(f"{self.who} did not reach {wanted} within {timeout}s (is {self.status.name})") from exc
        return self.status
