"""Staged receivers (F3), payloads that own their bytes, and the drift check of ``flat`` patches.

* ``stage_init`` / ``stage`` download, decompress and validate while only reading the model;
  the ``StagedWrite`` they return is the only part that writes, all-or-nothing (S8).
* A bootstrap staged by ``stage_init`` is written with the next patch as one step.
* Whole-state writes (bootstrap buckets, bucket mode) write only what changed, and stay
  bit-exact on tied and non-contiguous receiver tensors.
* Every payload owns its bytes: mutating the sender's state after ``sync`` / ``init_sender``
  never changes what the receiver applies.
* ``flat`` patches carry a hash of the old bits at their changed positions; a receiver that
  drifted there is refused (``DriftError``) with nothing written.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses

import pytest
import torch
from helpers import bits, recv_from, same_bits
from torch import nn

from aiosync.errors import ApplyError, DriftError, HandshakeError, PatchChainError, PayloadError, VersionError
from aiosync.syncers import BucketWeightSyncer, CompressedWeightPatch, PatchWeightSyncer, StagedWrite, WeightPatch
from aiosync.syncers.bucket.format import META_PREFIX, load_into
from aiosync.syncers.faults import ApplyFaults, FlakyBucketSyncer, FlakyPatchSyncer
from aiosync.syncers.common.staging import FullStateWrite, Journal
from aiosync.transports.inproc import inproc_pair


def snap(sd) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in sd.items()}


def same_state(a, b) -> bool:
    return a.keys() == b.keys() and all(same_bits(a[k], b[k]) for k in a)


def collector():
    sent: list = []

    async def send(p):
        sent.append(p)

    return sent, send


class TiedNet(nn.Module):
    """Tied embedding/head (optionally), a transposed (non-contiguous) matrix, a permuted 3-D
    tensor, an int64 buffer."""

    def __init__(self, seed: int, tied: bool = True) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.emb = nn.Embedding(10, 8)
        self.head = nn.Linear(8, 10, bias=False)
        with torch.no_grad():
            self.emb.weight.copy_(torch.randn(10, 8, generator=g))
            self.head.weight.copy_(torch.randn(10, 8, generator=g))
        if tied:
            self.head.weight = self.emb.weight
        self.w = nn.Parameter(torch.randn(8, 6, generator=g).t())  # (6, 8), non-contiguous
        self.c = nn.Parameter(torch.randn(2, 4, 3, generator=g).permute(0, 2, 1))  # (2, 3, 4), non-contiguous
        self.register_buffer("n", torch.arange(5, dtype=torch.int64) * (seed + 1))


def nudge(model: nn.Module, step: int) -> None:
    """A sparse change: a few elements of every tensor."""
    with torch.no_grad():
        for i, (_, t) in enumerate(sorted(model.state_dict(keep_vars=True).items())):
            flat_index = (step * 7 + i * 3) % t.numel()
            idx = torch.unravel_index(torch.tensor(flat_index), t.shape)
            t[idx] += 1


# ------------------------------------------------------------------ staging: nothing before write

async def test_a_staged_patch_writes_nothing_until_write():
    src = {"w": torch.randn(16, 8), "b": torch.randn(8)}
    dst = {"w": torch.zeros(16, 8, dtype=torch.bfloat16), "b": torch.zeros(8)}
    s, r = PatchWeightSyncer(), PatchWeightSyncer()
    a, b = inproc_pair(timeout=10)
    await asyncio.gather(s.init_sender(src, None, a.send, a.recv), r.init_receiver(dst, b.recv, b.send))
    src["w"][3, 4] += 1
    await s.sync(src, a.send, 1)
    before = snap(dst)
    staged = await r.stage(dst, b.recv)
    assert isinstance(staged, StagedWrite) and staged.version == 1 and staged.changed == 1 and staged.nbytes > 0
    assert same_state(before, dst) and r.version is None
    assert await staged.write(dst) == 1
    assert r.version == 1 and same_bits(dst["w"], src["w"].to(torch.bfloat16))
    assert r.statistics().changed == 1 and r.statistics().write_s is not None
    with pytest.raises(PatchChainError, match="stage again"):  # a staged write is good for one write
        await staged.write(dst)


async def test_stage_init_writes_nothing_and_keeps_the_committed_state_until_the_next_write():
    src = {"w": torch.randn(16, 8), "n": torch.tensor([1, 2, 3])}
    dst = {"w": torch.zeros(16, 8), "n": torch.tensor([0, 0, 0])}
    s1, r = PatchWeightSyncer(), PatchWeightSyncer()
    a, b = inproc_pair(timeout=10)
    await asyncio.gather(s1.init_sender(src, None, a.send, a.recv), r.init_receiver(dst, b.recv, b.send))
    src["w"] += 1
    await s1.sync(src, a.send, 3)
    assert await r.apply(dst, b.recv) == 3
    session = r._rx.session
    # a repair: a new handshake with a bootstrap of other weights
    src2 = {"w": torch.randn(16, 8), "n": torch.tensor([7, 8, 9])}
    s2 = PatchWeightSyncer()
    before = snap(dst)
    a, b = inproc_pair(timeout=10)
    await asyncio.gather(s2.init_sender(src2, None, a.send, a.recv), r.stage_init(dst, b.recv, b.send))
    assert same_state(before, dst)
    assert r.version == 3 and r._rx.session == session  # committed state untouched
    src2["w"][0, 0] += 1
    await s2.sync(src2, a.send, 4)
    staged = await r.stage(dst, b.recv)
    assert same_state(before, dst) and staged.version == 4
    assert staged.changed >= 16 * 8  # the bootstrap and the patch
    assert await staged.write(dst) == 4
    assert same_state(dst, src2) and r.version == 4 and r._rx.session != session


async def test_a_refused_patch_raises_at_stage():
    src = {"w": torch.randn(16, 8)}
    dst = {"w": torch.zeros(16, 8)}
    s, r = PatchWeightSyncer(), PatchWeightSyncer()
    a, b = inproc_pair(timeout=10)
    await asyncio.gather(s.init_sender(src, None, a.send, a.recv), r.init_receiver(dst, b.recv, b.send))
    for v in (1, 2):
        src["w"][v, v] += 1
        await s.sync(src, a.send, v)
    p1, p2 = await b.recv(), await b.recv()
    before = snap(dst)
    with pytest.raises(PatchChainError):  # built on 1, the receiver holds nothing yet
        await r.stage_payload(dst, p2)
    with pytest.raises(PayloadError, match="old_hashes"):
        await r.stage_payload(dst, dataclasses.replace(p1, old_hashes=None))
    with pytest.raises(PayloadError):
        await r.stage_payload(dst, {"not": "a patch"})
    assert same_state(before, dst) and r.version is None
    await (await r.stage_payload(dst, p1)).write(dst)
    with pytest.raises(VersionError):
        await r.stage_payload(dst, p1)


async def test_a_refused_bucket_sync_raises_at_stage():
    src, dst = {"w": torch.randn(16, 8)}, {"w": torch.zeros(16, 8)}
    s, r = BucketWeightSyncer(bucket_size=128), BucketWeightSyncer(bucket_size=128)
    await s.init_sender(src, None, None)
    sent, send = collector()
    await s.sync(src, send, 1)
    r.version = 1
    with pytest.raises(VersionError):
        await r.stage(dst, recv_from(sent))
    r.version = None
    bad = [dict(p) for p in sent]
    bad[-1]["w"] = bad[-1]["w"][:-1]
    with pytest.raises(PayloadError):
        await r.stage(dst, recv_from(bad))
    assert torch.equal(dst["w"], torch.zeros(16, 8))
    staged = await r.stage(dst, recv_from(sent))
    assert torch.equal(dst["w"], torch.zeros(16, 8)) and r.version is None
    assert await staged.write(dst) == 1 and torch.equal(dst["w"], src["w"])


# ------------------------------------------------------------------ all-or-nothing

async def test_bootstrap_and_patch_are_one_step_a_failure_in_the_patch_rolls_the_bootstrap_back():
    src = {"w": torch.randn(32, 8), "b": torch.randn(8), "n": torch.tensor([5, 6])}
    dst = {"w": torch.zeros(32, 8, dtype=torch.bfloat16), "b": torch.zeros(8), "n": torch.tensor([0, 0])}
    s, r = PatchWeightSyncer(), PatchWeightSyncer()
    a, b = inproc_pair(timeout=10)
    await asyncio.gather(s.init_sender(src, None, a.send, a.recv), r.stage_init(dst, b.recv, b.send))
    src["w"][::3] += 0.5
    src["b"][1] += 1
    await s.sync(src, a.send, 1)
    staged = await r.stage(dst, b.recv)
    before = snap(dst)
    calls = []

    def fail_in_the_patch(i, n):
        calls.append((i, n))
        if len(calls) == len(dst) + 1:  # every bootstrap tensor written, then one patch tensor
            raise RuntimeError("injected fault in the patch")

    r.after_each_write = fail_in_the_patch
    with pytest.raises(ApplyError, match="injected fault"):
        await staged.write(dst)
    assert len(calls) == len(dst) + 1
    assert same_state(before, dst) and r.version is None
    r.after_each_write = None
    assert await staged.write(dst) == 1  # nothing was committed: the same write can be retried
    assert all(same_bits(dst[k], src[k].to(dst[k].dtype)) for k in src)


@pytest.mark.parametrize("kind", ["patch", "bucket"])
async def test_the_flaky_syncers_fail_half_way_through_a_staged_write_and_roll_back(kind):
    faults = ApplyFaults(1.0, seed=0)
    src = {f"t{i}": torch.randn(8, 8) for i in range(4)}
    dst = {k: torch.zeros(8, 8) for k in src}
    if kind == "patch":
        s, r = PatchWeightSyncer(), FlakyPatchSyncer()
        a, b = inproc_pair(timeout=10)
        await asyncio.gather(s.init_sender(src, None, a.send, a.recv), r.stage_init(dst, b.recv, b.send))
        await s.sync(src, a.send, 1)
        staged = await r.stage(dst, b.recv)
    else:
        s, r = BucketWeightSyncer(bucket_size=256), FlakyBucketSyncer(bucket_size=256)
        await s.init_sender(src, None, None)
        sent, send = collector()
        await s.sync(src, send, 1)
        staged = await r.stage(dst, recv_from(sent))
    r.faults = faults
    faults.enabled = True
    written: list[bool] = []
    hook = r.after_each_write

    def spy(i, n):  # record whether something was already written when the fault fires
        written.append(any(not torch.equal(dst[k], torch.zeros(8, 8)) for k in dst))
        hook(i, n)

    r.after_each_write = spy
    with pytest.raises(ApplyError, match="injected fault"):
        await staged.write(dst)
    assert faults.fired == 1 and written[-1] is True  # it raised after writing part of it
    assert all(torch.equal(v, torch.zeros(8, 8)) for v in dst.values()) and r.version is None
    faults.enabled = False
    assert await staged.write(dst) == 1 and same_state(dst, src)


# ------------------------------------------------------------------ whole-state writes

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("sender_tied", [True, False])
async def test_bucket_staged_writes_are_bit_exact_on_tied_and_non_contiguous_receivers(sender_tied, dtype):
    src = TiedNet(0, tied=sender_tied)
    dst = TiedNet(1, tied=True).to(dtype)
    assert dst.head.weight is dst.emb.weight and not dst.w.is_contiguous() and not dst.c.is_contiguous()
    oracle = copy.deepcopy(dst)  # loaded key after key with copy_: what the staged write must equal
    s, r = BucketWeightSyncer(bucket_size=128), BucketWeightSyncer(bucket_size=128)
    await s.init_sender(src.state_dict(), None, None)
    for version in (1, 2, 3):  # 1: every tensor differs (copied whole), then sparse changes
        if version > 1:
            nudge(src, version)
        sent, send = collector()
        await s.sync(src.state_dict(), send, version)
        before = snap(dst.state_dict())
        if not sender_tied:  # a tied receiver cannot hold an untied sender's two values (issue 35)
            with pytest.raises(HandshakeError, match="'emb.weight' and 'head.weight' share memory"):
                await r.stage(dst, recv_from(sent))
            assert same_state(before, dst.state_dict())
            return
        staged = await r.stage(dst, recv_from(sent))
        assert same_state(before, dst.state_dict())
        for p in sent:
            load_into(oracle.state_dict(), {k: v for k, v in p.items() if not k.startswith(META_PREFIX)})
        # a failure after the last tensor was written: everything is restored
        r.after_each_write = lambda i, n: (_ for _ in ()).throw(RuntimeError("late fault")) if i == n - 1 else None
        with pytest.raises(ApplyError, match="late fault"):
            await staged.write(dst)
        assert same_state(before, dst.state_dict())
        r.after_each_write = None
        assert await staged.write(dst) == version
        assert same_state(oracle.state_dict(), dst.state_dict())
        assert dst.head.weight is dst.emb.weight and dst.w.stride() == (1, 6) and not dst.c.is_contiguous()


async def test_patch_bootstrap_into_tied_and_non_contiguous_receivers_is_bit_exact():
    src = TiedNet(0, tied=True)
    dst = TiedNet(1, tied=True).to(torch.bfloat16)
    c0 = src.c.detach().to(torch.bfloat16)
    # "c" (permuted 3-D) cannot be patched through a 2-D view: bootstrapped only, not synced
    names = [k for k in src.state_dict() if k != "c"]
    s, r = PatchWeightSyncer(), PatchWeightSyncer()
    a, b = inproc_pair(timeout=10)
    await asyncio.gather(s.init_sender(src.state_dict(), names, a.send, a.recv),
                         r.init_receiver(dst.state_dict(), b.recv, b.send))
    assert same_bits(dst.c, c0) and not dst.c.is_contiguous()
    for version in (1, 2):
        nudge(src, version)
        await s.sync(src.state_dict(), a.send, version)
        assert await r.apply(dst, b.recv) == version
        for k in names:
            assert same_bits(dst.state_dict()[k], src.state_dict()[k].to(dst.state_dict()[k].dtype)), k
    assert dst.head.weight is dst.emb.weight and not dst.w.is_contiguous() and same_bits(dst.c, c0)


def test_full_state_write_of_overlapping_views_equals_copying_key_after_key():
    base = torch.arange(12, dtype=torch.float32)
    target = {"a": base[0:6], "b": base[3:9], "c": base.view(3, 4)[:, 1], "d": torch.zeros(5)}
    oracle_base = base.clone()
    oracle = {"a": oracle_base[0:6], "b": oracle_base[3:9], "c": oracle_base.view(3, 4)[:, 1], "d": torch.zeros(5)}
    values = {"a": torch.full((6,), 100.0), "b": torch.arange(6, dtype=torch.float32) + 50, "c": torch.zeros(3),
              "d": torch.tensor([0.0, 1, 0, 0, 2])}
    plan = FullStateWrite()
    plan.add(target, values)
    before = base.clone()
    load_into(oracle, values)
    journal = Journal()
    plan.check(target)
    plan.write(target, journal)
    assert torch.equal(base, oracle_base) and torch.equal(target["d"], values["d"])
    journal.rollback()
    assert torch.equal(base, before) and torch.equal(target["d"], torch.zeros(5))


def test_full_state_write_checks_the_tensors_it_was_planned_against():
    target = {"w": torch.zeros(4, 4)}
    plan = FullStateWrite()
    plan.add(target, {"w": torch.ones(4, 4)})
    with pytest.raises(ApplyError, match="'w'"):
        plan.check({"w": torch.zeros(4, 4)})  # another tensor (a model moved or reloaded)


# ------------------------------------------------------------------ payloads own their bytes

async def test_a_bootstrap_and_patches_hold_the_values_of_the_call_time():
    src = {"w": torch.randn(16, 8), "n": torch.tensor([1, 2, 3])}  # the receiver has the same dtypes: no cast
    dst = {"w": torch.zeros(16, 8), "n": torch.tensor([0, 0, 0])}
    s, r = PatchWeightSyncer(), PatchWeightSyncer()
    a, b = inproc_pair(timeout=10)
    sent, capture = collector()
    receiving = asyncio.ensure_future(r.init_receiver(dst, b.recv, b.send))
    await s.init_sender(src, None, capture, a.recv)
    at_init = snap(src)
    for t in src.values():
        t.add_(7)  # the trainer moves on, in place, before the explorer reads the bootstrap
    for p in sent:
        await a.send(p)
    await receiving
    assert same_state(dst, at_init)
    src["w"][2, 2] = 42.0
    sent.clear()
    await s.sync(src, capture, 1)
    at_sync = snap(src)
    src["w"].mul_(3)
    src["n"].add_(1)
    for p in sent:
        await a.send(p)
    assert await r.apply(dst, b.recv) == 1
    assert same_state(dst, at_sync)


async def test_bucket_payloads_hold_the_values_of_the_call_time():
    src = {"w": torch.randn(16, 8), "n": torch.tensor([1, 2, 3])}
    dst = {"w": torch.zeros(16, 8), "n": torch.tensor([0, 0, 0])}
    s, r = BucketWeightSyncer(bucket_size=64), BucketWeightSyncer(bucket_size=64)  # no bucket_dtype: no cast
    await s.init_sender(src, None, None)
    sent, capture = collector()
    await s.sync(src, capture, 1)
    at_sync = snap(src)
    for t in src.values():
        t.add_(1)
    for p in sent:
        for k, v in p.items():
            if not k.startswith(META_PREFIX):
                assert v.untyped_storage().data_ptr() != src[k].untyped_storage().data_ptr(), k
    assert await r.apply(dst, recv_from(sent)) == 1
    assert same_state(dst, at_sync)


# ------------------------------------------------------------------ the drift check

async def _flat_pair(src, dst, encoding="flat", **kw):
    fmt = {"encoding": encoding, "compression": "zstd" if encoding == "flat" else "none"}
    s = PatchWeightSyncer(**fmt, **{k: v for k, v in kw.items() if k == "builder_kernel"})
    r = PatchWeightSyncer(**fmt)
    a, b = inproc_pair(timeout=10)
    await asyncio.gather(s.init_sender(src, None, a.send, a.recv), r.init_receiver(dst, b.recv, b.send))
    return s, r, a, b


@pytest.mark.parametrize("encoding", ["flat", "ctx"])
@pytest.mark.parametrize("builder_kernel", ["auto", "torch"])
@pytest.mark.parametrize("contiguous", [True, False], ids=["contiguous", "transposed"])
async def test_a_receiver_that_drifted_at_a_changed_position_is_refused(builder_kernel, contiguous, encoding):
    src = {"w": torch.randn(12, 10), "b": torch.randn(10)}
    w = torch.zeros(12, 10, dtype=torch.bfloat16) if contiguous else torch.zeros(10, 12, dtype=torch.bfloat16).t()
    dst = {"w": w, "b": torch.zeros(10)}
    s, r, a, b = await _flat_pair(src, dst, encoding, builder_kernel=builder_kernel)
    src["w"][4, 5] += 1
    src["w"][7, 0] -= 1
    src["b"][3] += 1
    await s.sync(src, a.send, 1)
    patch = await b.recv()
    assert isinstance(patch, CompressedWeightPatch if encoding == "flat" else WeightPatch)
    assert patch.old_hashes.dtype == torch.int64 and patch.old_hashes.numel() == patch.ordinals.numel() == 2
    held = dst["w"][7, 0].clone()
    dst["w"][7, 0] += 1  # drifted, at a position the patch changes
    before = snap(dst)
    # flat: the drift check names the key; ctx: the drifted value also moves its element to another
    # class, so the positions may no longer decode against it (a DriftError naming its ordinal)
    with pytest.raises(DriftError, match="'w'" if encoding == "flat" else "'w'|ordinal 0"):
        await r.apply_payload(dst, patch)
    assert same_state(before, dst) and r.version is None  # nothing written, "b" included
    dst["w"][7, 0] = held  # back to what the sender built on: the same patch applies
    assert await r.apply_payload(dst, patch) == 1
    assert all(same_bits(dst[k], src[k].to(dst[k].dtype)) for k in src)


async def test_drift_elsewhere_is_not_an_error():
    src = {"w": torch.randn(12, 10)}
    dst = {"w": torch.zeros(12, 10, dtype=torch.bfloat16)}
    s, r, a, b = await _flat_pair(src, dst)
    src["w"][4, 5] += 1
    await s.sync(src, a.send, 1)
    dst["w"][0, 0] += 1  # drifted where nothing changes: the cheap check does not look there
    assert await r.apply(dst, b.recv) == 1
    expected = src["w"].to(torch.bfloat16)
    expected[0, 0] += 1
    assert same_bits(dst["w"], expected)


@pytest.mark.parametrize("compressed", [True, False])
async def test_a_flat_patch_without_old_hashes_is_refused(compressed):
    src = {"w": torch.randn(12, 10)}
    dst = {"w": torch.zeros(12, 10, dtype=torch.bfloat16)}
    s = PatchWeightSyncer(compression="zstd" if compressed else "none")
    r = PatchWeightSyncer(compression="zstd" if compressed else "none")
    a, b = inproc_pair(timeout=10)
    await asyncio.gather(s.init_sender(src, None, a.send, a.recv), r.init_receiver(dst, b.recv, b.send))
    src["w"][1, 1] += 1
    await s.sync(src, a.send, 1)
    patch = await b.recv()
    assert isinstance(patch, CompressedWeightPatch if compressed else WeightPatch)
    before = snap(dst)
    with pytest.raises(PayloadError, match="old_hashes"):
        await r.apply_payload(dst, dataclasses.replace(patch, old_hashes=None))
    with pytest.raises(PayloadError, match="old_hashes"):
        await r.apply_payload(dst, dataclasses.replace(patch, old_hashes=patch.old_hashes.to(torch.int32)))
    assert same_state(before, dst) and r.version is None
    assert await r.apply_payload(dst, patch) == 1


@pytest.mark.parametrize("encoding", ["flat", "ctx"])
async def test_drift_after_a_partial_bootstrap_refuses_the_whole_staged_write(encoding):
    """A bootstrap of some prefixes leaves the other tensors as the receiver holds them; a
    patch that changes one of those where the receiver does not hold the sender's values is
    refused, and the staged bootstrap is rolled back with it (a ``ctx`` patch, decoded against
    the receiver's values inside the write, fails to decode there)."""
    src = {"a.w": torch.randn(8, 8), "b.w": torch.randn(8, 8)}
    dst = {"a.w": torch.zeros(8, 8), "b.w": torch.zeros(8, 8)}  # "b.w" differs and is not bootstrapped
    s = PatchWeightSyncer(init_sync_prefixes=["a"], encoding=encoding)
    r = PatchWeightSyncer(encoding=encoding)
    a, b = inproc_pair(timeout=10)
    await asyncio.gather(s.init_sender(src, None, a.send, a.recv), r.stage_init(dst, b.recv, b.send))
    src["a.w"][0, 0] += 1
    src["b.w"][1, 1] += 1
    await s.sync(src, a.send, 1)
    staged = await r.stage(dst, b.recv)
    with pytest.raises(DriftError, match="'b.w'" if encoding == "flat" else "'b.w'|ordinal 1"):
        await staged.write(dst)
    assert all(torch.equal(v, torch.zeros(8, 8)) for v in dst.values()) and r.version is None


async def test_a_coo_patch_carries_no_drift_hash_and_still_applies():
    src = {"w": torch.randn(12, 10)}
    dst = {"w": torch.zeros(12, 10, dtype=torch.bfloat16)}
    s = PatchWeightSyncer(encoding="coo", compression="none")
    r = PatchWeightSyncer(encoding="coo", compression="none")
    a, b = inproc_pair(timeout=10)
    await asyncio.gather(s.init_sender(src, None, a.send, a.recv), r.init_receiver(dst, b.recv, b.send))
    src["w"][1, 1] += 1
    await s.sync(src, a.send, 1)
    patch = await b.recv()
    assert patch.old_hashes is None
    assert await r.apply_payload(dst, patch) == 1 and same_bits(dst["w"], src["w"].to(torch.bfloat16))


def test_bits_helper_sanity():
    assert bits(torch.tensor([1.0], dtype=torch.bfloat16)).dtype == torch.int16
