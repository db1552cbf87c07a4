"""Weight syncers: how one policy version travels from a sender to a receiver.

* :mod:`.base` — the interface (W1), the registry behind ``WeightSyncer.create`` (W2),
  staging (F3: :class:`StagedWrite`) and :class:`SyncStatistics`
* :mod:`.factory` — :func:`create_syncer`, :func:`syncer_factory` (what a synchronizer uses)
* :mod:`.patch` — patch mode: changed elements only; :mod:`.snapshot` builds the diff,
  :mod:`.patch_format` encodes it, :mod:`.codecs` compresses it, :mod:`.patch_handshake` and
  :mod:`.patch_receiver` are its handshake and its receiver
* :mod:`.bucket` — bucket mode: whole tensors in size-bounded buckets (:mod:`.bucket_format`)
* :mod:`.staging` — staged whole-state writes and the write journal
* :mod:`.state_dicts` — which tensors are synced, DTensors, tied tensors
* :mod:`.config` — the ``weight_syncer`` config group as dataclasses
* :mod:`.faults` — receivers whose writes fail on purpose (simulation, tests)

Importing this package registers both implementations for ``WeightSyncer.create``. It imports
nothing of the transports or of the coordination layer.
"""

from .base import CommitTarget, StagedWrite, SyncStatistics, WeightSyncer
from .bucket import BucketWeightSyncer
from .bucket_format import iter_named_tensor_buckets
from .config import BucketConfig, CommOptions, InitSyncConfig, PatchConfig, WeightSyncerConfig
from .factory import SyncerFactory, create_syncer, syncer_factory
from .indexing import as_coo_2d_view, delta_decode, delta_encode, downscale_nonnegative_indices
from .patch import PatchWeightSyncer
from .payloads import CompressedWeightPatch, EmptyWeightPatch, ReceiverMetadata, SenderHello, WeightPatch
from .state_dicts import collect_param_names_need_sync, gather_full_state

__all__ = [
    "WeightSyncer", "PatchWeightSyncer", "BucketWeightSyncer", "StagedWrite", "CommitTarget", "SyncStatistics",
    "SyncerFactory",
    "syncer_factory", "create_syncer", "WeightPatch", "EmptyWeightPatch", "CompressedWeightPatch",
    "ReceiverMetadata", "SenderHello", "as_coo_2d_view", "downscale_nonnegative_indices", "delta_encode",
    "delta_decode", "collect_param_names_need_sync", "gather_full_state", "iter_named_tensor_buckets",
    "WeightSyncerConfig", "PatchConfig", "BucketConfig", "InitSyncConfig", "CommOptions",
]
