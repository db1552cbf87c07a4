"""What a :class:`~aiosync.coordination.synchronizer.Synchronizer` shares with its trainer handle
and its explorer sessions: :class:`Hub`, explicit shared state (anyio style) with a few methods.

Sessions and the trainer handle see only this — the config, the source of published weights,
the fan-out, the syncer factory, the registered sessions — never the synchronizer's internals.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

import anyio

from ..syncers.factory import SyncerFactory
from .config import SynchronizerConfig
from .delivery import DeliveryLine
from .fanout import FanOut
from .sources import Source
from .states import RunningStatus
from .styles import SyncMethod, SyncStyle


class SessionView(Protocol):
    """What the hub and the trainer read of an explorer session."""

    name: str
    line: DeliveryLine

    @property
    def attached(self) -> bool: ...

    @property
    def open(self) -> bool: ...

    @property
    def expects_handshakes(self) -> bool: ...


class TrainerView(Protocol):
    """What sessions read of the trainer."""

    names: list[str]
    version: int

    @property
    def status(self) -> RunningStatus: ...


@dataclass(eq=False)
class Hub:
    """The synchronizer's shared state."""

    config: SynchronizerConfig
    syncers: SyncerFactory
    source: Source
    fanout: FanOut | None = None
    trainer: TrainerView | None = None
    #: How delivery lines make their senders (``None``: :attr:`syncers`); a sharded trainer's
    #: sender builds every shard on its rank (:mod:`aiosync.coordination.shards`).
    senders: SyncerFactory | None = None
    #: The other ranks of a sharded trainer (told when each check point is over), or ``None``.
    shard_peers: Any = None
    #: Who other than an explorer its delivery waits for now, named (a sharded trainer's
    #: ranks: ``ShardSet.stalled``), for timeout messages; ``None``: nobody.
    stalled: Any = None
    #: Why the last join was refused (``wait_for_explorers`` says so when it times out).
    last_refusal: str | None = None
    #: Attached explorer sessions by name (``Synchronizer.explorers``); lost ones stay, with their error.
    sessions: dict = field(default_factory=dict)
    #: Sessions whose first sync runs now, by name.
    joining: dict = field(default_factory=dict)
    trainer_attached: anyio.Event = field(default_factory=anyio.Event)

    # -- who is there ------------------------------------------------------------------

    def open_sessions(self) -> list[SessionView]:
        return [s for s in self.sessions.values() if s.open]

    def lines(self) -> list[DeliveryLine]:
        """The delivery lines of every attached, open session."""
        return [s.line for s in self.open_sessions()]

    def joining_lines(self) -> list[DeliveryLine]:
        """The delivery lines of explorers whose first sync runs now."""
        return [s.line for s in self.joining.values() if s.line is not None and not s.line.closed]

    def handshake_lines(self) -> set[DeliveryLine]:
        """Lines an NCCL handshake waits for: explorers that are running and alive."""
        return {s.line for s in self.open_sessions() if s.expects_handshakes}

    # -- changes -----------------------------------------------------------------------

    def changed(self) -> None:
        """Something handshakes and joins wait on changed (an explorer joined, stopped, left or
        was lost): wake everything waiting on the source or on a line."""
        self.source._notify()
        for session in list(self.sessions.values()):
            if session.line is not None:
                session.line.notify()

    # -- requests ----------------------------------------------------------------------

    def request(self, line: DeliveryLine, held: int | None) -> int | None:
        """Queue an explorer's ask for the newest weights on ``line``; returns the request's seq,
        or ``None`` when nothing newer can come (the trainer stopped, S5). EXPLORER_DRIVEN and
        NCCL requests wait for the trainer at most ``sync_timeout``. (A FIXED explorer waits for
        a newer version on its own side before it asks: :meth:`Explorer.sync_weight`.)"""
        cfg, source = self.config, self.source
        latest = source.latest
        needs_trainer = cfg.method is SyncMethod.NCCL or cfg.style is SyncStyle.EXPLORER_DRIVEN
        if source.trainer_stopped:
            if cfg.method is SyncMethod.NCCL or latest is None or (held is not None and latest.version <= held):
                return None
            needs_trainer = False
        elif cfg.method is not SyncMethod.NCCL and latest is not None and (held is None or held < latest.version):
            needs_trainer = False  # a newer version exists already: it is sent now, not after the next publish
        if needs_trainer:
            fresh_after = source.seq if cfg.method is not SyncMethod.NCCL else None
            return line.request(fresh_after=fresh_after, deadline=time.monotonic() + cfg.sync_timeout)
        return line.request()

    async def wait_settled(self, lines: Iterable[DeliveryLine], timeout: float) -> list[DeliveryLine]:
        """Wait until no delivery is outstanding on ``lines``; returns those still busy after ``timeout``."""
        deadline = time.monotonic() + timeout
        return [line for line in lines
                if not await line.wait_settled(max(0.0, deadline - time.monotonic())) and not line.closed]

    async def wait_applied(self, lines: Iterable[DeliveryLine], version: int, timeout: float, *,
                           until_idle: bool = False) -> list[DeliveryLine]:
        """Wait until every line's explorer applied ``version`` or newer (or stopped, left, was
        lost; ``until_idle``: or its line has nothing in flight any more); returns the lines
        still below it after ``timeout``."""
        deadline = time.monotonic() + timeout
        joining = set(self.joining_lines())

        def caught_up(line: DeliveryLine) -> bool:
            return (line.applied_version is not None and line.applied_version >= version) or \
                (until_idle and not line.busy) or (line not in self.handshake_lines() and line not in joining)

        return [line for line in lines
                if not await line.wait_for(lambda line=line: caught_up(line), max(0.0, deadline - time.monotonic()))]

    async def wait_served(self, handed: list[tuple[DeliveryLine, int]], timeout: float) -> list[DeliveryLine]:
        """Wait until every ``(line, seq)`` was served; returns the lines that were not in time."""
        deadline = time.monotonic() + timeout
        return [line for line, seq in handed
                if not await line.wait_served(seq, max(0.0, deadline - time.monotonic())) and not line.closed]
