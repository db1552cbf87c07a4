"""Weight syncers: how one policy version travels from a sender to a receiver.

* :mod:`.base` — the interface (W1) and the factory (W2)
* :mod:`.patch` — patch mode: changed elements only; :mod:`.snapshot` builds the diff,
  :mod:`.patch_format` encodes it, :mod:`.codecs` compresses it
* :mod:`.bucket` — bucket mode: whole tensors in size-bounded buckets
* :mod:`.config` — the ``weight_syncer`` config group as dataclasses
"""

from .base import WeightSyncer
from .bucket import BucketWeightSyncer, iter_named_tensor_buckets
from .config import BucketConfig, CommOptions, InitSyncConfig, PatchConfig, WeightSyncerConfig
from .indexing import as_coo_2d_view, delta_decode, delta_encode, downscale_nonnegative_indices
from .patch import PatchWeightSyncer
from .payloads import CompressedWeightPatch, EmptyWeightPatch, ReceiverMetadata, SenderHello, WeightPatch
from .selection import collect_param_names_need_sync

__all__ = [
    "WeightSyncer", "PatchWeightSyncer", "BucketWeightSyncer", "WeightPatch", "EmptyWeightPatch",
    "CompressedWeightPatch", "ReceiverMetadata", "SenderHello", "as_coo_2d_view",
    "downscale_nonnegative_indices", "delta_encode", "delta_decode", "collect_param_names_need_sync",
    "iter_named_tensor_buckets", "WeightSyncerConfig", "PatchConfig", "BucketConfig", "InitSyncConfig",
    "CommOptions",
]
