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
    """``(symbol, raw bit count)`` of the non-negative integer ``v`` (uint64); branch free (gaps
    mix small and large values unpredictably)."""
    b = bit_length64(v | np.uint64(DIRECT))  # at least 5
    big = np.int64(DIRECT + 2 * (b - 5)) + np.int64((v >> np.uint64(b - 2)) & np.uint64(1))
    small = v < np.uint64(DIRECT)
    return (np.int64(v) if small else big), (np.int64(0) if small else b - 2)


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


@intrinsic
def load_u16(typingctx, buf, q):
    """The little-endian 16-bit word at byte ``q`` of the uint8 array ``buf``: one unaligned load
    (every host numba targets is little-endian)."""
    sig = types.uint64(buf, types.int64)

    def codegen(context, builder, signature, args):
        ary = context.make_array(signature.args[0])(context, builder, args[0])
        ptr = builder.gep(ary.data, [args[1]])
        word = builder.load(builder.bitcast(ptr, ir.IntType(16).as_pointer()), align=1)
        return builder.zext(word, ir.IntType(64))

    return sig, codegen


@intrinsic
def store_u16(typingctx, buf, q, x):
    """Store the low 16 bits of ``x`` little-endian at byte ``q`` of the uint8 array ``buf``: one
    unaligned store."""
    sig = types.void(buf, types.int64, types.uint64)

    def codegen(context, builder, signature, args):
        ary = context.make_array(signature.args[0])(context, builder, args[0])
        ptr = builder.gep(ary.data, [args[1]])
        builder.store(builder.trunc(args[2], ir.IntType(16)), builder.bitcast(ptr, ir.IntType(16).as_pointer()), align=1)
        return context.get_dummy_value()

    return sig, codegen


# ------------------------------------------------------------------- encoding
@numba.njit(nogil=True, cache=True, inline="always")
def _emit(x, buf, p, xmax):  # pragma: no cover - compiled
    """Renormalise before coding: move the low 16 bits out when the step would overflow. Branch
    free: the word is always stored below ``p`` (free space), ``p`` moves only when it counts."""
    store_u16(buf, p - 2, x)
    m = np.uint64(x >= xmax)
    return x >> (m << np.uint64(4)), p - 2 * np.int64(m)


@numba.njit(nogil=True, cache=True, inline="always")
def _put(x, buf, p, enc, t, sym):  # pragma: no cover - compiled
    """Encode ``sym`` with table ``t``; returns the new state and write index (words go to ``buf[:p]``)."""
    tu, su = np.uint64(t), np.uint64(sym)  # unsigned indices: no negative-index wrap-around code
    x, p = _emit(x, buf, p, enc[tu, su, _XMAX])
    q = ((x * enc[tu, su, _RCP]) >> np.uint64(32)) >> enc[tu, su, _SHIFT]
    return x + enc[tu, su, _BIAS] + q * enc[tu, su, _CMPL], p


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
def _refill(x, buf, p, lim):  # pragma: no cover - compiled
    """Read one 16-bit word when the state fell below ``RANS_L`` (after any coding step one word
    restores it), without a branch. The word is read at ``min(p, lim - 2)`` (``lim``: the end of
    the buffer, so never outside it) and the index still counts: a decoder that ran out of a
    malformed stream ends with its index past its stream's end (the caller checks). Streams are
    at least 4 bytes long (the flushed state)."""
    w = load_u16(buf, min(p, lim - 2))
    m = np.uint64(x < np.uint64(RANS_L))
    x = (x << (m << np.uint64(4))) | (w & (np.uint64(0) - m))
    return x, p + 2 * np.int64(m)


@numba.njit(nogil=True, cache=True, inline="always")
def get_value(x, buf, p, lim, slots, freq, start, t):  # pragma: no cover - compiled
    """Decode one integer with table ``t`` (``0 <= t < tables``: unchecked); returns ``(value,
    state, index)``. Words are read below ``lim`` (the buffer's end, see :func:`_refill`); a
    stream that ran out shows as an index past its end (checked by the caller)."""
    slot = x & np.uint64(PROB_SCALE - 1)
    tu = np.uint64(t)  # unsigned indices: no negative-index wrap-around code
    sym = slots[tu, slot]
    x = np.uint64(freq[tu, sym]) * (x >> np.uint64(PROB_BITS)) + slot - np.uint64(start[tu, sym])
    x, p = _refill(x, buf, p, lim)
    v = SYM_BASE[sym]
    nraw = SYM_NRAW[sym]
    if nraw <= RAW_PIECE:  # branch-free for the usual symbols: zero raw bits is a no-op
        v |= x & ((np.uint64(1) << np.uint64(nraw)) - np.uint64(1))
        x >>= np.uint64(nraw)
        x, p = _refill(x, buf, p, lim)
        return v, x, p
    lo = 0
    while lo < nraw:
        n = min(RAW_PIECE, nraw - lo)
        v |= (x & ((np.uint64(1) << np.uint64(n)) - np.uint64(1))) << np.uint64(lo)
        x >>= np.uint64(n)
        x, p = _refill(x, buf, p, lim)
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
    f = np.asarray(freqs, np.int64)
    cum = np.cumsum(f, axis=1) - f
    enc = np.zeros((*f.shape, 5), np.uint64)
    seen = f > 0
    enc[..., _XMAX] = np.where(seen, ((RANS_L >> PROB_BITS) << 16) * f, 0)
    enc[..., _CMPL] = np.where(seen, PROB_SCALE - f, 0)
    # f == 1: q = x − 1 with the all-ones reciprocal, C(x) = x·2**PROB_BITS + start
    # else:   q = floor(x / f) for every state x < 2**31
    shift = np.zeros_like(f)
    many = f > 1
    shift[many] = np.ceil(np.log2(f[many])).astype(np.int64)  # (f − 1).bit_length(), exact for f ≤ 2**12
    fs = np.maximum(f, 1)
    rcp = ((np.int64(1) << (shift + 31)) + fs - 1) // fs  # below 2**44: exact in int64
    enc[..., _RCP] = np.where(many, rcp, np.where(f == 1, 0xFFFFFFFF, 0)).astype(np.uint64)
    enc[..., _SHIFT] = np.where(many, shift - 1, 0)
    enc[..., _BIAS] = np.where(many, cum, np.where(f == 1, cum + PROB_SCALE - 1, 0))
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
