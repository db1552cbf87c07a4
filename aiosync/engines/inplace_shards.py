"""A sharded (FSDP2) trainer's patches inside the engine (:class:`~aiosync.engines.inplace.EngineReceiver`).

Each rank of a sharded trainer builds the patch of its own rows (:mod:`aiosync.syncers.patch.shards`);
one version is a :class:`~aiosync.syncers.common.payloads.ShardedPatch` of every rank's part,
applied together, all or nothing. The explorer forwards the handshake with its ``shards``
(:func:`~aiosync.syncers.patch.forward.handshake_of`) and each version's parts as they came;
here:

* :func:`parse_shards` — the handshake's shard table, checked against the engine's tensors
  (every key's pieces cover its rows exactly once, keys and ordinals well formed): each shard
  is a model of its own, the rows of the engine's tensors (meta views), with its own ordinals
  and layouts;
* :func:`holds_rows` — whether this worker (of a tensor-parallel engine) holds any element of
  a shard's rows: a worker that holds none skips that shard's part after its header, never
  decoding it;
* :class:`Rows` — a shard's rows read from the parameters, for a ``ctx`` part's decoder.

The receiver decodes every part against meta views of its rows, shifts each part's positions
by its first row (``first row × elements per row``: the whole tensor's flat positions) and
stages them as one patch: each part's drift hash checked on its own (summed over the workers),
then one commit.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ..errors import PayloadError
from ..syncers.patch.handshake import is_int, receiver_layouts
from ..syncers.patch.receiver import ReceiverState, ShardRx
from ..syncers.patch.shard_layout import shard_views, tiling_problem
from .index_map import IndexMap

__all__ = ["Rows", "holds_rows", "parse_shards", "row_elems"]


def parse_shards(table: Any, known: Mapping[str, torch.Tensor], session: int | None) -> tuple[ShardRx, ...]:
    """The shards of a forwarded handshake: ``[{"rows": {key: None or [first row, rows]},
    "keys": [the shard's keys, in its ordinal order], "synced": [ordinals its patches touch]}]``,
    checked against ``known`` (the engine's tensors, meta will do); a :class:`PayloadError`
    naming what is wrong otherwise."""
    if not isinstance(table, list) or not table:
        raise PayloadError("the handshake's shards must be a non-empty list of {'rows', 'keys', 'synced'}")
    for r, entry in enumerate(table):
        if not isinstance(entry, dict) or set(entry) != {"rows", "keys", "synced"} or not isinstance(
                entry["rows"], dict):
            raise PayloadError(f"the handshake's shard {r} must be {{'rows': {{key: rows}}, 'keys': [...], "
                               f"'synced': [...]}}, got {entry!r:.120}")
        unknown = [k for k in entry["rows"] if k not in known]
        if unknown:
            raise PayloadError(f"the handshake's shard {r} names {len(unknown)} tensor(s) this engine does not hold: "
                               f"{unknown[:3]}")
    problem = tiling_problem([entry["rows"] for entry in table], {k: tuple(t.shape) for k, t in known.items()})
    if problem:
        raise PayloadError(f"the handshake's shards do not fit this engine's tensors: {problem}")
    out = []
    for r, entry in enumerate(table):
        keys, synced = entry["keys"], entry["synced"]
        if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys) or sorted(keys) != sorted(
                entry["rows"]):
            raise PayloadError(f"the handshake's shard {r} must list each of its {len(entry['rows'])} keys once")
        if not isinstance(synced, list) or not all(is_int(o) and 0 <= o < len(keys) for o in synced) or any(
                b <= a for a, b in zip(synced, synced[1:])):
            raise PayloadError(f"the handshake's shard {r} names synced ordinals outside [0, {len(keys)}) or out of "
                               "order")
        views = shard_views(known, entry["rows"])
        rows = {k: None if v is None else (int(v[0]), int(v[1])) for k, v in entry["rows"].items()}
        out.append(ShardRx(rows, ReceiverState(list(keys), receiver_layouts(views, keys, synced), session), False))
    return tuple(out)


def row_elems(known: Mapping[str, torch.Tensor], key: str) -> int:
    """Elements of one row (along dim 0) of ``key``: a shard's positions of it start at its
    first row times this in the whole tensor's flat positions."""
    shape = tuple(known[key].shape)
    return int(torch.Size(shape[1:]).numel())


def holds_rows(index: IndexMap, aliases: Mapping[str, str], known: Mapping[str, torch.Tensor],
               rows: Mapping[str, tuple | None]) -> bool:
    """Whether this worker holds any element of ``rows`` (a shard's rows of each key)."""
    for key, span in rows.items():
        tmap = index.tensors[aliases.get(key, key)]
        if tmap.copy is not None:
            return True
        lo, hi = (0, tmap.numel) if span is None else (span[0] * row_elems(known, key),
                                                      (span[0] + span[1]) * row_elems(known, key))
        for table in tmap.tables:
            if bool(((table.ckpt < hi) & (table.ckpt + table.length > lo)).any()):
                return True
    return False


class Rows(Mapping):
    """A shard's rows of the tensors, read whole from the parameters (``whole(key)``) on demand:
    what a ``ctx`` part is decoded against."""

    def __init__(self, whole: Mapping[str, torch.Tensor], rows: Mapping[str, tuple | None]) -> None:
        self.whole, self.rows = whole, rows

    def __getitem__(self, key: str) -> torch.Tensor:
        span = self.rows[key]
        t = self.whole[key]
        return t if span is None else t.narrow(0, span[0], span[1])

    def __contains__(self, key: object) -> bool:
        return key in self.rows

    def __iter__(self):
        return iter(self.rows)

    def __len__(self) -> int:
        return len(self.rows)
