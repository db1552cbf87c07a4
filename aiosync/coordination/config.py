"""Configuration of the coordination layer: the ``synchronizer`` config node.

The shipped default is ``aiosync/configs/synchronizer/default.yaml`` (a Hydra config group
beside ``weight_syncer/``: ``- synchronizer/default@synchronizer`` in a defaults list), loadable
without Hydra through :func:`aiosync.configs.load_config`.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from typing import Any

from .._strict import check_types, from_mapping, to_plain
from ..errors import ConfigError
from .styles import SyncMethod, SyncStyle

STALENESS_MODES = ("drop", "downweight")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_seconds(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value < math.inf


@dataclass
class SynchronizerConfig:
    """When and how weights move from the trainer to the explorers.

    * ``method``: ``nccl`` | ``memory`` | ``checkpoint`` (:class:`SyncMethod`).
    * ``style``: ``fixed`` | ``explorer_driven`` | ``trainer_driven`` (:class:`SyncStyle`).
    * ``sync_interval``: steps between syncs (≥ 1).
    * ``sync_offset``: with ``fixed``, explore steps the explorer runs ahead before its first sync (≥ 0).
    * ``sync_timeout``: seconds any side waits for the other (handshake, explorer request) before
      carrying on; an explorer that timed out asks again next cycle.
    * ``sync_weight_no_wait``: the trainer's sync returns once the payload is handed off and
      explorers apply in a background task. Patch syncers only.
    * ``max_staleness``: samples generated more than this many versions behind the trainer are
      dropped (or down-weighted, ``staleness_mode: downweight``); ``null`` keeps everything.
    * ``staleness_mode``: ``drop`` | ``downweight`` (with ``max_staleness`` only);
      ``staleness_decay``: weight factor per version beyond ``max_staleness`` (``downweight`` only).

    Every value is type-checked (a bool is not a number); a key that does not apply to the
    chosen method, style or mode is refused when set to anything but its default.
    * ``max_ahead``: admission control (throttling). An explorer starts a rollout (a lease) only
      while the trainer's newest published version is at most this many versions ahead of the
      weights it holds; otherwise the lease first gets newer weights (it asks, and waits at most
      ``sync_timeout + delivery_timeout`` for them to land). ``null``: rollouts always start.
      A sample is then at most ``max_ahead`` plus the versions published during its rollout
      behind when the trainer uses it: set ``max_ahead`` below ``max_staleness`` by that margin
      and no rollout is wasted.
    * ``delivery_timeout``: the longest one delivery (build, transfer, apply, including waiting
      for leases to end) may take before the link gives it up and re-bootstraps the explorer.
    * ``checkpoint_dir``: directory of the ``checkpoint`` method (required for it, refused for the
      others); a string (or ``os.PathLike``).
    * ``checkpoint_writers``: trainer ranks that each write a shard of every version (a sharded
      trainer, e.g. FSDP2); a version is published once all are in (``checkpoint`` only).
    * ``liveness_timeout``: an explorer that runs but shows no sign of life (no call into its API,
      no lease held) for this long is declared lost: handshakes stop waiting for it.
    * ``verify_state``: whole-state verification (:mod:`aiosync.coordination.verify`): every
      explorer's state is checked against a digest of the trainer's version after every
      bootstrap and repair, at the drain, and every ``verify_state`` versions (``0``: not on a
      schedule; ``null``: never, not even at the drain).
    """

    method: SyncMethod = SyncMethod.MEMORY
    style: SyncStyle = SyncStyle.FIXED
    sync_interval: int = 1
    sync_offset: int = 0
    sync_timeout: float = 60.0
    sync_weight_no_wait: bool = False
    max_staleness: int | None = None
    staleness_mode: str = "drop"
    staleness_decay: float = 0.5
    max_ahead: int | None = None
    delivery_timeout: float = 600.0
    checkpoint_dir: str | None = None
    checkpoint_writers: int = 1
    liveness_timeout: float = 60.0
    verify_state: int | None = 16

    def __post_init__(self) -> None:
        for name, enum in (("method", SyncMethod), ("style", SyncStyle)):
            try:
                setattr(self, name, enum.parse(getattr(self, name)))
            except ValueError as exc:
                raise ConfigError(f"synchronizer.{name}: {exc}") from None
        if isinstance(self.checkpoint_dir, os.PathLike):
            self.checkpoint_dir = os.fspath(self.checkpoint_dir)
        check_types(self, "synchronizer", skip=("method", "style"))
        if not _is_int(self.sync_interval) or self.sync_interval < 1:
            raise ConfigError(
                f"synchronizer.sync_interval must be an integer >= 1 (steps between syncs), got {self.sync_interval!r}; "
                "use 1 to sync after every step"
            )
        if not _is_int(self.sync_offset) or self.sync_offset < 0:
            raise ConfigError(
                f"synchronizer.sync_offset must be an integer >= 0 (explore steps run ahead), got {self.sync_offset!r}"
            )
        if self.sync_offset and self.style is not SyncStyle.FIXED:
            raise ConfigError(
                f"synchronizer.sync_offset={self.sync_offset} only applies to style: fixed; "
                f"set sync_offset: 0 or style: fixed (style is {self.style.value})"
            )
        for name in ("sync_timeout", "delivery_timeout", "liveness_timeout"):
            if not _is_seconds(getattr(self, name)):
                raise ConfigError(
                    f"synchronizer.{name} must be a positive, finite number of seconds, got {getattr(self, name)!r}"
                    " (every wait has a timeout; there is no 'wait forever')"
                )
        if not isinstance(self.sync_weight_no_wait, bool):
            raise ConfigError(f"synchronizer.sync_weight_no_wait must be true or false, got {self.sync_weight_no_wait!r}")
        if self.max_staleness is not None and (not _is_int(self.max_staleness) or self.max_staleness < 0):
            raise ConfigError(
                f"synchronizer.max_staleness must be null or an integer >= 0 (versions), got {self.max_staleness!r}"
            )
        if self.max_ahead is not None and (not _is_int(self.max_ahead) or self.max_ahead < 0):
            raise ConfigError(
                f"synchronizer.max_ahead must be null or an integer >= 0 (versions the trainer may be ahead of a "
                f"rollout's weights when it starts), got {self.max_ahead!r}"
            )
        if self.staleness_mode not in STALENESS_MODES:
            raise ConfigError(
                f"synchronizer.staleness_mode must be one of {', '.join(STALENESS_MODES)}, got {self.staleness_mode!r}"
            )
        if not 0.0 <= self.staleness_decay <= 1.0:
            raise ConfigError(f"synchronizer.staleness_decay must be a number in [0, 1], got {self.staleness_decay!r}")
        if self.staleness_mode != "drop" and self.max_staleness is None:
            raise ConfigError(f"synchronizer.staleness_mode={self.staleness_mode} applies only with max_staleness "
                              "(null keeps every sample at weight 1): set max_staleness, or remove staleness_mode")
        if self.staleness_decay != 0.5 and self.staleness_mode != "downweight":
            raise ConfigError(f"synchronizer.staleness_decay={self.staleness_decay} applies only to staleness_mode: "
                              f"downweight (it is {self.staleness_mode}): set staleness_mode: downweight, or remove "
                              "staleness_decay")
        if self.method is SyncMethod.CHECKPOINT and not self.checkpoint_dir:
            raise ConfigError("synchronizer.method: checkpoint needs synchronizer.checkpoint_dir (a directory path)")
        if self.checkpoint_dir is not None and self.method is not SyncMethod.CHECKPOINT:
            raise ConfigError(f"synchronizer.checkpoint_dir applies to method: checkpoint only (method is "
                              f"{self.method.value}); remove checkpoint_dir, or set method: checkpoint")
        if not _is_int(self.checkpoint_writers) or self.checkpoint_writers < 1:
            raise ConfigError(f"synchronizer.checkpoint_writers must be an integer >= 1 (trainer ranks writing "
                              f"shards), got {self.checkpoint_writers!r}")
        if self.checkpoint_writers > 1 and self.method is not SyncMethod.CHECKPOINT:
            raise ConfigError(f"synchronizer.checkpoint_writers={self.checkpoint_writers} applies to method: "
                              f"checkpoint only (method is {self.method.value}); set checkpoint_writers: 1")
        if self.verify_state is not None and (not _is_int(self.verify_state) or self.verify_state < 0):
            raise ConfigError(f"synchronizer.verify_state must be null or an integer >= 0 (verify every explorer's "
                              f"whole state every this many versions; 0: only after bootstraps and at the drain), got "
                              f"{self.verify_state!r}")

    @classmethod
    def from_any(cls, config: Any = None) -> "SynchronizerConfig":
        """Build from ``None`` (defaults), a mapping, an OmegaConf node or an instance.

        Unknown keys raise :class:`aiosync.errors.ConfigError` naming the key. A mapping holding
        a ``synchronizer`` key (a whole experiment config) is unwrapped.
        """
        if isinstance(config, cls):
            return config
        data = to_plain(config)
        if isinstance(data, dict) and "synchronizer" in data:
            data = data["synchronizer"]
        return from_mapping(cls, data, "synchronizer")

    def to_dict(self) -> dict[str, Any]:
        """Plain values (enums as strings), e.g. for logging or YAML."""
        out = dataclasses.asdict(self)
        out["method"] = self.method.value
        out["style"] = self.style.value
        return out

    def check_weight_syncer(self, syncers: Any) -> None:
        """Reject combinations with the weight syncer that cannot work, before any sync.

        ``syncers`` is a :class:`aiosync.syncers.factory.SyncerFactory`, or anything
        :func:`aiosync.syncers.factory.syncer_factory` accepts (a ``weight_syncer`` config, a
        zero-argument callable returning a syncer).
        """
        if not self.sync_weight_no_wait:
            return
        from ..syncers.factory import SyncerFactory, syncer_factory

        if not isinstance(syncers, SyncerFactory):
            syncers = syncer_factory(syncers)
        if not syncers.supports_no_wait:
            kind = f"weight_syncer.type: {syncers.config.type}" if syncers.config is not None else \
                "a syncer factory whose syncers have supports_no_wait = False"
            raise ConfigError(
                f"synchronizer.sync_weight_no_wait: true needs weight_syncer.type: patch (got {kind}): bucket mode "
                "yields between buckets, so a background apply could expose a half-updated model. "
                "Set synchronizer.sync_weight_no_wait: false, or use weight_syncer.type: patch"
            )
