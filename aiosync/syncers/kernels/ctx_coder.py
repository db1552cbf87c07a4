"""Numba kernels that code the ``ctx`` patch encoding's records: the rANS streams of a segment,
their decoding against the receiver's old values, and the receiver's write.

A segment's changes are coded as ``2 L`` independent rANS streams (``L`` = :func:`lanes`):
``L`` gap streams, then ``L`` value streams. Gaps are taken *class-major* (every gap of class
0 in position order, then class 1, …) and dealt round-robin to the gap lanes; value codes are
taken in position order and dealt round-robin to the value lanes. Each lane has its own state
and its own bytes, so a decoder runs ``L`` dependency chains side by side; one rANS chain alone
is latency-bound (each symbol's table lookup waits for the previous symbol's state).

The receiver decodes in three passes per segment:

1. every gap (``L`` lanes at a time), summed per class into *ranks* (the class-local index of
   each change), marked in one bitset per class;
2. one pass over its old values: per block of 64 elements the four class masks
   (:func:`~aiosync.syncers.kernels.ctx._block_classes`), and the block's change mask as the
   OR over classes of the class's next ``popcount`` rank bits deposited (``pdep``) into its
   class mask; its set bits are the change positions, in position order;
3. every value code (``L`` lanes at a time), each with the table of its old value's exponent.

Every malformation is a negative return code; nothing is written before the whole segment
decoded.
"""

from __future__ import annotations

import numba
import numpy as np
from llvmlite import binding as llvm
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from .flat import _flatten, _popcount64, _width, mix64, unzigzag
from .ctx import N_CLASSES, N_VCTX, _block_classes, value_ctx
from .simd import PREFETCH_BLOCKS, prefetch_block
from .rans import RANS_L, flush, get_value, put_value, start_state

#: lanes of a segment with at least this many changes (fewer: one lane; four more streams cost
#: about 36 bytes of flushed states and lengths, under 1.2 % of such a segment's patch)
LANES_MIN = 4096
MAX_LANES = 4
POS_GROUP = 64  # blocks of 64 elements the positions pass takes before it looks up their value tables


@numba.njit(nogil=True, cache=True, inline="always")
def lanes(total):  # pragma: no cover - compiled
    """Lanes (independent rANS streams per kind) of a segment with ``total`` changes."""
    return MAX_LANES if total >= LANES_MIN else 1


def stream_count(total: int) -> int:
    """Streams of a segment with ``total`` changes: none when empty, else ``2 * lanes``."""
    return 0 if total == 0 else 2 * lanes(total)


def stream_bound(total: int) -> int:
    """Bytes one stream of a segment with ``total`` changes may take: four for its state, at
    most twelve per value (a symbol and five raw pieces) with slack."""
    return 8 + 20 * (-(-total // lanes(total)) + 4)


def encode_streams(rec_gap, rec_ctx, rec_z, counts, enc, tmap, wslot) -> tuple[np.ndarray, list[int]]:
    """One segment's records coded (:func:`encode_segment`; ``counts``: its changes per class):
    its streams back to back, and the length of each (none for a segment without changes)."""
    n = int(counts.sum())
    ns = stream_count(n)
    if not ns:
        return np.empty(0, np.uint8), []
    bound = stream_bound(n)
    buf = np.empty(ns * bound, np.uint8)
    ends = np.arange(1, ns + 1, dtype=np.int64) * bound
    starts = np.empty(ns, np.int64)
    encode_segment(rec_gap, rec_ctx, rec_z, n, counts, enc, tmap, wslot, buf, ends, starts)
    parts = [buf[a:b] for a, b in zip(starts, ends)]
    return np.concatenate(parts), [p.size for p in parts]


# ------------------------------------------------------------------ the sender
@numba.njit(nogil=True, cache=True, boundscheck=False)
def _encode_gaps(gaps, nl, enc, t, buf, x, p):  # pragma: no cover - compiled
    """Code one class's gaps (table ``t``): gap ``j`` into gap lane ``j % nl`` (states ``x``,
    write indices ``p``), each lane backwards, the mirror of the decoder's order."""
    i = gaps.shape[0] - 1
    while i >= 0 and (i & (nl - 1)) != nl - 1:  # the partial group at the end, one lane each
        s = i & (nl - 1)
        x[s], p[s] = put_value(x[s], buf, p[s], enc, t, np.uint64(gaps[i]))
        i -= 1
    if nl == 4:
        x0, x1, x2, x3 = x[0], x[1], x[2], x[3]
        p0, p1, p2, p3 = p[0], p[1], p[2], p[3]
        while i >= 3:
            x3, p3 = put_value(x3, buf, p3, enc, t, np.uint64(gaps[i]))
            x2, p2 = put_value(x2, buf, p2, enc, t, np.uint64(gaps[i - 1]))
            x1, p1 = put_value(x1, buf, p1, enc, t, np.uint64(gaps[i - 2]))
            x0, p0 = put_value(x0, buf, p0, enc, t, np.uint64(gaps[i - 3]))
            i -= 4
        x[0], x[1], x[2], x[3] = x0, x1, x2, x3
        p[0], p[1], p[2], p[3] = p0, p1, p2, p3
    else:
        while i >= 0:
            x[0], p[0] = put_value(x[0], buf, p[0], enc, t, np.uint64(gaps[i]))
            i -= 1


@numba.njit(nogil=True, cache=True, boundscheck=False, inline="always")
def _vput(x, buf, p, enc, tmap, tv, c, z):  # pragma: no cover - compiled
    """Code one value code ``z`` (context byte ``c``)."""
    return put_value(x, buf, p, enc, tmap[np.uint64(tv + (c >> 2))], np.uint64(z) - np.uint64(1))


@numba.njit(nogil=True, cache=True, boundscheck=False)
def _encode_values(rec_ctx, rec_z, n, nl, enc, tmap, tv, buf, x, p):  # pragma: no cover - compiled
    """Code the value codes (position order): code ``k`` into value lane ``k % nl`` (states
    ``x[nl:]``), each lane backwards."""
    i = n - 1
    while i >= 0 and (i & (nl - 1)) != nl - 1:
        s = nl + (i & (nl - 1))
        x[s], p[s] = _vput(x[s], buf, p[s], enc, tmap, tv, rec_ctx[i], rec_z[i])
        i -= 1
    if nl == 4:
        x0, x1, x2, x3 = x[4], x[5], x[6], x[7]
        p0, p1, p2, p3 = p[4], p[5], p[6], p[7]
        while i >= 3:
            x3, p3 = _vput(x3, buf, p3, enc, tmap, tv, rec_ctx[i], rec_z[i])
            x2, p2 = _vput(x2, buf, p2, enc, tmap, tv, rec_ctx[i - 1], rec_z[i - 1])
            x1, p1 = _vput(x1, buf, p1, enc, tmap, tv, rec_ctx[i - 2], rec_z[i - 2])
            x0, p0 = _vput(x0, buf, p0, enc, tmap, tv, rec_ctx[i - 3], rec_z[i - 3])
            i -= 4
        x[4], x[5], x[6], x[7] = x0, x1, x2, x3
        p[4], p[5], p[6], p[7] = p0, p1, p2, p3
    else:
        while i >= 0:
            x[1], p[1] = _vput(x[1], buf, p[1], enc, tmap, tv, rec_ctx[i], rec_z[i])
            i -= 1


@numba.njit(nogil=True, cache=True, boundscheck=False)
def encode_segment(rec_gap, rec_ctx, rec_z, n, counts, enc, tmap, wslot, buf, ends, starts):  # pragma: no cover
    """rANS-code one segment's ``n`` records (as the builder wrote them: gaps class-major,
    ``counts[c]`` of class ``c``; contexts and value codes in position order).

    Stream ``s`` (``0 … 2 L − 1``: gap lanes, then value lanes) is written backwards into
    ``buf`` ending at ``ends[s]``; its start goes to ``starts[s]``. ``tmap`` maps context ids
    to rows of ``enc``; tables: gaps ``wslot * N_CLASSES + class``, value codes (minus one:
    never zero) ``4 * N_CLASSES + wslot * N_VCTX + value context``. Gap ``j`` of a class goes
    to gap lane ``j % L`` (each class starts again at lane 0), value code ``k`` (position
    order) to value lane ``k % L``.
    """
    nl = lanes(n)
    tg = wslot * N_CLASSES
    off = np.zeros(N_CLASSES + 1, np.int64)
    for c in range(N_CLASSES):
        off[c + 1] = off[c] + counts[c]
    x = np.full(2 * nl, np.uint64(RANS_L))
    p = ends[:2 * nl].copy()
    for c in range(N_CLASSES - 1, -1, -1):  # lanes are decoded class 0 first: coded class 3 first
        if off[c + 1] > off[c]:
            _encode_gaps(rec_gap[off[c]:off[c + 1]], nl, enc, tmap[tg + c], buf, x, p)
    _encode_values(rec_ctx, rec_z, n, nl, enc, tmap, 4 * N_CLASSES + wslot * N_VCTX, buf, x, p)
    for s in range(2 * nl):
        starts[s] = flush(x[s], buf, p[s])


# ------------------------------------------------------------------ the receiver
@intrinsic
def _pdep64(typingctx, src, mask):
    """BMI2 parallel bit deposit (x86-64)."""
    sig = types.uint64(types.uint64, types.uint64)

    def codegen(context, builder, signature, args):
        i64 = ir.IntType(64)
        fn = builder.module.declare_intrinsic("llvm.x86.bmi.pdep.64", fnty=ir.FunctionType(i64, [i64, i64]))
        return builder.call(fn, args)

    return sig, codegen


def _fast_pdep() -> bool:
    """pdep is one fast instruction on Intel since Haswell and AMD since Zen 3 (microcoded before)."""
    try:
        features = llvm.get_host_cpu_features()
        name = llvm.get_host_cpu_name()
    except Exception:  # pragma: no cover - exotic hosts
        return False
    return bool(features.get("bmi2", False)) and name not in ("znver1", "znver2", "bdver4", "generic")


FAST_PDEP = _fast_pdep()


@numba.njit(nogil=True, cache=True, inline="always")
def _deposit(src, mask):  # pragma: no cover - compiled
    """The low ``popcount(mask)`` bits of ``src`` moved to the set bits of ``mask`` (pdep)."""
    if FAST_PDEP:
        return _pdep64(src, mask)
    out = np.uint64(0)
    one = np.uint64(1)
    b = one
    while mask:
        low = mask & (np.uint64(0) - mask)
        if src & b:
            out |= low
        mask ^= low
        b <<= one
    return out


@numba.njit(nogil=True, cache=True, boundscheck=False, inline="always")
def _window(bits, r):  # pragma: no cover - compiled
    """Bits ``r … r + 63`` of the bitset ``bits`` (it has a spare word past its end)."""
    u = np.uint64(r)  # unsigned indices: no negative-index wrap-around code
    q = u >> np.uint64(6)
    sh = u & np.uint64(63)
    return (bits[q] >> sh) | ((bits[q + np.uint64(1)] << (np.uint64(63) - sh)) << np.uint64(1))


@numba.njit(nogil=True, cache=True, boundscheck=False, inline="always")
def _mark(bits, r, g, n):  # pragma: no cover - compiled
    """The rank after gap ``g`` (``r + g + 1``, at most ``n``), marked in ``bits``."""
    r = min(r + np.int64(min(g, np.uint64(n))) + 1, n)
    u = np.uint64(r)  # unsigned indices: no negative-index wrap-around code
    bits[u >> np.uint64(6)] |= np.uint64(1) << (u & np.uint64(63))
    return r


@numba.njit(nogil=True, cache=True, boundscheck=False)
def _decode_gaps(buf, xs, ps, total, counts, slots, freq, start, tmap, tg, bits, n):  # pragma: no cover
    """Pass 1: every gap, class-major, from the gap lanes (states ``xs``, read indices ``ps``:
    updated); gap ``j`` of a class comes from lane ``j % L``. Each class's ranks (class-local
    indices of its changes) are marked in its row of ``bits``. Returns False when a rank falls
    outside the segment."""
    nl = lanes(total)
    lim = buf.shape[0]
    ok = True
    for c in range(N_CLASSES):
        m = counts[c]
        t = tmap[tg + c]
        row = bits[c]
        r = np.int64(-1)
        j = 0
        if nl == 4 and m >= 4:
            x0, x1, x2, x3 = xs[0], xs[1], xs[2], xs[3]
            p0, p1, p2, p3 = ps[0], ps[1], ps[2], ps[3]
            while j + 4 <= m:
                g0, x0, p0 = get_value(x0, buf, p0, lim, slots, freq, start, t)
                g1, x1, p1 = get_value(x1, buf, p1, lim, slots, freq, start, t)
                g2, x2, p2 = get_value(x2, buf, p2, lim, slots, freq, start, t)
                g3, x3, p3 = get_value(x3, buf, p3, lim, slots, freq, start, t)
                r = _mark(row, _mark(row, _mark(row, _mark(row, r, g0, n), g1, n), g2, n), g3, n)
                j += 4
            xs[0], xs[1], xs[2], xs[3] = x0, x1, x2, x3
            ps[0], ps[1], ps[2], ps[3] = p0, p1, p2, p3
        while j < m:
            s = j & (nl - 1)
            g, xs[s], ps[s] = get_value(xs[s], buf, ps[s], lim, slots, freq, start, t)
            r = _mark(row, r, g, n)
            j += 1
        ok &= r < n
    return ok


@numba.njit(nogil=True, cache=True, boundscheck=False)
def _decode_values(buf, xs, ps, total, vtab, slots, freq, start, zmax, out_z):  # pragma: no cover - compiled
    """Pass 3: every value code, in position order, from the value lanes; ``vtab[k]`` is the
    table of change ``k`` (``-1``: its context has none). Returns -5 when a table is missing,
    -3 when a code does not fit the dtype, else 0."""
    nl = lanes(total)
    lim = buf.shape[0]
    one = np.uint64(1)
    bad_t = False
    bad_v = False
    k = 0
    if nl == 4:
        x0, x1, x2, x3 = xs[0], xs[1], xs[2], xs[3]
        p0, p1, p2, p3 = ps[0], ps[1], ps[2], ps[3]
        while k + 4 <= total:
            t0, t1, t2, t3 = vtab[k], vtab[k + 1], vtab[k + 2], vtab[k + 3]
            bad_t |= (t0 | t1 | t2 | t3) < 0
            v0, x0, p0 = get_value(x0, buf, p0, lim, slots, freq, start, max(t0, 0))
            v1, x1, p1 = get_value(x1, buf, p1, lim, slots, freq, start, max(t1, 0))
            v2, x2, p2 = get_value(x2, buf, p2, lim, slots, freq, start, max(t2, 0))
            v3, x3, p3 = get_value(x3, buf, p3, lim, slots, freq, start, max(t3, 0))
            bad_v |= (v0 >= zmax) | (v1 >= zmax) | (v2 >= zmax) | (v3 >= zmax)
            out_z[k], out_z[k + 1], out_z[k + 2], out_z[k + 3] = v0 + one, v1 + one, v2 + one, v3 + one
            k += 4
        xs[0], xs[1], xs[2], xs[3] = x0, x1, x2, x3
        ps[0], ps[1], ps[2], ps[3] = p0, p1, p2, p3
    while k < total:
        s = k & (nl - 1)
        t = vtab[k]
        bad_t |= t < 0
        v, xs[s], ps[s] = get_value(xs[s], buf, ps[s], lim, slots, freq, start, max(t, 0))
        bad_v |= v >= zmax
        out_z[k] = v + one
        k += 1
    if bad_t:
        return -5
    return -3 if bad_v else 0


@numba.njit(nogil=True, cache=True, boundscheck=False)
def _positions(old, s0, s1, bits, run, thr, mm, pos, k):  # pragma: no cover - compiled
    """Pass 2 over elements ``[s0, s1)`` (``s0`` a multiple of 64): each block's change mask is
    the OR over classes of the class's next rank bits (``run[c]``: the class's elements before
    the block) deposited into its class mask; its set bits go to ``pos[k:]`` as indices into
    ``old``. Returns the new count (``pos`` needs 64 spare entries)."""
    t1, t2, t3, msk = thr[0], thr[1], thr[2], mm[0]
    r0, r1, r2, r3 = run[0], run[1], run[2], run[3]
    for s in range(s0, s1, 64):
        prefetch_block(old, s + PREFETCH_BLOCKS * 64)
        m0, m1, m2, m3 = _block_classes(old, s, min(s1, s + 64), msk, t1, t2, t3)
        m = (_deposit(_window(bits[0], r0), m0) | _deposit(_window(bits[1], r1), m1)
             | _deposit(_window(bits[2], r2), m2) | _deposit(_window(bits[3], r3), m3))
        r0 += np.int64(_popcount64(m0))
        r1 += np.int64(_popcount64(m1))
        r2 += np.int64(_popcount64(m2))
        r3 += np.int64(_popcount64(m3))
        k = _flatten(m, s, pos, k)
    run[0], run[1], run[2], run[3] = r0, r1, r2, r3
    return k


@numba.njit(nogil=True, cache=True, boundscheck=False)
def _value_tables(old, pos, k0, k1, mmask, mant_bits, vtop, tmap, tv, vtab, base):  # pragma: no cover
    """The value table of changes ``k0 … k1 - 1`` (from the old value at ``pos[k]``, an index
    into ``old``); ``pos[k]`` becomes ``base + index``."""
    for q in range(k0, k1):
        j = pos[q]
        vtab[q] = tmap[np.uint64(tv + value_ctx(old[np.uint64(j)], mmask, mant_bits, vtop))]
        pos[q] = base + j


@numba.njit(nogil=True, cache=True, boundscheck=False)
def decode_segment(old, buf, bounds, thr, mm, stat, counts, slots, freq, start, tmap, wslot, out_pos, out_z,
                   base):  # pragma: no cover - compiled
    """Decode one segment against the receiver's old bits ``old`` (the segment's elements, read
    only): positions (``base`` + index, into ``out_pos``) and value codes (``out_z``), in position
    order. Stream ``s`` of the segment is ``buf[bounds[s]:bounds[s + 1]]`` (``2 L`` streams, see
    the module docstring). ``counts`` are the changes per class the patch announces; ``tmap``
    maps context ids to table rows (``-1``: no table). Returns the number of changes, or a
    negative error: -1 a stream ends early, -2 a change lies beyond the segment or its class,
    -3 a value code out of range for the dtype, -4 bytes left over, a wrong final state or a
    wrong number of streams, -5 a symbol of a context without a table.
    """
    width = _width(old)
    n = old.shape[0]
    mmask = np.uint64(mm[0])
    mant_bits, vtop = stat[0], stat[2]
    zmax = np.uint64(0xFFFFFFFFFFFFFFFF) if width == 8 else (np.uint64(1) << np.uint64(8 * width)) - np.uint64(1)
    tg = wslot * N_CLASSES
    tv = 4 * N_CLASSES + wslot * N_VCTX
    total = 0
    for c in range(N_CLASSES):
        total += counts[c]
        if counts[c] and tmap[tg + c] < 0:
            return -5
    if total == 0:
        return 0 if bounds.shape[0] == 1 or bounds[-1] == bounds[0] else -4
    nl = lanes(total)
    if bounds.shape[0] != 2 * nl + 1:
        return -4
    ns = 2 * nl
    xs = np.empty(ns, np.uint64)
    ps = np.empty(ns, np.int64)
    es = bounds[1:]
    for s in range(ns):
        xs[s], ps[s] = start_state(buf, bounds[s], bounds[s + 1])
        if ps[s] < 0:
            return -1
    # 1: gaps → ranks, marked in one bitset per class
    bits = np.zeros((N_CLASSES, ((n + 63) >> 6) + 2), np.uint64)
    ranks_ok = _decode_gaps(buf, xs, ps, total, counts, slots, freq, start, tmap, tg, bits, n)
    for s in range(nl):
        if ps[s] > es[s]:
            return -1
    if not ranks_ok:
        return -2
    # 2: positions, by the receiver's own classes, a group of blocks at a time (then the value
    # tables of the group's changes, while its old values are in cache)
    pos = np.empty(total + 68, np.int64)
    vtab = np.empty(total + 68, np.int64)
    run = np.zeros(N_CLASSES, np.int64)
    k = 0
    for g0 in range(0, n, 64 * POS_GROUP):
        g1 = min(n, g0 + 64 * POS_GROUP)
        k1 = min(_positions(old, g0, g1, bits, run, thr, mm, pos, k), total)
        _value_tables(old, pos, k, k1, mmask, mant_bits, vtop, tmap, tv, vtab, base)
        k = k1
        if k >= total:
            break
    if k != total:  # a rank past its class's last element: its change lies beyond the segment
        return -2
    # 3: value codes
    rc = _decode_values(buf, xs[nl:], ps[nl:], total, vtab, slots, freq, start, zmax, out_z)
    if rc < 0:
        return rc
    for s in range(ns):
        if ps[s] > es[s]:
            return -1
    for s in range(ns):
        if ps[s] != es[s] or xs[s] != np.uint64(RANS_L):
            return -4
    out_pos[:total] = pos[:total]
    return total


@numba.njit(nogil=True, cache=True, boundscheck=False)
def write_codes(target, pos, z, out_old):  # pragma: no cover - compiled
    """The ``ctx`` patch writer: ``target[pos[i]]`` moves by value code ``z[i]``; the overwritten
    bits go to ``out_old`` (the write's journal, for :func:`restore_codes`). Returns their drift
    hash (the sum of :func:`mix64` over the changes, modulo 2**64)."""
    width = _width(target)
    h = np.uint64(0)
    for i in range(pos.shape[0]):
        j = pos[i]
        o = target[j]
        out_old[i] = o
        h += mix64(j, o)
        target[j] = unzigzag(o, np.uint64(z[i]), width)
    return h


@numba.njit(nogil=True, cache=True, boundscheck=False)
def restore_codes(target, pos, old):  # pragma: no cover - compiled
    """Undo :func:`write_codes`."""
    for i in range(pos.shape[0]):
        target[pos[i]] = old[i]
