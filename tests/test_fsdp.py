"""W17: an FSDP2 (``fully_shard``) sender whose state dict holds DTensors, patched to a plain
receiver. Two gloo processes on CPU; rank 0 is the active sender and also hosts the receiver,
rank 1 only takes part in the collectives that gather the DTensors."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from helpers import bits as _bits

WORLD = 2
STEPS = 3

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="needs torch.distributed with gloo")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]




class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d, 3 * d)  # 3*d rows: not a multiple of the world size for d = 7
        self.out = nn.Linear(3 * d, d)
        self.norm = nn.LayerNorm(d)

    def forward(self, x):
        return self.norm(x + self.out(torch.relu(self.fc(x))))


class Net(nn.Module):
    def __init__(self, d: int = 7) -> None:
        super().__init__()
        self.emb = nn.Embedding(33, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(2))
        self.head = nn.Linear(d, 33)
        self.register_buffer("step", torch.tensor(0, dtype=torch.int64))

    def forward(self, idx):
        x = self.emb(idx)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def _full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The gathered (full) state dict; a collective, called by every rank in the same order."""
    from torch.distributed.tensor import DTensor

    out = {}
    for k, v in model.state_dict().items():
        out[k] = (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
    return out


async def _run(rank: int, result_path: str, reverse_receiver: bool) -> None:
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from aiosync.syncers import PatchWeightSyncer, collect_param_names_need_sync
    from aiosync.transports.inproc import inproc_pair

    torch.manual_seed(0)
    model = Net()
    receiver_model = Net().to(torch.bfloat16) if rank == 0 else None
    if receiver_model is not None:
        with torch.no_grad():
            for p in receiver_model.parameters():
                p.fill_(0.5)  # different from the trainer: the bootstrap must fix it
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    sd = model.state_dict()
    assert isinstance(sd["blocks.0.fc.weight"], DTensor), type(sd["blocks.0.fc.weight"])
    names = collect_param_names_need_sync(model)
    assert "blocks.1.out.bias" in names and "step" in names
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95))
    kw = dict(encoding="flat", compression="zstd", init_sync_enabled=True, init_sync_bucket_size=1024,
              recv_timeout=30)
    sender = PatchWeightSyncer(**kw)
    applied = []
    if rank == 0:
        receiver = PatchWeightSyncer(encoding="flat", compression="zstd", recv_timeout=30)
        a, b = inproc_pair(timeout=30)
        rsd = receiver_model.state_dict()
        if reverse_receiver:  # the receiver lists its keys in another order than the sender's state dict
            rsd = dict(reversed(list(rsd.items())))
        await asyncio.gather(sender.init_sender(model.state_dict(), names, a.send, a.recv, is_sender=True),
                             receiver.init_receiver(rsd, b.recv, b.send))
    else:
        sent = []

        async def send(payload):  # a non-sender rank must never send
            sent.append(payload)

        await sender.init_sender(model.state_dict(), names, send, None, is_sender=False)
    full = _full_state(model)
    if rank == 0:
        for k in names:
            assert torch.equal(_bits(full[k].to(torch.bfloat16) if full[k].is_floating_point() else full[k]),
                               _bits(receiver_model.state_dict()[k])), f"bootstrap: {k}"
    changed = []
    for version in range(1, STEPS + 1):
        g = torch.Generator().manual_seed(100 * version + rank)  # each rank its own data
        idx = torch.randint(0, 33, (20,), generator=g)
        loss = model(idx).float().pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        with torch.no_grad():
            model.step += 2**33
        if rank == 0:
            await sender.sync(model.state_dict(), a.send, version)
            applied.append(await receiver.apply(receiver_model, b.recv))
            changed.append(sender.statistics().changed)
        else:
            await sender.sync(model.state_dict(), send, version)
        full = _full_state(model)
        if rank == 0:
            rsd = receiver_model.state_dict()
            for k in names:
                want = full[k].to(torch.bfloat16) if full[k].is_floating_point() else full[k]
                assert want.shape == rsd[k].shape, k
                assert torch.equal(_bits(want), _bits(rsd[k])), f"version {version}: {k} differs"
    if rank == 1:
        assert sent == [], f"rank 1 sent {len(sent)} payloads"
    else:
        assert applied == list(range(1, STEPS + 1))
        assert all(c > 0 for c in changed), changed
        with open(result_path, "w") as f:
            json.dump({"applied": applied, "changed": changed, "keys": len(names)}, f)


def _worker(rank: int, world: int, port: int, result_path: str, reverse_receiver: bool) -> None:
    torch.set_num_threads(1)
    os.environ.setdefault("NUMBA_NUM_THREADS", "1")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    try:
        asyncio.run(_run(rank, result_path, reverse_receiver))
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("reverse_receiver", [False, True], ids=["same-order", "receiver-reordered"])
def test_fsdp2_dtensor_sender_patches_plain_receiver(tmp_path, reverse_receiver):
    result = tmp_path / "result.json"
    ctx = mp.spawn(_worker, args=(WORLD, _free_port(), str(result), reverse_receiver), nprocs=WORLD, join=False)
    deadline = time.monotonic() + 120
    try:
        while not ctx.join(timeout=1.0):
            if time.monotonic() > deadline:
                pytest.fail("FSDP workers did not finish in time")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
                p.join(5)
    data = json.loads(result.read_text())
    assert data["applied"] == list(range(1, STEPS + 1))
    assert all(c > 0 for c in data["changed"])
    assert data["keys"] == len(Net().state_dict())
