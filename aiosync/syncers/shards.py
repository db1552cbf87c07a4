"""Shard-local patches (FSDP2 trainers): every trainer rank diffs and sends its own shard.

A rank of a sharded trainer holds a *piece* of each synced tensor: FSDP2 (``fully_shard``)
shards dim 0, so rank ``r`` holds rows ``[o_r, o_r + n_r)`` — possibly none, and not
necessarily as many as the others; a plain tensor (a buffer, a replicated parameter) is whole
on every rank and belongs to shard 0. Each rank keeps the snapshot of its own pieces, diffs
and encodes them itself: no rank materialises another rank's data, and sender memory and build
time scale with a rank's shard, not with the model (docs/performance.md).

A shard is a model of its own: its pieces on the sender (:func:`shard_layout`), the same rows
of the receiver's tensors on the receiver (:func:`shard_views`), and the receiver metadata of
those rows (:func:`shard_metadata`). So a shard's sender is an ordinary
:class:`~aiosync.syncers.patch.PatchWeightSyncer` over the rank's local pieces — its ordinals,
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
* The receiver (:mod:`.patch_receiver`: :func:`~.patch_receiver.receiver_shards`,
  :class:`~.patch_receiver.ShardedWrite`) is a :class:`PatchWeightSyncer` whose hello has
  ``shards``: every shard is validated on its own, then all are written in one exclusive
  section with one undo journal — a version is applied only when every shard of it is in,
  all-or-nothing.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import anyio
import torch

from ..checkpoints import local_pieces
from ..dtypes import dtype_name
from ..errors import ConfigError, HandshakeError, PatchChainError, PayloadError
from ..messages import RecvFn, SendFn, Shared, payload_nbytes
from .base import SyncStatistics, WeightSyncer, recv_with_timeout
from .bucket_format import check_version
from .patch_handshake import check_metadata, is_int
from .payloads import (ReceiverMetadata, SenderHello, ShardBuild, ShardDone, ShardDrop, ShardedPatch, ShardHello,
                       ShardInit)

#: Scratch of a shard's builder, as a fraction of its elements (bounded to [64 Ki, 4 Mi] elements
#: per chunk): sender memory stays about one shard snapshot.
SCRATCH_FRACTION = 1 / 32


# ----------------------------------------------------------------------------- layouts

def shard_layout(state: Mapping[str, torch.Tensor], rank: int, names: list[str]
                 ) -> tuple[dict[str, torch.Tensor], dict[str, list]]:
    """The local pieces of ``names`` that shard ``rank`` holds, and their layout: ``{key:
    [first row or None (the whole tensor), rows, full shape, dtype]}``. DTensors give their
    local shard (one replica of a replicated one), :class:`~aiosync.checkpoints.TensorSlice`
    its block, plain tensors count as replicated (shard 0 holds them); empty pieces are left
    out, and so are keys a mapping of pieces does not hold. Only dim-0 pieces (FSDP2's
    ``Shard(0)``) can be patched shard-locally."""
    tensors, slices = local_pieces({k: state[k] for k in names if k in state}, rank)
    layout = {}
    for key, t in tensors.items():
        t = t.detach()
        tensors[key] = t
        if key not in slices:
            layout[key] = [None, None, list(t.shape), dtype_name(t.dtype)]
            continue
        offset, shape = slices[key]
        if any(offset[1:]) or list(t.shape[1:]) != list(shape[1:]):
            raise ConfigError(f"{key!r}: shard {rank} holds the block at {offset} of shape {tuple(t.shape)} of a "
                              f"{tuple(shape)} tensor; shard-local patches need pieces of whole rows (dim 0, as "
                              "FSDP2's fully_shard makes them)")
        layout[key] = [offset[0], t.shape[0], list(shape), dtype_name(t.dtype)]
    return tensors, layout


def shard_rows(layouts: list[dict[str, list]]) -> list[dict[str, list | None]]:
    """Per shard, ``{key: [first row, rows] or None (whole)}``, after checking that the shards'
    pieces of every key tile it exactly (:class:`ConfigError` naming the key otherwise)."""
    rows = [{k: None if p[0] is None else [p[0], p[1]] for k, p in lay.items()} for lay in layouts]
    shapes: dict[str, tuple] = {}
    for r, lay in enumerate(layouts):
        for key, p in lay.items():
            if shapes.setdefault(key, (tuple(p[2]), p[3])) != (tuple(p[2]), p[3]):
                raise ConfigError(f"shards disagree on {key!r}: shard {r} has it as {tuple(p[2])} {p[3]}, another as "
                                  f"{shapes[key][0]} {shapes[key][1]}")
    problem = tiling_problem(rows, {k: s for k, (s, _) in shapes.items()})
    if problem:
        raise ConfigError(f"the trainer's shards do not fit together: {problem}")
    return rows


def tiling_problem(rows: list[dict], shapes: Mapping[str, tuple]) -> str | None:
    """What is wrong with a shard table (``None``: every key is whole in one shard, or its
    pieces cover its rows exactly once)."""
    pieces: dict[str, list] = {}
    for r, table in enumerate(rows):
        if not isinstance(table, dict):
            return f"shard {r}'s rows are not a mapping"
        for key, span in table.items():
            pieces.setdefault(key, []).append((r, span))
    for key, spans in pieces.items():
        if key not in shapes:
            return f"{key!r} is not a tensor of the model"
        shape = tuple(shapes[key])
        if any(span is None for _, span in spans):
            if len(spans) != 1:
                return f"{key!r} is whole in one shard and also in another"
            continue
        if not shape:
            return f"{key!r} is a scalar but is split into rows"
        at = 0
        for r, span in sorted(spans, key=lambda s: s[1][0] if isinstance(s[1], list) and s[1] else -1):
            if not (isinstance(span, list) and len(span) == 2 and all(is_int(v) for v in span) and span[1] >= 1):
                return f"shard {r} gives {key!r} the malformed rows {span!r}"
            if span[0] != at:
                return f"the rows of {key!r} are not covered exactly once (shard {r} starts at {span[0]}, not {at})"
            at = span[0] + span[1]
        if at != shape[0]:
            return f"the shards cover {at} of the {shape[0]} rows of {key!r}"
    return None


def shard_metadata(meta: ReceiverMetadata, rows: Mapping[str, list | None]) -> ReceiverMetadata:
    """The receiver metadata of one shard: the keys it holds, in the receiver's order, with
    the shapes of its rows; tied keys stay tied when they are split the same way."""
    idx = [i for i, k in enumerate(meta.ordered_keys) if k in rows]
    keys = [meta.ordered_keys[i] for i in idx]
    shapes = [tuple(meta.original_shapes[i]) if rows[k] is None else (rows[k][1], *meta.original_shapes[i][1:])
              for i, k in zip(idx, keys)]
    aliases = {a: b for a, b in meta.aliases.items() if a in rows and b in rows and rows[a] == rows[b]}
    viewable = [meta.viewable[i] for i in idx] if meta.viewable else []
    return ReceiverMetadata(keys, shapes, [meta.dtypes[i] for i in idx], aliases, viewable, meta.session)


def shard_views(state: Mapping[str, torch.Tensor], rows: Mapping[str, list | None]) -> dict[str, torch.Tensor]:
    """The receiver's tensors seen as one shard: views of its rows (no copy)."""
    return {k: state[k] if span is None else state[k].narrow(0, span[0], span[1]) for k, span in rows.items()}


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
    peak_bytes: int = 0
    #: Bytes of the snapshots alone (the shard's pieces, in the receivers' dtypes), last seen.
    snapshot_nbytes: int = 0

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

    async def _init(self, cmd: ShardInit) -> None:
        syncer = _shard_syncer(cmd.config, cmd.bootstrap)
        tensors, _ = shard_layout(self.live(), self.rank, self.names)

        async def recv() -> ReceiverMetadata:
            return cmd.meta

        self._drop(cmd.sender)
        await syncer.init_sender(tensors, [k for k in self.names if k in tensors], self.send, recv)
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
            await self.send(Shared(patch))  # encoded once, here; relayed as these bytes

        await syncer.sync(tensors, send, cmd.version)
        self.builds += 1
        self._held()
        st = syncer.statistics()
        await self.send(ShardDone(cmd.sender, True, stats={"changed": st.changed, "bytes": st.bytes,
                                                           "build_s": st.build_s, "encode_s": st.encode_s,
                                                           "snapshot_bytes": self.snapshot_bytes}))

    def _drop(self, sender: int) -> None:
        old = self.senders.pop(sender, None)
        if old is not None:
            old.close()

    def close(self) -> None:
        for sender in list(self.senders):
            self._drop(sender)


# ----------------------------------------------------------------------------- the synchronizer's rank

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
    _next_id: int = 0

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
        return ShardedPatchSender(self, self._next_id, bootstrap)

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
        for sender in drops:
            await link.send(ShardDrop(sender))
        await link.send(cmd)

    async def reply(self, link: ShardLink, what: str) -> Any:
        return await recv_with_timeout(link.recv, self.timeout, f"shard rank {link.rank}'s {what}")


class ShardedPatchSender(WeightSyncer):
    """The sender of a sharded trainer's whole model, on the synchronizer's rank (one per
    fan-out lineage; see the module docstring). Made by :meth:`ShardSet.make`."""

    supports_no_wait = True
    payloads_per_sync = 1
    fan_out_mode = "chain"
    shares_payloads = True

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
        s = self.shards
        meta = await recv_with_timeout(recv, s.timeout, "the receiver's metadata")
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
        self.local = _shard_syncer(s.config, self.bootstrap)
        local_tx, local_rx = anyio.create_memory_object_stream(0)
        readers = [_Reader(local_rx.receive, "shard 0")] + [
            _Reader(lambda link=link: s.reply(link, "answer"), f"shard rank {link.rank}", link) for link in s.links]
        try:
            async with _locks(s.links), _one_error(), anyio.create_task_group() as tg:
                tg.start_soon(self._init_local, subs[0], local_tx)
                for link, sub in zip(s.links, subs[1:]):
                    await s.command(link, ShardInit(self.id, s.boundary(), sub, s.config, self.bootstrap))
                    readers[s.links.index(link) + 1].started = True
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
                self.shard_stats = [await r.forward(send) for r in readers]
        finally:
            for r in readers:
                r.abandon(self.id)
        self._last_version, self._broken = None, None

    async def _init_local(self, sub: ReceiverMetadata, tx) -> None:
        async def recv() -> ReceiverMetadata:
            return sub

        async with tx:
            try:
                tensors = self.shards.local()
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
            async with _locks(s.links), _one_error(), anyio.create_task_group() as tg:
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
        st = self.local.statistics()
        parts[0] = Shared(collected[0])
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
        if not isinstance(patch, Shared) or not isinstance(done, ShardDone) or not done.ok:
            why = done.error if isinstance(done, ShardDone) else f"a {type(done).__name__} instead of its answer"
            raise PayloadError(f"shard rank {rank} failed to build its patch: {why}")
        parts[i], stats[i] = patch, done.stats

    def close(self) -> None:
        """This lineage is gone: every rank drops its snapshot (before its next command)."""
        if self.local is not None:
            self.local.close()
        if self._broken != "closed":
            self._broken = "closed"
            for link in self.shards.links:
                link.drops.append(self.id)

    # Receiving is PatchWeightSyncer's (it reads the shard table of the hello).
    async def init_receiver(self, state_dict, recv, send=None) -> None:
        raise NotImplementedError("a ShardedPatchSender only sends; its receiver is a PatchWeightSyncer")

    async def apply(self, model, recv) -> int:
        raise NotImplementedError("a ShardedPatchSender only sends; its receiver is a PatchWeightSyncer")


class _locks:
    """Hold every link's lock, in order (so two conversations never wait on each other)."""

    def __init__(self, links: list[ShardLink]) -> None:
        self.links = links

    async def __aenter__(self) -> None:
        for link in self.links:
            await link.lock.acquire()

    async def __aexit__(self, *exc: Any) -> None:
        for link in reversed(self.links):
            link.lock.release()


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

    async def forward(self, send: SendFn) -> dict:
        while True:
            msg = await self.next()
            if isinstance(msg, ShardDone):
                if not msg.ok:
                    raise HandshakeError(f"{self.what} failed its handshake: {msg.error}")
                return msg.stats
            await send(msg)  # a bootstrap bucket, relayed as it came

    async def drain(self, first: Any) -> None:
        msg = first
        while not isinstance(msg, ShardDone):
            msg = await self.next()

    def abandon(self, sender: int) -> None:
        if self.link is not None and self.started and not self.finished:
            self.link.abandoned = sender
