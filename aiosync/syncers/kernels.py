"""CPU kernels of the patch builder, compiled with numba.

The builder compares the bit patterns of the current tensor (already cast to the receiver's
dtype) with the snapshot. Comparing raw bits, not values, makes NaN == NaN when the bits are
equal and 0.0 != -0.0 (B2). The kernel builds a 64-bit change mask per block of 64 elements
(a branch-free loop the compiler vectorises), then visits only the set bits with
count-trailing-zeros, writing each changed position, its new and old bits, and updating the
snapshot in place. Cost is one streaming pass over both arrays plus O(changes).
"""

from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic


@intrinsic
def _cttz64(typingctx, x):
    """LLVM count-trailing-zeros on a uint64 (one instruction on x86-64 and arm64)."""
    sig = types.uint64(types.uint64)

    def codegen(context, builder, signature, args):
        i64 = ir.IntType(64)
        fnty = ir.FunctionType(i64, [i64, ir.IntType(1)])
        fn = builder.module.declare_intrinsic("llvm.cttz", [i64], fnty)
        return builder.call(fn, [args[0], ir.Constant(ir.IntType(1), 1)])

    return sig, codegen


@numba.njit(nogil=True, cache=True, boundscheck=False)
def diff_and_update(new, snap, out_pos, out_new, out_old, base):  # pragma: no cover - compiled
    """Find elements where ``new`` and ``snap`` differ bitwise; record and copy them.

    ``new`` and ``snap`` are 1-D unsigned-integer views of equal length and dtype. Changed
    element ``j`` is written as ``out_pos[k] = base + j``, ``out_new[k] = new[j]``,
    ``out_old[k] = snap[j]``, then ``snap[j] = new[j]``. Returns the number of changes ``k``.
    The output arrays must hold ``len(new)`` entries.
    """
    n = new.shape[0]
    nblocks = n // 64
    one = np.uint64(1)
    masks = np.empty(nblocks, np.uint64)
    for b in range(nblocks):
        s = b * 64
        m = np.uint64(0)
        for i in range(64):
            m |= np.uint64(new[s + i] != snap[s + i]) << np.uint64(i)
        masks[b] = m
    k = 0
    for b in range(nblocks):
        m = masks[b]
        s = b * 64
        while m:
            j = s + np.int64(_cttz64(m))
            m &= m - one
            v = new[j]
            out_pos[k] = base + j
            out_new[k] = v
            out_old[k] = snap[j]
            snap[j] = v
            k += 1
    for j in range(nblocks * 64, n):
        v = new[j]
        if v != snap[j]:
            out_pos[k] = base + j
            out_new[k] = v
            out_old[k] = snap[j]
            snap[j] = v
            k += 1
    return k


@numba.njit(nogil=True, cache=True, boundscheck=False)
def diff_cast_f32_bf16(src, snap, out_pos, out_new, out_old, base):  # pragma: no cover - compiled
    """:func:`diff_and_update` fused with the fp32 → bf16 cast.

    ``src`` holds fp32 bit patterns (uint32), ``snap`` bf16 bit patterns (uint16). The cast
    rounds to nearest even and maps every NaN to 0xFFFF, exactly as torch's CPU cast does
    (checked at import by :func:`fused_cast_matches_torch`; otherwise this kernel is unused).
    """
    n = src.shape[0]
    nblocks = n // 64
    one = np.uint64(1)
    buf = np.empty(64, np.uint16)
    k = 0
    for b in range(nblocks + 1):
        s = b * 64
        e = min(n, s + 64)
        m = np.uint64(0)
        for i in range(e - s):
            u = np.uint32(src[s + i])
            if (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000):
                h = np.uint16(0xFFFF)
            else:
                h = np.uint16((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16))
            buf[i] = h
            m |= np.uint64(h != snap[s + i]) << np.uint64(i)
        while m:
            i = np.int64(_cttz64(m))
            m &= m - one
            j = s + i
            out_pos[k] = base + j
            out_new[k] = buf[i]
            out_old[k] = snap[j]
            snap[j] = buf[i]
            k += 1
    return k


@numba.njit(nogil=True, cache=True, boundscheck=False)
def _zigzag(new, old, width):  # pragma: no cover - compiled
    if width == 8:
        return np.uint64(new) ^ np.uint64(old)
    bits = 8 * width
    mod = np.int64(1) << bits
    d = (np.int64(new) - np.int64(old)) & (mod - 1)  # modulo 2**bits without a division
    if d >= mod >> 1:
        d -= mod
    if d >= 0:
        return np.uint64(2 * d)
    return np.uint64(-2 * d - 1)


@numba.njit(nogil=True, cache=True, boundscheck=False, inline="always")
def _put_varint(gaps, g, gap):  # pragma: no cover - compiled
    """Write ``gap`` as a LEB128 varint at ``gaps[g]``; return the next free index."""
    while gap >= np.uint64(0x80):
        gaps[g] = np.uint8((gap & np.uint64(0x7F)) | np.uint64(0x80))
        gap >>= np.uint64(7)
        g += 1
    gaps[g] = np.uint8(gap)
    return g + 1


@numba.njit(nogil=True, cache=True, boundscheck=False, inline="always")
def _put_code(planes, k, z, width):  # pragma: no cover - compiled
    """Write code ``z`` byte-plane-wise; the common widths are unrolled."""
    if width == 2:
        planes[0, k] = np.uint8(z & np.uint64(0xFF))
        planes[1, k] = np.uint8((z >> np.uint64(8)) & np.uint64(0xFF))
    elif width == 1:
        planes[0, k] = np.uint8(z & np.uint64(0xFF))
    else:
        for bb in range(width):
            planes[bb, k] = np.uint8((z >> np.uint64(8 * bb)) & np.uint64(0xFF))


@numba.njit(nogil=True, cache=True, boundscheck=False)
def encode_flat(pos, new, old, count, width, prev, gaps, planes, plane_off):  # pragma: no cover - compiled
    """Gap-code ``pos[:count]`` as LEB128 varints into ``gaps`` and zig-zag code the values.

    ``prev`` is the position before the first (``-1`` at a tensor's start). Value codes are
    written byte-plane-wise: byte ``b`` of code ``i`` goes to ``planes[b, plane_off + i]``.
    Returns ``(bytes written to gaps, bytes taken by the first varint)``.
    """
    g = 0
    first_len = 0
    for i in range(count):
        p = np.int64(pos[i])
        start = g
        g = _put_varint(gaps, g, np.uint64(p - prev - 1))
        prev = p
        if i == 0:
            first_len = g - start
        _put_code(planes, plane_off + i, _zigzag(new[i], old[i], width), width)
    return g, first_len


@numba.njit(nogil=True, cache=True, boundscheck=False)
def decode_gaps(gaps, start, end, count, numel, out_pos):  # pragma: no cover - compiled
    """Parse ``count`` LEB128 gaps from ``gaps[start:end]`` into positions.

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
        out_pos[i] = p
        prev = p
    if g != end:
        return -4
    return g - start


@numba.njit(nogil=True, cache=True, boundscheck=False)
def apply_flat(target, pos, planes, plane_off, count, width):  # pragma: no cover - compiled
    """Write ``target[pos[i]] = unzigzag(old, code_i)`` for ``count`` validated positions."""
    bits = 8 * width
    for i in range(count):
        z = np.uint64(0)
        for b in range(width):
            z |= np.uint64(planes[b, plane_off + i]) << np.uint64(8 * b)
        j = pos[i]
        old = target[j]
        if width == 8:
            target[j] = old ^ z
        else:
            mod = np.int64(1) << bits
            zi = np.int64(z)
            s = zi >> 1 if (zi & 1) == 0 else -((zi + 1) >> 1)
            target[j] = (np.int64(old) + s) & (mod - 1)
    return count


def fused_cast_matches_torch() -> bool:
    """Whether :func:`diff_cast_f32_bf16` reproduces this torch build's fp32 → bf16 cast."""
    import torch

    probe = torch.tensor(
        [0x7FC00000, 0xFFC00000, 0x7F800001, 0xFF800001, 0x7F800000, 0xFF800000, 0x00000000, 0x80000000,
         0x3F808000, 0x3F818000, 0x3F80FFFF, 0x7F7FFFFF, 0x00000001, 0x3EAAAAAB] * 8,
        dtype=torch.int64).to(torch.int32).view(torch.float32)
    want = probe.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    snap = np.zeros(probe.numel(), np.uint16)
    n = probe.numel()
    pos, new, old = np.empty(n, np.int64), np.empty(n, np.uint16), np.empty(n, np.uint16)
    diff_cast_f32_bf16(probe.view(torch.int32).numpy().view(np.uint32), snap, pos, new, old, 0)
    return bool(np.array_equal(snap, want))


@numba.njit(nogil=True, cache=True, boundscheck=False, inline="always")
def _cast_bf16(u):  # pragma: no cover - compiled
    u = np.uint32(u)
    if (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000):
        return np.uint16(0xFFFF)
    return np.uint16((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16))


@numba.njit(nogil=True, cache=True, boundscheck=False)
def diff_encode_flat(src, snap, fused_cast, width, gaps, planes):  # pragma: no cover - compiled
    """Diff one chunk and emit the ``flat`` encoding directly (no intermediate arrays).

    ``src`` holds the current bits (already in the snapshot's dtype), or fp32 bits when
    ``fused_cast`` (cast to bf16 on the fly). Changed elements update ``snap`` and append a
    LEB128 gap (positions relative to the chunk, the first one from -1) to ``gaps`` and a
    zig-zag code to ``planes[:, k]``. Returns ``(changes, gap bytes, bytes of the first
    varint, first position, last position)`` so that chunks can be stitched into one
    stream per tensor.
    """
    n = snap.shape[0]
    nblocks = (n + 63) // 64
    one = np.uint64(1)
    buf = np.empty(64, snap.dtype)
    k = 0
    g = 0
    prev = np.int64(-1)
    first_len = 0
    first_pos = np.int64(-1)
    for b in range(nblocks):
        s = b * 64
        e = min(n, s + 64)
        m = np.uint64(0)
        if fused_cast:
            for i in range(e - s):
                h = _cast_bf16(src[s + i])
                buf[i] = h
                m |= np.uint64(h != snap[s + i]) << np.uint64(i)
        else:
            for i in range(e - s):
                h = src[s + i]
                buf[i] = h
                m |= np.uint64(h != snap[s + i]) << np.uint64(i)
        if m == 0:
            continue
        while m:
            i = np.int64(_cttz64(m))
            m &= m - one
            j = s + i
            h = buf[i]
            o = snap[j]
            snap[j] = h
            start = g
            g = _put_varint(gaps, g, np.uint64(j - prev - 1))
            if k == 0:
                first_pos = j
                first_len = g - start
            prev = j
            _put_code(planes, k, _zigzag(h, o, width), width)
            k += 1
    return k, g, first_len, first_pos, prev


def varint_bytes(value: int) -> bytes:
    """LEB128 encoding of one non-negative integer."""
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)



_WARM: set[int] = set()


def warm_up(widths: tuple[int, ...] = (1, 2, 4, 8)) -> None:
    """Compile (or load from numba's on-disk cache) the kernels for these element widths.

    numba holds the GIL while it compiles, so this belongs in set-up (``init_sender`` /
    ``init_receiver`` call it in a worker thread), not in the first sync, where it would
    stall the event loop.
    """
    todo = [w for w in widths if w not in _WARM]
    if not todo:
        return
    dtypes = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
    for w in todo:
        dt = dtypes[w]
        n = 130
        new, snap = np.ones(n, dt), np.zeros(n, dt)
        pos, nv, ov = np.empty(n, np.int64), np.empty(n, dt), np.empty(n, dt)
        diff_and_update(new, snap.copy(), pos, nv, ov, 0)
        gaps, planes = np.empty(n * 10, np.uint8), np.empty((w, n), np.uint8)
        k, g, _, _, _ = diff_encode_flat(new, snap.copy(), False, w, gaps, planes)
        encode_flat(pos, nv, ov, 0, w, -1, gaps, planes, 0)
        out = np.empty(k, np.int64)
        decode_gaps(gaps, 0, g, k, n, out)
        apply_flat(np.zeros(n, dt), out, planes, 0, k, w)
        if w == 2:
            src = np.ones(n, np.uint32)
            diff_cast_f32_bf16(src, snap.copy(), pos, nv, ov, 0)
            diff_encode_flat(src, snap.copy(), True, w, gaps, planes)
        _WARM.add(w)
