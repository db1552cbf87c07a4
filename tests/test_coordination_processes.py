"""Issue 5 with real processes: gloo on 127.0.0.1, free ports chosen at run time, every join
bounded (a hang is a failure, never a stuck CI job).

* an FSDP2 (``fully_shard``) trainer on two ranks → two explorers, bit-exact, fan-out;
* CHECKPOINT through a shared directory: a reader process never sees a half-written file;
* an explorer that joins late (NCCL method over gloo: the two-way handshake) is bootstrapped,
  then patched like the others;
* an explorer process killed mid-run: the trainer gets an error and keeps serving the other;
* ``examples/distributed_sync.py`` under ``torchrun``.

Workers write their results as JSON; the test process only reads them. Nothing asserts on
elapsed time.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from processes import JOIN_BOUND, join, results, start

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs torch.distributed with gloo"),
]

OP_TIMEOUT = 20.0  # seconds any wait on a peer may take inside the workers
PATCH = {"type": "patch", "patch": {"encoding": "flat", "compression": "zstd", "init_sync": {"enabled": True}}}
ROOT = Path(__file__).resolve().parents[1]


def weights(v: int, n: int = 24) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    w = torch.randn(n, 16, generator=g)
    b = torch.randn(16, generator=g)
    return {"w": w + 0.25 * v, "b": b - 0.5 * v, "stamp": torch.tensor(v, dtype=torch.int64)}


def rollout_model(n: int = 24) -> dict[str, torch.Tensor]:
    return {"w": torch.zeros(n, 16, dtype=torch.bfloat16), "b": torch.zeros(16), "stamp": torch.tensor(-1)}


def holds(model: dict[str, torch.Tensor], v: int) -> bool:
    return all(torch.equal(model[k], t.to(model[k].dtype)) for k, t in weights(v, model["w"].shape[0]).items())


def train_to(state: dict[str, torch.Tensor], v: int) -> None:
    for k, t in weights(v, state["w"].shape[0]).items():
        state[k].copy_(t)


def digest(state) -> str:
    h = hashlib.sha256()
    for key in sorted(state):
        h.update(key.encode())
        h.update(state[key].detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


# ------------------------------------------------------------------ process plumbing

def _wait_for_file(path: Path, bound: float = JOIN_BOUND) -> None:
    deadline = time.monotonic() + bound
    while not path.exists():
        assert time.monotonic() < deadline, f"{path.name} never appeared"
        time.sleep(0.02)


# ------------------------------------------------------------------ scenarios (run in the workers)

class _Net(torch.nn.Module):
    def __init__(self, d: int = 12) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(d, 3 * d)  # 36 rows: sharded across two ranks
        self.out = torch.nn.Linear(3 * d, d)
        self.norm = torch.nn.LayerNorm(d)
        self.register_buffer("steps", torch.tensor(0, dtype=torch.int64))

    def forward(self, x):
        return self.norm(x + self.out(torch.relu(self.fc(x))))


def _train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int, rank: int) -> None:
    """One AdamW step on this trainer rank's own data; the ``steps`` buffer stamps the step."""
    g = torch.Generator().manual_seed(100 * step + rank)
    loss = model(torch.randn(8, 12, generator=g)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    with torch.no_grad():
        model.steps.fill_(step)


def _scenario_fsdp(rank: int, world: int, out: Path, extra: dict) -> dict:
    import anyio

    from aiosync.coordination import Synchronizer
    from aiosync.coordination import Explorer
    from aiosync.syncers import gather_full_state
    from aiosync.transports.distributed import WeightSyncGroup

    group = WeightSyncGroup.init(backend="gloo", timeout=OP_TIMEOUT)
    fsdp_group = dist.new_group([0, 1], backend="gloo")  # a collective: every rank makes it
    steps = extra["steps"]
    if rank >= 2:
        async def explore() -> dict:
            model = _Net().to(torch.bfloat16)
            t = group.transport(0)
            torn = 0
            async with Explorer(f"e{rank}", model, t) as ex:
                first = ex.version
                while not ex.trainer_stopped:
                    async with ex.lease() as (m, version):
                        torn += int(m.steps.item()) != version  # the stamp travels with the weights
                    await ex.step_done()
                    await anyio.sleep(0.005)
            await t.send({"digest": digest(model.state_dict()), "version": ex.version})
            return {"first": first, "final": ex.version, "torn": torn}

        return anyio.run(explore)

    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    torch.manual_seed(0)
    model = _Net()
    fully_shard(model, mesh=DeviceMesh.from_group(fsdp_group, "cpu"))
    assert isinstance(model.state_dict()["fc.weight"], DTensor)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95))

    def train_step(step: int) -> dict:
        _train_step(model, opt, step, rank)
        return gather_full_state(model)  # a collective over the FSDP group, on both ranks

    live = gather_full_state(model)  # version 0; every FSDP rank gathers, in the same order
    if rank == 1:  # the other FSDP rank: trains and gathers in lockstep, sends nothing
        for step in range(1, steps + 1):
            train_step(step)
        return {}

    async def train() -> dict:
        cfg = dict(style="trainer_driven", sync_weight_no_wait=True, sync_timeout=OP_TIMEOUT,
                   delivery_timeout=OP_TIMEOUT)
        async with Synchronizer(cfg, PATCH) as sync:
            trainer = await sync.attach_trainer(live)  # a mapping, updated in place below
            transports = [group.transport(r) for r in (2, 3)]
            for t in transports:
                sync.serve_remote(t)
            await sync.wait_for_explorers(2, timeout=OP_TIMEOUT)
            for step in range(1, steps + 1):
                live.update(await anyio.to_thread.run_sync(train_step, step))
                await trainer.step_done()
                await anyio.sleep(0.01)
            await trainer.stop()
        want = digest({k: (v.to(torch.bfloat16) if v.is_floating_point() else v) for k, v in live.items()})
        reports = [await t.recv() for t in transports]
        m = sync.metrics()
        return {"bit_exact": [r["digest"] == want for r in reports], "versions": [r["version"] for r in reports],
                "final": trainer.version, "builds": m["fanout"]["builds"], "shared": m["fanout"]["shared"],
                "delivered": m["totals"]["delivered"]}

    return anyio.run(train)


def _scenario_checkpoint(rank: int, world: int, out: Path, extra: dict) -> dict:
    import anyio

    from aiosync.coordination import Synchronizer
    from aiosync.coordination import CheckpointFollower
    from aiosync.checkpoints import CheckpointDir

    directory, versions, n = out / "shared", extra["versions"], extra["rows"]
    if rank == 0:  # the trainer: the CHECKPOINT method writes every version to the shared directory
        async def write() -> dict:
            state = weights(0, n)
            cfg = dict(method="checkpoint", checkpoint_dir=str(directory), style="trainer_driven")
            async with Synchronizer(cfg, PATCH) as sync:
                trainer = await sync.attach_trainer(state)
                (out / "first-published").write_text("")
                for v in range(1, versions + 1):
                    train_to(state, v)
                    await trainer.sync_weight(v)
                    await anyio.sleep(0.01)
                await trainer.stop()
            return {"files": sorted(os.listdir(directory)), "run": sync.source.directory.run_id}

        return anyio.run(write)

    # The reader: loads as fast as it can while the writer publishes, and follows the directory.
    _wait_for_file(out / "first-published")
    d = CheckpointDir(directory)
    seen, bad = set(), []
    deadline = time.monotonic() + JOIN_BOUND / 2
    while time.monotonic() < deadline:
        v, tensors = d.load()
        seen.add(v)
        if not all(torch.equal(tensors[k], t) for k, t in weights(v, n).items()):
            bad.append(v)
        if v == versions:
            break

    async def follow() -> dict:
        follower = CheckpointFollower(d, rollout_model(n), poll_interval=0.01)
        held = await follower.wait_for_version(versions, timeout=OP_TIMEOUT)
        async with follower.lease() as (model, version):
            return {"held": held, "holds": holds(model, version)}

    return {"seen": sorted(seen), "bad": bad, **anyio.run(follow)}


def _scenario_late_joiner(rank: int, world: int, out: Path, extra: dict) -> dict:
    import anyio

    from aiosync.coordination import Synchronizer
    from aiosync.coordination import Explorer
    from aiosync.transports.distributed import WeightSyncGroup

    group = WeightSyncGroup.init(backend="gloo", timeout=OP_TIMEOUT)
    steps, join_at = extra["steps"], extra["join_at"]

    if rank == 0:
        async def train() -> dict:
            state = weights(0)
            cfg = dict(method="nccl", style="fixed", sync_timeout=OP_TIMEOUT, delivery_timeout=OP_TIMEOUT)
            async with Synchronizer(cfg, PATCH) as sync:
                trainer = await sync.attach_trainer(state)
                transports = {r: group.transport(r) for r in (1, 2)}
                for t in transports.values():
                    sync.serve_remote(t)
                await sync.wait_for_explorers(1, timeout=OP_TIMEOUT)
                for step in range(1, steps + 1):
                    train_to(state, step)
                    trainer.step = step
                    await trainer.sync_weight(step)  # the handshake: explorers that asked build from it
                    if step == join_at:
                        (out / "go").write_text("")  # the late explorer starts now...
                        await sync.wait_for_explorers(2, timeout=OP_TIMEOUT)  # ...and is served here
                    await anyio.sleep(0.01)
                await trainer.stop()
            m = sync.metrics()["explorers"]
            history = [new.name for _, new in trainer.state.history]
            reports = {r: await t.recv() for r, t in transports.items()}
            return {"reports": {str(r): v for r, v in reports.items()}, "reinits": {k: v["reinits"] for k, v in m.items()},
                    "delivered": {k: v["delivered"] for k, v in m.items()}, "history": history,
                    "final": trainer.version}

        return anyio.run(train)

    async def explore() -> dict:
        if rank == 2:
            while not (out / "go").exists():
                await anyio.sleep(0.02)
        t = group.transport(0)
        applied = []
        async with Explorer(f"e{rank}", rollout_model(), t) as ex:
            applied.append(ex.version)
            while not ex.trainer_stopped:
                await ex.step_done()  # FIXED, interval 1: asks every step (REQUIRE_SYNC until served)
                if ex.version != applied[-1]:
                    applied.append(ex.version)
                await anyio.sleep(0.005)
        await t.send({"applied": applied, "final": ex.version, "holds": holds(ex.slot.model, ex.version)})
        return {}

    return anyio.run(explore)


def _scenario_killed(rank: int, world: int, out: Path, extra: dict) -> dict:
    import anyio

    from aiosync.coordination import Synchronizer
    from aiosync.coordination import Explorer
    from aiosync.transports.distributed import WeightSyncGroup

    group = WeightSyncGroup.init(backend="gloo", timeout=OP_TIMEOUT)

    if rank == 0:
        async def train() -> dict:
            state = weights(0)
            cfg = dict(style="trainer_driven", sync_weight_no_wait=True, sync_timeout=OP_TIMEOUT,
                       delivery_timeout=OP_TIMEOUT)
            failed_in, step = [], 0
            async with Synchronizer(cfg, PATCH) as sync:
                trainer = await sync.attach_trainer(state)
                t1 = group.transport(1)
                sync.serve_remote(t1)
                sync.serve_remote(group.transport(2))
                await sync.wait_for_explorers(2, timeout=OP_TIMEOUT)
                doomed = sync.explorers["e2"]
                deadline = time.monotonic() + JOIN_BOUND / 2
                while doomed.error is None and time.monotonic() < deadline:
                    step += 1
                    train_to(state, step)
                    trainer.step = step
                    result = await trainer.sync_weight(step, wait=True)  # pushed to both, waits for both
                    failed_in += result["failed"]
                    await anyio.sleep(0.02)
                for _ in range(3):  # the trainer goes on with the explorer it has left
                    step += 1
                    train_to(state, step)
                    trainer.step = step
                    result = await trainer.sync_weight(step, wait=True)
                    assert result["handed_to"] == ["e1"] and result["failed"] == [], result
                await trainer.stop()
            report = await t1.recv()
            return {"error": None if doomed.error is None else f"{type(doomed.error).__name__}: {doomed.error}",
                    "status": doomed.status.name, "failed_in": failed_in, "final": trainer.version, "report": report,
                    "last_error": sync.metrics()["explorers"]["e2"]["last_error"]}

        result = anyio.run(train)
        result["lost"] = result.pop("error")
        return result

    async def explore() -> dict:
        t = group.transport(0)
        async with Explorer(f"e{rank}", rollout_model(), t) as ex:
            while not ex.trainer_stopped:
                await ex.step_done()
                if rank == 2 and ex.version is not None and ex.version >= 3:
                    (out / "kill-me").write_text(str(os.getpid()))
                    await anyio.sleep(3600)  # the test kills this process (SIGKILL) now
                await anyio.sleep(0.005)
        await t.send({"final": ex.version, "holds": holds(ex.slot.model, ex.version)})
        return {}

    return anyio.run(explore)


def _scenario_checkpoint_writers(rank: int, world: int, out: Path, extra: dict) -> dict:
    """An FSDP2 trainer on two ranks, CHECKPOINT method with two writers: each rank writes its
    own shard of every version (no rank gathers the other's); rank 0's synchronizer publishes a
    version once both shards are in, to an explorer in its process. Rank 1 holds its shard of
    version 2 back until rank 0 saw that the version is not published without it."""
    import anyio

    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    from aiosync.checkpoints import CheckpointDir, shared_run_id
    from aiosync.coordination import Synchronizer
    from aiosync.syncers import gather_full_state

    dist.init_process_group("gloo")
    run = shared_run_id()  # every writer publishes as one run
    steps, directory = extra["steps"], out / "ckpt"
    torch.manual_seed(0)
    model = _Net()
    fully_shard(model, mesh=DeviceMesh.from_group(dist.group.WORLD, "cpu"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95))

    def train_step(step: int) -> None:
        _train_step(model, opt, step, rank)

    if rank == 1:
        d = CheckpointDir(directory, run_id=run)
        d.publish(model.state_dict(), 0, writer=(1, 2))
        for step in range(1, steps + 1):
            train_step(step)
            if step == 2:
                _wait_for_file(out / "go")
            d.publish(model.state_dict(), step, writer=(1, 2))
        gather_full_state(model)  # a collective: rank 0 gathers too, to check its explorer
        return {"files": sorted(p.name for p in directory.iterdir() if p.name[0] != "."), "run": run}

    async def train() -> dict:
        cfg = dict(method="checkpoint", checkpoint_dir=str(directory), checkpoint_writers=2, style="trainer_driven",
                   sync_timeout=OP_TIMEOUT, delivery_timeout=OP_TIMEOUT)
        held_back = None
        async with Synchronizer(cfg, PATCH) as sync:
            trainer = await sync.attach_trainer(model, run_id=run)  # writer 0: its torch.distributed rank
            explorer = await sync.attach_explorer("e0", _Net().to(torch.bfloat16))
            for step in range(1, steps + 1):
                await anyio.to_thread.run_sync(train_step, step)
                if step != 2:
                    await trainer.step_done()
                    continue
                async with anyio.create_task_group() as tg:
                    tg.start_soon(trainer.step_done)
                    own = directory / f"sync-000000000002.{run}.w00000-of-00002.safetensors"
                    while not own.exists():
                        await anyio.sleep(0.01)
                    held_back = CheckpointDir(directory).newest_version()  # only writer 0's shard of 2 is in
                    (out / "go").write_text("")
            await trainer.stop()
        # leaving the block drained: the explorer holds the final version
        final, got = explorer.version, digest(explorer.slot.model.state_dict())
        full = await anyio.to_thread.run_sync(gather_full_state, model)
        want = digest({k: (v.to(torch.bfloat16) if v.is_floating_point() else v) for k, v in full.items()})
        return {"held_back": held_back, "final": final, "bit_exact": got == want}

    return anyio.run(train)


SCENARIOS = {"fsdp": _scenario_fsdp, "checkpoint": _scenario_checkpoint,
             "late_joiner": _scenario_late_joiner, "killed": _scenario_killed,
             "checkpoint_writers": _scenario_checkpoint_writers}


# ------------------------------------------------------------------ the tests

def test_fsdp2_trainer_to_two_explorers_bit_exact(tmp_path):
    steps = 5
    procs = start(__name__, "fsdp", 4, tmp_path, {"steps": steps})
    join(procs)
    r = results(tmp_path, range(4))
    assert r[0]["final"] == steps and r[0]["versions"] == [steps, steps]
    assert r[0]["bit_exact"] == [True, True]
    assert r[2]["torn"] == 0 and r[3]["torn"] == 0
    assert r[0]["shared"] >= 1 and r[0]["builds"] <= steps  # fan-out: a version is built once


def test_checkpoint_reader_never_sees_a_half_written_file(tmp_path):
    versions = 12
    procs = start(__name__, "checkpoint", 2, tmp_path, {"versions": versions, "rows": 200_000})  # ~13 MB per file
    join(procs)
    r = results(tmp_path, [0, 1])
    assert r[1]["bad"] == []  # every file the reader loaded was whole and consistent
    assert r[1]["seen"][-1] == versions and len(r[1]["seen"]) >= 2
    assert r[1]["held"] == versions and r[1]["holds"]
    files = [n for n in r[0]["files"] if not n.startswith(".hold-")]  # superseded files removed, no temporaries
    assert files == [f"sync-{versions:012d}.{r[0]['run']}.safetensors"]


def test_late_joining_explorer_is_bootstrapped_then_patched(tmp_path):
    steps, join_at = 10, 5
    procs = start(__name__, "late_joiner", 3, tmp_path, {"steps": steps, "join_at": join_at})
    join(procs)
    r = results(tmp_path, range(3))[0]
    early, late = r["reports"]["1"], r["reports"]["2"]
    assert early["final"] == late["final"] == steps and early["holds"] and late["holds"]
    assert late["applied"][0] >= join_at  # bootstrapped at the version current when it joined
    assert len(late["applied"]) >= 2 and r["reinits"]["e2"] == 1  # then patched, never re-bootstrapped
    assert r["delivered"]["e1"] >= steps // 2
    assert "REQUIRE_SYNC" in r["history"]  # NCCL method (over gloo): the two-way handshake


def test_killed_explorer_is_reported_and_the_trainer_serves_the_other(tmp_path):
    procs = start(__name__, "killed", 3, tmp_path)
    try:
        _wait_for_file(tmp_path / "kill-me")
        os.kill(procs[2].pid, signal.SIGKILL)
    finally:
        join({r: p for r, p in procs.items() if r != 2})
        join({2: procs[2]}, bound=5)
    r = results(tmp_path, [0, 1])[0]
    assert r["lost"] is not None and r["status"] == "STOPPED"  # the trainer was told, and went on
    assert r["lost"].startswith(("TransportError", "EndOfStream")), r["lost"]
    assert r["last_error"] and "rank 2" in r["last_error"], r["last_error"]
    assert r["report"]["final"] == r["final"] and r["report"]["holds"]  # the survivor got the end, bit-exact


@pytest.mark.skipif(shutil.which("torchrun", path=os.path.dirname(sys.executable)) is None,
                    reason="torchrun is not installed next to this python")
def test_example_runs_under_torchrun():
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    cmd = [torchrun, "--standalone", "--nproc-per-node", "3", str(ROOT / "examples" / "distributed_sync.py"),
           "--steps", "20"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=JOIN_BOUND, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")][-1]
    report = json.loads(line)
    assert report["explorers"] == 2 and report["final_version"] == 20
    assert report["bit_exact"] is True and report["bytes_sent"] > 0


def test_a_sharded_trainer_whose_ranks_each_write_a_checkpoint_shard(tmp_path):
    steps = 4
    procs = start(__name__, "checkpoint_writers", 2, tmp_path, {"steps": steps})
    join(procs)
    r = results(tmp_path, [0, 1])
    assert r[0]["held_back"] == 1  # version 2 was not published while writer 1's shard was missing
    assert r[0]["final"] == steps and r[0]["bit_exact"]
    assert r[1]["files"] == [f"sync-{steps:012d}.{r[1]['run']}.w0000{i}-of-00002.safetensors" for i in (0, 1)]
