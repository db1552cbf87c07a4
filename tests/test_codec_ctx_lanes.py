"""The ``ctx`` encoding's lanes: a segment with at least ``LANES_MIN`` changes is coded as four
gap and four value rANS streams (one stream each below that). Round trips on both sides of the
boundary and with class counts that are not multiples of four, the decoder against a plain
reference on random data, and malformed lanes refused with nothing written."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from aiosync.errors import PayloadError
from aiosync.syncers.kernels import ctx as kc
from aiosync.syncers.kernels import ctx_coder as kcc
from aiosync.syncers.kernels.ctx import N_CONTEXTS, WIDTH_SLOT, build_tables
from aiosync.syncers.patch.ctx.decode import _ints
from aiosync.syncers.kernels.rans import NSYM, decoder_tables, encoder_tables
from codec_cases import assert_same_bits, change, connect
from helpers import bits


def test_lane_count_follows_the_segments_changes():
    assert kcc.stream_count(0) == 0
    assert kcc.stream_count(1) == kcc.stream_count(kcc.LANES_MIN - 1) == 2
    assert kcc.stream_count(kcc.LANES_MIN) == 2 * kcc.MAX_LANES


def _records(n: int, changes: int, seed: int, dense_small: bool = True):
    """Old bits (bf16, the receiver's model) and the builder's records of a random update."""
    rng = np.random.default_rng(seed)
    old = (rng.standard_normal(n).astype(np.float32) * 0.02).view(np.uint32)
    old = ((old + 0x8000) >> 16).astype(np.uint16)  # bf16 bits
    new = old.copy()
    where = rng.choice(n, changes, replace=False)
    new[where] += rng.choice(np.array([1, 0xFFFF, 3, 40], np.uint16), changes)
    thr = np.array([0x3A00, 0x3B80, 0x3C80] if dense_small else [0x3000, 0x3100, 0x3200], np.uint16)
    mm = np.array([0x7FFF], np.uint16)
    stat = np.array([7, 127, 0x3C80 >> 7], np.int64)
    snap = old.copy()
    gap, ctx, z = np.empty((kc.N_CLASSES, n), np.uint32), np.empty(n, np.uint8), np.empty(n, np.uint16)
    counts = np.zeros(4, np.int64)
    hist = np.zeros((N_CONTEXTS, NSYM), np.int64)
    k, _ = kc.diff_ctx(new, snap, False, thr, mm, stat, gap, ctx, z, counts, np.zeros(kc.BINS, np.int64),
                       np.zeros(kc.BINS, np.int64), 0, hist, WIDTH_SLOT[2], 1)
    assert k == changes and np.array_equal(snap, new)
    return old, new, (kc.class_major(gap, counts), ctx[:k], z[:k]), counts, hist, (thr, mm, stat)


def _code(records, counts, hist):
    gap, ctx, z = records
    _, freqs, tmap = build_tables([hist])
    cat, lens = kcc.encode_streams(gap, ctx, z, counts, encoder_tables(freqs), tmap, WIDTH_SLOT[2])
    return cat, np.concatenate([[0], np.cumsum(lens)]).astype(np.int64), freqs, tmap


def _decode(old, cat, bounds, params, counts, freqs, tmap):
    k = int(counts.sum())
    pos, codes = np.empty(k, np.int64), np.empty(k, np.uint16)
    rc = kcc.decode_segment(old, cat, bounds, *params, counts, *decoder_tables(freqs), tmap, WIDTH_SLOT[2], pos, codes,
                            0)
    return rc, pos, codes


@pytest.mark.parametrize("changes", [1, 5, kcc.LANES_MIN - 1, kcc.LANES_MIN, kcc.LANES_MIN + 1, 4 * kcc.LANES_MIN + 3])
@pytest.mark.parametrize("dense_small", [True, False])
def test_decoder_matches_a_plain_reference_on_both_sides_of_the_lane_boundary(changes, dense_small):
    old, new, records, counts, hist, params = _records(70_000, changes, seed=changes, dense_small=dense_small)
    cat, bounds, freqs, tmap = _code(records, counts, hist)
    assert bounds.size - 1 == kcc.stream_count(changes)
    rc, pos, codes = _decode(old, cat, bounds, params, counts, freqs, tmap)
    assert rc == changes
    truth = np.nonzero(old != new)[0]
    assert np.array_equal(pos, truth)
    # value codes: zig-zag of new − old modulo 2**16, plus one (never zero)
    d = (new[truth].astype(np.int64) - old[truth].astype(np.int64) + 2**15) % 2**16 - 2**15
    assert np.array_equal(codes.astype(np.int64), np.where(d >= 0, 2 * d, -2 * d - 1))
    if changes >= kcc.LANES_MIN:
        assert (np.diff(bounds) >= 4).all()  # every lane holds at least its flushed state
        assert (counts % 4 != 0).any() or changes % 4 == 0


@pytest.mark.parametrize("n", [kcc.LANES_MIN, kcc.LANES_MIN + 3, 64 * 100 + 17])
def test_every_element_of_a_segment_changes_with_lanes(n):
    old, new, records, counts, hist, params = _records(n, n, seed=n)
    cat, bounds, freqs, tmap = _code(records, counts, hist)
    assert bounds.size - 1 == 2 * kcc.MAX_LANES
    rc, pos, codes = _decode(old, cat, bounds, params, counts, freqs, tmap)
    assert rc == n and np.array_equal(pos, np.arange(n))


@pytest.mark.parametrize("changes", [kcc.LANES_MIN - 1, kcc.LANES_MIN + 5])
def test_malformed_lanes_are_refused(changes):
    old, new, records, counts, hist, params = _records(50_000, changes, seed=7)
    cat, bounds, freqs, tmap = _code(records, counts, hist)
    ns = bounds.size - 1
    cases = {"a lane truncated": (cat, np.concatenate([bounds[:-1], [bounds[-1] - 1]]).astype(np.int64)),
             "a byte moved between lanes": (cat, np.concatenate([[bounds[0], bounds[1] - 1], bounds[2:]])
                                           .astype(np.int64)),
             "too few streams": (cat, bounds[[0, ns // 2, ns]]),
             "too many streams": (cat, np.concatenate([bounds[:1], bounds]).astype(np.int64)),
             "a flushed state flipped": (np.bitwise_xor(cat, np.eye(1, cat.size, int(bounds[ns - 1]) + 1,
                                                                    dtype=np.uint8)[0] * 0x40), bounds)}
    for name, (buf, bnd) in cases.items():
        if name == "too few streams" and ns == 2:
            bnd = bounds[[0, ns]]
        rc, _, _ = _decode(old, buf, bnd, params, counts, freqs, tmap)
        assert rc < 0, name
    rc, pos, _ = _decode(old, cat, bounds, params, counts, freqs, tmap)
    assert rc == changes and np.array_equal(pos, np.nonzero(old != new)[0])


async def _lane_patch():
    g = torch.Generator().manual_seed(5)
    n = 200_000
    src = {"w": (torch.randn(n, generator=g) * 0.02).to(torch.bfloat16), "b": torch.randn(64, generator=g)}
    dst = {k: v.clone() for k, v in src.items()}
    s, r, a, b = await connect(src, dst, "ctx", False, "none")
    change(src["w"], torch.randperm(n, generator=g)[:kcc.LANES_MIN + 999], g)
    change(src["b"], torch.tensor([3]), g)
    await s.sync(src, a.send, 1)
    return src, dst, r, await b.recv()


def _segment_entries(patch):
    """The header's closing entries, per changed tensor (one segment each here): its four class
    counts and the lengths of its streams but the last; and where the largest tensor's start."""
    ints = _ints(patch.values)
    nnz = [int(x) for x in patch.nnz_per_tensor]
    sizes = [4 + kcc.stream_count(n) - 1 for n in nnz]
    w = nnz.index(max(nnz))
    start = len(ints) - sum(sizes) + sum(sizes[:w])
    return ints, nnz, w, start


async def test_a_patch_with_lanes_round_trips_and_its_header_lists_every_stream():
    src, dst, r, patch = await _lane_patch()
    ints, nnz, w, start = _segment_entries(patch)
    assert nnz[w] >= kcc.LANES_MIN and sum(ints[start:start + 4]) == nnz[w]
    lens = ints[start + 4:start + 4 + 2 * kcc.MAX_LANES - 1]
    assert min(lens) >= 4 and sum(lens) < int(patch.gap_bytes[w])  # seven listed, the eighth is the rest
    assert await r.apply_payload(dst, patch) == 1
    assert_same_bits(src, dst)


async def test_malformed_lane_lengths_in_the_header_are_refused_and_nothing_is_written():
    from aiosync.syncers.patch.ctx.encode import varints

    src, dst, r, patch = await _lane_patch()
    ints, nnz, w, start = _segment_entries(patch)
    assert nnz[w] >= kcc.LANES_MIN
    before = {k: v.clone() for k, v in dst.items()}
    hostile = []
    for i, delta in ((0, -1), (3, 2), (6, 10**9)):
        bad = list(ints)
        bad[start + 4 + i] += delta
        hostile.append(dataclasses.replace(patch, values=torch.from_numpy(varints(bad).copy())))
    for bad in hostile:
        with pytest.raises(PayloadError):
            await r.apply_payload(dst, bad)
        assert r.version is None
        assert_same_bits(before, dst)
    assert await r.apply_payload(dst, patch) == 1
    assert torch.equal(bits(dst["w"]), bits(src["w"]))
