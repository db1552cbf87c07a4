"""Messages that syncers exchange. Plain dataclasses of tensors, numbers and strings.

Handshake (patch mode): the receiver sends :class:`ReceiverMetadata`, the sender answers
with :class:`SenderHello`; then the optional bootstrap buckets follow. Each sync is then one
:class:`WeightPatch`, :class:`CompressedWeightPatch` or :class:`EmptyWeightPatch`.
Bucket payloads are state-dict-like ``dict[str, Tensor]`` (see :mod:`aiosync.syncers.bucket.format`).

One version's patch goes to every explorer at its base version as the same object (a
:class:`~aiosync.messages.Shared`, encoded once); what differs per explorer — the session of
its handshake — travels beside it, in a :class:`Stamped`.

Every class here is a registered message type (:func:`aiosync.messages.message`): a receiving
process rebuilds them field by field, never by unpickling.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ...messages import message


@message
@dataclass
class ReceiverMetadata:
    """What the receiver tells the sender about its model (W7)."""

    ordered_keys: list[str]
    original_shapes: list[tuple[int, ...]]
    dtypes: list[str]
    #: key → earlier key whose tensor it aliases (tied weights); written once, through the first.
    aliases: dict[str, str] = field(default_factory=dict)
    #: whether each tensor can be written through a 2-D view (W9).
    viewable: list[bool] = field(default_factory=list)
    #: random id of this handshake, echoed by the sender in its answer, its bootstrap buckets
    #: and its patches: a stale payload of another handshake is refused (``None``: not checked).
    session: int | None = None
    #: pairs of keys whose tensors share memory (tied weights, views of one buffer), as
    #: :func:`~aiosync.syncers.common.state_dicts.shared_memory` gives them: the sender must
    #: share them alike, or this receiver cannot hold its values of both.
    shares: list = field(default_factory=list)


@message
@dataclass
class SenderHello:
    """The sender's answer to :class:`ReceiverMetadata`: accepted (and whether a bootstrap
    follows), or refused with the reason, so the receiver fails instead of waiting."""

    ok: bool
    init_sync: bool = False
    error: str | None = None
    #: receiver ordinals that patches will touch, ascending.
    synced_ordinals: list[int] = field(default_factory=list)
    #: the receiver's :attr:`ReceiverMetadata.session`, echoed.
    session: int | None = None
    #: a sharded sender (:mod:`aiosync.syncers.patch.shards`): per shard, ``{"rows": {key: [first row,
    #: rows] or None (the whole tensor)}, "synced": [ordinals of that shard's keys], "init_sync":
    #: bool}``; its patches are :class:`ShardedPatch` es. ``None``: one sender.
    shards: list | None = None


@message
@dataclass
class EmptyWeightPatch:
    """Nothing changed since ``base_version``; applying it still moves the receiver to ``version``."""

    version: int
    base_version: int | None = None
    #: the handshake this patch belongs to (:attr:`ReceiverMetadata.session`).
    session: int | None = None


@message
@dataclass
class WeightPatch:
    """Changed elements of the synced tensors (W10).

    ``ordinals`` index the receiver's ``ordered_keys``; ``nnz_per_tensor[i]`` elements of
    tensor ``ordinals[i]`` changed. With ``encoding="coo"`` (the seed's format) ``rows`` and
    ``cols`` are 2-D COO coordinates, delta-coded when ``delta_encoded``; ``values`` are the
    new elements' raw bytes. With ``encoding="flat"`` ``cols`` holds, per tensor, the gaps
    between consecutive changed row-major positions (first gap from -1), ``rows`` is unused,
    and ``values`` are the zig-zag coded differences between the new and the receiver's old
    bit patterns. See ``docs/wire-format.md``.
    """

    version: int
    base_version: int | None
    encoding: str
    delta_encoded: bool
    ordinals: torch.Tensor
    nnz_per_tensor: torch.Tensor
    rows: torch.Tensor | None
    cols: torch.Tensor
    values: torch.Tensor  # uint8
    #: ``flat`` only: bytes of ``cols`` taken by each tensor's gap stream.
    gap_bytes: torch.Tensor | None = None
    #: the handshake this patch belongs to (:attr:`ReceiverMetadata.session`).
    session: int | None = None
    #: ``verify_checksums`` only: int64 CRC-32 of each touched tensor *after* the patch, in
    #: ``ordinals`` order; the receiver verifies them after writing and rolls back on a mismatch.
    checksums: torch.Tensor | None = None
    #: the drift check (required for ``flat``): per touched tensor, in ``ordinals`` order, an int64
    #: hash of the *old* bits at its changed positions (:func:`aiosync.syncers.common.integrity.drift_hash`);
    #: the receiver compares it with its own bits before writing anything (``DriftError``).
    old_hashes: torch.Tensor | None = None

    @property
    def nnz(self) -> int:
        return int(self.nnz_per_tensor.to(torch.int64).sum()) if self.nnz_per_tensor.numel() else 0

    @property
    def nbytes(self) -> int:
        tensors = [self.ordinals, self.nnz_per_tensor, self.rows, self.cols, self.values, self.gap_bytes,
                   self.checksums, self.old_hashes]
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)


@message
@dataclass
class CompressedWeightPatch:
    """A :class:`WeightPatch` whose index and value arrays are compressed (W12, B1).

    ``blobs`` maps a stream name (``rows``, ``cols``, ``values.<width>``) to its compressed
    bytes as a uint8 tensor; ``dtypes`` gives the index streams' dtypes and ``sizes`` every
    stream's uncompressed length in bytes (used to bound decompression).
    """

    version: int
    base_version: int | None
    encoding: str
    delta_encoded: bool
    codec: str
    ordinals: torch.Tensor
    nnz_per_tensor: torch.Tensor
    blobs: dict[str, torch.Tensor]
    dtypes: dict[str, str]
    sizes: dict[str, int]
    gap_bytes: torch.Tensor | None = None
    session: int | None = None
    checksums: torch.Tensor | None = None
    #: as :attr:`WeightPatch.old_hashes` (carried as is, not compressed).
    old_hashes: torch.Tensor | None = None

    @property
    def nnz(self) -> int:
        return int(self.nnz_per_tensor.to(torch.int64).sum()) if self.nnz_per_tensor.numel() else 0

    @property
    def nbytes(self) -> int:
        extra = [self.ordinals, self.nnz_per_tensor, self.gap_bytes, self.checksums, self.old_hashes]
        return (sum(b.numel() for b in self.blobs.values())
                + sum(t.numel() * t.element_size() for t in extra if t is not None))


@message
@dataclass(eq=False)
class Stamped:
    """One receiver's stamp beside a payload that every receiver at that version shares:
    ``session``, the handshake it belongs to (:attr:`ReceiverMetadata.session`). ``payload`` is
    the same object for all of them (a :class:`~aiosync.messages.Shared` patch, encoded once);
    the receiver checks the stamp instead of the patch's own ``session``."""

    session: int
    payload: Any


@message
@dataclass(eq=False)
class ShardedPatch:
    """One version from a sharded trainer: the patch of every shard, each built by the rank
    that holds it against its own piece of the tensors (indices local to the piece), in the
    order of :attr:`SenderHello.shards`; applied together, all-or-nothing."""

    version: int
    base_version: int | None
    shards: list


# ----------------------------------------------------------------------------- shard ranks
# Between the rank that runs the synchronizer and the other ranks of a sharded trainer
# (:mod:`aiosync.syncers.patch.shards`).


@message
@dataclass(eq=False)
class ShardHello:
    """A shard rank's layout: per synced key, ``[first row or None (whole), rows, full shape,
    dtype]`` of the piece it holds (keys whose piece is empty are left out)."""

    rank: int
    pieces: dict
    names: list


@message
@dataclass(eq=False)
class ShardInit:
    """Start sender ``sender`` for the receiver whose metadata for this shard is ``meta``,
    under the patch config ``config`` (``bootstrap``: send the whole shard); only at trainer
    step ``boundary``. The rank answers with its ``SenderHello``, its bootstrap buckets, then
    :class:`ShardDone`."""

    sender: int
    boundary: int
    meta: ReceiverMetadata
    config: dict
    bootstrap: bool = False
    #: take one more receiver onto the existing sender ``sender`` (``accept``: no new snapshot)
    accept: bool = False


@message
@dataclass(eq=False)
class ShardBuild:
    """Build sender ``sender``'s patch of ``version`` now (trainer step ``boundary``); the rank
    answers with the patch (a shared part), then :class:`ShardDone`."""

    sender: int
    boundary: int
    version: int


@message
@dataclass(eq=False)
class ShardDrop:
    """Forget sender ``sender`` (its lineage is gone): its snapshot is freed."""

    sender: int


@message
@dataclass(eq=False)
class ShardDone:
    """The end of a shard rank's answer to a command: ``ok``, or why not (``error``); ``stats``
    of the build (``changed``, ``bytes``, ``build_s``, ``encode_s``, ``snapshot_bytes``)."""

    sender: int
    ok: bool
    error: str | None = None
    stats: dict = field(default_factory=dict)


# ----------------------------------------------------------------------------- direct routes
# A shard rank that sends its parts straight to the explorers (aiosync.syncers.patch.shards_direct):
# the synchronizer's rank forwards only where a part is, each explorer fetches it from that rank.


@message
@dataclass(eq=False)
class ShardRef:
    """Where shard rank ``rank``'s part is (a version's patch, or a bootstrap bucket): under
    ``key`` on that rank, ``nbytes`` long. Stands in for the part in what the synchronizer's
    rank sends; the explorer fetches it from that rank alone (:class:`ShardFetch`)."""

    rank: int
    key: str
    nbytes: int = 0


@message
@dataclass(eq=False)
class ShardFetch:
    """An explorer asks a shard rank for the part under ``key`` (request ``id``)."""

    id: int
    key: str


@message
@dataclass(eq=False)
class ShardPart:
    """A shard rank's answer to :class:`ShardFetch` ``id``: the part (``payload``), or why it
    has none (``error``: never built, or evicted)."""

    id: int
    key: str
    payload: Any = None
    error: str | None = None
