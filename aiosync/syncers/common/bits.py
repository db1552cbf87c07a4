"""Tensors as their raw bits: every patch compares, hashes and writes bit patterns (B2), so NaN
equals itself and 0.0 → -0.0 is a change."""

from __future__ import annotations

import numpy as np
import torch

BITS_DTYPES = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
NP_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def bits_dtype(dtype: torch.dtype) -> torch.dtype:
    """The integer dtype whose elements hold the raw bits of ``dtype``."""
    size = dtype.itemsize
    if size not in BITS_DTYPES:
        raise ValueError(f"dtype {dtype} ({size} bytes per element) is not supported by patch mode")
    return BITS_DTYPES[size]


def as_bits(t: torch.Tensor) -> torch.Tensor:
    """Reinterpret ``t`` as integers of the same width (bool → uint8); shares storage."""
    return t.view(bits_dtype(t.dtype))


def np_bits(t: torch.Tensor) -> np.ndarray:
    """A zero-copy numpy view of a CPU contiguous tensor's bits as an unsigned array."""
    b = as_bits(t)
    return b.numpy().view(NP_UINT[b.element_size()])
