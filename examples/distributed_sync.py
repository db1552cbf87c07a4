"""Trainer and explorers in separate processes, synced over torch.distributed (gloo on CPU).

    torchrun --standalone --nproc-per-node 3 examples/distributed_sync.py --steps 20

Rank 0 trains a small policy (real AdamW steps) and runs the :class:`aiosync.Synchronizer`;
every other rank is an explorer (:class:`aiosync.Explorer`, the same class as in one process) that
rolls out with a bfloat16 copy of the policy, stamping every rollout with the version that
produced it. Patch sync, trainer-driven, ``sync_weight_no_wait``: the trainer never waits for
an explorer after the first sync, explorers apply new versions in the background.

At the end every explorer sends back a digest of its final weights; rank 0 compares each with
its own final weights cast to bfloat16 and prints one JSON line::

    {"explorers": 2, "final_version": 20, "bit_exact": true, "bytes_sent": ..., ...}

Multi-node: run the same script with ``--nnodes``/``--rdzv-*`` (see ``docs/distributed.md``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
from collections import Counter

import anyio
import torch
import torch.distributed as dist
from torch import nn

from aiosync.coordination import Explorer, Synchronizer
from aiosync.syncers.config import WeightSyncerConfig
from aiosync.transports.distributed import WeightSyncGroup

OBS, ACT = 24, 6
WEIGHT_SYNCER = {"type": "patch", "patch": {"encoding": "flat", "compression": "zstd", "init_sync": {"enabled": True}}}


class Policy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(OBS, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh())
        self.norm = nn.LayerNorm(64)
        self.head = nn.Linear(64, ACT)

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.body(obs)))


def digest(state: dict[str, torch.Tensor]) -> str:
    """SHA-256 of every tensor's bytes, keys in sorted order."""
    h = hashlib.sha256()
    for key in sorted(state):
        t = state[key].detach().contiguous().reshape(-1)
        h.update(key.encode())
        h.update(t.view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def as_explorer_dtype(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: (v.to(torch.bfloat16) if v.is_floating_point() else v) for k, v in state.items()}


async def run_trainer(group: WeightSyncGroup, args: argparse.Namespace) -> dict:
    torch.manual_seed(0)
    policy = Policy()
    opt = torch.optim.AdamW(policy.parameters(), lr=args.lr, betas=(0.9, 0.95))
    target = Policy()  # the behaviour we regress toward: a stand-in for an RL objective
    ranks = [r for r in range(group.world_size) if r != group.rank]
    transports = {r: group.transport(r) for r in ranks}
    config = {"method": "memory", "style": "trainer_driven", "sync_weight_no_wait": True,
              "sync_timeout": args.timeout, "delivery_timeout": args.timeout}

    def train_step(step: int) -> float:
        g = torch.Generator().manual_seed(step)
        obs = torch.randn(64, OBS, generator=g)
        with torch.no_grad():
            want = target(obs)
        loss = (policy(obs) - want).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        return float(loss.detach())

    async with Synchronizer(config, WEIGHT_SYNCER) as sync:
        trainer = await sync.attach_trainer(policy)
        for t in transports.values():
            sync.serve_remote(t)
        await sync.wait_for_explorers(len(ranks), timeout=args.timeout)
        losses = []
        for step in range(1, args.steps + 1):
            losses.append(await anyio.to_thread.run_sync(train_step, step))
            await trainer.step_done()  # trainer-driven: publishes and pushes every step, no wait
            await anyio.sleep(args.step_pause)
        await trainer.stop()
    # Leaving the block drained: every explorer was delivered the final version.
    metrics = sync.metrics()
    want = digest(as_explorer_dtype(policy.state_dict()))
    reports = {}
    for rank, t in transports.items():
        with anyio.fail_after(args.timeout):
            reports[rank] = await t.recv()
    bit_exact = all(r["digest"] == want and r["version"] == trainer.version for r in reports.values())
    return {
        "explorers": len(reports),
        "final_version": trainer.version,
        "bit_exact": bit_exact,
        "bytes_sent": sum(t.stats.bytes_sent for t in transports.values()),
        "payload_bytes": metrics["totals"]["bytes_sent"],
        "deliveries": metrics["totals"]["delivered"],
        "builds": metrics["fanout"]["builds"],
        "shared": metrics["fanout"]["shared"],
        "coalesced": metrics["totals"]["coalesced"],
        "versions": {str(r): rep["version"] for r, rep in reports.items()},
        "rollouts": {str(r): rep["rollouts"] for r, rep in reports.items()},
        "final_loss": round(losses[-1], 6),
        "backend": group.backend,
    }


async def run_explorer(group: WeightSyncGroup, args: argparse.Namespace) -> None:
    policy = Policy().to(torch.bfloat16)
    with torch.no_grad():
        for p in policy.parameters():
            p.zero_()  # the bootstrap must bring it to the trainer's weights
    transport = group.transport(0)
    rollouts: Counter[int] = Counter()
    async with Explorer(f"explorer-{group.rank}", policy, transport) as explorer:
        g = torch.Generator().manual_seed(group.rank)
        while not explorer.trainer_stopped:
            async with explorer.lease() as (model, version):
                obs = torch.randn(16, OBS, generator=g).to(torch.bfloat16)
                with torch.no_grad():
                    model(obs).argmax(-1)  # one rollout step, generated by `version`
            rollouts[version] += 1
            await explorer.step_done()
            await anyio.sleep(args.step_pause)
    # The block waited for the final drain: the model holds the trainer's last version.
    await transport.send({"digest": digest(policy.state_dict()), "version": explorer.version,
                          "rollouts": sum(rollouts.values()), "versions_seen": len(rollouts)})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20, help="train steps (versions) on rank 0")
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds any wait on a peer may take")
    parser.add_argument("--step-pause", type=float, default=0.01, help="seconds each loop yields per step")
    args = parser.parse_args(argv)
    if "RANK" not in os.environ:
        parser.error("run it with torchrun, e.g. torchrun --standalone --nproc-per-node 3 " + sys.argv[0])
    torch.set_num_threads(1)
    comm = WeightSyncerConfig.from_any(WEIGHT_SYNCER).comm_options
    group = WeightSyncGroup.init(backend="gloo", comm_options=comm, timeout=args.timeout)
    if group.world_size < 2:
        parser.error("needs at least 2 processes: one trainer and one explorer")
    try:
        if group.rank == 0:
            print(json.dumps(anyio.run(run_trainer, group, args)), flush=True)
        else:
            anyio.run(run_explorer, group, args)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
