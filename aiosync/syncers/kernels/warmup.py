"""Compiling the numba kernels ahead of use (or loading them from numba's on-disk cache).

numba holds the GIL while it compiles, so warming up belongs in set-up, in a worker thread
(``init_sender`` / ``init_receiver`` / staging do it), never in the first sync, where it would
stall the event loop.
"""

from __future__ import annotations

import numpy as np

_WARM: set[int] = set()
_WARM_CTX: set[int] = set()
_DTYPES = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def warm_up(widths: tuple[int, ...] = (1, 2, 4, 8), ctx: bool = True) -> None:
    """Compile (or load from numba's on-disk cache) the kernels for these element widths
    (bytes per element; the default covers every dtype), and with ``ctx`` those of the ``ctx``
    encoding too (a few seconds more to compile on a cold cache; syncers of other encodings
    leave them out and compile them on a first ``ctx`` patch). Public as ``aiosync.warm_up()``.

    aiosync calls it in a worker thread when a syncer pair is set up (``init_sender`` /
    ``init_receiver``, staging), never in a sync. numba's and LLVM's initialisation holds the
    GIL even there (about 0.1 s of loop stall once per process); call this before starting the
    event loop to keep that off it too. Idempotent and cheap once done.
    """
    _warm_digest()
    for w in widths:
        _warm_base(w)
        if ctx and w not in _WARM_CTX:
            _warm_ctx(w)
            _WARM_CTX.add(w)


def _warm_digest() -> None:
    """The state digest's kernels (whole-state verification)."""
    if 0 in _WARM:
        return
    from .digest import digest_fp32_as_bf16, digest_words

    digest_words(np.zeros(4, np.uint64), 0)
    digest_fp32_as_bf16(np.zeros(4, np.uint32), 0)
    _WARM.add(0)


def _warm_base(w: int) -> None:
    """The kernels of every encoding but ``ctx``, for element width ``w``."""
    if w in _WARM:
        return
    from . import write as kw
    from .flat import count_escapes, decode_gaps, diff_encode_flat, diff_update, encode_flat, pack_nibbles

    dt = _DTYPES[w]
    n = 130
    new, snap = np.ones(n, dt), np.zeros(n, dt)
    pos, nv, ov = np.empty(n, np.int64), np.empty(n, dt), np.empty(n, dt)
    diff_update(new, snap.copy(), False, pos, nv, ov, 0)
    k0 = kw.diff_positions(new, snap, pos, nv, 0)
    kw.scatter(snap.copy(), pos[:k0], nv[:k0], ov[:k0])
    kw.scatter(snap.copy(), pos[:k0], nv[:k0], ov[:0])
    gaps, nibs, exc = np.empty(n * 10, np.uint8), np.empty(n, np.uint8), np.empty((w, n), np.uint8)
    k, g, _, _, _, _, _ = diff_encode_flat(new, snap.copy(), False, gaps, nibs, exc, 0)
    encode_flat(pos, nv, ov, 0, -1, gaps, nibs, exc)
    packed = np.zeros((k + 1) // 2, np.uint8)
    pack_nibbles(nibs[:k], packed)
    count_escapes(packed, np.array([k], np.int64), np.empty(1, np.int64))
    out = np.empty(k, np.int64)
    decode_gaps(gaps, 0, g, k, n, out, True)
    decode_gaps(gaps, 0, g, k, n, out, False)
    old = np.empty(k, dt)
    kw.apply_flat_gaps_logged(np.zeros(n, dt), gaps, 0, k, packed, 0, exc, 0, old)
    kw.restore_gaps(np.zeros(n, dt), gaps, 0, k, old)
    if w == 2:
        src = np.ones(n, np.uint32)
        diff_update(src, snap.copy(), True, pos, nv, ov, 0)
        diff_encode_flat(src, snap.copy(), True, gaps, nibs, exc, 0)
    _WARM.add(w)


def _warm_ctx(w: int) -> None:
    """The ``ctx`` encoding's kernels: a tiny patch built, coded, decoded, written and undone."""
    from . import ctx as kc
    from . import ctx_coder as kcc
    from .ctx import N_CONTEXTS, WIDTH_SLOT, build_tables
    from .rans import NSYM, decoder_tables, encoder_tables

    n, dt = 130, _DTYPES[w]
    new, snap = np.ones(n, dt), np.zeros(n, dt)
    thr, mm, stat = np.zeros(3, dt), np.array([np.iinfo(dt).max], dt), np.array([w * 8 - 1, 0, 0], np.int64)
    gap, ctx, z = np.empty((kc.N_CLASSES, n), np.uint32), np.empty(n, np.uint8), np.empty(n, dt)
    counts, hc, hd = np.zeros(4, np.int64), np.zeros(kc.BINS, np.int64), np.zeros(kc.BINS, np.int64)
    sources = [(new, False)] + ([(np.ones(n, np.uint32), True)] if w == 2 else [])
    for src, fused in reversed(sources):  # the plain source last: its records are coded below
        hist = np.zeros((N_CONTEXTS, NSYM), np.int64)
        k, _ = kc.diff_ctx(src, snap.copy(), fused, thr, mm, stat, gap, ctx, z, counts, hc, hd, 0, hist, WIDTH_SLOT[w], 1)
    kc.exp_histogram(snap, mm, stat[0], stat[1], hc)
    gap, ctx, z = kc.class_major(gap, counts), ctx[:k], z[:k]
    kc.count_symbols(gap, counts, ctx, z, WIDTH_SLOT[w], np.zeros((N_CONTEXTS, NSYM), np.int64))
    _, freqs, tmap = build_tables([hist])
    cat, lens = kcc.encode_streams(gap, ctx, z, counts, encoder_tables(freqs), tmap, WIDTH_SLOT[w])
    bounds = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    pos, codes = np.empty(k, np.int64), np.empty(k, dt)
    kcc.decode_segment(snap, cat, bounds, thr, mm, stat, counts, *decoder_tables(freqs), tmap,
                       WIDTH_SLOT[w], pos, codes, 0)
    target, old = snap.copy(), np.empty(k, dt)
    kcc.write_codes(target, pos, codes, old)
    kcc.restore_codes(target, pos, old)
    kc.best_split(np.ones(4), np.ones(4) / 2)


def warm_up_kernels(tensors, ctx: bool = False) -> None:
    """Compile (or load) the numba kernels for these tensors' element widths (with ``ctx``, the
    ``ctx`` encoding's too): numba holds the GIL while compiling, so this belongs in a worker
    thread before the first use."""
    warm_up(tuple(sorted({t.element_size() for t in tensors if t.element_size() in _DTYPES})), ctx)
