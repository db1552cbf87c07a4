"""GPU paths (W13, W12 nvCOMP): CUDA state dicts, CPU and CUDA snapshots, CUDA transport.

Every test here needs a CUDA device and is skipped cleanly without one.
"""

from __future__ import annotations

import asyncio
import copy

import pytest
import torch
from torch import nn

from aiosync.syncers import (BucketWeightSyncer, CompressedWeightPatch, PatchWeightSyncer, WeightPatch,
                             collect_param_names_need_sync)
from aiosync.transports.inproc import inproc_pair
from aiosync.syncers.snapshot.builder import Snapshot
from helpers import bits

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

DEV = "cuda"




def assert_bit_exact(src_sd, dst_sd, keys):
    assert keys
    for k in keys:
        s, d = src_sd[k].detach(), dst_sd[k].detach()
        want = s.to(device=d.device, dtype=d.dtype)
        assert torch.equal(bits(want).cpu(), bits(d).cpu()), f"{k} differs"


def need_nvcomp():
    pytest.importorskip("nvidia.nvcomp", reason="nvidia-nvcomp-cu12 is not installed")


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            self.emb = nn.Embedding(64, 32)
            self.conv = nn.Conv1d(4, 8, 3)
            self.l1 = nn.Linear(32, 300)  # > 255 columns downstream, > 64 elements per row
            self.l2 = nn.Linear(300, 32)
            self.head = nn.Linear(32, 64, bias=False)
            self.extra = nn.Parameter(torch.randn(70))  # trainable but unused: no grad, AdamW skips it
        self.register_buffer("step", torch.tensor(0, dtype=torch.int64))
        self.register_buffer("mask", torch.zeros(9, dtype=torch.bool))

    def forward(self, idx, x):
        h = self.emb(idx) + self.conv(x).mean(dim=(1, 2))[:, None]
        return self.head(self.l2(torch.relu(self.l1(h))))


def train_step(model: Net, opt, step: int) -> None:
    g = torch.Generator().manual_seed(step)
    idx = torch.randint(0, 64, (16,), generator=g).to(model.emb.weight.device)
    x = torch.randn(16, 4, 12, generator=g).to(model.emb.weight.device)
    loss = model(idx, x).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    with torch.no_grad():
        model.step += 2**33
        model.mask[step % 9] ^= True
        if step == 2:  # B2 on the GPU path: NaN and -0.0 arrive bit-exact
            model.extra[0] = float("nan")
            model.extra[1] = -0.0
            model.extra[69] = float("-inf")


async def run_patch_round_trip(sender_kw, receiver_kw, src_device, dst_device, dst_dtype=torch.bfloat16,
                               versions=(1, 2, 3)):
    src = Net().to(src_device)
    dst = copy.deepcopy(src).to(device=dst_device, dtype=dst_dtype)
    names = collect_param_names_need_sync(src)
    opt = torch.optim.AdamW(src.parameters(), lr=1e-4, betas=(0.9, 0.95))
    s = PatchWeightSyncer(**sender_kw)
    r = PatchWeightSyncer(**receiver_kw)
    a, b = inproc_pair(timeout=60)
    sent = []

    async def send(p):
        sent.append(p)
        await a.send(p)

    await asyncio.gather(s.init_sender(src.state_dict(), names, send, a.recv),
                         r.init_receiver(dst.state_dict(), b.recv, b.send))
    for version in versions:
        train_step(src, opt, version)
        await s.sync(src.state_dict(), send, version)
        assert await r.apply(dst, b.recv) == version
        assert s.statistics().changed > 0
        assert_bit_exact(src.state_dict(), dst.state_dict(), names)
    return s, r, sent


@pytest.mark.parametrize("dst_device", ["cpu", DEV])
@pytest.mark.parametrize("compression", ["none", "zstd"])
@pytest.mark.parametrize("encoding", ["coo", "flat"])
@pytest.mark.parametrize("snapshot_device", ["cpu", DEV])
async def test_cuda_state_dict_patch(snapshot_device, encoding, compression, dst_device):
    kw = dict(snapshot_device=snapshot_device, encoding=encoding, compression=compression)
    s, _, sent = await run_patch_round_trip(kw, dict(encoding=encoding, compression=compression), DEV, dst_device)
    assert s.snapshot.device.type == torch.device(snapshot_device).type
    if snapshot_device == "cpu":
        # W13: the CPU snapshot of a CUDA model is pinned, so copies to and from it are asynchronous
        assert s.snapshot.tensor(0).is_pinned()
    want = WeightPatch if compression == "none" else CompressedWeightPatch
    assert all(type(p) is want for p in sent if isinstance(p, (WeightPatch, CompressedWeightPatch)))


@pytest.mark.parametrize("encoding", ["coo", "flat"])
@pytest.mark.parametrize("snapshot_device", ["cpu", DEV])
async def test_cuda_transport_device_without_compression(snapshot_device, encoding):
    kw = dict(snapshot_device=snapshot_device, transport_device=DEV, encoding=encoding)
    _, _, sent = await run_patch_round_trip(kw, dict(encoding=encoding), DEV, DEV)
    patches = [p for p in sent if isinstance(p, WeightPatch)]
    assert patches and all(p.values.is_cuda for p in patches)


@pytest.mark.parametrize("compression", ["nvcomp_lz4", "nvcomp_zstd"])
@pytest.mark.parametrize("encoding", ["coo", "flat"])
@pytest.mark.parametrize("snapshot_device", ["cpu", DEV])
async def test_nvcomp_round_trip(snapshot_device, encoding, compression):
    need_nvcomp()
    kw = dict(snapshot_device=snapshot_device, transport_device=DEV, encoding=encoding, compression=compression)
    rkw = dict(transport_device=DEV, encoding=encoding, compression=compression)
    _, _, sent = await run_patch_round_trip(kw, rkw, DEV, DEV)
    patches = [p for p in sent if isinstance(p, CompressedWeightPatch)]
    assert patches and all(p.codec == compression for p in patches)


@pytest.mark.parametrize("compression", ["nvcomp_lz4", "nvcomp_zstd"])
async def test_nvcomp_from_cpu_state_dict_to_cpu_receiver(compression):
    need_nvcomp()
    kw = dict(transport_device=DEV, encoding="flat", compression=compression)
    await run_patch_round_trip(kw, dict(transport_device=DEV, encoding="flat", compression=compression), "cpu", "cpu")


async def test_cuda_same_dtype_fp32_round_trip_and_init_sync():
    kw = dict(snapshot_device="cpu", encoding="flat", compression="zstd", init_sync_enabled=True)
    src = Net().to(DEV)
    dst = Net().to(DEV)
    with torch.no_grad():
        for p in dst.parameters():
            p.add_(1.0)  # receiver starts elsewhere; the bootstrap fixes it
    names = collect_param_names_need_sync(src)
    s, r = PatchWeightSyncer(**kw), PatchWeightSyncer(encoding="flat", compression="zstd")
    a, b = inproc_pair(timeout=60)
    await asyncio.gather(s.init_sender(src.state_dict(), names, a.send, a.recv),
                         r.init_receiver(dst.state_dict(), b.recv, b.send))
    assert_bit_exact(src.state_dict(), dst.state_dict(), list(src.state_dict()))
    opt = torch.optim.AdamW(src.parameters(), lr=1e-3)
    for version in (1, 2, 3):
        train_step(src, opt, version)
        await s.sync(src.state_dict(), a.send, version)
        assert await r.apply(dst, b.recv) == version
        assert_bit_exact(src.state_dict(), dst.state_dict(), names)


@pytest.mark.parametrize("snap_dtype", [torch.bfloat16, torch.float32, torch.int64, torch.bool])
def test_cuda_builder_matches_cpu_numba_builder(snap_dtype):
    g = torch.Generator().manual_seed(0)
    shapes = [(4097,), (33, 65), (3, 5, 7), ()]
    if snap_dtype == torch.bool:
        base = [torch.rand(s, generator=g) > 0.5 for s in shapes]
    elif snap_dtype == torch.int64:
        base = [torch.randint(0, 50, s, generator=g) for s in shapes]
    else:
        base = [torch.randn(s, generator=g) for s in shapes]
    cpu = Snapshot("cpu")
    gpu_snap = Snapshot(DEV)
    pinned = Snapshot("cpu")  # W13: CPU snapshot diffed against CUDA tensors
    dtypes = [snap_dtype] * len(shapes)
    cpu.load(base, dtypes)
    gpu_snap.load([t.to(DEV) for t in base], dtypes)
    pinned.load([t.to(DEV) for t in base], dtypes)
    for step in range(3):
        cur = [t.clone() for t in base]
        for t in cur:
            n = t.numel()
            idx = torch.randperm(n, generator=g)[: max(1, n // (2 + 10 * step))]
            if t.dtype == torch.bool:
                t.view(-1)[idx] = ~t.view(-1)[idx]
            elif t.dtype == torch.int64:
                t.view(-1)[idx] += 1
            else:
                t.view(-1)[idx] += 1e-3
        d_cpu = cpu.diff(cur)
        d_gpu = gpu_snap.diff([t.to(DEV) for t in cur], "cpu")
        torch.cuda.synchronize()
        d_pin = pinned.diff([t.to(DEV) for t in cur], "cpu")
        if pinned.staged_event is not None:
            pinned.staged_event.synchronize()
        for other in (d_gpu, d_pin):
            assert [d.slot for d in other] == [d.slot for d in d_cpu]
            for x, y in zip(d_cpu, other):
                assert torch.equal(x.positions, y.positions.cpu())
                assert torch.equal(x.new_bits, y.new_bits.cpu()) and torch.equal(x.old_bits, y.old_bits.cpu())
        for i in range(len(shapes)):
            assert torch.equal(bits(cpu.tensor(i)), bits(gpu_snap.tensor(i)).cpu())
            assert torch.equal(bits(cpu.tensor(i)), bits(pinned.tensor(i)))  # write-back finished
        base = cur
    for snap in (cpu, gpu_snap, pinned):
        snap.close()


@pytest.mark.parametrize("bucket_dtype", [None, "bfloat16"])
async def test_bucket_cuda_device(bucket_dtype):
    src = Net().to(DEV)
    dst = Net().to(DEV)
    with torch.no_grad():
        for p in dst.parameters():
            p.zero_()
    s = BucketWeightSyncer(bucket_size=4096, bucket_dtype=bucket_dtype, bucket_device=DEV)
    r = BucketWeightSyncer(bucket_size=4096, bucket_dtype=bucket_dtype)
    a, b = inproc_pair(timeout=60)
    await s.init_sender(src.state_dict(), None, a.send)
    await r.init_receiver(dst.state_dict(), b.recv)
    await s.sync(src.state_dict(), a.send, 2**33)
    assert await r.apply(dst, b.recv) == 2**33
    for k, v in src.state_dict().items():
        want = v.to(getattr(torch, bucket_dtype)) if (bucket_dtype and v.is_floating_point()) else v
        assert torch.equal(bits(want.to(dst.state_dict()[k].dtype)), bits(dst.state_dict()[k])), k


# ------------------------------------------------------------------ issue 18: device and stream

def need_gpus(n: int):
    if torch.cuda.device_count() < n:
        pytest.skip(f"needs {n} CUDA devices, found {torch.cuda.device_count()}")


async def test_a_rank_on_cuda_1_never_touches_cuda_0():
    """Item 1: with the rank's device set to cuda:1, a bare ``cuda`` snapshot and transport device
    mean cuda:1 in every worker thread: nothing is allocated on cuda:0."""
    need_gpus(2)
    torch.cuda.set_device(1)
    try:
        before = torch.cuda.memory_allocated(0)
        kw = dict(snapshot_device="cuda", transport_device="cuda", encoding="flat", compression="none")
        s, r, sent = await run_patch_round_trip(kw, dict(encoding="flat"), "cuda:1", "cuda:1")
        assert s.snapshot.device == torch.device("cuda", 1)
        assert all(p.values.device == torch.device("cuda", 1) for p in sent if isinstance(p, WeightPatch))
        assert torch.cuda.memory_allocated(0) == before
    finally:
        torch.cuda.set_device(0)


async def test_a_trainer_writing_on_a_side_stream_is_read_after_its_writes():
    """Item 2, sender: the trainer updates its weights on a side stream and syncs without a host
    sync; the build runs on that stream (carried into the worker), so it sees the update."""
    src = Net().to(DEV)
    dst = copy.deepcopy(src).to(dtype=torch.bfloat16)
    names = collect_param_names_need_sync(src)
    s, r = PatchWeightSyncer(snapshot_device=DEV, encoding="flat"), PatchWeightSyncer(encoding="flat")
    a, b = inproc_pair(timeout=60)
    await asyncio.gather(s.init_sender(src.state_dict(), names, a.send, a.recv),
                         r.init_receiver(dst.state_dict(), b.recv, b.send))
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(200_000_000)  # the update is queued behind ~0.1 s of GPU work
        with torch.no_grad():
            for p in src.parameters():
                p.add_(1.0)
        await s.sync(src.state_dict(), a.send, 1)
    assert await r.apply(dst, b.recv) == 1
    assert_bit_exact(src.state_dict(), dst.state_dict(), names)


async def test_a_gpu_apply_commits_only_after_its_writes_completed():
    """Item 2, receiver: the writes are queued on the explorer's stream behind long GPU work; once
    ``apply`` returns the version, a reader on another stream sees the new weights without syncing."""
    src = Net()
    dst = copy.deepcopy(src).to(DEV)
    names = collect_param_names_need_sync(src)
    s, r = PatchWeightSyncer(encoding="flat"), PatchWeightSyncer(encoding="flat")
    a, b = inproc_pair(timeout=60)
    await asyncio.gather(s.init_sender(src.state_dict(), names, a.send, a.recv),
                         r.init_receiver(dst.state_dict(), b.recv, b.send))
    with torch.no_grad():
        for p in src.parameters():
            p.add_(1.0)
    await s.sync(src.state_dict(), a.send, 1)
    # after the first tensor's write, ~0.1 s of GPU work: the later writes queue behind it
    r.after_each_write = lambda i, n: torch.cuda._sleep(200_000_000) if i == 0 else None
    busy = torch.cuda.Stream()
    with torch.cuda.stream(busy):
        assert await r.apply(dst, b.recv) == 1
    reader = torch.cuda.Stream()
    with torch.cuda.stream(reader):  # no wait on `busy`: only a completed write is visible here
        seen = {k: v.to("cpu", non_blocking=False) for k, v in dst.state_dict().items()}
    assert_bit_exact(src.state_dict(), seen, names)


async def test_a_cuda_build_of_many_tensors_syncs_with_the_host_a_bounded_number_of_times():
    """Item 5: host synchronisations of one build, counted by torch's sync debug mode, do not
    grow with the number of tensors (groups, not tensors)."""
    import warnings

    src = {f"t{i}": torch.randn(1000 + i, device=DEV) for i in range(200)}
    s = PatchWeightSyncer(snapshot_device=DEV, transport_device=DEV, encoding="coo", compression="none",
                          init_sync_enabled=False)
    r = PatchWeightSyncer(encoding="coo", compression="none", init_sync_enabled=False)
    dst = {k: v.clone() for k, v in src.items()}
    a, b = inproc_pair(timeout=60)
    await asyncio.gather(s.init_sender(src, None, a.send, a.recv), r.init_receiver(dst, b.recv, b.send))
    for t in src.values():
        t[::5] += 1.0
    snap = s.snapshot
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            snap.diff(list(src.values()), DEV)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    syncs = [w for w in caught if "synchroniz" in str(w.message)]
    assert len(syncs) <= 8, f"{len(syncs)} host syncs for 200 tensors"


def test_the_cuda_snapshot_reuses_one_copy_stream_and_pins_exactly_its_size():
    """Item 4: a CPU snapshot of CUDA tensors is one registered block of its own size, and every
    build prefetches on the same copy stream."""
    tensors = [torch.randn(1000 + 3 * i, device=DEV) for i in range(10)]
    snap = Snapshot("cpu")
    snap.load(tensors, [torch.bfloat16] * len(tensors))
    assert snap._pinned is not None and snap._pinned.registered and snap.tensor(0).is_pinned()
    assert snap._pinned.buffer.numel() <= sum(t.numel() * 2 + 64 for t in tensors)
    for step in range(3):
        for t in tensors:
            t[step::11] += 1.0
        snap.diff(tensors, "cpu")
        snap.staged_event.synchronize()
    assert len(snap._copy_streams) == 1
    snap.close()


def test_the_nccl_loop_is_not_frozen_by_the_first_transfer(tmp_path):
    """Item 3: two ranks over NCCL; the receiving rank posts its first receive a second late. The
    sender's event loop keeps running meanwhile (its largest tick gap stays small), and both
    ranks finish the transfer."""
    need_gpus(2)
    import os
    import subprocess
    import sys

    script = tmp_path / "nccl_first_send.py"
    script.write_text(_NCCL_FIRST_SEND)
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29611", "WORLD_SIZE": "2"}
    procs = [subprocess.Popen([sys.executable, str(script)], env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    gap = float(outs[0][0].strip().splitlines()[-1])
    assert gap < 0.5, f"the sender's loop stalled {gap:.2f}s during its first NCCL send"


_NCCL_FIRST_SEND = '''
import time, anyio, torch
from aiosync.transports.distributed import WeightSyncGroup

async def main():
    group = WeightSyncGroup.init(backend="nccl", timeout=60)
    t = group.transport(1 - group.rank)
    if group.rank == 0:
        gaps, last, done = [0.0], time.monotonic(), anyio.Event()
        async def tick():
            nonlocal last
            while not done.is_set():
                await anyio.sleep(0.01)
                now = time.monotonic(); gaps.append(now - last - 0.01); last = now
        async with anyio.create_task_group() as tg:
            tg.start_soon(tick)
            await t.send({"w": torch.ones(1 << 20, device=group.device)})
            done.set()
        print(max(gaps))
    else:
        time.sleep(1.0)  # joins late: its first receive builds the pair's communicator
        got = await t.recv()
        assert torch.equal(got["w"].cpu(), torch.ones(1 << 20))
    group.destroy()

anyio.run(main)
'''


# ------------------------------------------------------------------ item 5: the fused, packed builder

def _edge_and_random(n: int, seed: int) -> torch.Tensor:
    from test_builder_packed import edge_floats

    g = torch.Generator().manual_seed(seed)
    return torch.cat([edge_floats(), torch.randn(n, generator=g)])


@pytest.mark.parametrize("src_dtype,snap_dtype", [(torch.float32, torch.bfloat16), (torch.float32, torch.float32),
                                                  (torch.int64, torch.int64), (torch.bool, torch.bool)])
def test_the_fused_builder_equals_the_torch_ops_bit_for_bit(src_dtype, snap_dtype):
    pytest.importorskip("triton", reason="triton is not installed")
    from aiosync.syncers.snapshot import cuda as snapshot_cuda

    assert snapshot_cuda.fused_ok(torch.device(DEV, torch.cuda.current_device()))  # compiled, self-checked

    def sources():
        out = [_edge_and_random(5000, 1), _edge_and_random(3, 2), _edge_and_random(1 << 20, 3), torch.randn(1)]
        return [(t > 0) if src_dtype == torch.bool else (t * 100).to(src_dtype) if src_dtype == torch.int64
                else t.to(src_dtype) for t in out]

    results = []
    for backend in ("fused", "torch"):
        srcs = [s.to(DEV) for s in sources()]
        snaps = [torch.zeros(s.numel(), dtype=snap_dtype, device=DEV) for s in srcs]
        snaps[2].copy_(srcs[2].to(snap_dtype))
        snaps[2][::7] = snaps[2][1::7]
        out = snapshot_cuda.diff_groups(list(zip(srcs, snaps)), group_elems=1 << 19, backend=backend)
        results.append([x.cpu() for r in out for x in r] + [s.cpu() for s in snaps])
        if backend == "fused" and snap_dtype == torch.bfloat16:  # what a bucket (torch's cast) delivers
            for (pos, nv, _), s in zip(out, srcs):
                assert torch.equal(nv, s.to(torch.bfloat16).view(torch.int16)[pos])
    for a, b in zip(*results):
        assert a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def _syncs_of_a_build(n: int, snapshot_device: str) -> int:
    import warnings

    tensors = [torch.randn(1000 + i, device=DEV) for i in range(n)]
    snap = Snapshot(snapshot_device)
    snap.load(tensors, [torch.bfloat16] * n)
    for t in tensors:
        t[::5] += 1.0
    snap.diff(tensors, "cpu")  # warm-up: kernels compiled, self-check done
    for t in tensors:
        t[1::5] += 1.0
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            diffs = snap.diff(tensors, "cpu")
    finally:
        torch.cuda.set_sync_debug_mode(0)
    snap.staged_event.synchronize()
    assert len(diffs) == n
    snap.close()
    return len([w for w in caught if "synchroniz" in str(w.message)])


@pytest.mark.parametrize("snapshot_device", [DEV, "cpu"])
def test_host_syncs_of_a_packed_build_do_not_grow_with_the_tensor_count(snapshot_device):
    few, many = _syncs_of_a_build(20, snapshot_device), _syncs_of_a_build(200, snapshot_device)
    assert many == few, f"{few} host syncs for 20 tensors, {many} for 200"
