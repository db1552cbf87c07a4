"""The ``ctx`` patch encoding, receiver side: the model header and the decoding of every segment.

A ``ctx`` patch's positions depend on the receiver's old values (their classes), so decoding
reads the receiver's tensors (never writes them). Everything is checked before anything is
written: the model header (tables that sum to ``2**PROB_BITS``, thresholds in range, class
counts that add up to ``nnz_per_tensor``, one coded stream per segment), and every segment's
stream (it must end exactly at its last byte, in the coder's initial state, with every
position inside the segment and every value code inside the dtype). Any violation is a
:class:`~aiosync.errors.PayloadError` naming the tensor.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ....errors import DriftError, PayloadError
from ...kernels import ctx as kc
from ...kernels import ctx_coder as kcc
from ...kernels.ctx import N_CONTEXTS, WIDTH_SLOT
from .encode import ctx_format
from ...kernels.rans import NSYM, PROB_SCALE, decoder_tables

_ERRORS = {-1: "ends before its last change (truncated)", -2: "places a change beyond its segment",
           -3: "holds a value code out of range for the dtype", -4: "has bytes left over or a wrong final state",
           -5: "needs a context that has no table"}


def n_segments(numel: int) -> int:
    """Segments of a tensor of ``numel`` elements (each coded on its own)."""
    return max(1, -(-numel // kc.SEGMENT))


@dataclass
class CtxHeader:
    """A validated model header."""

    tmap: np.ndarray
    slots: np.ndarray
    freq: np.ndarray
    start: np.ndarray
    params: list[tuple[int, int, int, int]]  # per tensor: three thresholds, value top
    counts: list[np.ndarray]  # per tensor: (segments, classes) changes
    stream_lens: list[list[list[int]]]  # per tensor and segment: bytes of each stream but the last


def _ints(values: torch.Tensor) -> list[int]:
    from ..format import varint_decode

    if not isinstance(values, torch.Tensor) or values.dtype != torch.uint8:
        raise PayloadError("ctx patch model header (values) must be a uint8 tensor of varints")
    return varint_decode(values.reshape(-1).cpu()).tolist()


def parse_header(values: torch.Tensor, layouts, ords: list[int], counts: list[int]) -> CtxHeader:
    """Read and check the model header of a ``ctx`` patch (see docs/wire-format.md)."""
    from ..bounds import stream_bounds

    most = stream_bounds("ctx", ords, counts, layouts)["values"][1]
    if isinstance(values, torch.Tensor) and values.numel() > most:
        raise PayloadError(f"ctx patch model header holds {values.numel()} bytes; a patch of these changes needs at "
                           f"most {most} (malformed)")
    ints = _ints(values)
    pos = 0

    def take(n: int, what: str) -> list[int]:
        nonlocal pos
        if pos + n > len(ints):
            raise PayloadError(f"ctx patch model header ends inside {what} (truncated)")
        out = ints[pos:pos + n]
        pos += n
        return out

    (n_tables,) = take(1, "the table count")
    if n_tables > N_CONTEXTS:
        raise PayloadError(f"ctx patch declares {n_tables} tables; at most {N_CONTEXTS} contexts exist")
    freqs = np.zeros((max(1, n_tables), NSYM), np.int64)
    tmap = np.full(N_CONTEXTS, -1, np.int64)
    last = -1
    for row in range(n_tables):
        cid, nsym = take(2, "a table")
        if not last < cid < N_CONTEXTS or not 1 <= nsym <= NSYM:
            raise PayloadError(f"ctx patch table {row} has context {cid} / {nsym} symbols (contexts must increase, "
                               f"below {N_CONTEXTS}; 1 to {NSYM} symbols)")
        f = take(nsym, "a table's frequencies")
        if sum(f) != PROB_SCALE:
            raise PayloadError(f"ctx patch table for context {cid} sums to {sum(f)}, not {PROB_SCALE}")
        freqs[row, :nsym] = f
        tmap[cid] = row
        last = cid
    params = []
    for o in ords:
        t1, t2, t3, vtop = take(4, "a tensor's parameters")
        top = min((1 << (8 * layouts[o].elem_size)) - 1, (1 << 63) - 1)
        if not t1 <= t2 <= t3 <= top or vtop > 1 << 12:
            raise PayloadError(f"ctx patch parameters of tensor ordinal {o} are malformed (thresholds must be "
                               "nondecreasing and fit the dtype)")
        params.append((t1, t2, t3, vtop))
    seg_counts, stream_lens = [], []
    for o, n in zip(ords, counts):
        k = n_segments(layouts[o].numel)
        numel = layouts[o].numel
        c = np.zeros((k, kc.N_CLASSES), np.int64)
        lens = []
        for s in range(k):  # in Python ints: a sum of int64 counts could wrap around to n
            seg = take(kc.N_CLASSES, "the class counts")
            if sum(seg) > min(kc.SEGMENT, numel - s * kc.SEGMENT):
                raise PayloadError(f"ctx patch class counts of tensor ordinal {o} (segment {s}) claim {sum(seg)} "
                                   "changes, more than the segment has elements")
            c[s] = seg
            lens.append(take(max(0, kcc.stream_count(sum(seg)) - 1), "the stream lengths"))
        if int(c.sum()) != n:
            raise PayloadError(f"ctx patch class counts of tensor ordinal {o} add up to {int(c.sum())}, but "
                               f"nnz_per_tensor says {n}")
        seg_counts.append(c)
        stream_lens.append(lens)
    if pos != len(ints):
        raise PayloadError(f"ctx patch model header has {len(ints) - pos} values left over (malformed)")
    slots, freq, start = decoder_tables(freqs)
    return CtxHeader(tmap, slots, freq, start, params, seg_counts, stream_lens)


def old_bits(t: torch.Tensor) -> np.ndarray:
    """The receiver's bits of ``t`` in row-major order, as a flat unsigned numpy array (a view
    for contiguous CPU tensors, else a copy)."""
    from ...common.bits import np_bits

    t = t.detach()
    if t.device.type != "cpu" or not t.is_contiguous():
        t = t.contiguous().cpu()
    return np_bits(t.reshape(-1))


def decode_ctx(patch, layouts, ords: list[int], counts: list[int], targets: list[torch.Tensor],
               pool=None) -> list[tuple[np.ndarray, np.ndarray]]:
    """Decode every tensor of a ``ctx`` patch against ``targets`` (the receiver's tensors, in
    ``ords`` order; read only). Returns per tensor ``(positions int64, value codes)`` (codes unsigned, of the element's width)."""
    cols = patch.cols
    if not isinstance(cols, torch.Tensor) or cols.dtype != torch.uint8:
        raise PayloadError("ctx patch streams (cols) must be a uint8 tensor")
    head = parse_header(patch.values, layouts, ords, counts)
    if patch.gap_bytes is None:
        raise PayloadError("ctx patch lacks gap_bytes (the bytes of each segment's stream)")
    from ..format import _int_tensor

    seg_bytes = _int_tensor(patch.gap_bytes, "gap_bytes").cpu().tolist()
    want = sum(c.shape[0] for c in head.counts)
    if len(seg_bytes) != want or any(b < 0 for b in seg_bytes) or sum(seg_bytes) != cols.numel():
        raise PayloadError(f"ctx patch gap_bytes list {len(seg_bytes)} segments for {want}, or do not add up to its "
                           f"{cols.numel()} stream bytes")
    buf = cols.reshape(-1).cpu().numpy()
    jobs = []
    off = si = 0
    for i, (o, c) in enumerate(zip(ords, head.counts)):
        for k in range(c.shape[0]):
            nb, lens = seg_bytes[si], head.stream_lens[i][k]
            if sum(lens) > nb or (nb and not lens and not c[k].sum()):
                raise PayloadError(f"ctx patch streams of tensor ordinal {o} (segment {k}) are longer than its "
                                   f"{nb} bytes, or it has bytes but no changes")
            jobs.append((i, k, np.array([off, *(off + np.cumsum(lens, dtype=np.int64)), off + nb], np.int64)
                         if c[k].sum() else np.array([off], np.int64)))
            off += nb
            si += 1
    bits = [old_bits(t) for t in targets]
    out_pos = [np.empty(n, np.int64) for n in counts]
    out_z = [np.empty(n, _UINT[layouts[o].elem_size]) for o, n in zip(ords, counts)]
    firsts = [np.concatenate([[0], np.cumsum(c.sum(axis=1))]) for c in head.counts]
    fmts = [ctx_format(layouts[o].dtype, layouts[o].elem_size) for o in ords]

    def one(job):
        i, k, bounds = job
        o = ords[i]
        lay = layouts[o]
        magmask, mant, bias = fmts[i]
        old = bits[i]
        s, e = k * kc.SEGMENT, min(lay.numel, (k + 1) * kc.SEGMENT)
        t1, t2, t3, vtop = head.params[i]
        thr = np.array([t1, t2, t3], old.dtype)
        a, b = firsts[i][k], firsts[i][k + 1]
        rc = kcc.decode_segment(old[s:e], buf, bounds, thr, np.array([magmask], old.dtype),
                               np.array([mant, bias, vtop], np.int64), head.counts[i][k], head.slots, head.freq,
                               head.start, head.tmap, WIDTH_SLOT[lay.elem_size], out_pos[i][a:b], out_z[i][a:b], s)
        if rc < 0:  # the header was sound: the stream, or the values it is decoded against, are not
            raise DriftError(f"ctx patch stream of tensor ordinal {o} (segment {k}) {_ERRORS.get(rc, rc)} against this "
                             "receiver's values: the stream is corrupt, or the receiver's values of the tensor are not "
                             "the ones the sender built the patch on (drifted); refused, nothing was written")

    if pool is not None and len(jobs) > 1:
        list(pool.map(one, jobs))
    else:
        for job in jobs:
            one(job)
    return list(zip(out_pos, out_z))


def decode_ctx_patch(patch, layouts, target_of, pool=None) -> list:
    """Validate a ``ctx`` patch and decode it against the receiver's tensors (``target_of(ordinal)``
    returns the tensor, checked against its layout); :class:`~aiosync.syncers.patch.format.DecodedTensor`
    per changed tensor, in ordinal order."""
    from ..format import DecodedTensor, _check_header

    ords, counts = _check_header(patch, layouts)
    targets = [target_of(o) for o in ords]
    decoded = decode_ctx(patch, layouts, ords, counts, targets, pool)
    return [DecodedTensor(o, torch.from_numpy(pos), _NO_PAYLOAD, True, zcodes=z)
            for o, (pos, z) in zip(ords, decoded)]


_NO_PAYLOAD = torch.empty(0, dtype=torch.uint8)
_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
