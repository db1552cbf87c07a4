"""A sharded trainer's ranks (FSDP2): shard-local syncs, with one synchronizer.

Every rank of the trainer keeps the snapshot of its own shard and builds its own shard's patch
(:mod:`aiosync.syncers.patch.shards`); one rank — the trainer's rank 0 — runs the
:class:`~aiosync.Synchronizer` (sessions, schedules, fan-out, explorers) and attaches the
trainer with ``attach_trainer(model, shard_peers=[...])``; every other rank runs a
:class:`ShardPeer` over a transport to it::

    # rank 0 of the trainer
    async with Synchronizer({"method": "nccl", ...}, PATCH) as sync:
        trainer = await sync.attach_trainer(model, shard_peers=[group.transport(r, tag=SHARD_TAG)
                                                                 for r in trainer_ranks[1:]])
        ...
        for step in range(steps):
            await anyio.to_thread.run_sync(train_step)
            await trainer.step_done()

    # every other rank of the trainer
    async with ShardPeer(model, group.transport(0, tag=SHARD_TAG)) as peer:
        for step in range(steps):
            await anyio.to_thread.run_sync(train_step)   # FSDP's collectives: every rank
            await peer.step_done()                       # wherever rank 0 calls step_done()

Syncs happen at the trainer's check points, as with the NCCL method (which a sharded trainer
uses): rank 0 opens a window at ``step_done()``; every shard of the version is built from that
step, each by its rank, in parallel; rank 0 says :class:`~.protocol.ShardGo` when its check
point is over, and the ranks train on. A command is only carried out at the step it names (one
for a step a rank has not reached yet waits until it has), so no version ever mixes two steps.
Before its first ``step_done()`` and after its last, a rank serves at any time; between two
steps it serves while rank 0 says so (:class:`~.protocol.ShardServe`: ``wait_for_explorers`` or
an ``attach_explorer`` in rank 0's trainer task, after its check point): a synchronous trainer's
weights cannot change while rank 0 is not training — the other ranks' next step waits for rank
0 in its first collective — so explorers that join then are bootstrapped from the ranks' live
shards of the step just done.

Train in a worker thread (``anyio.to_thread.run_sync``): the event loop of every rank must stay
free to answer rank 0 while the collectives of a step run.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import anyio
import torch

from ..errors import (ClosedResourceError, ConfigError, EndOfStream, PeerTimeoutError, TrainerRankLostError,
                      TransportError)
from ..syncers.base import recv_with_timeout
from ..syncers.common.payloads import ShardHello
from ..syncers.patch.shards import ShardLink, ShardServer
from ..syncers.patch.shards_direct import ROUND_GRACE, PartCache
from ..syncers.common.state_dicts import collect_param_names_need_sync, module_state_dict
from ..transports.base import Transport
from .protocol import ShardClose, ShardGo, ShardServe

log = logging.getLogger("aiosync.sync")

#: The point-to-point tag of the channels between a trainer's ranks (apart from the explorers').
SHARD_TAG = 0x5A5D

T = TypeVar("T")


def _names(model: Any, names: Iterable[str] | None) -> list[str]:
    if names is not None:
        return list(names)
    if isinstance(model, torch.nn.Module):
        return collect_param_names_need_sync(model)
    return list(model)


class ShardPeer:
    """A rank of a sharded trainer that does not run the synchronizer: serves the commands of
    the rank that does, over ``transport`` (see the module docstring). ``routes``: a channel
    to each explorer — direct routes: this rank's parts go straight to the explorers, which
    fetch them (their ``Explorer(shard_routes=...)``); the synchronizer's rank forwards refs only.

    ``model``: the rank's module (its state dict holds DTensors) or a mapping of its pieces
    (DTensors, :class:`~aiosync.checkpoints.TensorSlice`). ``rank``: its shard's index among
    the trainer's ranks (default: its torch.distributed rank). ``timeout`` bounds every wait on
    rank 0 (a ``step_done()`` waiting for the end of rank 0's check point, the final drain).
    ``round_grace``: with routes over a process group, the most seconds a multicast round of this
    rank's patch waits for a due explorer's fetch after the first one came
    (:class:`~aiosync.syncers.patch.shards_direct.PartCache`).
    """

    def __init__(self, model: Any, transport: Transport, *, rank: int | None = None,
                 names: Iterable[str] | None = None, timeout: float = 600.0,
                 routes: Iterable[Transport] | None = None, round_grace: float = ROUND_GRACE) -> None:
        if rank is None:
            import torch.distributed as dist

            if not (dist.is_available() and dist.is_initialized()):
                raise ConfigError("ShardPeer: pass rank= or initialise torch.distributed (its rank is the default)")
            rank = dist.get_rank()
        if rank == 0:
            raise ConfigError("ShardPeer: shard 0 is the synchronizer's rank (attach_trainer(..., shard_peers=...))")
        self.model, self.transport, self.timeout = model, transport, timeout
        self.step = 0
        self.closed = False
        #: Why rank 0 is gone (its channel broke), or ``None``.
        self.error: BaseException | None = None
        self.server = ShardServer(rank, lambda: module_state_dict(self.model), _names(model, names), transport.send,
                                  lambda: self.step)
        #: Direct routes: a channel to each explorer (:mod:`aiosync.syncers.patch.shards_direct`).
        self.routes = list(routes) if routes is not None else None
        if self.routes is not None:
            if isinstance(round_grace, bool) or not isinstance(round_grace, (int, float)) or not round_grace >= 0:
                raise ConfigError(f"ShardPeer: round_grace must be a number of seconds >= 0, got {round_grace!r}")
            self.server.cache = PartCache(rank, timeout=timeout, round_grace=round_grace)
        self._go = 0
        self._serving = anyio.Event()
        self._changed = anyio.Event()
        self._tg: Any = None
        self._routes_open = 0

    @property
    def snapshot_bytes(self) -> int:
        """Bytes this rank holds for syncs: its shard's snapshots and their scratch."""
        return self.server.snapshot_bytes

    def _notify(self) -> None:
        self._changed.set()
        self._changed = anyio.Event()

    async def __aenter__(self) -> "ShardPeer":
        hello = self.server.hello()
        with anyio.fail_after(self.timeout):
            await self.transport.send(hello)
        self._tg = anyio.create_task_group()
        await self._tg.__aenter__()
        self._serving.set()  # before the first step: the weights do not change yet
        self._tg.start_soon(self._read)
        for route in self.routes or ():
            self.serve_route(route)
        return self

    def serve_route(self, route: Transport) -> None:
        """Serve one more explorer's direct route (an explorer that joins later, or came back on a
        new channel); the peer must have been made with ``routes`` (``[]`` for none yet) and be
        entered."""
        if self.server.cache is None or self._tg is None:
            raise ConfigError("ShardPeer.serve_route: make the peer with routes=[...] (direct routes) and enter it "
                              "first")
        self._routes_open += 1
        self._tg.start_soon(self._serve_route, route)

    async def _serve_route(self, route: Transport) -> None:
        try:
            await self.server.cache.serve(route.send, route.recv, transport=route)
        finally:
            self._routes_open -= 1
            self._notify()

    async def step_done(self) -> None:
        """The end of one train step on this rank: carry out rank 0's commands for this step,
        until rank 0's check point is over (bounded by ``timeout``). A call cancelled before
        that is resumed by the next one (the rank reached the step; it is not counted twice)."""
        self._check()
        if self._go >= self.step:  # the last check point is over: this is the next step
            self.step += 1
        self._serving.set()
        self._notify()  # a command for this step that came early runs now
        with anyio.move_on_after(self.timeout):
            while self._go < self.step and not self.closed:
                await self._changed.wait()
        self._check()
        if self._go < self.step:
            raise PeerTimeoutError(f"shard rank {self.server.rank}: rank 0 did not finish its check point of step "
                                   f"{self.step} within {self.timeout}s (call step_done() on every rank of the trainer, "
                                   "at the same steps)")

    def _check(self) -> None:
        if self.error is not None:
            raise TrainerRankLostError(f"trainer rank 0 (the synchronizer's rank) is gone for shard rank "
                                       f"{self.server.rank}: {self.error}", rank=0) from self.error

    async def __aexit__(self, *exc: Any) -> None:
        try:
            if exc[0] is None and not self.closed:  # serve the final syncs (drain, repairs) until rank 0 closes
                self._serving.set()
                with anyio.move_on_after(self.timeout):
                    while not self.closed:
                        await self._changed.wait()
            if exc[0] is None:  # every explorer's process says goodbye: nothing is left posted
                with anyio.move_on_after(self.timeout):
                    while self._routes_open:
                        await self._changed.wait()
        finally:
            self._tg.cancel_scope.cancel()
            await self._tg.__aexit__(None, None, None)
            self.server.close()

    async def _read(self) -> None:
        while True:
            try:
                msg = await self.transport.recv()
            except PeerTimeoutError:
                continue
            except (EndOfStream, TransportError, ClosedResourceError) as exc:
                self.error, self.closed = exc, True
                self._notify()
                return
            if isinstance(msg, ShardServe):
                if msg.step == self.step:  # rank 0 serves a joiner between steps: so do we
                    self._serving.set()
                    self._notify()
            elif isinstance(msg, ShardGo):
                if msg.step >= self.step:
                    self._serving = anyio.Event()  # training again: later commands wait for the next step
                self._go = max(self._go, msg.step)
                self._notify()
            elif isinstance(msg, ShardClose):
                self.closed = True
                self._notify()
                return
            else:
                await self._until_step(getattr(msg, "boundary", self.step))
                await self._serving.wait()
                await self.server.handle(msg)

    async def _until_step(self, step: int) -> None:
        """A command for a step this rank has not reached yet (rank 0 got there first) waits
        until it does (at most ``timeout``: then the command is refused as out of step)."""
        with anyio.move_on_after(self.timeout):
            while self.step < step and not self.closed:
                await self._changed.wait()


@dataclass(eq=False)
class ShardPeers:
    """The synchronizer rank's side of the other ranks: their links (for the sharded sender)
    and the check points it tells them about."""

    transports: list
    links: list = field(default_factory=list)
    timeout: float = 600.0
    #: Set when a rank is gone (its link's ``gone``): shared by every link.
    lost: anyio.Event = field(default_factory=anyio.Event)

    async def connect(self, names: list[str]) -> None:
        """Every rank's layout (:class:`ShardHello`), bounded by ``timeout``."""
        for t in self.transports:
            hello = await recv_with_timeout(t.recv, self.timeout, "a shard rank's layout")
            if not isinstance(hello, ShardHello):
                raise ConfigError(f"expected a ShardHello from a shard rank, got {type(hello).__name__}")
            if list(hello.names) != list(names):
                diff = sorted(set(names) ^ set(hello.names))[:3]
                raise ConfigError(f"shard rank {hello.rank} syncs other keys than this rank (e.g. {diff}): every rank "
                                  "of the trainer must sync the same keys")
            self.links.append(ShardLink(hello.rank, t.send, t.recv, hello.pieces, lost=self.lost))

    def check(self) -> None:
        """Raise :class:`~aiosync.errors.TrainerRankLostError` for the first rank that is gone."""
        for link in self.links:
            if link.gone is not None:
                raise link.gone

    async def unless_lost(self, call: Callable[[], Awaitable[T]]) -> T:
        """``await call()``, ended at once with :class:`~aiosync.errors.TrainerRankLostError`
        naming the rank when one is gone meanwhile: its channel failed in a conversation, or
        its transport says it broke (a transport with ``wait_broken()``, e.g.
        :class:`~aiosync.transports.ray.RayChannel`: its actor died or its node was lost) — not
        after the deliveries' bounds. A lost rank wins over the error ``call`` met meanwhile
        (which it explains); any other error is raised as it is."""
        self.check()
        result: Any = None
        error: Exception | None = None
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._watch, tg.cancel_scope)
            try:
                result = await call()
            except Exception as exc:  # raised below as it is, not inside an exception group
                error = exc
            finally:
                tg.cancel_scope.cancel()
        self.check()
        if error is not None:
            raise error
        return result

    async def _watch(self, scope: anyio.CancelScope) -> None:
        """Cancel ``scope`` once a rank is gone (``lost``); a link whose transport can tell that it
        broke is made gone when it does."""
        async with anyio.create_task_group() as tg:
            for transport, link in zip(self.transports, self.links):
                wait_broken = getattr(transport, "wait_broken", None)
                if callable(wait_broken):
                    tg.start_soon(self._broken, link, wait_broken)
            await self.lost.wait()
            tg.cancel_scope.cancel()
        scope.cancel()

    @staticmethod
    async def _broken(link: ShardLink, wait_broken: Callable[[], Awaitable[BaseException]]) -> None:
        why = await wait_broken()
        link.gone_now(why, "(its transport says it broke)")

    async def go(self, step: int) -> None:
        """Rank 0's check point of ``step`` is over: every rank trains on. Then a rank that is
        gone (or whose link fails now) raises :class:`~aiosync.errors.TrainerRankLostError`
        naming it: the trainer cannot go on without it."""
        for link in self.links:
            try:
                async with link.lock:
                    with link.talking(f"after step {step}"):
                        await link.send(ShardGo(step))
            except TrainerRankLostError:
                continue  # the live ranks are told first
        self.check()

    @contextlib.asynccontextmanager
    async def serving(self, step: int) -> AsyncIterator[None]:
        """Rank 0 serves explorers between steps (after its check point of ``step``): every rank
        serves its commands meanwhile (:class:`ShardServe`), then trains on (:class:`ShardGo`,
        sent also when the body fails or is cancelled)."""
        for link in self.links:
            async with link.lock:
                await link.send(ShardServe(step))
        try:
            yield
        finally:
            with anyio.CancelScope(shield=True), anyio.move_on_after(self.timeout):
                await self.go(step)

    async def close(self, reason: str = "") -> None:
        """The synchronizer closes: the ranks stop serving (bounded, quiet)."""
        with anyio.move_on_after(min(self.timeout, 30.0), shield=True):
            for link in self.links:
                try:
                    async with link.lock:
                        await link.send(ShardClose(reason))
                except (EndOfStream, TransportError, ClosedResourceError, PeerTimeoutError) as exc:
                    log.debug("aiosync: could not tell shard rank %d to stop: %s", link.rank, exc)
