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
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ..messages import RecvFn, SendFn
from .config import CommOptions, WeightSyncerConfig


@dataclass(eq=False)
class StagedWrite:
    """One sync, received and validated but not yet written (F3: staging).

    Made by :meth:`WeightSyncer.stage` *outside* the receiver's exclusive section: downloading,
    decompressing and validating happen while rollouts keep reading the model. Only
    :attr:`write` runs inside it.

    * ``version`` — the version the write brings.
    * ``write(model, rollback=True)`` — writes it (and a bootstrap staged by
      :meth:`WeightSyncer.stage_init` before it, if any) and returns ``version``. With
      ``rollback`` the write is all-or-nothing: on any exception, or cancellation, nothing of it
      stays written. ``rollback=False`` (the model holds no valid version yet, so there is
      nothing to protect) lets a failure leave partial writes and saves the journal.
    * ``nbytes`` — bytes received; ``changed`` — elements the write changes, when known;
      ``stage_s`` — seconds spent staging.
    """

    version: int
    write: Callable[..., Awaitable[int]]
    nbytes: int = 0
    changed: int | None = None
    stage_s: float = 0.0


class WeightSyncer(ABC):
    """Base class of :class:`PatchWeightSyncer` and :class:`BucketWeightSyncer`."""

    #: ``True`` when ``apply`` swaps in a whole version at once, so it may run in the
    #: background while rollouts continue (``sync_weight_no_wait``). Bucket mode is not.
    supports_no_wait: bool = False
    #: How many payloads one ``sync`` sends and one ``apply`` consumes, when that is fixed
    #: (patch mode: 1); ``None`` when it varies (bucket mode). Lets a caller refuse a
    #: truncated or padded delivery before ``apply`` writes anything.
    payloads_per_sync: int | None = None
    #: ``True`` when :meth:`stage_init` and :meth:`stage` are implemented: the receiver downloads
    #: and validates outside its exclusive section and holds the model only to write (F3).
    #: Without them, a synchronizer runs ``init_receiver`` / ``apply`` inside the exclusive
    #: section, with a backup of the model for rollback.
    supports_staging: bool = False

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

    async def stage_init(self, state_dict: Mapping[str, torch.Tensor], recv: RecvFn, send: SendFn) -> None:
        """:meth:`init_receiver` without writing: the init conversation runs and a bootstrap is
        received and validated, but it is written only by the :class:`StagedWrite` of the next
        :meth:`stage`. ``state_dict`` is only read. Needs :attr:`supports_staging`."""
        raise NotImplementedError(f"{type(self).__name__} does not support staging")

    async def stage(self, model: torch.nn.Module | Mapping[str, torch.Tensor], recv: RecvFn) -> StagedWrite:
        """Receive and validate one sync without writing anything; returns the
        :class:`StagedWrite` that writes it. Refusals (:class:`~aiosync.errors.PayloadError`,
        :class:`~aiosync.errors.VersionError`, ...) are raised here, before any write. ``model``
        is only read. Needs :attr:`supports_staging`."""
        raise NotImplementedError(f"{type(self).__name__} does not support staging")


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
