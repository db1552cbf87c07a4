"""A static-table rANS entropy coder in numba, the back end of the ``ctx`` patch encoding.

rANS ("range asymmetric numeral systems", J. Duda) keeps the coded message in one integer
state. Coding a symbol of probability ``f / 2**PROB_BITS`` grows the state by about
``-log2(f / 2**PROB_BITS)`` bits, so a symbol costs a fraction of a bit when it is likely:
what a prefix code such as zstd's Huffman stage cannot do (it spends at least one bit on every
symbol). This matters here: most changes of an RL step move a value by one unit in the last
place, and most of the elements a position code skips are nearly certain not to change.

The state is kept in ``[RANS_L, RANS_L << 16)`` (``RANS_L = 2**15``; a 31-bit integer held in
a uint64) and renormalised 16 bits at a time, so every coding step moves at most one 16-bit
word (no data-dependent loop). Encoding runs backwards (the decoder reads symbols in the
reverse of the order they were encoded), so an encoder writes its words (little-endian) from
the end of a buffer towards the front and flushes its final state as four little-endian bytes
in front of them; the decoder reads those first and finishes, after the last symbol, in the
encoder's initial state ``RANS_L`` with every byte consumed (a free integrity check). Several
states may share one stream (interleaving): each step reads or writes the word of the state
it codes, so the decoder only has to visit the states in the mirror order of the encoder.

Integers are coded as a *symbol* plus *raw bits*: values below ``DIRECT`` are their own
symbol; a larger value of bit length ``b`` is the symbol ``DIRECT + 2 (b - 5) + s`` (``s`` is
its second-highest bit) followed by its ``b - 2`` low bits, coded as uniform symbols of at
most 15 bits, the lowest piece first. The frequency tables are static per patch (built by the
sender from the patch itself, sent with it) and divide ``2**PROB_BITS``; the encoder avoids
division with per-symbol reciprocals.
"""

from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

PROB_BITS = 12
PROB_SCALE = 1 << PROB_BITS
RANS_L = 1 << 15
DIRECT = 16
NSYM = DIRECT + 2 * 59 + 2  # symbols of 0 … 2**64 - 1: 136
RAW_PIECE = 15

# encoder table columns (uint64): x_max, reciprocal, reciprocal shift, bias, complement of freq
_XMAX, _RCP, _SHIFT, _BIAS, _CMPL = range(5)


@intrinsic
def bit_length64(typingctx, x):
    """Bits needed to hold a uint64 (0 for 0): 64 − count-leading-zeros, one instruction."""
    sig = types.int64(types.uint64)

    def codegen(context, builder, signature, args):
        i64 = ir.IntType(64)
        fn = builder.module.declare_intrinsic("llvm.ctlz", [i64], ir.FunctionType(i64, [i64, ir.IntType(1)]))
        lz = builder.call(fn, [args[0], ir.Constant(ir.IntType(1), 0)])
        return builder.sub(ir.Constant(i64, 64), lz)

    return sig, codegen


@numba.njit(nogil=True, cache=True, inline="always")
def symbol_of(v):  # pragma: no cover - compiled
    """``(symbol, raw bit count)`` of the non-negative integer ``v`` (uint64)."""
    if v < np.uint64(DIRECT):
        return np.int64(v), np.int64(0)
    b = bit_length64(v)
    s = np.int64((v >> np.uint64(b - 2)) & np.uint64(1))
    return np.int64(DIRECT + 2 * (b - 5)) + s, b - 2


def _symbol_tables() -> tuple[np.ndarray, np.ndarray]:
    base = np.zeros(NSYM, np.uint64)
    nraw = np.zeros(NSYM, np.int64)
    for sym in range(NSYM):
        if sym < DIRECT:
            base[sym] = sym
        else:
            b = (sym - DIRECT) // 2 + 5
            base[sym] = (2 | ((sym - DIRECT) & 1)) << (b - 2)
            nraw[sym] = b - 2
    return base, nraw


#: per symbol: the smallest value it codes, and how many raw bits follow it
SYM_BASE, SYM_NRAW = _symbol_tables()


# ------------------------------------------------------------------- encoding
@numba.njit(nogil=True, cache=True, inline="always")
def _emit(x, buf, p, xmax):  # pragma: no cover - compiled
    """Renormalise before coding: move the low 16 bits out when the step would overflow. Branch
    free: the word is always stored below ``p`` (free space), ``p`` moves only when it counts."""
    buf[p - 2] = np.uint8(x & np.uint64(0xFF))
    buf[p - 1] = np.uint8((x >> np.uint64(8)) & np.uint64(0xFF))
    m = np.uint64(x >= xmax)
    return x >> (m << np.uint64(4)), p - 2 * np.int64(m)


@numba.njit(nogil=True, cache=True, inline="always")
def _put(x, buf, p, enc, t, sym):  # pragma: no cover - compiled
    """Encode ``sym`` with table ``t``; returns the new state and write index (words go to ``buf[:p]``)."""
    x, p = _emit(x, buf, p, enc[t, sym, _XMAX])
    q = ((x * enc[t, sym, _RCP]) >> np.uint64(32)) >> enc[t, sym, _SHIFT]
    return x + enc[t, sym, _BIAS] + q * enc[t, sym, _CMPL], p


@numba.njit(nogil=True, cache=True, inline="always")
def _put_raw(x, buf, p, bits, n):  # pragma: no cover - compiled
    """Encode ``n`` (0 … 15) uniform bits ``bits``."""
    x, p = _emit(x, buf, p, np.uint64(1) << np.uint64(31 - n))
    return (x << np.uint64(n)) | bits, p


@numba.njit(nogil=True, cache=True, inline="always")
def put_value(x, buf, p, enc, t, v):  # pragma: no cover - compiled
    """Encode the integer ``v`` (uint64) with table ``t``: raw bits first (they decode last)."""
    sym, nraw = symbol_of(v)
    if nraw <= RAW_PIECE:  # branch-free for the usual symbols: zero raw bits is a no-op
        x, p = _put_raw(x, buf, p, v & ((np.uint64(1) << np.uint64(nraw)) - np.uint64(1)), nraw)
    else:
        # pieces of at most RAW_PIECE bits, lowest first when decoding: so the highest goes in first
        npieces = (nraw + RAW_PIECE - 1) // RAW_PIECE
        for k in range(npieces - 1, -1, -1):
            lo = k * RAW_PIECE
            n = min(RAW_PIECE, nraw - lo)
            bits = (v >> np.uint64(lo)) & ((np.uint64(1) << np.uint64(n)) - np.uint64(1))
            x, p = _put_raw(x, buf, p, bits, n)
    return _put(x, buf, p, enc, t, sym)


@numba.njit(nogil=True, cache=True, inline="always")
def flush(x, buf, p):  # pragma: no cover - compiled
    """Write the final state as four little-endian bytes in front of the stream; returns the start."""
    p -= 4
    for k in range(4):
        buf[p + k] = np.uint8((x >> np.uint64(8 * k)) & np.uint64(0xFF))
    return p


# ------------------------------------------------------------------- decoding
@numba.njit(nogil=True, cache=True, inline="always")
def start_state(buf, p, end):  # pragma: no cover - compiled
    """The state flushed by :func:`flush` at ``buf[p:p+4]``; returns ``(state, next index)``
    (``-1`` as index when the stream is shorter than four bytes)."""
    if end - p < 4:
        return np.uint64(0), np.int64(-1)
    x = np.uint64(0)
    for k in range(4):
        x |= np.uint64(buf[p + k]) << np.uint64(8 * k)
    return x, p + 4


@numba.njit(nogil=True, cache=True, inline="always")
def _refill(x, buf, p, end):  # pragma: no cover - compiled
    """Read one 16-bit word when the state fell below ``RANS_L`` (after any coding step one word
    restores it), without a branch. The word is read at ``min(p, end - 2)`` (never outside the
    stream) and the index still counts: a decoder that ran out of a malformed stream ends with
    its index past ``end``. Streams are at least 8 bytes long (the two flushed states)."""
    q = min(p, end - 2)
    w = np.uint64(buf[q]) | (np.uint64(buf[q + 1]) << np.uint64(8))
    m = np.uint64(x < np.uint64(RANS_L))
    x = (x << (m << np.uint64(4))) | (w & (np.uint64(0) - m))
    return x, p + 2 * np.int64(m)


@numba.njit(nogil=True, cache=True, inline="always")
def get_value(x, buf, p, end, slots, freq, start, t):  # pragma: no cover - compiled
    """Decode one integer with table ``t``; returns ``(value, state, index)``. A stream that
    ran out shows as an index past ``end`` (checked by the caller)."""
    slot = x & np.uint64(PROB_SCALE - 1)
    sym = np.int64(slots[t, slot])
    x = np.uint64(freq[t, sym]) * (x >> np.uint64(PROB_BITS)) + slot - np.uint64(start[t, sym])
    x, p = _refill(x, buf, p, end)
    v = SYM_BASE[sym]
    nraw = SYM_NRAW[sym]
    if nraw <= RAW_PIECE:  # branch-free for the usual symbols: zero raw bits is a no-op
        v |= x & ((np.uint64(1) << np.uint64(nraw)) - np.uint64(1))
        x >>= np.uint64(nraw)
        x, p = _refill(x, buf, p, end)
        return v, x, p
    lo = 0
    while lo < nraw:
        n = min(RAW_PIECE, nraw - lo)
        v |= (x & ((np.uint64(1) << np.uint64(n)) - np.uint64(1))) << np.uint64(lo)
        x >>= np.uint64(n)
        x, p = _refill(x, buf, p, end)
        lo += n
    return v, x, p


# --------------------------------------------------------------------- tables
def normalize(counts: np.ndarray) -> np.ndarray:
    """Frequencies summing to ``PROB_SCALE`` from symbol counts (a symbol seen gets at least 1)."""
    counts = np.asarray(counts, np.int64)
    total = int(counts.sum())
    freq = np.zeros(counts.size, np.int64)
    if total == 0:
        return freq
    seen = counts > 0
    freq[seen] = np.maximum(1, (counts[seen] * PROB_SCALE + total // 2) // total)
    excess = int(freq.sum()) - PROB_SCALE
    order = np.argsort(-counts, kind="stable")
    while excess:  # move the rounding error onto the most frequent symbols
        for s in order[: max(1, int(seen.sum()))]:
            if excess > 0 and freq[s] > 1:
                freq[s] -= 1
                excess -= 1
            elif excess < 0:
                freq[s] += 1
                excess += 1
            if not excess:
                break
    return freq


def encoder_tables(freqs: np.ndarray) -> np.ndarray:
    """Per table and symbol: ``x_max``, reciprocal, shift, bias, ``PROB_SCALE − f`` (uint64)."""
    n_tables, nsym = freqs.shape
    enc = np.zeros((n_tables, nsym, 5), np.uint64)
    for t in range(n_tables):
        cum = 0
        for s in range(nsym):
            f = int(freqs[t, s])
            if f:
                enc[t, s, _XMAX] = ((RANS_L >> PROB_BITS) << 16) * f
                enc[t, s, _CMPL] = PROB_SCALE - f
                if f == 1:  # q = x − 1 with the all-ones reciprocal: C(x) = x·2**PROB_BITS + start
                    enc[t, s, _RCP], enc[t, s, _SHIFT], enc[t, s, _BIAS] = 0xFFFFFFFF, 0, cum + PROB_SCALE - 1
                else:  # q = floor(x / f) for every state x < 2**31
                    shift = (f - 1).bit_length()
                    enc[t, s, _RCP] = ((1 << (shift + 31)) + f - 1) // f
                    enc[t, s, _SHIFT], enc[t, s, _BIAS] = shift - 1, cum
            cum += f
    return enc


def decoder_tables(freqs: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(slot → symbol, freq, start)`` per table, for :func:`get_value`."""
    n_tables, nsym = freqs.shape
    slots = np.zeros((n_tables, PROB_SCALE), np.uint8)
    start = np.zeros((n_tables, nsym), np.uint32)
    for t in range(n_tables):
        f = freqs[t].astype(np.int64)
        cum = np.concatenate([[0], np.cumsum(f)])
        start[t] = cum[:-1]
        if cum[-1] == PROB_SCALE:  # (a placeholder row of zeros decodes nothing)
            slots[t] = np.repeat(np.arange(nsym, dtype=np.uint8), f)
    return slots, freqs.astype(np.uint32), start
