"""CPU kernels of the patch builder and receiver, compiled with numba.

The builder compares the bit patterns of the current tensor (already in the receiver's
dtype, or fp32 cast to bf16 on the fly) with the snapshot. Comparing raw bits, not values,
makes NaN == NaN when the bits are equal and 0.0 != -0.0 (B2).

The builder kernels run in two passes over each group of 64-element blocks. A branch-free
compare builds a 64-bit change mask per block (:mod:`aiosync.syncers.kernels.simd`: one vector compare) and flattens
its set bits into positions with popcount and count-trailing-zeros, with no data-dependent
branch when a block holds at most four changes (nearly all of them at RL densities). Then
a loop with a predictable trip count visits only those positions, while their cache lines
are still hot, writes each change out and updates the snapshot in place. Cost: one
streaming pass over both arrays plus a few nanoseconds per change.
"""

from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic, overload

from .simd import PREFETCH_BLOCKS, change_mask, prefetch_block


@intrinsic
def _tz64(typingctx, x):
    """LLVM count-trailing-zeros of a uint64, 64 for zero (one instruction on x86-64 and arm64)."""
    sig = types.uint64(types.uint64)

    def codegen(context, builder, signature, args):
        i64 = ir.IntType(64)
        fnty = ir.FunctionType(i64, [i64, ir.IntType(1)])
        fn = builder.module.declare_intrinsic("llvm.cttz", [i64], fnty)
        return builder.call(fn, [args[0], ir.Constant(ir.IntType(1), 0)])

    return sig, codegen


@intrinsic
def _popcount64(typingctx, x):
    """LLVM population count of a uint64."""
    sig = types.uint64(types.uint64)

    def codegen(context, builder, signature, args):
        i64 = ir.IntType(64)
        fn = builder.module.declare_intrinsic("llvm.ctpop", [i64], ir.FunctionType(i64, [i64]))
        return builder.call(fn, [args[0]])

    return sig, codegen


def _width(a):
    """Bytes per element of array ``a``, a compile-time constant inside kernels."""
    return a.itemsize


@overload(_width)
def _width_impl(a):
    # typed per dtype, so branches on the width fold away (``a.itemsize`` is a run-time load)
    w = a.dtype.bitwidth // 8

    def impl(a):
        return w

    return impl


@numba.njit(nogil=True, cache=True, boundscheck=False, inline="always")
def _cast_bf16(u):  # pragma: no cover - compiled
    """fp32 bits → bf16 bits: round to nearest even, every NaN → 0xFFFF (torch's CPU cast)."""
    u = np.uint32(u)
    if (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000):
        return np.uint16(0xFFFF)
    return np.uint16((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16))


@numba.njit(nogil=True, cache=True, boundscheck=False, inline="always")
def _load(src, j, fused):  # pragma: no cover - compiled
    """Element ``j`` of the source as snapshot bits (cast to bf16 on the fly when ``fused``)."""
    if fused:
        return np.uint64(_cast_bf16(src[j]))
    return np.uint64(src[j])


@numba.njit(nogil=True, cache=True, boundscheck=False, inline="always")
def _flatten(m, s, idx, cnt):  # pragma: no cover - compiled
    """Append ``s + i`` for every set bit ``i`` of ``m`` to ``idx[cnt:]``; return the new count.

    The first four slots are written unconditionally (past the count they are scratch, so
    ``idx`` needs four spare entries): a loop over set bits would mispredict its exit about
    once per block.
    """
    one = np.uint64(1)
    pc = np.int64(_popcount64(m))
    idx[cnt] = s + np.int64(_tz64(m))
    m &= m - one
    idx[cnt + 1] = s + np.int64(_tz64(m))
    m &= m - one
    idx[cnt + 2] = s + np.int64(_tz64(m))
    m &= m - one
    idx[cnt + 3] = s + np.int64(_tz64(m))
    m &= m - one
    if pc > 4:
        c = cnt + 4
        while m:
            idx[c] = s + np.int64(_tz64(m))
            m &= m - one
            c += 1
    return cnt + pc


_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)


@numba.njit(nogil=True, cache=True, boundscheck=False, inline="always")
def mix64(pos, old):  # pragma: no cover - compiled
    """The drift check's per-change term: splitmix64's finaliser of ``pos × golden XOR old``
    (``old`` zero-extended). :func:`aiosync.syncers.common.integrity.drift_hash` is the torch twin."""
    x = (np.uint64(pos) * _GOLDEN) ^ np.uint64(old)
    x ^= x >> np.uint64(30)
    x *= _MIX1
    x ^= x >> np.uint64(27)
    x *= _MIX2
    x ^= x >> np.uint64(31)
    return x


# Blocks of 64 elements whose changes are collected before the second pass writes them out
# (measured best between 16 and 32: large enough to amortise the switch, small enough that
# the blocks' cache lines are still in L1).
GROUP_BLOCKS = 16


@numba.njit(nogil=True, cache=True, boundscheck=False, inline="always")
def _tail_mask(src, snap, s, e, fused):  # pragma: no cover - compiled
    """The change mask of a last, partial block ``[s, e)`` (full blocks: :func:`change_mask`)."""
    m = np.uint64(0)
    for i in range(e - s):
        m |= np.uint64(np.uint64(_load(src, s + i, fused)) != np.uint64(snap[s + i])) << np.uint64(i)
    return m


@numba.njit(nogil=True, cache=True, boundscheck=False, inline="always")
def block_mask(src, snap, s, e, fused):  # pragma: no cover - compiled
    """The change mask of block ``[s, e)`` (64 elements but for the last block), after asking
    for the data ``PREFETCH_BLOCKS`` blocks ahead: the builders' per-block first step."""
    prefetch_block(src, s + PREFETCH_BLOCKS * 64)
    prefetch_block(snap, s + PREFETCH_BLOCKS * 64)
    return change_mask(src, snap, s) if e - s == 64 else _tail_mask(src, snap, s, e, fused)


@numba.njit(nogil=True, cache=True, boundscheck=False)
def diff_update(src, snap, fused, out_pos, out_new, out_old, base):  # pragma: no cover - compiled
    """Find elements where ``src`` and ``snap`` differ bitwise; record them; update ``snap``.

    ``src`` and ``snap`` are 1-D unsigned-integer views of equal length; ``src`` holds the
    snapshot's dtype, or fp32 bits cast to bf16 on the fly when ``fused``. Changed element
    ``j`` is written as ``out_pos[k] = base + j`` with its new and old bits in ``out_new[k]``
    and ``out_old[k]``; then ``snap[j]`` takes the new bits. Returns the number of changes.
    The output arrays must hold ``len(snap)`` entries.
    """
    n = snap.shape[0]
    nblocks = (n + 63) // 64
    idx = np.empty(GROUP_BLOCKS * 64 + 4, np.int64)
    cnt = 0
    k = 0
    for b in range(nblocks):
        s = b * 64
        e = min(n, s + 64)
        m = block_mask(src, snap, s, e, fused)
        cnt = _flatten(m, s, idx, cnt)
        if (b & (GROUP_BLOCKS - 1)) == GROUP_BLOCKS - 1 or b == nblocks - 1:
            for q in range(cnt):
                j = idx[q]
                h = _load(src, j, fused)
                out_pos[k] = base + j
                out_new[k] = h
                out_old[k] = snap[j]
                snap[j] = h
                k += 1
            cnt = 0
    return k


@numba.njit(nogil=True, cache=True, boundscheck=False, inline="always")
def _zigzag(new, old, width):  # pragma: no cover - compiled
    """Zig-zag code of ``new - old`` modulo 2**(8*width), branch-free (XOR for 8-byte elements)."""
    if width == 8:
        return np.uint64(new) ^ np.uint64(old)
    bits = 8 * width
    mask = (np.int64(1) << bits) - 1
    half = np.int64(1) << (bits - 1)
    d = (np.int64(new) - np.int64(old)) & mask
    sd = (d ^ half) - half  # the difference, sign-extended
    return np.uint64(((sd << 1) ^ (sd >> 63)) & mask)


@numba.njit(nogil=True, cache=True, boundscheck=False, inline="always")
def _put_varint(gaps, g, gap):  # pragma: no cover - compiled
    """Write ``gap`` as a LEB128 varint at ``gaps[g]``; return the next free index."""
    while gap >= np.uint64(0x80):
        gaps[g] = np.uint8((gap & np.uint64(0x7F)) | np.uint64(0x80))
        gap >>= np.uint64(7)
        g += 1
    gaps[g] = np.uint8(gap)
    return g + 1


# Value codes: a zig-zag code below ESCAPE is its own nibble; larger codes take nibble ESCAPE
# and go whole to an exception list, written byte-plane-wise (``exc[b, e]`` = byte ``b``).
ESCAPE = 15


@numba.njit(nogil=True, cache=True, boundscheck=False, inline="always")
def _put_value(nibs, k, exc, e, z):  # pragma: no cover - compiled
    """Record code ``z`` of change ``k``: its nibble, and the whole code when it escapes.
    Returns the new exception count."""
    if z < np.uint64(ESCAPE):
        nibs[k] = np.uint8(z)
        return e
    nibs[k] = np.uint8(ESCAPE)
    for bb in range(exc.shape[0]):
        exc[bb, e] = np.uint8((z >> np.uint64(8 * bb)) & np.uint64(0xFF))
    return e + 1


@numba.njit(nogil=True, cache=True, boundscheck=False)
def encode_flat(pos, new, old, count, prev, gaps, nibs, exc):  # pragma: no cover - compiled
    """Gap-code ``pos[:count]`` as LEB128 varints into ``gaps``; code the values.

    ``prev`` is the position before the first (``-1`` at a tensor's start). ``nibs[i]`` gets
    change ``i``'s value nibble (one per byte; packed later), escaped codes go to ``exc``
    (``(width, count)`` bytes). Returns ``(gap bytes, bytes of the first varint, exceptions)``.
    """
    width = _width(new)
    g = 0
    e = 0
    first_len = 0
    for i in range(count):
        p = np.int64(pos[i])
        start = g
        g = _put_varint(gaps, g, np.uint64(p - prev - 1))
        prev = p
        if i == 0:
            first_len = g - start
        e = _put_value(nibs, i, exc, e, _zigzag(new[i], old[i], width))
    return g, first_len, e


@numba.njit(nogil=True, cache=True, boundscheck=False)
def pack_nibbles(nibs, out):  # pragma: no cover - compiled
    """``out[i] = nibs[2i] | nibs[2i+1] << 4``; a missing last high nibble is 0."""
    n = nibs.shape[0]
    for i in range(n // 2):
        out[i] = nibs[2 * i] | (nibs[2 * i + 1] << np.uint8(4))
    if n % 2:
        out[n // 2] = nibs[n - 1]


@numba.njit(nogil=True, cache=True, boundscheck=False, inline="always")
def _is_escape(packed, c):  # pragma: no cover - compiled
    return np.int64(get_nibble(packed, c) == np.uint64(ESCAPE))


@numba.njit(nogil=True, cache=True, boundscheck=False)
def count_escapes(packed, counts, out):  # pragma: no cover - compiled
    """``out[t]`` = how many of tensor ``t``'s nibbles are ESCAPE; tensor ``t`` owns the
    ``counts[t]`` nibbles after those of tensors ``0 … t-1``. Whole bytes are counted two
    nibbles at a time (a loop the compiler vectorises)."""
    c = 0
    for t in range(counts.shape[0]):
        end = c + counts[t]
        e = 0
        if c & 1 and c < end:  # a leading high nibble
            e += _is_escape(packed, c)
            c += 1
        for i in range(c >> 1, end >> 1):
            b = packed[i]
            e += np.int64((b & np.uint8(15)) == np.uint8(ESCAPE)) + np.int64((b >> np.uint8(4)) == np.uint8(ESCAPE))
        c = max(c, end & ~1)
        if c < end:  # a trailing low nibble
            e += _is_escape(packed, c)
            c += 1
        out[t] = e


@numba.njit(nogil=True, cache=True, boundscheck=False)
def decode_gaps(gaps, start, end, count, numel, out_pos, store=True):  # pragma: no cover - compiled
    """Parse ``count`` LEB128 gaps from ``gaps[start:end]`` into positions (into ``out_pos``
    when ``store``; without it, this only validates the stream).

    Returns the bytes consumed, or a negative error code: -1 truncated stream, -2 varint too
    long, -3 position out of range, -4 bytes left over.
    """
    g = start
    prev = np.int64(-1)
    for i in range(count):
        value = np.uint64(0)
        shift = np.uint64(0)
        while True:
            if g >= end:
                return -1
            byte = np.uint64(gaps[g])
            g += 1
            if shift > np.uint64(56):
                return -2
            value |= (byte & np.uint64(0x7F)) << shift
            if byte < np.uint64(0x80):
                break
            shift += np.uint64(7)
        if value >= np.uint64(numel):
            return -3
        p = prev + 1 + np.int64(value)
        if p >= numel or p < 0:
            return -3
        if store:
            out_pos[i] = p
        prev = p
    if g != end:
        return -4
    return g - start


@numba.njit(nogil=True, cache=True, boundscheck=False, inline="always")
def get_varint(gaps, g):  # pragma: no cover - compiled
    """Read the LEB128 varint at ``gaps[g]`` of a stream :func:`decode_gaps` validated;
    returns ``(value, index after it)``."""
    byte = np.uint64(gaps[g])
    g += 1
    value = byte & np.uint64(0x7F)
    shift = np.uint64(7)
    while byte >= np.uint64(0x80):
        byte = np.uint64(gaps[g])
        g += 1
        value |= (byte & np.uint64(0x7F)) << shift
        shift += np.uint64(7)
    return value, g


@numba.njit(nogil=True, cache=True, boundscheck=False, inline="always")
def get_nibble(packed, c):  # pragma: no cover - compiled
    """Nibble ``c`` of ``packed``: change ``c``'s value code, or ESCAPE (then the code is
    :func:`get_exception` of the next exception)."""
    return np.uint64((packed[c >> 1] >> np.uint8(4 * (c & 1))) & np.uint8(15))


@numba.njit(nogil=True, cache=True, boundscheck=False, inline="always")
def get_exception(exc, e, width):  # pragma: no cover - compiled
    """Exception ``e``: the whole code of an escaped change, from ``exc[:, e]`` (byte planes).

    Kept apart from :func:`get_nibble`, the escape test left to the caller: one inlined helper
    that took ``exc`` and branched on the escape made two refcount calls per change (numba 0.68
    does not prune them; 0.65 did), which made the whole flat write 2.6× slower."""
    z = np.uint64(0)
    for b in range(width):
        z |= np.uint64(exc[b, e]) << np.uint64(8 * b)
    return z


@numba.njit(nogil=True, cache=True, boundscheck=False, inline="always")
def unzigzag(old, z, width):  # pragma: no cover - compiled
    """The inverse of :func:`_zigzag`: the value coded as ``z`` against ``old`` (as uint64)."""
    if width == 8:
        return np.uint64(old) ^ z
    zi = np.int64(z)
    sd = (zi >> 1) ^ -(zi & 1)  # zig-zag decode, branch-free
    return np.uint64((np.int64(old) + sd) & ((np.int64(1) << (8 * width)) - 1))


def fused_cast_matches_torch() -> bool:
    """Whether the kernels' fused fp32 → bf16 cast reproduces this torch build's cast."""
    import torch

    probe = torch.tensor(
        [0x7FC00000, 0xFFC00000, 0x7F800001, 0xFF800001, 0x7F800000, 0xFF800000, 0x00000000, 0x80000000,
         0x3F808000, 0x3F818000, 0x3F80FFFF, 0x7F7FFFFF, 0x00000001, 0x3EAAAAAB] * 8,
        dtype=torch.int64).to(torch.int32).view(torch.float32)
    want = probe.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    snap = np.zeros(probe.numel(), np.uint16)
    n = probe.numel()
    pos, new, old = np.empty(n, np.int64), np.empty(n, np.uint16), np.empty(n, np.uint16)
    diff_update(probe.view(torch.int32).numpy().view(np.uint32), snap, True, pos, new, old, 0)
    return bool(np.array_equal(snap, want))


@numba.njit(nogil=True, cache=True, boundscheck=False)
def diff_encode_flat(src, snap, fused, gaps, nibs, exc, base=0):  # pragma: no cover - compiled
    """Diff one chunk and emit the ``flat`` encoding directly (no intermediate arrays).

    ``src`` and ``fused`` as in :func:`diff_update`. Changed elements update ``snap`` and
    append a LEB128 gap (positions relative to the chunk, the first one from -1) to ``gaps``,
    a value nibble to ``nibs`` (one per byte) and, for escaped codes, the whole code to
    ``exc`` (``(width, n)`` byte planes). Returns ``(changes, gap bytes, exceptions, bytes of
    the first varint, first position, last position, drift hash)`` so that chunks can be
    stitched into one stream per tensor; the drift hash sums :func:`mix64` of every change's
    position in the tensor (``base`` + position in the chunk) and old bits, modulo 2**64.
    """
    width = _width(snap)
    n = snap.shape[0]
    nblocks = (n + 63) // 64
    idx = np.empty(GROUP_BLOCKS * 64 + 4, np.int64)
    cnt = 0
    k = 0
    g = 0
    e = 0
    prev = np.int64(-1)
    first_len = 0
    first_pos = np.int64(-1)
    hsum = np.uint64(0)
    base = np.int64(base)
    for b in range(nblocks):
        s = b * 64
        end = min(n, s + 64)
        m = block_mask(src, snap, s, end, fused)
        cnt = _flatten(m, s, idx, cnt)
        if (b & (GROUP_BLOCKS - 1)) == GROUP_BLOCKS - 1 or b == nblocks - 1:
            if k == 0 and cnt > 0:
                first_pos = idx[0]
                first_len = _put_varint(gaps, 0, np.uint64(first_pos))
            for q in range(cnt):
                j = idx[q]
                h = _load(src, j, fused)
                o = np.uint64(snap[j])
                snap[j] = h
                hsum += mix64(base + j, o)
                gap = np.uint64(j - prev - 1)
                prev = j
                if gap < np.uint64(0x80):  # nearly always at RL densities: no loop
                    gaps[g] = np.uint8(gap)
                    g += 1
                else:
                    g = _put_varint(gaps, g, gap)
                e = _put_value(nibs, k, exc, e, _zigzag(h, o, width))
                k += 1
            cnt = 0
    return k, g, e, first_len, first_pos, prev, hsum


def varint_bytes(value: int) -> bytes:
    """LEB128 encoding of one non-negative integer."""
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)
