"""A sharded trainer and explorers as Ray actors on a cluster of several nodes; one node goes away.

    python examples/ray_cluster_sync.py --nodes 3 --ranks 2 --explorers 4 --steps 20 --remove-node-at 8 --json out.json

``ray.cluster_utils.Cluster`` starts ``--nodes`` Ray nodes on this machine (a head for the trainer,
the others for explorers). The trainer's ``--ranks`` ranks are Ray actors on the head: rank 0 runs
the :class:`aiosync.Synchronizer` (``TrainerActor.synchronizer``, NCCL method: syncs at its check
points) and attaches the trainer with ``shard_peers``; every other rank runs a
:class:`~aiosync.coordination.shards.ShardPeer` over a Ray channel to rank 0. Each rank holds a
block of rows of every tensor (a :class:`~aiosync.checkpoints.TensorSlice`) and builds its own
shard's patch — the ranks' "training" writes the rows of a state that is a pure function of the
version (no collectives between the rank actors here), so every check is bit-exact.

The ``--explorers`` explorer actors (``max_restarts=1``) are spread over the other nodes and join
rank 0 (``ExplorerActor.explorer``). When the trainer reaches version ``--remove-node-at``, the
driver removes the node that hosts the first explorer (``Cluster.remove_node``): its actors'
processes die, the trainer's Ray channels to them break (Ray's signal) and their sessions are
declared lost; Ray restarts the actors on a surviving node, the driver calls their ``run`` again
(``call_with_restarts``), and they rejoin with a bootstrap. The trainer never waits on them: each
``step_done`` is bounded by ``sync_timeout``. It prints (and with ``--json`` writes)::

    {"nodes": 3, "ranks": 2, "explorers": 4, "final_version": 20, "bit_exact": true, "node_removed": true,
     "explorers_restarted": ..., "rejoined": ..., "lost_detect_s": ..., "trainer_max_wait_s": ...,
     "sync_timeout": ..., "seconds": ...}

``lost_detect_s``: from the node's removal to the last of its explorers declared lost by rank 0;
``trainer_max_wait_s``: the longest ``step_done()`` of rank 0 (training excluded). Direct routes
by default (``--routes relay``: through rank 0): every explorer actor opens a Ray channel to every
rank but 0 when it joins (again after a restart), and the report adds ``relayed_bytes`` (0),
``rank_patch_bytes`` and ``rank_sent_bytes`` (rank 0: the sync packets the explorers' last
incarnations received from it; the others: the parts every explorer fetched from them).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time

import anyio
import ray
import torch
from ray.cluster_utils import Cluster

from aiosync.checkpoints import TensorSlice
from aiosync.coordination.shards import ShardPeer
from aiosync.integrations.ray import ExplorerActor, TrainerActor, call_with_restarts
from aiosync.syncers.patch.shards_direct import ShardRoutes
from aiosync.transports.ray import RayChannel, RayEndpoint

PATCH = {"type": "patch", "patch": {"encoding": "flat", "compression": "zstd",
                                    "init_sync": {"enabled": True, "bucket_size": 1 << 20}}}
#: Ray's node health checks, made fast enough that a lost node is noticed in about a second.
FAST_HEALTH = {"health_check_initial_delay_ms": 0, "health_check_period_ms": 200,
               "health_check_failure_threshold": 3}


def full(v: int) -> dict[str, torch.Tensor]:
    """The trainer's whole state at version ``v`` (1.1 M parameters; rows not divisible by the ranks)."""
    g = torch.Generator().manual_seed(11)
    w = torch.randn(4099, 256, generator=g)
    return {"w": w + 1e-3 * v * torch.sin(w), "b": torch.randn(301, generator=g) - 0.01 * v,
            "steps": torch.arange(7, dtype=torch.int64) + v, "scale": torch.tensor(1.0 + v)}


def rows(n: int, rank: int, ranks: int) -> tuple[int, int]:
    per = -(-n // ranks)
    return min(n, rank * per), min(n, (rank + 1) * per)


def pieces(state: dict[str, torch.Tensor], rank: int, ranks: int) -> dict:
    """Rank ``rank``'s rows of every tensor (a scalar is whole on rank 0)."""
    out: dict = {}
    for key, t in state.items():
        if t.dim() == 0:
            if rank == 0:
                out[key] = t
            continue
        a, b = rows(t.shape[0], rank, ranks)
        out[key] = TensorSlice(t[a:b], (a,) + (0,) * (t.dim() - 1), tuple(t.shape))
    return out


def digest(state: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for key in sorted(state):
        t = state[key].detach()
        t = t.to(torch.bfloat16) if t.is_floating_point() else t
        h.update(key.encode())
        h.update(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


class _Rank:
    def __init__(self, rank: int, ranks: int) -> None:
        torch.set_num_threads(1)
        self.rank, self.ranks = rank, ranks
        self.state = full(0)
        self.pieces = pieces(self.state, rank, ranks)

    def train_step(self, step: int) -> None:
        for key, t in full(step).items():
            self.state[key].copy_(t)  # the rank's pieces are views of its rows


@ray.remote(num_cpus=0, resources={"trainer": 1})
class Rank0(_Rank, TrainerActor):
    def __init__(self, ranks: int) -> None:
        super().__init__(0, ranks)
        self.version = 0
        self.shard_channels: list = []
        self._joined = anyio.Event()
        self._stepped = anyio.Event()
        self._started = anyio.Event()
        self.lost_at: dict[str, float] = {}

    async def wait_started(self) -> None:
        """Returns once the first explorers joined: every rank starts its steps together."""
        await self._started.wait()

    async def shard_connect(self, peer, channel: str, timeout: float) -> None:
        """A rank > 0 connects: this end of its shard channel."""
        ch = RayChannel(peer, channel, timeout=timeout)
        ch.watch()
        self.shard_channels.append(ch)
        self._joined.set()

    async def wait_version(self, version: int) -> float:
        while self.version < version:
            await self._stepped.wait()
        return time.time()

    async def _watch_lost(self, sync) -> None:
        while True:
            for name, session in list(sync.explorers.items()):
                if session.lost and name not in self.lost_at:
                    self.lost_at[name] = time.time()
            await sync.source.changed(None)  # a session closing wakes it

    async def lost_times(self) -> dict:
        return dict(self.lost_at)

    async def train(self, steps: int, explorers: int, config: dict, rejoins_wanted: int, timeout: float,
                    step_pause: float) -> dict:
        with anyio.fail_after(timeout):
            while len(self.shard_channels) < self.ranks - 1:
                await self._joined.wait()
                self._joined = anyio.Event()
        waits: list[float] = []
        async with self.synchronizer(config, PATCH) as sync, anyio.create_task_group() as tg:
            handle = await sync.attach_trainer(self.pieces, param_names=list(self.state),
                                               shard_peers=self.shard_channels)
            tg.start_soon(self._watch_lost, sync)
            await sync.wait_for_explorers(explorers, timeout=timeout)
            self._started.set()
            for step in range(1, steps + 1):
                await anyio.to_thread.run_sync(self.train_step, step)
                t0 = time.perf_counter()
                await handle.step_done()
                waits.append(time.perf_counter() - t0)
                self.version = handle.version
                self._stepped.set()
                self._stepped = anyio.Event()
                await anyio.sleep(step_pause)
            # End with the whole fleet: the restarted explorers reconnect first (bounded).
            await self.wait_for_connections(explorers + rejoins_wanted, timeout=timeout)
            await sync.wait_for_explorers(explorers, timeout=timeout)
            await handle.stop()
            tg.cancel_scope.cancel()
        served = self.serving_statistics()
        return {"digest": digest(full(steps)), "version": handle.version, "rejoins": served.rejoins,
                "joins": served.joins, "trainer_max_wait_s": max(waits), "lost": sorted(self.lost_at),
                "relayed_bytes": sync.shards.relayed_bytes, "patch_bytes": sync.shards.patch_bytes}


@ray.remote(num_cpus=0, resources={"trainer": 1})
class RankN(_Rank, RayEndpoint):
    def __init__(self, rank: int, ranks: int) -> None:
        super().__init__(rank, ranks)
        self.peer: ShardPeer | None = None
        self._entered = anyio.Event()

    async def route_connect(self, explorer, channel: str, timeout: float) -> None:
        """An explorer actor opens its direct route to this rank (at every join, restarts included)."""
        with anyio.fail_after(timeout):
            await self._entered.wait()
        ch = RayChannel(explorer, channel, timeout=timeout)
        ch.watch()
        self.peer.serve_route(ch)

    async def run(self, rank0, steps: int, timeout: float, direct: bool) -> dict:
        channel = RayChannel(rank0, timeout=timeout)
        await rank0.shard_connect.remote(ray.get_runtime_context().current_actor, channel.channel, timeout)
        channel.watch()
        self.peer = ShardPeer(self.pieces, channel, rank=self.rank, names=list(self.state), timeout=timeout,
                              routes=[] if direct else None)
        async with self.peer as peer:
            self._entered.set()
            with anyio.fail_after(timeout):  # serving the explorers' joins meanwhile (before its first step)
                await rank0.wait_started.remote()
            for step in range(1, steps + 1):
                await anyio.to_thread.run_sync(self.train_step, step)
                await peer.step_done()
        cache = peer.server.cache
        return {"rank": self.rank, "builds": peer.server.builds, "patch_bytes": peer.server.patch_bytes,
                "sent_patch_bytes": None if cache is None else cache.sent_patch_bytes}


@ray.remote(num_cpus=0, max_restarts=1, resources={"explorer": 1})
class Rollout(ExplorerActor):
    def __init__(self, name: str) -> None:
        torch.set_num_threads(1)
        self.name = name

    def node(self) -> str:
        return ray.get_runtime_context().get_node_id()

    async def run(self, trainer, ranks: list, step_pause: float, timeout: float) -> dict:
        model = {k: torch.zeros(v.shape, dtype=torch.bfloat16 if v.is_floating_point() else v.dtype)
                 for k, v in full(0).items()}
        me = ray.get_runtime_context().current_actor
        channels = {r: RayChannel(actor, timeout=timeout) for r, actor in enumerate(ranks, start=1)}
        for r, ch in channels.items():  # direct routes: a channel to every rank but 0
            await ranks[r - 1].route_connect.remote(me, ch.channel, timeout)
            ch.watch()
        async with ShardRoutes(channels, timeout=timeout) as routes, \
                self.explorer(trainer, self.name, model, connect_timeout=timeout, timeout=timeout,
                              shard_routes=routes if ranks else None) as explorer:
            while not explorer.trainer_stopped:
                async with explorer.lease():
                    pass  # a rollout would run here, on one whole version
                await explorer.step_done()
                await anyio.sleep(step_pause)
        return {"digest": digest(model), "version": explorer.version, "node": self.node(),
                "fetched": dict(routes.received_bytes), "packet_bytes": routes.packet_bytes}


async def run(args: argparse.Namespace, cluster: Cluster, workers: list) -> dict:
    t0 = time.perf_counter()
    config = {"method": "nccl", "style": "trainer_driven", "sync_weight_no_wait": True,
              "sync_timeout": args.sync_timeout, "delivery_timeout": args.sync_timeout}
    rank0 = Rank0.remote(args.ranks)
    others = [RankN.remote(r, args.ranks) for r in range(1, args.ranks)]
    names = [f"explorer-{i}" for i in range(args.explorers)]
    explorers = {n: Rollout.options(scheduling_strategy="SPREAD").remote(n) for n in names}
    nodes = {n: await e.node.remote() for n, e in explorers.items()}
    victim_node = nodes[names[0]]
    on_victim = [n for n in names if nodes[n] == victim_node]
    results: dict = {}
    removed_at = None

    async def explore(name: str) -> None:
        routed = others if args.routes == "direct" else []
        results[name] = await call_with_restarts(explorers[name], "run", rank0, routed, args.step_pause, args.timeout,
                                                 max_restarts=1, restart_timeout=args.timeout)

    with anyio.fail_after(4 * args.timeout):
        async with anyio.create_task_group() as tg:
            training = rank0.train.remote(args.steps, args.explorers, config,
                                          len(on_victim) if args.remove_node_at else 0, args.timeout, args.step_pause)
            shard_runs = [r.run.remote(rank0, args.steps, args.timeout, args.routes == "direct") for r in others]
            for name in names:
                tg.start_soon(explore, name)
            if args.remove_node_at:
                await rank0.wait_version.remote(args.remove_node_at)
                node = next(w for w in workers if w.node_id == victim_node)
                removed_at = time.time()
                cluster.remove_node(node)
            trained = await training
            shard_results = [await ref for ref in shard_runs]
    lost = await rank0.lost_times.remote()
    detect = [lost[n] - removed_at for n in on_victim if n in lost] if removed_at else []
    bit_exact = all(r.value["digest"] == trained["digest"] and r.value["version"] == trained["version"]
                    for r in results.values())
    return {"nodes": args.nodes, "ranks": args.ranks, "explorers": len(results), "final_version": trained["version"],
            "bit_exact": bit_exact, "node_removed": removed_at is not None,
            "explorers_restarted": sum(r.restarts for r in results.values()), "rejoined": trained["rejoins"],
            "lost_detect_s": round(max(detect), 3) if detect else None,
            "trainer_max_wait_s": round(trained["trainer_max_wait_s"], 3), "sync_timeout": args.sync_timeout,
            "seconds": round(time.perf_counter() - t0, 2), "routes": args.routes,
            "relayed_bytes": trained["relayed_bytes"],
            "rank_patch_bytes": [trained["patch_bytes"]] + [r["patch_bytes"] for r in shard_results],
            "rank_sent_bytes": [sum(r.value["packet_bytes"] for r in results.values())]
            + [r["sent_patch_bytes"] for r in shard_results],
            "on_removed_node": on_victim, "lost": trained["lost"],
            "final_nodes": {n: r.value["node"][:8] for n, r in results.items()},
            "surviving_nodes": sorted(w.node_id for w in workers if removed_at and w.node_id != victim_node)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=3, help="Ray nodes on this machine: a head and explorer nodes")
    parser.add_argument("--ranks", type=int, default=2, help="trainer ranks (Ray actors on the head node)")
    parser.add_argument("--explorers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--remove-node-at", type=int, default=0, metavar="VERSION",
                        help="remove the first explorer's node when the trainer reaches this version (0: never)")
    parser.add_argument("--sync-timeout", type=float, default=10.0, help="synchronizer sync_timeout and "
                        "delivery_timeout: the longest the trainer waits on an explorer")
    parser.add_argument("--timeout", type=float, default=120.0, help="bound on every other wait")
    parser.add_argument("--step-pause", type=float, default=0.3, help="seconds each loop yields per step")
    parser.add_argument("--routes", choices=("direct", "relay"), default="direct",
                        help="direct: every rank sends its own parts to the explorers; relay: through rank 0")
    parser.add_argument("--json", default=None, help="also write the result to this file")
    args = parser.parse_args(argv)
    if args.nodes < 3 and args.remove_node_at:
        parser.error("--remove-node-at needs --nodes 3 or more (the head, the node removed, one that survives)")
    if args.ranks < 1 or args.explorers < 1:
        parser.error("--ranks and --explorers must be at least 1")
    if args.remove_node_at and not 0 < args.remove_node_at < args.steps:
        parser.error(f"--remove-node-at must be in 1 .. {args.steps - 1}")
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 2, "resources": {"trainer": args.ranks}, "include_dashboard": False,
        "_system_config": FAST_HEALTH})
    workers = [cluster.add_node(num_cpus=1, resources={"explorer": args.explorers}) for _ in range(args.nodes - 1)]
    ray.init(address=cluster.address, log_to_driver=False)
    try:
        cluster.wait_for_nodes()
        result = anyio.run(run, args, cluster, workers)
    finally:
        ray.shutdown()
        cluster.shutdown()
    print(json.dumps(result), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    ok = result["bit_exact"] and result["trainer_max_wait_s"] <= result["sync_timeout"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
