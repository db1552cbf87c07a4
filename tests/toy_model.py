"""A toy policy shared by the runtime tests: its weights are a pure function of the version,
so every check is bit-exact and a torn read is detectable."""

from __future__ import annotations

import torch


def weights(v: int) -> dict[str, torch.Tensor]:
    """The trainer's state at version ``v``: fp32 weights and bias, an int64 version stamp."""
    g = torch.Generator().manual_seed(1)
    w = torch.randn(24, 16, generator=g)
    b = torch.randn(16, generator=g)
    return {"w": w + 0.25 * v, "b": b - 0.5 * v, "stamp": torch.tensor(v, dtype=torch.int64)}


def trainer_state() -> dict[str, torch.Tensor]:
    return weights(0)


def rollout_model() -> dict[str, torch.Tensor]:
    """The explorer's copy: bf16 weights (a cast receiver), fp32 bias, int64 stamp."""
    return {"w": torch.zeros(24, 16, dtype=torch.bfloat16), "b": torch.zeros(16), "stamp": torch.tensor(-1)}


def holds(model: dict[str, torch.Tensor], v: int) -> bool:
    """Bit-exact: the model holds version ``v`` cast to its own dtypes."""
    return all(torch.equal(model[k], t.to(model[k].dtype)) for k, t in weights(v).items())


def train_to(state: dict[str, torch.Tensor], v: int) -> None:
    """Move the trainer's tensors to version ``v`` in place."""
    for k, t in weights(v).items():
        state[k].copy_(t)
