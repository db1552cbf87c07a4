"""Shared cases of the patch codec tests: a state of every dtype and shape, edge-case
mutations, a connected syncer pair, and plain-Python references of the value codes."""

from __future__ import annotations

import asyncio

import torch

from aiosync.syncers import PatchWeightSyncer
from aiosync.transports.inproc import inproc_pair
from helpers import bits


# (encoding, delta_encoding) variants of the wire format
FORMATS = [("coo", True), ("coo", False), ("flat", False), ("ctx", False)]
FORMAT_IDS = ["coo-delta", "coo-abs", "flat", "ctx"]




def make_state(seed: int = 0) -> dict[str, torch.Tensor]:
    """Tensors of 0-d to 4-d in every supported dtype, NaNs and a zero-size tensor included."""
    g = torch.Generator().manual_seed(seed)
    nan_t = torch.randn(4, 6, generator=g)
    nan_t[0, 0] = float("nan")
    nan_t[3, 5] = float("nan")
    nan_t[1, 2] = -0.0
    return {
        "scalar_f32": torch.tensor(1.25),
        "vec_bf16": torch.randn(300, generator=g).to(torch.bfloat16),  # > 255 columns: int32 cols
        "mat_f16": torch.randn(5, 70, generator=g).to(torch.float16),
        "t3_f32": torch.randn(3, 4, 5, generator=g),
        "t4_i32": torch.randint(-(2**31), 2**31 - 1, (2, 3, 4, 5), dtype=torch.int32, generator=g),
        "vec_i64": torch.randint(-(2**62), 2**62, (17,), dtype=torch.int64, generator=g),
        "mat_u8": torch.randint(0, 256, (4, 9), dtype=torch.uint8, generator=g),
        "t3_bool": torch.rand(2, 3, 3, generator=g) > 0.5,
        "nan_f32": nan_t,
        "empty": torch.zeros(0, 4),
        "long_rows": torch.randn(300, 2, generator=g).to(torch.bfloat16),  # > 255 rows
    }


def change(t: torch.Tensor, flat_index: torch.Tensor, g: torch.Generator, nudge: bool = True) -> None:
    """Change the elements at ``flat_index`` of ``t`` in place (always a real bit change).

    With ``nudge`` about half of them move by 1-3 units in the last place only (which a cast
    to a narrower dtype may round away)."""
    if flat_index.numel() == 0:
        return
    if t.dtype == torch.bool:
        v = t.view(-1)
        v[flat_index] = ~v[flat_index]
        return
    b = bits(t).view(-1) if t.is_contiguous() else None
    assert b is not None
    width = t.element_size()
    n = flat_index.numel()
    if width == 8:
        noise = torch.randint(1, 2**62, (n,), dtype=torch.int64, generator=g)
    else:
        noise = torch.randint(1, 2 ** (8 * width - 1), (n,), dtype=torch.int64, generator=g).to(b.dtype)
    # about half the changes move by 1-3 units in the last place (a flat patch's nibble codes,
    # as in training), the rest by random bit flips (mostly escaped codes)
    step = torch.randint(1, 4, (n,), generator=g) * (torch.randint(0, 2, (n,), generator=g) * 2 - 1)
    nudged = (b[flat_index].to(torch.int64) + step).to(b.dtype)
    small = torch.randint(0, 2, (n,), generator=g).bool() & nudge
    b[flat_index] = torch.where(small, nudged, b[flat_index] ^ noise)


def mutate(state: dict[str, torch.Tensor], case: str, seed: int = 1) -> int:
    """Apply one of the edge cases to ``state``; return the number of changed elements."""
    g = torch.Generator().manual_seed(seed)
    total = 0
    if case == "empty":
        return 0
    if case == "single":
        change(state["t3_f32"], torch.tensor([27]), g)
        return 1
    for k, t in state.items():
        n = t.numel()
        if n == 0:
            continue
        if case == "all":
            idx = torch.arange(n)
        elif case == "first_last":
            idx = torch.tensor(sorted({0, n - 1}))
        elif case == "nan":
            if k != "nan_f32":
                continue
            v = t.view(-1)
            v[0] = 3.0  # NaN -> number
            v[1] = float("nan")  # number -> NaN
            bits(t).view(-1)[23] = int(bits(torch.tensor(float("nan")))) | 5  # NaN -> another NaN
            v[8] = 0.0  # -0.0 -> 0.0
            v[9] = -0.0  # x -> -0.0
            return 5
        else:
            raise AssertionError(case)
        change(t, idx, g)
        total += idx.numel()
    return total


async def connect(src, dst, encoding, delta, compression, **kw):
    s = PatchWeightSyncer(encoding=encoding, delta_encoding=delta, compression=compression, **kw)
    r = PatchWeightSyncer(encoding=encoding, delta_encoding=delta, compression=compression)
    a, b = inproc_pair(timeout=10)
    await asyncio.gather(s.init_sender(src, None, a.send, a.recv), r.init_receiver(dst, b.recv, b.send))
    return s, r, a, b


def zigzag_code_values(new_bits: torch.Tensor, old_bits: torch.Tensor) -> list[int]:
    """Reference value codes in plain Python: zig-zag of new - old modulo 2**bits (XOR for 8 bytes)."""
    w = new_bits.element_size()
    mod = 1 << (8 * w)
    out = []
    for a, b in zip(new_bits.reshape(-1).tolist(), old_bits.reshape(-1).tolist()):
        a, b = a % mod, b % mod
        if w == 8:
            out.append(a ^ b)
            continue
        d = (a - b) % mod
        d = d - mod if d >= mod // 2 else d
        out.append(2 * d if d >= 0 else -2 * d - 1)
    return out


def expected_flat_values(codes_per_tensor: list[list[int]], widths: list[int]) -> list[int]:
    """Reference ``flat`` values stream: nibbles two per byte (low first, escape 15), then the
    escaped codes of each width, widths ascending, byte plane by byte plane."""
    nibs = [min(z, 15) for codes in codes_per_tensor for z in codes]
    if len(nibs) % 2:
        nibs.append(0)
    out = [nibs[i] | nibs[i + 1] << 4 for i in range(0, len(nibs), 2)]
    for w in sorted(set(widths)):
        esc = [z for codes, wz in zip(codes_per_tensor, widths) if wz == w for z in codes if z >= 15]
        for b in range(w):
            out += [(z >> (8 * b)) & 0xFF for z in esc]
    return out


def assert_same_bits(x: dict, y: dict) -> None:
    assert list(x) == list(y) or set(x) == set(y)
    for k in x:
        assert x[k].dtype == y[k].dtype, k
        assert torch.equal(bits(x[k]), bits(y[k])), k
