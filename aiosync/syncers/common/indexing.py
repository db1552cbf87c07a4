"""Index helpers of the patch format: the 2-D COO view (W9), delta coding and downscaling (W11)."""

from __future__ import annotations

import math

import torch

_INT32_MAX = 2**31 - 1


def coo_2d_shape(shape: tuple[int, ...] | torch.Size) -> tuple[int, int]:
    """The (rows, cols) shape under which a tensor of ``shape`` is patched (W9)."""
    shape = tuple(shape)
    if len(shape) == 0:
        return (1, 1)
    if len(shape) == 1:
        return (1, shape[0])
    if len(shape) == 2:
        return (shape[0], shape[1])
    return (shape[0], math.prod(shape[1:]))


def as_coo_2d_view(tensor: torch.Tensor, name: str | None = None) -> torch.Tensor:
    """View ``tensor`` as 2-D: scalar → (1, 1), 1-D → (1, N), 2-D as is, ≥3-D → (shape[0], prod(rest)).

    Always a view sharing storage with ``tensor``. Raises ``ValueError`` when the trailing
    dimensions of a ≥3-D tensor cannot be flattened without a copy (e.g. after a permute).
    """
    if tensor.dim() == 2:
        return tensor
    rows, cols = coo_2d_shape(tensor.shape)
    try:
        return tensor.view(rows, cols)
    except RuntimeError as exc:
        label = f"tensor {name!r}" if name else "tensor"
        raise ValueError(
            f"{label} of shape {tuple(tensor.shape)} and strides {tensor.stride()} cannot be viewed as "
            f"({rows}, {cols}) without a copy; patch mode writes through a 2-D view, so make it "
            "contiguous (e.g. .contiguous()) or sync it with bucket mode"
        ) from exc


def downscale_nonnegative_indices(indices: torch.Tensor) -> torch.Tensor:
    """Cast non-negative indices to the smallest of uint8 / int32 / int64 that holds them (W11).

    An empty tensor becomes uint8. Negative values raise ``ValueError``.
    """
    if indices.is_floating_point() or indices.is_complex() or indices.dtype == torch.bool:
        raise ValueError(f"indices must be an integer tensor, got {indices.dtype}")
    if indices.numel() == 0:
        return indices.to(torch.uint8)
    lo, hi = torch.aminmax(indices.reshape(-1))
    lo, hi = int(lo), int(hi)
    if lo < 0:
        raise ValueError(f"indices must be non-negative, found {lo}")
    if hi <= 255:
        return indices.to(torch.uint8)
    if hi <= _INT32_MAX:
        return indices.to(torch.int32)
    return indices.to(torch.int64)


def delta_encode(rows: torch.Tensor, cols: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Delta-code row-major sorted COO coordinates as the seed describes (W11).

    ``rows`` become the differences of consecutive rows (the first relative to 0). ``cols``
    become the difference to the previous column while the row stays the same, and the
    absolute column whenever a new row starts. Both results are int64.
    """
    rows = rows.to(torch.int64).reshape(-1)
    cols = cols.to(torch.int64).reshape(-1)
    if rows.shape != cols.shape:
        raise ValueError(f"rows and cols must have the same length, got {rows.numel()} and {cols.numel()}")
    if rows.numel() == 0:
        return rows.clone(), cols.clone()
    drows = torch.diff(rows, prepend=rows.new_zeros(1))
    prev_cols = torch.cat([cols.new_zeros(1), cols[:-1]])
    dcols = torch.where(drows == 0, cols - prev_cols, cols)
    return drows, dcols


def delta_decode(rows: torch.Tensor, cols: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Invert :func:`delta_encode`; returns absolute (rows, cols) as int64."""
    drows = rows.to(torch.int64).reshape(-1)
    dcols = cols.to(torch.int64).reshape(-1)
    if drows.shape != dcols.shape:
        raise ValueError(f"rows and cols must have the same length, got {drows.numel()} and {dcols.numel()}")
    if drows.numel() == 0:
        return drows.clone(), dcols.clone()
    abs_rows = torch.cumsum(drows, 0)
    is_start = drows != 0
    is_start[0] = True
    csum = torch.cumsum(dcols, 0)
    starts = torch.nonzero(is_start).reshape(-1)
    seg = torch.cumsum(is_start.to(torch.int64), 0) - 1
    base = (csum[starts] - dcols[starts])[seg]
    return abs_rows, csum - base
