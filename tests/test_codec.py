"""The patch codec on edge cases (W10-W12, B1, B2) in every encoding (``coo``, ``flat``, ``ctx``),
and malformed payloads (SPEC §7: a clear PayloadError, nothing changed)."""

from __future__ import annotations

import asyncio
import dataclasses

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aiosync.errors import PatchChainError, PayloadError
from aiosync.syncers import CompressedWeightPatch, EmptyWeightPatch, WeightPatch
from codec_cases import FORMAT_IDS, FORMATS, assert_same_bits, change, connect, make_state, mutate
from helpers import bits


# ------------------------------------------------------------------------- edge cases
@pytest.mark.parametrize("case", ["empty", "single", "all", "first_last", "nan"])
@pytest.mark.parametrize("compression", ["none", "zstd"])
@pytest.mark.parametrize("encoding,delta", FORMATS, ids=FORMAT_IDS)
async def test_codec_edge_cases(encoding, delta, compression, case):
    src = make_state()
    dst = {k: v.clone() for k, v in src.items()}
    s, r, a, b = await connect(src, dst, encoding, delta, compression)
    expected = mutate(src, case)
    sent = []

    async def send(p):
        sent.append(p)
        await a.send(p)

    await s.sync(src, send, 1)
    patch = sent[0]
    if case == "empty":
        assert type(patch) is EmptyWeightPatch and patch.version == 1
    else:
        assert type(patch) is (WeightPatch if compression == "none" else CompressedWeightPatch)
        assert patch.nnz == expected
    assert s.statistics().changed == expected
    assert await r.apply(dst, b.recv) == 1
    assert r.statistics().changed == expected
    assert_same_bits(src, dst)
    # and a second version on top (chained), changing everything back and more
    more = mutate(src, "first_last", seed=2)
    await s.sync(src, send, 2)
    assert sent[-1].nnz == more
    assert await r.apply(dst, b.recv) == 2
    assert_same_bits(src, dst)


@pytest.mark.parametrize("shape", [(), (1,), (9,), (1, 1), (3, 7), (2, 3, 4), (2, 1, 3, 4), (1, 2, 1, 5)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.int32, torch.int64,
                                   torch.uint8, torch.bool])
@pytest.mark.parametrize("encoding,delta", FORMATS, ids=FORMAT_IDS)
async def test_codec_shapes_and_dtypes(encoding, delta, dtype, shape):
    g = torch.Generator().manual_seed(sum(shape) * 31 + len(shape) * 7 + len(str(dtype)))
    if dtype == torch.bool:
        t = torch.rand(shape, generator=g) > 0.5
    elif dtype.is_floating_point:
        t = torch.randn(shape, generator=g).to(dtype)
    else:
        t = torch.randint(0, 100, shape, generator=g).to(dtype)
    src = {"x": t}
    dst = {"x": t.clone()}
    s, r, a, b = await connect(src, dst, encoding, delta, "zstd" if t.numel() % 2 else "none")
    n = t.numel()
    idx = torch.tensor(sorted({0, n - 1, n // 2}))
    change(src["x"], idx, g)
    await s.sync(src, a.send, 1)
    assert await r.apply(dst, b.recv) == 1
    assert s.statistics().changed == idx.numel()
    assert torch.equal(bits(dst["x"]), bits(src["x"]))
    assert dst["x"].shape == torch.Size(shape) and dst["x"].dtype == dtype


@pytest.mark.parametrize("compression", ["none", "zstd"])
async def test_coo_indices_are_downscaled(compression):
    src = {"small": torch.zeros(4, 200), "wide": torch.zeros(2, 70000)}
    dst = {k: v.clone() for k, v in src.items()}
    s, r, a, b = await connect(src, dst, "coo", False, "none")
    src["small"][3, 199] = 1.0
    await s.sync(src, a.send, 1)
    p = await b.recv()
    assert p.rows.dtype == torch.uint8 and p.cols.dtype == torch.uint8
    assert p.rows.tolist() == [3] and p.cols.tolist() == [199]
    assert p.values.dtype == torch.uint8 and p.values.numel() == 4
    await r.apply_payload(dst, p)
    src["wide"][1, 69999] = 2.0
    await s.sync(src, a.send, 2)
    p = await b.recv()
    assert p.cols.dtype == torch.int32 and p.cols.tolist() == [69999] and p.rows.tolist() == [1]
    assert p.ordinals.tolist() == [1]
    await r.apply_payload(dst, p)
    assert_same_bits(src, dst)


async def test_coo_delta_encoding_on_the_wire():
    src = {"m": torch.zeros(6, 10)}
    dst = {"m": torch.zeros(6, 10)}
    s, r, a, b = await connect(src, dst, "coo", True, "none")
    for rr, cc in [(0, 3), (0, 7), (2, 1), (2, 9), (5, 0)]:
        src["m"][rr, cc] = 1.0
    await s.sync(src, a.send, 1)
    p = await b.recv()
    assert p.delta_encoded
    assert p.rows.tolist() == [0, 0, 2, 0, 3]
    assert p.cols.tolist() == [3, 4, 1, 8, 0]
    assert p.values.view(torch.float32).tolist() == [1.0] * 5
    assert await r.apply_payload(dst, p) == 1
    assert torch.equal(dst["m"], src["m"])


# ------------------------------------------------------------------ malformed payloads
async def _prepared(encoding, delta, compression):
    src = make_state()
    dst = {k: v.clone() for k, v in src.items()}
    s, r, a, b = await connect(src, dst, encoding, delta, compression)
    await s.sync(src, a.send, 1)  # empty: moves the receiver to a known version
    assert await r.apply(dst, b.recv) == 1
    mutate(src, "first_last", seed=7)
    await s.sync(src, a.send, 2)
    patch = await b.recv()
    return src, dst, r, patch


def _corruptions(patch):
    """(name, corrupted payload) pairs; each must be refused with PayloadError."""
    out = []
    rep = dataclasses.replace
    two = patch.ordinals.numel() >= 2
    out.append(("ordinal out of range", rep(patch, ordinals=torch.full_like(patch.ordinals, 200))))
    if two:
        o = patch.ordinals.clone()
        o[1] = o[0]
        out.append(("duplicated ordinal", rep(patch, ordinals=o)))
        o = patch.ordinals.clone()
        o[0], o[1] = patch.ordinals[1], patch.ordinals[0]
        out.append(("reordered ordinals", rep(patch, ordinals=o)))
    n = patch.nnz_per_tensor.to(torch.int64).clone()
    n[0] += 1
    out.append(("nnz too large", rep(patch, nnz_per_tensor=n)))
    n = patch.nnz_per_tensor.to(torch.int64).clone()
    n[-1] -= 1
    out.append(("nnz too small", rep(patch, nnz_per_tensor=n)))
    out.append(("nnz count mismatch", rep(patch, nnz_per_tensor=patch.nnz_per_tensor[:-1])))
    if isinstance(patch, WeightPatch):
        out.append(("truncated values", rep(patch, values=patch.values[:-1])))
        out.append(("values too long", rep(patch, values=torch.cat([patch.values, patch.values[:3]]))))
        out.append(("values wrong dtype", rep(patch, values=patch.values.to(torch.int16))))
        out.append(("truncated cols", rep(patch, cols=patch.cols[:-1])))
        if patch.encoding == "coo":
            out.append(("truncated rows", rep(patch, rows=patch.rows[:-1])))
            out.append(("no rows", rep(patch, rows=None)))
            rows = patch.rows.to(torch.int64).clone()
            rows[-1] += 10_000
            out.append(("row out of range", rep(patch, rows=rows)))
            cols = patch.cols.to(torch.int64).clone()
            cols[-1] += 100_000
            out.append(("col out of range", rep(patch, cols=cols)))
            if not patch.delta_encoded:
                cols = patch.cols.to(torch.int64).clone()
                rows = patch.rows.to(torch.int64).clone()
                nnz = patch.nnz_per_tensor.tolist()
                i = next(i for i, n in enumerate(nnz) if n >= 2)  # a tensor with two changes
                at = sum(nnz[:i])
                rows[at + 1], cols[at + 1] = rows[at], cols[at]  # a repeated position inside one tensor
                out.append(("repeated position", rep(patch, rows=rows, cols=cols)))
            out.append(("float indices", rep(patch, cols=patch.cols.to(torch.float32))))
        else:
            gb = patch.gap_bytes.to(torch.int64).clone()
            gb[0] += 1
            out.append(("gap_bytes do not add up", rep(patch, gap_bytes=gb)))
            out.append(("no gap_bytes", rep(patch, gap_bytes=None)))
            cols = patch.cols.clone()
            cols[-1] = 0x80  # last varint continues: truncated stream
            out.append(("truncated varint", rep(patch, cols=cols)))
            cols = patch.cols.clone()
            cols[0] = 0x7F  # first gap far too large
            out.append(("gap beyond tensor", rep(patch, cols=cols)))
        out.append(("unknown encoding", rep(patch, encoding="csr")))
    else:
        # zstd streams travel as frames named "<stream>#<i>"
        blobs = dict(patch.blobs)
        name = next(k for k in blobs if k.startswith("values"))
        blobs[name] = blobs[name][:-3]
        out.append(("truncated zstd blob", rep(patch, blobs=blobs)))
        blobs = dict(patch.blobs)
        bad = blobs["cols#0"].clone()
        bad[:4] = torch.tensor([1, 2, 3, 4], dtype=torch.uint8)  # destroy the zstd frame magic
        blobs["cols#0"] = bad
        out.append(("corrupted zstd blob", rep(patch, blobs=blobs)))
        sizes = dict(patch.sizes)
        sizes["cols#0"] += 1
        out.append(("wrong stream size", rep(patch, sizes=sizes)))
        sizes = dict(patch.sizes)
        sizes["cols"] += 1
        out.append(("wrong total stream size", rep(patch, sizes=sizes)))
        blobs = dict(patch.blobs)
        del blobs["cols#0"]
        out.append(("missing stream", rep(patch, blobs=blobs)))
        blobs = dict(patch.blobs)
        blobs["cols#7"] = blobs["cols#0"]
        out.append(("frame gap", rep(patch, blobs=blobs)))
        blobs = dict(patch.blobs)
        blobs["cols#x"] = blobs["cols#0"]
        out.append(("malformed frame name", rep(patch, blobs=blobs)))
        out.append(("unknown codec", rep(patch, codec="brotli")))
        dtypes = dict(patch.dtypes)
        dtypes["cols"] = "float32"
        out.append(("bad stream dtype", rep(patch, dtypes=dtypes)))
    return out


@pytest.mark.parametrize("compression", ["none", "zstd"])
@pytest.mark.parametrize("encoding,delta", FORMATS, ids=FORMAT_IDS)
async def test_malformed_payloads_raise_and_change_nothing(encoding, delta, compression):
    src, dst, r, patch = await _prepared(encoding, delta, compression)
    before = {k: v.clone() for k, v in dst.items()}
    cases = _corruptions(patch)
    assert len(cases) >= 6
    for name, bad in cases:
        with pytest.raises(PayloadError) as info:
            await r.apply_payload(dst, bad)
            pytest.fail(f"{name}: accepted")
        assert not isinstance(info.value, PatchChainError), name
        assert r.version == 1, name
        assert_same_bits(before, dst)
    for junk in (None, b"\x00\x01", {"w": torch.zeros(1)}, torch.zeros(3)):
        with pytest.raises(PayloadError):
            await r.apply_payload(dst, junk)
    assert_same_bits(before, dst)
    # the genuine patch still applies afterwards, bit-exact
    assert await r.apply_payload(dst, patch) == 2
    assert_same_bits(src, dst)


# ------------------------------------------------------------------- property test
_DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.int32, torch.int64, torch.uint8, torch.bool]


@st.composite
def _case(draw):
    n_tensors = draw(st.integers(1, 3))
    specs = []
    for _ in range(n_tensors):
        shape = tuple(draw(st.lists(st.integers(1, 6), min_size=0, max_size=4)))
        dtype = draw(st.sampled_from(_DTYPES))
        numel = int(np.prod(shape)) if shape else 1
        changed = draw(st.sets(st.integers(0, numel - 1), max_size=numel))
        specs.append((shape, dtype, sorted(changed)))
    fmt = draw(st.sampled_from(FORMATS))
    compression = draw(st.sampled_from(["none", "zstd"]))
    seed = draw(st.integers(0, 2**16))
    return specs, fmt, compression, seed


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_case())
def test_property_random_changes_round_trip_bit_exact(case):
    specs, (encoding, delta), compression, seed = case
    g = torch.Generator().manual_seed(seed)
    src = {}
    for i, (shape, dtype, _) in enumerate(specs):
        if dtype == torch.bool:
            src[f"t{i}"] = torch.rand(shape, generator=g) > 0.5
        elif dtype.is_floating_point:
            src[f"t{i}"] = torch.randn(shape, generator=g).to(dtype)
        else:
            src[f"t{i}"] = torch.randint(0, 256, shape, generator=g).to(dtype)
    dst = {k: v.clone() for k, v in src.items()}

    async def run():
        s, r, a, b = await connect(src, dst, encoding, delta, compression)
        for i, (_, _, changed) in enumerate(specs):
            change(src[f"t{i}"], torch.tensor(changed, dtype=torch.int64), g)
        await s.sync(src, a.send, 1)
        assert await r.apply(dst, b.recv) == 1
        assert s.statistics().changed == sum(len(c) for _, _, c in specs)

    asyncio.run(run())
    assert_same_bits(src, dst)


@pytest.mark.parametrize("encoding,delta", FORMATS, ids=FORMAT_IDS)
async def test_non_contiguous_receiver_tensor(encoding, delta):
    """A transposed 2-D receiver tensor is written through its strided view (torch apply path)."""
    src = {"m": torch.randn(5, 7).to(torch.bfloat16), "v": torch.randn(9)}
    dst = {"m": src["m"].t().contiguous().t(), "v": src["v"].clone()}
    assert not dst["m"].is_contiguous() and torch.equal(dst["m"], src["m"])
    s, r, a, b = await connect(src, dst, encoding, delta, "zstd")
    g = torch.Generator().manual_seed(1)
    change(src["m"], torch.tensor([0, 6, 7, 20, 34]), g)
    change(src["v"], torch.tensor([8]), g)
    await s.sync(src, a.send, 1)
    assert await r.apply(dst, b.recv) == 1
    assert not dst["m"].is_contiguous()
    assert torch.equal(bits(dst["m"]), bits(src["m"])) and torch.equal(bits(dst["v"]), bits(src["v"]))
