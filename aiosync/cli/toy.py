"""The toy policy of ``aiosync simulate``: weights that are a pure function of the version, so
every read can be checked bit for bit against the version it claims; and a warm-up that compiles
the syncer's kernels before any timeout counts."""

from __future__ import annotations

from typing import Any

import anyio
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

    def final_state(self, explorers: dict, version: int | None) -> dict:
        """Per explorer: the version it holds and the keys that differ from ``version``'s weights
        (cast to its dtypes) — a run's end, in its report."""
        expected = self.weights(version) if version is not None else {}
        return {name: {"version": ex.version,
                       "differs": [k for k, v in expected.items()
                                   if not torch.equal(ex.slot.model[k], v.to(ex.slot.model[k].dtype))]}
                for name, ex in explorers.items()}


async def warm_up_syncer(policy: ToyPolicy, syncer: Any, recv_dtype: torch.dtype) -> None:
    """One syncer round trip on the toy policy, so that the numba kernels are compiled before
    short delivery timeouts start counting (the faults scenario)."""
    from ..syncers.factory import create_syncer
    from ..transports.inproc import inproc_pair

    make = syncer if callable(syncer) else (lambda: create_syncer(syncer))
    sender, receiver = make(), make()
    a, b = inproc_pair(timeout=120)
    src = policy.weights(0)
    dst = {k: torch.zeros_like(v, dtype=recv_dtype if v.is_floating_point() else v.dtype) for k, v in src.items()}
    async with anyio.create_task_group() as tg:
        tg.start_soon(sender.init_sender, src, None, a.send, a.recv)
        await receiver.init_receiver(dst, b.recv, b.send)
    for version in (1, 2):
        src = policy.weights(version)
        await sender.sync(src, a.send, version)
        await receiver.apply(dst, b.recv)
