"""aiosync: asyncio-native weight sync and coordination for asynchronous RL in PyTorch.

Layout (bottom to top; a layer imports only the ones below it — ``docs/architecture.md``):

* :mod:`aiosync.errors`, :mod:`aiosync.aio`, :mod:`aiosync.messages` (message types, ``send``
  / ``recv``), :mod:`aiosync.dtypes` — the bottom layer;
* :mod:`aiosync.transports` (where payloads travel: in-process, simulated, torch.distributed)
  and :mod:`aiosync.checkpoints` (a directory of version-stamped files);
* :mod:`aiosync.syncers` (how weights travel: patch, bucket, codecs), seeing only send/recv;
* :mod:`aiosync.coordination` (when they travel: synchronizer, trainer, explorers, slots);
  beside it :mod:`aiosync.engines` (inference engines as explorer models: vLLM), imported only
  when used;
* :mod:`aiosync.runners` (loop skeletons) and :mod:`aiosync.cli` (``aiosync demo|bench|simulate``).

``import aiosync`` is cheap: the names below are imported from their modules when first used.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

#: Public name → the module that defines it (imported on first use, PEP 562).
_EXPORTS = {
    "AwaitableEvent": "aiosync.aio", "run_sync": "aiosync.aio", "wait_event": "aiosync.aio",
    "load_config": "aiosync.configs",
    "register_message": "aiosync.messages", "message": "aiosync.messages",
    "Synchronizer": "aiosync.coordination", "SynchronizerConfig": "aiosync.coordination",
    "TrainerHandle": "aiosync.coordination", "Explorer": "aiosync.coordination",
    "ExplorerHandle": "aiosync.coordination", "RemoteExplorer": "aiosync.coordination",
    "ExplorerSession": "aiosync.coordination", "CheckpointFollower": "aiosync.coordination",
    "SyncMethod": "aiosync.coordination", "SyncStyle": "aiosync.coordination",
    "RunningStatus": "aiosync.coordination", "PolicySlot": "aiosync.coordination", "Lease": "aiosync.coordination",
    "Rollout": "aiosync.coordination",
    "LatestSlot": "aiosync.coordination", "StalenessFilter": "aiosync.coordination",
    "FilterResult": "aiosync.coordination", "LoopLagMonitor": "aiosync.coordination",
    "TrainerLoop": "aiosync.runners", "ExplorerLoop": "aiosync.runners",
    "WeightSyncer": "aiosync.syncers", "PatchWeightSyncer": "aiosync.syncers",
    "BucketWeightSyncer": "aiosync.syncers", "WeightPatch": "aiosync.syncers", "EmptyWeightPatch": "aiosync.syncers",
    "CompressedWeightPatch": "aiosync.syncers", "WeightSyncerConfig": "aiosync.syncers",
    "StagedWrite": "aiosync.syncers", "CommitTarget": "aiosync.syncers", "as_coo_2d_view": "aiosync.syncers", "delta_encode": "aiosync.syncers",
    "delta_decode": "aiosync.syncers", "downscale_nonnegative_indices": "aiosync.syncers",
    "collect_param_names_need_sync": "aiosync.syncers", "iter_named_tensor_buckets": "aiosync.syncers",
    "gather_full_state": "aiosync.syncers", "warm_up": "aiosync.syncers.kernels.warmup",
    "Transport": "aiosync.transports", "InProcTransport": "aiosync.transports", "inproc_pair": "aiosync.transports",
    "SimulatedTransport": "aiosync.transports", "simulated_pair": "aiosync.transports",
    "FaultProfile": "aiosync.transports", "DistributedTransport": "aiosync.transports",
    "WeightSyncGroup": "aiosync.transports",
    "CheckpointDir": "aiosync.checkpoints",
    "AiosyncError": "aiosync.errors", "ApplyError": "aiosync.errors", "AuthenticationError": "aiosync.errors", "ChecksumError": "aiosync.errors",
    "CheckpointHeldError": "aiosync.errors", "CheckpointWriteError": "aiosync.errors",
    "ClosedResourceError": "aiosync.errors", "CodecUnavailableError": "aiosync.errors",
    "ConfigError": "aiosync.errors", "DrainError": "aiosync.errors", "DriftError": "aiosync.errors",
    "EndOfStream": "aiosync.errors", "ExplorerLostError": "aiosync.errors", "HandshakeError": "aiosync.errors",
    "PatchChainError": "aiosync.errors",
    "PayloadError": "aiosync.errors", "PeerTimeoutError": "aiosync.errors",
    "StateMismatchError": "aiosync.errors", "StateTransitionError": "aiosync.errors",
    "TrainerRankLostError": "aiosync.errors", "TransportError": "aiosync.errors", "VersionError": "aiosync.errors",
    "WouldBlock": "aiosync.errors",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'aiosync' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # the next access is a plain lookup
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
