"""The vector block masks of the numba kernels (aiosync/syncers/kernels/simd.py) against numpy,
for every element width, the fused fp32 → bf16 compare on edge values, and prefetches past the
end of an array."""

from __future__ import annotations

import numba
import numpy as np
import pytest
import torch

from aiosync.syncers.kernels.simd import change_mask, ge_mask, prefetch_block

UINTS = [np.uint8, np.uint16, np.uint32, np.uint64]


@numba.njit(nogil=True, boundscheck=True)
def _change_masks(src, snap):
    out = np.empty(snap.shape[0] // 64, np.uint64)
    for b in range(out.shape[0]):
        prefetch_block(src, b * 64 + 16 * 64)  # far past the end for the last blocks: must not fault
        prefetch_block(snap, b * 64 + 16 * 64)
        out[b] = change_mask(src, snap, b * 64)
    return out


@numba.njit(nogil=True, boundscheck=True)
def _ge_masks(bits, magmask, thr):
    out = np.empty(bits.shape[0] // 64, np.uint64)
    for b in range(out.shape[0]):
        out[b] = ge_mask(bits, b * 64, magmask, thr)
    return out


def _pack(flags: np.ndarray) -> np.ndarray:
    """Bit ``i`` of word ``b`` = ``flags[64 b + i]`` (the masks' layout)."""
    weights = np.uint64(1) << np.arange(64, dtype=np.uint64)
    return (flags.reshape(-1, 64).astype(np.uint64) * weights).sum(axis=1, dtype=np.uint64)


def _random(dtype, n: int, seed: int) -> np.ndarray:
    info = np.iinfo(dtype)
    return np.random.default_rng(seed).integers(0, int(info.max), n, dtype=np.uint64, endpoint=True).astype(dtype)


@pytest.mark.parametrize("dtype", UINTS)
def test_change_mask_equals_numpy_for_every_width(dtype):
    a = _random(dtype, 64 * 50, 1)
    b = a.copy()
    flip = np.random.default_rng(2).random(a.size) < 0.1
    b[flip] ^= dtype(1) << dtype(np.iinfo(dtype).bits - 1)  # the top bit: a signed compare would differ
    b[:64] = a[:64]  # a block without changes
    b[64:128] = ~a[64:128]  # a block of changes only
    assert np.array_equal(_change_masks(a, b), _pack(a != b))


def test_the_fused_compare_casts_like_torch_on_edge_values():
    edges = np.array([0x7FC00000, 0xFFC00000, 0x7F800001, 0xFF800001, 0x7F800000, 0xFF800000, 0, 0x80000000,
                      0x3F808000, 0x3F818000, 0x3F80FFFF, 0x7F7FFFFF, 0x00000001, 0x807FFFFF, 0x3EAAAAAB],
                     np.uint32)
    src = np.concatenate([np.resize(edges, 64 * 8), _random(np.uint32, 64 * 40, 3)])
    cast = torch.from_numpy(src.view(np.float32).copy()).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    snap = cast.copy()
    flip = np.random.default_rng(4).random(snap.size) < 0.2
    snap[flip] ^= np.uint16(0x8001)
    assert np.array_equal(_change_masks(src, snap), _pack(snap != cast))
    assert not _change_masks(src, cast.copy()).any()  # torch's own cast compares equal everywhere


@pytest.mark.parametrize("dtype", UINTS)
def test_ge_mask_compares_magnitudes_unsigned(dtype):
    bits = _random(dtype, 64 * 30, 5)
    top = int(np.iinfo(dtype).max)
    magmask = dtype(top >> 1)  # a float's sign bit dropped
    for thr in (0, 1, top >> 3, top >> 1, top):
        want = _pack((bits & magmask) >= dtype(thr))
        assert np.array_equal(_ge_masks(bits, magmask, dtype(thr)), want), thr


def test_mismatched_widths_are_a_typing_error():
    with pytest.raises((TypeError, numba.core.errors.TypingError), match="change_mask compares one width"):
        _change_masks(np.zeros(64, np.uint32), np.zeros(64, np.uint8))
