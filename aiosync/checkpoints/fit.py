"""The one check of a checkpoint's tensors against the model they are for."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ..dtypes import dtype_name
from ..errors import HandshakeError, PayloadError
from ..pieces import TensorSlice


def check_tensors_fit(target: Mapping[str, Any], tensors: Mapping[str, torch.Tensor], what: str) -> None:
    """Check that ``tensors`` can be written into ``target`` before anything is written.

    Every key of ``tensors`` must exist in ``target`` with the same shape (a :class:`TensorSlice`
    of ``target``: its full shape); a floating-point
    tensor may arrive in another floating-point dtype (it is cast), an integer, bool or complex
    tensor must arrive in exactly the target's dtype. Keys of ``target`` that ``tensors`` lacks
    are fine (they are left alone). ``what`` names the source in the error (e.g. ``"checkpoint
    sync-000000000003.safetensors"``). Raises :class:`aiosync.errors.HandshakeError` naming the
    first key that does not fit (:class:`aiosync.errors.PayloadError` for a value that is not a
    tensor).
    """
    for key, value in tensors.items():
        if not isinstance(value, torch.Tensor):
            raise PayloadError(f"{what}: {key!r} is a {type(value).__name__}, not a tensor")
        held = target.get(key)
        if held is None:
            raise HandshakeError(f"{what}: key {key!r} does not exist in the model")
        held_dtype = held.tensor.dtype if isinstance(held, TensorSlice) else held.dtype  # a slice: its full shape
        if tuple(held.shape) != tuple(value.shape):
            raise HandshakeError(f"{what}: {key!r} has shape {tuple(value.shape)}, the model has {tuple(held.shape)}")
        if value.dtype != held_dtype and not (value.dtype.is_floating_point and held_dtype.is_floating_point):
            raise HandshakeError(f"{what}: {key!r} is {dtype_name(value.dtype)}, the model holds "
                                 f"{dtype_name(held_dtype)} (only floating-point tensors may change dtype)")
