"""aiosync: asyncio-native weight sync and coordination for asynchronous RL in PyTorch.

Layout: :mod:`aiosync.syncers` (how weights travel: patch, bucket, codecs),
:mod:`aiosync.coordination` (when they travel: synchronizer, slots, states, styles),
:mod:`aiosync.transports` (where they travel: in-process, simulated, distributed,
checkpoint), :mod:`aiosync.runners` (loops), :mod:`aiosync.cli` (``aiosync demo|bench|simulate``).
"""

from .aio import AwaitableEvent, run_sync, wait_event
from .configs import load_config
from .coordination import (ExplorerHandle, FilterResult, LatestSlot, Lease, LoopLagMonitor, PolicySlot, RunningStatus,
                           StalenessFilter, Synchronizer, SynchronizerConfig, SyncMethod, SyncStyle, TrainerHandle)
from .errors import (AiosyncError, ApplyError, ChecksumError, ClosedResourceError, CodecUnavailableError, ConfigError,
                     EndOfStream, HandshakeError, PatchChainError, PayloadError, PeerTimeoutError,
                     StateTransitionError, TransportError, VersionError, WouldBlock)
from .coordination.remote import CheckpointFollower, RemoteExplorer
from .runners import ExplorerLoop, TrainerLoop
from .syncers import (BucketWeightSyncer, CompressedWeightPatch, EmptyWeightPatch, PatchWeightSyncer, WeightPatch,
                      WeightSyncer, WeightSyncerConfig, as_coo_2d_view, collect_param_names_need_sync, delta_decode,
                      delta_encode, downscale_nonnegative_indices, iter_named_tensor_buckets)
from .transports.checkpoint import CheckpointDir
from .transports.distributed import DistributedTransport, WeightSyncGroup, gather_full_state, register_message
from .transports.inproc import InProcTransport, inproc_pair
from .transports.simulated import FaultProfile, SimulatedTransport, simulated_pair

__version__ = "0.1.0"

__all__ = [
    "WeightSyncer", "PatchWeightSyncer", "BucketWeightSyncer", "WeightPatch", "EmptyWeightPatch",
    "CompressedWeightPatch", "WeightSyncerConfig", "as_coo_2d_view", "downscale_nonnegative_indices",
    "delta_encode", "delta_decode", "collect_param_names_need_sync", "iter_named_tensor_buckets",
    "Synchronizer", "SynchronizerConfig", "TrainerHandle", "ExplorerHandle", "SyncMethod", "SyncStyle",
    "RunningStatus", "PolicySlot", "Lease", "LatestSlot", "StalenessFilter", "FilterResult", "LoopLagMonitor",
    "TrainerLoop", "ExplorerLoop", "SimulatedTransport", "simulated_pair", "CheckpointDir",
    "InProcTransport", "inproc_pair", "load_config", "AwaitableEvent", "wait_event", "run_sync",
    "RemoteExplorer", "CheckpointFollower", "DistributedTransport", "WeightSyncGroup", "register_message",
    "gather_full_state", "FaultProfile", "ChecksumError", "AiosyncError", "ApplyError", "ClosedResourceError", "CodecUnavailableError", "ConfigError", "EndOfStream",
    "HandshakeError", "PatchChainError", "PayloadError", "PeerTimeoutError", "StateTransitionError", "TransportError",
    "VersionError", "WouldBlock",
]
