"""Building syncers from what a user passes (W2): a config, or a zero-argument factory.

* :func:`create_syncer` — one syncer from a ``weight_syncer`` config (mapping, OmegaConf
  node, :class:`~aiosync.syncers.config.WeightSyncerConfig`); the same as
  :meth:`WeightSyncer.create`.
* :func:`syncer_factory` — the plan a synchronizer uses to make one syncer per sender and
  receiver: :class:`SyncerFactory`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError
from .base import WeightSyncer
from .config import WeightSyncerConfig


def create_syncer(config: Any) -> WeightSyncer:
    """A syncer built from a ``weight_syncer`` config; unknown types and keys raise
    :class:`~aiosync.errors.ConfigError` naming them."""
    return WeightSyncer.create(config)


@dataclass(frozen=True)
class SyncerFactory:
    """How a synchronizer makes the syncers of its pairs.

    * ``make(bootstrap)`` — a fresh syncer; with ``bootstrap=True`` the pair's init
      conversation sends the *whole* state (a repair must not trust the receiver's old
      weights): a patch syncer gets ``init_sync`` enabled with no prefixes.
    * ``config`` — the validated config, or ``None`` when built from a user's callable.
    * ``supports_no_wait`` — whether the syncers can apply in the background (S7).
    * ``bootstrap_unless_declared`` — a patch config with ``init_sync`` off: an explorer is
      trusted without a bootstrap only when it declares it holds the trainer's version.
    * ``comm_options`` — W4's communication options of these syncers (``None``: defaults),
      which the synchronizer and explorers hand to their transports.
    """

    make: Callable[[bool], WeightSyncer]
    config: WeightSyncerConfig | None
    supports_no_wait: bool
    bootstrap_unless_declared: bool
    comm_options: Any = None

    def to_dict(self) -> dict | None:
        """The config as a plain dict (told to explorers in other processes); ``None`` for a callable."""
        return None if self.config is None else dataclasses.asdict(self.config)


def syncer_factory(weight_syncer: Any) -> SyncerFactory:
    """The :class:`SyncerFactory` of a ``weight_syncer`` argument: a config (mapping, OmegaConf
    node, :class:`WeightSyncerConfig`), or a zero-argument callable returning a fresh
    :class:`WeightSyncer` each call (probed once here: anything else is a :class:`ConfigError`)."""
    if isinstance(weight_syncer, WeightSyncer):
        raise ConfigError("weight_syncer must be a config or a zero-argument factory of syncers, not a syncer "
                          f"instance ({type(weight_syncer).__name__}): each pair needs its own syncer")
    if callable(weight_syncer) and not isinstance(weight_syncer, Mapping) \
            and not dataclasses.is_dataclass(weight_syncer):
        probe = weight_syncer()
        if not isinstance(probe, WeightSyncer):
            raise ConfigError(f"weight_syncer factory returned {type(probe).__name__}, not a WeightSyncer")

        def make_from_callable(bootstrap: bool) -> WeightSyncer:
            syncer = weight_syncer()
            if bootstrap:
                syncer.require_full_bootstrap()
            return syncer

        return SyncerFactory(make_from_callable, None, bool(probe.supports_no_wait), False, probe.comm_options)

    cfg = WeightSyncerConfig.from_any(weight_syncer)
    repair = cfg
    if cfg.type == "patch" and (not cfg.patch.init_sync.enabled or cfg.patch.init_sync.prefixes is not None):
        init = dataclasses.replace(cfg.patch.init_sync, enabled=True, prefixes=None)
        repair = dataclasses.replace(cfg, patch=dataclasses.replace(cfg.patch, init_sync=init))
    cls = WeightSyncer.implementation(cfg.type)

    def make(bootstrap: bool) -> WeightSyncer:
        return WeightSyncer.create(repair if bootstrap else cfg)

    return SyncerFactory(make, cfg, bool(cls.supports_no_wait),
                         cfg.type == "patch" and not cfg.patch.init_sync.enabled, cfg.comm_options)
