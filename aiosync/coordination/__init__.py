"""The async runtime: synchronizer, policy slot, sync methods / styles / states, staleness, metrics.

Typical use (see ``docs/api.md``)::

    async with Synchronizer(config, weight_syncer) as sync:
        trainer = await sync.attach_trainer(policy)
        explorer = await sync.attach_explorer("e0", rollout_model)
        ...
"""

from .config import SynchronizerConfig
from .link import Ack, Packet, Reinit
from .fanout import FanOut
from .metrics import LoopLagMonitor, RunningStat, flatten, log_metrics
from .remote import CheckpointFollower, RemoteExplorer, RemoteExplorerHandle
from .slots import LatestSlot, Lease, PolicySlot
from .staleness import FilterResult, StalenessFilter, version_of
from .states import ALLOWED_TRANSITIONS, RunningStatus, StatusCell, check_transition
from .styles import SyncMethod, SyncStyle, explorer_step_syncs, trainer_step_syncs
from .synchronizer import ExplorerHandle, Synchronizer, TrainerHandle

__all__ = [
    "Synchronizer", "TrainerHandle", "ExplorerHandle", "SynchronizerConfig",
    "SyncMethod", "SyncStyle", "RunningStatus", "StatusCell", "ALLOWED_TRANSITIONS", "check_transition",
    "trainer_step_syncs", "explorer_step_syncs",
    "PolicySlot", "Lease", "LatestSlot",
    "StalenessFilter", "FilterResult", "version_of",
    "LoopLagMonitor", "RunningStat", "log_metrics", "flatten",
    "Packet", "Reinit", "Ack",
    "RemoteExplorer", "RemoteExplorerHandle", "CheckpointFollower", "FanOut",
]
