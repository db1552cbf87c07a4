"""Sampled symbol statistics of the ``ctx`` builder: a build expecting at least ``SAMPLE_MIN``
changes counts the symbols of one group of blocks in ``SAMPLE_EVERY`` only. The tables it sends
must still code every change (the ones the sample missed included), the patch must stay
bit-exact, and its bytes must stay within a percent of exact tables' where sampling starts."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from aiosync.syncers.kernels import ctx as kc
from aiosync.syncers.kernels.flat import GROUP_BLOCKS
from aiosync.syncers.kernels.ctx import N_CONTEXTS, WIDTH_SLOT, build_tables
from aiosync.syncers.kernels.ctx import _context_rows
from aiosync.syncers.kernels.rans import NSYM, symbol_of
from codec_cases import assert_same_bits, connect, make_state, mutate

GROUP = GROUP_BLOCKS * 64  # elements per group of blocks


def _diff(old: np.ndarray, new: np.ndarray, every: int):
    n = old.size
    thr = np.array([0x3A00, 0x3B80, 0x3C80], np.uint16)
    gap, ctx, z = np.empty((kc.N_CLASSES, n), np.uint32), np.empty(n, np.uint8), np.empty(n, np.uint16)
    hist = np.zeros((N_CONTEXTS, NSYM), np.int64)
    k, _ = kc.diff_ctx(new, old.copy(), False, thr, np.array([0x7FFF], np.uint16), np.array([7, 127, 0x3C80 >> 7]),
                       gap, ctx, z, np.zeros(4, np.int64), np.zeros(kc.BINS, np.int64), np.zeros(kc.BINS, np.int64),
                       0, hist, WIDTH_SLOT[2], every)
    return k, hist


@pytest.mark.parametrize("every", [1, 2, 4])
def test_the_builder_counts_the_symbols_of_one_group_in_every(every):
    rng = np.random.default_rng(every)
    n = 10 * GROUP + 77  # a partial last group
    old = ((rng.standard_normal(n).astype(np.float32) * 0.02).view(np.uint32) >> 16).astype(np.uint16)
    new = old.copy()
    where = rng.choice(n, 900, replace=False)
    new[where] += 1
    k, hist = _diff(old, new, every)
    assert k == 900
    sampled = np.count_nonzero((where // GROUP) % every == 0)
    gaps, values = _context_rows(WIDTH_SLOT[2])
    assert hist[gaps].sum() == hist[values].sum() == sampled


def test_tables_of_a_sampled_width_code_every_context_and_every_symbol_it_can_hold():
    hist = np.zeros((N_CONTEXTS, NSYM), np.int64)
    gaps, values = _context_rows(WIDTH_SLOT[2])
    hist[gaps.start, 3] = 1000  # one class's gaps seen, nothing else
    hist[values.start + 2, 0] = 5000
    other = WIDTH_SLOT[4]
    hist[_context_rows(other)[0].start, 1] = 10  # another width, not sampled: left exact
    used, freqs, tmap = build_tables([hist], {WIDTH_SLOT[2]})
    top_gap = int(symbol_of(np.uint64(kc.SEGMENT - 1))[0])
    top_value = int(symbol_of(np.uint64(0xFFFF))[0])
    for cid in [*range(gaps.start, gaps.stop), *range(values.start, values.stop)]:
        row = freqs[tmap[cid]]
        top = top_gap if cid < values.start else top_value
        assert tmap[cid] >= 0 and (row[:top + 1] >= 1).all() and row.sum() == 4096, cid
    assert freqs[tmap[gaps.start], 3] > 3800  # the sample still shapes the table (1000 counts, 52 escapes)
    row = freqs[tmap[_context_rows(other)[0].start]]
    assert row[1] == 4096 and np.count_nonzero(row) == 1
    assert (tmap[_context_rows(other)[0].start + 1:_context_rows(other)[0].stop] == -1).all()


def _update(n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    src = {"w": (torch.randn(n, generator=g) * 0.02).to(torch.bfloat16)}
    return src, {k: v.clone() for k, v in src.items()}


def _step(t: torch.Tensor, seed: int, rare_at: int | None = None) -> None:
    """About 3 % of the elements move by one unit in the last place; with ``rare_at``, one
    element far out (its own context and a value code no other change has)."""
    rng = np.random.default_rng(seed)
    b = t.view(torch.int16).view(-1)
    where = torch.from_numpy(rng.choice(b.numel(), b.numel() // 33, replace=False))
    b[where] += torch.from_numpy(rng.choice(np.array([1, -1], np.int16), where.numel()))
    if rare_at is not None:
        b[rare_at] = 0x0002 if int(b[rare_at]) == 0x0001 else 0x0001  # a subnormal (the lowest contexts)
        b[rare_at + 1] ^= 0x3F00  # a value code of 14 bits


async def test_changes_the_sample_missed_round_trip_bit_exact(monkeypatch):
    monkeypatch.setattr(kc, "SAMPLE_MIN", 0)  # every build samples
    n = 8 * GROUP
    src, dst = _update(n, 1)
    s, r, a, b = await connect(src, dst, "ctx", False, "none")
    seen = []
    real = build_tables
    monkeypatch.setattr("aiosync.syncers.patch.ctx.encode.build_tables", lambda h, c=frozenset(): seen.append((sum(h), c))
                        or real(h, c))
    for step in range(3):
        _step(src["w"], step, rare_at=GROUP + 5)  # group 1: never in the sample
        await s.sync(src, a.send, step + 1)
        assert await r.apply_payload(dst, await b.recv()) == step + 1
        assert_same_bits(src, dst)
    hist, complete = seen[-1]
    assert complete == {WIDTH_SLOT[2]}
    assert hist[_context_rows(WIDTH_SLOT[2])[1], 20:].sum() == 0  # the sample missed the large value codes
    counted = hist[_context_rows(WIDTH_SLOT[2])[1]].sum()  # one value code per change counted
    assert 0 < counted < 0.5 * s.statistics().changed  # a sample: two groups in eight


async def test_sampled_tables_cost_under_one_percent_more_bytes_at_the_sampling_threshold(monkeypatch):
    sizes, n = {}, 33 * kc.SAMPLE_MIN  # about SAMPLE_MIN changes
    for name, floor in (("exact", 1 << 62), ("sampled", 0)):
        monkeypatch.setattr(kc, "SAMPLE_MIN", floor)
        src, dst = _update(n, 2)
        s, r, a, b = await connect(src, dst, "ctx", False, "none")
        _step(src["w"], 7)
        await s.sync(src, a.send, 1)
        assert await r.apply_payload(dst, await b.recv()) == 1
        assert_same_bits(src, dst)
        sizes[name] = s.statistics().bytes
    assert sizes["exact"] < sizes["sampled"] < 1.01 * sizes["exact"]


@pytest.mark.parametrize("case", ["all", "first_last", "nan", "single"])
async def test_sampled_tables_code_every_dtype_and_edge_case(monkeypatch, case):
    monkeypatch.setattr(kc, "SAMPLE_MIN", 0)  # every build samples: every width's tables are completed
    src = make_state(3)
    dst = {k: v.clone() for k, v in src.items()}
    s, r, a, b = await connect(src, dst, "ctx", False, "none")
    for version in (1, 2):
        mutate(src, case, seed=version)
        await s.sync(src, a.send, version)
        assert await r.apply_payload(dst, await b.recv()) == version
        assert_same_bits(src, dst)
