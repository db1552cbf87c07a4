"""A directory of version-stamped checkpoint files that one run owns (the CHECKPOINT sync method).

* :class:`CheckpointDir` (:mod:`.directory`) publishes and discovers versions: the hold of one
  run, publishing that never replaces a file, readers that read the holding run's complete
  versions only, and verify every tensor's digest.
* :mod:`.files`: one file — its name (``sync-<version>.<run>[.w<rank>-of-<world>].safetensors``),
  writing it with the digests of its tensors, reading and verifying it.
* :mod:`.hold`: the hold files, and when a hold is stale.
* :func:`check_tensors_fit` (:mod:`.fit`): the one check of a checkpoint against a model.

A sharded trainer's ranks each write their shard (``publish(..., writer=(rank, world))``) of one
run: :func:`shared_run_id` gives every rank the same run id.
"""

from __future__ import annotations

from ..pieces import TensorSlice
from .directory import CheckpointDir
from .fit import check_tensors_fit
from .hold import new_run_id

__all__ = ["CheckpointDir", "TensorSlice", "check_tensors_fit", "new_run_id", "shared_run_id"]


def shared_run_id(group=None) -> str:
    """One run id for every rank of a torch.distributed job: rank 0 makes it, every rank gets it
    (a collective: call it on every rank at the same point, e.g. right after
    ``init_process_group``). Without an initialised process group: a fresh run id."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return new_run_id()
    box = [new_run_id() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]
