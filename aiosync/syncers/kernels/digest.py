"""The state digest's kernels (whole-state verification, see
:func:`aiosync.syncers.common.integrity.state_digest`): a sum of
:func:`~aiosync.syncers.kernels.flat.mix64` over a tensor's raw bytes read as little-endian
64-bit words, each mixed with its word index. Sums of parts add up (modulo 2**64), so a tensor
is digested chunk by chunk (or shard by shard) and the parts combined by addition.

Each word's term depends on no other: the loop vectorises (64-bit multiplies: AVX-512DQ, or
emulated), and runs at several GB/s per core, without the GIL (``nogil``).
"""

from __future__ import annotations

import numba
import numpy as np

from .flat import _cast_bf16, mix64


@numba.njit(nogil=True, cache=True, boundscheck=False)
def digest_words(words, start):  # pragma: no cover - compiled
    """``Σ mix64(start + i, words[i]) mod 2**64`` over a 1-D uint64 array."""
    h = np.uint64(0)
    for i in range(words.shape[0]):
        h += mix64(start + i, words[i])
    return h


@numba.njit(nogil=True, cache=True, boundscheck=False)
def digest_fp32_as_bf16(src, start):  # pragma: no cover - compiled
    """:func:`digest_words` of fp32 bits ``src`` cast to bf16 on the fly (as the patch builder
    casts: round to nearest even, every NaN 0xFFFF), four bf16 per word; ``len(src)`` must be a
    multiple of 4 (the caller pads the last chunk with zeros, which are zero bf16 bits too)."""
    h = np.uint64(0)
    for i in range(src.shape[0] // 4):
        j = 4 * i
        w = (np.uint64(_cast_bf16(src[j])) | (np.uint64(_cast_bf16(src[j + 1])) << np.uint64(16))
             | (np.uint64(_cast_bf16(src[j + 2])) << np.uint64(32))
             | (np.uint64(_cast_bf16(src[j + 3])) << np.uint64(48)))
        h += mix64(start + i, w)
    return h
