"""The torch-ops patch builder (CUDA snapshots and sources; ``builder_kernel: torch`` on CPU):
packed groups of tensors, a constant number of kernels and host synchronisations per group,
bounded transient memory.

A model has hundreds of small tensors; a builder that launches a dozen kernels and asks the
device two or three times "how many changed?" (each answer a host synchronisation) *per tensor*
spends its time launching and waiting, not moving bytes. Here tensors are diffed in **groups**:

* :func:`plan` puts the pieces to diff into groups of one *kind* (source dtype, snapshot dtype,
  device) of at most :data:`GROUP_ELEMS` elements; large tensors are cut into pieces, so the
  transient memory of a dense update is bounded by the group, not by the tensor.
* Each group is diffed *packed*, by one of two backends that give the same bits:

  - **fused** (CUDA, when ``triton`` imports — it ships with CUDA torch wheels —
    :mod:`aiosync.syncers.snapshot.triton`): two kernels reading the members through a pointer table. The
    first loads each source element, casts it to the snapshot dtype in registers (fp32 → bf16
    with the rounding and NaN rule of torch's own cast on that device, probed), compares it with
    the snapshot bits and writes one *bit* per element plus a count per tile; the second, after
    one host synchronisation that sizes the outputs, visits the changed elements only: writes
    their position, new and old bits, and updates the snapshot. No cast copy, no byte mask, no
    int64 index of the whole group.
  - **torch ops** (everywhere else, CPU included): the members' sources are packed into one
    buffer (``torch.cat``) and cast once; the snapshot of a group is one contiguous slice
    (:class:`~aiosync.syncers.snapshot.builder.Snapshot` keeps one buffer per dtype); one ``ne``, one
    ``nonzero`` (host sync 1), one gather of new and old bits, one scatter into the snapshot, and
    the changes are split per member from one ``bincount`` (host sync 2).

  Either way the kernels launched per group do not depend on how many tensors it holds, and the
  results keep their shape: per tensor, ascending ``(positions int64, new bits, old bits)``.

Bytes moved per element (fp32 source, bf16 snapshot; ``c`` = changes):

* fused: read 4 (source) + 2 (snapshot), write 1/8 (change bit) + 4/1024 (tile count); then read
  the 1/8 bit again: **≈ 6.25 B/element**, plus per change ≈ 4 + 2 read (sector granular) and
  8 + 2 + 2 + 2 written (position, new, old, snapshot update).
* torch ops: cast 4 read + 2 written (+ 4 + 4 for ``cat`` when a group has several members), the
  compare 2 + 2 read + 1 written, ``nonzero`` ≈ 2 × 1 read: ≈ 13 B/element (21 packed), plus per
  change 8 (index) + 2 × 2 (gather) + 2 (scatter) + 8 × 3 (member split).

The snapshot's own traffic on the W13 path (a CPU snapshot prefetched to the GPU) comes on top:
2 B/element over PCIe, one copy per contiguous run of the group.
"""

from __future__ import annotations

import threading
import warnings
from dataclasses import dataclass

import torch

#: Elements of one group: bounds the transient buffers (mask, indices) of a build.
GROUP_ELEMS = 1 << 26

#: The backend of :func:`diff_group` when none is named: ``"auto"``, ``"torch"`` or ``"fused"``
#: (benchmarks set it to compare the two).
BACKEND = "auto"

_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@dataclass(frozen=True)
class Piece:
    """Elements ``[start, end)`` of pair ``pair``."""

    pair: int
    start: int
    end: int


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(_BITS[t.element_size()])


def _kind(src: torch.Tensor, snap: torch.Tensor) -> tuple:
    return src.dtype, src.device, snap.dtype, snap.device


def plan(pairs: list[tuple[torch.Tensor, torch.Tensor]], group_elems: int | None = None) -> list[list[Piece]]:
    """Groups of pieces of ``(source, snapshot)`` pairs: one kind per group (pairs of a kind keep
    their order), at most ``group_elems`` (default :data:`GROUP_ELEMS`) elements, large tensors
    cut into pieces."""
    group_elems = group_elems or GROUP_ELEMS
    by_kind: dict[tuple, list[int]] = {}
    for i, (src, snap) in enumerate(pairs):
        by_kind.setdefault(_kind(src, snap), []).append(i)
    groups: list[list[Piece]] = []
    for members in by_kind.values():
        group: list[Piece] = []
        filled = 0
        for i in members:
            n = pairs[i][1].numel()
            for start in range(0, n, group_elems):
                end = min(n, start + group_elems)
                if group and filled + end - start > group_elems:
                    groups.append(group)
                    group, filled = [], 0
                group.append(Piece(i, start, end))
                filled += end - start
        if group:
            groups.append(group)
    return groups


@dataclass
class GroupDiff:
    """The changes of one group, member after member, each member's in ascending order;
    ``counts[k]`` of them belong to ``group[k]`` (positions are local to its tensor)."""

    group: list[Piece]
    positions: torch.Tensor
    new_bits: torch.Tensor
    old_bits: torch.Tensor
    counts: list[int]


def diff_group(pairs, group: list[Piece], backend: str | None = None,
               snaps: list[torch.Tensor] | None = None) -> GroupDiff | None:
    """Diff one group (see :func:`plan`), update its snapshots; ``None`` when nothing changed.

    ``backend``: ``"auto"`` (fused kernels on CUDA where available, torch ops otherwise),
    ``"torch"`` or ``"fused"`` (forced; on CPU only under Triton's interpreter, for tests).
    ``snaps``: the snapshot of each piece, where it is not ``pairs[p.pair][1][p.start:p.end]``
    (a CPU snapshot's copy prefetched to the GPU)."""
    backend = backend or BACKEND
    if backend not in ("auto", "torch", "fused"):
        raise ValueError(f"backend must be 'auto', 'torch' or 'fused', got {backend!r}")
    if snaps is None:
        snaps = [pairs[p.pair][1][p.start:p.end] for p in group]
    if backend == "fused" or (backend == "auto" and snaps[0].is_cuda and fused_ok(snaps[0].device)):
        return _diff_group_fused(pairs, group, snaps)
    return _diff_group_torch(pairs, group, snaps)


def _diff_group_fused(pairs, group: list[Piece], snaps: list[torch.Tensor]) -> GroupDiff | None:
    from .triton import diff_fused

    out = diff_fused([pairs[p.pair][0][p.start:p.end] for p in group], snaps, [p.start for p in group])
    if out is NotImplemented:  # a dtype pair or layout the kernels do not handle
        return _diff_group_torch(pairs, group, snaps)
    return None if out is None else GroupDiff(group, *out)


def split(pairs, diffs: list[GroupDiff], join=None) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Per pair, ``(positions, new bits, old bits)`` from the groups' changes: views where a pair
    changed in one piece; the pieces of a large tensor joined by ``join(parts)`` (default:
    concatenated)."""
    parts: list[list] = [[] for _ in pairs]
    for g in diffs:
        cols = [torch.split(x, g.counts) for x in (g.positions, g.new_bits, g.old_bits)]
        for piece, k, pos, nv, ov in zip(g.group, g.counts, *cols):
            if k:
                parts[piece.pair].append((pos, nv, ov))
    out, empties = [], {}
    for (src, snap), p in zip(pairs, parts):
        if not p:
            key = (snap.element_size(), snap.device)
            if key not in empties:
                empty = torch.empty(0, dtype=_bits(snap).dtype, device=snap.device)
                empties[key] = (torch.empty(0, dtype=torch.int64, device=snap.device), empty, empty)
            out.append(empties[key])
        else:
            out.append(p[0] if len(p) == 1 else (join or _cat)(p))
    return out


def diff_groups(pairs: list[tuple[torch.Tensor, torch.Tensor]], group_elems: int | None = None,
                backend: str | None = None) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Diff ``(source, snapshot)`` pairs of flat tensors (any source dtype, cast to its snapshot's
    dtype as torch casts; both on one device); update every snapshot where it differs; return
    per pair ``(positions int64, new bits, old bits)`` of its changes in ascending order."""
    diffs = [d for g in plan(pairs, group_elems) if (d := diff_group(pairs, g, backend)) is not None]
    return split(pairs, diffs)


def _cat(parts):
    return tuple(torch.cat([q[k] for q in parts]) for k in range(3))


def contiguous_run(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """One flat view covering ``tensors`` when they lie back to back in one storage (in order),
    else ``None``."""
    first = tensors[0]
    at = first.data_ptr()
    for t in tensors:
        if not t.is_contiguous() or t.data_ptr() != at or t.untyped_storage().data_ptr() != \
                first.untyped_storage().data_ptr():
            return None
        at += t.numel() * t.element_size()
    total = sum(t.numel() for t in tensors)
    return first.as_strided((total,), (1,))


def _diff_group_torch(pairs, group: list[Piece], snaps: list[torch.Tensor]) -> GroupDiff | None:
    dtype = snaps[0].dtype
    srcs = [pairs[p.pair][0][p.start:p.end] for p in group]
    snaps = [_bits(s) for s in snaps]
    packed = srcs[0] if len(srcs) == 1 else torch.cat(srcs)
    new = _bits(packed if packed.dtype == dtype else packed.to(dtype))
    run = contiguous_run(snaps)
    old_all = run if run is not None else torch.cat(snaps)  # not made by Snapshot: a packed copy
    idx = torch.nonzero(torch.ne(new, old_all)).reshape(-1)  # host sync 1: every change of the group
    if idx.numel() == 0:
        return None
    nv, ov = new[idx], old_all[idx]
    old_all[idx] = nv
    if len(group) == 1:
        out = GroupDiff(group, idx + group[0].start if group[0].start else idx, nv, ov, [idx.numel()])
    else:
        starts, at = [], 0
        for p in group:
            starts.append(at)
            at += p.end - p.start
        starts_t = torch.tensor(starts, dtype=torch.int64, device=idx.device)
        shift = starts_t - torch.tensor([p.start for p in group], dtype=torch.int64, device=idx.device)
        member = torch.bucketize(idx, starts_t[1:], right=True)
        counts = torch.bincount(member, minlength=len(group)).tolist()  # host sync 2: changes per member
        out = GroupDiff(group, idx - shift[member], nv, ov, counts)
    if run is None:  # write the packed copy's updates back, member by member
        for p, s, pos, v in zip(group, snaps, torch.split(out.positions, out.counts), torch.split(nv, out.counts)):
            s[pos - p.start] = v
    return out


_FUSED: dict = {}
_FUSED_LOCK = threading.Lock()


def fused_ok(device: torch.device) -> bool:
    """Whether the fused kernels import, compile and reproduce the torch ops bit for bit on
    ``device`` (checked once per device, :func:`self_check`)."""
    with _FUSED_LOCK:
        if device not in _FUSED:
            try:
                import triton  # noqa: F401  (ships with CUDA torch wheels)
            except ImportError:
                _FUSED[device] = False
            else:
                _FUSED[device] = self_check(device)
        return _FUSED[device]


def self_check(device: torch.device) -> bool:
    """Run the fused kernels on ``device`` against the torch ops: fp32 edge values (NaN
    payloads, ±0, ±inf, subnormals, max finite, ties) and random data, fp32 → bf16 and a plain
    compare, several members, partial tiles. ``False``, with a warning, if they fail to compile
    or differ in any bit."""
    try:
        from .triton import TILE, probe_values

        g = torch.Generator().manual_seed(0)
        sources = [torch.cat([probe_values().view(torch.float32), torch.randn(TILE + 37, generator=g)]),
                   torch.randn(5, generator=g), torch.randn(2 * TILE, generator=g)]
        for dtype in (torch.bfloat16, torch.float32):
            outs = []
            for run in (_diff_group_fused, _diff_group_torch):
                srcs = [s.to(device) for s in sources]
                snaps = [torch.zeros(s.numel(), dtype=dtype, device=device) for s in sources]
                snaps[2].copy_(srcs[2])
                snaps[2][::3] = 0
                pairs = list(zip(srcs, snaps))
                [group] = plan(pairs)
                d = run(pairs, group, [snaps[p.pair][p.start:p.end] for p in group])
                outs.append([d.counts] + [_bits(x).cpu() for x in (d.positions, d.new_bits, d.old_bits, *snaps)])
            if outs[0][0] != outs[1][0] or not all(torch.equal(a, b) for a, b in zip(outs[0][1:], outs[1][1:])):
                raise AssertionError(f"the fused kernels differ from the torch ops ({dtype})")
    except Exception as exc:  # compile errors, driver errors, any difference: keep the torch ops
        warnings.warn(f"aiosync: fused builder disabled on {device}, using torch ops: {exc}", RuntimeWarning,
                      stacklevel=2)
        return False
    return True
