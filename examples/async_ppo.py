"""Asynchronous PPO on CartPole-v1 with aiosync: the loop of ``aiosync demo`` as a plain script.

Copy it and replace the pieces: your environment, your network, your update. What aiosync
does here, and nothing else:

* explorers roll out under ``lease()``: the weights cannot change mid-rollout, and the lease
  says which version they are; every rollout is stamped with it;
* the trainer drops rollouts more than ``max_staleness`` versions old (``filter_stale``),
  trains, and ``step_done()`` publishes the new version; with ``sync_weight_no_wait`` that
  returns as soon as the weights are handed off, and each explorer swaps the patch in
  atomically in the background, between two of its rollouts;
* leaving ``async with Synchronizer(...)`` drains: every explorer ends on the final weights.

Environment steps and PPO updates run in worker threads (``run_sync``): the event loop only
schedules, so explorers keep generating while the trainer learns.

Run::

    python examples/async_ppo.py                 # ~20 s on a laptop CPU
    python examples/async_ppo.py --steps 100     # shorter
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import time

import torch

from aiosync import load_config, run_sync
from aiosync.coordination import Synchronizer
from aiosync.runners.ppo import ActorCritic, EnvRunner, PPOConfig, ppo_update

EXPLORERS = 2
ENVS_PER_EXPLORER = 8
ROLLOUT_STEPS = 32        # per rollout: 32 steps x 8 envs = 256 transitions
ROLLOUTS_PER_UPDATE = 2
MAX_STALENESS = 2         # versions


async def explorer(handle, runner: EnvRunner, queue: asyncio.Queue, credits: asyncio.Semaphore,
                   returns: list, done: asyncio.Event) -> None:
    while True:
        await credits.acquire()                    # room for one more rollout (back-pressure)
        if done.is_set():
            break
        async with handle.lease() as (policy, version):  # one whole version, never torn
            rollout = await run_sync(runner.rollout, policy, ROLLOUT_STEPS, version, handle.name)
        returns += rollout.episode_returns
        queue.put_nowait(rollout)                  # rollout.version is the version that produced it
        await handle.step_done()                   # check point: a newer version is applied in the background
    await handle.stop()


async def trainer(handle, policy: ActorCritic, queue: asyncio.Queue, credits: asyncio.Semaphore,
                  returns: list, steps: int, done: asyncio.Event) -> None:
    cfg = PPOConfig()
    optimizer = torch.optim.Adam(policy.parameters(), lr=cfg.lr, eps=1e-5)
    t0 = time.perf_counter()
    try:
        while handle.step < steps:
            batch = []
            for _ in range(ROLLOUTS_PER_UPDATE):
                batch.append(await queue.get())
                credits.release()                  # an explorer may start the next rollout now
            fresh = handle.filter_stale(batch)     # drop what is more than MAX_STALENESS versions old
            if not fresh.kept:
                continue
            for group in optimizer.param_groups:
                group["lr"] = cfg.lr * (1 - handle.step / steps)
            await run_sync(ppo_update, policy, optimizer, fresh.kept, fresh.weights, cfg)
            await handle.step_done()               # publish the new version; returns at once (no-wait)
            if handle.step % 25 == 0:
                last = returns[-20:]
                print(f"{time.perf_counter() - t0:6.1f}s  version {handle.version:4d}  "
                      f"staleness {fresh.staleness}  mean return {sum(last) / max(1, len(last)):6.1f}")
        await handle.stop()                        # publishes whatever is unpublished
    finally:
        done.set()
        for _ in range(EXPLORERS):
            credits.release()                      # wake explorers waiting for a credit


async def main(steps: int, seed: int) -> float:
    torch.manual_seed(seed)
    torch.set_num_threads(1)                       # tiny networks: let the worker threads run side by side
    runners = [EnvRunner("CartPole-v1", ENVS_PER_EXPLORER, seed=seed * 1000 + i) for i in range(EXPLORERS)]
    policy = ActorCritic(runners[0].obs_dim, runners[0].n_actions)
    config = {"method": "memory", "style": "trainer_driven", "sync_interval": 1,
              "sync_weight_no_wait": True, "max_staleness": MAX_STALENESS}
    weight_syncer = load_config("weight_syncer/patch_syncer")   # the shipped, recommended patch config
    queue: asyncio.Queue = asyncio.Queue()
    credits = asyncio.Semaphore(ROLLOUTS_PER_UPDATE)
    returns: list[float] = []
    done = asyncio.Event()

    async with Synchronizer(config, weight_syncer) as sync:
        trainer_handle = await sync.attach_trainer(policy)
        explorers = [await sync.attach_explorer(f"explorer{i}", copy.deepcopy(policy)) for i in range(EXPLORERS)]
        await asyncio.gather(
            trainer(trainer_handle, policy, queue, credits, returns, steps, done),
            *(explorer(h, r, queue, credits, returns, done) for h, r in zip(explorers, runners)),
        )
    # Drained: every explorer holds the trainer's final weights, bit for bit.
    for h in explorers:
        assert all(torch.equal(a, b) for a, b in zip(policy.state_dict().values(), h.slot.model.state_dict().values()))
    totals = sync.metrics()["totals"]
    staleness = sync.metrics()["staleness"]
    last = returns[-20:]
    mean_return = sum(last) / max(1, len(last))
    print(f"final mean return {mean_return:.1f} | {totals['delivered']} syncs, {totals['bytes_sent']:,} bytes, "
          f"{totals['coalesced']} coalesced | staleness mean {staleness['mean']:.2f}, {staleness['dropped']} dropped")
    return mean_return


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=400, help="PPO updates (policy versions)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    asyncio.run(main(args.steps, args.seed))
