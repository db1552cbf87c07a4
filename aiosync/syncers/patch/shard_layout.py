"""What a shard of a sharded trainer is (:mod:`aiosync.syncers.patch.shards`): the pieces a rank holds, how the
pieces of every rank fit together, and a shard seen as a model of its own on both sides.

* :func:`shard_layout` — the pieces of the synced tensors a rank holds (DTensors' local
  shards, :class:`~aiosync.pieces.TensorSlice` s, plain tensors for shard 0).
* :func:`shard_rows` / :func:`tiling_problem` — the shard table (each shard's rows of each
  key) and the check that every key's pieces cover its rows exactly once.
* :func:`shard_metadata` / :func:`shard_views` — the receiver metadata of one shard's rows, and
  views of a full model's tensors on them (no copy).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from ...pieces import local_pieces
from ...dtypes import dtype_name
from ...errors import ConfigError
from .handshake import is_int
from ..common.payloads import ReceiverMetadata

def shard_layout(state: Mapping[str, torch.Tensor], rank: int, names: list[str]
                 ) -> tuple[dict[str, torch.Tensor], dict[str, list]]:
    """The local pieces of ``names`` that shard ``rank`` holds, and their layout: ``{key:
    [first row or None (the whole tensor), rows, full shape, dtype]}``. DTensors give their
    local shard (one replica of a replicated one), :class:`~aiosync.pieces.TensorSlice`
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
    shares = [p for p in meta.shares if p[0] in rows and p[1] in rows and rows[p[0]] == rows[p[1]]]
    return ReceiverMetadata(keys, shapes, [meta.dtypes[i] for i in idx], aliases, viewable, meta.session, shares)


def shard_views(state: Mapping[str, torch.Tensor], rows: Mapping[str, list | None]) -> dict[str, torch.Tensor]:
    """The receiver's tensors seen as one shard: views of its rows (no copy)."""
    return {k: state[k] if span is None else state[k].narrow(0, span[0], span[1]) for k, span in rows.items()}
