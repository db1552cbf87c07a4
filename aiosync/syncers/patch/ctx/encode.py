"""The ``ctx`` patch encoding, sender side: statistics, class thresholds, the build and the coding.

A ``ctx`` patch codes each changed tensor's changes against what the receiver already holds
(its old values; see :mod:`aiosync.syncers.kernels.ctx`, :mod:`aiosync.syncers.kernels.ctx_coder` and
docs/wire-format.md):

* the *class* of an element (four, by the magnitude of its old value against three per-tensor
  thresholds) selects the table its gaps are coded with, and gaps count only elements of the
  same class;
* the *value context* (how many octaves the old value lies below a per-tensor top exponent)
  selects the table of its value code;
* one static rANS table per context in use travels in the patch's model header.

The sender keeps, per slot, a histogram of its snapshot's exponents (taken when the snapshot is
loaded, updated by every build) and the histogram of the last build's changes; from them it
chooses the thresholds of the next build (the split that minimises the estimated entropy of the
change mask). Thresholds travel with the patch, so how they were chosen never affects decoding.
"""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass

import numpy as np
import torch

from ...kernels import ctx as kc
from ...kernels import ctx_coder as kcc
from ...kernels.ctx import N_CONTEXTS, WIDTH_SLOT, build_tables
from ...kernels.rans import NSYM, encoder_tables
from ...common.bits import np_bits

_NP_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
# dtype → (mantissa bits, exponent bias) of its floating-point layout
_FLOATS = {torch.bfloat16: (7, 127), torch.float16: (10, 15), torch.float32: (23, 127), torch.float64: (52, 1023)}
for _name, _fmt in (("float8_e4m3fn", (3, 7)), ("float8_e5m2", (2, 15))):
    if hasattr(torch, _name):
        _FLOATS[getattr(torch, _name)] = _fmt


def ctx_format(dtype: torch.dtype | None, width: int) -> tuple[int, int, int]:
    """``(magnitude mask, mantissa bits, exponent bias)`` of an element type: floats drop their
    sign bit and expose their exponent; other types are classed by their raw bits."""
    bits = 8 * width
    if dtype in _FLOATS:
        mant, bias = _FLOATS[dtype]
        return (1 << (bits - 1)) - 1, mant, bias
    return (1 << bits) - 1, bits - 1, 0


def _split_bins(hn: np.ndarray, hc: np.ndarray | None) -> list[int]:
    """Three bin boundaries (classes 1-3 start there) for one tensor.

    With change statistics: the contiguous split of the exponent bins into four classes that
    minimises ``Σ n_c · H(changes_c / n_c)`` (dynamic programming over the occupied bins).
    Without (the first build): the 5 %, 20 % and 50 % quantiles of the magnitudes (small
    values change most often).
    """
    occupied = np.nonzero(hn > 0)[0]
    if occupied.size == 0:
        return [kc.BINS - 1] * 3
    lo, hi = int(occupied[0]), int(occupied[-1])
    if hc is None or hc[lo:hi + 1].sum() == 0:
        cum = np.cumsum(hn) / max(1, hn.sum())
        return [int(np.searchsorted(cum, q, side="right")) for q in (0.05, 0.2, 0.5)]
    cuts = kc.best_split(hn[lo:hi + 1].astype(np.float64), np.minimum(hc[lo:hi + 1], hn[lo:hi + 1]).astype(np.float64))
    cuts = sorted(lo + int(i) for i in cuts)[1:]  # the first class starts at lo
    while len(cuts) < 3:
        cuts.append(hi + 1)
    return cuts


@dataclass
class SlotModel:
    """What the sender knows of one slot's statistics, and the parameters of its next build."""

    width: int
    magmask: int
    mant_bits: int
    bias: int
    hn: np.ndarray  # snapshot elements per exponent bin
    hc: np.ndarray | None = None  # changes per bin (old value) in the last build
    thr: tuple[int, int, int] = (0, 0, 0)
    vtop: int = 0

    def plan(self) -> None:
        """Choose the thresholds and value top of the next build from the statistics."""
        cuts = _split_bins(self.hn, self.hc)
        top = min(self.magmask, (1 << 63) - 1)  # (thresholds travel as varints of at most 63 bits)
        self.thr = tuple(min(top, max(0, b + self.bias - 128) << self.mant_bits) for b in cuts)
        occupied = np.nonzero(self.hn > 0)[0]
        self.vtop = int(occupied[-1]) + self.bias - 128 if occupied.size else 0
        self.vtop = max(0, self.vtop)

    def stat(self) -> np.ndarray:
        return np.array([self.mant_bits, self.bias, self.vtop], np.int64)


@dataclass
class Segment:
    """One segment's records (changes in position order), as :func:`~kernels_ctx.diff_ctx` wrote them."""

    start: int
    n: int
    counts: np.ndarray  # changes per class
    gap: np.ndarray  # class-major: the gaps of class 0's changes, then class 1's, …
    ctx: np.ndarray  # position order, as ``z``
    z: np.ndarray


@dataclass
class CtxDiff:
    """One tensor's changes, ready for :func:`encode_ctx`."""

    slot: int
    nnz: int
    segments: list[Segment]  # every segment of the tensor, with or without changes
    old_hash: int
    thr: tuple[int, int, int]
    vtop: int
    hist: np.ndarray  # symbol counts per context
    sampled: bool = False  # ``hist`` counts a sample of the changes (see :func:`build_tables`)


class CtxBuilder:
    """The sender's ``ctx`` builder over a :class:`~aiosync.syncers.snapshot.builder.Snapshot`."""

    def __init__(self, snapshot, layouts) -> None:
        self.snapshot = snapshot
        self.models: list[SlotModel] = []
        for slot, lay in enumerate(layouts):
            magmask, mant, bias = ctx_format(lay.dtype, lay.elem_size)
            bits = np_bits(snapshot.tensor(slot).detach().reshape(-1).cpu().contiguous())
            hn = np.zeros(kc.BINS, np.int64)
            mm = np.array([magmask], bits.dtype)
            for s in range(0, bits.size, kc.SEGMENT):
                kc.exp_histogram(bits[s:s + kc.SEGMENT], mm, mant, bias, hn)
            model = SlotModel(lay.elem_size, magmask, mant, bias, hn)
            model.plan()
            self.models.append(model)
        self._local = threading.local()

    # --------------------------------------------------------------------- build
    def build(self, tensors: list[torch.Tensor], slots: list[int] | None = None) -> list[CtxDiff]:
        """Diff ``tensors`` (CPU) against the snapshot, updating it; one :class:`CtxDiff` per
        changed tensor, in slot order. Segments run as tasks of about ``chunk_elems`` elements
        (:meth:`~aiosync.syncers.snapshot.builder.Snapshot.map_pieces`)."""
        snap = self.snapshot
        slots = list(range(len(tensors))) if slots is None else slots
        snap.wait_writeback()
        expected = sum(int(self.models[i].hc.sum()) for i in slots if self.models[i].hc is not None)
        every = kc.SAMPLE_EVERY if expected >= kc.SAMPLE_MIN else 1
        sources = {}
        pieces: list[tuple[int, int, int]] = []
        for i, t in zip(slots, tensors):
            flat = t.detach().reshape(-1)
            if flat.is_cuda or snap.bits(i).size != flat.numel():
                raise ValueError(f"slot {i}: the ctx builder needs a CPU tensor of the snapshot's size")
            sources[i] = (flat, snap.bits(i), *snap.kernel_source(flat, i))
            n = flat.numel()
            pieces += [(i, start, min(n, start + kc.SEGMENT)) for start in range(0, max(n, 1), kc.SEGMENT)]
        left = Counter(i for i, _, _ in pieces)
        done: dict[int, list] = {}
        diffs: dict[int, CtxDiff | None] = {}
        lock = threading.Lock()

        def run(i: int, start: int, end: int) -> None:
            out = self._segment(sources[i], i, start, end, every)
            with lock:
                done.setdefault(i, []).append((start, out))
                left[i] -= 1
                last = not left[i]
            if last:  # the tensor's last segment: its worker closes it while the other worker diffs on
                diffs[i] = self._close(i, [part for _, part in sorted(done.pop(i), key=lambda p: p[0])], every)

        snap.map_pieces(pieces, run)
        return [diffs[i] for i in sorted(diffs) if diffs[i] is not None]

    def _close(self, slot: int, parts: list, every: int) -> CtxDiff | None:
        """One tensor's segments (in order) as a :class:`CtxDiff` (``None`` without changes);
        its statistics updated and the next build planned."""
        model = self.models[slot]
        _, _, hc, _, hist = parts[0]  # (most tensors are one segment: its arrays serve as they are)
        nnz, old_hash = 0, 0
        segments = []
        for n, (seg, h, seg_hc, hn_delta, seg_hist) in enumerate(parts):
            nnz += seg.n
            old_hash = (old_hash + h) & 0xFFFFFFFFFFFFFFFF
            model.hn += hn_delta
            if n:
                hc += seg_hc
                hist += seg_hist
            segments.append(seg)
        thr, vtop = model.thr, model.vtop
        model.hc = hc
        model.plan()  # for the next build
        return CtxDiff(slot, nnz, segments, old_hash, thr, vtop, hist, every > 1) if nnz else None

    def _scratch(self, width: int, need: int):
        """This thread's record buffers for a segment of ``need`` elements of ``width`` bytes
        (sized for the longest segment the snapshot has, so taken once)."""
        cache = getattr(self._local, "bufs", None)
        if cache is None:
            cache = self._local.bufs = {}
        if width not in cache or cache[width][1].size < need:
            n = max(need, self.snapshot.scratch_elems(width, kc.SEGMENT))
            cache[width] = (np.empty((kc.N_CLASSES, n), np.uint32), np.empty(n, np.uint8), np.empty(n, _NP_UINT[width]))
            self.snapshot.count_scratch(n * (4 * kc.N_CLASSES + 1 + width))
        return cache[width]

    def _segment(self, source, slot: int, start: int, end: int, every: int):
        """Diff and record elements ``[start, end)`` of one tensor (in a worker thread), counting
        the symbols of one group of blocks in ``every``."""
        flat, snap_np, src_np, fused = source
        model = self.models[slot]
        width = snap_np.itemsize
        gap, ctx, z = self._scratch(width, end - start)
        if src_np is None:  # torch casts this segment into a scratch buffer first
            src, fused = self.snapshot.cast_source(flat[start:end], slot)
        else:
            src = src_np[start:end]
        thr = np.array(model.thr, snap_np.dtype)
        mm = np.array([model.magmask], snap_np.dtype)
        counts = np.zeros(kc.N_CLASSES, np.int64)
        hc = np.zeros(kc.BINS, np.int64)
        hn_delta = np.zeros(kc.BINS, np.int64)
        hist = np.zeros((N_CONTEXTS, NSYM), np.int64)
        k, h = kc.diff_ctx(src, snap_np[start:end], fused, thr, mm, model.stat(), gap, ctx, z, counts, hc,
                           hn_delta, start, hist, WIDTH_SLOT[width], every)
        seg = Segment(start, k, counts, kc.class_major(gap, counts), ctx[:k].copy(), z[:k].copy())
        return seg, int(h), hc, hn_delta, hist


# ------------------------------------------------------------------- coding
def encode_ctx(diffs: list[CtxDiff], pool=None) -> tuple[np.ndarray, list[int], list[int]]:
    """rANS-code every segment of ``diffs``; returns ``(streams, bytes per segment, model)``,
    ``model`` being the integers of the model header (written as varints)."""
    sampled = {WIDTH_SLOT[_width_of(d.segments[0])] for d in diffs if d.sampled}
    used, freqs, tmap = build_tables([d.hist for d in diffs], sampled)
    enc = encoder_tables(freqs)
    jobs = [(d, seg) for d in diffs for seg in d.segments]

    def one(job):
        d, seg = job
        cat, lens = kcc.encode_streams(seg.gap, seg.ctx, seg.z, seg.counts, enc, tmap, WIDTH_SLOT[_width_of(seg)])
        return cat, lens[:-1]

    coded = list(pool.map(one, jobs)) if pool is not None and len(jobs) > 1 else [one(j) for j in jobs]
    streams = [c for c, _ in coded]
    model = [int(used.size)]
    for row, cid in enumerate(used):
        f = freqs[row]
        nsym = int(np.nonzero(f)[0][-1]) + 1
        model += [int(cid), nsym, *f[:nsym].tolist()]
    for d in diffs:
        model += [*d.thr, d.vtop]
    for (d, seg), (_, lens) in zip(jobs, coded):
        model += [*seg.counts.tolist(), *lens]
    cat = np.concatenate(streams) if streams else np.empty(0, np.uint8)
    return cat, [s.size for s in streams], model


def _width_of(seg: Segment) -> int:
    return seg.z.itemsize


def varints(values: list[int]) -> np.ndarray:
    """Non-negative integers as LEB128 bytes."""
    out = bytearray()
    for v in values:
        while v >= 0x80:
            out.append((v & 0x7F) | 0x80)
            v >>= 7
        out.append(v)
    return np.frombuffer(bytes(out), np.uint8)


# ------------------------------------------------------------ the torch path
def _as_key(bits: np.ndarray) -> np.ndarray:
    """Unsigned bits as uint64 (numpy compares them correctly)."""
    return bits.astype(np.uint64)


def diffs_from_tensor_diffs(builder: CtxBuilder, diffs) -> list[CtxDiff]:
    """:class:`CtxDiff` records from the torch builder's :class:`~aiosync.syncers.snapshot.builder.TensorDiff`
    (CUDA snapshots, ``builder_kernel: torch``, DTensors): the same records the numba builder
    writes, computed from the updated snapshot and the diff's old bits. Updates the statistics."""
    from ...common.integrity import drift_hash
    from ..format import zigzag_delta

    out = []
    for d in diffs:
        model = builder.models[d.slot]
        width = model.width
        u = _NP_UINT[width]
        after = builder.snapshot.tensor(d.slot).detach().reshape(-1).cpu()
        key = _as_key(np_bits(after.contiguous())) & np.uint64(model.magmask)
        pos = d.positions.cpu().numpy().astype(np.int64)
        old = d.old_bits.cpu().contiguous().view(-1)
        new = d.new_bits.cpu().contiguous().view(-1)
        old_np, new_np = np_bits(old).astype(np.uint64), np_bits(new).astype(np.uint64)
        key[pos] = old_np & np.uint64(model.magmask)  # classes come from the values before the patch
        thr = [np.uint64(t) for t in model.thr]
        cls = (key >= thr[0]).astype(np.int64) + (key >= thr[1]) + (key >= thr[2])
        seg_of = pos // kc.SEGMENT
        n_seg = max(1, -(-key.size // kc.SEGMENT))
        rank = np.empty(pos.size, np.int64)
        c_at = cls[pos]
        for c in range(kc.N_CLASSES):
            inc = np.cumsum(cls == c) - 1  # class-local index of every element of class c
            sel = c_at == c
            base = np.array([np.count_nonzero(cls[:s * kc.SEGMENT] == c) for s in range(n_seg)], np.int64)
            rank[sel] = inc[pos[sel]] - base[seg_of[sel]]
        gap = np.empty(pos.size, np.int64)
        for c in range(kc.N_CLASSES):
            sel = np.nonzero(c_at == c)[0]
            r = rank[sel]
            prev = np.concatenate([[-1], r[:-1]])
            first = np.ones(sel.size, bool)
            first[1:] = seg_of[sel][1:] != seg_of[sel][:-1]
            prev[first] = -1
            gap[sel] = r - prev - 1
        e_old = ((old_np & np.uint64(model.magmask)) >> np.uint64(model.mant_bits)).astype(np.int64)
        vctx = np.clip(model.vtop - e_old, 0, kc.N_VCTX - 1)
        ctx = (c_at | (vctx << 2)).astype(np.uint8)
        z = zigzag_delta(new, old).contiguous()
        z = np_bits(z).astype(u)
        segments = []
        for s in range(n_seg):
            sel = seg_of == s
            counts = np.bincount(c_at[sel], minlength=kc.N_CLASSES).astype(np.int64)
            gaps, cs = gap[sel], c_at[sel]
            gaps = np.concatenate([gaps[cs == c] for c in range(kc.N_CLASSES)]).astype(np.uint32)  # class-major
            segments.append(Segment(s * kc.SEGMENT, int(sel.sum()), counts, gaps, ctx[sel], z[sel]))
        hist = np.zeros((N_CONTEXTS, NSYM), np.int64)
        for seg in segments:
            if seg.n:
                kc.count_symbols(seg.gap, seg.counts, seg.ctx, seg.z, WIDTH_SLOT[width], hist)
        bins_old = np.clip(e_old - model.bias + 128, 0, kc.BINS - 1)
        e_new = ((new_np & np.uint64(model.magmask)) >> np.uint64(model.mant_bits)).astype(np.int64)
        bins_new = np.clip(e_new - model.bias + 128, 0, kc.BINS - 1)
        thr_used, vtop_used = model.thr, model.vtop
        model.hn += np.bincount(bins_new, minlength=kc.BINS) - np.bincount(bins_old, minlength=kc.BINS)
        model.hc = np.bincount(bins_old, minlength=kc.BINS).astype(np.int64)
        model.plan()
        out.append(CtxDiff(d.slot, int(pos.size), segments, drift_hash(d.positions, d.old_bits) & 0xFFFFFFFFFFFFFFFF,
                           thr_used, vtop_used, hist))
    return out


def assemble_ctx_patch(diffs: list[CtxDiff], layouts, *, version: int, base_version: int | None, pool=None):
    """A ``ctx`` :class:`~aiosync.syncers.common.payloads.WeightPatch` from the builder's records."""
    from ...common.indexing import downscale_nonnegative_indices
    from ...common.payloads import EmptyWeightPatch, WeightPatch

    if not diffs:
        return EmptyWeightPatch(version, base_version)
    cat, seg_bytes, model = encode_ctx(diffs, pool)

    def ints(values):
        return downscale_nonnegative_indices(torch.tensor(values, dtype=torch.int64))

    hashes = [h - (1 << 64) if h >= 1 << 63 else h for h in (d.old_hash for d in diffs)]
    return WeightPatch(
        version=version, base_version=base_version, encoding="ctx", delta_encoded=False,
        ordinals=ints([layouts[d.slot].ordinal for d in diffs]), nnz_per_tensor=ints([d.nnz for d in diffs]),
        rows=None, cols=torch.from_numpy(cat), values=torch.from_numpy(varints(model).copy()),
        gap_bytes=ints(seg_bytes), old_hashes=torch.tensor(hashes, dtype=torch.int64),
    )
