"""The torch-ops patch builder (CUDA snapshots and sources; ``builder_kernel: torch`` on CPU):
many tensors per host synchronisation, bounded transient memory.

A compare that asks the device how many elements changed (``nonzero``) waits for the device: a
host synchronisation. Diffing tensor by tensor costs two or three of them per tensor, and a model
has hundreds of small tensors. Here tensors are diffed in *groups*: every member writes its
change mask into one shared buffer (``torch.ne(..., out=slice)``: no concatenation copy), one
``nonzero`` finds every change of the group, one ``bincount`` splits them per member — two host
synchronisations per group, whatever the number of tensors in it. Large tensors are cut into
chunks, so a group never holds more than :data:`GROUP_ELEMS` mask bytes and the transient int64
indices of a dense update stay bounded by the group, not the tensor.

Traffic per element: the two compared bit patterns (``2 × width`` bytes), the mask written and
read once (2 bytes); per change: its index, new and old bits, and the snapshot update.
"""

from __future__ import annotations

import torch

#: Elements (mask bytes) of one group: bounds the mask and the transient indices of a build.
GROUP_ELEMS = 1 << 26


def diff_groups(pairs: list[tuple[torch.Tensor, torch.Tensor]], group_elems: int = GROUP_ELEMS
                ) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Diff ``(new, snap)`` pairs of contiguous 1-D bit tensors (same dtype per pair, all on one
    device); update every ``snap`` where it differs; return per pair ``(positions int64, new
    bits, old bits)`` of its changes in ascending order."""
    out: list[list] = [[] for _ in pairs]
    group: list[tuple[int, int, int]] = []  # (pair, start, end) pieces of the current group
    filled = 0
    for i, (new, _) in enumerate(pairs):
        n = new.numel()
        for start in range(0, n, group_elems):
            end = min(n, start + group_elems)
            if filled and filled + end - start > group_elems:
                _diff_group(pairs, group, filled, out)
                group, filled = [], 0
            group.append((i, start, end))
            filled += end - start
    if group:
        _diff_group(pairs, group, filled, out)
    results = []
    for i, parts in enumerate(out):
        new = pairs[i][0]
        if not parts:
            empty = new.new_empty(0)
            results.append((torch.empty(0, dtype=torch.int64, device=new.device), empty, empty))
        elif len(parts) == 1:
            results.append(parts[0])
        else:
            results.append(tuple(torch.cat([p[k] for p in parts]) for k in range(3)))
    return results


def _diff_group(pairs, group, filled: int, out: list[list]) -> None:
    device = pairs[group[0][0]][0].device
    mask = torch.empty(filled, dtype=torch.bool, device=device)
    starts, at = [], 0
    for i, a, b in group:
        new, snap = pairs[i]
        torch.ne(new[a:b], snap[a:b], out=mask[at:at + b - a])
        starts.append(at)
        at += b - a
    idx = torch.nonzero(mask).reshape(-1)  # host sync 1: every change of the group
    if idx.numel() == 0:
        return
    bounds = torch.tensor(starts[1:], dtype=torch.int64, device=device)
    member = torch.bucketize(idx, bounds, right=True)
    counts = torch.bincount(member, minlength=len(group)).tolist()  # host sync 2: changes per member
    pieces = torch.split(idx, counts)
    for (i, a, _), start, piece, k in zip(group, starts, pieces, counts):
        if not k:
            continue
        new, snap = pairs[i]
        local = piece - start + a
        nv, ov = new[local], snap[local]
        snap[local] = nv
        out[i].append((local, nv, ov))
