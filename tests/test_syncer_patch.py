"""Patch mode end to end over the in-process channel (W1, W5-W15, B2, B3)."""

from __future__ import annotations

import asyncio
import copy
from collections import OrderedDict

import pytest
import torch
from torch import nn

from aiosync.syncers import (CompressedWeightPatch, EmptyWeightPatch, PatchWeightSyncer, WeightPatch, WeightSyncer,
                             collect_param_names_need_sync)
from aiosync.transports.inproc import inproc_pair
from aiosync.errors import (CodecUnavailableError, ConfigError, HandshakeError, PatchChainError, VersionError)
from aiosync.syncers.common.payloads import ReceiverMetadata, SenderHello
from helpers import bits



# ----------------------------------------------------------------------------- helpers


def assert_bit_exact(src_sd, dst_sd, keys=None):
    keys = list(src_sd) if keys is None else list(keys)
    assert keys
    for k in keys:
        s, d = src_sd[k].detach(), dst_sd[k].detach()
        assert tuple(s.shape) == tuple(d.shape), k
        want = s.to(d.dtype)
        assert torch.equal(bits(want), bits(d)), f"{k} differs"


def differs(src_sd, dst_sd, key) -> bool:
    s, d = src_sd[key].detach(), dst_sd[key].detach()
    return not torch.equal(bits(s.to(d.dtype)), bits(d))


class Net(nn.Module):
    """Small model with 0-d to 3-d tensors, a frozen parameter, and int64 / bool buffers."""

    def __init__(self, seed: int = 0, tied: bool = False) -> None:
        super().__init__()
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            self.emb = nn.Embedding(32, 16)
            self.conv = nn.Conv1d(4, 6, 3)  # 3-D weight (6, 4, 3)
            self.l1 = nn.Linear(16, 24)
            self.l10 = nn.Linear(24, 16)  # "l1" as a prefix must not select "l10.*"
            self.norm = nn.LayerNorm(16)
            self.head = nn.Linear(16, 32, bias=False)
            self.frozen = nn.Parameter(torch.randn(3, 4), requires_grad=False)
            self.scale = nn.Parameter(torch.tensor(1.5 + seed))  # 0-d trainable parameter
        if tied:
            self.head.weight = self.emb.weight
        self.register_buffer("step", torch.tensor(0, dtype=torch.int64))
        self.register_buffer("counts", torch.zeros(7, dtype=torch.int64))
        self.register_buffer("mask", torch.zeros(2, 3, dtype=torch.bool))
        self.register_buffer("cache", torch.zeros(5), persistent=False)

    def forward(self, idx: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(idx)
        c = self.conv(x).mean(dim=(1, 2))
        h = self.norm(self.l10(torch.tanh(self.l1(h))) + c[:, None]) * self.scale
        return self.head(h)


def make_opt(model: nn.Module, lr: float = 1e-3) -> torch.optim.Optimizer:
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr, betas=(0.9, 0.95))


def train_step(model: Net, opt: torch.optim.Optimizer, step: int) -> None:
    g = torch.Generator().manual_seed(1000 + step)
    idx = torch.randint(0, 32, (8,), generator=g)
    x = torch.randn(8, 4, 10, generator=g)
    loss = model(idx, x).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    with torch.no_grad():
        model.step += 1
        model.counts[step % 7] += 2**33 + step  # values beyond 32 bits
        model.counts[(step + 3) % 7] -= 5 * step  # and negative ones
        model.mask.view(-1)[step % 6] ^= True
        model.cache += 1.0  # non-persistent: never synced


async def connect(sender, receiver, src_sd, dst_sd, names=None, timeout=10):
    a, b = inproc_pair(timeout=timeout)
    sent: list = []

    async def send(payload):
        sent.append(payload)
        await a.send(payload)

    await asyncio.gather(sender.init_sender(src_sd, names, send, a.recv),
                         receiver.init_receiver(dst_sd, b.recv, b.send))
    return send, b, sent


# ------------------------------------------------------------------------- round trips
@pytest.mark.parametrize("compression", ["none", "zstd"])
@pytest.mark.parametrize("delta", [True, False])
@pytest.mark.parametrize("encoding", ["coo", "flat"])
async def test_round_trip_over_versions(encoding, delta, compression):
    src = Net(0)
    dst = copy.deepcopy(src)
    opt = make_opt(src)
    names = collect_param_names_need_sync(src)
    s = PatchWeightSyncer(delta_encoding=delta, compression=compression, encoding=encoding)
    r = PatchWeightSyncer(delta_encoding=delta, compression=compression, encoding=encoding)
    send, b, sent = await connect(s, r, src.state_dict(), dst.state_dict(), names)
    for version in (1, 2, 3, 7):
        train_step(src, opt, version)
        assert differs(src.state_dict(), dst.state_dict(), "l1.weight")
        await s.sync(src.state_dict(), send, version)
        applied = await r.apply(dst, b.recv)
        assert applied == version
        assert r.version == version
        assert_bit_exact(src.state_dict(), dst.state_dict(), names)
        patch = sent[-1]
        want_type = WeightPatch if compression == "none" else CompressedWeightPatch
        assert type(patch) is want_type
        assert patch.version == version
        assert patch.encoding == encoding
        assert patch.delta_encoded == (delta and encoding == "coo")
        assert s.statistics().changed > 0 and r.statistics().changed == s.statistics().changed
    # the frozen parameter and the non-persistent buffer were never touched
    assert torch.equal(dst.cache, torch.zeros(5))


async def test_empty_patch_still_returns_version():
    src = Net(0)
    dst = copy.deepcopy(src)
    for compression in ("none", "zstd"):
        s = PatchWeightSyncer(compression=compression, encoding="flat")
        r = PatchWeightSyncer(compression=compression, encoding="flat")
        send, b, sent = await connect(s, r, src.state_dict(), dst.state_dict())
        before = {k: v.clone() for k, v in dst.state_dict().items()}
        await s.sync(src.state_dict(), send, 5)
        assert type(sent[-1]) is EmptyWeightPatch
        assert sent[-1].version == 5
        assert await r.apply(dst, b.recv) == 5
        assert r.version == 5
        assert_bit_exact(before, dst.state_dict())
        # a real change after the empty one still chains correctly
        with torch.no_grad():
            src.l1.weight[0, 0] += 1.0
        await s.sync(src.state_dict(), send, 6)
        assert isinstance(sent[-1], (WeightPatch, CompressedWeightPatch))
        assert sent[-1].base_version == 5
        assert sent[-1].nnz == 1
        assert await r.apply(dst, b.recv) == 6
        assert_bit_exact(src.state_dict(), dst.state_dict())


@pytest.mark.parametrize("encoding", ["coo", "flat"])
async def test_receiver_key_order_differs(encoding):
    src = Net(0)
    opt = make_opt(src)
    dst_model = copy.deepcopy(src)
    # the receiver's state dict lists the same tensors in reverse order
    dst = OrderedDict(reversed(list(dst_model.state_dict().items())))
    assert list(dst) != list(src.state_dict())
    s = PatchWeightSyncer(encoding=encoding, compression="zstd")
    r = PatchWeightSyncer(encoding=encoding, compression="zstd")
    names = collect_param_names_need_sync(src)
    send, b, _ = await connect(s, r, src.state_dict(), dst, names)
    for version in (1, 2):
        train_step(src, opt, version)
        await s.sync(src.state_dict(), send, version)
        assert await r.apply(dst, b.recv) == version
        assert_bit_exact(src.state_dict(), dst, names)
        assert_bit_exact(src.state_dict(), dst_model.state_dict(), names)


@pytest.mark.parametrize("builder_kernel", ["auto", "torch"])
@pytest.mark.parametrize("encoding", ["coo", "flat"])
async def test_fp32_sender_bf16_receiver(encoding, builder_kernel):
    src = Net(0)
    dst = copy.deepcopy(src).to(torch.bfloat16)
    assert dst.l1.weight.dtype == torch.bfloat16 and dst.counts.dtype == torch.int64 and dst.mask.dtype == torch.bool
    opt = make_opt(src, lr=1e-4)  # small steps: only some bf16 values move
    names = collect_param_names_need_sync(src)
    s = PatchWeightSyncer(encoding=encoding, compression="zstd", builder_kernel=builder_kernel)
    r = PatchWeightSyncer(encoding=encoding, compression="zstd")
    send, b, _ = await connect(s, r, src.state_dict(), dst.state_dict(), names)
    float_elems = sum(v.numel() for k, v in src.state_dict().items() if k in names and v.is_floating_point())
    for version in range(1, 5):
        train_step(src, opt, version)
        await s.sync(src.state_dict(), send, version)
        assert await r.apply(dst, b.recv) == version
        assert_bit_exact(src.state_dict(), dst.state_dict(), names)
        assert 0 < s.statistics().changed < float_elems
    # the snapshot is kept in the receiver's dtype
    assert s.snapshot.tensor(0).dtype in (torch.bfloat16, torch.int64, torch.bool)


async def test_int64_and_bool_buffers_exact():
    src = {
        "w": torch.randn(4, 5),
        "ids": torch.tensor([0, -1, 2**62, -(2**63), 2**63 - 1, 17], dtype=torch.int64),
        "flag": torch.tensor([True, False, True]),
        "scalar_i": torch.tensor(-7, dtype=torch.int64),
        "small": torch.tensor([1, 2, 3], dtype=torch.int32),
        "bytes": torch.tensor([0, 255, 128], dtype=torch.uint8),
    }
    for encoding in ("coo", "flat"):
        dst = {k: v.clone() for k, v in src.items()}
        sender_sd = {k: v.clone() for k, v in src.items()}
        s = PatchWeightSyncer(encoding=encoding, compression="zstd")
        r = PatchWeightSyncer(encoding=encoding, compression="zstd")
        send, b, _ = await connect(s, r, sender_sd, dst)
        sender_sd["ids"].copy_(torch.tensor([2**63 - 1, 0, -(2**62) - 3, 2**63 - 1, -(2**63), 2**40 + 1]))
        sender_sd["flag"].copy_(torch.tensor([False, False, True]))
        sender_sd["scalar_i"].fill_(2**35)
        sender_sd["small"].copy_(torch.tensor([-(2**31), 2**31 - 1, 3], dtype=torch.int32))
        sender_sd["bytes"].copy_(torch.tensor([255, 0, 128], dtype=torch.uint8))
        await s.sync(sender_sd, send, 1)
        assert await r.apply(dst, b.recv) == 1
        for k in src:
            assert dst[k].dtype == src[k].dtype
            assert torch.equal(dst[k], sender_sd[k]), k
        assert s.statistics().changed == 6 + 1 + 1 + 2 + 2


# --------------------------------------------------------------------- init bootstrap
async def test_init_bootstrap_whole_state_dict():
    src = Net(0)
    dst = Net(1).to(torch.bfloat16)  # different weights, different dtype
    with torch.no_grad():
        src.step.fill_(41)
        src.counts.copy_(torch.arange(7) * (2**40))
        src.mask[0, 1] = True
    differing = [k for k in src.state_dict() if differs(src.state_dict(), dst.state_dict(), k)]
    for k in ("emb.weight", "conv.weight", "l1.weight", "l10.bias", "frozen", "scale", "step", "counts", "mask"):
        assert k in differing, k
    names = collect_param_names_need_sync(src)
    s = PatchWeightSyncer(encoding="flat", compression="zstd", init_sync_enabled=True, init_sync_bucket_size=512)
    r = PatchWeightSyncer(encoding="flat", compression="zstd")
    send, b, sent = await connect(s, r, src.state_dict(), dst.state_dict(), names)
    # null prefixes: the whole state dict, buffers and the frozen parameter included
    assert_bit_exact(src.state_dict(), dst.state_dict())
    assert torch.equal(dst.frozen, src.frozen.to(torch.bfloat16))
    assert dst.l1.weight.dtype == torch.bfloat16 and dst.counts.dtype == torch.int64
    assert sum(isinstance(p, SenderHello) for p in sent) == 1
    buckets = [p for p in sent if isinstance(p, dict)]
    assert len(buckets) > 1  # small bucket size: several buckets
    # patches continue from the bootstrapped state
    opt = make_opt(src, lr=1e-4)
    for version in (1, 2):
        train_step(src, opt, version)
        await s.sync(src.state_dict(), send, version)
        assert await r.apply(dst, b.recv) == version
        assert_bit_exact(src.state_dict(), dst.state_dict(), names)


async def test_init_bootstrap_selected_prefixes():
    src = Net(0)
    dst = Net(1)
    with torch.no_grad():
        src.counts.fill_(2**40)
    dst_before = {k: v.clone() for k, v in dst.state_dict().items()}
    s = PatchWeightSyncer(init_sync_enabled=True, init_sync_prefixes=["l1", "norm.weight", "counts"])
    r = PatchWeightSyncer()
    await connect(s, r, src.state_dict(), dst.state_dict(), collect_param_names_need_sync(src))
    selected = ["l1.weight", "l1.bias", "norm.weight", "counts"]
    assert_bit_exact(src.state_dict(), dst.state_dict(), selected)
    for k, v in dst.state_dict().items():
        if k not in selected:  # l10.*, norm.bias, emb, ... untouched
            assert torch.equal(bits(v), bits(dst_before[k])), k
    assert differs(src.state_dict(), dst.state_dict(), "l10.weight")
    assert differs(src.state_dict(), dst.state_dict(), "emb.weight")


async def test_prefix_matching_nothing_raises():
    src = Net(0)
    dst = Net(0)
    s = PatchWeightSyncer(init_sync_enabled=True, init_sync_prefixes=["l1", "decoder"])
    r = PatchWeightSyncer(recv_timeout=5)
    a, b = inproc_pair(timeout=10)
    res = await asyncio.gather(s.init_sender(src.state_dict(), None, a.send, a.recv),
                               r.init_receiver(dst.state_dict(), b.recv, b.send), return_exceptions=True)
    assert isinstance(res[0], ConfigError) and isinstance(res[0], ValueError)
    assert "decoder" in str(res[0])
    # the receiver is told, instead of waiting for an answer that never comes
    assert isinstance(res[1], HandshakeError), res[1]
    assert "decoder" in str(res[1])


async def test_prefix_is_matched_at_dot_boundaries_only():
    src = Net(0)
    dst = Net(1)
    s = PatchWeightSyncer(init_sync_enabled=True, init_sync_prefixes=["l1"])
    r = PatchWeightSyncer()
    await connect(s, r, src.state_dict(), dst.state_dict())
    assert_bit_exact(src.state_dict(), dst.state_dict(), ["l1.weight", "l1.bias"])
    assert differs(src.state_dict(), dst.state_dict(), "l10.weight")
    assert differs(src.state_dict(), dst.state_dict(), "l10.bias")


@pytest.mark.parametrize("init_sync", [False, True])
async def test_sender_key_missing_on_receiver_fails_both_sides(init_sync):
    src = Net(0)
    dst = dict(Net(0).state_dict())
    del dst["l10.bias"]
    s = PatchWeightSyncer(init_sync_enabled=init_sync)
    r = PatchWeightSyncer(recv_timeout=5)
    a, b = inproc_pair(timeout=10)
    res = await asyncio.gather(s.init_sender(src.state_dict(), None, a.send, a.recv),
                               r.init_receiver(dst, b.recv, b.send), return_exceptions=True)
    assert isinstance(res[0], HandshakeError), res[0]
    assert "l10.bias" in str(res[0])
    assert isinstance(res[1], HandshakeError), res[1]
    assert "l10.bias" in str(res[1])


async def test_shape_mismatch_fails_both_sides_naming_key():
    src = Net(0)
    dst = dict(Net(0).state_dict())
    dst["l1.weight"] = torch.zeros(24, 17)
    s = PatchWeightSyncer()
    r = PatchWeightSyncer(recv_timeout=5)
    a, b = inproc_pair(timeout=10)
    res = await asyncio.gather(s.init_sender(src.state_dict(), None, a.send, a.recv),
                               r.init_receiver(dst, b.recv, b.send), return_exceptions=True)
    assert isinstance(res[0], HandshakeError) and "l1.weight" in str(res[0])
    assert isinstance(res[1], HandshakeError) and "l1.weight" in str(res[1])


async def test_integer_dtype_mismatch_fails_both_sides_naming_key():
    src = Net(0)
    dst = dict(Net(0).state_dict())
    dst["counts"] = dst["counts"].to(torch.int32)  # only floating tensors may change dtype
    s = PatchWeightSyncer()
    r = PatchWeightSyncer(recv_timeout=5)
    a, b = inproc_pair(timeout=10)
    res = await asyncio.gather(s.init_sender(src.state_dict(), None, a.send, a.recv),
                               r.init_receiver(dst, b.recv, b.send), return_exceptions=True)
    assert isinstance(res[0], HandshakeError) and "counts" in str(res[0])
    assert isinstance(res[1], HandshakeError) and "counts" in str(res[1])


async def test_non_viewable_receiver_tensor_raises_at_init_naming_key():
    src = Net(0)
    dst = dict(Net(0).state_dict())
    w = dst["conv.weight"]  # (6, 4, 3)
    odd = torch.empty(6, 3, 4).permute(0, 2, 1)
    assert odd.shape == w.shape and not odd.is_contiguous()
    odd.copy_(w)
    dst["conv.weight"] = odd
    s = PatchWeightSyncer()
    r = PatchWeightSyncer(recv_timeout=5)
    a, b = inproc_pair(timeout=10)
    res = await asyncio.gather(s.init_sender(src.state_dict(), None, a.send, a.recv),
                               r.init_receiver(dst, b.recv, b.send), return_exceptions=True)
    assert isinstance(res[0], ValueError) and "conv.weight" in str(res[0])
    assert isinstance(res[1], ValueError) and "conv.weight" in str(res[1])


async def test_metadata_handshake_carries_keys_in_canonical_order_shapes_dtypes():
    dst = OrderedDict([("b", torch.zeros(2, 3, dtype=torch.bfloat16)), ("a", torch.zeros((), dtype=torch.int64))])
    r = PatchWeightSyncer(recv_timeout=5)
    a, b = inproc_pair(timeout=10)
    task = asyncio.ensure_future(r.init_receiver(dst, b.recv, b.send))
    meta = await a.recv()
    assert isinstance(meta, ReceiverMetadata)
    assert meta.ordered_keys == ["a", "b"]  # sorted by name, whatever the state dict's order
    assert [tuple(s) for s in meta.original_shapes] == [(), (2, 3)]
    assert meta.dtypes == ["int64", "bfloat16"]
    await a.send(SenderHello(ok=True, synced_ordinals=[0, 1]))
    await task


# ------------------------------------------------------------------ what is synced (W5)
async def test_frozen_skipped_persistent_buffers_synced_non_persistent_not():
    src = Net(0)
    names = collect_param_names_need_sync(src)
    assert "frozen" not in names
    assert "cache" not in names and "cache" not in src.state_dict()
    for k in ("step", "counts", "mask", "scale", "l1.weight", "conv.weight"):
        assert k in names
    assert names == [k for k in src.state_dict() if k != "frozen"]
    dst = copy.deepcopy(src)
    s = PatchWeightSyncer(encoding="flat", compression="zstd")
    r = PatchWeightSyncer(encoding="flat", compression="zstd")
    send, b, sent = await connect(s, r, src.state_dict(), dst.state_dict(), names)
    opt = make_opt(src)
    train_step(src, opt, 1)
    with torch.no_grad():
        src.frozen.add_(1.0)
    await s.sync(src.state_dict(), send, 1)
    assert await r.apply(dst, b.recv) == 1
    assert_bit_exact(src.state_dict(), dst.state_dict(), names)
    assert differs(src.state_dict(), dst.state_dict(), "frozen")
    assert torch.equal(dst.cache, torch.zeros(5)) and not torch.equal(src.cache, torch.zeros(5))
    assert int(dst.step) == 1


@pytest.mark.parametrize("receiver_tied", [True, False])
@pytest.mark.parametrize("encoding", ["coo", "flat"])
async def test_tied_parameters(encoding, receiver_tied):
    src = Net(0, tied=True)
    assert src.head.weight is src.emb.weight
    names = collect_param_names_need_sync(src)
    assert "emb.weight" in names and "head.weight" in names
    dst = Net(5, tied=receiver_tied).to(torch.bfloat16)
    s = PatchWeightSyncer(encoding=encoding, compression="zstd", init_sync_enabled=True)
    r = PatchWeightSyncer(encoding=encoding, compression="zstd")
    send, b, _ = await connect(s, r, src.state_dict(), dst.state_dict(), names)
    assert_bit_exact(src.state_dict(), dst.state_dict(), names)
    opt = make_opt(src, lr=1e-3)
    for version in (1, 2, 3):
        train_step(src, opt, version)
        await s.sync(src.state_dict(), send, version)
        assert await r.apply(dst, b.recv) == version
        assert_bit_exact(src.state_dict(), dst.state_dict(), names)
    assert (dst.head.weight is dst.emb.weight) == receiver_tied


# ---------------------------------------------------------------- bit-exactness (B2)
@pytest.mark.parametrize("builder_kernel", ["auto", "torch"])
@pytest.mark.parametrize("encoding", ["coo", "flat"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
async def test_nan_and_negative_zero_bit_exact(dtype, encoding, builder_kernel):
    src = {"w": torch.zeros(3, 70, dtype=dtype), "v": torch.ones(5, dtype=dtype)}
    src["w"][1, 5] = float("nan")
    src["v"][2] = float("nan")
    dst = {k: v.clone() for k, v in src.items()}
    s = PatchWeightSyncer(encoding=encoding, compression="zstd", builder_kernel=builder_kernel)
    r = PatchWeightSyncer(encoding=encoding, compression="zstd")
    send, b, sent = await connect(s, r, src, dst)
    # unchanged NaNs (same bits) are not changes: an empty patch
    await s.sync(src, send, 1)
    assert type(sent[-1]) is EmptyWeightPatch
    assert await r.apply(dst, b.recv) == 1
    w_bits = bits(src["w"]).view(-1)
    w_bits[0] = bits(torch.tensor(-0.0, dtype=dtype))  # 0.0 -> -0.0
    w_bits[69] = bits(torch.tensor(-0.0, dtype=dtype))
    w_bits[209] = bits(torch.tensor(float("nan"), dtype=dtype))  # 0.0 -> NaN (last element)
    nan_payload = bits(torch.tensor(float("nan"), dtype=dtype)) | 1  # NaN with another payload
    w_bits[75] = nan_payload  # NaN -> other NaN: a change
    v_bits = bits(src["v"]).view(-1)
    v_bits[0] = bits(torch.tensor(-float("inf"), dtype=dtype))
    await s.sync(src, send, 2)
    assert s.statistics().changed == 5
    assert await r.apply(dst, b.recv) == 2
    for k in src:
        assert torch.equal(bits(dst[k]), bits(src[k])), k
    assert torch.signbit(dst["w"].view(-1)[0]) and dst["w"].view(-1)[0] == 0
    assert int(bits(dst["w"]).view(-1)[75]) == int(nan_payload)
    # -0.0 -> 0.0 back again
    w_bits[0] = 0
    await s.sync(src, send, 3)
    assert s.statistics().changed == 1
    assert await r.apply(dst, b.recv) == 3
    assert not torch.signbit(dst["w"].view(-1)[0])
    assert torch.equal(bits(dst["w"]), bits(src["w"]))


# ------------------------------------------------------------------------ versions
async def test_versions_must_increase():
    src = Net(0)
    dst = copy.deepcopy(src)
    s = PatchWeightSyncer()
    r = PatchWeightSyncer()
    send, b, sent = await connect(s, r, src.state_dict(), dst.state_dict())
    await s.sync(src.state_dict(), send, 5)
    assert await r.apply(dst, b.recv) == 5
    n_sent = len(sent)
    for bad in (5, 4, 0):
        with pytest.raises(VersionError):
            await s.sync(src.state_dict(), send, bad)
    for bad in (-1, 1.5, True):
        with pytest.raises(VersionError):
            await s.sync(src.state_dict(), send, bad)
    assert len(sent) == n_sent  # nothing was sent for a refused version
    # the receiver refuses a patch whose version does not advance
    with pytest.raises(VersionError):
        await r.apply_payload(dst, EmptyWeightPatch(version=5, base_version=5))
    with pytest.raises(VersionError):
        await r.apply_payload(dst, EmptyWeightPatch(version=3, base_version=5))
    assert r.version == 5
    await s.sync(src.state_dict(), send, 6)
    assert await r.apply(dst, b.recv) == 6


async def test_version_above_2_pow_32():
    src = Net(0)
    dst = copy.deepcopy(src)
    opt = make_opt(src)
    s = PatchWeightSyncer(encoding="flat", compression="zstd")
    r = PatchWeightSyncer(encoding="flat", compression="zstd")
    send, b, _ = await connect(s, r, src.state_dict(), dst.state_dict())
    for version in (2**32 + 5, 2**33, 2**62 + 1):
        train_step(src, opt, version % 1000)
        await s.sync(src.state_dict(), send, version)
        applied = await r.apply(dst, b.recv)
        assert applied == version and type(applied) is int
        assert_bit_exact(src.state_dict(), dst.state_dict())


@pytest.mark.parametrize("compression", ["none", "zstd"])
async def test_patch_for_another_base_version_raises_chain_error(compression):
    src = Net(0)
    dst = copy.deepcopy(src)
    opt = make_opt(src)
    s = PatchWeightSyncer(encoding="flat", compression=compression)
    r = PatchWeightSyncer(encoding="flat", compression=compression)
    send, b, sent = await connect(s, r, src.state_dict(), dst.state_dict())
    for version in (1, 2, 3):
        train_step(src, opt, version)
        await s.sync(src.state_dict(), send, version)
    p1, p2, p3 = await b.recv(), await b.recv(), await b.recv()
    before = {k: v.clone() for k, v in dst.state_dict().items()}
    # receiver at None gets the patch built on 1
    with pytest.raises(PatchChainError) as info:
        await r.apply_payload(dst, p2)
    assert info.value.expected_base == 1 and info.value.receiver_version is None
    assert r.version is None
    assert_bit_exact(before, dst.state_dict())
    assert await r.apply_payload(dst, p1) == 1
    mid = {k: v.clone() for k, v in dst.state_dict().items()}
    # receiver at 1 gets the patch built on 2: refused, nothing written
    with pytest.raises(PatchChainError) as info:
        await r.apply_payload(dst, p3)
    assert info.value.expected_base == 2 and info.value.receiver_version == 1
    assert r.version == 1
    assert_bit_exact(mid, dst.state_dict())
    assert await r.apply_payload(dst, p2) == 2
    assert await r.apply_payload(dst, p3) == 3
    assert_bit_exact(src.state_dict(), dst.state_dict())


# ---------------------------------------------------------------- builder kernels
def _payload_fields(p):
    out = {}
    for name in ("version", "base_version", "encoding", "delta_encoded"):
        out[name] = getattr(p, name)
    for name in ("ordinals", "nnz_per_tensor", "rows", "cols", "values", "gap_bytes", "old_hashes"):
        t = getattr(p, name)
        out[name] = None if t is None else (t.dtype, t.tolist())
    return out


@pytest.mark.parametrize("encoding,delta", [("coo", True), ("coo", False), ("flat", False)])
@pytest.mark.parametrize("receiver_dtype", [None, torch.bfloat16])
async def test_torch_builder_kernel_matches_numba(encoding, delta, receiver_dtype):
    src = Net(0)
    dst_a = copy.deepcopy(src)
    if receiver_dtype is not None:
        dst_a = dst_a.to(receiver_dtype)
    dst_b = copy.deepcopy(dst_a)
    opt = make_opt(src, lr=3e-4)
    kw = dict(encoding=encoding, delta_encoding=delta, compression="none")
    s_auto = PatchWeightSyncer(builder_kernel="auto", **kw)
    s_torch = PatchWeightSyncer(builder_kernel="torch", **kw)
    r_a, r_b = PatchWeightSyncer(**kw), PatchWeightSyncer(**kw)
    send_a, b_a, sent_a = await connect(s_auto, r_a, src.state_dict(), dst_a.state_dict())
    send_b, b_b, sent_b = await connect(s_torch, r_b, src.state_dict(), dst_b.state_dict())
    for version in (1, 2, 3):
        train_step(src, opt, version)
        await s_auto.sync(src.state_dict(), send_a, version)
        await s_torch.sync(src.state_dict(), send_b, version)
        pa, pb = sent_a[-1], sent_b[-1]
        assert type(pa) is type(pb) is WeightPatch
        assert pa.nnz > 0
        # the drift hashes too: the fused numba builder and the torch path agree bit for bit
        assert (pa.old_hashes is not None) == (encoding == "flat")
        assert _payload_fields(pa) == _payload_fields(pb)
        assert await r_a.apply(dst_a, b_a.recv) == version
        assert await r_b.apply(dst_b, b_b.recv) == version
        assert_bit_exact(src.state_dict(), dst_a.state_dict())
        assert_bit_exact(src.state_dict(), dst_b.state_dict())


# ---------------------------------------------------------------- codecs at build time
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error raised without a GPU")
def test_nvcomp_without_gpu_fails_when_built():
    with pytest.raises(ConfigError, match="transport_device"):
        PatchWeightSyncer(compression="nvcomp_lz4")
    # no GPU: the device that is not there is refused with the config (issue 33), naming it
    unavailable = (ConfigError, "transport_device is 'cuda' but this machine has 0 CUDA") \
        if not torch.cuda.is_available() else (CodecUnavailableError, "")
    with pytest.raises(unavailable[0], match=unavailable[1]):
        PatchWeightSyncer(compression="nvcomp_lz4", transport_device="cuda")
    with pytest.raises(unavailable[0], match=unavailable[1]):
        PatchWeightSyncer(compression="nvcomp_zstd", transport_device="cuda")
    with pytest.raises(unavailable[0], match=unavailable[1]):
        WeightSyncer.create({"type": "patch", "patch": {"compression": "nvcomp_lz4", "transport_device": "cuda"}})
    with pytest.raises(ConfigError):
        WeightSyncer.create({"type": "patch", "patch": {"compression": "nvcomp_lz4"}})
