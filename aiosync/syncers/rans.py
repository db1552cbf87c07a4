"""A static-table rANS entropy coder in numba, the back end of the ``ctx`` patch encoding.

rANS ("range asymmetric numeral systems", J. Duda) keeps the coded message in one integer
state. Coding a symbol of probability ``f / 2**PROB_BITS`` grows the state by about
``-log2(f / 2**PROB_BITS)`` bits, so a symbol costs a fraction of a bit when it is likely:
what a prefix code such as zstd's Huffman stage cannot do (it spends at least one bit on every
symbol). This matters here: most changes of an RL step move a value by one unit in the last
place, and most of the elements a position code skips are nearly certain not to change.

The state is kept in ``[RANS_L, RANS_L << 8)`` (a 32-bit integer held in a uint64); it is
renormalised a byte at a time. Encoding runs backwards (the decoder reads symbols in the
reverse of the order they were encoded), so an encoder writes its bytes from the end of a
buffer towards the front and flushes its final state as four little-endian bytes in front of
them; the decoder reads those four bytes first and finishes, after the last symbol, in the
encoder's initial state ``RANS_L`` with every byte consumed (a free integrity check).

Integers are coded as a *symbol* plus *raw bits*: values below ``DIRECT`` are their own
symbol; a larger value of bit length ``b`` is the symbol ``DIRECT + 2 (b - 5) + s`` (``s`` is
its second-highest bit) followed by its ``b - 2`` low bits, coded as uniform symbols of at
most 16 bits, the lowest piece first. The frequency tables are static per patch (built by the
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
RANS_L = 1 << 23
DIRECT = 16
NSYM = DIRECT + 2 * 59 + 2  # symbols of 0 … 2**64 - 1: 136
RAW_PIECE = 16

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


@numba.njit(nogil=True, cache=True, inline="always")
def symbol_base(sym):  # pragma: no cover - compiled
    """Inverse of :func:`symbol_of`: ``(the value with its raw bits zero, raw bit count)``."""
    if sym < DIRECT:
        return np.uint64(sym), np.int64(0)
    b = (sym - DIRECT) // 2 + 5
    s = np.uint64((sym - DIRECT) & 1)
    return (np.uint64(2) | s) << np.uint64(b - 2), b - 2


# ------------------------------------------------------------------- encoding
@numba.njit(nogil=True, cache=True, inline="always")
def _put(x, buf, p, enc, t, sym):  # pragma: no cover - compiled
    """Encode ``sym`` with table ``t``; returns the new state and write index (bytes go to ``buf[:p]``)."""
    xmax = enc[t, sym, _XMAX]
    while x >= xmax:
        p -= 1
        buf[p] = np.uint8(x & np.uint64(0xFF))
        x >>= np.uint64(8)
    q = ((x * enc[t, sym, _RCP]) >> np.uint64(32)) >> enc[t, sym, _SHIFT]
    return x + enc[t, sym, _BIAS] + q * enc[t, sym, _CMPL], p


@numba.njit(nogil=True, cache=True, inline="always")
def _put_raw(x, buf, p, bits, n):  # pragma: no cover - compiled
    """Encode ``n`` (1 … 16) uniform bits ``bits``."""
    xmax = np.uint64(1) << np.uint64(31 - n)
    while x >= xmax:
        p -= 1
        buf[p] = np.uint8(x & np.uint64(0xFF))
        x >>= np.uint64(8)
    return (x << np.uint64(n)) | bits, p


@numba.njit(nogil=True, cache=True, inline="always")
def put_value(x, buf, p, enc, t, v):  # pragma: no cover - compiled
    """Encode the integer ``v`` (uint64) with table ``t``: raw bits first (they decode last)."""
    sym, nraw = symbol_of(v)
    if 0 < nraw <= RAW_PIECE:
        x, p = _put_raw(x, buf, p, v & ((np.uint64(1) << np.uint64(nraw)) - np.uint64(1)), nraw)
    elif nraw:
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
    for k in range(3, -1, -1):
        p -= 1
        buf[p] = np.uint8((x >> np.uint64(8 * k)) & np.uint64(0xFF))
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
    """Read bytes until the state is back in range. Past ``end`` it reads zeros (never outside
    the stream) and still counts: a decoder that ran out ends with its index past ``end``.
    The state of a well-formed stream is never 0, and a malformed one cannot make it 0 either
    (it is at least ``RANS_L >> 16`` after every step), so the loop always ends."""
    while x < np.uint64(RANS_L):
        byte = buf[p] if p < end else np.uint8(0)
        x = (x << np.uint64(8)) | np.uint64(byte)
        p += 1
    return x, p


@numba.njit(nogil=True, cache=True, inline="always")
def get_value(x, buf, p, end, slots, freq, start, t):  # pragma: no cover - compiled
    """Decode one integer with table ``t``; returns ``(value, state, index)``. A stream that
    ran out shows as an index past ``end`` (checked by the caller at the end)."""
    slot = x & np.uint64(PROB_SCALE - 1)
    sym = np.int64(slots[t, slot])
    x = np.uint64(freq[t, sym]) * (x >> np.uint64(PROB_BITS)) + slot - np.uint64(start[t, sym])
    x, p = _refill(x, buf, p, end)
    if sym < DIRECT:
        return np.uint64(sym), x, p
    b = (sym - DIRECT) // 2 + 5
    nraw = b - 2
    v = (np.uint64(2) | np.uint64((sym - DIRECT) & 1)) << np.uint64(nraw)
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
                enc[t, s, _XMAX] = ((RANS_L >> PROB_BITS) << 8) * f
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
