"""An FSDP2 trainer whose ranks are Ray actors, explorers as Ray actors on other nodes; a node goes away.

    python examples/ray_cluster_sync.py --nodes 3 --ranks 2 --explorers 4 --steps 20 --remove-node-at 8 --json out.json

``ray.cluster_utils.Cluster`` starts ``--nodes`` Ray nodes on this machine (a head for the trainer,
the others for explorers). The trainer's ``--ranks`` ranks are Ray actors on the head that form one
torch.distributed process group (gloo), the way verl / OpenRLHF / NeMo-RL launch trainer ranks:
the driver asks rank 0 for its address and a free port and hands them to every rank, which calls
``init_process_group`` with it. A small transformer-shaped model is sharded over the group with
FSDP2 (``fully_shard``) and trained with real AdamW steps (each rank its own data; the gradients
are reduce-scattered across the group). Rank 0 runs the :class:`aiosync.Synchronizer`
(``TrainerActor.synchronizer``, NCCL method: syncs at its check points) and attaches its FSDP2
module with ``shard_peers``; every other rank runs a
:class:`~aiosync.coordination.shards.ShardPeer` on its FSDP2 module over a Ray channel to rank 0.
Each rank diffs and encodes the patch of its own shards (the DTensors' local tensors): nothing is
gathered for syncs. At the end every rank gathers the full model once (``gather_full_state``) to
check that every explorer holds it exactly (bfloat16 copies, hashed).

The ``--explorers`` explorer actors (``max_restarts=1``) are spread over the other nodes and join
rank 0 (``ExplorerActor.explorer``). When the trainer reaches version ``--remove-node-at``, the
driver removes the node that hosts the first explorer (``Cluster.remove_node``): its actors'
processes die, the trainer's Ray channels to them break (Ray's signal) and their sessions are
declared lost; Ray restarts the actors on a surviving node, the driver calls their ``run`` again
(``call_with_restarts``), and they rejoin with a bootstrap. The trainer never waits on them: each
``step_done`` is bounded by ``sync_timeout``. It prints (and with ``--json`` writes)::

    {"nodes": 3, "ranks": 2, "explorers": 4, "final_version": 20, "bit_exact": true, "node_removed": true,
     "explorers_restarted": ..., "rejoined": ..., "lost_detect_s": ..., "trainer_max_wait_s": ...,
     "sync_timeout": ..., "seconds": ..., "fsdp2": true, ...}

``lost_detect_s``: from the node's removal to the last of its explorers declared lost by rank 0;
``trainer_max_wait_s``: the longest ``step_done()`` of rank 0 (training excluded). Direct routes
by default (``--routes relay``: through rank 0): every explorer actor opens a Ray channel to every
rank but 0 when it joins (again after a restart), and the report adds ``relayed_bytes`` (0),
``rank_patch_bytes`` and ``rank_sent_bytes`` (rank 0: the sync packets the explorers' last
incarnations received from it; the others: the parts every explorer fetched from them), and for
the ranks but 0 ``rank_route_bytes``: ``answered_bytes`` (every answer on its routes, whole, as
each explorer got it), ``object_bytes_put`` (parts of at least ``ROUTE_OBJECT_BYTES``, put into
Ray's object store once) and ``object_bytes_reused`` (the same objects referenced by the other
explorers' answers: bytes the rank did not send again; what left the rank is ``answered_bytes -
object_bytes_reused``).

**A trainer rank lost** (``--kill-rank-at VERSION``): the driver kills the last rank's actor when
the trainer reaches that version. A sharded trainer cannot go on without one of its ranks: rank 0
learns it from its Ray channel to that rank (Ray's signal, not a timeout) and ends its run with
:class:`~aiosync.errors.TrainerRankLostError` naming the rank (its collective in flight is
abandoned); the synchronizer closes (the explorers' sessions end: "the trainer failed") and the
driver ends every actor. The report then has ``trainer_rank_lost`` (the rank), ``error`` and
``rank_lost_end_s`` (from the kill to rank 0's error), and the exit status is 3.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import socket
import sys
import time
from datetime import timedelta

import anyio
import ray
import torch
import torch.distributed as dist
from ray.cluster_utils import Cluster
from torch import nn

from aiosync.coordination.shards import ShardPeer
from aiosync.errors import TrainerRankLostError
from aiosync.integrations.ray import ExplorerActor, TrainerActor, call_with_restarts
from aiosync.syncers import collect_param_names_need_sync, gather_full_state
from aiosync.syncers.patch.shards_direct import ShardRoutes
from aiosync.transports.ray import RayChannel, RayEndpoint

PATCH = {"type": "patch", "patch": {"encoding": "flat", "compression": "zstd",
                                    "init_sync": {"enabled": True, "bucket_size": 1 << 20}}}
#: Ray's node health checks, made fast enough that a lost node is noticed in about a second.
FAST_HEALTH = {"health_check_initial_delay_ms": 0, "health_check_period_ms": 200,
               "health_check_failure_threshold": 3}
D_MODEL, LAYERS, VOCAB, LR = 128, 2, 1001, 1e-4
#: A rank's parts at least this large go to the explorers through Ray's object store: put once per
#: version, referenced by every explorer's answer (Ray pulls it once per node) — one send per rank.
ROUTE_OBJECT_BYTES = 16 << 10


class LM(nn.Module):
    """A small transformer language model (torch's own encoder layers), 0.7 M parameters: the
    embedding's and the head's rows are not divisible by the ranks (uneven shards); an int64
    buffer (not sharded: rank 0's)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, D_MODEL)
        self.layers = nn.ModuleList(nn.TransformerEncoderLayer(D_MODEL, 4, 4 * D_MODEL, dropout=0.0, batch_first=True)
                                    for _ in range(LAYERS))
        self.head = nn.Linear(D_MODEL, VOCAB)
        self.register_buffer("steps", torch.zeros((), dtype=torch.int64))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def rollout_model() -> nn.Module:
    """An explorer's bfloat16 copy, zeroed: its bootstrap must bring it to the trainer's weights."""
    model = LM().to(torch.bfloat16)
    with torch.no_grad():
        for t in model.state_dict().values():
            t.zero_()
    return model


def digest(state: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for key in sorted(state):
        t = state[key].detach()
        t = t.to(torch.bfloat16) if t.is_floating_point() else t
        h.update(key.encode())
        h.update(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


class _Rank:
    """One rank of the FSDP2 trainer: a member of the ranks' gloo group, its shards, its optimizer."""

    def __init__(self, rank: int, ranks: int) -> None:
        torch.set_num_threads(1)
        self.rank, self.ranks = rank, ranks
        self.model: nn.Module | None = None

    def master(self) -> tuple[str, int]:
        """Rank 0: the address and a free port the group meets at (what verl & co. hand the others)."""
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return ray.util.get_node_ip_address(), port

    async def init_group(self, address: str, port: int, timeout: float) -> list[str]:
        """Join the trainer's process group (every rank at once) and shard the model over it."""
        await anyio.to_thread.run_sync(self._init_group, address, port, timeout)
        return self.names

    def _init_group(self, address: str, port: int, timeout: float) -> None:
        from torch.distributed.fsdp import fully_shard

        dist.init_process_group("gloo", init_method=f"tcp://{address}:{port}", rank=self.rank,
                                world_size=self.ranks, timeout=timedelta(seconds=timeout))
        torch.manual_seed(0)  # the same initial weights on every rank; fully_shard keeps each rank's rows
        model = LM()
        for layer in model.layers:
            fully_shard(layer)
        fully_shard(model)
        self.opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.95))
        self.model, self.names = model, collect_param_names_need_sync(model)

    def train_step(self, step: int) -> None:
        """One AdamW step on every rank (collectives: the ranks call it together)."""
        g = torch.Generator().manual_seed(1000 * step + self.rank)  # each rank its own data
        idx = torch.randint(0, VOCAB, (4, 16), generator=g)
        loss = nn.functional.cross_entropy(self.model(idx).flatten(0, 1), torch.roll(idx, 1, 1).flatten())
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()
        with torch.no_grad():
            self.model.steps.fill_(step)

    def full_digest(self) -> str:
        """The whole model gathered once (a collective: every rank calls it), hashed."""
        return digest(gather_full_state(self.model, self.names))

    def leave_group(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


@ray.remote(num_cpus=0, resources={"trainer": 1})
class Rank0(_Rank, TrainerActor):
    def __init__(self, ranks: int) -> None:
        super().__init__(0, ranks)
        self.version = 0
        self.shard_channels: dict[int, RayChannel] = {}
        self._joined = anyio.Event()
        self._stepped = anyio.Event()
        self._started = anyio.Event()
        self.lost_at: dict[str, float] = {}

    async def wait_started(self) -> None:
        """Returns once the first explorers joined: every rank starts its steps together."""
        await self._started.wait()

    async def shard_connect(self, peer, channel: str, rank: int, timeout: float) -> None:
        """Rank ``rank`` > 0 connects: this end of its shard channel."""
        ch = RayChannel(peer, channel, timeout=timeout)
        ch.watch()
        self.shard_channels[rank] = ch
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

    async def _watch_rank(self, rank: int, channel: RayChannel, lost: list, scope: anyio.CancelScope) -> None:
        """A rank's channel broke (Ray's signal: its actor died, or its node was lost): end the run."""
        why = await channel.wait_broken()
        lost.append(TrainerRankLostError(f"trainer rank {rank} is gone ({why}); a sharded trainer cannot go on "
                                         "without one of its ranks: restart the trainer's ranks together",
                                         rank=rank))
        scope.cancel()

    async def train(self, steps: int, explorers: int, config: dict, rejoins_wanted: int, timeout: float,
                    step_pause: float) -> dict:
        with anyio.fail_after(timeout):
            while len(self.shard_channels) < self.ranks - 1:
                await self._joined.wait()
                self._joined = anyio.Event()
        waits: list[float] = []
        lost: list[TrainerRankLostError] = []
        peers = [self.shard_channels[r] for r in sorted(self.shard_channels)]
        async with self.synchronizer(config, PATCH) as sync:
            async with anyio.create_task_group() as tg:
                handle = await sync.attach_trainer(self.model, shard_peers=peers)
                tg.start_soon(self._watch_lost, sync)
                for rank, ch in self.shard_channels.items():
                    tg.start_soon(self._watch_rank, rank, ch, lost, tg.cancel_scope)
                await sync.wait_for_explorers(explorers, timeout=timeout)
                self._started.set()
                for step in range(1, steps + 1):
                    try:  # a collective whose rank died is abandoned when the watcher ends the run
                        await anyio.to_thread.run_sync(self.train_step, step, abandon_on_cancel=True)
                        t0 = time.perf_counter()
                        await handle.step_done()
                        waits.append(time.perf_counter() - t0)
                    except (RuntimeError, TrainerRankLostError):
                        with anyio.move_on_after(min(timeout, 30.0)):  # a failed collective: Ray names the rank
                            await anyio.sleep_forever()
                        raise
                    self.version = handle.version
                    self._stepped.set()
                    self._stepped = anyio.Event()
                    await anyio.sleep(step_pause)
                # End with the whole fleet: the restarted explorers reconnect first (bounded).
                await self.wait_for_connections(explorers + rejoins_wanted, timeout=timeout)
                await sync.wait_for_explorers(explorers, timeout=timeout)
                await handle.stop()
                tg.cancel_scope.cancel()
            if lost:
                raise lost[0]
        trained = await anyio.to_thread.run_sync(self.full_digest)
        served = self.serving_statistics()
        return {"digest": trained, "version": handle.version, "rejoins": served.rejoins,
                "joins": served.joins, "trainer_max_wait_s": max(waits), "lost": sorted(self.lost_at),
                "relayed_bytes": sync.shards.relayed_bytes, "patch_bytes": sync.shards.patch_bytes}


@ray.remote(num_cpus=0, resources={"trainer": 1})
class RankN(_Rank, RayEndpoint):
    def __init__(self, rank: int, ranks: int) -> None:
        super().__init__(rank, ranks)
        self.peer: ShardPeer | None = None
        self.routes: list[RayChannel] = []
        self._entered = anyio.Event()

    async def route_connect(self, explorer, channel: str, timeout: float) -> None:
        """An explorer actor opens its direct route to this rank (at every join, restarts included)."""
        with anyio.fail_after(timeout):
            await self._entered.wait()
        ch = RayChannel(explorer, channel, timeout=timeout, out_of_band_bytes=ROUTE_OBJECT_BYTES)
        ch.watch()
        self.routes.append(ch)
        self.peer.serve_route(ch)

    async def run(self, rank0, steps: int, timeout: float, direct: bool) -> dict:
        channel = RayChannel(rank0, timeout=timeout)
        await rank0.shard_connect.remote(ray.get_runtime_context().current_actor, channel.channel, self.rank, timeout)
        channel.watch()
        self.peer = ShardPeer(self.model, channel, rank=self.rank, timeout=timeout, routes=[] if direct else None)
        async with self.peer as peer:
            self._entered.set()
            with anyio.fail_after(timeout):  # serving the explorers' joins meanwhile (before its first step)
                await rank0.wait_started.remote()
            for step in range(1, steps + 1):
                await anyio.to_thread.run_sync(self.train_step, step)
                await peer.step_done()
        await anyio.to_thread.run_sync(self.full_digest)  # rank 0 gathers the model: every rank takes part
        cache = peer.server.cache
        stats = [ch.statistics() for ch in self.routes]
        return {"rank": self.rank, "builds": peer.server.builds, "patch_bytes": peer.server.patch_bytes,
                "sent_patch_bytes": None if cache is None else cache.sent_patch_bytes,
                "answered_bytes": sum(s.bytes_sent for s in stats), "object_bytes_put": sum(s.bytes_put for s in stats),
                "object_bytes_reused": sum(s.bytes_reused for s in stats)}


@ray.remote(num_cpus=0, max_restarts=1, resources={"explorer": 1})
class Rollout(ExplorerActor):
    def __init__(self, name: str) -> None:
        torch.set_num_threads(1)
        self.name = name

    def node(self) -> str:
        return ray.get_runtime_context().get_node_id()

    async def run(self, trainer, ranks: list, names: list, step_pause: float, timeout: float) -> dict:
        model = rollout_model()
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
        state = model.state_dict()
        return {"digest": digest({k: state[k] for k in names}), "version": explorer.version, "node": self.node(),
                "fetched": dict(routes.received_bytes), "packet_bytes": routes.packet_bytes}


async def run(args: argparse.Namespace, cluster: Cluster, workers: list) -> dict:
    t0 = time.perf_counter()
    config = {"method": "nccl", "style": "trainer_driven", "sync_weight_no_wait": True,
              "sync_timeout": args.sync_timeout, "delivery_timeout": args.sync_timeout}
    rank0 = Rank0.remote(args.ranks)
    others = [RankN.remote(r, args.ranks) for r in range(1, args.ranks)]
    address, port = await rank0.master.remote()  # the trainer's process group: rank 0's address, to every rank
    with anyio.fail_after(args.timeout):
        inits = [r.init_group.remote(address, port, args.timeout) for r in [rank0, *others]]
        param_names = [await ref for ref in inits][0]
    names = [f"explorer-{i}" for i in range(args.explorers)]
    explorers = {n: Rollout.options(scheduling_strategy="SPREAD").remote(n) for n in names}
    nodes = {n: await e.node.remote() for n, e in explorers.items()}
    victim_node = nodes[names[0]]
    on_victim = [n for n in names if nodes[n] == victim_node]
    results: dict = {}
    failed: dict = {}
    removed_at = killed_at = None

    async def explore(name: str) -> None:
        routed = others if args.routes == "direct" else []
        try:
            results[name] = await call_with_restarts(explorers[name], "run", rank0, routed, param_names,
                                                     args.step_pause, args.timeout, max_restarts=1,
                                                     restart_timeout=args.timeout)
        except Exception as exc:
            if not args.kill_rank_at:
                raise
            failed[name] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1][:200]}"

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
            if args.kill_rank_at:
                await rank0.wait_version.remote(args.kill_rank_at)
                killed_at = time.time()
                ray.kill(others[-1], no_restart=True)
                try:
                    await training
                    raise AssertionError(f"the trainer went on without rank {args.ranks - 1}")
                except ray.exceptions.RayTaskError as exc:
                    ended = time.time() - killed_at
                    cause = exc.cause if isinstance(getattr(exc, "cause", None), Exception) else exc
                for actor in [rank0, *others[:-1], *explorers.values()]:  # the run is over: end every actor
                    ray.kill(actor, no_restart=True)
                tg.cancel_scope.cancel()
                return {"nodes": args.nodes, "ranks": args.ranks, "explorers": args.explorers, "fsdp2": True,
                        "killed_rank_at": args.kill_rank_at, "trainer_rank_lost": getattr(cause, "rank", None),
                        "error": f"{type(cause).__name__}: {str(cause).splitlines()[0]}",
                        "rank_lost_end_s": round(ended, 3), "seconds": round(time.perf_counter() - t0, 2)}
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
            "seconds": round(time.perf_counter() - t0, 2), "fsdp2": True, "routes": args.routes,
            "relayed_bytes": trained["relayed_bytes"],
            "rank_patch_bytes": [trained["patch_bytes"]] + [r["patch_bytes"] for r in shard_results],
            "rank_sent_bytes": [sum(r.value["packet_bytes"] for r in results.values())]
            + [r["sent_patch_bytes"] for r in shard_results],
            "rank_route_bytes": [{k: r[k] for k in ("answered_bytes", "object_bytes_put", "object_bytes_reused")}
                                 for r in shard_results],
            "on_removed_node": on_victim, "lost": trained["lost"],
            "final_nodes": {n: r.value["node"][:8] for n, r in results.items()},
            "surviving_nodes": sorted(w.node_id for w in workers if removed_at and w.node_id != victim_node)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=3, help="Ray nodes on this machine: a head and explorer nodes")
    parser.add_argument("--ranks", type=int, default=2, help="trainer ranks (Ray actors on the head node; one "
                        "FSDP2 process group)")
    parser.add_argument("--explorers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--remove-node-at", type=int, default=0, metavar="VERSION",
                        help="remove the first explorer's node when the trainer reaches this version (0: never)")
    parser.add_argument("--kill-rank-at", type=int, default=0, metavar="VERSION",
                        help="kill the last trainer rank's actor when the trainer reaches this version (0: never); "
                        "the run ends with TrainerRankLostError naming it")
    parser.add_argument("--sync-timeout", type=float, default=10.0, help="synchronizer sync_timeout and "
                        "delivery_timeout: the longest the trainer waits on an explorer")
    parser.add_argument("--timeout", type=float, default=120.0, help="bound on every other wait (and the trainer "
                        "group's gloo timeout)")
    parser.add_argument("--step-pause", type=float, default=0.3, help="seconds each loop yields per step")
    parser.add_argument("--routes", choices=("direct", "relay"), default="direct",
                        help="direct: every rank sends its own parts to the explorers; relay: through rank 0")
    parser.add_argument("--json", default=None, help="also write the result to this file")
    args = parser.parse_args(argv)
    if args.nodes < 3 and args.remove_node_at:
        parser.error("--remove-node-at needs --nodes 3 or more (the head, the node removed, one that survives)")
    if args.nodes < 2:
        parser.error("--nodes must be at least 2 (the head for the trainer, a node for the explorers)")
    if args.ranks < 1 or args.explorers < 1:
        parser.error("--ranks and --explorers must be at least 1")
    for flag, at in (("--remove-node-at", args.remove_node_at), ("--kill-rank-at", args.kill_rank_at)):
        if at and not 0 < at < args.steps:
            parser.error(f"{flag} must be in 1 .. {args.steps - 1}")
    if args.kill_rank_at and (args.ranks < 2 or args.remove_node_at):
        parser.error("--kill-rank-at needs --ranks 2 or more (rank 0 runs the synchronizer) and no --remove-node-at")
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
    if args.kill_rank_at:
        return 3
    ok = result["bit_exact"] and result["trainer_max_wait_s"] <= result["sync_timeout"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
