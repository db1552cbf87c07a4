"""Numba kernels of the receiver's staged writes: the patch writer that keeps what it
overwrites (the write's undo record) and hashes it (the drift check), its undo, and the
read-only diff and the scatter of :mod:`aiosync.syncers.common.staging`. Shared pieces (the block
mask flattening, :func:`~aiosync.syncers.kernels.flat.mix64`) live in :mod:`aiosync.syncers.kernels.flat`.
"""

from __future__ import annotations

import numba
import numpy as np

from .flat import ESCAPE, GROUP_BLOCKS, _flatten, _width, get_exception, get_nibble, get_varint, mix64, unzigzag


@numba.njit(nogil=True, cache=True, boundscheck=False)
def diff_positions(new, old, out_pos, out_new, base):  # pragma: no cover - compiled
    """Read-only twin of :func:`diff_update` (staged whole-state writes): record every ``j``
    where ``new[j]`` and ``old[j]`` differ bitwise as ``out_pos[k] = base + j``,
    ``out_new[k] = new[j]``; writes neither input. Returns the number of differences. The
    output arrays must hold ``len(old)`` entries."""
    n = old.shape[0]
    nblocks = (n + 63) // 64
    idx = np.empty(GROUP_BLOCKS * 64 + 4, np.int64)
    cnt = 0
    k = 0
    for b in range(nblocks):
        s = b * 64
        e = min(n, s + 64)
        m = np.uint64(0)
        for i in range(e - s):
            m |= np.uint64(new[s + i] != old[s + i]) << np.uint64(i)
        cnt = _flatten(m, s, idx, cnt)
        if (b & (GROUP_BLOCKS - 1)) == GROUP_BLOCKS - 1 or b == nblocks - 1:
            for q in range(cnt):
                j = idx[q]
                out_pos[k] = base + j
                out_new[k] = new[j]
                k += 1
            cnt = 0
    return k


@numba.njit(nogil=True, cache=True, boundscheck=False)
def scatter(target, pos, values, out_old):  # pragma: no cover - compiled
    """``target[pos[i]] = values[i]``; the overwritten values go to ``out_old`` when it holds
    ``len(pos)`` entries (an empty ``out_old`` keeps nothing)."""
    keep = out_old.shape[0] == pos.shape[0]
    for i in range(pos.shape[0]):
        j = pos[i]
        if keep:
            out_old[i] = target[j]
        target[j] = values[i]


@numba.njit(nogil=True, cache=True, boundscheck=False)
def apply_flat_gaps_logged(target, gaps, start, count, packed, nib_off, exc, exc_off, out_old):  # pragma: no cover
    """The flat patch writer. Writes ``count`` changes: positions from the LEB128 gap stream at
    ``gaps[start:]`` (validated by :func:`~aiosync.syncers.kernels.flat.decode_gaps`), change
    ``i``'s code from nibble ``nib_off + i`` of ``packed`` or, escaped, from ``exc[:, exc_off:]``
    in order. Keeps every overwritten value in ``out_old`` (the write's journal, for
    :func:`restore_gaps`) and returns their drift hash: the sum of :func:`mix64` over the
    changes, modulo 2**64. One pass over the changed positions."""
    width = _width(target)
    e = exc_off
    g = start
    prev = np.int64(-1)
    h = np.uint64(0)
    for i in range(count):
        gap, g = get_varint(gaps, g)
        j = prev + 1 + np.int64(gap)
        prev = j
        z = get_nibble(packed, nib_off + i)
        if z == np.uint64(ESCAPE):
            z = get_exception(exc, e, width)
            e += 1
        old = target[j]
        out_old[i] = old
        h += mix64(j, old)
        target[j] = unzigzag(old, z, width)
    return h


@numba.njit(nogil=True, cache=True, boundscheck=False)
def restore_gaps(target, gaps, start, count, old):  # pragma: no cover - compiled
    """Undo a write: put ``old`` (from :func:`apply_flat_gaps_logged`) back at the positions of the
    gap stream at ``gaps[start:]``."""
    g = start
    prev = np.int64(-1)
    for i in range(count):
        gap, g = get_varint(gaps, g)
        j = prev + 1 + np.int64(gap)
        prev = j
        target[j] = old[i]
