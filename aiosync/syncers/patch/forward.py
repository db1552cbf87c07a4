"""A patch for a :class:`~aiosync.syncers.base.RemoteTarget` (an engine that decodes and writes
in place): checked without the weights, handed over as it was received.

The receiver holds no values to decode a patch against (a patch codes the new values against
the receiver's old ones), so it checks what it can without them — the kind of payload, its
version, the base version it was built on, the handshake it belongs to — and the target's
side decodes and validates the rest before anything is written
(:mod:`aiosync.engines.inplace`). :func:`handshake_of` is the handshake state the target needs
to decode the patches of a chain. :func:`stage_patch`, :func:`write_remote` and
:func:`local_model` are the patch syncer's steps for such a target.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any

import anyio

from ...aio import run_sync
from ...errors import HandshakeError
from ...messages import payload_nbytes
from ..base import RemoteTarget, RemoteWrite, SyncStatistics
from ..common.payloads import Stamped
from ..common.remote import tensor_plan
from ..common.staging import written
from .receiver import PreparedPatch, ReceiverState, check_header, prepare_patch, unstamp

__all__ = ["ForwardedPatch", "forward_patch", "handshake_of", "local_model", "stage_patch", "tensor_plan",
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
    session); :class:`~aiosync.errors.PayloadError` (or the subclass naming it) otherwise."""
    patch, session = unstamp(payload, state.session)
    version = check_header(patch, version_now, session)
    if isinstance(payload, Stamped) and state.session is not None and getattr(patch, "session", None) != state.session:
        patch = dataclasses.replace(patch, session=state.session)  # shares the tensors
    return ForwardedPatch(version, patch, payload_nbytes(patch), int(getattr(patch, "nnz", 0)))


def handshake_of(state: ReceiverState) -> dict:
    """The handshake as a remote target takes it (:attr:`~aiosync.syncers.base.RemoteWrite.handshake`)."""
    return {"keys": list(state.keys), "synced": sorted(state.layouts), "session": state.session}


def local_model(state_dict: Any) -> Any:
    """``state_dict`` itself; a :class:`HandshakeError` for a remote target (a sharded trainer's
    patches are decoded against the model's rows here, which a remote target does not hold)."""
    if isinstance(state_dict, RemoteTarget):
        raise HandshakeError("a sharded trainer's patches cannot be forwarded to a model that applies them where it "
                             "lives (a RemoteTarget) yet; give the explorer a model that holds its weights (a vLLM engine: "
                             "VLLMTarget(engine, inplace=False); a vllm serve: start it without aiosync's worker "
                             "extension, so that it takes the shadow path)")
    return state_dict


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
