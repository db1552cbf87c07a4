"""Embedding aiosync in your own asyncio runner (an AsyncPPO-shaped loop).

The runner is plain asyncio: a trainer coroutine and a few explorer coroutines share a queue
of trajectories. aiosync only sits at their check points:

* explorers roll out under ``lease()`` (the model cannot change mid-rollout) and stamp every
  trajectory with the version that produced it;
* the trainer filters stale trajectories, trains, and ``step_done()`` publishes the new
  version; with ``sync_weight_no_wait`` that returns as soon as the weights are handed off,
  and explorers swap them in atomically in the background;
* leaving ``async with Synchronizer(...)`` drains: every explorer ends on the final weights.

Run::

    python examples/custom_runner.py                  # asyncio
    python examples/custom_runner.py --uvloop         # uvloop
    python examples/custom_runner.py --latency 0.2    # a slow link: watch requests coalesce
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import logging

import torch
from torch import nn

import aiosync
from aiosync.coordination import Synchronizer  # also exported as aiosync.Synchronizer
from aiosync.transports.simulated import simulated_pair


class Policy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 64), nn.Tanh(), nn.Linear(64, 4))

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        return self.net(obs)


def train_step(policy: Policy, opt: torch.optim.Optimizer, batch: list[dict], weights: list[float]) -> float:
    """A policy-gradient-flavoured update; runs in a worker thread, off the event loop."""
    obs = torch.cat([t["obs"] for t in batch])
    actions = torch.cat([t["actions"] for t in batch])
    advantages = torch.cat([t["advantage"] * w for t, w in zip(batch, weights)])
    logp = torch.log_softmax(policy(obs), dim=-1).gather(1, actions[:, None]).squeeze(1)
    loss = -(logp * advantages).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss.item()


@torch.no_grad()
def act(model: nn.Module, obs: torch.Tensor) -> torch.Tensor:
    """The rollout's forward pass; runs in a worker thread, off the event loop.

    ``no_grad`` belongs here, in the thread that runs the model: grad mode is per thread, and
    a ``with torch.no_grad():`` around an ``await`` would switch it for every other coroutine
    on the loop (and can leave it off when two such blocks interleave)."""
    return model(obs)


async def explorer(handle, queue: asyncio.Queue, done: asyncio.Event) -> None:
    while not done.is_set():
        async with handle.lease() as (model, version):  # weights of exactly one version
            obs = torch.randn(16, 8)
            logits = await asyncio.to_thread(act, model, obs)
            await asyncio.sleep(0.005)  # the environment's part of the rollout
        trajectory = {"obs": obs, "actions": logits.argmax(-1), "advantage": torch.randn(16),
                      "version": version}  # every trajectory carries the version that produced it
        try:
            queue.put_nowait(trajectory)
        except asyncio.QueueFull:
            pass  # the trainer is behind: drop, fresher ones will come
        await handle.step_done()  # the explorer's check point
    await handle.stop()


async def trainer(handle, policy: Policy, queue: asyncio.Queue, steps: int, done: asyncio.Event) -> None:
    opt = torch.optim.AdamW(policy.parameters(), lr=3e-4, betas=(0.9, 0.95))
    try:
        for _ in range(steps):
            batch = [await queue.get() for _ in range(4)]
            fresh = handle.filter_stale(batch)  # AsyncPPO: drop what is too old
            if fresh.kept:
                await asyncio.to_thread(train_step, policy, opt, fresh.kept, fresh.weights)
            await handle.step_done()  # publishes the new version (every sync_interval steps)
        await handle.stop()
    finally:
        done.set()


async def main(steps: int, n_explorers: int, latency: float) -> dict:
    torch.manual_seed(0)
    policy = Policy()
    config = {
        "method": "memory",
        "style": "trainer_driven",
        "sync_interval": 1,
        "sync_weight_no_wait": True,
        "max_staleness": 4,
    }
    weight_syncer = {"type": "patch", "patch": {"encoding": "flat", "compression": "zstd",
                                                "init_sync": {"enabled": True}}}
    link = (lambda name: simulated_pair(latency=latency)) if latency > 0 else None
    queue: asyncio.Queue = asyncio.Queue(maxsize=8)
    done = asyncio.Event()

    async with Synchronizer(config, weight_syncer, transport_factory=link) as sync:
        trainer_handle = await sync.attach_trainer(policy)
        explorers = [await sync.attach_explorer(f"explorer{i}", copy.deepcopy(policy).eval())
                     for i in range(n_explorers)]
        await asyncio.gather(
            trainer(trainer_handle, policy, queue, steps, done),
            *(explorer(h, queue, done) for h in explorers),
        )
    # Drained: every explorer holds the trainer's final weights, bit for bit.
    for h in explorers:
        for (name, a), b in zip(policy.state_dict().items(), h.slot.model.state_dict().values()):
            assert torch.equal(a, b), name
    metrics = sync.metrics()
    sync.log_metrics()
    return {
        "final_version": trainer_handle.version,
        "explorer_versions": {h.name: h.version for h in explorers},
        "requests": metrics["totals"]["requests"],
        "coalesced": metrics["totals"]["coalesced"],
        "delivered": metrics["totals"]["delivered"],
        "bytes_sent": metrics["totals"]["bytes_sent"],
        "stale_samples_dropped": metrics["staleness"]["dropped"],
        "mean_staleness": round(metrics["staleness"]["mean"], 2),
        "loop_lag_p99_ms": round(metrics["loop_lag"]["p99_ms"], 2),
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--explorers", type=int, default=2)
    parser.add_argument("--latency", type=float, default=0.05, help="simulated link latency in seconds (0: in-process)")
    parser.add_argument("--uvloop", action="store_true")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    aiosync.warm_up()  # load the numba kernels before the loop runs (their set-up holds the GIL)
    coro = main(args.steps, args.explorers, args.latency)
    if args.uvloop:
        import uvloop

        result = uvloop.run(coro)
    else:
        result = asyncio.run(coro)
    for key, value in result.items():
        print(f"{key:>22}: {value}")
