"""How long do rollouts wait for a sync? Ordinary patch applies against a repair, over a slow link.

An explorer rolls out in a tight loop (lease, a millisecond of work, release) while the trainer
publishes versions of a model of ``--elements`` elements (fp32 trainer, bf16 explorer, about 3 %
of the values change per version) over a simulated link of ``--bandwidth`` bytes per second.
Then one acknowledgement is lost, so the next delivery is a *repair*: a re-bootstrap that sends
the whole model over the slow link. Rollouts must not wait for that transfer — aiosync stages
the download outside the explorer's exclusive section and holds the model only to write what
changed. Prints (and with ``--json`` writes) the longest lease wait and exclusive write in each
phase::

    python examples/lease_pauses.py --elements 20000000 --bandwidth 40e6
"""

from __future__ import annotations

import argparse
import json
import time

import anyio
import torch

from aiosync.coordination import Synchronizer
from aiosync.coordination.protocol import Ack
from aiosync.transports.simulated import simulated_pair

PATCH = {"type": "patch", "patch": {"encoding": "flat", "compression": "zstd", "init_sync": {"enabled": True}}}


def make_model(elements: int) -> dict[str, torch.Tensor]:
    rows = 4096
    g = torch.Generator().manual_seed(0)
    return {f"layer{i}.weight": torch.randn(rows, elements // (4 * rows), generator=g) for i in range(4)}


def step(state: dict[str, torch.Tensor], version: int) -> None:
    """An RL-sized update: about 3 % of the bf16 values move by one unit in the last place."""
    g = torch.Generator().manual_seed(version)
    with torch.no_grad():
        for t in state.values():
            mask = torch.rand(t.shape, generator=g) < 0.03
            t.add_(mask * t.abs() * 2.0 ** -7)


async def run(args: argparse.Namespace) -> dict:
    state = make_model(args.elements)
    ends = {}

    lose_ack_of: set[int] = set()

    def link(name: str):
        pair = simulated_pair(bandwidth=args.bandwidth, latency=0.001, seed=0, timeout=600)
        # faults strike only the explorer's Ack of the versions named in lose_ack_of
        pair[1].faults_where = lambda msg: isinstance(msg, Ack) and msg.version in lose_ack_of
        ends[name] = pair
        return pair

    cfg = dict(style="trainer_driven", sync_weight_no_wait=True, delivery_timeout=args.ack_bound)
    report: dict = {"elements": sum(t.numel() for t in state.values()), "bandwidth_Bps": args.bandwidth}
    async with Synchronizer(cfg, PATCH, transport_factory=link) as sync:
        trainer = await sync.attach_trainer(state)
        explorer = await sync.attach_explorer("e0", {k: v.to(torch.bfloat16) for k, v in state.items()})
        line = sync.explorers["e0"].line
        waits: list[float] = []
        done = anyio.Event()

        async def rollouts() -> None:
            while not done.is_set():
                t0 = time.perf_counter()
                async with explorer.lease():
                    waits.append(time.perf_counter() - t0)
                    await anyio.sleep(0.001)

        async def phase(versions: range, lose_ack: bool = False) -> dict:
            waits.clear()
            explorer.slot.stats.max_exclusive_s = 0.0
            repairs = line.stats.repairs
            for v in versions:
                if lose_ack:  # the explorer's Ack of this version is lost, so the line fails
                    lose_ack_of.add(v)  # and re-bootstraps the explorer at the next version
                    ends["e0"][1].inject("drop")
                step(state, v)
                await trainer.sync_weight(v)
                if not await line.wait_settled(600):
                    raise TimeoutError(f"version {v} was not delivered within 600 s")
            return {"versions": len(versions), "lease_wait_max_ms": max(waits, default=0.0) * 1e3,
                    "exclusive_write_max_ms": explorer.slot.stats.max_exclusive_s * 1e3,
                    "leases": len(waits), "repairs": line.stats.repairs - repairs}

        async with anyio.create_task_group() as tg:
            tg.start_soon(rollouts)
            await phase(range(1, 2))  # the first sync (blocking)
            report["patches"] = await phase(range(2, 6))
            await phase(range(6, 7), lose_ack=True)
            t0 = time.perf_counter()
            report["repair"] = await phase(range(7, 8))
            report["repair"]["seconds"] = time.perf_counter() - t0
            done.set()
        report["bit_exact"] = all(torch.equal(explorer.slot.model[k], t.to(torch.bfloat16)) for k, t in state.items())
        report["final_version"] = explorer.version
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--elements", type=int, default=20_000_000)
    parser.add_argument("--bandwidth", type=float, default=40e6, help="bytes per second of the simulated link")
    parser.add_argument("--ack-bound", type=float, default=10.0, help="delivery_timeout (seconds)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    report = anyio.run(run, args)
    print(json.dumps(report, indent=2))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(report, fh, indent=2)


if __name__ == "__main__":
    main()
