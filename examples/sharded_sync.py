"""A sharded (FSDP2) trainer whose ranks each sync their own shard: nothing is gathered.

    torchrun --standalone --nproc-per-node 2 examples/sharded_sync.py --explorers 2 --steps 10 --json out.json

Every rank trains its shard of a small transformer-shaped model with ``fully_shard`` (gloo on
CPU; real AdamW steps at an RL learning rate). Rank 0 runs the :class:`aiosync.Synchronizer`
(NCCL method: syncs at the trainer's check points; patch sync every step, trainer-driven,
``sync_weight_no_wait``) and attaches the trainer with ``shard_peers``; every other rank runs a
:class:`~aiosync.coordination.shards.ShardPeer`. Each rank keeps the snapshot of its own
shard, diffs and encodes its own shard's patch and sends it straight to every explorer (direct
routes: rank 0 forwards a ref in its place and relays nothing; ``--routes relay``: through rank 0). The explorers (``--explorers``, bfloat16 copies that
roll out while the trainer trains) live in rank 0's process — the same processes as the trainer
(explorers in other processes: ``examples/distributed_sync.py`` and the tests).

At the end every rank hashes its own rows of every tensor (cast to bfloat16) and every explorer
the same rows of its copy; the hashes meet on rank 0, which writes (``--json``) and prints::

    {"ranks": 2, "explorers": 2, "steps": 10, "bit_exact": true, "gathered_bytes": 0,
     "encodes_per_version": 2.0, "sender_sync_bytes_per_rank": ..., "full_snapshot_bytes": ...,
     "seconds": ...}

* ``gathered_bytes``: bytes of other ranks' shards materialised for syncs, on any rank;
* ``encodes_per_version``: shard patches built and encoded per version, all ranks together
  (one per rank: shared by every explorer);
* ``sender_sync_bytes_per_rank``: the most bytes any rank held for syncs (its shard's
  snapshot, the builder's scratch; on rank 0 also the packets the fan-out keeps and the largest
  relayed payload), next to ``full_snapshot_bytes``, the snapshot of the whole model.

The report adds ``routes``, ``relayed_bytes`` (other ranks' bytes rank 0 sent on: 0 with direct
routes), and per rank ``rank_patch_bytes`` (its patches, each encoded once) and ``rank_sent_bytes``
(what it sent the explorers: about ``explorers ×`` its patches).

``--mode gather`` runs the old way for comparison (every rank gathers the full state each step,
rank 0 syncs it); more figures go to stderr.

**Explorers in processes of their own** (``--ranks R``: the first R ranks train, every other rank
is one explorer, over gloo from rank 0 — multicast rounds when several take a version at once)::

    torchrun --standalone --nproc-per-node 5 examples/sharded_sync.py --ranks 2 --explorers 3 \
        --join-late-at 3 --kill-explorer-at 6 --steps 12 --json out.json

``--join-late-at S``: the last explorer joins after train step S, through rank 0's
``wait_for_explorers`` (the other trainer ranks serve its bootstrap meanwhile: they are between
steps). ``--kill-explorer-at S``: the first explorer dies by SIGKILL once it holds version S (its
process is a child of its torchrun worker, so that torchrun sees the worker end cleanly and keeps
the others running); the others carry on. The report adds ``late_joined`` (explorers attached
after the first step), ``killed``, ``survivors`` and ``survivor_max_gap_s`` (the longest a
surviving explorer waited for a version the trainer had published, from its publish to the
explorer holding it or a newer one); ``bit_exact`` is then about the survivors.

With explorers in processes of their own and direct routes, every rank answers the explorers'
fetches of a patch in one multicast round when several take it at once (the patch's bytes
broadcast once over a group of that rank and those explorers): the report adds per rank
``rank_multicast_rounds`` and ``rank_broadcast_bytes``, and per rank but 0 ``rank_round_wait_s``
and ``rank_round_late`` (see :class:`~aiosync.syncers.patch.shards_direct.PartCache`).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import subprocess
import sys
import time

import anyio
import torch
import torch.distributed as dist
from torch import nn

from aiosync.coordination import Explorer, Synchronizer
from aiosync.coordination.shards import SHARD_TAG, ShardPeer
from aiosync.syncers import gather_full_state
from aiosync.syncers.patch.shard_layout import shard_layout
from aiosync.syncers.patch.shards_direct import ROUND_GRACE, ShardRoutes
from aiosync.syncers.common.state_dicts import collect_param_names_need_sync, gathered_bytes
from aiosync.transports.distributed import WeightSyncGroup

#: Point-to-point tags apart from the explorers' channels: rank 0 telling the late explorer to
#: join, and the reports sent to rank 0 at the end (a killed rank rules out collectives).
JOIN_TAG, REPORT_TAG = 0x5A5E, 0x5A5F
#: The channels of direct routes: each explorer's process fetches every rank's parts from that rank.
ROUTE_TAG = 0x5A60


def weight_syncer(bucket: int) -> dict:
    return {"type": "patch", "patch": {"encoding": "flat", "compression": "zstd",
                                       "init_sync": {"enabled": True, "bucket_size": bucket}}}


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.up = nn.Linear(d, 4 * d)
        self.down = nn.Linear(4 * d, d)
        self.norm = nn.LayerNorm(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x + self.down(torch.relu(self.up(x))))


class Net(nn.Module):
    """Embedding rows not divisible by the ranks (uneven shards), a one-row gate (rank 1's shard
    of it is empty), an int64 buffer (whole: rank 0's shard)."""

    def __init__(self, d: int, layers: int, vocab: int) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(layers))
        self.gate = nn.Parameter(torch.ones(1, d))
        self.head = nn.Linear(d, vocab)
        self.register_buffer("steps", torch.zeros((), dtype=torch.int64))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx) * self.gate
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _sha(t: torch.Tensor) -> str:
    t = t.detach()
    t = t.to(torch.bfloat16) if t.is_floating_point() else t
    return hashlib.sha256(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


def rows_digest(state, layout: dict) -> dict:
    """Per key, SHA-256 of the rows ``layout`` names of a full state (bfloat16 for floating tensors)."""
    return {key: _sha(state[key] if first is None else state[key].narrow(0, first, rows))
            for key, (first, rows, _, _) in layout.items()}


def make_trainer(args, fsdp_group):
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = Net(args.d_model, args.layers, args.vocab)
    mesh = DeviceMesh.from_group(fsdp_group, "cpu")
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95))
    rank = dist.get_rank()

    def train_step(step: int) -> None:
        g = torch.Generator().manual_seed(1000 * step + rank)  # each rank its own data
        idx = torch.randint(0, args.vocab, (4, 16), generator=g)
        loss = nn.functional.cross_entropy(model(idx).flatten(0, 1), torch.roll(idx, 1, 1).flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        with torch.no_grad():
            model.steps.fill_(step)

    return model, train_step


async def run(args, group: WeightSyncGroup, fsdp_group) -> dict:
    rank = group.rank
    if rank >= args.ranks:
        return await run_explorer(args, group, rank - args.ranks)
    model, train_step = make_trainer(args, fsdp_group)
    names = collect_param_names_need_sync(model)
    config = {"method": "nccl", "style": "trainer_driven", "sync_weight_no_wait": True,
              "sync_timeout": args.timeout, "delivery_timeout": args.timeout}
    ws = weight_syncer(args.bootstrap_bucket)
    gathered0 = gathered_bytes()
    report: dict = {}
    t0 = time.perf_counter()
    if args.mode == "gather":
        report = await run_gathered(args, rank, fsdp_group, model, train_step, names, config, ws)
    elif rank == 0:
        report = await run_rank0(args, group, fsdp_group, model, train_step, names, config, ws)
    else:
        explorer_ranks = range(args.ranks, group.world_size) if args.ranks < group.world_size else [0]
        routes = [group.transport(x, tag=ROUTE_TAG) for x in explorer_ranks] if args.routes == "direct" else None
        async with ShardPeer(model, group.transport(0, tag=SHARD_TAG), timeout=args.timeout, routes=routes,
                             round_grace=args.round_grace) as peer:
            await anyio.to_thread.run_sync(dist.barrier, fsdp_group)  # every trainer rank starts together
            builds0, build_s0 = peer.server.builds, peer.server.build_s
            for step in range(1, args.steps + 1):
                await anyio.to_thread.run_sync(train_step, step)
                await peer.step_done()
            report["builds"] = peer.server.builds - builds0
            report["build_s"] = (peer.server.build_s - build_s0) / args.steps
            report["held"] = peer.server.peak_bytes
            cache = peer.server.cache  # direct: what it sent each explorer; relayed: its patches, once, to rank 0
            report["patch_bytes"] = peer.server.patch_bytes
            report["sent_bytes"] = cache.sent_patch_bytes if cache is not None else peer.server.patch_bytes
            report["multicast_rounds"] = cache.multicast_rounds if cache is not None else 0
            report["round_wait_s"] = cache.round_wait_s if cache is not None else 0.0
            report["round_late"] = cache.round_late if cache is not None else 0
            report["broadcast_bytes"] = group.multicast.statistics().bytes_broadcast
    report["seconds"] = time.perf_counter() - t0
    report["gathered"] = gathered_bytes() - gathered0
    # bit-exact, and nothing gathered: every rank hashes its own rows, every explorer the same rows
    pieces, layout = shard_layout(model.state_dict(), rank, names)
    report["trainer_rows"] = {key: _sha(t) for key, t in pieces.items()}  # this rank's own rows only
    report["layout"] = layout
    return report


async def run_rank0(args, group, fsdp_group, model, train_step, names, config, ws) -> dict:
    peers = [group.transport(r, tag=SHARD_TAG) for r in range(1, args.ranks)]
    remote = list(range(args.ranks, group.world_size))  # explorer processes (--ranks)
    late = remote[-1] if remote and args.join_late_at else None
    held = 0
    published: dict[int, float] = {}
    late_joined = 0
    fetcher = shard_routes(args, group, here=not remote)  # for explorers in this process
    async with Synchronizer(config, ws) as sync:
        trainer = await sync.attach_trainer(model, shard_peers=peers)
        sync.source.listeners.append(lambda event, v: published.setdefault(v, time.time())
                                     if event == "window_open" and v is not None else None)
        explorers = [await sync.attach_explorer(f"e{i}", rollout_model(args), shard_routes=fetcher)
                     for i in range(0 if remote else args.explorers)]
        for r in remote:
            sync.serve_remote(group.transport(r))
        if remote:
            await sync.wait_for_explorers(len(remote) - (late is not None), timeout=args.timeout)
        await anyio.to_thread.run_sync(dist.barrier, fsdp_group)  # every trainer rank starts together
        shards = sync.shards
        builds0, build_s0 = shards.builds, shards.build_s
        async with anyio.create_task_group() as tg:
            for ex in explorers:
                tg.start_soon(rollouts, ex)
            for step in range(1, args.steps + 1):
                await anyio.to_thread.run_sync(train_step, step)
                await trainer.step_done()
                held = max(held, sync.fanout.held_bytes)
                if late is not None and step == args.join_late_at:  # between two steps, as documented
                    before = {n for n, s in sync.explorers.items() if s.open}
                    await group.transport(late, tag=JOIN_TAG).send({"join": step})
                    now = await sync.wait_for_explorers(len(before) + 1, timeout=args.timeout)
                    late_joined = len(set(now) - before)
            await trainer.stop()
        builds, build_s = shards.builds - builds0, (shards.build_s - build_s0) / args.steps
        lost = sorted(n for n, s in sync.explorers.items() if s.lost)
    await fetcher.aclose()  # the other ranks stop serving this process's routes
    m = sync.metrics()
    print(json.dumps({"rank0": {"fanout": m["fanout"], "relayed_bytes": shards.relayed_bytes,
                                "relayed_peak": shards.relayed_peak, "shard_peak_bytes": shards.peak_bytes,
                                "fanout_held_peak": held,
                                "explorers": {k: {f: r[f] for f in ("delivered", "reinits", "shared", "bytes_sent")}
                                              for k, r in m["explorers"].items()}}}), file=sys.stderr)
    return {"builds": builds, "build_s": build_s, "held": shards.peak_bytes + held + shards.relayed_peak,
            "explorer_rows": [ex.slot.model.state_dict() for ex in explorers], "published": published,
            "late_joined": late_joined, "lost": lost, "relayed_bytes": shards.relayed_bytes,
            "patch_bytes": shards.patch_bytes, "packet_bytes": fetcher.packet_bytes,
            "multicast_rounds": m["fanout"]["multicast_rounds"],
            "broadcast_bytes": group.multicast.statistics().bytes_broadcast}


def shard_routes(args, group, here: bool = True) -> ShardRoutes:
    """An explorer process's channels to every trainer rank but 0 (direct routes), or none (relayed,
    or no explorer ``here``: it only counts what arrives from rank 0)."""
    ranks = range(1, args.ranks) if args.routes == "direct" and here else ()
    return ShardRoutes({r: group.transport(r, tag=ROUTE_TAG) for r in ranks}, timeout=args.timeout)


async def run_explorer(args, group: WeightSyncGroup, k: int) -> dict:
    """An explorer in a process of its own (``--ranks``): rolls out with the newest weights it has,
    records when it first rolled out on each version; the late one joins when rank 0 says so; the
    victim dies."""
    late = args.join_late_at and group.rank == group.world_size - 1
    victim = args.kill_explorer_at and k == 0
    if late:
        with anyio.fail_after(args.timeout * 4):
            await group.transport(0, tag=JOIN_TAG).recv()
    arrived: dict[int, float] = {}  # when each version was first rolled out on
    fetcher = shard_routes(args, group)
    async with Explorer(f"x{k}", rollout_model(args), group.transport(0), connect_timeout=args.timeout,
                        shard_routes=fetcher) as ex:
        g = torch.Generator().manual_seed(7 + k)
        while not ex.trainer_stopped:
            async with ex.lease() as (model, version):
                arrived.setdefault(version, time.time())
                if victim and version >= args.kill_explorer_at:
                    os.kill(os.getpid(), signal.SIGKILL)  # dies with its sockets open, mid-run
                idx = torch.randint(0, model.emb.num_embeddings, (2, 8), generator=g)
                await anyio.to_thread.run_sync(lambda: model(idx).argmax(-1))
            await ex.step_done()
    arrived.setdefault(ex.version, time.time())
    await fetcher.aclose()
    return {"explorer": f"x{k}", "late": bool(late), "arrived": arrived, "version": ex.version,
            "state": ex.slot.model.state_dict(), "packet_bytes": fetcher.packet_bytes}


async def run_gathered(args, rank, fsdp_group, model, train_step, names, config, ws) -> dict:
    """The old way: every rank gathers the full state each step; rank 0 syncs the gathered copy."""
    live = gather_full_state(model, names)
    full = sum(t.numel() * t.element_size() for t in live.values())  # the gathered copy every rank holds
    gather_s = 0.0

    def gather() -> dict:
        nonlocal gather_s
        t0 = time.perf_counter()
        out = gather_full_state(model, names)
        gather_s += time.perf_counter() - t0
        return out

    if rank != 0:
        await anyio.to_thread.run_sync(dist.barrier, fsdp_group)
        for step in range(1, args.steps + 1):
            await anyio.to_thread.run_sync(train_step, step)
            await anyio.to_thread.run_sync(gather)
        return {"builds": 0, "build_s": gather_s / args.steps, "held": full}
    async with Synchronizer(config, ws) as sync:
        trainer = await sync.attach_trainer(live)
        explorers = [await sync.attach_explorer(f"e{i}", rollout_model(args)) for i in range(args.explorers)]
        await anyio.to_thread.run_sync(dist.barrier, fsdp_group)
        builds0 = sync.fanout.builds
        async with anyio.create_task_group() as tg:
            for ex in explorers:
                tg.start_soon(rollouts, ex)
            for step in range(1, args.steps + 1):
                await anyio.to_thread.run_sync(train_step, step)
                live.update(await anyio.to_thread.run_sync(gather))
                await trainer.step_done()
            await trainer.stop()
        lineage = sync.fanout.lineages[0] if sync.fanout.lineages else None
        snap = 0 if lineage is None else lineage.sender.snapshot.nbytes + lineage.sender.snapshot.scratch_bytes
        builds = sync.fanout.builds - builds0
        rows = sync.metrics()["explorers"].values()
        build_s = sum(r["build_s"]["total"] for r in rows) / max(1, builds)
    # the copy published each version (MEMORY would copy it; NCCL reads the gathered tensors), the snapshot
    held = snap + full + sync.fanout.held_bytes
    return {"builds": builds, "build_s": gather_s / args.steps + build_s, "held": held,
            "explorer_rows": [ex.slot.model.state_dict() for ex in explorers]}


def rollout_model(args) -> nn.Module:
    model = Net(args.d_model, args.layers, args.vocab).to(torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()  # the bootstrap must bring it to the trainer's weights
    return model


async def rollouts(explorer) -> None:
    g = torch.Generator().manual_seed(7)
    while not explorer.trainer_stopped:
        async with explorer.lease() as (model, version):
            idx = torch.randint(0, model.emb.num_embeddings, (2, 8), generator=g)
            await anyio.to_thread.run_sync(lambda: model(idx).argmax(-1))
        await explorer.step_done()


def survivor_gap(published: dict, arrived: dict) -> float:
    """The longest a survivor waited for a version the trainer published while it was attached:
    from the publish to the survivor holding that version or a newer one."""
    start = min(arrived.values())
    gaps = []
    for v, t_pub in published.items():
        if t_pub < start:
            continue
        held = [t for w, t in arrived.items() if w >= v]
        if held:
            gaps.append(max(0.0, min(held) - t_pub))
    return max(gaps, default=0.0)


def summarize(args, reports: list[dict], explorer_states: list) -> dict:
    elems = {}
    for r in reports:
        for key, (first, rows, shape, dtype) in r["layout"].items():
            elems[key] = (shape, dtype)
    full_snapshot = 0
    for shape, dtype in elems.values():
        n = 1
        for s in shape:
            n *= s
        full_snapshot += n * (2 if "float" in dtype else getattr(torch, dtype).itemsize)
    bit_exact = True
    for model_state in explorer_states:
        for r in reports:
            bit_exact &= rows_digest(model_state, r["layout"]) == r["trainer_rows"]
    return {"ranks": len(reports), "explorers": args.explorers, "steps": args.steps, "bit_exact": bool(bit_exact),
            "gathered_bytes": int(sum(r["gathered"] for r in reports)),
            "encodes_per_version": sum(r["builds"] for r in reports) / args.steps,
            "sender_sync_bytes_per_rank": int(max(r["held"] for r in reports)),
            "full_snapshot_bytes": int(full_snapshot), "seconds": round(max(r["seconds"] for r in reports), 3)}


def routes_report(args, trainers: list[dict], explorers: list[dict]) -> dict:
    """Who sent what to the explorers: ``relayed_bytes`` (other ranks' bytes rank 0 sent on),
    per rank its patches (``rank_patch_bytes``: each encoded once) and what it sent
    (``rank_sent_bytes``: rank 0 the sync packets every explorer got from it; another rank the parts
    every explorer fetched from it — or, relayed, its patches once, to rank 0), and per rank its
    multicast rounds (``rank_multicast_rounds``: rank 0 its sync packets', another rank its
    patches' — answered to several explorers' processes at once) and the bytes it broadcast in
    them (``rank_broadcast_bytes``: sent once however many explorers took them); per rank but 0
    the seconds its rounds' first fetches waited for the other explorers due them, in all
    (``rank_round_wait_s``), and its rounds that went out without a due explorer after the grace
    period (``rank_round_late``); rank 0's rounds are the fan-out's (``null`` there)."""
    if args.mode == "gather":
        return {}
    rank0 = trainers[0]
    return {"routes": args.routes, "relayed_bytes": int(rank0["relayed_bytes"]),
            "rank_patch_bytes": [int(r["patch_bytes"]) for r in trainers],
            "rank_sent_bytes": [int(rank0["packet_bytes"] + sum(e["packet_bytes"] for e in explorers))]
            + [int(r["sent_bytes"]) for r in trainers[1:]],
            "rank_multicast_rounds": [int(r["multicast_rounds"]) for r in trainers],
            "rank_broadcast_bytes": [int(r["broadcast_bytes"]) for r in trainers],
            "rank_round_wait_s": [None] + [round(r["round_wait_s"], 4) for r in trainers[1:]],
            "rank_round_late": [None] + [int(r["round_late"]) for r in trainers[1:]]}


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--explorers", type=int, default=2,
                        help="explorers: in rank 0's process, or (--ranks) one per process after the trainer ranks")
    parser.add_argument("--ranks", type=int, default=None,
                        help="trainer ranks (default: every process); the other processes are explorers")
    parser.add_argument("--join-late-at", type=int, default=0, metavar="STEP",
                        help="with --ranks: the last explorer joins after this train step (wait_for_explorers)")
    parser.add_argument("--kill-explorer-at", type=int, default=0, metavar="VERSION",
                        help="with --ranks: the first explorer dies by SIGKILL once it holds this version")
    parser.add_argument("--steps", type=int, default=10, help="train steps; a patch sync after each")
    parser.add_argument("--d-model", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=1001, help="embedding rows (odd: uneven shards)")
    parser.add_argument("--lr", type=float, default=2e-6, help="AdamW learning rate (RL range)")
    parser.add_argument("--bootstrap-bucket", type=int, default=1 << 20, help="bytes per bootstrap bucket")
    parser.add_argument("--mode", choices=("shard", "gather"), default="shard")
    parser.add_argument("--routes", choices=("direct", "relay"), default="direct",
                        help="direct: every rank sends its own parts to the explorers; relay: through rank 0")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds any wait on a peer may take")
    parser.add_argument("--round-grace", type=float, default=ROUND_GRACE, metavar="S",
                        help="ShardPeer(round_grace=S): the most a rank's multicast round waits for a due explorer")
    parser.add_argument("--json", metavar="PATH", help="write the result here too")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)  # an explorer rank's own process
    args = parser.parse_args(argv)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    args.ranks = world if args.ranks is None else args.ranks
    problems = []
    if not 1 <= args.ranks <= world:
        problems.append(f"--ranks {args.ranks} must be between 1 and the {world} processes")
    elif args.ranks < world and args.explorers != world - args.ranks:
        problems.append(f"--explorers {args.explorers} with --ranks {args.ranks} needs {args.ranks + args.explorers} "
                        f"processes (--nproc-per-node), got {world}")
    if (args.join_late_at or args.kill_explorer_at) and args.ranks == world:
        problems.append("--join-late-at and --kill-explorer-at need explorers in processes of their own (--ranks)")
    for flag, at in (("--join-late-at", args.join_late_at), ("--kill-explorer-at", args.kill_explorer_at)):
        if at and not 0 < at < args.steps:
            problems.append(f"{flag} {at} must be a step in 1 .. {args.steps - 1}")
    if args.join_late_at and args.kill_explorer_at and args.explorers < 3:
        problems.append("--join-late-at with --kill-explorer-at needs --explorers 3 or more (one joins late, one "
                        "dies, one survives)")
    if args.mode == "gather" and args.ranks != world:
        problems.append("--mode gather runs explorers in rank 0's process: leave --ranks out")
    if problems:
        parser.error("; ".join(problems))
    return args


def run_child(argv: list[str], args: argparse.Namespace) -> int:
    """An explorer rank's torchrun worker: run its explorer in a child process (the same rank,
    the same environment) and end cleanly when that child is killed on purpose — torchrun stops
    every worker when one dies, and only the explorer is meant to."""
    code = subprocess.run([sys.executable, os.path.abspath(__file__), *argv, "--child"]).returncode
    victim = args.kill_explorer_at and int(os.environ["RANK"]) == args.ranks
    return 0 if victim and code == -signal.SIGKILL else code


async def collect(args, group, report: dict) -> list[dict] | None:
    """Every rank's report to rank 0, point to point (an explorer that was killed sends none);
    rank 0 answers each so that none exits before its report was read."""
    if group.rank != 0:
        t = group.transport(0, tag=REPORT_TAG)
        await t.send(report)
        with anyio.move_on_after(args.timeout):
            await t.recv()
        return None
    victim = args.ranks if args.kill_explorer_at else None
    reports = [report]
    for r in range(1, group.world_size):
        if r != victim:
            t = group.transport(r, tag=REPORT_TAG)
            with anyio.fail_after(args.timeout):
                reports.append(await t.recv())
            await t.send("read")
    return reports


def summarize_processes(args, reports: list[dict], explorer_states: list) -> dict:
    trainers, explorers = reports[:args.ranks], reports[args.ranks:]
    result = summarize(args, trainers, [e["state"] for e in explorers] + explorer_states)
    published = dict(trainers[0]["published"])
    result.update(late_joined=trainers[0]["late_joined"], killed=trainers[0]["lost"], survivors=len(explorers),
                  survivor_max_gap_s=round(max((survivor_gap(published, dict(e["arrived"])) for e in explorers),
                                               default=0.0), 3))
    result.update(routes_report(args, trainers, explorers))
    return result


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse(argv)
    if int(os.environ.get("RANK", "0")) >= args.ranks and not args.child:
        return run_child(argv, args)
    torch.set_num_threads(1)
    os.environ.setdefault("NUMBA_NUM_THREADS", "1")
    group = WeightSyncGroup.init(backend="gloo", timeout=args.timeout)
    fsdp_group = dist.new_group(list(range(args.ranks)), backend="gloo")  # every process calls it, in order
    separate = args.ranks < group.world_size
    try:
        report = anyio.run(run, args, group, fsdp_group)
        explorer_states = report.pop("explorer_rows", [])  # stays here: only the hashes travel
        if separate:  # no collective over every rank: one of them may have been killed
            for key in ("published", "arrived"):
                if key in report:
                    report[key] = sorted(report[key].items())
            reports = anyio.run(collect, args, group, report)
        else:
            reports = [None] * group.world_size
            dist.all_gather_object(reports, report)
        if group.rank == 0:
            if separate:
                result = summarize_processes(args, reports, explorer_states)
            else:
                result = summarize(args, reports, explorer_states)
                result.update(routes_report(args, reports, []))
            line = json.dumps(result)
            print(json.dumps({"mode": args.mode, "build_s_per_version": [round(r["build_s"], 4)
                                                                          for r in reports[:args.ranks]],
                              "held_per_rank": [int(r["held"]) for r in reports[:args.ranks]]}), file=sys.stderr)
            print(line)
            if args.json:
                with open(args.json, "w") as f:
                    f.write(line + "\n")
        if not separate:
            dist.barrier()
    finally:
        group.destroy()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
