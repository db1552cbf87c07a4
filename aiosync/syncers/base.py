"""The weight-syncer interface (W1), its registry (W2), staging (F3) and statistics.

A weight syncer moves a policy's weights from one sender to one receiver. It sees only two
async callables, ``send(payload)`` and ``recv()``; it knows nothing of the transport.

Sender side::

    await syncer.init_sender(state_dict, names, send, recv)   # once
    await syncer.sync(state_dict, send, version)              # every new version

Receiver side::

    await syncer.init_receiver(model.state_dict(), recv, send)   # once
    version = await syncer.apply(model, recv)                    # per sync

Staged receiver side (F3: only the write needs the model exclusively)::

    await syncer.stage_init(model.state_dict(), recv, send)     # reads the model only
    staged = await syncer.stage(model, recv)                     # reads the model only
    async with exclusive_access(model):
        version = await staged.write(model)                      # all-or-nothing

A receiver model may also be a :class:`CommitTarget`: a mapping of host tensors that stand for
weights held elsewhere (an inference engine's). A staged write then writes the mapping and
calls its ``commit_write`` before the write counts, in the same all-or-nothing step. Or it is
a :class:`RemoteTarget`, whose weights are decoded and written where they live: a staged write
validates what can be validated without them and hands over what it received
(:class:`RemoteWrite`).

Implementations register under their config ``type`` with a class keyword
(``class PatchWeightSyncer(WeightSyncer, type_name="patch")``); :meth:`WeightSyncer.create`
looks them up, so this module imports none of them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol, runtime_checkable

import torch

from ..errors import ConfigError
from ..messages import RecvFn, SendFn
from .config import SYNCER_TYPES, CommOptions, WeightSyncerConfig


@dataclass(frozen=True)
class SyncStatistics:
    """What the last ``sync`` (sender) or ``apply`` / staged write (receiver) did.

    Fields that do not apply to a side or a mode are ``None``: ``changed`` is unknown to a
    bucket sender; ``build_s`` / ``encode_s`` / ``send_s`` are the sender's, ``stage_s`` /
    ``write_s`` / ``apply_s`` the receiver's (``apply_s`` = staging + writing; ``write_s`` is the
    part that holds the model exclusively).
    """

    version: int | None = None
    bytes: int = 0
    changed: int | None = None
    elements: int | None = None
    build_s: float | None = None
    encode_s: float | None = None
    send_s: float | None = None
    stage_s: float | None = None
    write_s: float | None = None
    apply_s: float | None = None
    buckets: int | None = None
    #: Receiver: the most bytes it held beyond the model at once while staging and writing —
    #: received payloads it still referenced, the planned changes, the undo records — as the
    #: receiver counts them (``None``: not counted).
    peak_bytes: int | None = None

    @property
    def bytes_per_changed(self) -> float | None:
        """Payload bytes per changed element (``None`` when unknown, 0.0 when nothing changed)."""
        if self.changed is None:
            return None
        return self.bytes / self.changed if self.changed else 0.0


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


@runtime_checkable
class CommitTarget(Protocol):
    """A receiver model whose tensors live elsewhere (an inference engine), written through a
    host-side mapping of them in checkpoint names.

    Such a model is a ``Mapping[str, torch.Tensor]`` (what a syncer reads and writes, like any
    dict of tensors) with one more coroutine. A staged write (:class:`StagedWrite`) first writes
    the mapping, all-or-nothing, then awaits ``commit_write(keys, version)``: make the real
    weights equal the mapping's tensors ``keys`` (the ones the write changed; the target may
    send more) and label them ``version`` (``None``: keep the label they have). Only when it
    returns does the write count. If it raises, the write is undone in the mapping and
    ``commit_write(keys, None)`` is awaited once more to put the old values back into the real
    weights; then the error propagates (the explorer's version stays). Staging syncers (patch,
    bucket) call it; an explorer refuses a syncer that cannot stage for such a model.
    """

    async def commit_write(self, keys: Sequence[str], version: int | None) -> None: ...


@runtime_checkable
class DigestTarget(Protocol):
    """A receiver model that digests what it holds itself, for whole-state verification: its
    weights live elsewhere (an inference engine), so a digest of the mapping the syncers see
    would check a copy, not the weights. ``state_digests(keys)`` returns the
    :func:`~aiosync.syncers.common.integrity.state_digest` of each key's tensor as the real
    weights hold it (read where they live); a key it leaves out counts as a mismatch.
    :class:`RemoteTarget` is one; :class:`~aiosync.engines.vllm.VLLMTarget` too."""

    async def state_digests(self, keys: Sequence[str]) -> dict[str, int]: ...


@dataclass
class RemoteWrite:
    """One staged write for a :class:`RemoteTarget`: what the receiver took in for it, as it
    arrived, validated as far as it can be without the weights.

    * ``version`` — the version the write brings (``None``: a bootstrap written without one).
    * ``handshake`` — a patch handshake's state, when this write starts a new patch chain:
      ``{"keys": [the target's keys, in its order], "synced": [ordinals patches touch],
      "session": id or None}``; patches index ``keys`` by ordinal. From a sharded trainer it
      adds ``"shards"``: per shard ``{"rows": {key: None (whole) or [first row, rows]}, "keys":
      [its keys, in its ordinal order], "synced": [ordinals its parts touch]}``.
    * ``tensors`` — whole tensors, bucket by bucket (a bootstrap or a bucket sync), written
      before the patch.
    * ``patch`` — the encoded patch (:class:`~aiosync.syncers.common.payloads.WeightPatch`,
      ``CompressedWeightPatch`` or ``EmptyWeightPatch``; from a sharded trainer a
      ``ShardedPatch`` of every shard's part, positions local to its rows), its header checked
      (version, base version, session), the rest not decoded; ``None``: no patch.
    """

    version: int | None
    handshake: dict | None = None
    tensors: list[dict[str, torch.Tensor]] = field(default_factory=list)
    patch: Any = None


@runtime_checkable
class RemoteTarget(Protocol):
    """A receiver model whose weights live elsewhere and are decoded and written there (an
    inference engine's workers, in place in their parameters): the syncers never read or
    write its tensors.

    Such a model is a ``Mapping[str, torch.Tensor]`` of *meta* tensors — its layout: names in
    its order, shapes, dtypes, and tied names as the same tensor — with one more coroutine. A
    staged write (:class:`StagedWrite`) awaits ``write_remote(write)`` (a :class:`RemoteWrite`)
    instead of writing: make the weights hold what ``write`` brings, all or nothing, and return
    the version they now hold (``write.version``). If it raises, nothing was written, and the
    receiver keeps its version. Staging syncers (patch, bucket) call it. Whole-state
    verification awaits ``state_digests(keys)`` (a :class:`DigestTarget`): computed where the
    weights live.
    """

    async def write_remote(self, write: RemoteWrite) -> int | None: ...

    async def state_digests(self, keys: Sequence[str]) -> dict[str, int]: ...


@runtime_checkable
class ReceiverHost(Protocol):
    """A receiver model whose weights live where the receiving syncer must run too (a
    ``vllm serve`` process: :class:`aiosync.engines.vllm_server.VLLMServer`): the explorer does
    not decode what it receives, it forwards it. ``host_receiver(syncer)`` returns the syncer
    the explorer drives in place of ``syncer`` (made from the same config): a staging syncer
    that hands the init conversation and every payload over, still encoded, to a receiver made
    from that config where the weights are, and whose staged write writes there."""

    def host_receiver(self, syncer: "WeightSyncer") -> "WeightSyncer": ...


@runtime_checkable
class LosesWeights(Protocol):
    """A receiver model whose weights can be replaced where they live, outside aiosync (a
    ``vllm serve`` process that restarted comes back holding the weights it was started
    from). ``on_weights_lost(callback)``: call ``callback(reason)`` whenever that is noticed
    (the latest callback registered is the one told); the explorer holding the model then
    reports no version until a bootstrap lands, and asks for one."""

    def on_weights_lost(self, callback: Callable[[str], None]) -> None: ...


class WeightSyncer(ABC):
    """Base class of :class:`PatchWeightSyncer` and :class:`BucketWeightSyncer`.

    A subclass registers itself for :meth:`create` under a config ``type`` with the class
    keyword ``type_name`` (``class MySyncer(WeightSyncer, type_name="patch")``); it then needs a
    ``from_config(node, **comm)`` classmethod taking that type's config node.
    """

    #: config ``type`` → implementation; filled by ``__init_subclass__``.
    _registry: ClassVar[dict[str, type["WeightSyncer"]]] = {}
    #: How a synchronizer may share one sender among explorers (S12, X2): ``"chain"`` (patches
    #: form a version chain every explorer at the same version can share), ``"latest"`` (each
    #: sync carries the whole state: an explorer needs only the newest), ``None`` (one private
    #: sender per explorer).
    fan_out_mode: ClassVar[str | None] = None
    #: ``True`` when the receiver takes a sync's payloads as :class:`aiosync.messages.Shared`
    #: (and patches as :class:`~aiosync.syncers.common.payloads.Stamped`): a fan-out then sends one
    #: object, encoded once, to every explorer at that version, with each explorer's session
    #: beside it. ``False``: each explorer gets its own copy of the payload (encoded per explorer).
    shares_payloads: ClassVar[bool] = False
    #: ``True`` when a sender can take one more receiver of the same layout onto its chain at
    #: its current version (``accept(state_dict, meta, send, like=<the sender it would have had>)``,
    #: returning that receiver's first payload): a fan-out then keeps one sender, one snapshot,
    #: per layout.
    accepts_receivers: ClassVar[bool] = False

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

    def __init_subclass__(cls, type_name: str | None = None, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if type_name is not None:
            if type_name not in SYNCER_TYPES:
                raise TypeError(f"type_name {type_name!r} is not a weight_syncer type ({', '.join(SYNCER_TYPES)})")
            WeightSyncer._registry[type_name] = cls

    def __init__(self, *, use_ring_sync: bool = False, nccl_max_ctas: int | None = None,
                 nccl_min_ctas: int | None = None) -> None:
        self._comm_options = CommOptions.or_none(use_ring_sync, nccl_max_ctas, nccl_min_ctas)
        self._statistics = SyncStatistics()

    @classmethod
    def from_config(cls, node: Any, **comm: Any) -> "WeightSyncer":
        """Build from this type's config node (``weight_syncer.<type>``) and the shared
        communication options; registered implementations define it."""
        raise NotImplementedError(f"{cls.__name__} cannot be built from a config")

    def statistics(self) -> SyncStatistics:
        """What the last ``sync`` (sender) or ``apply`` / staged write (receiver) did."""
        return self._statistics

    def close(self) -> None:
        """Free what a sender keeps between syncs (a snapshot); the default does nothing."""

    def require_full_bootstrap(self) -> None:
        """Make this syncer's init conversation send the whole state (a repair must not trust
        the receiver's old weights). A no-op for syncers whose every sync is whole."""

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
        return WeightSyncer.implementation(cfg.type).from_config(
            getattr(cfg, cfg.type), use_ring_sync=cfg.use_ring_sync, nccl_max_ctas=cfg.nccl_max_ctas,
            nccl_min_ctas=cfg.nccl_min_ctas)

    @staticmethod
    def implementation(type_name: str) -> type["WeightSyncer"]:
        """The class registered for config ``type`` ``type_name`` (:class:`ConfigError` if none)."""
        cls = WeightSyncer._registry.get(type_name)
        if cls is None:
            valid = ", ".join(sorted(WeightSyncer._registry)) or "none registered"
            raise ConfigError(f"unknown weight_syncer.type {type_name!r}; valid types are: {valid}")
        return cls

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
