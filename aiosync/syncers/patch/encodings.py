"""One version's changes in two encodings from one diff (``encoding: auto``, L3).

:func:`build_encoded` is the sender's build of one version in the encodings asked for (one of
them: :meth:`~aiosync.syncers.patch.syncer.PatchWeightSyncer.sync`). A fan-out whose explorer links
chose different encodings needs this version's patch both as
``flat`` and as ``ctx``. ``ctx`` codes each change against the receiver's old values *and* the
classes of every element around it, so it must be built from the snapshot at the base version;
``flat`` needs only the changes. So: the changes are found first (the numba diff, which moves the
snapshot to the new version and keeps each change's old bits), the snapshot is put back at those
positions (O(changes)), and the fused ``ctx`` builder runs over it — finding the same changes,
coding them, and moving the snapshot on again. The ``flat`` patch is coded from the first diff.
Two passes over the model instead of one, only while the links disagree.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from ...aio import run_sync, wait_event
from ...messages import payload_nbytes
from ..base import SyncStatistics
from ..common.bits import np_bits
from ..common.state_dicts import is_dtensor, materialize
from .handshake import check_planned


def build_flat_and_ctx(syncer, tensors: list) -> dict[str, tuple[list, float]]:
    """``{"flat": (TensorDiffs, seconds), "ctx": (CtxDiffs, seconds)}`` for ``tensors`` (CPU, one per
    slot) against ``syncer``'s snapshot, which holds the new version afterwards (a worker thread)."""
    from ..kernels.write import scatter

    snap = syncer.snapshot
    ctx = syncer.ctx_builder()  # its statistics from the base version's snapshot
    t0 = time.perf_counter()
    diffs = snap.diff(tensors, "cpu")
    t1 = time.perf_counter()
    for d in diffs:  # the snapshot back at the base version where it changed
        old = np_bits(d.old_bits.contiguous())
        scatter(snap.bits(d.slot), d.positions.numpy(), old, old[:0])
    ctx_diffs = ctx.build(tensors)
    t2 = time.perf_counter()
    if sum(d.nnz for d in ctx_diffs) != sum(d.nnz for d in diffs):  # pragma: no cover - the two builders disagree
        raise RuntimeError("the ctx builder found other changes than the diff it was put back from")
    return {"flat": (diffs, t1 - t0), "ctx": (ctx_diffs, t2 - t1)}


async def build_encoded(syncer, state_dict, version: int, encodings: tuple[str, ...]) -> dict[str, Any]:
    """Build ``version``'s patch in each of ``encodings`` ``syncer`` can build now (the first
    always: ``ctx`` before its kernels load is ``flat``), as
    :meth:`~aiosync.syncers.patch.syncer.PatchWeightSyncer.sync_encodings` documents; records the
    per-encoding statistics and moves the syncer's chain on (a build that fails half way breaks it).
    The state dict is checked against the handshake's plan first (nothing is built on a change)."""
    check_planned(state_dict, syncer._slot_keys, syncer._planned)
    wanted = list(dict.fromkeys("flat" if e == "ctx" and not syncer.ctx_ready() else e for e in encodings))
    if len(wanted) > 1 and (any(is_dtensor(state_dict[k]) for k in syncer._slot_keys)
                            or not syncer._fused_cpu([state_dict[k] for k in syncer._slot_keys], "ctx")):
        wanted = wanted[:1]  # two codings of one diff: the CPU builders only
    t0 = time.perf_counter()
    base = syncer._last_version
    built: list = []

    def build():
        if len(wanted) == 1:
            out = {wanted[0]: (syncer._build(state_dict, wanted[0]), time.perf_counter() - t0)}
        else:
            out = build_flat_and_ctx(syncer, [materialize(state_dict[k]) for k in syncer._slot_keys])
        built.append(True)
        return out

    try:
        diffs = await run_sync(build)
    finally:
        if built:  # the snapshot holds `version` now, whatever happens to this patch
            syncer._last_version = version
        else:
            syncer._chain_broken = f"building patch {version} failed half way, the sender's snapshot is out of step"
    if syncer._snapshot.staged_event is not None:
        await wait_event(syncer._snapshot.staged_event, timeout=syncer.config.recv_timeout)
    t1 = time.perf_counter()
    patches, syncer._by_encoding = {}, {}
    elements = sum(lay.numel for lay in syncer._layouts)
    for enc, (d, build_s) in diffs.items():
        e0 = time.perf_counter()
        patches[enc] = await run_sync(syncer._encode, d, version, base, enc)
        syncer._by_encoding[enc] = SyncStatistics(
            version=version, bytes=payload_nbytes(patches[enc]), changed=sum(x.nnz for x in d),  # both diff kinds
            elements=elements, build_s=build_s, encode_s=time.perf_counter() - e0)
    first = syncer._by_encoding[next(iter(patches))]
    syncer._statistics = dataclasses.replace(first, build_s=t1 - t0, encode_s=time.perf_counter() - t1)
    syncer._last_version = version
    return patches
