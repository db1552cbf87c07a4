"""The patch receiver's two halves (F3): :func:`prepare_patch` validates a received patch
outside the exclusive section (decompression and decoding included; the model is not
touched), :func:`write_patch` writes it inside.

A sharded sender's patch (:class:`~aiosync.syncers.common.payloads.ShardedPatch`, see
:mod:`aiosync.syncers.patch.shards`) is prepared shard by shard against views of the receiver's tensors on that
shard's rows, and written in one pass over every shard with one undo record
(:func:`prepare_patch` and :func:`write_patch` take both kinds).

The write is the minimum: one pass over the changed positions that writes the new bits and
keeps the old ones (the undo record, O(changed)) and their drift hash (``flat`` patches), then
the optional checksums. A tensor that fails its drift check, or any other failure inside the
write, undoes the whole patch before the error propagates: nothing of it stays written.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ...aio import finish_cuda_work
from ...errors import AiosyncError, ChecksumError, DriftError, PatchChainError, PayloadError, VersionError
from ...messages import payload_nbytes, unshare
from ..bucket.format import check_version
from .codecs import decompress_patch
from ..common.indexing import as_coo_2d_view, coo_2d_shape
from ..common.integrity import drift_hash, read_checksums, tensor_checksum
from .format import DecodedTensor, TensorLayout, _check_header, _int_tensor, decode_patch
from .handshake import is_int
from ..common.payloads import (CompressedWeightPatch, EmptyWeightPatch, ReceiverMetadata, ShardedPatch, ShardRef,
    Stamped, WeightPatch)
from .shard_layout import shard_metadata, shard_views, tiling_problem
from ..common.bits import np_bits, as_bits
from ..common.staging import Journal
from ..common.state_dicts import shared_memory

_MASK64 = (1 << 64) - 1


@dataclass(frozen=True)
class ShardRx:
    """One shard of a sharded sender as this receiver holds it: its rows of each key, and
    its own handshake state (keys in ordinal order, layouts of the ordinals it patches)."""

    rows: dict
    state: "ReceiverState"
    init_sync: bool


@dataclass(frozen=True)
class ReceiverState:
    """What a patch receiver's handshake established: its keys (ordinal order), the layouts of
    the ordinals patches touch, and the session (``None``: not checked); with a sharded
    sender, its ``shards`` (then patches are :class:`ShardedPatch` es)."""

    keys: list[str] = field(default_factory=list)
    layouts: dict[int, TensorLayout] = field(default_factory=dict)
    session: int | None = None
    shards: tuple = ()


@dataclass
class PreparedPatch:
    """A validated patch, ready to write: its tensors in ordinal order."""

    version: int
    decoded: list[DecodedTensor]
    keys: list[str]
    checksums: list[int] | None
    old_hashes: list[int] | None
    nbytes: int
    #: a ``ctx`` patch staged on top of a bootstrap not yet written: decoded against the
    #: bootstrapped values inside the write (:func:`complete_patch`); ``decoded`` is empty until then
    deferred: WeightPatch | None = None
    deferred_changed: int = 0
    #: A sharded patch: ``(rows, prepared shard, its layouts)`` per shard.
    parts: list = field(default_factory=list)

    @property
    def changed(self) -> int:
        own = self.deferred_changed if self.deferred is not None else sum(d.count for d in self.decoded)
        return own + sum(p.changed for _, p, _ in self.parts)

    @property
    def written_keys(self) -> list[str]:
        """The keys this patch changes (its shards' included)."""
        keys = [k for d, k in zip(self.decoded, self.keys) if d.count]
        return keys + [k for _, p, _ in self.parts for k in p.written_keys]


def unstamp(payload: Any, session: int | None) -> tuple[Any, int | None]:
    """The patch inside a received payload, and the session its own field must still match:
    a :class:`Stamped` payload is checked against ``session`` here (its patch is shared by
    every receiver, so its own field is not looked at)."""
    if not isinstance(payload, Stamped):
        return unshare(payload), session
    if session is not None and (not is_int(payload.session) or payload.session != session):
        raise PayloadError(f"a patch stamped for another handshake (session {payload.session!r}) arrived: a stale "
                           "or duplicated payload; refused, nothing was written")
    return unshare(payload.payload), None


def check_header(payload: Any, version_now: int | None, session: int | None) -> int:
    """Kind, version, base version and session of a received patch; returns its version."""
    if not isinstance(payload, (WeightPatch, CompressedWeightPatch, EmptyWeightPatch)):
        raise PayloadError(f"expected a weight patch, got {type(payload).__name__}")
    version = check_version(payload.version)
    if version_now is not None and version <= version_now:
        raise VersionError(f"patch version {version} does not advance the applied version {version_now}")
    base = payload.base_version
    if base is not None and not is_int(base):
        raise PayloadError(f"patch {version} has a malformed base_version {base!r}")
    if base != version_now:
        raise PatchChainError(f"patch {version} was built on version {base}, but this receiver holds {version_now}",
                              expected_base=base, receiver_version=version_now)
    if session is not None and (not is_int(payload.session) or payload.session != session):
        raise PayloadError(f"patch {version} belongs to another handshake (a stale or duplicated payload); "
                           "refused, nothing was written")
    return version


def prepare_patch(payload: Any, state: ReceiverState, version_now: int | None, target: Mapping[str, torch.Tensor],
                  *, verify_checksums: bool, defer_ctx: bool = False) -> PreparedPatch:
    """Validate ``payload`` whole against the receiver; nothing is written (``target`` is read
    for shapes and dtypes only). Everything malformed raises :class:`PayloadError` (or the
    subclass named), never another exception type."""
    if state.shards:
        return prepare_sharded(payload, state, version_now, target, verify_checksums=verify_checksums)
    payload, session = unstamp(payload, state.session)
    version = check_header(payload, version_now, session)
    nbytes = payload_nbytes(payload)
    if isinstance(payload, EmptyWeightPatch):
        return PreparedPatch(version, [], [], None, None, nbytes)
    try:
        if isinstance(payload, CompressedWeightPatch):
            payload = decompress_patch(payload, state.layouts)
        deferred = None
        if payload.encoding == "ctx":
            _ctx_kernels(state.layouts)
        if payload.encoding != "ctx":
            decoded = decode_patch(payload, state.layouts)
        elif defer_ctx:  # its positions depend on values a staged bootstrap has not written yet
            decoded, deferred = [], payload
            _check_header(payload, state.layouts)
        else:
            decoded = _decode_ctx(payload, state, target)
        what = f"patch {payload.version}"
        checksums = old_hashes = None
        n_tensors = len(decoded) if deferred is None else int(payload.ordinals.numel())
        if payload.checksums is not None:
            checksums = read_checksums(payload.checksums, n_tensors, what)
        elif verify_checksums:
            raise PayloadError(f"{what} carries no checksums but verify_checksums is on")
        if payload.old_hashes is not None:
            old_hashes = read_checksums(payload.old_hashes, n_tensors, what, "old_hashes")
        elif payload.encoding in ("flat", "ctx") and (decoded or deferred is not None):
            raise PayloadError(f"{what} is a {payload.encoding} patch without old_hashes (its drift check); refused, "
                               "nothing was written")
        keys = [state.keys[d.ordinal] for d in decoded]
        for d, key in zip(decoded, keys):
            check_target(target, key, state.layouts[d.ordinal])
        n_deferred = int(_int_tensor(deferred.nnz_per_tensor, "nnz_per_tensor").sum()) if deferred is not None else 0
    except AiosyncError:
        raise
    except Exception as exc:  # garbage that slipped past the checks: still the library's error
        raise PayloadError(f"malformed patch: {type(exc).__name__}: {exc}") from exc
    return PreparedPatch(version, decoded, keys, checksums, old_hashes, nbytes, deferred, n_deferred)


#: Seconds a ``ctx`` patch waits, at most, for this process's ``ctx`` kernels (a first compile).
CTX_KERNELS_WAIT = 600.0


def _ctx_kernels(layouts: dict[int, TensorLayout]) -> None:
    """Wait (a worker thread: staging) until the ``ctx`` kernels are loaded: decoding a ``ctx``
    patch has no torch path. They were asked for when the syncer pair was set up."""
    from ..kernels.warmup import wait_ready

    widths = sorted({lay.elem_size for lay in layouts.values()})
    if not wait_ready(widths, ctx=True, timeout=CTX_KERNELS_WAIT):
        raise PayloadError(f"a ctx patch arrived, but this process's ctx kernels were not ready within "
                           f"{CTX_KERNELS_WAIT:.0f}s (see `aiosync warm-up`); refused, nothing was written")


def _decode_ctx(payload: WeightPatch, state: ReceiverState, target: Mapping[str, torch.Tensor]) -> list[DecodedTensor]:
    from .ctx.decode import decode_ctx_patch
    from .format import _codec_pool

    return decode_ctx_patch(payload, state.layouts, lambda o: check_target(target, state.keys[o], state.layouts[o]),
                            _codec_pool())


def complete_patch(prepared: PreparedPatch, state: ReceiverState, target: Mapping[str, torch.Tensor]) -> None:
    """Decode a deferred ``ctx`` patch now (inside the write, after its bootstrap was written)."""
    if prepared.deferred is None:
        return
    try:
        decoded = _decode_ctx(prepared.deferred, state, target)
    except AiosyncError:
        raise
    except Exception as exc:
        raise PayloadError(f"malformed patch: {type(exc).__name__}: {exc}") from exc
    prepared.decoded = decoded
    prepared.keys = [state.keys[d.ordinal] for d in decoded]
    prepared.deferred = None


def check_target(target: Mapping[str, torch.Tensor], key: str, lay: TensorLayout) -> torch.Tensor:
    t = target[key] if key in target else None
    if not isinstance(t, torch.Tensor) or tuple(coo_2d_shape(t.shape)) != (lay.rows, lay.cols) \
            or t.element_size() != lay.elem_size:
        raise PayloadError(f"receiver tensor {key!r} changed shape or dtype since init_receiver")
    return t


def _fast(d: DecodedTensor, t: torch.Tensor) -> bool:
    """Whether a numba writer applies: a flat tensor decoded on CPU, or a ctx tensor, into a
    contiguous CPU tensor."""
    if t.device.type != "cpu" or not t.is_contiguous() or not d.is_delta:
        return False
    return d.zcodes is not None or (d.gaps is not None and not d.payload.is_cuda)


@dataclass
class _Job:
    key: str
    d: DecodedTensor
    t: torch.Tensor
    fast: bool
    lay: TensorLayout
    np_target: Any = None
    old: Any = None  # the overwritten bits: numpy (fast path) or a tensor (torch path)
    old_hash: int | None = None
    view: Any = None
    index: Any = None
    new: Any = None
    written: bool = False


def write_patch(target: Mapping[str, torch.Tensor], prepared: PreparedPatch, layouts: dict[int, TensorLayout],
                journal: Journal | None, after_each: Callable[[int, int], None] | None = None) -> int:
    """Write a prepared patch into ``target`` (in the calling thread); returns the elements
    written.

    Every overwritten value is kept, so the write undoes itself whatever fails inside it: a
    tensor whose old bits at the changed positions are not the ones the sender built the patch
    on (:class:`DriftError`; checked in the same pass as the write on the numba path, before
    any write on the torch path), a checksum mismatch (:class:`ChecksumError`), an exception
    of ``after_each(i, n)`` (run after the ``i``-th of ``n`` tensors; fault injection). Then
    nothing of the patch stays written. On success the undo records go to ``journal`` (if any)
    for the caller's later steps.
    """
    if prepared.parts:  # one shard after the other; what an earlier shard wrote is undone through `journal`
        return sum(write_patch(shard_views(target, rows), part, lays, journal, after_each)
                   for rows, part, lays in prepared.parts)
    jobs = []
    for d, key in zip(prepared.decoded, prepared.keys):
        t = check_target(target, key, layouts[d.ordinal])
        jobs.append(_Job(key, d, t, _fast(d, t), layouts[d.ordinal]))
    # Tensors that share memory (a buffer viewing rows of another tensor): the differences of
    # both are decoded against the old values, all gathered before anything is written (the
    # torch path), then written one after the other — both write the same new values where they
    # overlap. In place, the second would decode against what the first wrote.
    shared = {int(i) for a, b, *_ in shared_memory({str(i): j.t for i, j in enumerate(jobs)}) for i in (a, b)}
    for i in shared:
        jobs[i].fast = False
    hashes = prepared.old_hashes
    for i, job in enumerate(jobs):  # torch path: gather old bits and check them before any write
        if not job.fast:
            _prepare_torch(job)
            if hashes is not None:
                _check_drift(job, drift_hash(job.d.positions, job.old), hashes[i])
    try:
        with torch.no_grad():
            if after_each is not None or len(jobs) < 2 or shared:
                for i, job in enumerate(jobs):
                    _write_one(job)
                    if after_each is not None:
                        after_each(i, len(jobs))
            else:
                _write_parallel(jobs)
        if hashes is not None:
            for job, want in zip(jobs, hashes):
                if job.fast:
                    _check_drift(job, job.old_hash, want)
        finish_cuda_work(job.t for job in jobs)  # the writes landed before anything reads or commits them
        if prepared.checksums is not None:
            for job, want in zip(jobs, prepared.checksums):
                if tensor_checksum(job.t) != want:
                    raise ChecksumError(
                        f"tensor {job.key!r} does not match the sender's checksum after applying the patch "
                        "(corrupted in transit, or this receiver's weights had drifted); the patch was rolled back")
    except BaseException:
        with torch.no_grad():
            for job in reversed(jobs):
                if job.written:
                    _undo(job)()
        raise
    if journal is not None:
        for job in jobs:
            journal.record(_undo(job))
    return prepared.changed


def _check_drift(job: _Job, have: int, want: int) -> None:
    if have & _MASK64 != want & _MASK64:
        raise DriftError(
            f"receiver tensor {job.key!r} does not hold, at the {job.d.count} positions the patch changes, the values "
            "the sender built it on (written behind aiosync's back, or a lost delivery); refused, nothing was written")


def _write_parallel(jobs: list[_Job]) -> None:
    """Write every tensor, one group of about equal work per CPU (a task per tensor costs more
    than a small tensor's write); returns once every write has finished."""
    import os
    from concurrent.futures import wait

    from .format import _codec_pool

    n_groups = max(1, min(len(jobs), os.cpu_count() or 1, _codec_pool()._max_workers))
    total = sum(j.d.count for j in jobs) or 1
    groups: list[list[_Job]] = [[] for _ in range(n_groups)]
    done = 0
    for job in jobs:
        groups[min(n_groups - 1, done * n_groups // total)].append(job)
        done += job.d.count
    futures = [_codec_pool().submit(lambda g=g: [_write_one(j) for j in g]) for g in groups if g]
    wait(futures)
    for f in futures:
        f.result()


def _write_one(job: _Job) -> None:
    if job.fast and job.d.zcodes is not None:
        from ..kernels.ctx_coder import write_codes

        d = job.d
        job.np_target = np_bits(job.t.view(-1))
        job.old = np.empty(d.count, job.np_target.dtype)
        job.old_hash = int(write_codes(job.np_target, d.positions.numpy(), d.zcodes, job.old))
    elif job.fast:
        from ..kernels.write import apply_flat_gaps_logged

        d = job.d
        job.np_target = np_bits(job.t.view(-1))
        job.old = np.empty(d.count, job.np_target.dtype)
        job.old_hash = int(apply_flat_gaps_logged(job.np_target, d.gaps, d.gap_start, d.count, d.payload.numpy(),
                                                  d.nib_off, d.exceptions.numpy(), d.exc_off, job.old))
    else:
        job.view[job.index] = job.new
    job.written = True


def _undo(job: _Job) -> Callable[[], None]:
    if job.fast and job.d.zcodes is not None:
        from ..kernels.ctx_coder import restore_codes

        return lambda: restore_codes(job.np_target, job.d.positions.numpy(), job.old)
    if job.fast:
        from ..kernels.write import restore_gaps

        return lambda: restore_gaps(job.np_target, job.d.gaps, job.d.gap_start, job.d.count, job.old)
    return lambda: job.view.__setitem__(job.index, job.old)


def _prepare_torch(job: _Job) -> None:
    """Torch path (non-contiguous or CUDA tensors, ``coo``): gather old bits, compute new ones."""
    t, d, lay = job.t, job.d, job.lay
    pos = d.positions.to(t.device)
    if t.is_contiguous():
        job.view, job.index = as_bits(t).view(-1), pos
    else:
        job.view = as_bits(as_coo_2d_view(t, job.key))
        r = torch.div(pos, lay.cols, rounding_mode="floor")
        job.index = (r, pos - r * lay.cols)
    job.old = job.view[job.index]
    job.new = d.new_bits(job.old)


# ----------------------------------------------------------------------------- sharded senders

def receiver_shards(state_dict: Mapping[str, torch.Tensor], meta: ReceiverMetadata, table: Any,
                    session: int | None) -> tuple[ShardRx, ...]:
    """The shards of a sharded sender's hello, checked against this receiver (structure,
    ordinals, and that every key's pieces cover its rows exactly once: a
    :class:`~aiosync.errors.HandshakeError` otherwise)."""
    from ...errors import HandshakeError
    from .handshake import receiver_layouts

    if not isinstance(table, list) or not table:
        raise HandshakeError("the sender's shard table is malformed: not a non-empty list")
    for r, entry in enumerate(table):
        if not (isinstance(entry, dict) and isinstance(entry.get("rows"), dict)
                and isinstance(entry.get("init_sync"), bool) and isinstance(entry.get("synced"), list)):
            raise HandshakeError(f"the sender's shard table is malformed at shard {r}")
    shapes = dict(zip(meta.ordered_keys, (tuple(s) for s in meta.original_shapes)))
    problem = tiling_problem([e["rows"] for e in table], shapes)
    if problem:
        raise HandshakeError(f"the sender's shards do not fit this receiver: {problem}")
    out = []
    for r, entry in enumerate(table):
        sub = shard_metadata(meta, entry["rows"])
        ords = entry["synced"]
        if not all(is_int(o) and 0 <= o < len(sub.ordered_keys) for o in ords) or any(
                b <= a for a, b in zip(ords, ords[1:])):
            raise HandshakeError(f"the sender's shard {r} names synced ordinals outside [0, {len(sub.ordered_keys)}) "
                                 "or out of order")
        views = shard_views(state_dict, entry["rows"])
        state = ReceiverState(sub.ordered_keys, receiver_layouts(views, sub.ordered_keys, ords), session)
        out.append(ShardRx(dict(entry["rows"]), state, entry["init_sync"]))
    return tuple(out)


def sharded_parts(payload: Any, state: ReceiverState, version_now: int | None) -> tuple[ShardedPatch, list]:
    """The :class:`ShardedPatch` inside ``payload`` and its parts (unshared), every part's header
    checked against its shard (kind, version, base version, session) without decoding it: a
    part that never arrived (a :class:`ShardRef`) refuses the whole patch. A stamped payload is
    checked against the session here (the parts' own sessions are those of whoever the patch
    was first built for, so they are not looked at)."""
    stamp = payload if isinstance(payload, Stamped) else None
    inner = unshare(payload.payload if stamp is not None else payload)
    if not isinstance(inner, ShardedPatch) or not isinstance(inner.shards, list):
        raise PayloadError(f"expected a sharded patch (the sender has {len(state.shards)} shards), got "
                           f"{type(inner).__name__}")
    if stamp is not None and state.session is not None and stamp.session != state.session:
        raise PayloadError(f"sharded patch {inner.version!r} is stamped for another handshake (a stale or duplicated "
                           "payload); refused, nothing was written")
    version = check_version(inner.version)
    if len(inner.shards) != len(state.shards):
        raise PayloadError(f"sharded patch {version} holds {len(inner.shards)} shards, the sender announced "
                           f"{len(state.shards)}")
    parts = [unshare(part) for part in inner.shards]
    for r, (shard, part) in enumerate(zip(state.shards, parts)):
        if isinstance(part, ShardRef):  # a direct route's part that was never fetched
            raise PayloadError(f"shard {r} of sharded patch {version} did not arrive from shard rank {part.rank}; "
                               "refused whole, nothing was written")
        if check_header(part, version_now, shard.state.session if stamp is None else None) != version or \
                getattr(part, "base_version", None) != inner.base_version:
            raise PayloadError(f"shard {r} of sharded patch {version} is the patch of version {part.version}")
    return inner, parts


def prepare_sharded(payload: Any, state: ReceiverState, version_now: int | None, target: Mapping[str, torch.Tensor],
                    *, verify_checksums: bool) -> PreparedPatch:
    """:func:`prepare_patch` of a :class:`ShardedPatch`: every shard validated against views of
    ``target`` on its rows (:func:`sharded_parts` first)."""
    inner, parts = sharded_parts(payload, state, version_now)
    prepared = []
    for shard, part in zip(state.shards, parts):
        sub = ReceiverState(shard.state.keys, shard.state.layouts, None)  # its session: checked above
        prepared.append((shard.rows, prepare_patch(part, sub, version_now, shard_views(target, shard.rows),
                                                   verify_checksums=verify_checksums), shard.state.layouts))
    return PreparedPatch(inner.version, [], [], None, None, payload_nbytes(inner), parts=prepared)


@dataclass
class ShardedWrite:
    """A bootstrap of several shards into one model: ``parts`` are ``(rows, plan)`` pairs whose
    :class:`~aiosync.syncers.common.staging.FullStateWrite` plans work on :func:`shard_views` of the
    target; :meth:`check` / :meth:`write` as a FullStateWrite's."""

    parts: list

    @property
    def changed(self) -> int:
        return sum(plan.changed for _, plan in self.parts)

    @property
    def nbytes(self) -> int:
        return sum(plan.nbytes for _, plan in self.parts)

    @property
    def written_keys(self) -> list[str]:
        return list(dict.fromkeys(k for _, plan in self.parts for k in plan.written_keys))

    def check(self, target: Mapping[str, torch.Tensor]) -> None:
        for rows, plan in self.parts:
            plan.check(shard_views(target, rows))

    def write(self, target: Mapping[str, torch.Tensor], journal: Journal | None,
              after_each: Callable[[int, int], None] | None = None) -> int:
        return sum(plan.write(shard_views(target, rows), journal, after_each) for rows, plan in self.parts)
