"""Encoding of builder output into :class:`WeightPatch` and back (W10, W11, B1).

Two encodings share one container:

* ``coo`` — the seed's: per tensor, 2-D COO ``rows``/``cols`` (optionally delta-coded) and
  the new values' raw bytes.
* ``flat`` — per tensor, gaps between consecutive changed row-major positions, and values
  as zig-zag coded differences of bit patterns (new − old, modulo 2**bits) against the
  receiver's old values: a change of one unit in the last place costs one small symbol.
  Codes below 15 travel as one nibble (two per byte); larger ones escape to a list of whole
  codes. See docs/wire-format.md.

Decoding validates everything before anything is written: ordinals in range and strictly
increasing, counts that add up, positions inside each tensor, byte lengths that match.
Any violation is a :class:`aiosync.errors.PayloadError` naming the problem.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ...errors import PayloadError
from ..common.indexing import delta_decode, delta_encode, downscale_nonnegative_indices
from ..common.integrity import drift_hash
from .bounds import MAX_VARINT_BYTES
from ..common.payloads import EmptyWeightPatch, WeightPatch
from ..common.bits import BITS_DTYPES, np_bits
from ..kernels.warmup import ready as kernels_ready
from ..snapshot.builder import FlatDiff, TensorDiff

_WIDER = {1: torch.int16, 2: torch.int32, 4: torch.int64}


@dataclass(frozen=True)
class TensorLayout:
    """What both sides know about one synced tensor: its 2-D COO shape, element width and (for
    the ``ctx`` encoding's contexts) the receiver's dtype."""

    ordinal: int
    rows: int
    cols: int
    elem_size: int
    dtype: torch.dtype | None = None

    @property
    def numel(self) -> int:
        return self.rows * self.cols

    @property
    def bits_dtype(self) -> torch.dtype:
        return BITS_DTYPES[self.elem_size]


# ------------------------------------------------------------------ value coding
def zigzag_delta(new_bits: torch.Tensor, old_bits: torch.Tensor) -> torch.Tensor:
    """Zig-zag code ``new − old`` modulo 2**bits; same dtype as the inputs.

    ±1 becomes 2 / 1, so the changes of a slowly moving float fit in one small byte.
    8-byte elements use XOR instead (no wider integer type to subtract in).
    """
    width = new_bits.element_size()
    if width == 8:
        return new_bits ^ old_bits
    wide = _WIDER[width]
    mod = 1 << (8 * width)
    d = torch.remainder(new_bits.to(wide) - old_bits.to(wide), mod)
    s = torch.where(d >= mod // 2, d - mod, d)
    z = torch.where(s >= 0, 2 * s, -2 * s - 1)
    return _narrow(z, width)


def unzigzag_apply(old_bits: torch.Tensor, coded: torch.Tensor) -> torch.Tensor:
    """Invert :func:`zigzag_delta`: the new bits given the old ones."""
    width = old_bits.element_size()
    if width == 8:
        return old_bits ^ coded
    wide = _WIDER[width]
    mod = 1 << (8 * width)
    z = torch.remainder(coded.to(wide), mod)
    s = torch.where(z % 2 == 0, z // 2, -(z + 1) // 2)
    new = torch.remainder(torch.remainder(old_bits.to(wide), mod) + s, mod)
    return _narrow(new, width)


def _narrow(values: torch.Tensor, width: int) -> torch.Tensor:
    """Wide integers in [0, 2**bits) → the bits dtype of ``width`` (two's complement)."""
    dtype = BITS_DTYPES[width]
    if dtype == torch.uint8:
        return values.to(torch.uint8)
    mod = 1 << (8 * width)
    return torch.where(values >= mod // 2, values - mod, values).to(dtype)


# ------------------------------------------------------------- varints (torch)
def varint_encode(values: torch.Tensor) -> torch.Tensor:
    """LEB128-encode non-negative int64 ``values`` (any device) into a uint8 tensor."""
    values = values.to(torch.int64).reshape(-1)
    if values.numel() == 0:
        return torch.empty(0, dtype=torch.uint8, device=values.device)
    nbytes = torch.ones_like(values)
    for k in range(1, 9):
        nbytes += (values >= (1 << (7 * k))).to(torch.int64)
    offsets = torch.cumsum(nbytes, 0) - nbytes
    out = torch.empty(int(nbytes.sum()), dtype=torch.uint8, device=values.device)
    for k in range(int(nbytes.max())):
        sel = nbytes > k
        chunk = (values[sel] >> (7 * k)) & 0x7F
        more = (nbytes[sel] > k + 1).to(torch.int64) << 7
        out[offsets[sel] + k] = (chunk | more).to(torch.uint8)
    return out


def varint_decode(data: torch.Tensor) -> torch.Tensor:
    """Invert :func:`varint_encode`; raises :class:`PayloadError` on a truncated stream."""
    data = data.reshape(-1).to(torch.int64)
    if data.numel() == 0:
        return data
    if int(data[-1]) >= 0x80:
        raise PayloadError("varint stream is truncated (its last byte continues)")
    is_end = data < 0x80
    seg = torch.cumsum(is_end.to(torch.int64), 0) - is_end.to(torch.int64)
    starts = torch.cat([data.new_zeros(1), torch.nonzero(is_end).reshape(-1)[:-1] + 1])
    k = torch.arange(data.numel(), device=data.device) - starts[seg]
    if int(k.max()) > 8:
        raise PayloadError("varint longer than 9 bytes in the patch index stream")
    out = torch.zeros(int(is_end.sum()), dtype=torch.int64, device=data.device)
    out.index_add_(0, seg, (data & 0x7F) << (7 * k))
    return out


# ---------------------------------------------------------------------- encode
def _on_cpu(diffs: list[TensorDiff]) -> bool:
    return all(not d.positions.is_cuda for d in diffs)


def _encode_flat(diffs: list[TensorDiff], layouts: list[TensorLayout]):
    """Gap varints + value nibbles and exceptions; numba on CPU, torch ops elsewhere."""
    widths = [layouts[d.slot].elem_size for d in diffs]
    if _on_cpu(diffs) and kernels_ready(widths):
        from ..kernels.flat import encode_flat

        def one(i):
            d = diffs[i]
            gaps, nibs = np.empty(d.nnz * 10, np.uint8), np.empty(d.nnz, np.uint8)
            exc = np.empty((widths[i], d.nnz), np.uint8)
            new, old = np_bits(d.new_bits.contiguous()), np_bits(d.old_bits.contiguous())
            nb, _, e = encode_flat(d.positions.numpy(), new, old, d.nnz, -1, gaps, nibs, exc)
            return gaps[:nb], nibs, exc[:, :e]

        parts = list(_codec_pool().map(one, range(len(diffs)))) if len(diffs) > 1 else [one(0)]
        gaps = [torch.from_numpy(g) for g, _, _ in parts]
        values = torch.from_numpy(flat_values([n for _, n, _ in parts], [x for _, _, x in parts], widths))
    else:
        gaps, nibs, excs = [], [], []
        for d in diffs:
            prev = torch.cat([d.positions.new_full((1,), -1), d.positions[:-1]])
            gaps.append(varint_encode(d.positions - prev - 1))
            z = zigzag_delta(d.new_bits, d.old_bits).reshape(-1)
            zu = z.to(torch.int64) & ((1 << (8 * z.element_size())) - 1) if z.element_size() < 8 else z
            small = (zu >= 0) & (zu < ESCAPE)
            nibs.append(torch.where(small, zu, ESCAPE).to(torch.uint8))
            excs.append(z[~small].contiguous().view(torch.uint8).view(-1, z.element_size()).t())
        values = flat_values_torch(nibs, excs, widths)
    gap_bytes = torch.tensor([g.numel() for g in gaps], dtype=torch.int64)
    cols = torch.cat(gaps) if gaps else torch.empty(0, dtype=torch.uint8)
    return cols, values, gap_bytes


ESCAPE = 15  # the nibble of a value code that travels whole in the exception list


def flat_values(nibbles: list, exceptions: list, widths: list[int]):
    """The ``flat`` values stream from per-tensor nibbles (numpy uint8, one per change) and
    exception planes (``(width, e)``): nibbles packed two per byte (low nibble first), then
    the exceptions of each element width, widths ascending, byte-plane-wise."""
    from ..kernels.flat import pack_nibbles

    nibs = nibbles[0] if len(nibbles) == 1 else np.concatenate(nibbles)
    packed = np.empty((nibs.size + 1) // 2, np.uint8)
    pack_nibbles(nibs, packed)
    out = [packed]
    for w in sorted(set(widths)):
        block = [x for x, wx in zip(exceptions, widths) if wx == w and x.shape[1]]
        if block:
            out.append((block[0] if len(block) == 1 else np.concatenate(block, axis=1)).reshape(-1))
    return out[0] if len(out) == 1 else np.concatenate(out)


def flat_values_torch(nibbles: list[torch.Tensor], exceptions: list[torch.Tensor], widths: list[int]) -> torch.Tensor:
    """:func:`flat_values` in torch ops (any device)."""
    nibs = torch.cat(nibbles)
    if nibs.numel() % 2:
        nibs = torch.cat([nibs, nibs.new_zeros(1)])
    out = [nibs[0::2] | (nibs[1::2] << 4)]
    for w in sorted(set(widths)):
        block = [x for x, wx in zip(exceptions, widths) if wx == w and x.shape[1]]
        if block:
            out.append(torch.cat(block, dim=1).reshape(-1))
    return torch.cat(out)


_POOL = None


def _codec_pool():
    global _POOL
    if _POOL is None:
        import os
        from concurrent.futures import ThreadPoolExecutor

        from ...aio import lower_priority

        _POOL = ThreadPoolExecutor(max(1, min(4, os.cpu_count() or 1)), thread_name_prefix="aiosync-encode",
                                   initializer=lower_priority)
    return _POOL


def assemble_flat_patch(diffs: list[FlatDiff], layouts: list[TensorLayout], *, version: int,
                        base_version: int | None) -> WeightPatch | EmptyWeightPatch:
    """Build a ``flat`` patch from changes the builder already encoded (CPU fast path)."""
    if not diffs:
        return EmptyWeightPatch(version, base_version)
    values = flat_values([d.nibbles for d in diffs], [d.exceptions for d in diffs],
                         [layouts[d.slot].elem_size for d in diffs])
    ordinals = torch.tensor([layouts[d.slot].ordinal for d in diffs], dtype=torch.int64)
    return WeightPatch(
        version=version, base_version=base_version, encoding="flat", delta_encoded=False,
        ordinals=downscale_nonnegative_indices(ordinals),
        nnz_per_tensor=downscale_nonnegative_indices(torch.tensor([d.nnz for d in diffs], dtype=torch.int64)),
        rows=None, cols=torch.from_numpy(np.concatenate([d.gaps for d in diffs])), values=torch.from_numpy(values),
        gap_bytes=downscale_nonnegative_indices(torch.tensor([d.gaps.size for d in diffs], dtype=torch.int64)),
        old_hashes=torch.tensor([_as_int64(d.old_hash) for d in diffs], dtype=torch.int64),
    )


def _as_int64(h: int) -> int:
    """An unsigned 64-bit hash as the int64 with the same bits."""
    return h - (1 << 64) if h >= 1 << 63 else h


def encode_patch(diffs: list[TensorDiff], layouts: list[TensorLayout], *, version: int,
                 base_version: int | None, encoding: str, delta_encoding: bool) -> WeightPatch | EmptyWeightPatch:
    """Turn builder output (``diffs`` indexed by slot into ``layouts``) into a patch."""
    if not diffs:
        return EmptyWeightPatch(version, base_version)
    device = diffs[0].positions.device
    ordinals = torch.tensor([layouts[d.slot].ordinal for d in diffs], dtype=torch.int64, device=device)
    nnz = torch.tensor([d.nnz for d in diffs], dtype=torch.int64, device=device)
    rows = gap_bytes = old_hashes = None
    if encoding == "coo":
        rows_l, cols_l = [], []
        for d in diffs:
            ncols = layouts[d.slot].cols
            r = torch.div(d.positions, ncols, rounding_mode="floor")
            c = d.positions - r * ncols
            if delta_encoding:
                r, c = delta_encode(r, c)
            rows_l.append(r)
            cols_l.append(c)
        rows = downscale_nonnegative_indices(torch.cat(rows_l))
        cols = downscale_nonnegative_indices(torch.cat(cols_l))
        values = torch.cat([d.new_bits.reshape(-1).view(torch.uint8) for d in diffs])
    elif encoding == "flat":
        cols, values, gap_bytes = _encode_flat(diffs, layouts)
        gap_bytes = downscale_nonnegative_indices(gap_bytes)
        old_hashes = torch.tensor([drift_hash(d.positions, d.old_bits) for d in diffs], dtype=torch.int64)
    else:
        raise ValueError(f"unknown patch encoding {encoding!r}")
    return WeightPatch(
        version=version, base_version=base_version, encoding=encoding,
        delta_encoded=bool(delta_encoding and encoding == "coo"),
        ordinals=downscale_nonnegative_indices(ordinals), nnz_per_tensor=downscale_nonnegative_indices(nnz),
        rows=rows, cols=cols, values=values, gap_bytes=gap_bytes, old_hashes=old_hashes,
    )


# ---------------------------------------------------------------------- decode
@dataclass
class DecodedTensor:
    """One tensor's changes, validated.

    ``positions`` are int64, strictly increasing, inside the tensor. For ``coo``,
    ``payload`` holds the new bits. For ``flat``, ``payload`` is the patch's packed value
    nibbles, of which this tensor's are ``nib_off …``; its escaped codes are
    ``exceptions[:, exc_off:exc_off + n_exc]`` (byte planes). A ``flat`` tensor decoded on
    CPU keeps its validated gap stream (``gaps[gap_start:]``) instead: the numba writer reads
    positions straight from it, and ``positions`` is decoded only when asked for.
    """

    ordinal: int
    _positions: torch.Tensor | None
    payload: torch.Tensor
    is_delta: bool
    nib_off: int = 0
    exceptions: torch.Tensor | None = None
    exc_off: int = 0
    n_exc: int = 0
    count: int = 0
    gaps: Any = None  # numpy uint8 gap stream (CPU flat), else None
    gap_start: int = 0
    gap_end: int = 0
    zcodes: Any = None  # ``ctx``: numpy value codes (unsigned, the element's width), one per position

    def __post_init__(self) -> None:
        if self._positions is not None:
            self.count = int(self._positions.numel())

    @property
    def positions(self) -> torch.Tensor:
        if self._positions is None:
            from ..kernels.flat import decode_gaps

            pos = np.empty(self.count, np.int64)
            decode_gaps(self.gaps, self.gap_start, self.gap_end, self.count, np.iinfo(np.int64).max, pos, True)
            self._positions = torch.from_numpy(pos)
        return self._positions

    def codes(self) -> torch.Tensor:
        """The zig-zag value codes (int64, same device as the payload) of a ``flat`` or ``ctx`` tensor."""
        if self.zcodes is not None:
            return torch.from_numpy(self.zcodes.astype(np.uint64).view(np.int64))
        n = self.count
        c = self.nib_off + torch.arange(n, device=self.payload.device)
        q = (self.payload[c >> 1].to(torch.int64) >> ((c & 1) * 4)) & 15
        if self.n_exc:
            planes = self.exceptions[:, self.exc_off:self.exc_off + self.n_exc].to(torch.int64)
            whole = torch.zeros(self.n_exc, dtype=torch.int64, device=planes.device)
            for b in range(planes.shape[0]):
                whole |= planes[b] << (8 * b)
            q[q == ESCAPE] = whole.to(q.device)
        return q

    def new_bits(self, old_bits: torch.Tensor) -> torch.Tensor:
        """The bits to write, given the receiver's old bits at ``positions``."""
        if not self.is_delta:
            return self.payload.to(old_bits.device)
        return unzigzag_apply(old_bits, self.codes().to(old_bits.device))


def _int_tensor(t, name: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise PayloadError(f"patch field {name} must be a tensor, got {type(t).__name__}")
    if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
        raise PayloadError(f"patch field {name} must be an integer tensor, got {t.dtype}")
    return t.reshape(-1).to(torch.int64)


def _check_header(patch: WeightPatch, layouts: dict[int, TensorLayout]) -> tuple[list[int], list[int]]:
    if patch.encoding not in ("coo", "flat", "ctx"):
        raise PayloadError(f"unknown patch encoding {patch.encoding!r}")
    ordinals = _int_tensor(patch.ordinals, "ordinals").cpu()
    nnz = _int_tensor(patch.nnz_per_tensor, "nnz_per_tensor").cpu()
    if ordinals.numel() != nnz.numel():
        raise PayloadError(f"patch has {ordinals.numel()} ordinals but {nnz.numel()} nnz_per_tensor entries")
    if nnz.numel() and int(nnz.min()) < 0:
        raise PayloadError("patch nnz_per_tensor has a negative count")
    ords = ordinals.tolist()
    for a, b in zip(ords, ords[1:]):
        if b <= a:
            raise PayloadError(f"patch ordinals must be strictly increasing, found {a} then {b} (duplicated or reordered)")
    for o in ords:
        if o not in layouts:
            raise PayloadError(f"patch names tensor ordinal {o}, which the receiver does not sync")
    counts = nnz.tolist()
    for o, n in zip(ords, counts):
        if n > layouts[o].numel:
            raise PayloadError(f"patch claims {n} changes in tensor ordinal {o}, which has {layouts[o].numel} elements")
    values = patch.values
    if not isinstance(values, torch.Tensor) or values.dtype != torch.uint8:
        raise PayloadError("patch values must be a uint8 tensor of raw bytes")
    want_bytes = sum(n * layouts[o].elem_size for o, n in zip(ords, counts))
    if patch.encoding == "coo" and values.numel() != want_bytes:
        raise PayloadError(f"patch values hold {values.numel()} bytes, expected {want_bytes} (truncated or malformed)")
    return ords, counts


def decode_patch(patch: WeightPatch, layouts: dict[int, TensorLayout]) -> list[DecodedTensor]:
    """Validate ``patch`` against the receiver's ``layouts`` (by ordinal) and split it per tensor."""
    ords, counts = _check_header(patch, layouts)
    if patch.encoding == "flat":
        return _decode_flat(patch, layouts, ords, counts)
    total = sum(counts)
    if patch.rows is None:
        raise PayloadError("coo patch without rows")
    for name, t in (("cols", patch.cols), ("rows", patch.rows)):  # counted before they are widened to int64
        if isinstance(t, torch.Tensor) and t.numel() != total:
            raise PayloadError(f"patch carries {t.numel()} {name} entries, expected {total} (truncated or malformed)")
    cols = _int_tensor(patch.cols, "cols")
    rows = _int_tensor(patch.rows, "rows")
    if total and (int(cols.min()) < 0 or int(rows.min()) < 0):
        raise PayloadError("patch index stream holds a negative entry")
    values = patch.values.reshape(-1)
    out: list[DecodedTensor] = []
    start = vstart = 0
    for o, n in zip(ords, counts):
        lay = layouts[o]
        seg_r, seg_c = rows[start:start + n], cols[start:start + n]
        if patch.delta_encoded:
            seg_r, seg_c = delta_decode(seg_r, seg_c)
        if n and (int(seg_r.max()) >= lay.rows or int(seg_c.max()) >= lay.cols or int(seg_c.min()) < 0
                  or int(seg_r.min()) < 0):  # delta decoding of huge deltas wraps int64 around
            raise PayloadError(f"patch position out of range for tensor ordinal {o} of 2-D shape ({lay.rows}, {lay.cols})")
        pos = seg_r * lay.cols + seg_c
        if n > 1 and not bool((pos[1:] > pos[:-1]).all()):
            raise PayloadError(f"patch positions of tensor ordinal {o} are not strictly increasing")
        nbytes = n * lay.elem_size
        seg_v = values[vstart:vstart + nbytes]
        try:
            payload = seg_v.view(lay.bits_dtype)
        except RuntimeError:  # unaligned after a narrower tensor's values
            payload = seg_v.clone().view(lay.bits_dtype)
        out.append(DecodedTensor(o, pos, payload, False))
        start += n
        vstart += nbytes
    return out


_NO_POSITIONS = np.empty(1, np.int64)  # decode_gaps needs an array even when it only validates


_DECODE_ERRORS = {-1: "is truncated", -2: "holds a varint longer than 9 bytes",
                  -3: "points outside the tensor", -4: "has bytes left over (malformed)"}


def _decode_flat(patch: WeightPatch, layouts, ords: list[int], counts: list[int]) -> list[DecodedTensor]:
    cols = patch.cols
    if not isinstance(cols, torch.Tensor) or cols.dtype != torch.uint8:
        raise PayloadError("flat patch index stream must be a uint8 tensor of varint bytes")
    cols = cols.reshape(-1)
    if patch.gap_bytes is None:
        raise PayloadError("flat patch lacks gap_bytes")
    gap_bytes = _int_tensor(patch.gap_bytes, "gap_bytes").cpu().tolist()
    if len(gap_bytes) != len(ords) or any(b < 0 for b in gap_bytes) or sum(gap_bytes) != cols.numel():
        raise PayloadError(f"flat patch gap_bytes {gap_bytes[:4]}... do not add up to its {cols.numel()} index bytes")
    values = patch.values.reshape(-1)
    on_cpu = _numba_decodes(cols) and kernels_ready({layouts[o].elem_size for o in ords})
    nib_offs, exc, exc_offs, n_excs = _flat_value_layout(values, layouts, ords, counts)
    starts = [0]
    for b in gap_bytes:
        starts.append(starts[-1] + b)
    cols_np = cols.numpy() if on_cpu else None

    def one(i: int) -> DecodedTensor:
        o, n = ords[i], counts[i]
        lay = layouts[o]
        seg = cols[starts[i]:starts[i + 1]]
        if on_cpu:
            from ..kernels.flat import decode_gaps

            rc = decode_gaps(cols_np, starts[i], starts[i + 1], n, lay.numel, _NO_POSITIONS, False)
            if rc < 0:
                raise PayloadError(f"flat patch index stream of tensor ordinal {o} {_DECODE_ERRORS[rc]}")
            return DecodedTensor(o, None, values, True, nib_offs[i], exc[lay.elem_size], exc_offs[i], n_excs[i],
                                 count=n, gaps=cols_np, gap_start=starts[i], gap_end=starts[i + 1])
        return DecodedTensor(o, _torch_positions(seg, n, lay.numel, o), values, True, nib_offs[i], exc[lay.elem_size],
                             exc_offs[i], n_excs[i])

    if on_cpu and len(ords) > 1:
        return list(_codec_pool().map(one, range(len(ords))))
    return [one(i) for i in range(len(ords))]


def _numba_decodes(cols: torch.Tensor) -> bool:
    """Whether the numba decoder reads this gap stream (CPU), else torch ops (CUDA; and CPU until
    the kernels are loaded: the same positions, checked the same)."""
    return not cols.is_cuda


def _torch_positions(seg: torch.Tensor, n: int, numel: int, o: int) -> torch.Tensor:
    """Positions from one tensor's gap varints with torch ops (any device), every one checked:
    a gap of ``numel`` or more is refused before the running sum is formed, so the sum of at
    most ``numel`` gaps cannot wrap int64 around to a position inside the tensor (the last
    position alone proves nothing then); the positions must also strictly increase."""
    if not n <= seg.numel() <= MAX_VARINT_BYTES * n:  # before varint_decode widens every byte
        raise PayloadError(f"flat patch index stream of tensor ordinal {o} holds {seg.numel()} bytes for {n} gaps")
    gaps = varint_decode(seg)
    if gaps.numel() != n:
        raise PayloadError(f"flat patch index stream of tensor ordinal {o} holds {gaps.numel()} gaps, expected {n}")
    if not n:
        return gaps
    if int(gaps.max()) >= numel or int(gaps.min()) < 0:
        raise PayloadError(f"flat patch index stream of tensor ordinal {o} {_DECODE_ERRORS[-3]} (a gap of "
                           f"{numel} or more)")
    positions = torch.cumsum(gaps + 1, 0) - 1
    if int(positions[-1]) >= numel or (n > 1 and not bool((positions[1:] > positions[:-1]).all())):
        raise PayloadError(f"flat patch index stream of tensor ordinal {o} {_DECODE_ERRORS[-3]}")
    return positions


def _flat_value_layout(values: torch.Tensor, layouts, ords: list[int], counts: list[int], numba_counts: bool = True):
    """Check the ``flat`` values stream's length against its escape nibbles; return each
    tensor's nibble offset, the exception planes per width, each tensor's offset in them
    and its number of escaped codes. Escapes are counted with numba on CPU (``numba_counts``,
    once the kernels are loaded), else with torch ops."""
    total = sum(counts)
    packed_len = (total + 1) // 2
    if values.numel() < packed_len:
        raise PayloadError(f"flat patch values hold {values.numel()} bytes, fewer than the {packed_len} bytes of "
                           f"nibbles its {total} changes need (truncated or malformed)")
    nib_offs = [0]
    for n in counts:
        nib_offs.append(nib_offs[-1] + n)
    if values.is_cuda or not numba_counts or not kernels_ready({layouts[o].elem_size for o in ords}):
        c = torch.arange(total, device=values.device)
        esc = (((values[c >> 1].to(torch.int64) >> ((c & 1) * 4)) & 15) == ESCAPE).to(torch.int64)
        cs = torch.cat([esc.new_zeros(1), torch.cumsum(esc, 0)])
        bounds = torch.tensor(nib_offs, device=values.device)
        n_excs = (cs[bounds[1:]] - cs[bounds[:-1]]).tolist()
    else:
        from ..kernels.flat import count_escapes

        out = np.empty(len(counts), np.int64)
        count_escapes(values.numpy(), np.asarray(counts, np.int64), out)
        n_excs = out.tolist()
    if total % 2 and int(values[packed_len - 1]) >> 4:
        raise PayloadError("flat patch values: the padding nibble after the last change is not zero (malformed)")
    per_width: dict[int, int] = {}
    exc_offs = []
    for o, e in zip(ords, n_excs):
        w = layouts[o].elem_size
        exc_offs.append(per_width.get(w, 0))
        per_width[w] = per_width.get(w, 0) + e
    want = packed_len + sum(w * e for w, e in per_width.items())
    if values.numel() != want:
        raise PayloadError(f"flat patch values hold {values.numel()} bytes, expected {want} ({packed_len} of nibbles "
                           "and the escaped codes they announce; truncated or malformed)")
    exc = {}
    start = packed_len
    for w in sorted({layouts[o].elem_size for o in ords}):
        e = per_width.get(w, 0)
        exc[w] = values[start:start + w * e].view(w, e)
        start += w * e
    return nib_offs[:-1], exc, exc_offs, n_excs
