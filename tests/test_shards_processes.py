"""Shard-local syncs with real processes (issue 16): an FSDP2 (``fully_shard``) trainer on two
ranks, two explorers in two more processes; gloo on 127.0.0.1, every join bounded.

Every trainer rank snapshots, diffs and encodes its own shard; rank 0 relays rank 1's patch and
both shards of a version reach both explorers in one multicast round. The explorers end
bit-exact, no rank gathered another's shard, each shard was encoded once per version.
``examples/sharded_sync.py`` runs under torchrun here too.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from processes import JOIN_BOUND, join, results, start

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs torch.distributed with gloo"),
]

OP_TIMEOUT = 30.0
ROOT = Path(__file__).resolve().parents[1]
PATCH = {"type": "patch", "patch": {"encoding": "flat", "compression": "zstd",
                                    "init_sync": {"enabled": True, "bucket_size": 4096}}}
RESULTS_TAG = 0x77


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(37, 12)  # 37 rows: uneven shards
        self.fc = torch.nn.Linear(12, 36)
        self.gate = torch.nn.Parameter(torch.ones(1, 12))  # one row: rank 1's piece of it is empty
        self.norm = torch.nn.LayerNorm(12)
        self.register_buffer("steps", torch.tensor(0, dtype=torch.int64))

    def forward(self, idx):
        x = self.emb(idx) * self.gate
        return self.norm(x + self.fc(x)[..., :12])


def _bf16(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16) if t.is_floating_point() else t


def _scenario(rank: int, world: int, out: Path, extra: dict) -> dict:
    import anyio

    from aiosync.coordination import Explorer, Synchronizer
    from aiosync.coordination.shards import SHARD_TAG, ShardPeer
    from aiosync.syncers.patch.shard_layout import shard_layout
    from aiosync.syncers.common.state_dicts import collect_param_names_need_sync, gathered_bytes
    from aiosync.transports.distributed import WeightSyncGroup
    from aiosync.transports.distributed.wire import shared_statistics

    group = WeightSyncGroup.init(backend="gloo", timeout=OP_TIMEOUT)
    fsdp_group = dist.new_group([0, 1], backend="gloo")  # a collective: every rank makes it
    steps = extra["steps"]
    if rank >= 2:
        async def explore() -> dict:
            model = _Net().to(torch.bfloat16)
            t = group.transport(0)
            async with Explorer(f"e{rank}", model, t) as ex:
                while not ex.trainer_stopped:
                    async with ex.lease() as (m, version):
                        assert int(m.steps.item()) == version  # the stamp travels with the weights
                    await ex.step_done()
                    await anyio.sleep(0.005)
            await t.send({k: v for k, v in model.state_dict().items()})
            return {"final": ex.version, "broadcasts": group.multicast.statistics().broadcasts}

        return anyio.run(explore)

    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = _Net()
    fully_shard(model, mesh=DeviceMesh.from_group(fsdp_group, "cpu"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95))
    names = collect_param_names_need_sync(model)

    def train_step(step: int) -> None:
        g = torch.Generator().manual_seed(100 * step + rank)  # each trainer rank its own data
        loss = model(torch.randint(0, 37, (4, 5), generator=g)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        with torch.no_grad():
            model.steps.fill_(step)

    async def rank1() -> dict:
        async with ShardPeer(model, group.transport(0, tag=SHARD_TAG), timeout=OP_TIMEOUT) as peer:
            await anyio.to_thread.run_sync(dist.barrier, fsdp_group)
            encodes0 = shared_statistics().encodes
            for step in range(1, steps + 1):
                await anyio.to_thread.run_sync(train_step, step)
                await peer.step_done()
            encodes = shared_statistics().encodes - encodes0
            builds, snapshot = peer.server.builds, peer.server.snapshot_nbytes
        pieces, _ = shard_layout(model.state_dict(), 1, names)
        await group.transport(0, tag=RESULTS_TAG).send({k: _bf16(v) for k, v in pieces.items()})
        return {"encodes": encodes, "builds": builds, "snapshot": snapshot, "gathered": gathered_bytes()}

    async def rank0() -> dict:
        cfg = dict(method="nccl", style="trainer_driven", sync_timeout=OP_TIMEOUT, delivery_timeout=OP_TIMEOUT)
        async with Synchronizer(cfg, PATCH) as sync:
            trainer = await sync.attach_trainer(model, shard_peers=[group.transport(1, tag=SHARD_TAG)])
            explorer_ends = [group.transport(r) for r in (2, 3)]
            for t in explorer_ends:
                sync.serve_remote(t)
            await sync.wait_for_explorers(2, timeout=OP_TIMEOUT)
            await anyio.to_thread.run_sync(dist.barrier, fsdp_group)  # both trainer ranks start together
            stats0 = shared_statistics()
            for step in range(1, steps + 1):
                await anyio.to_thread.run_sync(train_step, step)
                await trainer.step_done()  # blocking syncs: both explorers take every version together
            await trainer.stop()
            stats1 = shared_statistics()
        finals = [await t.recv() for t in explorer_ends]
        theirs = await group.transport(1, tag=RESULTS_TAG).recv()
        ours, layout0 = shard_layout(model.state_dict(), 0, names)
        exact = []
        rows1 = sync.shards.rows[1]
        for final in finals:
            ok = all(torch.equal(_bf16(t), final[k] if layout0[k][0] is None else final[k].narrow(0, *layout0[k][:2]))
                     for k, t in ours.items())
            ok &= all(torch.equal(t, final[k].narrow(0, *rows1[k])) for k, t in theirs.items())
            exact.append(bool(ok))
        m = sync.metrics()
        return {"exact": exact, "fanout": m["fanout"], "multicast": group.multicast.statistics().__dict__,
                "encodes": stats1.encodes - stats0.encodes, "relayed": stats1.relayed - stats0.relayed,
                "gathered": gathered_bytes(), "rows": sync.shards.rows,
                "delivered": {k: r["delivered"] for k, r in m["explorers"].items()}}

    return anyio.run(rank0 if rank == 0 else rank1)


SCENARIOS = {"fsdp": _scenario}


def test_fsdp2_trainer_on_two_ranks_syncs_shard_locally_to_two_remote_explorers(tmp_path):
    steps = 4
    procs = start(__name__, "fsdp", 4, tmp_path, {"steps": steps})
    join(procs)
    r = results(tmp_path, range(4))
    r0, r1 = r[0], r[1]
    assert r0["exact"] == [True, True] and r[2]["final"] == r[3]["final"] == steps
    assert r0["gathered"] == 0 and r1["gathered"] == 0  # no rank materialised another rank's shard
    assert r0["rows"][1]["emb.weight"] == [19, 18] and "gate" not in r0["rows"][1]  # uneven; an empty piece
    # every shard built and encoded once per version, for both explorers (which live in other processes)
    # (+ each lineage's first packet: explorers that join at once each start one, merged at a later
    # build — which one depends on when each explorer's first delivery ran, so a build or two more)
    lineages = r0["fanout"]["lineages_created"]
    assert steps <= r0["fanout"]["builds"] <= steps + lineages - 1
    assert steps + 1 <= r1["builds"] <= steps + lineages
    assert r1["encodes"] == steps  # rank 1's patches, encoded on rank 1...
    assert r0["relayed"] == 2 * steps  # ...and sent on by rank 0, to both explorers, as the bytes they came in
    assert r0["encodes"] == steps  # rank 0's own shard: one encode per version
    # both shards of a version went to both explorers in one round (one broadcast each) whenever both
    # explorers' deliveries were under way together (on a loaded host one may start after the other
    # was sent, point to point): most versions, and never more rounds than versions
    rounds = r0["fanout"]["multicast_rounds"]
    assert steps // 2 <= rounds <= steps and r0["multicast"]["broadcasts"] == 2 * rounds
    assert r[2]["broadcasts"] == r[3]["broadcasts"] == 2 * rounds


@pytest.mark.skipif(shutil.which("torchrun", path=os.path.dirname(sys.executable)) is None,
                    reason="torchrun is not installed next to this python")
def test_the_sharded_example_runs_under_torchrun(tmp_path):
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    out = tmp_path / "out.json"
    cmd = [torchrun, "--standalone", "--nproc-per-node", "2", str(ROOT / "examples" / "sharded_sync.py"),
           "--explorers", "2", "--steps", "3", "--d-model", "64", "--layers", "2", "--vocab", "101",
           "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=JOIN_BOUND, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(out.read_text())
    assert list(report) == ["ranks", "explorers", "steps", "bit_exact", "gathered_bytes", "encodes_per_version",
                            "sender_sync_bytes_per_rank", "full_snapshot_bytes", "seconds", "routes", "relayed_bytes",
                            "rank_patch_bytes", "rank_sent_bytes", "rank_multicast_rounds", "rank_broadcast_bytes",
                            "rank_round_wait_s", "rank_round_late"]
    # direct routes (the default): rank 1's patches went to the explorers in rank 0's process from rank 1
    assert report["routes"] == "direct" and report["relayed_bytes"] == 0
    for patch, sent in zip(report["rank_patch_bytes"], report["rank_sent_bytes"]):
        assert 0 < sent <= 1.2 * patch * report["explorers"]
    assert report["ranks"] == 2 and report["explorers"] == 2 and report["steps"] == 3
    assert report["bit_exact"] is True and report["gathered_bytes"] == 0
    assert report["encodes_per_version"] <= report["ranks"]


@pytest.mark.skipif(shutil.which("torchrun", path=os.path.dirname(sys.executable)) is None,
                    reason="torchrun is not installed next to this python")
def test_each_rank_multicasts_its_parts_to_explorers_in_processes_of_their_own(tmp_path):
    """Issue 30: two trainer ranks, two explorers in processes of their own, direct routes: rank 1
    answers both explorers' fetches of a patch in one multicast round (its bytes broadcast once,
    not once per explorer); every process ends cleanly (no receive left posted: gloo would abort)."""
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    out = tmp_path / "out.json"
    steps = 3
    cmd = [torchrun, "--standalone", "--nproc-per-node", "4", str(ROOT / "examples" / "sharded_sync.py"),
           "--ranks", "2", "--explorers", "2", "--steps", str(steps), "--d-model", "64", "--layers", "2",
           "--vocab", "101", "--round-grace", "10", "--json", str(out)]  # a loaded host: rounds wait for both
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=JOIN_BOUND, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(out.read_text())
    assert report["bit_exact"] is True and report["relayed_bytes"] == 0
    assert report["rank_multicast_rounds"][1] >= 1 and report["rank_broadcast_bytes"][1] > 0
    # the rounds waited only for explorers due them, who came: none went out at its grace period
    assert report["rank_round_late"] == [None, 0]
