"""A patch for a :class:`~aiosync.syncers.base.RemoteTarget` (an engine that decodes and writes
in place): checked without the weights, handed over as it was received.

The receiver holds no values to decode a patch against (a patch codes the new values against
the receiver's old ones), so it checks what it can without them — the kind of payload, its
version, the base version it was built on, the handshake it belongs to — and the target's
side decodes and validates the rest before anything is written
(:mod:`aiosync.engines.inplace`). :func:`handshake_of` is the handshake state the target needs
to decode the patches of a chain. :func:`stage_patch`, :func:`write_remote` and
:func:`sharded_plan` are the patch syncer's steps for such a target.

A sharded (FSDP2) trainer's patches reach such a target too: each shard's part is checked on
its own header and handed over as it came (the target decodes each against its rows), and
its bootstrap reaches the target as whole tensors, assembled here from the shards' rows.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any

import anyio

from ...aio import run_sync
from ...messages import payload_nbytes
from ..base import RemoteTarget, RemoteWrite, SyncStatistics
from ..common.payloads import ShardedPatch, Stamped
from ..common.remote import AssembledTensors, tensor_plan
from ..common.staging import written
from .receiver import PreparedPatch, ReceiverState, check_header, prepare_patch, sharded_parts, unstamp

__all__ = ["ForwardedPatch", "forward_patch", "handshake_of", "sharded_plan", "stage_patch", "tensor_plan",
           "write_remote"]


@dataclass(frozen=True)
class ForwardedPatch:
    """A patch checked for a remote target: ``payload`` is the patch itself (a shared patch's
    session set to this receiver's), ``changed`` the elements it changes (from its header)."""

    version: int
    payload: Any
    nbytes: int
    changed: int


def forward_patch(payload: Any, state: ReceiverState, version_now: int | None) -> ForwardedPatch:
    """Check a received patch's header against the receiver (kind, version, base version,
    session); :class:`~aiosync.errors.PayloadError` (or the subclass naming it) otherwise. A
    sharded sender's patch (``state.shards``) is checked part by part, and a part that never
    arrived refuses it whole (:func:`~.receiver.sharded_parts`); it is handed over as a
    :class:`ShardedPatch` of the parts as they came."""
    if state.shards:
        inner, parts = sharded_parts(payload, state, version_now)
        if isinstance(payload, Stamped) and state.session is not None:
            parts = [_restamped(p, state.session) for p in parts]
        patch = ShardedPatch(inner.version, inner.base_version, parts)
        return ForwardedPatch(inner.version, patch, payload_nbytes(patch),
                              sum(int(getattr(p, "nnz", 0)) for p in parts))
    patch, session = unstamp(payload, state.session)
    version = check_header(patch, version_now, session)
    if isinstance(payload, Stamped) and state.session is not None:
        patch = _restamped(patch, state.session)
    return ForwardedPatch(version, patch, payload_nbytes(patch), int(getattr(patch, "nnz", 0)))


def _restamped(patch: Any, session: int) -> Any:
    """A shared patch (built for the first of its receivers) with this receiver's session: its
    tensors shared, not copied."""
    return patch if getattr(patch, "session", None) == session else dataclasses.replace(patch, session=session)


def handshake_of(state: ReceiverState) -> dict:
    """The handshake as a remote target takes it (:attr:`~aiosync.syncers.base.RemoteWrite.handshake`);
    a sharded sender's adds its ``shards``: each shard's ``rows`` of each key (``None``: whole;
    ``[first row, rows]`` along dim 0), its ``keys`` (the ordinal order of its patches) and the
    ``synced`` ordinals they touch."""
    out = {"keys": list(state.keys), "synced": sorted(state.layouts), "session": state.session}
    if state.shards:
        out["shards"] = [{"rows": {k: None if v is None else list(v) for k, v in s.rows.items()},
                          "keys": list(s.state.keys), "synced": sorted(s.state.layouts)} for s in state.shards]
    return out


def sharded_plan(target: Any) -> AssembledTensors | None:
    """A sharded trainer's bootstrap plan for ``target``: for a remote target, whole tensors
    assembled from the shards' rows (its loader takes whole tensors); ``None`` for a model
    that holds its weights (each shard written through views of its rows)."""
    return AssembledTensors(target) if isinstance(target, RemoteTarget) else None


async def stage_patch(syncer: Any, target: Any, payload: Any, pending: Any) -> PreparedPatch | ForwardedPatch:
    """The patch syncer's staging of a received patch: decoded against ``target`` (a worker
    thread), or, for a remote target, its header checked (:func:`forward_patch`)."""
    rx = pending.rx if pending is not None else syncer._rx
    version_now = None if pending is not None else syncer.version
    if isinstance(target, RemoteTarget):
        return forward_patch(payload, rx, version_now)
    return await run_sync(prepare_patch, payload, rx, version_now, target,
                          verify_checksums=syncer.config.verify_checksums,
                          defer_ctx=pending is not None and pending.plan is not None)


async def write_remote(syncer: Any, target: Any, prepared: ForwardedPatch | None, pending: Any,
                       stage_s: float | None, held: int) -> int | None:
    """The patch syncer's write to a remote target: the handshake, bootstrap tensors and patch
    it staged, handed over as received, in one call; the target writes them all or nothing.
    The syncer's receiver state and version advance only if it did."""
    t0 = time.perf_counter()
    boot = pending.plan if pending is not None else None
    write = RemoteWrite(prepared.version if prepared is not None else None,
                        handshake_of(pending.rx) if pending is not None else None,
                        list(boot.buckets) if boot is not None else [],
                        prepared.payload if prepared is not None else None)
    with anyio.CancelScope(shield=True):  # a cancellation cannot split the write from the receiver's state
        await target.write_remote(write)
        if pending is not None:
            syncer._rx, syncer._pending = pending.rx, None
        syncer.version = write.version
        syncer._generation += 1
    stage_s = (pending.stage_s if pending is not None else 0.0) if stage_s is None else stage_s
    nbytes = (prepared.nbytes if prepared is not None else 0) + (pending.nbytes if pending is not None else 0)
    changed = (prepared.changed if prepared is not None else 0) + (boot.changed if boot is not None else 0)
    del write
    await written(boot)  # the bootstrap's tensors released off the event loop
    write_s = time.perf_counter() - t0
    syncer._statistics = SyncStatistics(version=syncer.version, bytes=nbytes, changed=changed, stage_s=stage_s,
                                        write_s=write_s, apply_s=stage_s + write_s, peak_bytes=held)
    return syncer.version
