"""dtype names as they travel (in receiver metadata, bucket manifests, message headers):
written and parsed in this one place."""

from __future__ import annotations

import torch


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` → ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: object) -> torch.dtype | None:
    """``"bfloat16"`` (or ``"torch.bfloat16"``) → ``torch.bfloat16``; ``None`` for anything that
    does not name a torch dtype. Callers raise their own error, naming where the name came from."""
    if not isinstance(name, str):
        return None
    dt = getattr(torch, name.removeprefix("torch."), None)
    return dt if isinstance(dt, torch.dtype) else None


def element_size(dtype: torch.dtype) -> int:
    """Bytes per element of ``dtype``."""
    return dtype.itemsize
