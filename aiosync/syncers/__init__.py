"""Weight syncers: how one policy version travels from a sender to a receiver (over ``send`` /
``recv`` only: nothing here knows a transport or the coordination layer).

Top level — the interface and what builds syncers:

* :mod:`.base` — the interface (W1), the registry behind ``WeightSyncer.create`` (W2),
  staging (F3: :class:`StagedWrite`), :class:`CommitTarget`, :class:`RemoteTarget` (and its
  :class:`RemoteWrite`), :class:`ReceiverHost`, :class:`LosesWeights` and :class:`SyncStatistics`
* :mod:`.config` — the ``weight_syncer`` config group as dataclasses
* :mod:`.factory` — :func:`create_syncer`, :func:`syncer_factory` (what a synchronizer uses)
* :mod:`.faults` — receivers whose writes fail on purpose (simulation, tests)

Sub-packages — one family each, lowest first (each imports only those before it, and the top
level's :mod:`.base` / :mod:`.config`):

* :mod:`.kernels` — the numba kernels (flat builder, writer, SIMD block masks, ``ctx``, rANS,
  warm-up); they import no syncer
* :mod:`.common` — what every mode shares: raw bits, payloads, integrity, staging and its
  journal, state dicts, COO indexing
* :mod:`.snapshot` — the sender's snapshot and the patch builders (CPU, CUDA, Triton)
* :mod:`.bucket` — bucket mode: whole tensors in size-bounded buckets, and the bucket format
  (also the patch bootstrap's)
* :mod:`.patch` — patch mode: the syncer, handshake, wire format, bounds, compression, the
  receiver, shard-local patches, and the ``ctx`` coding (:mod:`.patch.ctx`)

Importing this package registers both implementations for ``WeightSyncer.create``; it loads
no numba kernel (they load on first use, off the event loop).
"""

from .base import (
    CommitTarget, LosesWeights, ReceiverHost, RemoteTarget, RemoteWrite, StagedWrite, SyncStatistics, WeightSyncer,
)
from .bucket.format import iter_named_tensor_buckets
from .bucket.syncer import BucketWeightSyncer
from .common.indexing import as_coo_2d_view, delta_decode, delta_encode, downscale_nonnegative_indices
from .common.payloads import CompressedWeightPatch, EmptyWeightPatch, ReceiverMetadata, SenderHello, WeightPatch
from .common.state_dicts import collect_param_names_need_sync, gather_full_state
from .config import BucketConfig, CommOptions, InitSyncConfig, PatchConfig, WeightSyncerConfig
from .factory import SyncerFactory, create_syncer, syncer_factory
from .patch.syncer import PatchWeightSyncer

__all__ = [
    "WeightSyncer", "PatchWeightSyncer", "BucketWeightSyncer", "StagedWrite", "CommitTarget", "RemoteTarget",
    "RemoteWrite", "ReceiverHost", "LosesWeights", "SyncStatistics", "SyncerFactory",
    "syncer_factory", "create_syncer", "WeightPatch", "EmptyWeightPatch", "CompressedWeightPatch",
    "ReceiverMetadata", "SenderHello", "as_coo_2d_view", "downscale_nonnegative_indices", "delta_encode",
    "delta_decode", "collect_param_names_need_sync", "gather_full_state", "iter_named_tensor_buckets",
    "WeightSyncerConfig", "PatchConfig", "BucketConfig", "InitSyncConfig", "CommOptions",
]
