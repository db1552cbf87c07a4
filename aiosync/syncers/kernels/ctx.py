"""Numba kernels of the ``ctx`` patch encoding (context-modelled positions and values).

Both sides know the old value of every element (the sender's snapshot is the receiver's
model), so both can sort elements into *classes* by the magnitude of the old value without
sending anything: ``class = #{k : (old & magmask) >= thr[k]}`` for three per-tensor
thresholds (four classes). Small weights cross a rounding boundary of their dtype far more
often than large ones, so the classes have very different change densities, and coding the
changes of each class as gaps *between elements of that class* approaches the entropy of the
change mask given the old values. Value codes (zig-zag of new − old) are coded with a table
chosen by the old value's exponent. See docs/wire-format.md ("ctx") for the layout.

* :func:`diff_ctx` — the builder: diff a chunk against the snapshot (as
  :func:`~aiosync.syncers.kernels.flat.diff_encode_flat`), update it, and emit one record per change
  (class-local gap, context byte, value code), plus the drift hash and the statistics the next
  build picks its thresholds from; :func:`class_major` joins its per-class gap rows.
* :func:`count_symbols` — histograms of the records' symbols (the numba builder counts them as
  it records; this is for the torch path).

The rANS coding of the records, their decoding and the receiver's write live in
:mod:`aiosync.syncers.kernels.ctx_coder`.
"""

from __future__ import annotations

import numba
import numpy as np

from .flat import GROUP_BLOCKS, _flatten, _load, _popcount64, _width, _zigzag, block_mask, mix64
from .simd import ge_mask
from .rans import NSYM, normalize, symbol_of

N_CLASSES = 4
N_VCTX = 16
N_CONTEXTS = 4 * N_CLASSES + 4 * N_VCTX  # gap tables (width, class), value tables (width, value ctx)
WIDTH_SLOT = {1: 0, 2: 1, 4: 2, 8: 3}  # element width (bytes) -> its slot in the context tables
SEGMENT = 1 << 22  # elements per independently coded segment of a tensor (a format constant)
BINS = 256  # exponent bins of the statistics
#: A build expecting at least ``SAMPLE_MIN`` changes (its tensors' changes in the previous build)
#: counts the symbols of one group of blocks in ``SAMPLE_EVERY``: counting is a sixth of the
#: builder's per-change work, and 2**16 samples or more fix the tables as well as all changes.
SAMPLE_EVERY = 4
SAMPLE_MIN = 1 << 18


@numba.njit(nogil=True, cache=True, boundscheck=False, inline="always")
def exp_bin(bits, mmask, mant_bits, bias):  # pragma: no cover - compiled
    """The statistics bin of an element: its exponent, centred on the dtype's bias, in [0, 255]."""
    e = np.int64((np.uint64(bits) & mmask) >> np.uint64(mant_bits)) - bias + 128
    return min(max(e, 0), BINS - 1)


@numba.njit(nogil=True, cache=True, boundscheck=False, inline="always")
def value_ctx(bits, mmask, mant_bits, vtop):  # pragma: no cover - compiled
    """The value-code context of an element: how many octaves its old value lies below ``vtop``."""
    e = np.int64((np.uint64(bits) & mmask) >> np.uint64(mant_bits))
    return min(max(vtop - e, 0), N_VCTX - 1)


@numba.njit(nogil=True, cache=True, boundscheck=False, inline="always")
def _block_classes(bits, s, e, msk, t1, t2, t3):  # pragma: no cover - compiled
    """The four class masks of block ``bits[s:e]`` (64 elements but for the last block): bit ``i``
    of mask ``c`` is set when element ``s + i`` is of class ``c``. The builder and the decoder
    classify alike: the snapshot the sender diffs against is the receiver's model."""
    if e - s == 64:  # vector compares (kernels_simd)
        a1 = ge_mask(bits, s, msk, t1)
        a2 = ge_mask(bits, s, msk, t2)
        a3 = ge_mask(bits, s, msk, t3)
        valid = np.uint64(0xFFFFFFFFFFFFFFFF)
    else:
        a1 = np.uint64(0)
        a2 = np.uint64(0)
        a3 = np.uint64(0)
        for i in range(e - s):
            v = bits[s + i] & msk
            a1 |= np.uint64(v >= t1) << np.uint64(i)
            a2 |= np.uint64(v >= t2) << np.uint64(i)
            a3 |= np.uint64(v >= t3) << np.uint64(i)
        valid = (np.uint64(1) << np.uint64(e - s)) - np.uint64(1)
    return valid & ~a1, a1 & ~a2, a2 & ~a3, a3


# ------------------------------------------------------------------ the builder
@numba.njit(nogil=True, cache=True, boundscheck=False)
def diff_ctx(src, snap, fused, thr, mm, stat, rec_gap, rec_ctx, rec_z, counts, hc, hn_delta, base, hist,
             wslot, every):  # pragma: no cover
    """Diff one segment, update ``snap``, record every change in position order.

    ``src``/``snap``/``fused`` as in :func:`~aiosync.syncers.kernels.flat.diff_update`; ``thr`` holds
    the three class thresholds and ``mm`` (a one-element array) the magnitude mask, both in
    ``snap``'s dtype. ``stat`` = ``(mant_bits, bias, vtop)``. Change ``k`` gets
    ``rec_ctx[k] = class | value_ctx << 2`` and ``rec_z[k]`` (its zig-zag value code); its gap
    (elements of its class since the previous change of that class, or since the segment start)
    goes to ``rec_gap[class, i]``, ``i`` counting the changes of its class: the gaps come out
    class-major, the order the coder takes them in. ``counts[c]`` counts the changes per class;
    ``hc[bin]`` the changes by the old value's exponent bin and ``hn_delta`` the moves between
    bins (the sender's statistics).
    Returns ``(changes, drift hash)``; the hash sums :func:`mix64` of ``base + j`` and the old
    bits over the changes, modulo 2**64. The records' symbols are added to ``hist`` as
    :func:`count_symbols` would (``wslot``: the width's table slot), in the same pass, but only
    for the changes of one group of ``GROUP_BLOCKS`` blocks in ``every`` (a power of two; 1:
    all): the tables of a large patch come from a sample (:data:`SAMPLE_EVERY`).
    """
    width = _width(snap)
    n = snap.shape[0]
    nblocks = (n + 63) // 64
    t1, t2, t3, msk = thr[0], thr[1], thr[2], mm[0]
    mmask = np.uint64(msk)
    mant_bits, bias, vtop = stat[0], stat[1], stat[2]
    idx = np.empty(GROUP_BLOCKS * 64 + 4, np.int64)
    cms = np.empty((GROUP_BLOCKS, N_CLASSES), np.uint64)  # class masks of the group's blocks
    at = np.zeros((GROUP_BLOCKS, N_CLASSES), np.int64)  # elements of each class before each block
    run = np.zeros(N_CLASSES, np.int64)
    prev = np.full(N_CLASSES, -1, np.int64)  # class-local index of each class's previous change
    for c in range(N_CLASSES):
        counts[c] = 0
    tg = wslot * N_CLASSES
    tv = 4 * N_CLASSES + wslot * N_VCTX
    one = np.uint64(1)
    cnt = 0
    k = 0
    hsum = np.uint64(0)
    g0 = 0
    skip = np.uint64(every - 1)
    for b in range(nblocks):
        s = b * 64
        e = min(n, s + 64)
        m = block_mask(src, snap, s, e, fused)
        lb = b - g0
        cms[lb, 0], cms[lb, 1], cms[lb, 2], cms[lb, 3] = _block_classes(snap, s, e, msk, t1, t2, t3)
        for c in range(N_CLASSES):
            at[lb, c] = run[c]
            run[c] += np.int64(_popcount64(cms[lb, c]))
        cnt = _flatten(m, s, idx, cnt)
        if (b & (GROUP_BLOCKS - 1)) == GROUP_BLOCKS - 1 or b == nblocks - 1:
            ug0 = np.uint64(g0)
            track = (np.uint64(b // GROUP_BLOCKS) & skip) == 0
            for q in range(cnt):  # unsigned indices below: no negative-index wrap-around code
                j = np.uint64(idx[q])
                lb = (j >> np.uint64(6)) - ug0
                bit = j & np.uint64(63)
                cu = ((cms[lb, 1] >> bit) & one) + (((cms[lb, 2] | cms[lb, 3]) >> bit) & one) * np.uint64(2) \
                    + ((cms[lb, 3] >> bit) & one)
                c = np.int64(cu)
                rank = at[lb, cu] + np.int64(_popcount64(cms[lb, cu] & ((one << bit) - one)))
                h = _load(src, j, fused)
                o = np.uint64(snap[j])
                snap[j] = h
                hsum += mix64(np.uint64(base) + j, o)
                gap = rank - prev[cu] - 1
                ku = np.uint64(k)
                rec_gap[cu, np.uint64(counts[cu])] = gap
                counts[cu] += 1
                prev[cu] = rank
                vc = value_ctx(o, mmask, mant_bits, vtop)
                rec_ctx[ku] = np.uint8(c | (vc << 2))
                zz = _zigzag(h, o, width)
                rec_z[ku] = zz
                if track:
                    sg, _ = symbol_of(np.uint64(gap))
                    hist[np.uint64(tg + c), np.uint64(sg)] += 1
                    sv, _ = symbol_of(np.uint64(zz) - one)
                    hist[np.uint64(tv + vc), np.uint64(sv)] += 1
                bo = np.uint64(exp_bin(o, mmask, mant_bits, bias))
                hc[bo] += 1
                bn = np.uint64(exp_bin(h, mmask, mant_bits, bias))
                if bn != bo:
                    hn_delta[bo] -= 1
                    hn_delta[bn] += 1
                k += 1
            cnt = 0
            g0 = b + 1
    return k, hsum


def class_major(rec_gap: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """The gaps :func:`diff_ctx` wrote into the rows of ``rec_gap``, as one class-major array
    (class 0's ``counts[0]`` gaps, then class 1's, …): what the coder takes."""
    return np.concatenate([rec_gap[c, :counts[c]] for c in range(N_CLASSES)])


@numba.njit(nogil=True, cache=True)
def best_split(hn, hc):  # pragma: no cover - compiled
    """Start bins of the (at most) ``N_CLASSES`` contiguous classes of exponent bins minimising
    ``Σ n_c · H(changes_c / n_c)`` (bits to code the change mask given the classes), by dynamic
    programming; ``hn`` / ``hc`` are elements and changes per bin (float64)."""
    size = hn.shape[0]
    cn = np.zeros(size + 1)
    cc = np.zeros(size + 1)
    for i in range(size):
        cn[i + 1] = cn[i] + hn[i]
        cc[i + 1] = cc[i] + hc[i]
    cost = np.zeros((size + 1, size + 1))  # bits of the change mask of bins [i, j) as one class
    for i in range(size):
        for j in range(i + 1, size + 1):
            nn = cn[j] - cn[i]
            ch = cc[j] - cc[i]
            if nn > 0 and 0 < ch < nn:
                p = ch / nn
                cost[i, j] = -nn * (p * np.log2(p) + (1 - p) * np.log2(1 - p))
    kmax = min(N_CLASSES, size)
    best = np.full((kmax + 1, size + 1), np.inf)
    arg = np.zeros((kmax + 1, size + 1), np.int64)
    best[0, 0] = 0.0
    for k in range(1, kmax + 1):
        for j in range(1, size + 1):
            for i in range(k - 1, j):
                v = best[k - 1, i] + cost[i, j]
                if v < best[k, j]:
                    best[k, j] = v
                    arg[k, j] = i
    out = np.zeros(kmax, np.int64)
    j = size
    for k in range(kmax, 0, -1):
        out[k - 1] = arg[k, j]
        j = arg[k, j]
    return out


@numba.njit(nogil=True, cache=True, boundscheck=False)
def exp_histogram(bits, mm, mant_bits, bias, out):  # pragma: no cover - compiled
    """``out[bin] +=`` the elements of ``bits`` in each exponent bin (the snapshot's statistics)."""
    mmask = np.uint64(mm[0])
    for i in range(bits.shape[0]):
        out[exp_bin(bits[i], mmask, mant_bits, bias)] += 1


# ------------------------------------------------------------ symbols and coding
@numba.njit(nogil=True, cache=True, boundscheck=False)
def count_symbols(rec_gap, counts, rec_ctx, rec_z, wslot, hist):  # pragma: no cover - compiled
    """Add the symbols of one segment's records to ``hist[table, symbol]``: its gaps
    (class-major, ``counts[c]`` of class ``c``) to table ``wslot * N_CLASSES + class``, its value
    codes (minus one: never zero) to ``4 * N_CLASSES + wslot * N_VCTX + value context``."""
    i = 0
    for c in range(N_CLASSES):
        for _ in range(counts[c]):
            sg, _ = symbol_of(np.uint64(rec_gap[i]))
            hist[wslot * N_CLASSES + c, sg] += 1
            i += 1
    for i in range(rec_ctx.shape[0]):
        v = np.int64(rec_ctx[i] >> 2)
        sv, _ = symbol_of(np.uint64(rec_z[i]) - np.uint64(1))
        hist[4 * N_CLASSES + wslot * N_VCTX + v, sv] += 1


# ------------------------------------------------------------------- the coding tables
def build_tables(hists: list[np.ndarray], complete: set[int] = frozenset()) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(context ids in use, their frequencies, context → table row map)`` from symbol counts.

    ``complete`` names width slots whose counts are a sample: every context of such a width
    gets a table, and every symbol its records can hold one more count, so that no change
    the sample missed lacks a code (on the bench: 0.15 kB more tables, 0.003 B/changed in all).
    """
    total = hists[0].copy()
    for h in hists[1:]:
        total += h
    for w in complete:
        gaps, values = _context_rows(w)
        total[gaps, :_SYMBOLS_GAP] += 1
        total[values, :_symbols_value(w)] += 1
    used = np.nonzero(total.sum(axis=1))[0]
    freqs = np.zeros((max(1, used.size), NSYM), np.int64)
    for row, cid in enumerate(used):
        freqs[row] = normalize(total[cid])
    tmap = np.full(N_CONTEXTS, -1, np.int64)
    tmap[used] = np.arange(used.size)
    return used, freqs, tmap


def _context_rows(wslot: int) -> tuple[slice, slice]:
    """The rows of width slot ``wslot``'s gap tables and value tables."""
    nc, nv = N_CLASSES, N_VCTX
    return slice(wslot * nc, (wslot + 1) * nc), slice(4 * nc + wslot * nv, 4 * nc + (wslot + 1) * nv)


_SYMBOLS_GAP = int(symbol_of(np.uint64(SEGMENT - 1))[0]) + 1  # gaps lie below a segment


def _symbols_value(wslot: int) -> int:
    """Symbols of a value code minus one: below ``2**(8 * width)``."""
    width = 1 << wslot
    return NSYM if width == 8 else int(symbol_of(np.uint64((1 << 8 * width) - 1))[0]) + 1
