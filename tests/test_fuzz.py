"""Fuzzing the decoders (SPEC §7): random and mutated payloads fed to the patch receiver
(``PatchWeightSyncer.apply_payload``), the bucket receiver (``BucketWeightSyncer.apply``) and
both sides of the patch handshake (``init_sender`` / ``init_receiver``).

The properties: whatever arrives, the receiver raises one of the library's own errors
(:class:`aiosync.errors.AiosyncError`) or succeeds; it never writes garbage. With checksums on,
a payload that is accepted produced exactly the weights the genuine one would have; a payload
that is refused left the model bit for bit as it was (a ``load_instant`` bucket receiver may
have loaded earlier, *genuine* buckets: each tensor is then either as before or genuine).

Example counts are modest so the file runs in seconds; raise them locally with
``--hypothesis-seed`` / settings profiles when hunting.
"""

from __future__ import annotations

import dataclasses
import functools

import anyio
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aiosync.syncers import BucketWeightSyncer, PatchWeightSyncer
from aiosync.errors import AiosyncError, PeerTimeoutError
from aiosync.syncers.common.integrity import bucket_checksum
from aiosync.syncers.common.payloads import (CompressedWeightPatch, EmptyWeightPatch, ReceiverMetadata, SenderHello,
    WeightPatch)
import hostile_cases as hc
from helpers import bits
from hostile_cases import receiver_model, recv_from, state

SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
                derandomize=True)
DTYPES = [torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float32, torch.bfloat16,
          torch.float16, torch.bool]




def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(bits(a), bits(b))


def rand_tensor(draw) -> torch.Tensor:
    dtype = draw(st.sampled_from(DTYPES))
    shape = tuple(draw(st.lists(st.integers(0, 5), max_size=3)))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    raw = torch.randint(0, 256, (int(torch.tensor(shape).prod()) if shape else 1,) , dtype=torch.uint8, generator=g)
    esize = torch.empty((), dtype=dtype).element_size()
    if dtype == torch.bool:
        return (raw % 2).to(torch.bool).reshape(shape)
    raw = raw.repeat_interleave(esize) if esize > 1 else raw
    t = raw.view(dtype).reshape(shape) if raw.numel() else torch.empty(shape, dtype=dtype)
    return t


def junk(draw):
    return draw(st.one_of(st.none(), st.integers(-2**70, 2**70), st.text(max_size=8), st.binary(max_size=8),
                          st.booleans(), st.floats(allow_nan=True), st.lists(st.integers(-3, 300), max_size=4),
                          st.just({"x": 1}), st.just([[1]]), st.builds(lambda: torch.zeros(2)),
                          st.builds(lambda: torch.zeros(2, 2, dtype=torch.complex64))))


# ------------------------------------------------------------------ mutations

def mutate_tensor(draw, t: torch.Tensor):
    how = draw(st.sampled_from(["flip", "flip", "truncate", "extend", "dtype", "random", "junk", "junk", "reshape",
                                "negate"]))
    if how == "flip" and t.numel():
        out = t.detach().clone().contiguous()
        raw = out.reshape(-1).view(torch.uint8)
        raw[draw(st.integers(0, raw.numel() - 1))] ^= draw(st.integers(1, 255))
        return out
    if how == "truncate" and t.numel():
        return t.reshape(-1)[: draw(st.integers(0, t.numel() - 1))].clone()
    if how == "extend":
        extra = t.reshape(-1)[: draw(st.integers(1, 3))] if t.numel() else torch.zeros(2, dtype=t.dtype)
        return torch.cat([t.reshape(-1), extra])
    if how == "dtype":
        return t.to(draw(st.sampled_from([d for d in DTYPES if d != t.dtype])))
    if how == "reshape" and t.numel():
        return t.reshape(-1, 1)
    if how == "negate" and not t.is_floating_point() and t.dtype not in (torch.bool, torch.uint8) and t.numel():
        return -t - 1
    if how == "junk":
        return junk(draw)
    return rand_tensor(draw)


def mutate_value(draw, value):
    if isinstance(value, torch.Tensor):
        return mutate_tensor(draw, value)
    if isinstance(value, bool):
        return draw(st.sampled_from([not value, None, 1, "yes"]))
    if isinstance(value, int) or value is None:
        return draw(st.one_of(st.integers(-5, 2**64), st.none(), st.just(value + 1 if isinstance(value, int) else 0),
                              st.just(value - 1 if isinstance(value, int) else -1), st.text(max_size=3),
                              st.builds(lambda: torch.tensor(3))))
    if isinstance(value, str):
        return draw(st.one_of(st.sampled_from(["coo", "flat", "zstd", "nvcomp_lz4", "csr", ""]), st.none(),
                              st.integers()))
    if isinstance(value, dict):
        value = dict(value)
        keys = list(value)
        how = draw(st.sampled_from(["drop", "add", "change", "change", "junk entry", "junk"]))
        if how == "drop" and keys:
            del value[draw(st.sampled_from(keys))]
        elif how == "add":
            value[draw(st.sampled_from(["cols#1", "values#0", "rows", "x", 3]))] = draw(
                st.one_of(st.builds(lambda: torch.zeros(3, dtype=torch.uint8)), st.integers(-1, 99), st.text(max_size=2)))
        elif how == "change" and keys:
            k = draw(st.sampled_from(keys))
            value[k] = mutate_value(draw, value[k])
        elif how == "junk entry" and keys:
            value[draw(st.sampled_from(keys))] = junk(draw)
        else:
            return junk(draw)
        return value
    return junk(draw)


def mutate_dataclass(draw, obj, n_max=3):
    names = [f.name for f in dataclasses.fields(obj)]
    for _ in range(draw(st.integers(1, n_max))):
        name = draw(st.sampled_from(names))
        obj = dataclasses.replace(obj, **{name: mutate_value(draw, getattr(obj, name))})
    return obj


# ------------------------------------------------------------------ patches

@functools.lru_cache(maxsize=None)
def prepared_patch(encoding: str, compression: str):
    """A receiver at version 1 (checksums required), its model, the genuine patch to 2 and the
    model it produces."""
    return hc.prepared_patch(encoding, compression, checksums=True)


def check_patch(encoding, compression, payload):
    r, dst0, _, after = prepared_patch(encoding, compression)
    dst = {k: v.clone() for k, v in dst0.items()}
    r.version = 1
    try:
        anyio.run(r.apply_payload, dst, payload)
    except AiosyncError:
        assert r.version == 1
        for k in dst:
            assert same(dst[k], dst0[k]), f"refused payload changed {k!r}"
    else:
        for k in dst:
            assert same(dst[k], after[k]) or same(dst[k], dst0[k]) and same(after[k], dst0[k]), \
                f"accepted payload wrote other weights into {k!r}"
    finally:
        r.version = 1


FORMATS = [("coo", "none"), ("coo", "zstd"), ("flat", "none"), ("flat", "zstd")]


@settings(max_examples=250, **SETTINGS)
@given(fmt=st.sampled_from(FORMATS), data=st.data())
def test_mutated_patches_raise_library_errors_and_never_write_garbage(fmt, data):
    _, _, patch, _ = prepared_patch(*fmt)
    assert isinstance(patch, CompressedWeightPatch if fmt[1] == "zstd" else WeightPatch)
    check_patch(*fmt, mutate_dataclass(data.draw, patch))


@st.composite
def random_patch(draw):
    kind = draw(st.sampled_from([WeightPatch, CompressedWeightPatch, EmptyWeightPatch]))
    if kind is EmptyWeightPatch:
        return EmptyWeightPatch(draw(st.integers(-3, 5)), draw(st.one_of(st.none(), st.integers(0, 3))),
                                draw(st.one_of(st.none(), st.integers(0, 3))))
    common = dict(version=draw(st.integers(0, 5)), base_version=draw(st.sampled_from([None, 1])),
                  encoding=draw(st.sampled_from(["coo", "flat", "x"])), delta_encoded=draw(st.booleans()),
                  ordinals=rand_tensor(draw), nnz_per_tensor=rand_tensor(draw),
                  gap_bytes=draw(st.one_of(st.none(), st.builds(lambda: None))))
    if kind is WeightPatch:
        return WeightPatch(rows=rand_tensor(draw), cols=rand_tensor(draw), values=rand_tensor(draw),
                           checksums=rand_tensor(draw), **common)
    return CompressedWeightPatch(codec=draw(st.sampled_from(["zstd", "nvcomp_lz4", "brotli"])),
                                 blobs={"cols#0": rand_tensor(draw), "values#0": rand_tensor(draw)},
                                 dtypes={"cols": draw(st.sampled_from(["uint8", "int32", "float32"]))},
                                 sizes={"cols#0": draw(st.integers(-1, 64)), "values#0": draw(st.integers(0, 64))},
                                 **common)


@settings(max_examples=80, **SETTINGS)
@given(fmt=st.sampled_from(FORMATS), payload=st.one_of(random_patch(), st.builds(lambda: None),
                                                        st.text(max_size=4), st.integers(), st.binary(max_size=8),
                                                        st.dictionaries(st.text(max_size=3), st.integers(), max_size=2)))
def test_random_payloads_raise_library_errors_and_change_nothing(fmt, payload):
    r, dst0, _, _ = prepared_patch(*fmt)
    dst = {k: v.clone() for k, v in dst0.items()}
    r.version = 1
    try:
        anyio.run(r.apply_payload, dst, payload)
    except AiosyncError:
        assert r.version == 1
    finally:
        r.version = 1
    for k in dst:  # random payloads can at most be valid empty patches: no weight changes either way
        assert same(dst[k], dst0[k]), k


def test_the_genuine_patches_still_apply():
    for fmt in FORMATS:
        r, dst0, patch, after = prepared_patch(*fmt)
        dst = {k: v.clone() for k, v in dst0.items()}
        r.version = 1
        assert anyio.run(r.apply_payload, dst, patch) == 2
        r.version = 1
        assert all(same(dst[k], after[k]) for k in dst)
        assert any(not same(after[k], dst0[k]) for k in dst)


# ------------------------------------------------------------------ buckets

@functools.lru_cache(maxsize=None)
def genuine_buckets(checksums: bool):
    sent = hc.genuine_buckets(checksums)
    assert len(sent) >= 3
    return sent


def mutate_buckets(draw, sent):
    buckets = [dict(b) for b in sent]
    for _ in range(draw(st.integers(1, 3))):
        how = draw(st.sampled_from(["drop", "duplicate", "swap", "entry", "entry", "entry", "junk"]))
        i = draw(st.integers(0, len(buckets) - 1)) if buckets else 0
        if how == "drop" and buckets:
            del buckets[i]
        elif how == "duplicate" and buckets:
            buckets.insert(i, buckets[i])
        elif how == "swap" and len(buckets) > 1:
            j = draw(st.integers(0, len(buckets) - 1))
            buckets[i], buckets[j] = buckets[j], buckets[i]
        elif how == "entry" and buckets and isinstance(buckets[i], dict):
            bucket = dict(buckets[i])
            keys = list(bucket)
            what = draw(st.sampled_from(["drop", "add", "change", "change", "rename"]))
            if what == "drop" and keys:
                del bucket[draw(st.sampled_from(keys))]
            elif what == "add":
                bucket[draw(st.sampled_from(["w", "b", "ghost", "__aiosync__.x", "__aiosync__.version", 5]))] = \
                    rand_tensor(draw)
            elif what == "rename" and keys:
                k = draw(st.sampled_from(keys))
                bucket[k + "_"] = bucket.pop(k)
            elif keys:
                k = draw(st.sampled_from(keys))
                bucket[k] = mutate_value(draw, bucket[k])
            buckets[i] = bucket
        elif how == "junk" and buckets:
            buckets[i] = junk(draw)
    return buckets


@settings(max_examples=150, **SETTINGS)
@given(checksums=st.booleans(), load_instant=st.booleans(), data=st.data())
def test_mutated_buckets_raise_library_errors_and_never_load_garbage(checksums, load_instant, data):
    sent = genuine_buckets(checksums)
    buckets = mutate_buckets(data.draw, sent)
    dst0 = receiver_model()
    genuine = receiver_model(1)
    dst = {k: v.clone() for k, v in dst0.items()}
    r = BucketWeightSyncer(bucket_size=300, load_instant=load_instant, verify_checksums=checksums, recv_timeout=1)
    r.version = 0
    try:
        version = anyio.run(r.apply, dst, recv_from(buckets))
    except AiosyncError:
        assert r.version == 0
        for k in dst:
            if load_instant:  # earlier, valid buckets may have been loaded: genuine values only
                assert same(dst[k], dst0[k]) or same(dst[k], genuine[k]), k
            else:
                assert same(dst[k], dst0[k]), k
        return
    assert version >= 1
    if checksums:  # accepted with checksums: exactly the genuine weights
        for k in dst:
            assert same(dst[k], genuine[k]), k


# ------------------------------------------------------------------ handshake

@functools.lru_cache(maxsize=None)
def genuine_handshake(checksums: bool = False):
    return hc.genuine_handshake(checksums)


@settings(max_examples=100, **SETTINGS)
@given(data=st.data())
def test_mutated_receiver_metadata_is_refused_by_the_sender_with_a_library_error(data):
    (meta,), _ = genuine_handshake()
    assert isinstance(meta, ReceiverMetadata)
    bad = mutate_dataclass(data.draw, meta)
    for f in ("ordered_keys", "original_shapes", "dtypes", "viewable"):  # mutate list entries too
        value = getattr(bad, f)
        if isinstance(value, list) and value and data.draw(st.booleans()):
            value = list(value)
            i = data.draw(st.integers(0, len(value) - 1))
            value[i] = data.draw(st.one_of(st.none(), st.integers(-2, 9), st.text(max_size=4),
                                           st.lists(st.integers(-1, 30), max_size=3), st.booleans()))
            bad = dataclasses.replace(bad, **{f: value})
    s = PatchWeightSyncer(encoding="flat", init_sync_enabled=True, init_sync_bucket_size=400, recv_timeout=1)
    sent = []

    async def send(p):
        sent.append(p)

    try:
        anyio.run(s.init_sender, state(1), None, send, recv_from([bad]))
    except AiosyncError:
        assert len(sent) == 1 and isinstance(sent[0], SenderHello) and sent[0].ok is False and sent[0].error
        return
    assert isinstance(sent[0], SenderHello) and sent[0].ok  # a harmless mutation (e.g. another float dtype)


@settings(max_examples=100, **SETTINGS)
@given(data=st.data())
def test_mutated_sender_answers_and_bootstraps_are_refused_without_writing_garbage(data):
    # with checksums: a value changed in transit is detected too (without them it cannot be)
    _, to_receiver = genuine_handshake(checksums=True)
    hello, buckets = to_receiver[0], to_receiver[1:]
    assert isinstance(hello, SenderHello) and hello.ok and len(buckets) >= 2
    messages = [hello, *buckets]
    target = data.draw(st.sampled_from(["hello", "buckets", "both"]))
    if target in ("hello", "both"):
        messages[0] = mutate_dataclass(data.draw, hello, n_max=2)
    if target in ("buckets", "both"):
        messages[1:] = mutate_buckets(data.draw, buckets)
    r = PatchWeightSyncer(encoding="flat", init_sync_enabled=True, recv_timeout=1, verify_checksums=True)
    dst0 = receiver_model()
    genuine = receiver_model(1)
    dst = {k: v.clone() for k, v in dst0.items()}
    # the receiver's random session: answer with it, as the sender would (unless mutated away)
    session = {}

    async def send(p):
        session["id"] = p.session

    async def recv_gen():
        items = iter(messages)
        first = True

        async def recv():
            nonlocal first
            try:
                item = next(items)
            except StopIteration:
                raise PeerTimeoutError("nothing more arrives") from None
            if first and isinstance(item, SenderHello) and type(item.session) is int and item.session == hello.session:
                item = dataclasses.replace(item, session=session["id"])
            tag = item.get("__aiosync__.session") if isinstance(item, dict) else None
            if (isinstance(tag, torch.Tensor) and tag.dtype == torch.int64 and tag.numel() == 1
                    and int(tag.reshape(-1)[0]) == hello.session):
                intact = _checksum_holds(item)  # re-sealed for the new session only if nothing else changed
                item = dict(item)
                item["__aiosync__.session"] = torch.tensor(session["id"])
                if intact:
                    item["__aiosync__.checksum"] = torch.tensor(bucket_checksum(item, "__aiosync__.checksum"))
            first = False
            return item

        return recv

    async def run():
        await r.init_receiver(dst, await recv_gen(), send)

    try:
        anyio.run(run)
    except AiosyncError:
        pass
    for k in dst:
        assert same(dst[k], dst0[k]) or same(dst[k], genuine[k]), k


def _checksum_holds(bucket: dict) -> bool:
    want = bucket.get("__aiosync__.checksum")
    try:
        return isinstance(want, torch.Tensor) and want.numel() == 1 and \
            int(want.reshape(-1)[0]) == bucket_checksum(bucket, "__aiosync__.checksum")
    except Exception:  # a mutated bucket that cannot even be checksummed
        return False


def test_the_genuine_handshake_still_works():
    _, to_receiver = genuine_handshake()
    assert isinstance(to_receiver[0], SenderHello) and to_receiver[0].init_sync


@pytest.mark.parametrize("payload", [None, 3, "patch", b"\x00", [1, 2], {"a": 1}, torch.zeros(3),
                                     ReceiverMetadata([], [], [])])
def test_plain_junk_is_a_payload_error(payload):
    r, dst0, _, _ = prepared_patch("flat", "zstd")
    with pytest.raises(AiosyncError):
        anyio.run(r.apply_payload, {k: v.clone() for k, v in dst0.items()}, payload)
    b = BucketWeightSyncer()
    with pytest.raises(AiosyncError):
        anyio.run(b.apply, receiver_model(), recv_from([payload]))
