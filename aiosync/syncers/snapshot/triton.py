"""Fused compare kernels of the CUDA builder (Triton): cast, compare and compact in two passes.

Imported only by :mod:`aiosync.syncers.snapshot.cuda` when a CUDA group is diffed (``import triton`` is slow);
``ImportError`` there means "use torch ops", and so does a failed self-check
(:func:`aiosync.syncers.snapshot.cuda.fused_ok`). A group (see :func:`aiosync.syncers.snapshot.cuda.plan`) is cut into
tiles of :data:`TILE` elements, none spanning two members; a member table gives each member's
source and snapshot address, length and first tile, so one launch covers every member:

1. :func:`_compare` — per tile: load the source, cast it to the snapshot's bits in registers
   (fp32 → bf16: round to nearest even, NaN by the rule torch's cast follows on this device),
   load the snapshot bits, write one change *bit* per element (``TILE / 32`` words) and the
   tile's count of changes.
2. ``cumsum`` of the counts on the device; one host synchronisation reads the members' totals
   (sizing the outputs).
3. :func:`_gather` — per tile: expand the change bits, load source and snapshot only where they
   are set, write (position, new bits, old bits) at the tile's offset, update the snapshot.

Traffic: see :mod:`aiosync.syncers.snapshot.cuda` (≈ 6.25 B per fp32 → bf16 element plus O(changes)).
"""

from __future__ import annotations

import os

import numpy as np
import torch
import triton
import triton.language as tl

#: Elements per tile (a multiple of 32: the change bits of a tile are whole 32-bit words).
TILE = 1024
#: NaN rules of a fp32 → bf16 cast: one canonical pattern, or the quiet bit set on the truncation.
NAN_CONST, NAN_QUIET = 0, 1


@triton.jit
def _ptr(addr, W: tl.constexpr):
    if W == 1:
        p = addr.to(tl.pointer_type(tl.int8))
    elif W == 2:
        p = addr.to(tl.pointer_type(tl.int16))
    elif W == 4:
        p = addr.to(tl.pointer_type(tl.int32))
    else:
        p = addr.to(tl.pointer_type(tl.int64))
    return p


@triton.jit
def _source_bits(addr, j, m, W: tl.constexpr, CAST: tl.constexpr, NAN_MODE: tl.constexpr, NAN_BITS: tl.constexpr):
    """The source elements ``j`` (where ``m``) as the snapshot's bits."""
    if CAST:
        u = tl.load(addr.to(tl.pointer_type(tl.uint32)) + j, mask=m, other=0)
        r = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
        if NAN_MODE == 0:
            q = tl.full(u.shape, NAN_BITS, tl.uint32)
        else:
            q = (u >> 16) | 0x40
        bits = tl.where((u & 0x7FFFFFFF) > 0x7F800000, q, r).to(tl.uint16).to(tl.int16, bitcast=True)
    else:
        bits = tl.load(_ptr(addr, W) + j, mask=m, other=0)
    return bits


@triton.jit
def _tile(tile_member, members, t):
    """Member row of tile ``t``: (source, snapshot, elements, position of element 0, first tile)."""
    row = members + tl.load(tile_member + t).to(tl.int64) * 5
    return tl.load(row), tl.load(row + 1), tl.load(row + 2), tl.load(row + 3), tl.load(row + 4)


@triton.jit
def _compare(tile_member, members, words, counts, W: tl.constexpr, CAST: tl.constexpr, NAN_MODE: tl.constexpr,
             NAN_BITS: tl.constexpr, TILE: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    src, snap, n, _, first = _tile(tile_member, members, t)
    j = (t - first) * TILE + tl.arange(0, TILE)
    valid = j < n
    new = _source_bits(src, j, valid, W, CAST, NAN_MODE, NAN_BITS)
    old = tl.load(_ptr(snap, W) + j, mask=valid, other=0)
    d = ((new != old) & valid).to(tl.int32)
    shifted = tl.reshape(d, (TILE // 32, 32)) << tl.arange(0, 32)[None, :]
    tl.store(words + t * (TILE // 32) + tl.arange(0, TILE // 32), tl.sum(shifted, axis=1))  # disjoint bits: sum = or
    tl.store(counts + t, tl.sum(d, axis=0))


@triton.jit
def _gather(tile_member, members, words, ends, counts, out_pos, out_new, out_old, W: tl.constexpr,
            CAST: tl.constexpr, NAN_MODE: tl.constexpr, NAN_BITS: tl.constexpr, TILE: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    src, snap, n, base, first = _tile(tile_member, members, t)
    k = tl.arange(0, TILE)
    w = tl.load(words + t * (TILE // 32) + k // 32)
    d = ((w >> (k % 32)) & 1) != 0
    j = (t - first) * TILE + k
    new = _source_bits(src, j, d, W, CAST, NAN_MODE, NAN_BITS)
    snap_p = _ptr(snap, W) + j
    old = tl.load(snap_p, mask=d, other=0)
    at = tl.load(ends + t) - tl.load(counts + t) + tl.cumsum(d.to(tl.int64), axis=0) - 1
    tl.store(out_pos + at, base + j, mask=d)
    tl.store(_ptr(out_new, W) + at, new, mask=d)
    tl.store(_ptr(out_old, W) + at, old, mask=d)
    tl.store(snap_p, new, mask=d)


_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_RULES: dict = {}
_PROBE = [0x7FC00000, 0xFFC00000, 0x7F800001, 0xFF800001, 0x7FFFFFFF, 0xFFFFFFFF, 0x7FA5A5A5, 0xFFB00001,
          0x7F800000, 0xFF800000, 0x00000000, 0x80000000, 0x00000001, 0x80000001, 0x007FFFFF, 0x00008000,
          0x00018000, 0x7F7FFFFF, 0xFF7FFFFF, 0x7F7F8000, 0x7F7E8000, 0x3F808000, 0x3F818000, 0x3F80FFFF,
          0x3F807FFF, 0x3F800000, 0x3EAAAAAB, 0xBF818000, 0x00010000, 0x0000FFFF]


def probe_values() -> torch.Tensor:
    """fp32 edge values (as int32 bits): NaN payloads of both signs, ±0, ±inf, subnormals, max
    finite (which rounds to inf), rounding ties both ways."""
    return torch.tensor(_PROBE, dtype=torch.int64).to(torch.int32)


def cast_rule(device: torch.device) -> tuple[int, int] | None:
    """The NaN rule of torch's fp32 → bf16 cast on ``device`` as ``(mode, bits)``, or ``None``
    when its results are not round-to-nearest-even with one of the known NaN rules."""
    key = str(device)
    if key not in _RULES:
        u = np.array(_PROBE, dtype=np.uint32)
        got = probe_values().to(device).view(torch.float32).to(torch.bfloat16).view(torch.int16).cpu().numpy()
        got = got.view(np.uint16).astype(np.uint32)
        nan = (u & 0x7FFFFFFF) > 0x7F800000
        rne = ((u.astype(np.uint64) + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint32)
        rule = None
        if np.array_equal(got[~nan], rne[~nan]):
            if np.all(got[nan] == got[nan][0]):
                rule = (NAN_CONST, int(got[nan][0]))
            elif np.array_equal(got[nan], (u[nan] >> 16) | 0x40):
                rule = (NAN_QUIET, 0)
        _RULES[key] = rule
    return _RULES[key]


def supports(src: torch.Tensor, snap: torch.Tensor) -> bool:
    """Whether the kernels handle this kind: fp32 → bf16, or the same dtype (compared as bits)."""
    return src.dtype == snap.dtype or (src.dtype == torch.float32 and snap.dtype == torch.bfloat16)


def diff_fused(srcs: list[torch.Tensor], snaps: list[torch.Tensor], bases: list[int]):
    """Diff one group: ``srcs[k]`` against ``snaps[k]`` (flat, contiguous), whose element 0 is at
    position ``bases[k]`` of its tensor; update the snapshots. Returns ``(positions, new bits,
    old bits, changes per member)``, ``None`` when nothing changed, or ``NotImplemented`` for
    what the kernels do not handle (the caller uses torch ops)."""
    src0, snap0 = srcs[0], snaps[0]
    if not snap0.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("the fused builder runs on CUDA tensors (on CPU only under TRITON_INTERPRET=1)")
    cast = src0.dtype != snap0.dtype
    rule = cast_rule(snap0.device) if cast else (NAN_CONST, 0)
    if not supports(src0, snap0) or rule is None:
        return NotImplemented
    device, width = snap0.device, snap0.element_size()
    rows, tiles, first = [], [], 0
    for src, snap, base in zip(srcs, snaps, bases):
        if not (src.is_contiguous() and snap.is_contiguous()):
            return NotImplemented
        n = snap.numel()
        rows.append((src.data_ptr(), snap.data_ptr(), n, base, first))
        tiles.append(-(-n // TILE))
        first += tiles[-1]
    members = torch.tensor(rows, dtype=torch.int64).to(device, non_blocking=True)
    tile_member = torch.from_numpy(np.repeat(np.arange(len(rows), dtype=np.int32), tiles)).to(device, non_blocking=True)
    ntiles = first
    last = torch.from_numpy(np.cumsum(tiles) - 1).to(device, non_blocking=True)
    words = torch.empty(ntiles * (TILE // 32), dtype=torch.int32, device=device)
    counts = torch.empty(ntiles, dtype=torch.int32, device=device)
    meta = dict(W=width, CAST=cast, NAN_MODE=rule[0], NAN_BITS=rule[1], TILE=TILE)
    _compare[(ntiles,)](tile_member, members, words, counts, **meta)
    ends = torch.cumsum(counts, 0, dtype=torch.int64)
    member_ends = ends[last].tolist()  # the one host sync of the group: its changes per member
    total = member_ends[-1]
    if total == 0:
        return None
    out_pos = torch.empty(total, dtype=torch.int64, device=device)
    out_new = torch.empty(total, dtype=_BITS[width], device=device)
    out_old = torch.empty(total, dtype=_BITS[width], device=device)
    _gather[(ntiles,)](tile_member, members, words, ends, counts, out_pos, out_new, out_old, **meta)
    return out_pos, out_new, out_old, np.diff(np.asarray([0] + member_ends)).tolist()
