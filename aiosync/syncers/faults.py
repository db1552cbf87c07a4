"""Receivers whose writes fail on purpose (``aiosync simulate``'s fault scenario, tests).

:class:`FlakyPatchSyncer` and :class:`FlakyBucketSyncer` raise in the middle of a staged
write, after writing part of it (every second tensor of the write is done when it raises),
as :class:`ApplyFaults` decides. The write's journal must then undo what was written: the
model keeps its previous weights and version (S8).
"""

from __future__ import annotations

import random
import threading
from typing import Any

from .bucket.syncer import BucketWeightSyncer
from .config import WeightSyncerConfig
from .patch.syncer import PatchWeightSyncer


class ApplyFaults:
    """Decides, from a seeded RNG, when an explorer's write raises half way (thread-safe).
    Disabled until ``enabled`` is set; ``fired`` counts the faults injected."""

    def __init__(self, rate: float, seed: int) -> None:
        self.rate = rate
        self.enabled = False
        self.fired = 0
        self._rng = random.Random(seed)
        self._lock = threading.Lock()

    def fire(self) -> bool:
        with self._lock:
            if self.enabled and self.rate and self._rng.random() < self.rate:
                self.fired += 1
                return True
            return False


class _Flaky:
    """The fault hook shared by both flaky syncers: consulted once per write, half way."""

    faults: ApplyFaults | None = None

    def after_each_write(self, i: int, n: int) -> None:
        if i == (n - 1) // 2 and self.faults is not None and self.faults.fire():
            raise RuntimeError(f"injected fault: the write raised after writing {i + 1} of {n} tensors")


class FlakyPatchSyncer(_Flaky, PatchWeightSyncer):
    """A patch syncer whose staged writes (bootstrap and patch) may raise half way."""


class FlakyBucketSyncer(_Flaky, BucketWeightSyncer):
    """A bucket syncer whose staged writes may raise half way."""


def flaky_syncer_factory(weight_syncer: Any, faults: ApplyFaults):
    """A zero-argument factory (for a synchronizer) of syncers built from the
    ``weight_syncer`` config whose writes fail as ``faults`` decides."""
    cfg = WeightSyncerConfig.from_any(weight_syncer)
    comm = dict(use_ring_sync=cfg.use_ring_sync, nccl_max_ctas=cfg.nccl_max_ctas, nccl_min_ctas=cfg.nccl_min_ctas)

    def make():
        if cfg.type == "patch":
            syncer = FlakyPatchSyncer.from_config(cfg.patch, **comm)
        else:
            syncer = FlakyBucketSyncer.from_config(cfg.bucket, **comm)
        syncer.faults = faults
        return syncer

    return make
