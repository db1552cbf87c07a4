"""The ``ctx`` encoding (context-modelled positions and values, rANS): the coder against plain
references, the float extremes, tensors of several segments, the torch builder against the numba
one byte for byte, and malformed streams (a PayloadError, the model untouched). The edge cases
shared with the other encodings (empty, single, every element, 0-d … 4-d, every dtype, NaN and
-0.0, hypothesis round trips, malformed headers) run in ``test_codec.py`` with ``ctx`` among
the formats."""

from __future__ import annotations

import asyncio
import dataclasses

import numba
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from aiosync.errors import DriftError, PayloadError
from aiosync.syncers import WeightPatch
from aiosync.syncers.kernels import rans
from aiosync.syncers.kernels import ctx as kc
from aiosync.syncers.patch.ctx.encode import _split_bins, ctx_format
from codec_cases import assert_same_bits, change, connect
from helpers import bits


@numba.njit
def _encode(values, enc, buf):
    x, p = np.uint64(rans.RANS_L), buf.shape[0]
    for i in range(values.shape[0] - 1, -1, -1):
        x, p = rans.put_value(x, buf, p, enc, 0, values[i])
    return rans.flush(x, buf, p)


@numba.njit
def _decode(buf, p, n, slots, freq, start, out):
    x, p = rans.start_state(buf, p, buf.shape[0])
    for i in range(n):
        out[i], x, p = rans.get_value(x, buf, p, buf.shape[0], slots, freq, start, 0)
    return x, p


def _round_trip(values: np.ndarray) -> tuple[np.ndarray, int, int, int]:
    counts = np.zeros(rans.NSYM, np.int64)
    for v in values.tolist():
        counts[rans.symbol_of(np.uint64(v))[0]] += 1
    freqs = rans.normalize(counts)[None, :]
    assert freqs.sum() == rans.PROB_SCALE and (freqs[0][counts > 0] > 0).all()
    buf = np.zeros(16 + 20 * values.size, np.uint8)
    p = _encode(values, rans.encoder_tables(freqs), buf)
    out = np.zeros(values.size, np.uint64)
    x, q = _decode(buf, p, values.size, *rans.decoder_tables(freqs), out)
    return out, int(x), int(q), buf.size - p


@settings(max_examples=60, deadline=None)
@given(st.lists(st.one_of(st.integers(0, 20), st.integers(0, 2**64 - 1), st.integers(2**15, 2**17)), min_size=1,
                max_size=300))
def test_rans_round_trips_any_integers_and_ends_in_its_initial_state(values):
    values = np.array(values, np.uint64)
    out, x, end, nbytes = _round_trip(values)
    assert out.tolist() == values.tolist()
    assert x == rans.RANS_L and end == 16 + 20 * values.size  # every byte read, back where encoding started
    assert nbytes % 2 == 0 and nbytes >= 4


def test_encoder_steps_divide_exactly_for_every_frequency():
    """The encoder's reciprocals give ``C(x) = (x // f) · 2**12 + x % f + start`` for every
    frequency ``f`` and state ``x`` the coder can hold before a step (below ``x_max``)."""
    f = np.arange(1, rans.PROB_SCALE + 1, dtype=np.int64)
    freqs = np.zeros((f.size, rans.NSYM), np.int64)
    freqs[:, 0] = f
    freqs[:, 1] = rans.PROB_SCALE - f  # (zero when f is the whole scale)
    enc = rans.encoder_tables(freqs)[:, 0].astype(object)
    rng = np.random.default_rng(0)
    for x in [int(v) for v in rng.integers(rans.RANS_L, 2**31, 8)] + [rans.RANS_L, 2**31 - 1]:
        keep = x < enc[:, 0]  # a state at or above x_max is renormalised first
        q = ((x * enc[:, 1]) >> 32) >> enc[:, 2]
        got = x + enc[:, 3] + q * enc[:, 4]
        want = (x // f) * rans.PROB_SCALE + x % f  # start 0: symbol 0 is first
        assert (got[keep] == want[keep]).all(), x


def test_rans_spends_a_fraction_of_a_bit_on_a_likely_symbol():
    values = np.zeros(100_000, np.uint64)
    values[::50] = 1  # p(0) = 0.98: 0.14 bits per symbol of entropy; a prefix code needs at least 1
    out, _, _, nbytes = _round_trip(values)
    assert np.array_equal(out, values)
    assert nbytes * 8 / values.size < 0.2


def test_symbols_cover_every_integer_exactly_once():
    for v in [0, 1, 15, 16, 17, 23, 24, 31, 32, 47, 48, 1000, 2**32 - 1, 2**32, 2**63, 2**64 - 1]:
        sym, nraw = rans.symbol_of(np.uint64(v))
        base = int(rans.SYM_BASE[sym])
        assert int(rans.SYM_NRAW[sym]) == nraw
        assert base <= v < base + (1 << nraw), v
        if sym + 1 < rans.NSYM:
            assert v < int(rans.SYM_BASE[sym + 1])
    assert rans.symbol_of(np.uint64(2**64 - 1))[0] == rans.NSYM - 1


def test_table_normalisation_keeps_every_seen_symbol_decodable():
    counts = np.zeros(rans.NSYM, np.int64)
    counts[:3] = [10**9, 1, 1]
    counts[rans.NSYM - 1] = 1
    f = rans.normalize(counts)
    assert f.sum() == rans.PROB_SCALE and f[1] == f[2] == f[-1] == 1 and f[3:-1].sum() == 0


def test_class_split_puts_the_dense_small_values_apart():
    hn = np.zeros(kc.BINS, np.int64)
    hc = np.zeros(kc.BINS, np.int64)
    hn[100:110] = 1000
    hc[100:103] = 900  # small magnitudes change nearly always
    hc[103:110] = 10
    cuts = _split_bins(hn, hc)
    assert cuts == sorted(cuts) and len(cuts) == 3
    assert cuts[0] == 103 or 103 in cuts  # a boundary where the density drops
    assert _split_bins(hn, None) == sorted(_split_bins(hn, None))  # the first build's quantile split


@pytest.mark.parametrize("seed", range(5))
def test_class_split_is_the_best_contiguous_split(seed):
    import itertools

    rng = np.random.default_rng(seed)
    size = 9
    hn = rng.integers(1, 1000, size).astype(np.float64)
    hc = np.minimum(hn, rng.integers(0, 600, size)).astype(np.float64)

    def bits(a, b):
        nn, ch = hn[a:b].sum(), hc[a:b].sum()
        if nn == 0 or not 0 < ch < nn:
            return 0.0
        p = ch / nn
        return -nn * (p * np.log2(p) + (1 - p) * np.log2(1 - p))

    def total(starts):
        edges = [*starts, size]
        return sum(bits(edges[i], edges[i + 1]) for i in range(len(starts)))

    best = min(total((0, *c)) for c in itertools.combinations(range(1, size), kc.N_CLASSES - 1))
    got = kc.best_split(hn, hc)
    assert got[0] == 0 and list(got) == sorted(set(got))
    assert total(tuple(int(x) for x in got)) == pytest.approx(best)


# ------------------------------------------------------------------ values at the extremes
def _extremes(dtype: torch.dtype) -> torch.Tensor:
    info = torch.finfo(dtype)
    vals = [0.0, -0.0, info.tiny, -info.tiny, info.tiny / 4, info.max, -info.max, float("inf"), float("-inf"),
            float("nan"), 1.0, -1.0, info.eps, 3.0e-3, -7.5e-5, 1e-30 if dtype != torch.float16 else 1e-7]
    return torch.tensor(vals * 9, dtype=torch.float64).to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
async def test_ctx_values_at_the_exponent_extremes_and_subnormals(dtype):
    src = {"x": _extremes(dtype), "y": torch.randn(70, 3).to(dtype)}
    dst = {k: v.clone() for k, v in src.items()}
    s, r, a, b = await connect(src, dst, "ctx", False, "none")
    g = torch.Generator().manual_seed(5)
    n = src["x"].numel()
    for version in range(1, 4):
        # moves of one unit in the last place (across exponent boundaries: 0 ↔ subnormal, max ↔ inf)
        # and random bit flips, on every kind of value
        change(src["x"], torch.randperm(n, generator=g)[: n // 3].sort().values, g)
        bx = bits(src["x"]).view(-1)
        bx[::11] += 1
        change(src["y"], torch.tensor([0, 5, 209]), g)
        await s.sync(src, a.send, version)
        assert await r.apply(dst, b.recv) == version
        assert_same_bits(src, dst)


def test_ctx_format_of_every_dtype():
    assert ctx_format(torch.bfloat16, 2) == (0x7FFF, 7, 127)
    assert ctx_format(torch.float32, 4) == (0x7FFFFFFF, 23, 127)
    assert ctx_format(torch.float64, 8) == ((1 << 63) - 1, 52, 1023)
    assert ctx_format(torch.int32, 4) == ((1 << 32) - 1, 31, 0)  # integers: classed by their raw bits
    assert ctx_format(None, 1) == (0xFF, 7, 0)


async def test_ctx_builder_scratch_fits_the_model_and_is_counted():
    g = torch.Generator().manual_seed(4)
    src = {"w": (torch.randn(5000, generator=g) * 0.02).to(torch.bfloat16), "b": torch.randn(40, generator=g)}
    dst = {k: v.clone() for k, v in src.items()}
    s, r, a, b = await connect(src, dst, "ctx", False, "none")
    before = s._snapshot.scratch_bytes
    change(src["w"], torch.arange(0, 5000, 7), g)
    change(src["b"], torch.tensor([1, 2]), g)
    await s.sync(src, a.send, 1)
    assert await r.apply(dst, b.recv) == 1
    assert_same_bits(src, dst)
    grown = s._snapshot.scratch_bytes - before
    # the record buffers of the longest tensor of each width (bf16: 5000, fp32: 40), per thread that built
    assert 0 < grown <= 2 * (5000 * (4 * kc.N_CLASSES + 1 + 2) + 40 * (4 * kc.N_CLASSES + 1 + 4))


# ------------------------------------------------------------------ several segments
async def test_ctx_tensor_of_several_segments_round_trips_bit_exact():
    n = kc.SEGMENT * 2 + 1000
    g = torch.Generator().manual_seed(2)
    src = {"big": (torch.randn(n, generator=g) * 0.02).to(torch.bfloat16), "small": torch.randn(10, generator=g)}
    dst = {k: v.clone() for k, v in src.items()}
    s, r, a, b = await connect(src, dst, "ctx", False, "none")
    idx = torch.tensor([0, 1, kc.SEGMENT - 1, kc.SEGMENT, kc.SEGMENT + 1, 2 * kc.SEGMENT - 1, 2 * kc.SEGMENT, n - 1])
    idx = torch.cat([idx, torch.randint(0, n, (5000,), generator=g)]).unique()
    change(src["big"], idx, g)
    sent = []

    async def send(p):
        sent.append(p)
        await a.send(p)

    await s.sync(src, send, 1)
    assert sent[0].gap_bytes.numel() == 3  # one coded stream per segment of the changed tensor
    assert await r.apply(dst, b.recv) == 1
    assert_same_bits(src, dst)
    bits(src["big"]).view(-1)[kc.SEGMENT + 7] += 1  # only the middle segment changes next
    await s.sync(src, send, 2)
    assert sent[1].gap_bytes.tolist()[0] == 0 and sent[1].gap_bytes.tolist()[2] == 0
    assert await r.apply(dst, b.recv) == 2
    assert_same_bits(src, dst)


# ------------------------------------------------------------------ torch builder = numba builder
async def test_ctx_torch_builder_writes_the_numba_builders_bytes():
    g = torch.Generator().manual_seed(9)
    base = {"w": torch.randn(300, 70, generator=g) * 0.02, "b": torch.randn(5000, generator=g).to(torch.bfloat16),
            "i": torch.randint(0, 100, (50,), generator=g, dtype=torch.int32), "f": torch.randn(33, generator=g)}
    patches = {}
    for kernel in ("auto", "torch"):
        src = {k: v.clone() for k, v in base.items()}
        dst = {k: v.to(torch.bfloat16) if k == "w" else v.clone() for k, v in base.items()}
        s, r, a, b = await connect(src, dst, "ctx", False, "none", builder_kernel=kernel)
        gg = torch.Generator().manual_seed(4)
        sent = []
        for version in range(1, 4):
            src["w"].add_(torch.randn(src["w"].shape, generator=gg) * 1e-4)
            change(src["b"], torch.randint(0, 5000, (300,), generator=gg).unique(), gg)
            src["i"][version] += 1
            change(src["f"], torch.tensor([0, 32]), gg)

            async def send(p, sent=sent):
                sent.append(p)
                await a.send(p)

            await s.sync(src, send, version)
            assert await r.apply(dst, b.recv) == version
            assert torch.equal(bits(dst["w"]), bits(src["w"].to(torch.bfloat16)))
        patches[kernel] = sent
    for p_auto, p_torch in zip(patches["auto"], patches["torch"]):
        for name in ("ordinals", "nnz_per_tensor", "cols", "values", "gap_bytes", "old_hashes"):
            x, y = getattr(p_auto, name), getattr(p_torch, name)
            assert x.dtype == y.dtype and x.tolist() == y.tolist(), name


# ------------------------------------------------------------------ malformed streams
async def _ctx_patch():
    g = torch.Generator().manual_seed(3)
    src = {"a": torch.randn(4000, generator=g).to(torch.bfloat16), "b": torch.randn(30, 20, generator=g)}
    dst = {k: v.clone() for k, v in src.items()}
    s, r, a, b = await connect(src, dst, "ctx", False, "none")
    change(src["a"], torch.randint(0, 4000, (400,), generator=g).unique(), g)
    change(src["b"], torch.tensor([0, 7, 599]), g)
    await s.sync(src, a.send, 1)
    return src, dst, r, await b.recv()


def _flip(t: torch.Tensor, i: int, mask: int = 0x41) -> torch.Tensor:
    t = t.clone()
    t[i] ^= mask
    return t


def _ctx_corruptions(p: WeightPatch) -> list[tuple[str, WeightPatch]]:
    """Structural corruptions, each refused. (A flipped *raw bit of a value code* decodes to another
    value and is caught only by ``verify_checksums``, as in ``flat``; positions are covered by the
    coder's final states and the drift check.)"""
    rep = dataclasses.replace
    cols, model = p.cols, p.values
    g0 = int(p.gap_bytes[0])
    out = [
        ("truncated streams", rep(p, cols=cols[:-1])),
        ("streams too long", rep(p, cols=torch.cat([cols, cols[:2]]))),
        ("gap state flipped", rep(p, cols=_flip(cols, 0))),
        ("value state flipped", rep(p, cols=_flip(cols, 3))),
        ("a gap word flipped", rep(p, cols=_flip(cols, 9))),
        ("a word flipped in the second gap stream", rep(p, cols=_flip(cols, g0 + 9))),
        ("stream bytes moved between segments", rep(p, gap_bytes=torch.tensor([g0 - 2, int(p.gap_bytes[1]) + 2]))),
        ("no gap_bytes", rep(p, gap_bytes=None)),
        ("one gap_bytes entry", rep(p, gap_bytes=p.gap_bytes[:1])),
        ("model truncated", rep(p, values=model[:-1])),
        ("model too long", rep(p, values=torch.cat([model, torch.tensor([5], dtype=torch.uint8)]))),
        ("table frequencies off", rep(p, values=_flip(model, 3, 0x01))),
        ("model not uint8", rep(p, values=model.to(torch.int32))),
        ("streams not uint8", rep(p, cols=cols.to(torch.int16))),
        ("nnz changed", rep(p, nnz_per_tensor=p.nnz_per_tensor.to(torch.int64) + 1)),
        ("no old hashes", rep(p, old_hashes=None)),
    ]
    return out


async def test_ctx_malformed_streams_raise_and_change_nothing():
    src, dst, r, patch = await _ctx_patch()
    assert patch.encoding == "ctx" and patch.gap_bytes.numel() == 2
    before = {k: v.clone() for k, v in dst.items()}
    for name, bad in _ctx_corruptions(patch):
        with pytest.raises(PayloadError):
            await r.apply_payload(dst, bad)
            pytest.fail(f"{name}: accepted")
        assert r.version is None, name
        assert_same_bits(before, dst)
    assert await r.apply_payload(dst, patch) == 1
    assert_same_bits(src, dst)


async def test_ctx_drifted_receiver_is_refused_whole():
    src, dst, r, patch = await _ctx_patch()
    before = {k: v.clone() for k, v in dst.items()}
    bits(dst["a"]).view(-1)[int(torch.nonzero(bits(src["a"]) != bits(dst["a"]))[0])] ^= 0x10  # a changed position
    drifted = {k: v.clone() for k, v in dst.items()}
    with pytest.raises(PayloadError) as info:
        await r.apply_payload(dst, patch)
    assert isinstance(info.value, (DriftError, PayloadError))
    assert_same_bits(drifted, dst)  # nothing written
    dst["a"].copy_(before["a"])
    assert await r.apply_payload(dst, patch) == 1
    assert_same_bits(src, dst)


def test_ctx_beats_flat_on_a_realistic_update():
    """The bench's update (AdamW, lr 2e-6, fp32 master, bf16 receiver), a small model: the context
    coder needs clearly fewer bytes than ``flat`` + zstd (``aiosync bench`` measures the full size)."""
    from aiosync.cli import bench

    sizes = {}

    async def run(encoding, compression):  # the same updates for both encodings
        trainer = bench.Trainer(bench.transformer_state(600_000, 128, 1024, seed=0), 2e-6, seed=0)
        for _ in range(4):
            trainer.step()
        state = trainer.state_dict()
        dst = {k: v.to(torch.bfloat16) for k, v in state.items()}
        s, r, a, b = await connect(state, dst, encoding, False, compression)
        changed = 0
        total = 0
        for version in range(1, 3):
            before = {k: v.clone() for k, v in dst.items()}
            await asyncio.to_thread(trainer.step)
            await s.sync(state, a.send, version)
            p = await b.recv()
            total += p.nbytes
            assert await r.apply_payload(dst, p) == version
            changed += bench.count_changed(before, dst)
        assert bench.bit_exact(state, dst)
        return total / changed

    for encoding, compression in (("ctx", "none"), ("flat", "zstd")):
        sizes[encoding] = asyncio.run(run(encoding, compression))
    assert sizes["ctx"] < 0.9 * sizes["flat"], sizes  # (the tables weigh more on a small model's patch)
