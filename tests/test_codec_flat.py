"""The ``flat`` and ``coo`` codecs' kernels against torch and plain-Python references: varints,
the snapshot builders, the drift hash, zig-zag codes, value nibbles and escapes, the writer."""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest
import torch

from aiosync.errors import PayloadError
from aiosync.syncers.kernels import flat as kernels
from aiosync.syncers.common.integrity import drift_hash
from aiosync.syncers.patch.format import (TensorLayout, encode_patch, unzigzag_apply, varint_decode, varint_encode,
    zigzag_delta)
from aiosync.syncers.snapshot.builder import Snapshot
from codec_cases import change, expected_flat_values, zigzag_code_values
from helpers import bits


# ------------------------------------------------------------- numba vs torch references
def test_varint_encode_matches_numba_and_reference():
    values = [0, 1, 127, 128, 255, 16383, 16384, 2**21 - 1, 2**21, 2**35 + 3, 2**56, 2**63 - 1]
    enc = varint_encode(torch.tensor(values, dtype=torch.int64))
    want = b"".join(kernels.varint_bytes(v) for v in values)
    assert enc.dtype == torch.uint8
    assert bytes(enc.tolist()) == want
    assert varint_decode(enc).tolist() == values
    # the numba gap coder over positions gives the same stream as torch over the gaps
    pos = np.array([0, 1, 5, 133, 134, 20000, 2**40], np.int64)
    buf = np.empty(pos.size * 10, np.uint8)
    nibs, exc = np.zeros(pos.size, np.uint8), np.zeros((2, pos.size), np.uint8)
    zeros = np.zeros(pos.size, np.uint16)
    nb, first, n_exc = kernels.encode_flat(pos, zeros, zeros, pos.size, -1, buf, nibs, exc)
    assert n_exc == 0 and nibs.tolist() == [0] * pos.size
    gaps = torch.from_numpy(pos) - torch.cat([torch.tensor([-1]), torch.from_numpy(pos[:-1])]) - 1
    assert buf[:nb].tolist() == varint_encode(gaps).tolist()
    assert first == 1
    assert varint_encode(torch.empty(0, dtype=torch.int64)).numel() == 0


def test_varint_decode_rejects_truncated_and_overlong():
    with pytest.raises(PayloadError):
        varint_decode(torch.tensor([0x80], dtype=torch.uint8))
    with pytest.raises(PayloadError):
        varint_decode(torch.tensor([5, 0xFF, 0xFF], dtype=torch.uint8))
    with pytest.raises(PayloadError):
        varint_decode(torch.tensor([0xFF] * 10 + [1], dtype=torch.uint8))


@pytest.mark.parametrize("src_dtype,snap_dtype", [(torch.float32, torch.float32), (torch.float32, torch.bfloat16),
                                                  (torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16),
                                                  (torch.int64, torch.int64), (torch.bool, torch.bool),
                                                  (torch.uint8, torch.uint8), (torch.int32, torch.int32)])
def test_snapshot_torch_kernel_matches_numba(src_dtype, snap_dtype):
    g = torch.Generator().manual_seed(3)
    shapes = [(1000,), (7, 129), (3, 5, 11), (), (64,), (65,)]

    def make():
        out = []
        for shape in shapes:
            if src_dtype == torch.bool:
                out.append(torch.rand(shape, generator=g) > 0.5)
            elif src_dtype.is_floating_point:
                out.append(torch.randn(shape, generator=g).to(src_dtype))
            else:
                out.append(torch.randint(0, 120, shape, generator=g).to(src_dtype))
        return out

    base = make()
    # small chunks: exercises the chunking of the numba path (and chunk borders)
    a, b = Snapshot(kernel="auto", chunk_elems=128, workers=2), Snapshot(kernel="torch")
    dtypes = [snap_dtype] * len(shapes)
    a.load(base, dtypes)
    b.load(base, dtypes)
    for step in range(3):
        cur = [t.clone() for t in base]
        for t in cur:
            n = t.numel()
            k = max(1, n // (3 + step * 20))
            change(t, torch.randperm(n, generator=g)[:k], g, nudge=False)  # every tensor must change
        if src_dtype.is_floating_point:
            cur[0].view(-1)[5] = float("nan")
            cur[0].view(-1)[6] = -0.0
        da, db = a.diff(cur), b.diff(cur)
        assert [d.slot for d in da] == [d.slot for d in db] and len(da) == len(shapes)
        for x, y in zip(da, db):
            assert torch.equal(x.positions, y.positions)
            assert x.new_bits.dtype == y.new_bits.dtype
            assert torch.equal(x.new_bits, y.new_bits) and torch.equal(x.old_bits, y.old_bits)
        for i in range(len(shapes)):
            assert torch.equal(bits(a.tensor(i)), bits(b.tensor(i)))
            assert torch.equal(bits(a.tensor(i)), bits(cur[i].to(snap_dtype)))
        base = cur
    a.close()
    b.close()


def reference_drift_hash(positions: torch.Tensor, old_bits: torch.Tensor) -> int:
    """docs/wire-format.md, in plain Python integers: sum over changes of splitmix64's finaliser
    of (position * 0x9E3779B97F4A7C15) XOR old bits (zero-extended), modulo 2**64."""
    m = 2**64 - 1
    width = 8 * old_bits.element_size()
    total = 0
    for p, o in zip(positions.tolist(), old_bits.reshape(-1).tolist()):
        x = ((p * 0x9E3779B97F4A7C15) & m) ^ (o & ((1 << width) - 1))
        x ^= x >> 30
        x = (x * 0xBF58476D1CE4E5B9) & m
        x ^= x >> 27
        x = (x * 0x94D049BB133111EB) & m
        x ^= x >> 31
        total = (total + x) & m
    return total


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int16, torch.int32, torch.int64])
def test_drift_hash_matches_the_documented_reference(dtype):
    g = torch.Generator().manual_seed(9)
    positions = torch.sort(torch.randperm(1 << 20, generator=g)[:500]).values
    info = torch.iinfo(dtype)
    old = torch.randint(info.min, info.max, (500,), generator=g, dtype=torch.int64).to(dtype)
    want = reference_drift_hash(positions, old)
    assert drift_hash(positions, old) % 2**64 == want
    assert drift_hash(positions[:0], old[:0]) == 0
    moved = old.clone()
    moved[123] ^= 1  # one drifted element changes the hash
    assert drift_hash(positions, moved) % 2**64 != want


@pytest.mark.parametrize("snap_dtype", [torch.bfloat16, torch.float32, torch.float16, torch.int64, torch.uint8])
def test_fused_flat_builder_matches_torch_reference(snap_dtype):
    """diff_flat (numba, chunk-stitched gap stream) == torch diff + varint_encode + zigzag_delta.

    fp32 sources: bf16 snapshots take the fused cast, fp16 ones a torch cast per chunk."""
    g = torch.Generator().manual_seed(4)
    src_dtype = torch.float32 if snap_dtype.is_floating_point else snap_dtype
    shapes = [(2000,), (3, 50), (7,), (), (40,), (2, 3)]  # the small ones share tasks
    if src_dtype.is_floating_point:
        base = [torch.randn(sh, generator=g) for sh in shapes]
    else:
        base = [torch.randint(0, 200, sh, generator=g).to(src_dtype) for sh in shapes]
    fused = Snapshot(chunk_elems=192, workers=2)
    ref = Snapshot(kernel="torch")
    fused.load(base, [snap_dtype] * len(shapes))
    ref.load(base, [snap_dtype] * len(shapes))
    cur = [t.clone() for t in base]
    # changes at chunk borders, long gaps across chunks (> 127: multi-byte varints), first/last
    idx0 = torch.tensor([0, 191, 192, 193, 383, 384, 1500, 1999])
    change(cur[0], idx0, g)
    change(cur[1], torch.tensor([0, 149]), g)
    for t in cur[2:]:
        change(t, torch.tensor(sorted({0, t.numel() - 1})), g, nudge=False)
    cur[4].view(-1)[17:20] = cur[4].view(-1)[17:20] + 1  # a run of changes mid-tensor
    flat = fused.diff_flat(cur)
    tdiff = ref.diff(cur)
    assert [d.slot for d in flat] == [d.slot for d in tdiff]
    for f, t in zip(flat, tdiff):
        assert f.nnz == t.nnz
        prev = torch.cat([torch.tensor([-1]), t.positions[:-1]])
        assert f.gaps.tolist() == varint_encode(t.positions - prev - 1).tolist()
        z = zigzag_code_values(t.new_bits, t.old_bits)
        w = t.new_bits.element_size()
        assert f.nibbles.tolist() == [min(v, 15) for v in z]
        assert f.exceptions.shape == (w, sum(v >= 15 for v in z))
        assert [int.from_bytes(bytes(col), "little") for col in f.exceptions.T.tolist()] == [v for v in z if v >= 15]
        # the drift hash of the fused builder (positions in the whole tensor, across chunks)
        assert f.old_hash == drift_hash(t.positions, t.old_bits) % 2**64 == reference_drift_hash(t.positions, t.old_bits)
    assert 4 in {d.slot for d in flat}  # small tensors sharing a task are diffed too
    for i in range(len(shapes)):
        assert torch.equal(bits(fused.tensor(i)), bits(ref.tensor(i)))
    fused.close()
    ref.close()


def test_encode_patch_flat_numba_matches_torch_on_meta_positions():
    """The CPU (numba) flat encoder and the torch varint/zigzag path give the same bytes."""
    from aiosync.syncers.snapshot.builder import TensorDiff

    g = torch.Generator().manual_seed(5)
    pos = torch.tensor([0, 3, 200, 201, 5000], dtype=torch.int64)
    new = torch.randint(-(2**15), 2**15, (5,), dtype=torch.int64, generator=g).to(torch.int16)
    old = torch.randint(-(2**15), 2**15, (5,), dtype=torch.int64, generator=g).to(torch.int16)
    lay = [TensorLayout(0, 1, 6000, 2)]
    p = encode_patch([TensorDiff(0, pos, new, old)], lay, version=1, base_version=None, encoding="flat",
                     delta_encoding=False)
    prev = torch.cat([torch.tensor([-1]), pos[:-1]])
    assert p.cols.tolist() == varint_encode(pos - prev - 1).tolist()
    assert p.values.tolist() == expected_flat_values([zigzag_code_values(new, old)], [2])
    assert p.gap_bytes.tolist() == [p.cols.numel()]


_EDGE16 = [0, 1, 2, -1, -2, 0x7FFF, 0x7FFE, -0x8000, -0x7FFF, 0x3FFF, 0x4000, -0x4000, 0x00FF, 0x0100, 0x7F80,
           -0x0080]


def test_zigzag_round_trip_int16_all_old_values_edge_new_values():
    old = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
    for nv in _EDGE16:
        new = torch.full_like(old, nv)
        z = zigzag_delta(new, old)
        assert z.dtype == torch.int16
        assert torch.equal(unzigzag_apply(old, z), new)
    # all pairs of edge values, and the "small change, small code" property with wrap-around
    a = torch.tensor([x for x, _ in itertools.product(_EDGE16, _EDGE16)], dtype=torch.int16)
    b = torch.tensor([y for _, y in itertools.product(_EDGE16, _EDGE16)], dtype=torch.int16)
    assert torch.equal(unzigzag_apply(b, zigzag_delta(a, b)), a)
    old = torch.tensor([0, 0x7FFF, -0x8000, 5], dtype=torch.int16)
    up = torch.tensor([1, -0x8000, -0x7FFF, 6], dtype=torch.int16)  # +1 (wrapping at 0x7FFF)
    down = torch.tensor([-1, 0x7FFE, 0x7FFF, 4], dtype=torch.int16)  # -1 (wrapping at 0x8000)
    assert zigzag_delta(up, old).tolist() == [2, 2, 2, 2]
    assert zigzag_delta(down, old).tolist() == [1, 1, 1, 1]
    assert zigzag_delta(old, old).tolist() == [0, 0, 0, 0]


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int32, torch.int64])
def test_zigzag_round_trip_other_widths_and_numba_agrees(dtype):
    if dtype == torch.uint8:
        vals = torch.arange(256, dtype=torch.int64)
        a, b = torch.meshgrid(vals, vals, indexing="ij")
        a, b = a.reshape(-1).to(dtype), b.reshape(-1).to(dtype)
    else:
        info = torch.iinfo(dtype)
        edge = [0, 1, -1, 2, info.max, info.max - 1, info.min, info.min + 1, 12345, -12345]
        a = torch.tensor([x for x, _ in itertools.product(edge, edge)], dtype=dtype)
        b = torch.tensor([y for _, y in itertools.product(edge, edge)], dtype=dtype)
    z = zigzag_delta(a, b)
    assert z.dtype == dtype
    assert torch.equal(unzigzag_apply(b, z), a)
    w = a.element_size()
    u = {1: np.uint8, 4: np.uint32, 8: np.uint64}[w]
    an, bn = a.numpy().view(u), b.numpy().view(u)
    zn = z.numpy().view(u)
    for i in range(0, a.numel(), max(1, a.numel() // 200)):
        assert int(kernels._zigzag(an[i], bn[i], w)) == int(zn[i]), i


@pytest.mark.parametrize("width_dtype", [torch.int16, torch.int32, torch.int64, torch.uint8])
def test_flat_torch_encoder_matches_numba_encoder(monkeypatch, width_dtype):
    """The torch flat encoder (the one CUDA diffs take) emits the same bytes as the numba one."""
    from aiosync.syncers.patch import format as patch_format
    from aiosync.syncers.snapshot.builder import TensorDiff

    g = torch.Generator().manual_seed(6)
    w = torch.empty((), dtype=width_dtype).element_size()
    layouts = [TensorLayout(0, 3, 100, w), TensorLayout(2, 1, 20000, w), TensorLayout(5, 1, 1, w)]
    diffs = []
    for slot, lay in enumerate(layouts):
        n = min(lay.numel, 40)
        pos = torch.randperm(lay.numel, generator=g)[:n].sort().values
        lo, hi = (0, 256) if width_dtype == torch.uint8 else (-(2**15), 2**15)
        new = torch.randint(lo, hi, (n,), generator=g).to(width_dtype)
        old = torch.randint(lo, hi, (n,), generator=g).to(width_dtype)
        diffs.append(TensorDiff(slot, pos, new, old))
    kw = dict(version=3, base_version=2, encoding="flat", delta_encoding=False)
    p_numba = encode_patch(diffs, layouts, **kw)
    monkeypatch.setattr(patch_format, "_on_cpu", lambda diffs: False)
    p_torch = encode_patch(diffs, layouts, **kw)
    for name in ("ordinals", "nnz_per_tensor", "cols", "values", "gap_bytes"):
        x, y = getattr(p_numba, name), getattr(p_torch, name)
        assert x.dtype == y.dtype and x.tolist() == y.tolist(), name
    # and decoding it yields the positions and new bits back
    decoded = patch_format.decode_patch(p_torch, {lay.ordinal: lay for lay in layouts})
    for d, src in zip(decoded, diffs):
        assert torch.equal(d.positions, src.positions)
        assert torch.equal(d.new_bits(src.old_bits), src.new_bits)


# ------------------------------------------------------------- flat value nibbles and escapes
@pytest.mark.parametrize("dtype", [torch.int16, torch.uint8, torch.int32, torch.int64])
@pytest.mark.parametrize("torch_path", [False, True], ids=["numba", "torch"])
def test_flat_values_nibbles_and_escapes_byte_exact(monkeypatch, dtype, torch_path):
    """Codes 1..14 travel as nibbles, 15 and up escape whole; odd counts pad with a zero nibble.
    Both encoders emit the reference bytes, and decoding (numba and torch escape counting)
    gives the new bits back."""
    from aiosync.syncers.patch import format as patch_format
    from aiosync.syncers.snapshot.builder import TensorDiff

    w = torch.empty((), dtype=dtype).element_size()
    top = 255 if dtype == torch.uint8 else 2 ** (8 * w - 1) - 1
    # deltas around the escape threshold (codes 13..17), one ulp each way, and big jumps
    deltas = [1, -1, 7, -7, 7, -8, 8, -9, 100, -100, top // 2, 3, -3]
    old = torch.tensor([(37 * i) % 50 + 60 for i in range(len(deltas))], dtype=torch.int64)
    new = old + torch.tensor(deltas)
    if dtype == torch.int64:
        new[10] = old[10] ^ (1 << 62)
    if dtype == torch.uint8:
        new = new % 256
    old_b, new_b = old.to(dtype), new.to(dtype)
    layouts = [TensorLayout(0, 1, 64, w), TensorLayout(3, 2, 40, w)]
    diffs = [TensorDiff(0, torch.tensor([0, 5, 9, 63]), new_b[:4], old_b[:4]),
             TensorDiff(1, torch.tensor([1, 2, 3, 10, 20, 40, 41, 78, 79]), new_b[4:], old_b[4:])]
    codes = [zigzag_code_values(d.new_bits, d.old_bits) for d in diffs]
    assert any(z < 15 for c in codes for z in c) and any(z >= 15 for c in codes for z in c)
    if torch_path:
        monkeypatch.setattr(patch_format, "_on_cpu", lambda diffs: False)
    p = encode_patch(diffs, layouts, version=2, base_version=1, encoding="flat", delta_encoding=False)
    assert p.values.tolist() == expected_flat_values(codes, [w, w])  # 13 changes: one padding nibble
    by_ord = {lay.ordinal: lay for lay in layouts}
    for numba_counts in (True, False):
        monkeypatch.setattr(patch_format, "_flat_value_layout",
                            lambda *a, nc=numba_counts, f=patch_format._flat_value_layout: f(*a, numba_counts=nc))
        for d, src in zip(patch_format.decode_patch(p, by_ord), diffs):
            assert torch.equal(d.positions, src.positions)
            assert torch.equal(d.new_bits(src.old_bits), src.new_bits)
            assert d.n_exc == sum(z >= 15 for z in zigzag_code_values(src.new_bits, src.old_bits))
        monkeypatch.undo()
        if torch_path:
            monkeypatch.setattr(patch_format, "_on_cpu", lambda diffs: False)


def test_flat_values_malformed_nibbles_are_refused():
    """A nibble flipped to the escape (or away from it) changes how many exception bytes the
    stream must hold; a non-zero padding nibble is malformed too. Each is a PayloadError."""
    from aiosync.syncers.patch import format as patch_format
    from aiosync.syncers.snapshot.builder import TensorDiff

    layouts = {0: TensorLayout(0, 1, 100, 2)}
    old = torch.tensor([10, 10, 10], dtype=torch.int16)
    new = torch.tensor([11, 9, 500], dtype=torch.int16)  # codes 2, 1, 980 (escaped)
    p = encode_patch([TensorDiff(0, torch.tensor([1, 2, 3]), new, old)], [layouts[0]], version=1,
                     base_version=None, encoding="flat", delta_encoding=False)
    assert p.values.tolist()[:2] == [2 | 1 << 4, 15]  # nibbles 2, 1 | 15, padding 0
    good = patch_format.decode_patch(p, layouts)
    assert good[0].n_exc == 1
    for name, values in [
        ("nibble turned into an escape", torch.tensor([15 | 1 << 4] + p.values.tolist()[1:], dtype=torch.uint8)),
        ("escape turned into a nibble", torch.tensor([p.values[0].item(), 3] + p.values.tolist()[2:], dtype=torch.uint8)),
        ("padding nibble not zero", torch.tensor([p.values[0].item(), 15 | 2 << 4] + p.values.tolist()[2:],
                                                  dtype=torch.uint8)),
        ("exception bytes cut", p.values[:-1]),
        ("nibbles cut", p.values[:1]),
    ]:
        with pytest.raises(PayloadError):
            patch_format.decode_patch(dataclasses.replace(p, values=values), layouts)


def test_count_escapes_matches_a_plain_count_at_every_nibble_alignment():
    rng = np.random.default_rng(1)
    for _ in range(300):
        counts = rng.integers(0, 9, int(rng.integers(1, 6))).astype(np.int64)
        nibs = rng.choice([1, 2, 14, 15], int(counts.sum())).astype(np.uint8)
        packed = np.zeros((nibs.size + 1) // 2, np.uint8)
        kernels.pack_nibbles(nibs, packed)
        out = np.empty(counts.size, np.int64)
        kernels.count_escapes(packed, counts, out)
        starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
        assert out.tolist() == [int((nibs[a:a + n] == 15).sum()) for a, n in zip(starts, counts)]


@pytest.mark.parametrize("dt", [np.uint8, np.uint16, np.uint32, np.uint64])
def test_the_flat_writer_decodes_what_the_encoder_wrote_and_its_journal_undoes_it(dt):
    """The receiver's numba writer reads positions straight from the gap stream, writes the
    coded values, journals and hashes what it overwrote; restoring the journal undoes it."""
    from aiosync.syncers.kernels import write as kernels_write

    rng = np.random.default_rng(2)
    n = 5000
    old = rng.integers(0, np.iinfo(dt).max, n, dtype=dt, endpoint=True)
    pos = np.sort(rng.choice(n, 700, replace=False)).astype(np.int64)
    pos[-1] = n - 1
    new = old.copy()
    new[pos[:600]] += dt(1)  # small codes
    new[pos[600:]] ^= rng.integers(1, np.iinfo(dt).max, 100, dtype=dt)  # mostly escapes
    gaps, nibs = np.empty(pos.size * 10, np.uint8), np.empty(pos.size, np.uint8)
    exc = np.empty((np.dtype(dt).itemsize, pos.size), np.uint8)
    g, _, e = kernels.encode_flat(pos, new[pos], old[pos], pos.size, -1, gaps, nibs, exc)
    packed = np.zeros((pos.size + 1) // 2, np.uint8)
    kernels.pack_nibbles(nibs, packed)
    target, journal = old.copy(), np.empty(pos.size, dt)
    h = kernels_write.apply_flat_gaps_logged(target, gaps[:g], 0, pos.size, packed, 0, exc[:, :e], 0, journal)
    assert np.array_equal(target, new) and np.array_equal(journal, old[pos])
    signed = old[pos].view(np.dtype(f"i{np.dtype(dt).itemsize}"))
    assert int(h) == drift_hash(torch.from_numpy(pos), torch.from_numpy(signed)) & (2**64 - 1)
    kernels_write.restore_gaps(target, gaps[:g], 0, pos.size, journal)
    assert np.array_equal(target, old)
    check = np.empty(pos.size, np.int64)
    assert kernels.decode_gaps(gaps, 0, g, pos.size, n, check, True) == g and np.array_equal(check, pos)
    assert kernels.decode_gaps(gaps, 0, g, pos.size, n - 1, check, False) == -3  # last position outside
