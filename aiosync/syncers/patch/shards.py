"""Shard-local patches (FSDP2 trainers): every trainer rank diffs and sends its own shard.

A rank of a sharded trainer holds a *piece* of each synced tensor: FSDP2 (``fully_shard``)
shards dim 0, so rank ``r`` holds rows ``[o_r, o_r + n_r)`` — possibly none, and not
necessarily as many as the others; a plain tensor (a buffer, a replicated parameter) is whole
on every rank and belongs to shard 0. Each rank keeps the snapshot of its own pieces, diffs
and encodes them itself: no rank materialises another rank's data, and sender memory and build
time scale with a rank's shard, not with the model (docs/performance.md).

A shard is a model of its own (:mod:`aiosync.syncers.patch.shard_layout`): its pieces on the sender, the same rows
of the receiver's tensors on the receiver, and the receiver metadata of those rows. So a shard's sender is an ordinary
:class:`~aiosync.syncers.patch.syncer.PatchWeightSyncer` over the rank's local pieces — its ordinals,
positions, drift hashes and bootstrap buckets are those of the piece — and the receiver writes
each shard through views of its full tensors.

* :class:`ShardServer` — on every rank but the synchronizer's: runs :class:`ShardInit`,
  :class:`ShardBuild` and :class:`ShardDrop` for its own pieces, at the trainer step the
  command names (a command for another step is refused: shards of one version are built from
  one step).
* :class:`ShardedPatchSender` — on the synchronizer's rank (made by :class:`ShardSet`): the
  sender of the whole model. Its own shard is built in this process, the others by their ranks
  in parallel; what it sends the receiver is one :class:`SenderHello` with a ``shards`` table,
  each shard's bootstrap in turn (relayed a bucket at a time), and per version one
  :class:`ShardedPatch` whose shards are :class:`~aiosync.messages.Shared` parts — a rank's
  patch is encoded once, on that rank, and relayed as the bytes it came in.
* The receiver (:mod:`aiosync.syncers.patch.receiver`: :func:`~aiosync.syncers.patch.receiver.receiver_shards`,
  :class:`~aiosync.syncers.patch.receiver.ShardedWrite`) is a :class:`PatchWeightSyncer` whose hello has
  ``shards``: every shard is validated on its own, then all are written in one exclusive
  section with one undo journal — a version is applied only when every shard of it is in,
  all-or-nothing.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import anyio
import torch

from ...aio import hold_all
from ...errors import ConfigError, HandshakeError, PatchChainError, PayloadError
from ...messages import RecvFn, SendFn, Shared, payload_nbytes
from ..base import SyncStatistics, WeightSyncer, recv_with_timeout
from ..bucket.format import check_version
from .handshake import check_metadata, is_int
from .shard_layout import shard_layout, shard_metadata, shard_rows
from ..common.payloads import (EmptyWeightPatch, ReceiverMetadata, SenderHello, ShardBuild, ShardDone, ShardDrop,
    ShardedPatch, ShardHello, ShardInit, ShardRef)
from .shard_link import ShardLink
from .shards_direct import PartCache, is_ref

#: Scratch of a shard's builder, as a fraction of its elements (bounded to [64 Ki, 4 Mi] elements
#: per chunk): sender memory stays about one shard snapshot.
SCRATCH_FRACTION = 1 / 64


# ----------------------------------------------------------------------------- a shard rank

def _shard_syncer(config: Any, bootstrap: bool) -> WeightSyncer:
    syncer = WeightSyncer.create(config)
    if not hasattr(syncer, "scratch_fraction"):
        raise ConfigError(f"shard-local syncs need a patch syncer, got weight_syncer type {config.get('type')!r}")
    syncer.scratch_fraction = SCRATCH_FRACTION
    if bootstrap:
        syncer.require_full_bootstrap()
    return syncer


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


@dataclass(eq=False)
class ShardServer:
    """Runs the synchronizer rank's commands for shard ``rank``: its pieces come from
    ``live()`` (the rank's live state dict), answers go out through ``send``. A command for
    another trainer step than ``boundary()`` is refused (:class:`ShardDone` with the reason)."""

    rank: int
    live: Callable[[], Mapping[str, torch.Tensor]]
    names: list[str]
    send: SendFn
    boundary: Callable[[], int]
    senders: dict = field(default_factory=dict)
    #: Patches built (one per version and lineage, however many explorers take it), and the
    #: most bytes this rank held for syncs at once (snapshots and their builders' scratch).
    builds: int = 0
    build_s: float = 0.0
    peak_bytes: int = 0
    #: Bytes of the snapshots alone (the shard's pieces, in the receivers' dtypes), last seen.
    snapshot_nbytes: int = 0
    #: Direct routes (:mod:`.shards_direct`): this rank's parts wait here for the explorers to
    #: fetch, and the synchronizer's rank gets refs; ``None``: parts go to that rank (relayed).
    cache: PartCache | None = None
    #: Bytes of the patches this rank built (each encoded once, however many explorers take it).
    patch_bytes: int = 0

    def hello(self) -> ShardHello:
        _, layout = shard_layout(self.live(), self.rank, self.names)
        return ShardHello(self.rank, layout, list(self.names))

    @property
    def snapshot_bytes(self) -> int:
        return sum(s.snapshot.nbytes + s.snapshot.scratch_bytes for s in self.senders.values() if s.snapshot)

    def _held(self) -> None:
        self.peak_bytes = max(self.peak_bytes, self.snapshot_bytes)
        self.snapshot_nbytes = sum(s.snapshot.nbytes for s in self.senders.values() if s.snapshot)

    async def handle(self, cmd: Any) -> None:
        if isinstance(cmd, ShardDrop):
            self._drop(cmd.sender)
            return
        if not isinstance(cmd, (ShardInit, ShardBuild)):
            raise PayloadError(f"shard rank {self.rank} got an unexpected {type(cmd).__name__}")
        if cmd.boundary != self.boundary():
            await self.send(ShardDone(cmd.sender, False, f"shard rank {self.rank} is at trainer step {self.boundary()}"
                                      f" but was asked for step {cmd.boundary}: call step_done() on every rank of "
                                      "the trainer, at the same steps"))
            return
        try:
            if isinstance(cmd, ShardInit):
                await self._init(cmd)
            else:
                await self._build(cmd)
        except Exception as exc:  # told to the synchronizer's rank, which repairs
            await self.send(ShardDone(cmd.sender, False, _describe(exc)))

    def _init_send(self, sender: int) -> SendFn:
        """Where an init conversation's answers go: with direct routes, each bootstrap bucket
        waits in the cache for its explorer and the synchronizer's rank gets its ref."""
        cache = self.cache
        if cache is None:
            return self.send

        async def send(msg: Any) -> None:
            if isinstance(msg, (SenderHello, ShardDone)):
                await self.send(msg)
            else:
                await cache.bucket(sender, msg, self.send)

        return send

    async def _init(self, cmd: ShardInit) -> None:
        tensors, _ = shard_layout(self.live(), self.rank, self.names)
        if cmd.accept:  # one more receiver onto an existing sender: no new snapshot
            syncer = self.senders.get(cmd.sender)
            if syncer is None:
                raise PatchChainError(f"shard rank {self.rank} has no sender {cmd.sender} to take a receiver onto",
                                      expected_base=None, receiver_version=None)
            await syncer.accept(tensors, cmd.meta, self._init_send(cmd.sender),
                                like=_shard_syncer(cmd.config, cmd.bootstrap))
            await self.send(ShardDone(cmd.sender, True, stats={"snapshot_bytes": self.snapshot_bytes}))
            return
        syncer = _shard_syncer(cmd.config, cmd.bootstrap)

        async def recv() -> ReceiverMetadata:
            return cmd.meta

        self._drop(cmd.sender)
        await syncer.init_sender(tensors, [k for k in self.names if k in tensors], self._init_send(cmd.sender), recv)
        self.senders[cmd.sender] = syncer
        self._held()
        await self.send(ShardDone(cmd.sender, True, stats={"snapshot_bytes": self.snapshot_bytes}))

    async def _build(self, cmd: ShardBuild) -> None:
        syncer = self.senders.get(cmd.sender)
        if syncer is None:
            raise PatchChainError(f"shard rank {self.rank} has no sender {cmd.sender} (dropped, or never made)",
                                  expected_base=None, receiver_version=None)
        tensors, _ = shard_layout(self.live(), self.rank, self.names)

        async def send(patch: Any) -> None:
            part = Shared(patch)  # encoded once, here: relayed as these bytes, or fetched by each explorer
            self.patch_bytes += payload_nbytes(part)
            await self.send(part if self.cache is None else self.cache.patch(cmd.sender, cmd.version, part))

        await syncer.sync(tensors, send, cmd.version)
        self.builds += 1
        self._held()
        st = syncer.statistics()
        self.build_s += (st.build_s or 0.0) + (st.encode_s or 0.0)
        await self.send(ShardDone(cmd.sender, True, stats={"changed": st.changed, "bytes": st.bytes,
                                                           "build_s": st.build_s, "encode_s": st.encode_s,
                                                           "snapshot_bytes": self.snapshot_bytes}))

    def _drop(self, sender: int) -> None:
        if self.cache is not None:
            self.cache.drop(sender)
        old = self.senders.pop(sender, None)
        if old is not None:
            old.close()

    def close(self) -> None:
        for sender in list(self.senders):
            self._drop(sender)


# ----------------------------------------------------------------------------- the synchronizer's rank



@dataclass(eq=False)
class ShardSet:
    """A sharded trainer as the synchronizer's rank sees it: its own live state (shard 0),
    the links to the other shards, the patch config every shard's sender uses, and the trainer
    step now (``boundary``). :meth:`make` is the synchronizer's sender factory."""

    live: Callable[[], Mapping[str, torch.Tensor]]
    names: list[str]
    links: list[ShardLink]
    config: Any
    boundary: Callable[[], int]
    timeout: float | None = 600.0
    rows: list = field(default_factory=list)
    #: The senders alive (not closed); the most bytes this rank held for their shard 0 at once
    #: (snapshots and builders' scratch); bytes of other ranks' payloads relayed (their patches,
    #: their bootstrap buckets, one at a time).
    senders: list = field(default_factory=list)
    peak_bytes: int = 0
    relayed_bytes: int = 0
    #: The largest payload relayed at once (a bootstrap bucket: ``init_sync.bucket_size``), and
    #: shard 0's patches built here (one per version and lineage).
    relayed_peak: int = 0
    builds: int = 0
    build_s: float = 0.0
    patch_bytes: int = 0
    _next_id: int = 0
    _stalled: str | None = None

    def __post_init__(self) -> None:
        _, own = shard_layout(self.live(), 0, self.names)
        layouts = [own] + [link.pieces for link in self.links]
        self.rows = shard_rows(layouts)
        self.shapes = {k: tuple(p[2]) for lay in layouts for k, p in lay.items()}
        missing = [k for k in self.names if k not in self.shapes]
        if missing:
            raise ConfigError(f"no shard of the trainer holds {missing[0]!r}")

    def local(self) -> dict[str, torch.Tensor]:
        return shard_layout(self.live(), 0, self.names)[0]

    def make(self, bootstrap: bool) -> "ShardedPatchSender":
        self._next_id += 1
        sender = ShardedPatchSender(self, self._next_id, bootstrap)
        self.senders.append(sender)
        return sender

    @property
    def held_bytes(self) -> int:
        """Bytes this rank holds for its shard now (every live sender's snapshot and scratch)."""
        return sum(s.snapshot_bytes for s in self.senders)

    def held(self) -> None:
        self.peak_bytes = max(self.peak_bytes, self.held_bytes)

    def relayed(self, payload: Any) -> None:
        if is_ref(payload):  # a direct route: the explorers fetch the part from its rank
            return
        n = payload_nbytes(payload)
        self.relayed_bytes += n
        self.relayed_peak = max(self.relayed_peak, n)

    async def command(self, link: ShardLink, cmd: Any) -> None:
        """Send ``cmd`` to ``link``'s rank (the caller holds ``link.lock``): first what an
        abandoned conversation still sends is skipped, and pending drops go out."""
        if link.abandoned is not None:
            while True:
                msg = await self.reply(link, "answer to an abandoned command")
                if isinstance(msg, ShardDone) and msg.sender == link.abandoned:
                    break
            link.abandoned = None
        drops, link.drops = link.drops, []
        with self._waiting_for(link, f"to take a command for step {self.boundary()}"), \
                link.talking(f"taking a command for step {self.boundary()}"):
            for sender in drops:
                await link.send(ShardDrop(sender))
            await link.send(cmd)

    async def reply(self, link: ShardLink, what: str) -> Any:
        with self._waiting_for(link, f"for its {what} of step {self.boundary()}"), \
                link.talking(f"sending its {what} of step {self.boundary()}"):
            return await recv_with_timeout(link.recv, self.timeout, f"shard rank {link.rank}'s {what}")

    @contextlib.contextmanager
    def _waiting_for(self, link: ShardLink, what: str) -> Iterator[None]:
        link.waiting = what
        try:
            yield
        except anyio.get_cancelled_exc_class():  # a delivery's bound: its message names this rank
            self._stalled = f"shard rank {link.rank} (waited {what})"
            raise
        finally:
            link.waiting = None

    def stalled(self) -> str | None:
        """The ranks waited for now — or, once, the one a cancelled wait was for — named, for a
        timeout's message; ``None``: none."""
        waited = [f"shard rank {link.rank} (waited {link.waiting})" for link in self.links if link.waiting is not None]
        last, self._stalled = self._stalled, None
        return ", ".join(waited) or last


class ShardedPatchSender(WeightSyncer):
    """The sender of a sharded trainer's whole model, on the synchronizer's rank (one per
    fan-out lineage; see the module docstring). Made by :meth:`ShardSet.make`."""

    supports_no_wait = True
    payloads_per_sync = 1
    fan_out_mode = "chain"
    shares_payloads = True
    accepts_receivers = True

    def __init__(self, shards: ShardSet, sender_id: int, bootstrap: bool) -> None:
        super().__init__()
        self.shards, self.id, self.bootstrap = shards, sender_id, bootstrap
        self.local: WeightSyncer | None = None
        self._last_version: int | None = None
        self._broken: str | None = "init_sender has not run"
        self.shard_stats: list[dict] = []

    async def init_sender(self, state_dict, param_names_need_sync, send: SendFn, recv: RecvFn | None = None,
                          is_sender: bool = True) -> None:
        """The receiver's metadata in, every shard's handshake (run by its rank), one hello
        with the shard table out, then each shard's bootstrap, a bucket at a time."""
        meta = await recv_with_timeout(recv, self.shards.timeout, "the receiver's metadata")
        self.local = _shard_syncer(self.shards.config, self.bootstrap)
        await self._handshake(meta, send, accept=False, bootstrap=self.bootstrap)
        self._last_version, self._broken = None, None

    async def accept(self, state_dict, meta: ReceiverMetadata, send: SendFn, *,
                     like: "ShardedPatchSender") -> ShardedPatch:
        """One more receiver onto this sender's chain at the version every shard holds (each
        rank's sender takes it, no new snapshots); returns its first payload, a sharded patch
        of empty shards. ``like``: the sender it would have had (its ``bootstrap``)."""
        bootstrap = like.bootstrap
        if self._broken is not None or self._last_version is None:
            raise PatchChainError(f"this sharded sender cannot take a receiver now: {self._broken or 'nothing built'}",
                                  expected_base=self._last_version, receiver_version=None)
        await self._handshake(meta, send, accept=True, bootstrap=bootstrap)
        empty = [Shared(EmptyWeightPatch(self._last_version, None, meta.session)) for _ in self.shards.rows]
        return ShardedPatch(self._last_version, None, empty)

    async def _handshake(self, meta: Any, send: SendFn, *, accept: bool, bootstrap: bool) -> None:
        s = self.shards
        try:
            if not isinstance(meta, ReceiverMetadata):
                raise HandshakeError(f"expected ReceiverMetadata from the receiver, got {type(meta).__name__}")
            check_metadata(meta)
            have = dict(zip(meta.ordered_keys, (tuple(x) for x in meta.original_shapes)))
            for key in s.names:
                if key not in have:
                    raise HandshakeError(f"sender key {key!r} is missing on the receiver")
                if have[key] != s.shapes[key]:
                    raise HandshakeError(f"shape mismatch for {key!r}: sender {s.shapes[key]}, receiver {have[key]}")
        except HandshakeError as exc:
            await send(SenderHello(ok=False, error=str(exc), session=meta.session if is_int(getattr(
                meta, "session", None)) else None))
            raise
        subs = [shard_metadata(meta, rows) for rows in s.rows]
        local_tx, local_rx = anyio.create_memory_object_stream(0)
        readers = [_Reader(local_rx.receive, "shard 0")] + [
            _Reader(lambda link=link: s.reply(link, "answer"), f"shard rank {link.rank}", link) for link in s.links]
        try:
            async with hold_all(link.lock for link in s.links), _one_error(), anyio.create_task_group() as tg:
                tg.start_soon(self._local_handshake, subs[0], local_tx, accept, bootstrap)
                for reader, sub in zip(readers[1:], subs[1:]):
                    await s.command(reader.link, ShardInit(self.id, s.boundary(), sub, s.config, bootstrap, accept))
                    reader.started = True
                hellos = [await r.next() for r in readers]
                refused = [f"{r.what}: {getattr(h, 'error', None) or type(h).__name__}"
                           for r, h in zip(readers, hellos) if not (isinstance(h, SenderHello) and h.ok)]
                if refused:
                    await send(SenderHello(ok=False, error="; ".join(refused), session=meta.session))
                    for r, h in zip(readers, hellos):
                        await r.drain(h)
                    raise HandshakeError(f"a shard refused the receiver: {'; '.join(refused)}")
                await send(SenderHello(ok=True, init_sync=any(h.init_sync for h in hellos), session=meta.session,
                                       shards=[{"rows": rows, "synced": list(h.synced_ordinals),
                                                "init_sync": h.init_sync} for rows, h in zip(s.rows, hellos)]))
                self.shard_stats = [await r.forward(send, s) for r in readers]
        finally:
            for r in readers:
                r.abandon(self.id)
        s.held()

    async def _local_handshake(self, sub: ReceiverMetadata, tx, accept: bool, bootstrap: bool) -> None:
        async def recv() -> ReceiverMetadata:
            return sub

        async with tx:
            try:
                tensors = self.shards.local()
                if accept:
                    await self.local.accept(tensors, sub, tx.send, like=_shard_syncer(self.shards.config, bootstrap))
                else:
                    await self.local.init_sender(tensors, [k for k in self.shards.names if k in tensors], tx.send, recv)
                await tx.send(ShardDone(self.id, True, stats={"snapshot_bytes": self.snapshot_bytes}))
            except Exception as exc:
                await tx.send(ShardDone(self.id, False, _describe(exc)))

    @property
    def snapshot_bytes(self) -> int:
        snap = getattr(self.local, "snapshot", None)
        return 0 if snap is None else snap.nbytes + snap.scratch_bytes

    async def sync(self, state_dict, send: SendFn, version: int) -> None:
        """Every shard builds its patch of ``version`` at once (this rank's here, the others on
        theirs); one :class:`ShardedPatch` goes out. A shard that fails or whose patch is lost
        breaks this sender (:class:`PatchChainError` from then on): the receiver is repaired."""
        version = check_version(version)
        if self._broken is not None:
            raise PatchChainError(f"cannot build the sharded patch of version {version}: {self._broken}",
                                  expected_base=self._last_version, receiver_version=None)
        s, t0 = self.shards, time.perf_counter()
        parts: list = [None] * (1 + len(s.links))
        stats: list = [None] * len(parts)
        readers = [_Reader(lambda link=link: s.reply(link, "patch"), f"shard rank {link.rank}", link)
                   for link in s.links]
        try:
            async with hold_all(link.lock for link in s.links), _one_error(), anyio.create_task_group() as tg:
                for link, reader in zip(s.links, readers):
                    await s.command(link, ShardBuild(self.id, s.boundary(), version))
                    reader.started = True
                tg.start_soon(self._build_local, version, parts, stats)
                for i, reader in enumerate(readers, start=1):
                    tg.start_soon(self._build_remote, reader, parts, stats, i)
        except BaseException as exc:
            self._broken = f"building shard patches of version {version} failed ({_describe(exc)})"
            raise
        finally:
            for r in readers:
                r.abandon(self.id)
        base = self._last_version
        self._last_version = version
        s.held()
        for part in parts[1:]:
            s.relayed(part)
        t1 = time.perf_counter()
        payload = ShardedPatch(version, base, parts)
        await send(payload)
        self.shard_stats = stats
        self._statistics = SyncStatistics(
            version=version, bytes=payload_nbytes(payload), changed=sum(st.get("changed") or 0 for st in stats),
            build_s=t1 - t0, encode_s=max((st.get("encode_s") or 0.0) for st in stats),
            send_s=time.perf_counter() - t1)

    async def _build_local(self, version: int, parts: list, stats: list) -> None:
        collected: list = []

        async def collect(patch: Any) -> None:
            collected.append(patch)

        await self.local.sync(self.shards.local(), collect, version)
        self.shards.builds += 1
        st = self.local.statistics()
        self.shards.build_s += (st.build_s or 0.0) + (st.encode_s or 0.0)
        parts[0] = Shared(collected[0])
        self.shards.patch_bytes += payload_nbytes(parts[0])
        stats[0] = {"changed": st.changed, "bytes": st.bytes, "build_s": st.build_s, "encode_s": st.encode_s,
                    "snapshot_bytes": self.snapshot_bytes}

    async def _build_remote(self, reader: "_Reader", parts: list, stats: list, i: int) -> None:
        rank = reader.link.rank
        patch = await reader.next()
        if isinstance(patch, ShardDone):
            reader.finished = True
            raise PayloadError(f"the patch of shard rank {rank} is missing: {patch.error or 'it sent none'}")
        done = await reader.next()
        if isinstance(done, ShardDone):
            reader.finished = True
        if not isinstance(patch, (Shared, ShardRef)) or not isinstance(done, ShardDone) or not done.ok:
            why = done.error if isinstance(done, ShardDone) else f"a {type(done).__name__} instead of its answer"
            raise PayloadError(f"shard rank {rank} failed to build its patch: {why}")
        parts[i], stats[i] = patch, done.stats

    def close(self) -> None:
        """This lineage is gone: every rank drops its snapshot (before its next command)."""
        if self.local is not None:
            self.local.close()
        if self._broken != "closed":
            self._broken = "closed"
            if self in self.shards.senders:
                self.shards.senders.remove(self)
            for link in self.shards.links:
                link.drops.append(self.id)

    # Receiving is PatchWeightSyncer's (it reads the shard table of the hello).
    async def init_receiver(self, state_dict, recv, send=None) -> None:
        raise NotImplementedError("a ShardedPatchSender only sends; its receiver is a PatchWeightSyncer")

    async def apply(self, model, recv) -> int:
        raise NotImplementedError("a ShardedPatchSender only sends; its receiver is a PatchWeightSyncer")


class _one_error:
    """Raise the first error of a task group as itself (not an exception group): the caller
    reports one reason."""

    async def __aenter__(self) -> None:
        return None

    async def __aexit__(self, exc_type, exc, tb) -> bool:
        if isinstance(exc, BaseExceptionGroup):
            first = exc
            while isinstance(first, BaseExceptionGroup):
                first = first.exceptions[0]
            raise first from exc
        return False


@dataclass(eq=False)
class _Reader:
    """One shard's answers in a conversation: an init's hello, its bootstrap buckets, then
    ShardDone; a build's patch, then ShardDone. A link whose conversation ends before its
    ShardDone was read is marked abandoned (the next command skips what is left)."""

    recv: Callable
    what: str
    link: ShardLink | None = None
    started: bool = False
    finished: bool = False

    async def next(self) -> Any:
        msg = await self.recv()
        if isinstance(msg, ShardDone):
            self.finished = True
        return msg

    async def forward(self, send: SendFn, shards: ShardSet) -> dict:
        while True:
            msg = await self.next()
            if isinstance(msg, ShardDone):
                if not msg.ok:
                    raise HandshakeError(f"{self.what} failed its handshake: {msg.error}")
                return msg.stats
            await send(msg)  # a bootstrap bucket, relayed as it came, then let go
            if self.link is not None:
                shards.relayed(msg)

    async def drain(self, first: Any) -> None:
        msg = first
        while not isinstance(msg, ShardDone):
            msg = await self.next()

    def abandon(self, sender: int) -> None:
        if self.link is not None and self.started and not self.finished:
            self.link.abandoned = sender
