"""Index helpers of the patch format: the 2-D COO view (W9), delta coding and downscaling (W11)."""

from __future__ import annotations

import pytest
import torch

from aiosync.syncers import as_coo_2d_view, delta_decode, delta_encode, downscale_nonnegative_indices


# --------------------------------------------------------------------- W9: 2-D COO view
@pytest.mark.parametrize(
    "shape, expected",
    [
        ((), (1, 1)),
        ((7,), (1, 7)),
        ((0,), (1, 0)),
        ((3, 5), (3, 5)),
        ((2, 3, 4), (2, 12)),
        ((2, 3, 4, 5), (2, 60)),
        ((4, 1, 1, 1, 2), (4, 2)),
    ],
)
def test_as_coo_2d_view_shapes(shape, expected):
    t = torch.arange(max(1, torch.Size(shape).numel()), dtype=torch.float32)[: torch.Size(shape).numel()].reshape(shape)
    v = as_coo_2d_view(t)
    assert tuple(v.shape) == expected
    # row-major element order is kept
    assert torch.equal(v.reshape(-1), t.reshape(-1))


@pytest.mark.parametrize("shape", [(), (6,), (2, 3), (2, 3, 4), (2, 2, 2, 2)])
def test_as_coo_2d_view_shares_storage(shape):
    t = torch.zeros(shape, dtype=torch.bfloat16)
    v = as_coo_2d_view(t)
    assert v.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()
    v[-1, -1] = 3.0
    assert t.reshape(-1)[-1].item() == 3.0
    assert v.dim() == 2


def test_as_coo_2d_view_two_d_noncontiguous_is_kept_as_is():
    t = torch.randn(4, 5).t()  # 2-D is used as is, even when transposed
    v = as_coo_2d_view(t)
    assert v.shape == (5, 4)
    assert v.data_ptr() == t.data_ptr()
    assert v.stride() == t.stride()


def test_as_coo_2d_view_non_viewable_raises_value_error_naming_tensor():
    t = torch.randn(4, 5, 6).permute(0, 2, 1)
    with pytest.raises(ValueError, match="layers.0.w"):
        as_coo_2d_view(t, "layers.0.w")
    with pytest.raises(ValueError, match=r"\(4, 30\)"):
        as_coo_2d_view(t)


def test_as_coo_2d_view_viewable_non_contiguous_3d():
    # leading-dim slicing keeps trailing dims flattenable: still a view, no copy
    base = torch.arange(4 * 5 * 6, dtype=torch.float32).reshape(4, 5, 6)
    t = base[::2]
    v = as_coo_2d_view(t)
    assert v.shape == (2, 30)
    assert v.untyped_storage().data_ptr() == base.untyped_storage().data_ptr()
    assert torch.equal(v, t.reshape(2, 30))


# --------------------------------------------------------------------- W11: delta coding
def test_delta_encode_hand_computed():
    rows = torch.tensor([0, 0, 0, 2, 2, 5, 5, 5])
    cols = torch.tensor([1, 4, 9, 3, 7, 0, 2, 8])
    drows, dcols = delta_encode(rows, cols)
    # rows: differences of consecutive rows, the first relative to 0
    assert drows.tolist() == [0, 0, 0, 2, 0, 3, 0, 0]
    # cols: delta within a row, absolute column whenever a new row starts
    assert dcols.tolist() == [1, 3, 5, 3, 4, 0, 2, 6]
    r, c = delta_decode(drows, dcols)
    assert r.dtype == torch.int64 and c.dtype == torch.int64
    assert r.tolist() == rows.tolist()
    assert c.tolist() == cols.tolist()


def test_delta_encode_first_row_nonzero_and_seed_semantics():
    rows = torch.tensor([3, 3, 4, 7])
    cols = torch.tensor([5, 6, 2, 2])
    drows, dcols = delta_encode(rows, cols)
    assert drows.tolist() == [3, 0, 1, 3]
    # first element starts a "new row" (row 3 != the implicit 0): absolute col 5
    assert dcols.tolist() == [5, 1, 2, 2]
    r, c = delta_decode(drows, dcols)
    assert r.tolist() == [3, 3, 4, 7]
    assert c.tolist() == [5, 6, 2, 2]


def test_delta_encode_first_row_zero_col_is_relative_to_zero():
    # first row is 0 (drow == 0): the col delta is relative to the implicit previous col 0,
    # which equals the absolute column, so decoding is unambiguous
    drows, dcols = delta_encode(torch.tensor([0]), torch.tensor([11]))
    assert drows.tolist() == [0] and dcols.tolist() == [11]
    r, c = delta_decode(drows, dcols)
    assert (r.tolist(), c.tolist()) == ([0], [11])


def test_delta_decode_small_dtypes_decode_as_int64():
    drows = torch.tensor([0, 0, 1, 0], dtype=torch.uint8)
    dcols = torch.tensor([200, 50, 255, 1], dtype=torch.uint8)
    r, c = delta_decode(drows, dcols)
    assert r.dtype == torch.int64 and c.dtype == torch.int64
    # 200 + 50 = 250 would be fine in uint8, but new row then 255+1 = 256 needs int64
    assert r.tolist() == [0, 0, 1, 1]
    assert c.tolist() == [200, 250, 255, 256]


def test_delta_encode_empty():
    r, c = delta_encode(torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=torch.int64))
    assert r.numel() == 0 and c.numel() == 0
    r2, c2 = delta_decode(r, c)
    assert r2.numel() == 0 and c2.numel() == 0 and r2.dtype == torch.int64


def test_delta_length_mismatch_raises():
    with pytest.raises(ValueError):
        delta_encode(torch.tensor([0, 1]), torch.tensor([0]))
    with pytest.raises(ValueError):
        delta_decode(torch.tensor([0, 1]), torch.tensor([0]))


@pytest.mark.parametrize("seed", range(5))
def test_delta_round_trip_random_sorted_coordinates(seed):
    g = torch.Generator().manual_seed(seed)
    n_rows, n_cols = 37, 1000
    numel = n_rows * n_cols
    pos = torch.randperm(numel, generator=g)[: 1 + seed * 97].sort().values
    rows, cols = pos // n_cols, pos % n_cols
    drows, dcols = delta_encode(rows, cols)
    assert int(drows.min()) >= 0 and int(dcols.min()) >= 0  # non-negative, so downscalable
    r, c = delta_decode(downscale_nonnegative_indices(drows), downscale_nonnegative_indices(dcols))
    assert torch.equal(r, rows) and torch.equal(c, cols)


# --------------------------------------------------------------------- W11: downscaling
@pytest.mark.parametrize(
    "hi, dtype",
    [
        (0, torch.uint8),
        (255, torch.uint8),
        (256, torch.int32),
        (2**31 - 1, torch.int32),
        (2**31, torch.int64),
        (2**40, torch.int64),
    ],
)
def test_downscale_bounds(hi, dtype):
    t = torch.tensor([0, 1, hi], dtype=torch.int64)
    out = downscale_nonnegative_indices(t)
    assert out.dtype == dtype
    assert out.to(torch.int64).tolist() == [0, 1, hi]


@pytest.mark.parametrize("src_dtype", [torch.uint8, torch.int16, torch.int32, torch.int64])
def test_downscale_from_any_integer_dtype(src_dtype):
    out = downscale_nonnegative_indices(torch.tensor([3, 200], dtype=src_dtype))
    assert out.dtype == torch.uint8 and out.tolist() == [3, 200]


def test_downscale_empty_is_uint8():
    out = downscale_nonnegative_indices(torch.empty(0, dtype=torch.int64))
    assert out.dtype == torch.uint8 and out.numel() == 0


def test_downscale_negative_raises():
    with pytest.raises(ValueError, match="-1"):
        downscale_nonnegative_indices(torch.tensor([5, -1, 3]))


def test_downscale_float_raises():
    with pytest.raises(ValueError):
        downscale_nonnegative_indices(torch.tensor([1.0, 2.0]))
