"""The synchronizer rank's channel to one other rank of a sharded trainer (:class:`ShardLink`).

A rank whose channel fails in a conversation, or whose transport says it broke, is *gone* for
good: a sharded trainer cannot go on without it (:class:`~aiosync.errors.TrainerRankLostError`
naming it; :mod:`aiosync.syncers.patch.shards`). This module imports only errors and message
types: the code above it that watches the links calls :meth:`ShardLink.gone_now`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import anyio

from ...errors import ClosedResourceError, EndOfStream, TrainerRankLostError, TransportError
from ...messages import RecvFn, SendFn

_GONE = (EndOfStream, TransportError, ClosedResourceError)


@dataclass(eq=False)
class ShardLink:
    """The synchronizer rank's channel to one other shard rank (``send`` / ``recv``), its
    layout (:class:`ShardHello`), and a lock: one conversation at a time. ``drops``: senders
    to drop there before the next command; ``abandoned``: a conversation given up half way
    (its remaining answers are skipped, up to its :class:`ShardDone`, before the next one)."""

    rank: int
    send: SendFn
    recv: RecvFn
    pieces: dict
    lock: anyio.Lock = field(default_factory=anyio.Lock)
    drops: list = field(default_factory=list)
    abandoned: int | None = None
    #: What this rank is waited for now (``None``: nothing): a delivery that outlives its bound
    #: names it — the rank stalled, not the explorer.
    waiting: str | None = None
    #: Why this rank is gone (its channel failed: the rank died), or ``None``; ``lost`` is set
    #: then (one event shared by every link of the trainer, :meth:`gone_now` sets both).
    gone: TrainerRankLostError | None = None
    lost: anyio.Event = field(default_factory=anyio.Event)
    #: The conversations under way (:meth:`talking`): ended when the rank is found gone.
    talks: set = field(default_factory=set)

    def gone_now(self, exc: BaseException, what: str) -> TrainerRankLostError:
        """This rank's channel failed (``exc``) during ``what``: the rank is gone for good; a
        conversation with it still waiting ends with its :class:`TrainerRankLostError`."""
        if self.gone is None:
            self.gone = TrainerRankLostError(
                f"trainer rank {self.rank} is gone: its shard channel failed {what} ({type(exc).__name__}: {exc}); a "
                "sharded trainer cannot go on without one of its ranks: restart the trainer's ranks together",
                rank=self.rank)
            self.gone.__cause__ = exc
            self.lost.set()
            for scope in self.talks:
                scope.cancel()
        return self.gone

    @contextlib.contextmanager
    def talking(self, what: str) -> Iterator[None]:
        """A conversation with this rank: one that is gone raises its :class:`TrainerRankLostError`
        at once, a channel that fails now makes it gone, and one found gone meanwhile (its
        transport said it broke: :meth:`gone_now`) ends it."""
        if self.gone is not None:
            raise self.gone
        try:
            with anyio.CancelScope() as scope:
                self.talks.add(scope)
                try:
                    yield
                finally:
                    self.talks.discard(scope)
        except _GONE as exc:
            raise self.gone_now(exc, what) from exc
        if scope.cancelled_caught and self.gone is not None:
            raise self.gone


__all__ = ["ShardLink"]
