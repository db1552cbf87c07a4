"""The async runtime: when weights travel, and who holds which version.

* :mod:`.synchronizer` — :class:`Synchronizer`: lifecycle, attaching, draining, metrics
* :mod:`.trainer` — :class:`TrainerHandle`: publishing versions, NCCL handshakes
* :mod:`.explorer` — :class:`Explorer`: one explorer class, in this process or another
* :mod:`.session` — :class:`ExplorerSession`: the synchronizer's side of one explorer
* :mod:`.delivery` / :mod:`.applier` — the two ends of one explorer's delivery line
* :mod:`.protocol` / :mod:`.mux` — the messages between them, and the wire split in two lanes
* :mod:`.sources` — where published weights wait (MEMORY, CHECKPOINT, NCCL windows)
* :mod:`.fanout` — one payload per version, shared by explorers at the same version
* :mod:`.hub` — the state the synchronizer shares with its trainer handle and sessions
* :mod:`.slots` — :class:`PolicySlot` (atomic, version-stamped swaps) and :class:`LatestSlot`
* :mod:`.config`, :mod:`.states`, :mod:`.styles`, :mod:`.staleness`, :mod:`.metrics`
* :mod:`.follower` — :class:`CheckpointFollower`: an explorer that reads a checkpoint directory

Typical use (see ``docs/api.md``)::

    async with Synchronizer(config, weight_syncer) as sync:
        trainer = await sync.attach_trainer(policy)
        explorer = await sync.attach_explorer("e0", rollout_model)
        ...
"""

from .config import SynchronizerConfig
from .explorer import Explorer, ExplorerHandle, RemoteExplorer
from .fanout import FanOut
from .follower import CheckpointFollower
from .metrics import LoopLagMonitor, RunningStat, flatten, log_metrics
from .protocol import Ack, Packet, Reinit
from .session import ExplorerSession
from .slots import LatestSlot, Lease, PolicySlot, Rollout
from .staleness import FilterResult, StalenessFilter, version_of
from .states import ALLOWED_TRANSITIONS, RunningStatus, StatusCell, check_transition
from .styles import SyncMethod, SyncStyle, explorer_step_syncs, trainer_step_syncs
from .synchronizer import Synchronizer
from .trainer import TrainerHandle

__all__ = [
    "Synchronizer", "TrainerHandle", "Explorer", "ExplorerHandle", "RemoteExplorer", "ExplorerSession",
    "SynchronizerConfig", "SyncMethod", "SyncStyle", "RunningStatus", "StatusCell", "ALLOWED_TRANSITIONS",
    "check_transition", "trainer_step_syncs", "explorer_step_syncs",
    "PolicySlot", "Lease", "Rollout", "LatestSlot",
    "StalenessFilter", "FilterResult", "version_of",
    "LoopLagMonitor", "RunningStat", "log_metrics", "flatten",
    "Packet", "Reinit", "Ack", "CheckpointFollower", "FanOut",
]
