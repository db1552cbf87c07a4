"""Patch mode (W6-W15, W17, B1, B2): send only the elements that changed.

The sender keeps a snapshot of the synced tensors in the *receiver's* dtypes. Each sync
diffs the current weights against it bit for bit, encodes the changed positions and values,
optionally compresses them, and advances the snapshot.

The receiver stages (F3): it downloads, decompresses and validates a patch (and a bootstrap)
while only reading its model (:meth:`PatchWeightSyncer.stage_init`, :meth:`~PatchWeightSyncer.stage`);
the :class:`~aiosync.syncers.base.StagedWrite` it returns does the writing, all-or-nothing.
``init_receiver`` and ``apply`` are staging plus writing at once.

Patch-chain integrity (B3): every patch names the version it was built on and the handshake
(session) it belongs to; a receiver holding another version, or belonging to another
handshake, refuses it before writing anything. ``flat`` patches always carry a drift check
(a hash of the old bits at the changed positions, verified before anything is written). With
``verify_checksums`` a patch also carries a CRC-32 of every tensor it touches as the sender's
snapshot holds it afterwards; the receiver checks the tensors it wrote and rolls the whole
patch back on a mismatch.

Helpers: :mod:`aiosync.syncers.patch.handshake` (metadata, answer, plan), :mod:`aiosync.syncers.patch.receiver` (validate,
write), :mod:`aiosync.syncers.common.staging` (bootstrap writes, journal).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import anyio
import torch

from ...aio import resolve_device, run_sync
from ...errors import AiosyncError, ApplyError, ConfigError, HandshakeError, PatchChainError, VersionError
from ...messages import RecvFn, SendFn, payload_nbytes
from ...reclaim import hand_over, release_if_only_here
from ..base import RemoteTarget, StagedWrite, SyncStatistics, WeightSyncer, recv_with_timeout
from ..bucket.format import (BucketReader, bucket_manifest, cast_for_bucket, check_no_reserved_keys, check_version,
    iter_named_tensor_buckets, seal_bucket)
from .codecs import check_codec_available, compress_patch
from ..config import PatchConfig
from ..common.integrity import checksum_tensor, new_session, tensor_checksum
from .format import TensorLayout, assemble_flat_patch, encode_patch
from .forward import sharded_plan, stage_patch, tensor_plan, write_remote
from .handshake import (check_hello, check_metadata, is_int, metadata_dtype, plan_slots, receiver_layouts,
    receiver_metadata, sender_layouts)
from .receiver import (PreparedPatch, ReceiverState, ShardedWrite, complete_patch, receiver_shards,
    write_patch)
from ..common.payloads import EmptyWeightPatch, ReceiverMetadata, SenderHello, WeightPatch
from .shard_layout import shard_views
from ..snapshot.builder import FlatDiff, Snapshot
from ..common.staging import FullStateWrite, Journal, commit_write, held_bytes, written
from ..kernels.warmup import ready as kernels_ready, request as request_kernels, widths_of
from ..common.state_dicts import is_dtensor, match_prefixes, materialize, module_state_dict, select_sync_names

_D = PatchConfig()  # the one home of the defaults (== weight_syncer/patch_syncer.yaml)


@dataclass
class _PendingInit:
    """A handshake staged by ``stage_init``: committed by the next staged write."""

    rx: ReceiverState
    plan: FullStateWrite | None  # the bootstrap, planned; None without one
    nbytes: int
    stage_s: float


class PatchWeightSyncer(WeightSyncer, type_name="patch"):
    """Incremental sync of changed elements.

    Parameters keep the seed's names: ``snapshot_device`` (``cpu`` or ``cuda``),
    ``transport_device`` (where patches are built for sending; ``None`` = ``cpu``),
    ``delta_encoding`` (delta-coded COO coordinates), ``compression`` (``none``, ``zstd``,
    ``nvcomp_lz4``, ``nvcomp_zstd``), ``init_sync_enabled`` / ``init_sync_prefixes`` /
    ``init_sync_bucket_size`` (one-time bootstrap, W8). Further options: ``encoding``
    (``coo`` — the seed's format — or ``flat``, the compact format of
    ``docs/wire-format.md``), ``compression_level`` (zstd), ``recv_timeout`` (seconds any
    wait on the peer may take), ``builder_kernel`` (``auto`` or ``torch``),
    ``verify_checksums`` (send a CRC-32 of every touched tensor; the receiver verifies what it
    wrote and rolls back on a mismatch; off by default and free when off). Defaults are those
    of :class:`~aiosync.syncers.config.PatchConfig` (the shipped ``patch_syncer.yaml``).
    """

    supports_no_wait = True
    payloads_per_sync = 1
    supports_staging = True
    fan_out_mode = "chain"
    shares_payloads = True
    accepts_receivers = True
    #: Fault injection: called as ``hook(i, n)`` after the ``i``-th of ``n`` tensors of a staged
    #: write was written (see :mod:`aiosync.syncers.faults`); ``None`` writes tensors in parallel.
    after_each_write: Callable[[int, int], None] | None = None
    #: The builder's scratch per chunk as a fraction of the synced elements (``None``: the
    #: default chunks); a shard sender sets it so its memory stays about its snapshot.
    scratch_fraction: float | None = None

    def __init__(self, snapshot_device: str = _D.snapshot_device, transport_device: str | None = _D.transport_device,
                 delta_encoding: bool = _D.delta_encoding, compression: str = _D.compression,
                 init_sync_enabled: bool = _D.init_sync.enabled, init_sync_prefixes: list[str] | None = None,
                 init_sync_bucket_size: int = _D.init_sync.bucket_size, *, encoding: str = _D.encoding,
                 compression_level: int = _D.compression_level, recv_timeout: float | None = _D.recv_timeout,
                 builder_kernel: str = "auto", verify_checksums: bool = _D.verify_checksums, **comm: Any) -> None:
        super().__init__(**comm)
        self.config = PatchConfig(
            snapshot_device=snapshot_device, transport_device=transport_device, delta_encoding=delta_encoding,
            compression=compression, encoding=encoding, compression_level=compression_level,
            recv_timeout=recv_timeout, verify_checksums=verify_checksums,
            init_sync={"enabled": init_sync_enabled, "prefixes": init_sync_prefixes, "bucket_size": init_sync_bucket_size},
        )
        check_codec_available(compression)  # fail when built, not at the first sync (W12)
        if str(snapshot_device).startswith("cuda") and not torch.cuda.is_available():
            raise ConfigError("patch.snapshot_device is cuda but CUDA is not available; use snapshot_device: cpu")
        self._transport_device = resolve_device(transport_device or "cpu")  # "cuda": the caller's device, not 0
        self._builder_kernel = builder_kernel
        # sender state
        self._snapshot: Snapshot | None = None
        self._ctx = None  # the ctx encoding's statistics (patch_ctx.CtxBuilder)
        self._slot_keys: list[str] = []
        self._names: list[str] = []  # synced keys in the sender's state-dict order (W17 collective order)
        self._layouts: list[TensorLayout] = []
        self._elem_sizes: dict[int, int] = {}
        self._widths: tuple[int, ...] = ()  # element widths of the snapshot (the receiver's dtypes)
        self._is_sender = True
        self._last_version: int | None = None
        self._chain_broken: str | None = None  # why the snapshot is out of step (a failed build)
        self._bootstrap_keys: list[str] = []
        self._planned: dict[str, tuple] = {}  # key -> (shape, dtype) as the handshake planned: each sync re-checks
        self._session: int | None = None  # the handshake's id, as the sender echoes it
        self._by_encoding: dict[str, SyncStatistics] = {}
        # receiver state: changes only when a staged write succeeds
        self._rx = ReceiverState()
        self.version: int | None = None
        self._pending: _PendingInit | None = None
        self._generation = 0  # bumped by every commit and every new handshake: older staged writes are void

    @classmethod
    def from_config(cls, cfg: PatchConfig, **comm: Any) -> "PatchWeightSyncer":
        return cls(snapshot_device=cfg.snapshot_device, transport_device=cfg.transport_device,
                   delta_encoding=cfg.delta_encoding, compression=cfg.compression,
                   init_sync_enabled=cfg.init_sync.enabled, init_sync_prefixes=cfg.init_sync.prefixes,
                   init_sync_bucket_size=cfg.init_sync.bucket_size, encoding=cfg.encoding,
                   compression_level=cfg.compression_level, recv_timeout=cfg.recv_timeout,
                   verify_checksums=cfg.verify_checksums, **comm)

    def require_full_bootstrap(self) -> None:
        """The next ``init_sender`` bootstraps the whole state dict (``init_sync`` on, no prefixes)."""
        init = dataclasses.replace(self.config.init_sync, enabled=True, prefixes=None)
        self.config = dataclasses.replace(self.config, init_sync=init)

    @property
    def snapshot(self) -> Snapshot | None:
        """The sender's snapshot (``None`` on a receiver or before ``init_sender``)."""
        return self._snapshot

    # ================================================================ sender
    async def init_sender(self, state_dict: Mapping[str, torch.Tensor], param_names_need_sync, send: SendFn,
                          recv: RecvFn | None = None, is_sender: bool = True) -> None:
        """Receive the receiver's metadata, check it, bootstrap if enabled, take the snapshot.

        Ranks with ``is_sender=False`` (other FSDP ranks) only take part in the collectives
        that gather DTensors, in the same order as the sender, and send nothing.
        """
        init = self.config.init_sync
        try:
            names = select_sync_names(state_dict, param_names_need_sync)
            boot = match_prefixes(state_dict.keys(), init.prefixes) if init.enabled else []
        except ValueError as exc:  # ConfigError / HandshakeError: tell the waiting receiver, don't let it time out
            if is_sender and recv is not None:
                try:
                    await send(SenderHello(ok=False, error=str(exc)))
                except Exception:  # the original error is the one to report
                    pass
            raise
        self._is_sender = is_sender
        self._names = names
        if not is_sender:
            self._slot_keys = names
            self._bootstrap_keys = boot
            for key in boot:
                await run_sync(materialize, state_dict[key])
            for key in names:
                await run_sync(materialize, state_dict[key])
            return
        if recv is None:
            raise ValueError("patch mode's init_sender needs `recv` to receive the receiver's metadata")
        meta = await recv_with_timeout(recv, self.config.recv_timeout, "the receiver's metadata")
        try:
            if not isinstance(meta, ReceiverMetadata):
                raise HandshakeError(f"expected ReceiverMetadata from the receiver, got {type(meta).__name__}")
            check_metadata(meta)
            slots, dtypes = plan_slots(state_dict, names, boot, meta)
        except HandshakeError as exc:
            session = getattr(meta, "session", None)
            await send(SenderHello(ok=False, error=str(exc), session=session if is_int(session) else None))
            raise
        self._session = meta.session
        self._meta = meta
        ordinal = {k: i for i, k in enumerate(meta.ordered_keys)}
        await send(SenderHello(ok=True, init_sync=bool(boot), synced_ordinals=[ordinal[k] for k in slots],
                               session=meta.session))
        if boot:
            await self._bootstrap(state_dict, boot, meta, send)
        self._slot_keys = slots
        self._planned = {k: (tuple(state_dict[k].shape), state_dict[k].dtype) for k in slots}
        self._layouts = sender_layouts(slots, meta, dtypes)
        self._elem_sizes = {lay.ordinal: lay.elem_size for lay in self._layouts}
        self._widths = tuple(sorted(set(self._elem_sizes.values())))
        request_kernels(self._widths, self.config.encoding == "ctx")  # in the background (L2): nothing waits
        snapshot = Snapshot(self.config.snapshot_device, kernel=self._builder_kernel, **self._chunking(state_dict, slots))
        await run_sync(self._take_snapshot, snapshot, state_dict, [dtypes[k] for k in slots])
        if self._snapshot is not None:
            self._snapshot.close()
        self._snapshot = snapshot
        self._ctx = None  # the ctx statistics: made by the first ctx build (ctx_builder)
        self._last_version = None
        self._chain_broken = None

    async def accept(self, state_dict: Mapping[str, torch.Tensor], meta: ReceiverMetadata, send: SendFn, *,
                     like: "PatchWeightSyncer") -> EmptyWeightPatch:
        """Take one more receiver onto this sender's chain, at the version its snapshot holds,
        without a snapshot of its own (fan-out: one snapshot per receiver layout): the hello,
        the bootstrap from ``state_dict`` (which must hold that version: the caller's), and the
        receiver's first payload, an empty patch of that version, are its own; every later patch
        is shared. ``meta`` must describe the same layout as the first receiver's
        (:class:`HandshakeError` otherwise). ``like``: the sender this receiver would have had
        of its own; its ``init_sync`` says what the bootstrap holds."""
        first = getattr(self, "_meta", None)
        if self._snapshot is None or first is None or self._last_version is None or self._chain_broken is not None:
            raise PatchChainError("this sender has no built version to take a receiver at (call init_sender and sync "
                                  "first)", expected_base=self._last_version, receiver_version=None)
        try:
            check_metadata(meta)
            same = (list(meta.ordered_keys), [tuple(x) for x in meta.original_shapes], list(meta.dtypes), meta.aliases,
                    list(meta.viewable), sorted(map(list, meta.shares)))
            if same != (list(first.ordered_keys), [tuple(x) for x in first.original_shapes], list(first.dtypes),
                        first.aliases, list(first.viewable), sorted(map(list, first.shares))):
                raise HandshakeError("this receiver's model differs from the one the sender was set up for (keys, "
                                     "shapes or dtypes); it needs a sender of its own")
        except HandshakeError as exc:
            await send(SenderHello(ok=False, error=str(exc), session=meta.session if is_int(meta.session) else None))
            raise
        init = like.config.init_sync
        boot = match_prefixes(state_dict.keys(), init.prefixes) if init.enabled else []
        ordinal = {k: i for i, k in enumerate(meta.ordered_keys)}
        await send(SenderHello(ok=True, init_sync=bool(boot), synced_ordinals=[ordinal[k] for k in self._slot_keys],
                               session=meta.session))
        if boot:
            await self._bootstrap(state_dict, boot, meta, send)
        return EmptyWeightPatch(self._last_version, None, meta.session)

    async def _bootstrap(self, state_dict, keys: list[str], meta: ReceiverMetadata, send: SendFn) -> None:
        dtypes = {k: metadata_dtype(d) for k, d in zip(meta.ordered_keys, meta.dtypes)}
        sized = ((k, torch.empty(state_dict[k].shape, dtype=dtypes[k], device="meta")) for k in keys)
        buckets = list(iter_named_tensor_buckets(sized, self.config.init_sync.bucket_size))
        manifest = bucket_manifest(buckets)

        def build(i, bucket):  # cast_for_bucket: every tensor owns its bytes (never the live state)
            tensors = {k: cast_for_bucket(state_dict[k], dtypes[k], self._transport_device) for k, _ in bucket}
            return seal_bucket(tensors, index=i, count=len(buckets), manifest=manifest if i == 0 else None,
                               session=meta.session, checksum=self.config.verify_checksums)

        for i, bucket in enumerate(buckets):
            await hand_over(send, [await run_sync(build, i, bucket)])  # let go of off the loop once sent

    def _chunking(self, state_dict, slots: list[str]) -> dict:
        if self.scratch_fraction is None:
            return {}
        total = sum(state_dict[k].numel() for k in slots)
        return {"chunk_elems": min(1 << 22, max(1 << 16, int(total * self.scratch_fraction)))}

    def close(self) -> None:
        """Free the sender's snapshot (and its builder threads)."""
        if self._snapshot is not None:
            self._snapshot.close()
            self._snapshot = None

    def _take_snapshot(self, snapshot: Snapshot, state_dict, dtypes: list[torch.dtype]) -> None:
        # Materialise every synced key in state-dict order, as ranks with is_sender=False do, so
        # DTensor gathers (collectives) match even when the receiver orders keys differently or
        # ties some of them (W17); only the slot keys are kept.
        full = {k: materialize(state_dict[k]) for k in self._names}
        snapshot.load([full[k] for k in self._slot_keys], dtypes)

    async def sync(self, state_dict: Mapping[str, torch.Tensor], send: SendFn, version: int) -> None:
        """Build the patch from the current ``state_dict`` and send it stamped ``version``.

        Once the patch is built the snapshot holds ``version``: if sending then fails (or the
        call is cancelled), the next patch is still built on ``version``, so a receiver that
        missed this one refuses the next with :class:`PatchChainError` instead of silently
        missing these changes (B3). A build that fails half way leaves the snapshot in an
        unknown state: every later ``sync`` raises :class:`PatchChainError` until
        ``init_sender`` runs again.
        """
        version = self._check_next(version)
        if not self._is_sender:
            for key in self._slot_keys:
                await run_sync(materialize, state_dict[key])
            self._last_version = version
            return
        if self._snapshot is None:
            raise RuntimeError("call init_sender before sync")
        patches = await self._build_encoded(state_dict, version, (self.plain_encoding(),))
        patch = next(iter(patches.values()))
        t2 = time.perf_counter()
        await send(patch)
        self._statistics = dataclasses.replace(self._statistics, send_s=time.perf_counter() - t2)

    async def sync_encodings(self, state_dict: Mapping[str, torch.Tensor], version: int,
                             encodings: tuple[str, ...]) -> dict[str, Any]:
        """Build ``version``'s patch once in each of ``encodings`` (``flat``, ``ctx``) and return
        them by encoding, sending nothing (a fan-out hands each explorer link the one it chose:
        ``encoding: auto``). One diff serves both: the changes found, the snapshot is put back at
        them and the ``ctx`` builder codes the same changes (:mod:`.encodings`). An encoding this
        sender cannot build now (``ctx`` before its kernels load; a sharded or CUDA state) is
        left out; the first of ``encodings`` it can build is always there.
        :meth:`encoding_statistics` says what each cost. Same checks and chain rules as :meth:`sync`."""
        version = self._check_next(version)
        if self._snapshot is None or not self._is_sender:
            raise RuntimeError("call init_sender (as the sender) before sync_encodings")
        return await self._build_encoded(state_dict, version, encodings)

    def _check_next(self, version: int) -> int:
        """``version`` as the next one to build: an int64 above the last, on an unbroken chain."""
        version = check_version(version)
        if self._chain_broken is not None:
            raise PatchChainError(f"cannot build patch {version}: {self._chain_broken}; call init_sender again to "
                                  "re-bootstrap the receiver", expected_base=self._last_version, receiver_version=None)
        if self._last_version is not None and version <= self._last_version:
            raise VersionError(f"version {version} is not greater than the last synced version {self._last_version}")
        return version

    def encoding_statistics(self) -> dict[str, SyncStatistics]:
        """Per encoding, what the last :meth:`sync_encodings` (or :meth:`sync`) built: bytes,
        changed elements, and the seconds its diff and coding took."""
        return dict(self._by_encoding)

    async def _build_encoded(self, state_dict, version: int, encodings: tuple[str, ...]) -> dict[str, Any]:
        from .encodings import build_encoded

        return await build_encoded(self, state_dict, version, encodings)

    def plain_encoding(self) -> str:
        """The encoding of a patch built by :meth:`sync`: the configured one; ``ctx`` is ``flat``
        until the ``ctx`` kernels are ready (the torch paths have no ``ctx`` coder); ``auto`` is
        ``flat`` (a fan-out picks per link: :meth:`sync_encodings`)."""
        enc = self.config.encoding
        if enc == "auto" or (enc == "ctx" and not self.ctx_ready()):
            return "flat"
        return enc

    def ctx_ready(self) -> bool:
        """Whether this sender can build ``ctx`` patches now (its kernels are loaded)."""
        return kernels_ready(self._widths, ctx=True)

    def request_ctx(self) -> None:
        """Ask for the ``ctx`` kernels (loaded in the background; see :meth:`ctx_ready`)."""
        request_kernels(self._widths, ctx=True)

    def ctx_builder(self):
        """The ``ctx`` statistics over the snapshot (made on first use, in a worker thread)."""
        if self._ctx is None:
            from .ctx.encode import CtxBuilder  # numba: imported when used, never at ``import aiosync``

            self._ctx = CtxBuilder(self._snapshot, self._layouts)
        return self._ctx

    def _build(self, state_dict, encoding: str):
        snap = self._snapshot
        if encoding != "ctx":
            self._ctx = None  # its statistics would miss this build's changes: made afresh when next used
        else:
            self.ctx_builder()  # from the snapshot before this build moves it on
        if not any(is_dtensor(state_dict[k]) for k in self._slot_keys):
            tensors = [materialize(state_dict[k]) for k in self._slot_keys]  # plain: detached, views resolved
            if self._fused_cpu(tensors, encoding):
                return snap.diff_flat(tensors) if encoding == "flat" else self.ctx_builder().build(tensors)
            return self._as_ctx(snap.diff(tensors, self._transport_device), encoding)
        # DTensors: gather a bounded group at a time so the sender never holds the full model twice.
        # Gather in state-dict order, every synced key (as the other ranks do; see _take_snapshot).
        diffs, group, used = [], [], 0
        limit = self.config.init_sync.bucket_size
        slot_of = {k: i for i, k in enumerate(self._slot_keys)}
        for n, key in enumerate(self._names):
            t = materialize(state_dict[key])
            if key in slot_of:
                group.append((slot_of[key], t))
                used += t.numel() * t.element_size()
            if group and (used >= limit or n == len(self._names) - 1):
                diffs += self._as_ctx(snap.diff([t for _, t in group], self._transport_device,
                                                slots=[s for s, _ in group]), encoding)
                group, used = [], 0
        diffs.sort(key=lambda d: d.slot)
        return diffs

    def _as_ctx(self, diffs, encoding: str):
        """The torch builder's diffs as ``ctx`` records (when that is the encoding)."""
        if encoding != "ctx" or not diffs:
            return diffs
        if self._snapshot.staged_event is not None:
            self._snapshot.staged_event.synchronize()
        from .ctx.encode import diffs_from_tensor_diffs

        return diffs_from_tensor_diffs(self.ctx_builder(), diffs)

    def _fused_cpu(self, tensors: list[torch.Tensor], encoding: str) -> bool:
        """Whether the CPU fast path (diff and encoding in one pass, numba) applies: its kernels
        are loaded (until then the torch builder serves, bit for bit the same patch)."""
        return (encoding in ("flat", "ctx") and self._builder_kernel == "auto"
                and self._transport_device.type == "cpu" and self._snapshot.device.type == "cpu"
                and not any(t.is_cuda for t in tensors) and kernels_ready(self._widths, encoding == "ctx"))

    def _encode(self, diffs, version: int, base: int | None, encoding: str):
        if diffs and isinstance(diffs[0], FlatDiff):
            patch = assemble_flat_patch(diffs, self._layouts, version=version, base_version=base)
        elif encoding == "ctx":
            from .ctx.encode import assemble_ctx_patch

            patch = assemble_ctx_patch(diffs, self._layouts, version=version, base_version=base,
                                       pool=self._snapshot.pool())
        else:
            patch = encode_patch(diffs, self._layouts, version=version, base_version=base,
                                 encoding=encoding, delta_encoding=self.config.delta_encoding)
        patch.session = self._session
        if isinstance(patch, WeightPatch) and self.config.verify_checksums:
            # the result the receiver must hold: the snapshot of each touched tensor
            patch.checksums = checksum_tensor([tensor_checksum(self._snapshot.tensor(d.slot)) for d in diffs])
        # auto: ctx patches are entropy-coded already (compressing them again only costs time)
        if isinstance(patch, WeightPatch) and self.config.compression != "none" and not (
                encoding == "ctx" and self.config.encoding == "auto"):
            return compress_patch(patch, self.config.compression, self._elem_sizes, self.config.compression_level)
        return patch

    # ============================================================== receiver
    async def init_receiver(self, state_dict: Mapping[str, torch.Tensor], recv: RecvFn,
                            send: SendFn | None = None) -> None:
        """Send this model's metadata (W7); write the bootstrap if the sender sends one (W8).

        :meth:`stage_init` and writing its bootstrap at once; a bootstrap is written only once
        every bucket arrived and passed (a broken-off stream writes nothing)."""
        await self.stage_init(state_dict, recv, send)
        await self._write_staged(state_dict, None, rollback=False, generation=self._generation,
                                 pending=self._pending)

    async def stage_init(self, state_dict: Mapping[str, torch.Tensor], recv: RecvFn,
                         send: SendFn | None = None) -> None:
        """The init conversation of :meth:`init_receiver` without writing: metadata out, answer
        in, the bootstrap received, validated and planned against ``state_dict`` (read only). The
        next staged write writes the bootstrap with its patch, all-or-nothing; until then this
        receiver keeps its committed version, session and layouts."""
        if send is None:
            raise ValueError("patch mode's init_receiver needs `send` to send its metadata to the sender")
        t0 = time.perf_counter()
        check_no_reserved_keys(state_dict.keys())
        self._pending = None
        self._generation += 1  # staged writes of the previous handshake are void
        request_kernels(widths_of(state_dict.values()), self.config.encoding in ("ctx", "auto"))
        meta = await run_sync(receiver_metadata, state_dict, new_session())
        await send(meta)
        hello = await recv_with_timeout(recv, self.config.recv_timeout, "the sender's answer to our metadata")
        check_hello(hello, len(meta.ordered_keys), meta.session)
        # A sender that does not echo the session (hand-made hellos) opts out of the check.
        session = meta.session if hello.session is not None else None
        shards = () if hello.shards is None else receiver_shards(state_dict, meta, hello.shards, session)
        plan, nbytes = None, 0
        if hello.init_sync:
            plan, nbytes = await self._receive_bootstrap(state_dict, recv, session, shards)
        layouts = {} if shards else receiver_layouts(state_dict, meta.ordered_keys, hello.synced_ordinals)
        rx = ReceiverState(meta.ordered_keys, layouts, session, shards)
        self._pending = _PendingInit(rx, plan, nbytes, time.perf_counter() - t0)
        self._generation += 1

    async def _receive_bootstrap(self, state_dict, recv: RecvFn, session: int | None, shards: tuple = (), plan=None):
        # The first bucket's manifest is checked against the whole model (a shard's: its rows) before
        # anything is planned; each bucket is validated, planned (compared with the model), then what the
        # plan did not keep of it given back off the loop. A sharded sender's shards come one after another.
        if shards:  # a remote target's: whole tensors assembled from the shards' rows (sharded_plan)
            parts, nbytes, whole = [], 0, sharded_plan(state_dict)
            for shard in shards:
                if shard.init_sync:
                    plan, n = await self._receive_bootstrap(shard_views(state_dict, shard.rows), recv, session,
                                                            plan=None if whole is None else whole.rows(shard.rows))
                    parts.append((shard.rows, plan))
                    nbytes += n
            return (ShardedWrite(parts) if whole is None else whole.finish()), nbytes
        reader = BucketReader(state_dict, versioned=False, session=session,
                              require_checksum=self.config.verify_checksums)
        plan, nbytes = tensor_plan(state_dict) if plan is None else plan, 0
        while not reader.done:
            box = [await recv_with_timeout(recv, self.config.recv_timeout, "a bootstrap bucket")]
            await run_sync(plan.add, state_dict, await run_sync(reader.read, box[0]))
            nbytes += payload_nbytes(box[0])
            await release_if_only_here(box)
        return plan, nbytes

    async def apply(self, model: torch.nn.Module | Mapping[str, torch.Tensor], recv: RecvFn) -> int:
        """Receive one patch, validate it whole, write it in place; return its version.

        Raises :class:`PatchChainError` when the patch was built on another base version,
        :class:`VersionError` when its version does not advance, :class:`DriftError` when this
        receiver's old values at the changed positions are not the sender's,
        :class:`PayloadError` when it is malformed. In every case nothing was written.
        """
        staged = await self.stage(model, recv)
        return await staged.write(model)

    async def apply_payload(self, model, payload: Any) -> int:
        """Apply an already received patch payload (see :meth:`apply`)."""
        staged = await self.stage_payload(model, payload)
        return await staged.write(model)

    async def stage(self, model: torch.nn.Module | Mapping[str, torch.Tensor], recv: RecvFn) -> StagedWrite:
        """Receive one patch and validate it without writing (see :meth:`WeightSyncer.stage`)."""
        payload = await recv_with_timeout(recv, self.config.recv_timeout, "a weight patch")
        return await self.stage_payload(model, payload)

    async def stage_payload(self, model, payload: Any) -> StagedWrite:
        """:meth:`stage` for an already received payload."""
        t0 = time.perf_counter()
        target = module_state_dict(model)
        pending, generation = self._pending, self._generation
        prepared = await stage_patch(self, target, payload, pending)  # a RemoteTarget: only the header is checked
        stage_s = time.perf_counter() - t0 + (pending.stage_s if pending is not None else 0.0)
        boot = pending.plan if pending is not None and pending.plan is not None else None
        held = held_bytes([payload, prepared]) + (boot.nbytes if boot is not None else 0)

        async def write(model, rollback: bool = True) -> int:
            return await self._write_staged(model, prepared, rollback=rollback, generation=generation,
                                            pending=pending, stage_s=stage_s, held=held)

        return StagedWrite(prepared.version, write,
                           nbytes=prepared.nbytes + (pending.nbytes if pending is not None else 0),
                           changed=prepared.changed + (boot.changed if boot is not None else 0), stage_s=stage_s)

    async def _write_staged(self, model, prepared: PreparedPatch | None, *, rollback: bool, generation: int,
                            pending: _PendingInit | None, stage_s: float | None = None, held: int = 0) -> int | None:
        """Write a staged bootstrap and/or patch as one all-or-nothing step, then commit."""
        if generation != self._generation or pending is not self._pending:
            raise PatchChainError("this staged write was staged against an earlier state of the receiver (another "
                                  "write or handshake came first); stage again. Nothing was written",
                                  expected_base=None, receiver_version=self.version)
        target = module_state_dict(model)
        rx = pending.rx if pending is not None else self._rx
        t0 = time.perf_counter()
        if isinstance(target, RemoteTarget):
            return await write_remote(self, target, prepared, pending, stage_s, held)
        # Written and committed as one step: a cancellation arriving while the worker thread
        # writes (it cannot be interrupted) must not leave new weights under the old version.
        with anyio.CancelScope(shield=True):
            changed, keys, journal, undo = await run_sync(self._write_sync, target, rx, pending, prepared, rollback)
            new_version = prepared.version if prepared is not None else None
            await commit_write(model, keys, new_version, journal)  # an engine behind the model (CommitTarget)
            if pending is not None:
                self._rx, self._pending = pending.rx, None
            version = self.version = new_version
            self._generation += 1
            await written(journal, pending.plan if pending is not None else None)
        write_s = time.perf_counter() - t0
        stage_s = pending.stage_s if stage_s is None and pending is not None else (stage_s or 0.0)
        nbytes = (prepared.nbytes if prepared is not None else 0) + (pending.nbytes if pending is not None else 0)
        self._statistics = SyncStatistics(version=version, bytes=nbytes, changed=changed, stage_s=stage_s,
                                          write_s=write_s, apply_s=stage_s + write_s, peak_bytes=held + undo)
        return version

    def _write_sync(self, target, rx: ReceiverState, pending: _PendingInit | None, prepared: PreparedPatch | None,
                    rollback: bool) -> tuple[int, list[str], Journal | None, int]:
        """The exclusive part (a worker thread): bootstrap, then patch; undone whole on failure.
        Returns the elements and the keys written, the journal that undoes them, and the bytes of
        old values kept meanwhile (the undo)."""
        journal = Journal() if rollback else None
        try:
            changed, keys, undo = 0, [], 0
            if pending is not None and pending.plan is not None:
                pending.plan.check(target)
                changed += pending.plan.write(target, journal, self.after_each_write)
                keys += pending.plan.written_keys
                undo += journal.nbytes if journal is not None else 0
            if prepared is not None and (prepared.decoded or prepared.deferred is not None or prepared.parts):
                complete_patch(prepared, rx, target)
                changed += write_patch(target, prepared, rx.layouts, journal, self.after_each_write)
                keys += prepared.written_keys
                undo += _old_bytes(prepared, rx.layouts)
            return changed, list(dict.fromkeys(keys)), journal, undo
        except BaseException as exc:
            if journal is not None:
                journal.rollback()
            if isinstance(exc, AiosyncError) or not isinstance(exc, Exception):
                raise
            undone = "was rolled back" if journal is not None else "may have left part of it written (rollback=False)"
            raise ApplyError(f"writing the patch failed and {undone}: {exc}") from exc



def _old_bytes(prepared: PreparedPatch, layouts: dict) -> int:
    """Bytes of the old values a patch's write keeps (its undo): one element per change."""
    own = sum(d.count * layouts[d.ordinal].elem_size for d in prepared.decoded if d.ordinal in layouts)
    return own + sum(_old_bytes(part, lays) for _, part, lays in prepared.parts)
