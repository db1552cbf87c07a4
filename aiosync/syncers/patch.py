"""Patch mode (W6-W15, W17, B1, B2): send only the elements that changed.

The sender keeps a snapshot of the synced tensors in the *receiver's* dtypes. Each sync
diffs the current weights against it bit for bit, encodes the changed positions and values,
optionally compresses them, and advances the snapshot. The receiver validates the whole
patch, then writes it in place; if a write fails, the written part is rolled back.

Patch-chain integrity (B3): every patch names the version it was built on and the handshake
(session) it belongs to; a receiver holding another version, or belonging to another
handshake, refuses it before writing anything. With ``verify_checksums`` the patch also
carries a CRC-32 of every tensor it touches as the sender's snapshot holds it afterwards; the
receiver checks the tensors it wrote and rolls the whole patch back on a mismatch.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import anyio
import torch

from ..aio import run_sync, wait_event
from ..errors import (AiosyncError, ApplyError, ChecksumError, ConfigError, HandshakeError, PatchChainError,
                      PayloadError, VersionError)
from ..transports.base import RecvFn, SendFn, payload_nbytes
from .base import WeightSyncer, recv_with_timeout
from .bucket import (BucketReader, bucket_manifest, check_no_reserved_keys, check_version,
                     iter_named_tensor_buckets, load_into, seal_bucket)
from .codecs import check_codec_available, compress_patch, decompress_patch
from .config import InitSyncConfig, PatchConfig
from .indexing import as_coo_2d_view, coo_2d_shape
from .integrity import checksum_tensor, new_session, read_checksums, tensor_checksum
from .patch_format import DecodedTensor, TensorLayout, assemble_flat_patch, decode_patch, encode_patch
from .payloads import CompressedWeightPatch, EmptyWeightPatch, ReceiverMetadata, SenderHello, WeightPatch
from .selection import alias_groups, is_dtensor, match_prefixes, materialize, module_state_dict, select_sync_names
from .snapshot import FlatDiff, Snapshot, as_bits

def _dtype_from_str(name: str) -> torch.dtype:
    dt = getattr(torch, str(name).removeprefix("torch."), None) if isinstance(name, str) else None
    if not isinstance(dt, torch.dtype):
        raise HandshakeError(f"unknown dtype {name!r} in receiver metadata")
    return dt


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _check_metadata(meta: ReceiverMetadata) -> None:
    """Structure of the receiver's metadata: anything malformed is a :class:`HandshakeError`."""
    keys, shapes, dtypes = meta.ordered_keys, meta.original_shapes, meta.dtypes
    if not all(isinstance(x, (list, tuple)) for x in (keys, shapes, dtypes)):
        raise HandshakeError("receiver metadata is malformed: keys, shapes and dtypes must be lists")
    if len(shapes) != len(keys) or len(dtypes) != len(keys):
        raise HandshakeError("receiver metadata is inconsistent: keys, shapes and dtypes differ in length")
    if not all(isinstance(k, str) for k in keys) or len(set(keys)) != len(keys):
        raise HandshakeError("receiver metadata is malformed: keys must be distinct strings")
    for k, shape in zip(keys, shapes):
        if not isinstance(shape, (list, tuple, torch.Size)) or not all(_is_int(d) and d >= 0 for d in shape):
            raise HandshakeError(f"receiver metadata gives {k!r} the malformed shape {shape!r}")
    for d in dtypes:
        _dtype_from_str(d)
    if not isinstance(meta.aliases, dict) or not all(
            isinstance(a, str) and isinstance(b, str) and a in keys and b in keys for a, b in meta.aliases.items()):
        raise HandshakeError("receiver metadata is malformed: aliases must map keys to keys")
    viewable = meta.viewable
    if not isinstance(viewable, (list, tuple)) or (viewable and len(viewable) != len(keys)) or not all(
            isinstance(v, bool) for v in viewable):
        raise HandshakeError("receiver metadata is malformed: viewable must be empty or one bool per key")
    if meta.session is not None and not _is_int(meta.session):
        raise HandshakeError(f"receiver metadata has a malformed session {meta.session!r}")


def _check_hello(hello: SenderHello, n_keys: int, session: int | None) -> None:
    """Structure of the sender's answer: anything malformed is a :class:`HandshakeError`."""
    if not isinstance(hello.ok, bool) or not isinstance(hello.init_sync, bool):
        raise HandshakeError("the sender's answer is malformed: ok and init_sync must be bools")
    if not hello.ok:
        return
    if hello.session is not None and hello.session != session:
        raise HandshakeError("the sender's answer belongs to another handshake (a stale or duplicated message)")
    ords = hello.synced_ordinals
    if not isinstance(ords, (list, tuple)) or not all(_is_int(o) and 0 <= o < n_keys for o in ords):
        raise HandshakeError(f"the sender's answer names synced ordinals outside [0, {n_keys})")
    if any(b <= a for a, b in zip(ords, ords[1:])):
        raise HandshakeError("the sender's answer lists synced ordinals that are not strictly increasing")


def _same_kind(a: torch.dtype, b: torch.dtype) -> bool:
    """Floating ↔ floating casts are allowed; integer and bool tensors must match exactly."""
    fa, fb = a.is_floating_point, b.is_floating_point
    return (fa and fb) or a == b


class PatchWeightSyncer(WeightSyncer):
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
    wrote and rolls back on a mismatch; off by default and free when off).
    """

    supports_no_wait = True
    payloads_per_sync = 1
    #: Keep the old bits of every write so that a failure after some tensors were written can
    #: be rolled back even on the numba fast path (always done when a patch carries checksums).
    journal_writes = False

    def __init__(self, snapshot_device: str = "cpu", transport_device: str | None = None,
                 delta_encoding: bool = True, compression: str = "none", init_sync_enabled: bool = False,
                 init_sync_prefixes: list[str] | None = None, init_sync_bucket_size: int = 134217728, *,
                 encoding: str = "coo", compression_level: int = 3, recv_timeout: float | None = 600.0,
                 builder_kernel: str = "auto", verify_checksums: bool = False, **comm: Any) -> None:
        super().__init__(**comm)
        self.config = PatchConfig(
            snapshot_device=snapshot_device, transport_device=transport_device, delta_encoding=delta_encoding,
            compression=compression, encoding=encoding, compression_level=compression_level,
            recv_timeout=recv_timeout, verify_checksums=verify_checksums,
            init_sync=InitSyncConfig(enabled=init_sync_enabled, prefixes=init_sync_prefixes,
                                     bucket_size=init_sync_bucket_size),
        )
        check_codec_available(compression)  # fail when built, not at the first sync (W12)
        if str(snapshot_device).startswith("cuda") and not torch.cuda.is_available():
            raise ConfigError("patch.snapshot_device is cuda but CUDA is not available; use snapshot_device: cpu")
        self._transport_device = torch.device(transport_device or "cpu")
        self._builder_kernel = builder_kernel
        # sender state
        self._snapshot: Snapshot | None = None
        self._slot_keys: list[str] = []
        self._names: list[str] = []  # synced keys in the sender's state-dict order (W17 collective order)
        self._layouts: list[TensorLayout] = []
        self._elem_sizes: dict[int, int] = {}
        self._is_sender = True
        self._last_version: int | None = None
        self._chain_broken: str | None = None  # why the snapshot is out of step (a failed build)
        self._bootstrap_keys: list[str] = []
        self._session: int | None = None  # the handshake's id (both sides)
        # receiver state
        self._recv_keys: list[str] = []
        self._recv_layouts: dict[int, TensorLayout] = {}
        self.version: int | None = None

    @classmethod
    def from_config(cls, cfg: PatchConfig, **comm: Any) -> "PatchWeightSyncer":
        return cls(snapshot_device=cfg.snapshot_device, transport_device=cfg.transport_device,
                   delta_encoding=cfg.delta_encoding, compression=cfg.compression,
                   init_sync_enabled=cfg.init_sync.enabled, init_sync_prefixes=cfg.init_sync.prefixes,
                   init_sync_bucket_size=cfg.init_sync.bucket_size, encoding=cfg.encoding,
                   compression_level=cfg.compression_level, recv_timeout=cfg.recv_timeout,
                   verify_checksums=cfg.verify_checksums, **comm)

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
        await run_sync(_warm_up_kernels, [state_dict[k] for k in names])
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
            _check_metadata(meta)
            slots, dtypes = self._plan(state_dict, names, boot, meta)
        except HandshakeError as exc:
            session = getattr(meta, "session", None)
            await send(SenderHello(ok=False, error=str(exc), session=session if _is_int(session) else None))
            raise
        self._session = meta.session
        ordinal = {k: i for i, k in enumerate(meta.ordered_keys)}
        await send(SenderHello(ok=True, init_sync=bool(boot), synced_ordinals=[ordinal[k] for k in slots],
                               session=meta.session))
        if boot:
            await self._bootstrap(state_dict, boot, meta, send)
        self._slot_keys = slots
        self._layouts = []
        for k in slots:
            rows, cols = coo_2d_shape(meta.original_shapes[ordinal[k]])
            esize = torch.empty((), dtype=dtypes[k]).element_size()
            self._layouts.append(TensorLayout(ordinal[k], rows, cols, esize))
        self._elem_sizes = {lay.ordinal: lay.elem_size for lay in self._layouts}
        snapshot = Snapshot(self.config.snapshot_device, kernel=self._builder_kernel)
        await run_sync(self._take_snapshot, snapshot, state_dict, [dtypes[k] for k in slots])
        if self._snapshot is not None:
            self._snapshot.close()
        self._snapshot = snapshot
        self._last_version = None
        self._chain_broken = None

    def _plan(self, state_dict, names: list[str], boot: list[str], meta: ReceiverMetadata):
        """Check keys, shapes and dtypes; order the synced keys by receiver ordinal, one per alias group."""
        ordinal = {k: i for i, k in enumerate(meta.ordered_keys)}
        recv_dtypes = {k: _dtype_from_str(d) for k, d in zip(meta.ordered_keys, meta.dtypes)}
        viewable = dict(zip(meta.ordered_keys, meta.viewable)) if meta.viewable else {}
        for key in list(dict.fromkeys(names + boot)):
            if key not in ordinal:
                raise HandshakeError(f"sender key {key!r} is missing on the receiver")
            want = tuple(meta.original_shapes[ordinal[key]])
            have = tuple(state_dict[key].shape)
            if want != have:
                raise HandshakeError(f"shape mismatch for {key!r}: sender {have}, receiver {want}")
            if not _same_kind(state_dict[key].dtype, recv_dtypes[key]):
                raise HandshakeError(
                    f"dtype mismatch for {key!r}: sender {state_dict[key].dtype}, receiver {recv_dtypes[key]} "
                    "(only floating-point tensors may change dtype)")
        for key in names:
            if viewable and not viewable.get(key, True):
                raise HandshakeError(
                    f"receiver tensor {key!r} of shape {tuple(meta.original_shapes[ordinal[key]])} cannot be viewed "
                    "as 2-D without a copy, so patch mode cannot write it; make it contiguous or use bucket mode")
        canonical = {k: meta.aliases.get(k, k) for k in names}
        seen: set[str] = set()
        slots = []
        for key in sorted(names, key=ordinal.__getitem__):
            if canonical[key] in seen:
                continue
            seen.add(canonical[key])
            slots.append(key)
        return slots, recv_dtypes

    async def _bootstrap(self, state_dict, keys: list[str], meta: ReceiverMetadata, send: SendFn) -> None:
        dtypes = {k: _dtype_from_str(d) for k, d in zip(meta.ordered_keys, meta.dtypes)}
        sized = ((k, torch.empty(state_dict[k].shape, dtype=dtypes[k], device="meta")) for k in keys)
        buckets = list(iter_named_tensor_buckets(sized, self.config.init_sync.bucket_size))

        manifest = bucket_manifest(buckets)
        checksum = self.config.verify_checksums

        def build(i, bucket):
            tensors = {k: materialize(state_dict[k]).to(device=self._transport_device, dtype=dtypes[k])
                       for k, _ in bucket}
            return seal_bucket(tensors, index=i, count=len(buckets), manifest=manifest if i == 0 else None,
                               session=meta.session, checksum=checksum)

        for i, bucket in enumerate(buckets):
            payload = await run_sync(build, i, bucket)
            await send(payload)

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
        version = check_version(version)
        if self._chain_broken is not None:
            raise PatchChainError(f"cannot build patch {version}: {self._chain_broken}; call init_sender again to "
                                  "re-bootstrap the receiver", expected_base=self._last_version, receiver_version=None)
        if self._last_version is not None and version <= self._last_version:
            raise VersionError(f"version {version} is not greater than the last synced version {self._last_version}")
        if not self._is_sender:
            for key in self._slot_keys:
                await run_sync(materialize, state_dict[key])
            self._last_version = version
            return
        if self._snapshot is None:
            raise RuntimeError("call init_sender before sync")
        missing = [k for k in self._slot_keys if k not in state_dict]
        if missing:
            raise HandshakeError(f"state dict passed to sync lacks synced key {missing[0]!r}")
        t0 = time.perf_counter()
        base = self._last_version
        built: list = []

        def build():
            out = self._build(state_dict)
            built.append(True)
            return out

        try:
            diffs = await run_sync(build)
        finally:
            if built:  # the snapshot holds `version` now, whatever happens to this patch
                self._last_version = version
            else:
                self._chain_broken = f"building patch {version} failed half way, the sender's snapshot is out of step"
        if self._snapshot.staged_event is not None:
            await wait_event(self._snapshot.staged_event, timeout=self.config.recv_timeout)
        t1 = time.perf_counter()
        patch = await run_sync(self._encode, diffs, version, base)
        t2 = time.perf_counter()
        await send(patch)
        t3 = time.perf_counter()
        changed = sum(d.nnz for d in diffs)  # TensorDiff and FlatDiff both count changes
        nbytes = payload_nbytes(patch)
        self.last_stats = {
            "version": version, "bytes": nbytes, "changed": changed,
            "elements": sum(lay.numel for lay in self._layouts),
            "bytes_per_changed": nbytes / changed if changed else 0.0,
            "build_s": t1 - t0, "encode_s": t2 - t1, "send_s": t3 - t2,
        }
        self._last_version = version

    def _build(self, state_dict):
        snap = self._snapshot
        if not any(is_dtensor(state_dict[k]) for k in self._slot_keys):
            tensors = [state_dict[k].detach() for k in self._slot_keys]
            if self._fused_flat(tensors):
                return snap.diff_flat(tensors)
            return snap.diff(tensors, self._transport_device)
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
                diffs += snap.diff([t for _, t in group], self._transport_device, slots=[s for s, _ in group])
                group, used = [], 0
        diffs.sort(key=lambda d: d.slot)
        return diffs

    def _fused_flat(self, tensors: list[torch.Tensor]) -> bool:
        """Whether the CPU fast path (diff and flat encoding in one pass) applies."""
        return (self.config.encoding == "flat" and self._builder_kernel == "auto"
                and self._transport_device.type == "cpu" and self._snapshot.device.type == "cpu"
                and not any(t.is_cuda for t in tensors))

    def _encode(self, diffs, version: int, base: int | None):
        if diffs and isinstance(diffs[0], FlatDiff):
            patch = assemble_flat_patch(diffs, self._layouts, version=version, base_version=base)
        else:
            patch = encode_patch(diffs, self._layouts, version=version, base_version=base,
                                 encoding=self.config.encoding, delta_encoding=self.config.delta_encoding)
        patch.session = self._session
        if isinstance(patch, WeightPatch) and self.config.verify_checksums:
            # the result the receiver must hold: the snapshot of each touched tensor
            patch.checksums = checksum_tensor([tensor_checksum(self._snapshot.tensor(d.slot)) for d in diffs])
        if isinstance(patch, WeightPatch) and self.config.compression != "none":
            return compress_patch(patch, self.config.compression, self._elem_sizes, self.config.compression_level)
        return patch

    # ============================================================== receiver
    async def init_receiver(self, state_dict: Mapping[str, torch.Tensor], recv: RecvFn,
                            send: SendFn | None = None) -> None:
        """Send this model's metadata (W7); apply the bootstrap if the sender sends one (W8)."""
        if send is None:
            raise ValueError("patch mode's init_receiver needs `send` to send its metadata to the sender")
        check_no_reserved_keys(state_dict.keys())
        keys = list(state_dict.keys())
        await run_sync(_warm_up_kernels, list(state_dict.values()))
        viewable = []
        for k in keys:
            try:
                as_coo_2d_view(state_dict[k], k)
                viewable.append(True)
            except ValueError:
                viewable.append(False)
        session = new_session()
        meta = ReceiverMetadata(
            ordered_keys=keys, original_shapes=[tuple(state_dict[k].shape) for k in keys],
            dtypes=[str(state_dict[k].dtype).removeprefix("torch.") for k in keys],
            aliases=alias_groups(state_dict), viewable=viewable, session=session,
        )
        self._session = None  # until the handshake succeeded, no patch is accepted
        self._recv_layouts = {}
        self.version = None
        await send(meta)
        hello = await recv_with_timeout(recv, self.config.recv_timeout, "the sender's answer to our metadata")
        if not isinstance(hello, SenderHello):
            raise HandshakeError(f"expected SenderHello from the sender, got {type(hello).__name__}")
        _check_hello(hello, len(keys), session)
        if not hello.ok:
            raise HandshakeError(f"the sender refused this receiver: {hello.error}")
        # A sender that does not echo the session (hand-made hellos) opts out of the check.
        session = session if hello.session is not None else None
        if hello.init_sync:
            await self._receive_bootstrap(state_dict, recv, session)
        self._recv_keys = keys
        self._recv_layouts = {}
        for o in hello.synced_ordinals:
            t = state_dict[keys[o]]
            rows, cols = coo_2d_shape(t.shape)
            self._recv_layouts[o] = TensorLayout(o, rows, cols, t.element_size())
        self.version = None
        self._session = session

    async def _receive_bootstrap(self, state_dict, recv: RecvFn, session: int | None) -> None:
        # The first bucket's manifest is checked against the whole model before anything is
        # loaded; a stream that breaks off later leaves the earlier buckets loaded (a
        # PolicySlot's backup restores them when applied through a synchronizer).
        reader = BucketReader(state_dict, versioned=False, session=session,
                              require_checksum=self.config.verify_checksums)
        while not reader.done:
            payload = await recv_with_timeout(recv, self.config.recv_timeout, "a bootstrap bucket")
            tensors = await run_sync(reader.read, payload)
            await run_sync(load_into, state_dict, tensors)

    async def apply(self, model: torch.nn.Module | Mapping[str, torch.Tensor], recv: RecvFn) -> int:
        """Receive one patch, validate it whole, write it in place; return its version.

        Raises :class:`PatchChainError` when the patch was built on another base version,
        :class:`VersionError` when its version does not advance, :class:`PayloadError` when it
        is malformed. In every case nothing was written.
        """
        payload = await recv_with_timeout(recv, self.config.recv_timeout, "a weight patch")
        return await self.apply_payload(model, payload)

    async def apply_payload(self, model, payload: Any) -> int:
        """Apply an already received patch payload (see :meth:`apply`)."""
        t0 = time.perf_counter()
        if not isinstance(payload, (WeightPatch, CompressedWeightPatch, EmptyWeightPatch)):
            raise PayloadError(f"expected a weight patch, got {type(payload).__name__}")
        version = payload.version
        check_version(version)
        if self.version is not None and version <= self.version:
            raise VersionError(f"patch version {version} does not advance the applied version {self.version}")
        base = payload.base_version
        if base is not None and not _is_int(base):
            raise PayloadError(f"patch {version} has a malformed base_version {base!r}")
        if base != self.version:
            raise PatchChainError(
                f"patch {version} was built on version {base}, but this receiver holds {self.version}",
                expected_base=base, receiver_version=self.version)
        if self._session is not None and (not _is_int(payload.session) or payload.session != self._session):
            raise PayloadError(f"patch {version} belongs to another handshake (a stale or duplicated payload); "
                               "refused, nothing was written")
        changed = 0
        if not isinstance(payload, EmptyWeightPatch):
            target = module_state_dict(model)
            # Validated, written and committed as one step: a cancellation arriving while the
            # worker thread runs (it cannot be interrupted) must not leave new weights under
            # the old version. Validation fails before anything is written.
            with anyio.CancelScope(shield=True):
                changed = await run_sync(self._apply_patch, target, payload)
                self.version = version
        self.version = version
        self.last_stats = {"version": version, "bytes": payload_nbytes(payload), "changed": changed,
                           "apply_s": time.perf_counter() - t0}
        return version

    def _decode(self, target: Mapping[str, torch.Tensor], payload):
        """Validate ``payload`` whole against this receiver; returns what :meth:`_write` needs.

        Everything malformed raises :class:`PayloadError` (never another exception type), and
        nothing is written.
        """
        try:
            elem_sizes = {o: lay.elem_size for o, lay in self._recv_layouts.items()}
            if isinstance(payload, CompressedWeightPatch):
                payload = decompress_patch(payload, elem_sizes)
            decoded = decode_patch(payload, self._recv_layouts)
            checksums = None
            if payload.checksums is not None:
                checksums = read_checksums(payload.checksums, len(decoded), f"patch {payload.version}")
            elif self.config.verify_checksums:
                raise PayloadError(f"patch {payload.version} carries no checksums but verify_checksums is on")
            tensors = []
            for d in decoded:
                key = self._recv_keys[d.ordinal]
                t = target[key]
                lay = self._recv_layouts[d.ordinal]
                if tuple(coo_2d_shape(t.shape)) != (lay.rows, lay.cols) or t.element_size() != lay.elem_size:
                    raise PayloadError(f"receiver tensor {key!r} changed shape or dtype since init_receiver")
                tensors.append(t)
        except AiosyncError:
            raise
        except Exception as exc:  # garbage that slipped past the checks: still the library's error
            raise PayloadError(f"malformed patch: {type(exc).__name__}: {exc}") from exc
        return decoded, tensors, checksums

    def _apply_patch(self, target: Mapping[str, torch.Tensor], payload) -> int:
        """Validate and write ``payload`` (both steps, in the calling thread)."""
        return self._write(target, self._decode(target, payload))

    def _write(self, target: Mapping[str, torch.Tensor], prepared) -> int:
        """Write a validated patch; on any failure (including a checksum mismatch) roll back
        everything written and raise. Without checksums or ``journal_writes`` the numba fast
        path keeps no old values: once validated, its writes cannot fail."""
        decoded, tensors, checksums = prepared
        fast = [d.is_delta and t.device.type == "cpu" and t.is_contiguous() and not d.payload.is_cuda
                for d, t in zip(decoded, tensors)]
        journal = [] if (checksums is not None or self.journal_writes) else None
        done: list = []  # torch-path writes: (view, index, old bits)
        try:
            self._write_tensors(decoded, tensors, fast, done, journal)
            if checksums is not None:
                for d, t, want in zip(decoded, tensors, checksums):
                    if tensor_checksum(t) != want:
                        raise ChecksumError(
                            f"tensor {self._recv_keys[d.ordinal]!r} does not match the sender's checksum after "
                            "applying the patch (corrupted in transit, or this receiver's weights had drifted); "
                            "the patch was rolled back")
        except BaseException as exc:  # roll back what was written
            with torch.no_grad():
                for view, index, old in reversed(done):
                    view[index] = old
                for flat, positions, old in reversed(journal or []):
                    flat[positions] = old
            if isinstance(exc, ChecksumError) or not isinstance(exc, Exception):
                raise
            raise ApplyError(f"writing the patch failed and was rolled back: {exc}") from exc
        return sum(d.count for d in decoded)

    def _write_tensors(self, decoded, tensors, fast, done: list, journal: list | None) -> None:
        """Write every tensor: fallible torch writes first (recorded in ``done``), then the
        numba writes (recorded in ``journal`` when it is not ``None``)."""
        with torch.no_grad():
            for d, t, f in zip(decoded, tensors, fast):
                if not f:
                    view, index, new, old = self._prepare(t, d)
                    view[index] = new
                    done.append((view, index, old))
        jobs = [(t, d) for d, t, f in zip(decoded, tensors, fast) if f]
        if journal is not None:
            for t, d in jobs:
                flat = as_bits(t).view(-1)
                journal.append((flat, d.positions, flat[d.positions].clone()))
        if len(jobs) > 1:
            from .patch_format import _codec_pool

            list(_codec_pool().map(lambda job: _apply_flat_cpu(*job), jobs))
        elif jobs:
            _apply_flat_cpu(*jobs[0])

    def _prepare(self, t: torch.Tensor, d: DecodedTensor):
        """Gather old bits and compute new bits for one tensor; writes nothing."""
        lay = self._recv_layouts[d.ordinal]
        pos = d.positions.to(t.device)
        if t.is_contiguous():
            view = as_bits(t).view(-1)
            index = pos
        else:
            view = as_bits(as_coo_2d_view(t, self._recv_keys[d.ordinal]))
            r = torch.div(pos, lay.cols, rounding_mode="floor")
            index = (r, pos - r * lay.cols)
        old = view[index]
        return view, index, d.new_bits(old), old


def _warm_up_kernels(tensors: list[torch.Tensor]) -> None:
    """Compile the numba kernels for these tensors' element widths during set-up."""
    from .kernels import warm_up

    warm_up(tuple(sorted({t.element_size() for t in tensors if t.element_size() in (1, 2, 4, 8)})))


def _apply_flat_cpu(t: torch.Tensor, d: DecodedTensor) -> None:
    """Numba fast path: write a validated flat patch into a contiguous CPU tensor."""
    from .kernels import apply_flat, apply_flat_gaps
    from .snapshot import _np_bits

    target = _np_bits(t.view(-1))
    if d.gaps is not None:  # positions straight from the validated gap stream
        apply_flat_gaps(target, d.gaps, d.gap_start, d.count, d.payload.numpy(), d.nib_off, d.exceptions.numpy(),
                        d.exc_off)
    else:
        apply_flat(target, d.positions.numpy(), d.payload.numpy(), d.nib_off, d.exceptions.numpy(), d.exc_off,
                   d.count)
