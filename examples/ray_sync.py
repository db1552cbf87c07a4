"""Trainer and explorers as Ray actors; one explorer is killed mid-run and Ray restarts it.

    python examples/ray_sync.py --steps 20 --kill-explorer-at 8 --json out.json

A local Ray cluster (or ``--address`` of an existing one) runs one trainer actor and
``--explorers`` explorer actors. The trainer trains a small policy (real AdamW steps) and runs the
:class:`aiosync.Synchronizer` (``TrainerActor.synchronizer``); each explorer runs the one
:class:`aiosync.Explorer` over a Ray channel (``ExplorerActor.explorer``), rolling out with a
bfloat16 copy and stamping each rollout with its version. Patch sync, trainer-driven,
``sync_weight_no_wait`` by default: the trainer never waits for an explorer after its first sync.

When the trainer reaches version ``--kill-explorer-at``, the driver kills the first explorer's
process (``ray.kill(..., no_restart=False)``, as a crash would). The trainer's channel to it
breaks (Ray's own signal), its session is declared lost, and the trainer trains on. Ray restarts
the actor (``max_restarts=1``); the driver calls its ``run`` again (``call_with_restarts``) and it
rejoins under the same name: a fresh bootstrap, then patches. So that the run ends with the whole
fleet, the trainer waits after its last step (bounded) until the restarted explorer is back.
Leaving the synchronizer drains: every explorer holds the trainer's final weights. It prints (and
with ``--json`` writes)::

    {"explorers": 2, "final_version": 20, "bit_exact": true, "restarts": 1, "rejoined": 1,
     "bytes_sent": ..., "seconds": ...}

``bit_exact``: every explorer's final weights hash equal to the trainer's final weights cast to
bfloat16, at the final version.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from collections import Counter

import anyio
import ray
import torch
from torch import nn

from aiosync.integrations.ray import ExplorerActor, TrainerActor, call_with_restarts

OBS, ACT = 24, 6
PATCH = {"type": "patch", "patch": {"encoding": "flat", "compression": "zstd", "init_sync": {"enabled": True}}}
BUCKET = {"type": "bucket", "bucket": {"bucket_size": 1 << 16}}


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
        h.update(key.encode())
        h.update(state[key].detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


@ray.remote(num_cpus=0)
class Trainer(TrainerActor):
    def __init__(self, lr: float) -> None:
        torch.set_num_threads(1)
        torch.manual_seed(0)
        self.policy = Policy()
        self.target = Policy()  # the behaviour we regress toward: a stand-in for an RL objective
        self.opt = torch.optim.AdamW(self.policy.parameters(), lr=lr, betas=(0.9, 0.95))
        self.version = 0
        self._stepped = anyio.Event()

    def train_step(self, step: int) -> float:
        obs = torch.randn(64, OBS, generator=torch.Generator().manual_seed(step))
        with torch.no_grad():
            want = self.target(obs)
        loss = (self.policy(obs) - want).pow(2).mean()
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()
        return float(loss.detach())

    async def wait_version(self, version: int) -> int:
        """Return once the trainer published ``version`` (the driver's cue to kill an explorer)."""
        while self.version < version:
            await self._stepped.wait()
        return self.version

    def _published(self, version: int) -> None:
        self.version = version
        self._stepped.set()
        self._stepped = anyio.Event()

    async def train(self, steps: int, explorers: int, config: dict, weight_syncer: dict, rejoins: int,
                    timeout: float, step_pause: float) -> dict:
        async with self.synchronizer(config, weight_syncer) as sync:
            handle = await sync.attach_trainer(self.policy)
            await sync.wait_for_explorers(explorers, timeout=timeout)
            for step in range(1, steps + 1):
                loss = await anyio.to_thread.run_sync(self.train_step, step)
                await handle.step_done()
                self._published(handle.version)
                await anyio.sleep(step_pause)
            # End the run with the whole fleet: restarted explorers first reconnect.
            await self.wait_for_connections(explorers + rejoins, timeout=timeout)
            await sync.wait_for_explorers(explorers, timeout=timeout)
            await handle.stop()
        # Drained: every attached explorer was delivered the final version.
        want = {k: (v.to(torch.bfloat16) if v.is_floating_point() else v) for k, v in self.policy.state_dict().items()}
        metrics, served = sync.metrics(), self.serving_statistics()
        return {"digest": digest(want), "version": handle.version, "final_loss": round(loss, 6),
                "rejoins": served.rejoins, "joins": served.joins, "bytes_sent": served.bytes_sent,
                "objects_put": served.objects_put, "objects_reused": served.objects_reused,
                "payload_bytes": metrics["totals"]["bytes_sent"], "deliveries": metrics["totals"]["delivered"],
                "builds": metrics["fanout"]["builds"], "shared": metrics["fanout"]["shared"]}


@ray.remote(num_cpus=0, max_restarts=1)
class Rollout(ExplorerActor):
    def __init__(self, name: str) -> None:
        torch.set_num_threads(1)
        self.name = name

    async def run(self, trainer, step_pause: float, timeout: float) -> dict:
        policy = Policy().to(torch.bfloat16)
        with torch.no_grad():
            for p in policy.parameters():
                p.zero_()  # the bootstrap must bring it to the trainer's weights
        rollouts: Counter[int] = Counter()
        g = torch.Generator().manual_seed(len(self.name))
        async with self.explorer(trainer, self.name, policy, connect_timeout=timeout, timeout=timeout) as explorer:
            while not explorer.trainer_stopped:
                async with explorer.lease() as (model, version):
                    obs = torch.randn(16, OBS, generator=g).to(torch.bfloat16)
                    with torch.no_grad():
                        model(obs).argmax(-1)  # one rollout step, generated by `version`
                rollouts[version] += 1
                await explorer.step_done()
                await anyio.sleep(step_pause)
        # The block waited for the final drain: the model holds the trainer's last version.
        return {"digest": digest(policy.state_dict()), "version": explorer.version,
                "rollouts": sum(rollouts.values()), "versions_seen": len(rollouts)}


async def run(args: argparse.Namespace) -> dict:
    t0 = time.perf_counter()
    syncer = PATCH if args.syncer == "patch" else BUCKET
    config = {"method": args.method, "style": args.style, "sync_interval": 1,
              "sync_weight_no_wait": args.syncer == "patch", "sync_timeout": args.timeout,
              "delivery_timeout": args.timeout}
    if args.method == "checkpoint":
        import tempfile

        config["checkpoint_dir"] = tempfile.mkdtemp(prefix="aiosync-ray-")
    trainer = Trainer.remote(args.lr)
    explorers = {f"explorer-{i}": Rollout.remote(f"explorer-{i}") for i in range(args.explorers)}
    kill = args.kill_explorer_at is not None
    results: dict = {}
    rejoin_s = None

    async def explore(name: str, actor) -> None:
        results[name] = await call_with_restarts(actor, "run", trainer, args.step_pause, args.timeout, max_restarts=1)

    with anyio.fail_after(4 * args.timeout):
        async with anyio.create_task_group() as tg:
            training = trainer.train.remote(args.steps, args.explorers, config, syncer, int(kill), args.timeout,
                                            args.step_pause)
            for name, actor in explorers.items():
                tg.start_soon(explore, name, actor)
            if kill:
                await trainer.wait_version.remote(args.kill_explorer_at)
                killed = time.perf_counter()
                ray.kill(explorers["explorer-0"], no_restart=False)  # a crash: Ray restarts the actor
                await trainer.wait_for_connections.remote(args.explorers + 1, args.timeout)
                rejoin_s = time.perf_counter() - killed
            trained = await training
    bit_exact = all(r.value["digest"] == trained["digest"] and r.value["version"] == trained["version"]
                    for r in results.values())
    return {
        "explorers": len(results),
        "final_version": trained["version"],
        "bit_exact": bit_exact,
        "restarts": sum(r.restarts for r in results.values()),
        "rejoined": trained["rejoins"],
        "bytes_sent": trained["bytes_sent"],
        "seconds": round(time.perf_counter() - t0, 2),
        "rejoin_s": None if rejoin_s is None else round(rejoin_s, 2),
        "method": args.method, "style": args.style, "syncer": args.syncer,
        "payload_bytes": trained["payload_bytes"], "deliveries": trained["deliveries"],
        "builds": trained["builds"], "shared": trained["shared"],
        "objects_put": trained["objects_put"], "objects_reused": trained["objects_reused"],
        "versions": {name: r.value["version"] for name, r in results.items()},
        "rollouts": {name: r.value["rollouts"] for name, r in results.items()},
        "final_loss": trained["final_loss"],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20, help="train steps (versions)")
    parser.add_argument("--explorers", type=int, default=2)
    parser.add_argument("--kill-explorer-at", type=int, default=None,
                        help="kill explorer-0 when the trainer reaches this version (Ray restarts it)")
    parser.add_argument("--method", choices=["memory", "checkpoint", "nccl"], default="memory")
    parser.add_argument("--style", choices=["trainer_driven", "explorer_driven", "fixed"], default="trainer_driven")
    parser.add_argument("--syncer", choices=["patch", "bucket"], default="patch")
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds any wait on a peer may take")
    parser.add_argument("--step-pause", type=float, default=0.4, help="seconds each loop yields per step")
    parser.add_argument("--address", default=None, help="an existing Ray cluster (default: start a local one)")
    parser.add_argument("--json", default=None, help="also write the result to this file")
    parser.add_argument("--verbose", action="store_true", help="show the actors' logs")
    args = parser.parse_args(argv)
    if args.kill_explorer_at is not None and not 0 < args.kill_explorer_at < args.steps:
        parser.error(f"--kill-explorer-at must be between 1 and --steps - 1 ({args.steps - 1})")
    if args.explorers < 1:
        parser.error("--explorers must be at least 1")
    ray.init(address=args.address, include_dashboard=False, log_to_driver=args.verbose)
    try:
        result = anyio.run(run, args)
    finally:
        ray.shutdown()
    print(json.dumps(result), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0 if result["bit_exact"] else 1


if __name__ == "__main__":
    sys.exit(main())
