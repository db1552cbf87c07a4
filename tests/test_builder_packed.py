"""The packed torch-ops builder (issue 18, item 5) on CPU: kernels per build independent of the
number of tensors, transient memory bounded per group, bits exact against the numba builder and
torch's cast; the fused Triton kernels under Triton's interpreter (skipped without triton)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from aiosync.syncers.snapshot import cuda as snapshot_cuda
from aiosync.syncers.snapshot.builder import Snapshot
from helpers import bits

EDGE = [0x7FC00000, 0xFFC00000, 0x7F800001, 0xFF800001, 0x7FFFFFFF, 0x7FA5A5A5, 0x7F800000, 0xFF800000, 0x00000000,
        0x80000000, 0x00000001, 0x80000001, 0x007FFFFF, 0x00008000, 0x00018000, 0x7F7FFFFF, 0xFF7FFFFF, 0x7F7F8000,
        0x3F808000, 0x3F818000, 0x3F80FFFF, 0x3F807FFF, 0xBF818000]


def edge_floats() -> torch.Tensor:
    """fp32 NaN payloads of both signs, ±0, ±inf, subnormals, max finite, rounding ties."""
    return torch.tensor(EDGE, dtype=torch.int64).to(torch.int32).view(torch.float32)


class Ops(TorchDispatchMode):
    """Counts the aten ops that run kernels (views launch none) and keeps their outputs' sizes."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []
        self.outputs: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not func.is_view:
            self.ops.append(str(func))
            for t in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(t, torch.Tensor):
                    self.outputs.append((str(func), t.numel()))
        return out


def model(n: int, seed: int = 0) -> tuple[list[torch.Tensor], list[torch.dtype]]:
    """``n`` small fp32 weights (synced as bf16), with an int64 and a bool buffer among them."""
    g = torch.Generator().manual_seed(seed)
    tensors = [torch.randn(50 + i % 7, generator=g) for i in range(n)]
    dtypes = [torch.bfloat16] * n
    tensors[n // 2], dtypes[n // 2] = torch.arange(9), torch.int64
    tensors[n // 3], dtypes[n // 3] = torch.zeros(5, dtype=torch.bool), torch.bool
    return tensors, dtypes


def build_ops(n: int) -> list[str]:
    tensors, dtypes = model(n)
    snap = Snapshot("cpu", kernel="torch")
    snap.load(tensors, dtypes)
    for t in tensors:
        if t.dtype == torch.bool:
            t[1] = True
        else:
            t[::3] += 1
    with Ops() as ops:
        diffs = snap.diff(tensors)
    assert len(diffs) == n  # every tensor changed, each its own TensorDiff
    for d, t, dt in zip(diffs, tensors, dtypes):
        assert torch.equal(bits(snap.tensor(d.slot)), bits(t.to(dt)))
    return ops.ops


def test_one_build_dispatches_as_many_kernels_for_200_tensors_as_for_20():
    few, many = build_ops(20), build_ops(200)
    assert sorted(few) == sorted(many), f"{len(few)} ops for 20 tensors, {len(many)} for 200"
    assert len(many) < 60  # three groups (bf16, int64, bool) of a constant handful each


def test_the_transient_memory_of_a_dense_update_is_bounded_by_the_group(monkeypatch):
    group = 1 << 12
    monkeypatch.setattr(snapshot_cuda, "GROUP_ELEMS", group)
    big, small = torch.randn(10 * group + 17), torch.randn(300)
    snap = Snapshot("cpu", kernel="torch")
    snap.load([big, small], [torch.bfloat16, torch.bfloat16])
    big += 1.0  # dense: every element changes
    small[::2] += 1.0
    with Ops() as ops:
        diffs = snap.diff([big, small])
    assert diffs[0].nnz == big.numel() and diffs[0].positions.tolist() == list(range(big.numel()))
    over = [(op, n) for op, n in ops.outputs if n > group]
    # only the three results of the large tensor (positions, new, old: the format's output) exceed a group
    assert sorted(over) == [("aten.cat.default", big.numel())] * 3
    assert max(n for op, n in ops.outputs if "nonzero" in op) <= group


def test_the_packed_builder_is_bit_exact_with_the_numba_builder_and_torchs_cast():
    g = torch.Generator().manual_seed(5)
    edge = edge_floats()
    base = [torch.randn(40, generator=g), torch.randn(7, 9, generator=g), torch.randn(1000, generator=g),
            torch.randn(3, generator=g)]
    packed, numba = Snapshot("cpu", kernel="torch"), Snapshot("cpu", kernel="auto", chunk_elems=256)
    dtypes = [torch.bfloat16, torch.bfloat16, torch.bfloat16, torch.float32]
    packed.load(base, dtypes)
    numba.load(base, dtypes)
    for step in range(3):
        cur = [t.clone() for t in base]
        for k, t in enumerate(cur):
            flat = t.view(-1)
            at = torch.randperm(flat.numel(), generator=g)[: min(len(EDGE), flat.numel())]
            flat[at] = edge[torch.randint(0, len(EDGE), (at.numel(),), generator=g)]
            flat[(step + k) % flat.numel()] = edge[step]
        a, b = packed.diff(cur), numba.diff(cur)
        assert [d.slot for d in a] == [d.slot for d in b] and a
        for x, y in zip(a, b):
            assert torch.equal(x.positions, y.positions)
            assert torch.equal(x.new_bits, y.new_bits) and torch.equal(x.old_bits, y.old_bits)
            want = bits(cur[x.slot].reshape(-1).to(dtypes[x.slot]))
            assert torch.equal(x.new_bits, want[x.positions])  # what a bucket (torch's cast) delivers
        for i, dt in enumerate(dtypes):
            assert torch.equal(bits(packed.tensor(i)), bits(cur[i].to(dt)))
        base = cur


def test_snapshots_that_are_not_back_to_back_are_still_diffed_and_updated():
    """diff_groups on snapshots it did not lay out (no contiguous run): a packed copy, written back."""
    srcs = [torch.randn(10), torch.randn(20)]
    holder = torch.zeros(64, dtype=torch.bfloat16)
    snaps = [holder[0:10], holder[30:50]]
    out = snapshot_cuda.diff_groups(list(zip(srcs, snaps)))
    for (pos, nv, ov), s, src in zip(out, snaps, srcs):
        assert pos.tolist() == list(range(src.numel())) and torch.equal(ov, torch.zeros_like(ov))
        assert torch.equal(bits(s), bits(src.to(torch.bfloat16)))
    assert torch.equal(holder[10:30], torch.zeros(20, dtype=torch.bfloat16))


INTERPRETED = textwrap.dedent("""
    import os, sys
    assert os.environ["TRITON_INTERPRET"] == "1"
    import torch
    sys.path.insert(0, sys.argv[1])
    from test_builder_packed import edge_floats
    from aiosync.syncers.snapshot import cuda as snapshot_cuda, triton as snapshot_triton
    g = torch.Generator().manual_seed(1)
    assert snapshot_cuda.self_check(torch.device("cpu"))
    import warnings
    snapshot_triton._RULES["cpu"] = (snapshot_triton.NAN_CONST, 0x7FC0)  # a wrong NaN rule: must be caught
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert not snapshot_cuda.self_check(torch.device("cpu"))
    assert "fused builder disabled" in str(caught[0].message)
    del snapshot_triton._RULES["cpu"]
    kinds = [(torch.float32, torch.bfloat16), (torch.float32, torch.float32), (torch.int64, torch.int64),
             (torch.bool, torch.bool), (torch.bfloat16, torch.bfloat16)]
    for src_dt, snap_dt in kinds:
        def sources():
            g.manual_seed(2)
            out = [torch.cat([edge_floats(), torch.randn(2100, generator=g)]), torch.randn(5, generator=g),
                   torch.randn(1024, generator=g), torch.randn(1, generator=g)]
            return [(t > 0) if src_dt == torch.bool else (t * 100).to(src_dt) if src_dt == torch.int64
                    else t.to(src_dt) for t in out]
        results = []
        for backend in ("fused", "torch"):
            srcs = sources()
            snaps = [torch.zeros(s.numel(), dtype=snap_dt) for s in srcs]
            snaps[2].copy_(srcs[2].to(snap_dt))
            snaps[2][::5] = snaps[2][1::5]
            out = snapshot_cuda.diff_groups(list(zip(srcs, snaps)), group_elems=1500, backend=backend)
            results.append([x for r in out for x in r] + snaps)
            if backend == "fused" and snap_dt == torch.bfloat16 and src_dt == torch.float32:
                for (pos, nv, _), s in zip(out, srcs):
                    assert torch.equal(nv, s.to(torch.bfloat16).view(torch.int16)[pos])
        for a, b in zip(*results):
            assert a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8)), (src_dt, snap_dt)
    print("interpreted ok")
""")


def test_the_fused_kernels_under_tritons_interpreter_match_the_torch_ops():
    pytest.importorskip("triton", reason="triton is not installed (it ships with CUDA torch wheels)")
    env = dict(os.environ, TRITON_INTERPRET="1")
    here = os.path.dirname(__file__)
    done = subprocess.run([sys.executable, "-c", INTERPRETED, here], env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0 and "interpreted ok" in done.stdout, done.stderr[-3000:]


def test_the_fused_kernels_compile_for_a_hopper_gpu():
    """Compiled ahead of time for sm_90 (no GPU needed: Triton ships its own ptxas)."""
    triton = pytest.importorskip("triton", reason="triton is not installed (it ships with CUDA torch wheels)")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from aiosync.syncers.snapshot import triton as st

    ptr = {"tile_member": "*i32", "members": "*i64", "words": "*i32", "counts": "*i32"}
    gather = {**ptr, "ends": "*i64", "out_pos": "*i64", "out_new": "*i16", "out_old": "*i16"}
    gather = {k: gather[k] for k in ("tile_member", "members", "words", "ends", "counts", "out_pos", "out_new",
                                     "out_old")}
    for cast, width, mode in ((True, 2, st.NAN_CONST), (True, 2, st.NAN_QUIET), (False, 1, 0), (False, 8, 0)):
        meta = dict(W=width, CAST=cast, NAN_MODE=mode, NAN_BITS=0x7FFF, TILE=st.TILE)
        for fn, sig in ((st._compare, ptr), (st._gather, gather)):
            src = ASTSource(fn, {**sig, **dict.fromkeys(meta, "constexpr")}, meta)
            assert triton.compile(src, target=GPUTarget("cuda", 90, 32)).asm["cubin"]
