"""The toy policy of ``aiosync simulate``: weights that are a pure function of the version, so
every rollout can check, under its lease, that it reads exactly the version it reports."""

from __future__ import annotations

import torch


class ToyPolicy:
    """Weights that are a pure function of the version.

    Each float element ``i`` changes once every ``period`` versions (at its own phase), by a
    fixed step, so consecutive versions differ in about ``1 / period`` of the elements —
    sparse, like an RL update. The ``stamp`` buffer holds the version itself.
    """

    def __init__(self, seed: int = 0, period: int = 20,
                 shapes: dict[str, tuple[int, ...]] | None = None) -> None:
        shapes = shapes or {"embed.weight": (512, 128), "block.w1": (256, 256), "block.w2": (256, 256),
                            "block.bias": (256,), "head.weight": (64, 256)}
        g = torch.Generator().manual_seed(seed)
        self.period = period
        self.base = {k: torch.randn(s, generator=g) for k, s in shapes.items()}
        self.phase = {k: torch.randint(1, period + 1, s, generator=g) for k, s in shapes.items()}

    def weights(self, version: int, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
        out = {}
        for k, base in self.base.items():
            bumps = torch.div(version + self.period - self.phase[k], self.period, rounding_mode="floor")
            out[k] = (base + bumps.to(torch.float32) * 0.0625).to(dtype)
        out["stamp"] = torch.tensor(version, dtype=torch.int64)
        return out

    def write(self, state: dict[str, torch.Tensor], version: int) -> None:
        """Set ``state`` (in place) to the weights of ``version``."""
        with torch.no_grad():
            for k, v in self.weights(version).items():
                state[k].copy_(v)

    def matches(self, state: dict[str, torch.Tensor], version: int, cache: dict) -> bool:
        """Whether ``state`` holds exactly the weights of ``version`` (in its own dtypes)."""
        if version not in cache:
            dtype = next(t.dtype for k, t in state.items() if k != "stamp")
            cache.clear()
            cache[version] = self.weights(version, dtype)
        expected = cache[version]
        return all(torch.equal(state[k], expected[k]) for k in expected)
