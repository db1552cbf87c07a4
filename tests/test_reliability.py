"""Reliability of the syncers (SPEC §7, B3): patch-chain integrity, checksums, handshake
sessions, bucket manifests, and clear errors that change nothing.

Every "nothing changed" below is checked bit for bit against a copy taken before.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading

import anyio
import pytest
import torch

from aiosync.syncers import BucketWeightSyncer, PatchWeightSyncer, WeightSyncer
from aiosync.syncers.faults import ApplyFaults, FlakyBucketSyncer, FlakyPatchSyncer
from aiosync.transports.inproc import inproc_pair
from aiosync.configs import load_config
from aiosync.errors import (AiosyncError, ApplyError, ChecksumError, ConfigError, HandshakeError, PatchChainError,
                            PayloadError, PeerTimeoutError, TransportError, VersionError)
from aiosync.syncers.bucket.format import BUCKET_KEY, CHECKSUM_KEY, MANIFEST_KEY, SESSION_KEY, VERSION_KEY
from aiosync.syncers.config import WeightSyncerConfig
from aiosync.syncers.common.integrity import decode_manifest, tensor_checksum
from aiosync.syncers.common.payloads import EmptyWeightPatch, SenderHello, WeightPatch
from helpers import bits, recv_from

FORMATS = [("coo", True), ("flat", False)]




def snapshot(sd: dict) -> dict:
    return {k: v.clone() for k, v in sd.items()}


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(bits(a[k]), bits(b[k])) for k in a)


def state(v: int, big: bool = False) -> dict[str, torch.Tensor]:
    """Weights that are a pure function of ``v``; about a quarter of the floats change per version."""
    g = torch.Generator().manual_seed(3)
    n = 4096 if big else 64
    base = {"w": torch.randn(n // 16, 16, generator=g), "b": torch.randn(16, generator=g),
            "h": torch.randn(4, 2, 8, generator=g)}
    out = {}
    for k, t in base.items():
        phase = torch.arange(t.numel()).reshape(t.shape) % 4
        out[k] = t + 0.125 * torch.div(v + phase, 4, rounding_mode="floor").to(t.dtype)
    out["step"] = torch.tensor(v, dtype=torch.int64)
    return out


def receiver_model() -> dict[str, torch.Tensor]:
    return {"w": torch.zeros(4, 16, dtype=torch.bfloat16), "b": torch.zeros(16), "h": torch.zeros(4, 2, 8),
            "step": torch.tensor(-1)}


def holds(model: dict, v: int) -> bool:
    return all(torch.equal(model[k], t.to(model[k].dtype)) for k, t in state(v).items())


async def pair(sender, receiver, src, dst):
    a, b = inproc_pair(timeout=10)
    await asyncio.gather(sender.init_sender(src, None, a.send, a.recv), receiver.init_receiver(dst, b.recv, b.send))
    return a, b


def patch_pair(encoding="flat", delta=False, compression="zstd", checksums=False, cls=PatchWeightSyncer):
    kw = dict(encoding=encoding, delta_encoding=delta, compression=compression, verify_checksums=checksums,
              init_sync_enabled=True, recv_timeout=5)
    return PatchWeightSyncer(**kw), cls(**kw)


# ------------------------------------------------------------------ patch chain (B3)

async def test_a_lost_patch_breaks_the_chain_loudly_and_a_rebootstrap_repairs_it():
    """The sender's snapshot advances even when sending fails, so the next patch names the
    lost one as its base: the receiver refuses it instead of silently missing changes."""
    s, r = patch_pair()
    src, dst = state(0), receiver_model()
    a, b = await pair(s, r, src, dst)
    await s.sync(state(1), a.send, 1)
    assert await r.apply(dst, b.recv) == 1

    async def broken_send(payload):
        raise TransportError("the link went down")

    with pytest.raises(TransportError):
        await s.sync(state(2), broken_send, 2)  # patch 2 is lost
    await s.sync(state(3), a.send, 3)
    before = snapshot(dst)
    with pytest.raises(PatchChainError) as info:
        await r.apply(dst, b.recv)
    assert info.value.expected_base == 2 and info.value.receiver_version == 1
    assert same(before, dst) and r.version == 1 and holds(dst, 1)
    # repair: a fresh handshake with a full bootstrap, then patches again
    s2, r2 = patch_pair()
    a, b = await pair(s2, r2, state(3), dst)
    await s2.sync(state(4), a.send, 4)
    assert await r2.apply(dst, b.recv) == 4 and holds(dst, 4)


@pytest.mark.both_loops
async def test_a_sender_cancelled_mid_sync_keeps_the_chain_honest():
    s, r = patch_pair()
    src, dst = state(0), receiver_model()
    a, b = await pair(s, r, src, dst)

    sending, never = anyio.Event(), anyio.Event()

    async def hanging_send(payload):
        sending.set()
        await never.wait()

    async def cancel_while_sending():
        await sending.wait()
        scope.cancel()

    async with anyio.create_task_group() as tg:
        with anyio.CancelScope() as scope:
            tg.start_soon(cancel_while_sending)
            await s.sync(state(1), hanging_send, 1)  # cancelled while "sending"
    assert scope.cancelled_caught
    await s.sync(state(2), a.send, 2)
    with pytest.raises(PatchChainError):
        await r.apply(dst, b.recv)
    assert r.version is None and holds(dst, 0)


async def test_a_build_that_fails_half_way_refuses_every_later_sync():
    s, r = patch_pair()
    src, dst = state(0), receiver_model()
    a, _ = await pair(s, r, src, dst)

    def failing_build(state_dict, *encoding):
        raise RuntimeError("device lost in the middle of the diff")

    good_build, s._build = s._build, failing_build
    with pytest.raises(RuntimeError, match="device lost"):
        await s.sync(state(1), a.send, 1)
    s._build = good_build
    with pytest.raises(PatchChainError, match="init_sender"):
        await s.sync(state(2), a.send, 2)


@pytest.mark.parametrize("kind", ["duplicated", "reordered", "backwards"])
async def test_duplicated_reordered_and_backward_patches_are_refused(kind):
    s, r = patch_pair(checksums=True)
    src, dst = state(0), receiver_model()
    a, b = await pair(s, r, src, dst)
    for v in (1, 2, 3):
        await s.sync(state(v), a.send, v)
    p1, p2, p3 = [await b.recv() for _ in range(3)]
    assert await r.apply_payload(dst, p1) == 1
    if kind == "duplicated":
        order, err = [p1], VersionError
    elif kind == "reordered":
        order, err = [p3], PatchChainError
    else:
        assert await r.apply_payload(dst, p2) == 2
        order, err = [p1], VersionError
    before, version = snapshot(dst), r.version
    for p in order:
        with pytest.raises(err):
            await r.apply_payload(dst, p)
    assert same(before, dst) and r.version == version
    for p in (p2, p3):
        if p.version > r.version:
            await r.apply_payload(dst, p)
    assert r.version == 3 and holds(dst, 3)


async def test_a_patch_of_another_handshake_is_refused():
    """A stale patch from an earlier handshake (same base, same version) must not be applied to
    the receiver of a new one: the session ties them together."""
    s1, r1 = patch_pair()
    dst = receiver_model()
    a, b = await pair(s1, r1, state(0), dst)
    await s1.sync(state(1), a.send, 1)
    stale = await b.recv()
    s2, r2 = patch_pair()
    a, b = await pair(s2, r2, state(5), dst)  # re-bootstrapped to 5
    before = snapshot(dst)
    with pytest.raises(PayloadError, match="another handshake"):
        await r2.apply_payload(dst, dataclasses.replace(stale, base_version=None))
    assert same(before, dst) and r2.version is None
    await s2.sync(state(6), a.send, 6)
    assert await r2.apply(dst, b.recv) == 6 and holds(dst, 6)


async def test_stale_handshake_answers_and_bootstrap_buckets_are_refused():
    # a SenderHello answering another receiver's metadata
    r = PatchWeightSyncer(recv_timeout=5, init_sync_enabled=True)
    a, b = inproc_pair(timeout=5)
    dst = receiver_model()
    task = asyncio.ensure_future(r.init_receiver(dst, b.recv, b.send))
    meta = await a.recv()
    await a.send(SenderHello(ok=True, synced_ordinals=[0, 1, 2, 3], session=meta.session + 1))
    with pytest.raises(HandshakeError, match="another handshake"):
        await task
    # bootstrap buckets of another session
    s1, r1 = patch_pair()
    a1, b1 = inproc_pair(timeout=5)
    captured = []

    async def capture(p):
        captured.append(p)
        await a1.send(p)

    await asyncio.gather(s1.init_sender(state(3), None, capture, a1.recv), r1.init_receiver(receiver_model(), b1.recv, b1.send))
    bucket = next(p for p in captured if isinstance(p, dict))
    r2 = PatchWeightSyncer(recv_timeout=5, init_sync_enabled=True)
    a2, b2 = inproc_pair(timeout=5)
    before = snapshot(dst)
    task = asyncio.ensure_future(r2.init_receiver(dst, b2.recv, b2.send))
    meta = await a2.recv()
    await a2.send(SenderHello(ok=True, init_sync=True, synced_ordinals=[0, 1, 2, 3], session=meta.session))
    await a2.send(bucket)  # stamped with the first handshake's session
    with pytest.raises(PayloadError, match="another handshake"):
        await task
    assert same(before, dst)


@pytest.mark.both_loops
async def test_cancelling_an_apply_while_it_writes_commits_it_whole():
    """The worker thread that writes cannot be interrupted; the version must then move with
    the weights, never stay behind them."""
    s, r = patch_pair()
    dst = receiver_model()
    a, b = await pair(s, r, state(0), dst)
    await s.sync(state(1), a.send, 1)
    patch = await b.recv()
    original = r._write_sync
    writing, cancelled = threading.Event(), threading.Event()

    def slow(*args):
        writing.set()
        assert cancelled.wait(10)  # the caller is cancelled while this worker thread writes
        return original(*args)

    r._write_sync = slow

    async def cancel_once_writing():
        await anyio.to_thread.run_sync(writing.wait)
        scope.cancel()
        cancelled.set()

    async with anyio.create_task_group() as tg:
        with anyio.CancelScope() as scope:
            tg.start_soon(cancel_once_writing)
            await r.apply_payload(dst, patch)
    assert scope.cancel_called  # cancelled while the worker thread wrote
    assert r.version == 1 and holds(dst, 1)


# ------------------------------------------------------------------ checksums

@pytest.mark.parametrize("compression", ["none", "zstd"])
@pytest.mark.parametrize("encoding,delta", FORMATS, ids=["coo", "flat"])
async def test_checksums_round_trip_bit_exact(encoding, delta, compression):
    s, r = patch_pair(encoding, delta, compression, checksums=True)
    dst = receiver_model()
    a, b = await pair(s, r, state(0), dst)
    for v in (1, 2, 3):
        await s.sync(state(v), a.send, v)
        patch = await b.recv()
        assert patch.checksums is not None and patch.checksums.dtype == torch.int64
        assert await r.apply_payload(dst, patch) == v and holds(dst, v)


@pytest.mark.parametrize("compression", ["none", "zstd"])
@pytest.mark.parametrize("encoding,delta", FORMATS, ids=["coo", "flat"])
async def test_a_corrupted_value_is_caught_by_the_checksum_and_rolled_back(encoding, delta, compression):
    s, r = patch_pair(encoding, delta, compression, checksums=True)
    dst = receiver_model()
    a, b = await pair(s, r, state(0), dst)
    await s.sync(state(1), a.send, 1)
    assert await r.apply(dst, b.recv) == 1
    await s.sync(state(2), a.send, 2)
    patch = await b.recv()
    plain = patch
    if compression == "zstd":
        from aiosync.syncers.patch.codecs import decompress_patch

        plain = decompress_patch(patch, {o: lay.elem_size for o, lay in r._rx.layouts.items()})
    values = plain.values.clone()
    values[-1] ^= 0x01  # one flipped bit that still decodes to a valid patch
    bad = dataclasses.replace(plain, values=values)
    before = snapshot(dst)
    with pytest.raises(ChecksumError, match="rolled back"):
        await r.apply_payload(dst, bad)
    assert same(before, dst) and r.version == 1
    assert await r.apply_payload(dst, patch) == 2 and holds(dst, 2)


async def test_a_drifted_receiver_is_caught_by_the_checksum():
    """Flat patches carry differences against the receiver's old bits: if those drifted, the
    result is wrong, and only the checksum can tell."""
    s, r = patch_pair("flat", checksums=True)
    dst = receiver_model()
    a, b = await pair(s, r, state(0), dst)
    await s.sync(state(1), a.send, 1)
    patch = await b.recv()
    changed = patch.ordinals.tolist()
    key = list(dst)[changed[0]]
    dst[key].view(-1)[0] += 1  # someone wrote into the rollout model behind aiosync's back
    before = snapshot(dst)
    with pytest.raises(ChecksumError, match=repr(key)):
        await r.apply_payload(dst, patch)
    assert same(before, dst) and r.version is None


async def test_a_receiver_that_wants_checksums_refuses_a_patch_or_bootstrap_without():
    s = PatchWeightSyncer(encoding="flat", init_sync_enabled=True, recv_timeout=5)
    r = PatchWeightSyncer(encoding="flat", init_sync_enabled=True, recv_timeout=5, verify_checksums=True)
    dst = receiver_model()
    with pytest.raises(PayloadError, match="no checksum"):
        await pair(s, r, state(0), dst)
    assert same(receiver_model(), dst)  # the bootstrap bucket was refused before loading
    s = PatchWeightSyncer(encoding="flat", recv_timeout=5, init_sync_enabled=False)
    r = PatchWeightSyncer(encoding="flat", recv_timeout=5, verify_checksums=True, init_sync_enabled=False)
    dst = {k: v.to(dst[k].dtype) for k, v in state(0).items()}  # already holds version 0
    a, b = await pair(s, r, state(0), dst)
    await s.sync(state(1), a.send, 1)
    before = snapshot(dst)
    with pytest.raises(PayloadError, match="no checksums"):
        await r.apply(dst, b.recv)
    assert same(before, dst)


async def test_checksums_of_the_wrong_length_are_refused():
    s, r = patch_pair("flat", checksums=True)
    dst = receiver_model()
    a, b = await pair(s, r, state(0), dst)
    await s.sync(state(1), a.send, 1)
    patch = await b.recv()
    before = snapshot(dst)
    with pytest.raises(PayloadError, match="checksums"):
        await r.apply_payload(dst, dataclasses.replace(patch, checksums=patch.checksums[:-1]))
    assert same(before, dst)


def test_tensor_checksum_is_layout_independent():
    t = torch.randn(6, 4).to(torch.bfloat16)
    assert tensor_checksum(t) == tensor_checksum(t.t().contiguous().t())  # same values, other strides
    assert tensor_checksum(t) != tensor_checksum(t.flip(0))
    assert tensor_checksum(torch.tensor(True)) != tensor_checksum(torch.tensor(False))
    assert tensor_checksum(torch.zeros(0)) == 0


def test_verify_checksums_config_is_strict_and_shipped():
    for name in ("patch_syncer", "bucket_syncer"):
        cfg = load_config(f"weight_syncer/{name}")
        sub = cfg["patch" if name == "patch_syncer" else "bucket"]
        assert sub["verify_checksums"] is False
    syncer = WeightSyncer.create({"type": "patch", "patch": {"verify_checksums": True}})
    assert syncer.config.verify_checksums is True
    assert WeightSyncer.create({"type": "bucket", "bucket": {"verify_checksums": True}}).config.verify_checksums
    with pytest.raises(ConfigError, match="verify_checksum"):
        WeightSyncerConfig.from_any({"type": "patch", "patch": {"verify_checksum": True}})  # a typo
    with pytest.raises(ConfigError, match="verify_checksums"):
        WeightSyncerConfig.from_any({"type": "patch", "patch": {"verify_checksums": "yes"}})
    with pytest.raises(ConfigError, match="verify_checksums"):
        WeightSyncerConfig.from_any({"type": "bucket", "bucket": {"verify_checksums": 1}})


# ------------------------------------------------------------------ applies that raise half way

@pytest.mark.parametrize("encoding,delta", FORMATS, ids=["coo", "flat"])
async def test_a_patch_apply_that_raises_half_way_is_rolled_back(encoding, delta):
    faults = ApplyFaults(1.0, seed=0)
    s, r = patch_pair(encoding, delta, cls=FlakyPatchSyncer)
    r.faults = faults
    dst = receiver_model()
    a, b = await pair(s, r, state(0), dst)
    await s.sync(state(1), a.send, 1)
    patch = await b.recv()
    assert patch.ordinals.numel() >= 2  # so that "half way" wrote something
    before = snapshot(dst)
    faults.enabled = True
    with pytest.raises(ApplyError, match="injected fault"):
        await r.apply_payload(dst, patch)
    assert faults.fired == 1 and same(before, dst) and r.version is None
    faults.enabled = False
    assert await r.apply_payload(dst, patch) == 1 and holds(dst, 1)


# ------------------------------------------------------------------ buckets

async def bucket_round(bucket_size=200, checksums=False, load_instant=True):
    src = state(1)
    dst = receiver_model()
    s = BucketWeightSyncer(bucket_size=bucket_size, verify_checksums=checksums)
    r = BucketWeightSyncer(bucket_size=bucket_size, load_instant=load_instant, verify_checksums=checksums,
                           recv_timeout=0.5)
    a, b = inproc_pair(timeout=5)
    await s.init_sender(src, None, a.send)
    await r.init_receiver(dst, b.recv)
    sent = []

    async def collect(p):
        sent.append(p)

    await s.sync(src, collect, 1)
    assert len(sent) >= 3
    return r, dst, sent


async def test_the_first_bucket_carries_a_manifest_of_every_bucket():
    r, dst, sent = await bucket_round()
    manifest = decode_manifest(sent[0][MANIFEST_KEY])
    assert len(manifest) == len(sent)
    for entries, bucket in zip(manifest, sent):
        assert {n for n, _, _ in entries} == {k for k in bucket if not k.startswith("__aiosync__.")}
    assert all(MANIFEST_KEY not in b for b in sent[1:])
    assert await r.apply(dst, recv_from(sent)) == 1 and holds(dst, 1)


@pytest.mark.parametrize("load_instant", [True, False])
@pytest.mark.parametrize("case", ["duplicated", "reordered", "int dtype", "truncated tensor", "extra key",
                                  "empty version", "version in the past", "manifest truncated"])
async def test_bad_buckets_raise_clear_errors_before_loading(case, load_instant):
    r, dst, sent = await bucket_round(load_instant=load_instant)
    r.version = 0
    sent = [dict(b) for b in sent]
    last = len(sent) - 1
    if case == "duplicated":
        sent.insert(1, sent[0])
        err, bad_at = PayloadError, 1
    elif case == "reordered":
        sent[1], sent[2] = sent[2], sent[1]
        err, bad_at = PayloadError, 1
    elif case == "int dtype":
        sent[last]["step"] = sent[last]["step"].to(torch.int32) if "step" in sent[last] else None
        assert sent[last]["step"] is not None
        err, bad_at = PayloadError, last
    elif case == "truncated tensor":
        k = next(k for k in sent[last] if not k.startswith("__"))
        sent[last][k] = sent[last][k].reshape(-1)[:-1]
        err, bad_at = PayloadError, last
    elif case == "extra key":
        sent[last]["ghost"] = torch.zeros(2)
        err, bad_at = PayloadError, last
    elif case == "empty version":
        sent[0][VERSION_KEY] = torch.zeros(0, dtype=torch.int64)
        err, bad_at = PayloadError, 0
    elif case == "version in the past":
        r.version = 5
        err, bad_at = VersionError, 0
    else:
        sent[0][MANIFEST_KEY] = sent[0][MANIFEST_KEY][:-3]
        err, bad_at = PayloadError, 0
    before = snapshot(dst)
    with pytest.raises(err):
        await r.apply(dst, recv_from(sent))
    if bad_at == 0 or not load_instant:
        assert same(before, dst)  # nothing was loaded
    assert r.version in (0, 5)


async def test_a_bucket_whose_int_dtype_differs_from_the_receiver_is_refused_up_front():
    src = state(1)
    src["step"] = src["step"].to(torch.int32)
    dst = receiver_model()
    s = BucketWeightSyncer(bucket_size=200)
    r = BucketWeightSyncer(bucket_size=200)
    await s.init_sender(src, None, None)
    sent = []

    async def collect(p):
        sent.append(p)

    await s.sync(src, collect, 1)
    before = snapshot(dst)
    with pytest.raises(HandshakeError, match="'step'.*int32.*int64"):
        await r.apply(dst, recv_from(sent))
    assert same(before, dst)


@pytest.mark.parametrize("load_instant", [True, False])
async def test_bucket_checksums_catch_corruption_before_loading_the_bucket(load_instant):
    r, dst, sent = await bucket_round(checksums=True, load_instant=load_instant)
    assert all(CHECKSUM_KEY in b for b in sent)
    bad = [dict(b) for b in sent]
    k = next(k for k in bad[0] if not k.startswith("__"))
    t = bad[0][k].clone()
    t.reshape(-1).view(torch.uint8)[0] ^= 0x10
    bad[0][k] = t
    before = snapshot(dst)
    with pytest.raises(ChecksumError):
        await r.apply(dst, recv_from(bad))
    assert same(before, dst) and r.version is None
    assert await r.apply(dst, recv_from(sent)) == 1 and holds(dst, 1)


async def test_a_bucket_receiver_that_wants_checksums_refuses_buckets_without():
    r, dst, sent = await bucket_round(checksums=False)
    r.config.verify_checksums = True
    with pytest.raises(PayloadError, match="no checksum"):
        await r.apply(dst, recv_from(sent))


async def test_a_bucket_stream_that_breaks_off_reports_a_timeout():
    r, dst, sent = await bucket_round(load_instant=False)
    before = snapshot(dst)
    with pytest.raises(PeerTimeoutError):
        await r.apply(dst, recv_from(sent[:-1]))
    assert same(before, dst)  # load_instant: false holds everything until the last bucket


async def test_a_bucket_load_that_raises_half_way_propagates():
    faults = ApplyFaults(1.0, seed=0)
    faults.enabled = True
    r, dst, sent = await bucket_round()
    flaky = FlakyBucketSyncer(bucket_size=200)
    flaky.faults = faults
    with pytest.raises(RuntimeError, match="injected"):
        await flaky.apply(dst, recv_from(sent))
    assert flaky.version is None  # the version never moves for a partial load


def test_every_error_is_the_librarys_own():
    for cls in (ChecksumError, PatchChainError, PayloadError, HandshakeError, VersionError, ApplyError):
        assert issubclass(cls, AiosyncError)
    assert issubclass(ChecksumError, PayloadError)
    assert BUCKET_KEY.startswith("__aiosync__.") and SESSION_KEY.startswith("__aiosync__.")
    assert EmptyWeightPatch(1).session is None and WeightPatch.__dataclass_fields__["checksums"].default is None
