"""What one rank of a sharded trainer holds of a state dict: its *pieces*.

A DTensor (an FSDP2 shard) contributes its local shard — the block of the full tensor at the
offset its placement gives it, one replica of a replicated one, nothing when the block is
empty; a :class:`TensorSlice` is such a block given by hand (any other layout); a plain tensor
counts as replicated and belongs to rank 0. Used by the CHECKPOINT method's writers
(:mod:`aiosync.checkpoints`) and by shard-local patches (:mod:`aiosync.syncers.patch.shards`).
Imports nothing of aiosync; DTensor support is imported only when a DTensor is met.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["TensorSlice", "local_pieces"]


@dataclass(frozen=True)
class TensorSlice:
    """A piece of a larger tensor, for a writer that holds only part of it: ``tensor`` is the
    block of the full tensor (of shape ``shape``) that starts at ``offset``."""

    tensor: torch.Tensor
    offset: tuple[int, ...]
    shape: tuple[int, ...]


def local_pieces(state: Mapping[str, Any], rank: int) -> tuple[dict[str, torch.Tensor], dict[str, list]]:
    """What writer ``rank`` stores of ``state``: tensors, and the slices among them (key →
    ``[offset, full shape]``). A DTensor contributes its local shard (one replica only; an empty
    shard nothing); a :class:`TensorSlice` itself; a plain tensor counts as replicated and is
    written by writer 0 only."""
    tensors: dict[str, torch.Tensor] = {}
    slices: dict[str, list] = {}
    for key, value in state.items():
        if isinstance(value, TensorSlice):
            piece, offset, shape = value.tensor, tuple(value.offset), tuple(value.shape)
        elif hasattr(value, "to_local") and hasattr(value, "placements"):  # a DTensor (imported only if used)
            from torch.distributed.tensor import Replicate
            from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

            coords = value.device_mesh.get_coordinate()
            if coords is None or any(isinstance(p, Replicate) and c for p, c in zip(value.placements, coords)):
                continue  # not in the mesh, or another replica writes it
            piece = value.to_local()
            _, offset = compute_local_shape_and_global_offset(value.shape, value.device_mesh, value.placements)
            offset, shape = tuple(offset), tuple(value.shape)
        else:
            if rank == 0:
                tensors[key] = value
            continue
        if piece.numel() == 0:
            continue
        tensors[key] = piece
        slices[key] = [list(offset), list(shape)]
    return tensors, slices
