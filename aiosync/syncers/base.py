"""The weight-syncer interface (W1) and its factory (W2).

A weight syncer moves a policy's weights from one sender to one receiver. It sees only two
async callables, ``send(payload)`` and ``recv()``; it knows nothing of the transport.

Sender side::

    await syncer.init_sender(state_dict, names, send, recv)   # once
    await syncer.sync(state_dict, send, version)              # every new version

Receiver side::

    await syncer.init_receiver(model.state_dict(), recv, send)   # once
    version = await syncer.apply(model, recv)                    # per sync
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from ..transports.base import RecvFn, SendFn
from .config import CommOptions, WeightSyncerConfig


class WeightSyncer(ABC):
    """Base class of :class:`PatchWeightSyncer` and :class:`BucketWeightSyncer`."""

    #: ``True`` when ``apply`` swaps in a whole version at once, so it may run in the
    #: background while rollouts continue (``sync_weight_no_wait``). Bucket mode is not.
    supports_no_wait: bool = False
    #: How many payloads one ``sync`` sends and one ``apply`` consumes, when that is fixed
    #: (patch mode: 1); ``None`` when it varies (bucket mode). Lets a caller refuse a
    #: truncated or padded delivery before ``apply`` writes anything.
    payloads_per_sync: int | None = None

    def __init__(self, *, use_ring_sync: bool = False, nccl_max_ctas: int | None = None,
                 nccl_min_ctas: int | None = None) -> None:
        self._comm_options = CommOptions.or_none(use_ring_sync, nccl_max_ctas, nccl_min_ctas)
        #: Statistics of the last ``sync`` / ``apply``: bytes, changed elements, timings.
        self.last_stats: dict[str, Any] = {}

    @property
    def comm_options(self) -> CommOptions | None:
        """Options for the collective transport (W4), or ``None`` when all are default."""
        return self._comm_options

    @staticmethod
    def create(config: Any) -> "WeightSyncer":
        """Build a syncer from a ``weight_syncer`` config (mapping, OmegaConf node or dataclass).

        Raises :class:`aiosync.errors.ConfigError` (a ``ValueError``) for an unknown ``type``
        or an unknown key, naming it.
        """
        cfg = WeightSyncerConfig.from_any(config)
        comm = dict(use_ring_sync=cfg.use_ring_sync, nccl_max_ctas=cfg.nccl_max_ctas,
                    nccl_min_ctas=cfg.nccl_min_ctas)
        if cfg.type == "patch":
            from .patch import PatchWeightSyncer

            return PatchWeightSyncer.from_config(cfg.patch, **comm)
        from .bucket import BucketWeightSyncer

        return BucketWeightSyncer.from_config(cfg.bucket, **comm)

    @abstractmethod
    async def init_sender(self, state_dict: Mapping[str, torch.Tensor],
                          param_names_need_sync: Iterable[str] | None, send: SendFn,
                          recv: RecvFn | None = None, is_sender: bool = True) -> None:
        """One-time sender setup. ``is_sender=False`` ranks join collectives and send nothing."""

    @abstractmethod
    async def init_receiver(self, state_dict: Mapping[str, torch.Tensor], recv: RecvFn,
                            send: SendFn | None = None) -> None:
        """One-time receiver setup."""

    @abstractmethod
    async def sync(self, state_dict: Mapping[str, torch.Tensor], send: SendFn, version: int) -> None:
        """Send the weights of ``version``."""

    @abstractmethod
    async def apply(self, model: torch.nn.Module | Mapping[str, torch.Tensor], recv: RecvFn) -> int:
        """Receive one sync and write it into ``model``; return the version actually applied."""


async def recv_with_timeout(recv: RecvFn, timeout: float | None, what: str) -> Any:
    """``await recv()`` bounded by ``timeout`` seconds; a timeout names what was awaited."""
    import anyio

    from ..errors import PeerTimeoutError

    try:
        with anyio.fail_after(timeout):
            return await recv()
    except PeerTimeoutError:
        raise
    except TimeoutError as exc:
        raise PeerTimeoutError(f"waited {timeout}s for {what} from the peer; nothing arrived") from exc
