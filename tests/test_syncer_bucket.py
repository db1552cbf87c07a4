"""Bucket mode (W16): whole tensors in size-bounded buckets."""

from __future__ import annotations

import asyncio

import pytest
import torch
from torch import nn

from aiosync.syncers import BucketWeightSyncer, collect_param_names_need_sync, iter_named_tensor_buckets
from aiosync.transports.inproc import inproc_pair
from aiosync.errors import HandshakeError, VersionError
from aiosync.syncers.bucket.format import BUCKET_KEY, META_PREFIX, VERSION_KEY
from helpers import bits





class Net(nn.Module):
    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            self.emb = nn.Embedding(20, 8)
            self.conv = nn.Conv2d(2, 3, 3)  # 4-D weight
            self.l1 = nn.Linear(8, 12)
            self.head = nn.Linear(12, 20, bias=False)
            self.frozen = nn.Parameter(torch.randn(4), requires_grad=False)
        self.register_buffer("step", torch.tensor(seed * 2**35 + 3, dtype=torch.int64))
        self.register_buffer("ids", torch.arange(6, dtype=torch.int64) * (2**40 + seed) - 2**41)
        self.register_buffer("mask", torch.tensor([bool(seed % 2), True, False]))
        self.register_buffer("cache", torch.full((3,), float(seed)), persistent=False)


def train(model: Net, step: int) -> None:
    g = torch.Generator().manual_seed(step)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(torch.randn(p.shape, generator=g) * 1e-2)
        model.step += 2**33
        model.ids[step % 6] = -(2**62) + step
        model.mask.logical_not_()


def expected_bits(src: torch.Tensor, bucket_dtype, recv_dtype) -> torch.Tensor:
    t = src.detach()
    if bucket_dtype is not None and t.is_floating_point():
        t = t.to(bucket_dtype)
    return bits(t.to(recv_dtype))


@pytest.mark.parametrize("receiver_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bucket_dtype", [None, "bfloat16"])
@pytest.mark.parametrize("load_instant", [True, False])
async def test_bucket_round_trip(load_instant, bucket_dtype, receiver_dtype):
    src = Net(0)
    dst = Net(1).to(receiver_dtype)
    names = collect_param_names_need_sync(src)
    s = BucketWeightSyncer(bucket_size=600, bucket_dtype=bucket_dtype)
    r = BucketWeightSyncer(bucket_size=600, bucket_dtype=bucket_dtype, load_instant=load_instant)
    a, b = inproc_pair(timeout=10)
    sent: list = []

    async def send(payload):
        sent.append(payload)
        await a.send(payload)

    await asyncio.gather(s.init_sender(src.state_dict(), names, send, a.recv), r.init_receiver(dst.state_dict(), b.recv))
    frozen_before = dst.frozen.clone()
    for version in (1, 2, 3):
        train(src, version)
        sent.clear()
        await s.sync(src.state_dict(), send, version)
        assert len(sent) > 1  # small buckets: several
        # what is sent: floats in bucket_dtype, integers and bools keep their dtype
        seen = {}
        for payload in sent:
            assert payload[VERSION_KEY].dtype == torch.int64 and int(payload[VERSION_KEY]) == version
            for k, v in payload.items():
                if not k.startswith(META_PREFIX):
                    seen[k] = v
        assert list(seen) == names
        assert seen["step"].dtype == torch.int64 and seen["ids"].dtype == torch.int64
        assert seen["mask"].dtype == torch.bool
        want_float = torch.bfloat16 if bucket_dtype == "bfloat16" else torch.float32
        assert seen["l1.weight"].dtype == want_float and seen["conv.weight"].dtype == want_float
        assert torch.equal(seen["ids"], src.ids) and torch.equal(seen["step"], src.step)

        # observe the receiver between buckets: nothing is written before the whole sync
        # arrived and passed (staged, F3), with or without load_instant
        first_bucket_keys = [k for k in sent[0] if not k.startswith(META_PREFIX)]
        calls = 0
        loaded_after_first: list[bool] = []

        bd = getattr(torch, bucket_dtype) if bucket_dtype else None

        async def recv():
            nonlocal calls
            if calls == 1:
                d = dst.state_dict()
                loaded_after_first.append(all(
                    torch.equal(bits(d[k]), expected_bits(src.state_dict()[k], bd, d[k].dtype)) for k in first_bucket_keys))
            calls += 1
            return await b.recv()

        applied = await r.apply(dst, recv)
        assert applied == version and r.version == version
        assert calls == len(sent)
        assert loaded_after_first == [False]
        d = dst.state_dict()
        for k in names:
            assert d[k].dtype == (receiver_dtype if src.state_dict()[k].is_floating_point() else src.state_dict()[k].dtype)
            assert torch.equal(bits(d[k]), expected_bits(src.state_dict()[k], bd, d[k].dtype)), k
        assert torch.equal(dst.ids, src.ids) and torch.equal(dst.step, src.step) and torch.equal(dst.mask, src.mask)
        assert torch.equal(dst.frozen, frozen_before)  # frozen parameters are not synced
        assert torch.equal(dst.cache, torch.full((3,), 1.0))  # non-persistent buffers neither


async def test_reserved_metadata_prefix_raises():
    sd = {"w": torch.zeros(3), META_PREFIX + "version": torch.zeros(1)}
    s = BucketWeightSyncer(bucket_size=1024)
    a, _ = inproc_pair(timeout=5)
    with pytest.raises(ValueError, match="__aiosync__"):
        await s.init_sender(sd, None, a.send)
    r = BucketWeightSyncer(bucket_size=1024)
    with pytest.raises(ValueError, match="__aiosync__.version"):
        await r.init_receiver(sd, a.recv)
    # a key that merely contains the prefix elsewhere is fine
    ok = {"w": torch.zeros(3), "x__aiosync__.version": torch.zeros(1)}
    await BucketWeightSyncer(bucket_size=1024).init_sender(ok, None, a.send)


async def test_int64_version_above_2_pow_32():
    src = Net(0)
    dst = Net(1)
    s = BucketWeightSyncer(bucket_size=1 << 20)
    r = BucketWeightSyncer(bucket_size=1 << 20)
    a, b = inproc_pair(timeout=10)
    await s.init_sender(src.state_dict(), None, a.send)
    await r.init_receiver(dst.state_dict(), b.recv)
    for version in (2**32 + 7, 2**40, 2**63 - 1):
        train(src, version % 97)
        await s.sync(src.state_dict(), a.send, version)
        applied = await r.apply(dst, b.recv)
        assert applied == version and type(applied) is int
        for k, v in src.state_dict().items():
            assert torch.equal(bits(dst.state_dict()[k]), bits(v)), k
    with pytest.raises(VersionError):
        await s.sync(src.state_dict(), a.send, 2**63 - 1)
    with pytest.raises(VersionError):
        await s.sync(src.state_dict(), a.send, 2**63)


async def test_receiver_refuses_version_that_does_not_advance():
    src = Net(0)
    dst = Net(1)
    s1 = BucketWeightSyncer(bucket_size=1 << 20)
    s2 = BucketWeightSyncer(bucket_size=1 << 20)
    r = BucketWeightSyncer(bucket_size=1 << 20)
    a, b = inproc_pair(timeout=10)
    await s1.init_sender(src.state_dict(), None, a.send)
    await s2.init_sender(src.state_dict(), None, a.send)
    await r.init_receiver(dst.state_dict(), b.recv)
    await s1.sync(src.state_dict(), a.send, 10)
    assert await r.apply(dst, b.recv) == 10
    await s2.sync(src.state_dict(), a.send, 10)
    with pytest.raises(VersionError):
        await r.apply(dst, b.recv)
    assert r.version == 10


def test_iter_named_tensor_buckets_sizes_and_order():
    tensors = [
        ("a", torch.zeros(10)),  # 40 B
        ("b", torch.zeros(10)),  # 40 B
        ("c", torch.zeros(5)),  # 20 B
        ("big", torch.zeros(100)),  # 400 B > bucket_size: alone
        ("d", torch.zeros(25)),  # 100 B exactly fills a bucket
        ("e", torch.zeros(1, dtype=torch.int64)),  # 8 B
        ("f", torch.zeros(3, dtype=torch.bool)),  # 3 B
    ]
    buckets = list(iter_named_tensor_buckets(tensors, 100))
    names = [[n for n, _ in bucket] for bucket in buckets]
    assert names == [["a", "b", "c"], ["big"], ["d"], ["e", "f"]]
    # order kept, nothing split or lost, tensors passed through untouched
    flat = [t for bucket in buckets for _, t in bucket]
    assert [n for bucket in names for n in bucket] == [n for n, _ in tensors]
    assert all(x is y for x, (_, y) in zip(flat, tensors))
    for bucket in buckets:
        size = sum(t.numel() * t.element_size() for _, t in bucket)
        assert size <= 100 or len(bucket) == 1


def test_iter_named_tensor_buckets_sized_in_wire_dtype():
    tensors = [("a", torch.zeros(25)), ("b", torch.zeros(25)), ("i", torch.zeros(6, dtype=torch.int64))]
    # fp32: 100 B each -> one per bucket; as bf16: 50 B each -> together; int64 stays 48 B
    assert [[n for n, _ in b] for b in iter_named_tensor_buckets(tensors, 100)] == [["a"], ["b"], ["i"]]
    assert [[n for n, _ in b] for b in iter_named_tensor_buckets(tensors, 100, torch.bfloat16)] == [["a", "b"], ["i"]]
    assert [[n for n, _ in b] for b in iter_named_tensor_buckets(tensors, 148, torch.bfloat16)] == [["a", "b", "i"]]
    with pytest.raises(ValueError):
        list(iter_named_tensor_buckets(tensors, 0))
    assert list(iter_named_tensor_buckets([], 10)) == []


async def test_sync_respects_bucket_size():
    src = Net(0)
    s = BucketWeightSyncer(bucket_size=256)
    a, b = inproc_pair(timeout=10)
    await s.init_sender(src.state_dict(), None, a.send)
    await s.sync(src.state_dict(), a.send, 1)
    payloads = []
    while True:
        p = await b.recv()
        payloads.append(p)
        idx, count = p[BUCKET_KEY].tolist()
        assert idx == len(payloads) - 1
        if idx == count - 1:
            break
    keys = []
    for p in payloads:
        body = {k: v for k, v in p.items() if not k.startswith(META_PREFIX)}
        size = sum(v.numel() * v.element_size() for v in body.values())
        assert size <= 256 or len(body) == 1
        keys += list(body)
    assert keys == list(src.state_dict())
    assert any(len([k for k in p if not k.startswith(META_PREFIX)]) > 1 for p in payloads)


async def test_is_agent_renaming_and_extra_state():
    sd = {
        "model.language_model.layers.0.weight": torch.randn(3, 4),
        "model.language_model.norm._extra_state": torch.zeros(2),
        "model.visual.proj.weight": torch.randn(2, 2),
        "lm_head.weight": torch.randn(5, 4),
    }
    dst = {
        "model.layers.0.weight": torch.zeros(3, 4),
        "model.visual.proj.weight": torch.zeros(2, 2),
        "lm_head.weight": torch.zeros(5, 4),
    }
    s = BucketWeightSyncer(bucket_size=1 << 20, is_agent=True)
    r = BucketWeightSyncer(bucket_size=1 << 20)
    a, b = inproc_pair(timeout=10)
    await s.init_sender(sd, None, a.send)
    await r.init_receiver(dst, b.recv)
    sent = []

    async def send(p):
        sent.append(p)
        await a.send(p)

    await s.sync(sd, send, 1)
    wire = [k for p in sent for k in p if not k.startswith(META_PREFIX)]
    assert wire == ["model.layers.0.weight", "model.visual.proj.weight", "lm_head.weight"]
    assert await r.apply(dst, b.recv) == 1
    assert torch.equal(dst["model.layers.0.weight"], sd["model.language_model.layers.0.weight"])
    assert torch.equal(dst["model.visual.proj.weight"], sd["model.visual.proj.weight"])
    assert torch.equal(dst["lm_head.weight"], sd["lm_head.weight"])


async def test_is_agent_without_visual_keys_keeps_names():
    sd = {"model.language_model.layers.0.weight": torch.randn(3, 4), "lm_head.weight": torch.randn(5, 4),
          "lm_head._extra_state": torch.zeros(1)}
    s = BucketWeightSyncer(bucket_size=1 << 20, is_agent=True)
    a, b = inproc_pair(timeout=10)
    await s.init_sender(sd, None, a.send)
    await s.sync(sd, a.send, 1)
    p = await b.recv()
    assert [k for k in p if not k.startswith(META_PREFIX)] == ["model.language_model.layers.0.weight", "lm_head.weight"]


async def test_without_is_agent_names_are_untouched():
    sd = {"model.language_model.w": torch.randn(2), "model.visual.w": torch.randn(2), "x._extra_state": torch.zeros(1)}
    s = BucketWeightSyncer(bucket_size=1 << 20)
    a, b = inproc_pair(timeout=10)
    await s.init_sender(sd, None, a.send)
    await s.sync(sd, a.send, 1)
    p = await b.recv()
    assert [k for k in p if not k.startswith(META_PREFIX)] == list(sd)


@pytest.mark.parametrize("load_instant,bucket_size", [(True, 1 << 20), (False, 1 << 20), (False, 200)])
async def test_shape_mismatch_on_receive_raises_and_loads_nothing(load_instant, bucket_size):
    src = Net(0)
    dst = dict(Net(1).state_dict())
    dst["head.weight"] = torch.zeros(20, 13)  # sender has (20, 12)
    before = {k: v.clone() for k, v in dst.items()}
    s = BucketWeightSyncer(bucket_size=bucket_size)
    r = BucketWeightSyncer(bucket_size=bucket_size, load_instant=load_instant)
    a, b = inproc_pair(timeout=10)
    await s.init_sender(src.state_dict(), None, a.send)
    await r.init_receiver(dst, b.recv)
    await s.sync(src.state_dict(), a.send, 1)
    with pytest.raises(ValueError, match="head.weight"):
        await r.apply(dst, b.recv)
    for k, v in dst.items():
        assert torch.equal(bits(v), bits(before[k])), k
    assert r.version is None


async def test_unknown_key_on_receive_raises():
    src = {"a": torch.ones(2), "b": torch.ones(3)}
    dst = {"a": torch.zeros(2)}
    s = BucketWeightSyncer(bucket_size=1 << 20)
    r = BucketWeightSyncer(bucket_size=1 << 20)
    a, b = inproc_pair(timeout=10)
    await s.init_sender(src, None, a.send)
    await r.init_receiver(dst, b.recv)
    await s.sync(src, a.send, 1)
    with pytest.raises(HandshakeError, match="'b'"):
        await r.apply(dst, b.recv)
    assert torch.equal(dst["a"], torch.zeros(2))


async def test_non_sender_rank_sends_nothing():
    src = Net(0)
    s = BucketWeightSyncer(bucket_size=256)
    a, b = inproc_pair(timeout=10)
    sent = []

    async def send(p):
        sent.append(p)
        await a.send(p)

    await s.init_sender(src.state_dict(), None, send, is_sender=False)
    await s.sync(src.state_dict(), send, 1)
    assert sent == []


def test_bucket_mode_is_not_no_wait_capable():
    assert BucketWeightSyncer.supports_no_wait is False


async def test_shape_mismatch_in_later_bucket_with_load_instant_loads_nothing():
    # The first bucket's manifest lists every bucket's names, shapes and dtypes, so the
    # mismatch in a later bucket is seen before the first one is loaded.
    src = Net(0)
    dst = dict(Net(1).state_dict())
    dst["head.weight"] = torch.zeros(20, 13)
    before = {k: v.clone() for k, v in dst.items()}
    s = BucketWeightSyncer(bucket_size=200)
    r = BucketWeightSyncer(bucket_size=200, load_instant=True)
    a, b = inproc_pair(timeout=10)
    await s.init_sender(src.state_dict(), None, a.send)
    await r.init_receiver(dst, b.recv)
    await s.sync(src.state_dict(), a.send, 1)
    with pytest.raises(ValueError, match="head.weight"):
        await r.apply(dst, b.recv)
    for k, v in dst.items():
        assert torch.equal(bits(v), bits(before[k])), k
