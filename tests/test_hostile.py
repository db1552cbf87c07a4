"""Hostile input that must not hurt (issue 18, items 6-11): one test per defect, each failing
without its fix. A corrupted or malicious peer or checkpoint file gets a clear error and changes
nothing; it never exhausts memory, kills a loop or reaches an unchecked kernel."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import anyio
import pytest
import torch

import hostile_cases as hc
from aiosync.errors import (AiosyncError, ConfigError, HandshakeError, MessageError, PayloadError,
                            PeerTimeoutError)
from aiosync.syncers import PatchWeightSyncer
from aiosync.syncers.patch import format as patch_format
from aiosync.syncers.config import BucketConfig, PatchConfig
from aiosync.syncers.kernels.flat import varint_bytes
from aiosync.syncers.patch.format import TensorLayout, decode_patch
from aiosync.syncers.common.payloads import SenderHello, WeightPatch

HERE = Path(__file__).resolve().parent


def child(*args: str, env: dict | None = None, timeout: float = 600) -> dict:
    """Run ``hostile_cases.py`` in a subprocess; its JSON result (a crash fails the test)."""
    out = subprocess.run([sys.executable, str(HERE / "hostile_cases.py"), *args], capture_output=True, text=True,
                         timeout=timeout, env={**os.environ, **(env or {})})
    assert out.returncode == 0, f"child died ({out.returncode}): {out.stderr[-3000:]}"
    return json.loads(out.stdout.strip().splitlines()[-1])


# ------------------------------------------------------------------ item 6: decompression bombs

@pytest.fixture(scope="module")
def flat_zstd():
    return hc.prepared_patch("flat", "zstd")


@pytest.mark.parametrize("case", ["frame content size", "declared size", "declared size, sized frame", "two frames",
                                  "64 frames"])
def test_a_zstd_bomb_is_refused_before_it_is_decompressed(flat_zstd, case):
    r, dst0, patch, _ = flat_zstd
    bomb = hc.bombs(patch, 64 << 20)[case]
    assert sum(b.numel() for b in bomb.blobs.values()) < 1 << 20  # a small payload
    dst = {k: v.clone() for k, v in dst0.items()}
    r.version = 1
    with pytest.raises(PayloadError, match="refused before decompressing|at most 8"):
        anyio.run(r.apply_payload, dst, bomb)
    assert r.version == 1 and all(torch.equal(dst[k], dst0[k]) for k in dst)


def test_a_stream_the_receiver_does_not_expect_is_refused(flat_zstd):
    r, dst0, patch, _ = flat_zstd
    bad = dataclasses.replace(patch, blobs={**patch.blobs, "extra#0": torch.zeros(4, dtype=torch.uint8)},
                              sizes={**patch.sizes, "extra#0": 4})
    r.version = 1
    with pytest.raises(PayloadError, match="does not expect"):
        anyio.run(r.apply_payload, {k: v.clone() for k, v in dst0.items()}, bad)


def test_a_32_kib_payload_raises_peak_memory_by_at_most_the_documented_bound():
    """In a subprocess (its peak resident set, ``ru_maxrss``): 32 KiB bombs that would each
    decompress to 512 MiB (1 GiB for two frames) raise the peak by at most FIXED; patches that
    declare every element of a 2M-element tensor changed by at most PER_CHANGE per change + FIXED."""
    bombs = child("memory", "bombs")
    assert bombs["peak_rise_bytes"] <= bombs["bound_bytes"], bombs
    assert all("refused before decompressing" in c["outcome"] or "at most 8" in c["outcome"]
               for c in bombs["cases"].values()), bombs
    assert max(c["bytes"] for c in bombs["cases"].values() if "frames" not in c["outcome"]) <= 1 << 20
    assert bombs["unchanged"]
    assert bombs["peak_rise_bytes"] <= bombs["bound_bytes"], bombs
    assert bombs["peak_rise_bytes"] < 512 << 20
    declared = child("memory", "declared")
    assert declared["unchanged"] and declared["peak_rise_bytes"] <= declared["bound_bytes"], declared


# ------------------------------------------------------------------ item 7: gaps that wrap around

def _flat_patch(gaps: list[int]) -> WeightPatch:
    n = len(gaps)
    cols = torch.tensor(list(b"".join(varint_bytes(g) for g in gaps)), dtype=torch.uint8)
    return WeightPatch(version=2, base_version=1, encoding="flat", delta_encoded=False,
                       ordinals=torch.tensor([0]), nnz_per_tensor=torch.tensor([n]), rows=None, cols=cols,
                       values=torch.zeros((n + 1) // 2, dtype=torch.uint8), gap_bytes=torch.tensor([cols.numel()]))


WRAP = [2**62, 2**62, 2**62, 2**62 + 2]  # positions 2**62, 2**63 + 1 (< 0), ..., and last 5: inside


@pytest.mark.parametrize("path", ["numba", "torch"])
def test_gaps_that_wrap_int64_around_are_refused_on_every_decode_path(monkeypatch, path):
    layouts = {0: TensorLayout(0, 1, 64, 4, torch.float32)}
    if path == "torch":  # the CUDA branch, run on CPU
        monkeypatch.setattr(patch_format, "_numba_decodes", lambda cols: False)
    good = decode_patch(_flat_patch([3, 0, 7]), layouts)
    assert good[0].positions.tolist() == [3, 4, 12]
    with pytest.raises(PayloadError, match="outside the tensor"):
        decode_patch(_flat_patch(WRAP), layouts)


def test_ctx_class_counts_that_wrap_int64_around_are_refused_before_the_kernel(monkeypatch):
    from aiosync.syncers.kernels import ctx_coder as kernels_ctx_coder

    r, dst0, patch, _ = hc.prepared_patch("ctx", "none")

    def kernel_reached(*args):
        raise AssertionError("the decode kernel was reached with class counts that do not add up")

    monkeypatch.setattr(kernels_ctx_coder, "decode_segment", kernel_reached)
    from aiosync.syncers.patch.ctx.encode import varints
    from aiosync.syncers.patch.ctx.decode import _ints

    ints = _ints(patch.values)
    n0 = int(patch.nnz_per_tensor[0])
    # the first tensor's first segment: four class counts and a stream length (one lane: two
    # streams), after the tables and parameters
    start = len(ints) - 5 * len(patch.ordinals)
    assert ints[start:start + 4] and sum(ints[start:start + 4]) == n0
    hostile = list(ints)
    hostile[start:start + 4] = [2**62, 2**62, 2**62, 2**62 + n0]  # sums to n0 modulo 2**64
    bad = dataclasses.replace(patch, values=torch.from_numpy(varints(hostile).copy()))
    r.version = 1
    with pytest.raises(PayloadError, match="more than the segment has elements"):
        anyio.run(r.apply_payload, {k: v.clone() for k, v in dst0.items()}, bad)


# ------------------------------------------------------------------ item 8: frames and the apply loop

def test_frames_that_break_the_json_parser_are_payload_errors():
    from aiosync.transports.distributed.wire import MAX_DEPTH, decode_message, encode_message

    deep = b"[" * 50000 + b"]" * 50000
    with pytest.raises(MessageError):
        decode_message(deep)
    with pytest.raises(MessageError, match="not valid JSON"):
        decode_message(b'{"v":1,"tensors":[],"tree":' + b"7" * 5000 + b"}")
    nested = b'{"v":1,"tensors":[],"tree":' + b'{"$tuple":[' * (MAX_DEPTH + 2) + b"1" + b"]}" * (MAX_DEPTH + 2) + b"}"
    with pytest.raises(MessageError, match="nests deeper"):
        decode_message(nested)
    frame = encode_message((1, [2, {"a": (3,)}]))
    assert decode_message(frame.header) == (1, [2, {"a": (3,)}])


def test_a_prefix_announcing_more_than_the_end_accepts_is_refused_before_allocating():
    from aiosync.transports.distributed.wire import MAGIC, Prefix, allocate_frame

    with pytest.raises(PayloadError, match="more than this end accepts"):
        Prefix.parse([MAGIC, 10, 2**62, 0], sender="rank 1")
    with pytest.raises(PayloadError, match="cannot allocate"):
        allocate_frame(Prefix(10, 2**55), None, None, sender="rank 1")
    assert Prefix.parse([MAGIC, 10, 100, 0], sender="rank 1") == Prefix(10, 100)


def test_a_message_whose_fields_have_the_wrong_type_is_refused_as_it_is_parsed():
    from aiosync.coordination.protocol import Hello, Packet
    from aiosync.transports.distributed.wire import decode_message, encode_message

    for good, field, bad in [(Hello("e0", 3), "name", [1, 2]), (Hello("e0", 3), "version", 2**70),
                             (Packet(4, []), "version", "4"), (Packet(4, []), "payloads", 7)]:
        doc = json.loads(encode_message(good).header)
        doc["tree"]["f"][field] = bad
        with pytest.raises(MessageError) as err:
            decode_message(json.dumps(doc).encode())
        assert err.value.message_type and err.value.message_type.endswith(type(good).__name__)
    with pytest.raises(PayloadError):
        Hello(name=torch.tensor([1, 2]))


@pytest.mark.both_loops
async def test_one_malformed_packet_is_refused_reported_and_repaired_and_the_loop_goes_on():
    """Item 8: the second Packet frame the explorer receives cannot be rebuilt (a tensor entry that
    does not fit its body: a real MessageError from the codec). The explorer's apply loop answers
    with an error Ack, the synchronizer counts the failure and repairs, and the explorer ends on
    the trainer's last weights."""
    from aiosync.coordination import Synchronizer
    from aiosync.transports.distributed import decode_message
    from helpers import HANG_GUARD, PATCH, holds, train_to, weights
    from test_coordination_remote import Wire, explorer_until_stopped, wires

    class Spoiling(Wire):
        packets = 0

        async def recv(self):
            header, host = await self.inner.recv()
            doc = json.loads(header)
            if str(doc["tree"].get("$dc", "")).endswith(":Packet"):
                Spoiling.packets += 1
                if Spoiling.packets == 2:
                    doc["tensors"][0][2] += 1  # its byte count no longer matches its shape
                    header = json.dumps(doc).encode()
            return decode_message(header, host)

    (a0, b0), = wires(1)
    spoiled = Spoiling(b0.inner)
    state, record = weights(0), {}
    cfg = dict(style="trainer_driven", sync_timeout=5, delivery_timeout=HANG_GUARD)
    with anyio.fail_after(HANG_GUARD):
        async with anyio.create_task_group() as tg:
            tg.start_soon(explorer_until_stopped, "e0", spoiled, record)
            async with Synchronizer(cfg, PATCH) as sync:
                trainer = await sync.attach_trainer(state)
                sync.serve_remote(a0)
                await sync.wait_for_explorers(1, timeout=HANG_GUARD)
                for step in range(1, 6):
                    train_to(state, step)
                    await trainer.step_done()
                await trainer.stop()
    stats = sync.metrics()["explorers"]["e0"]
    assert Spoiling.packets >= 3
    assert stats["failed"] >= 1 and stats["repairs"] >= 1, stats
    assert "do not hold" in (stats["last_error"] or ""), stats
    assert record["e0"]["final"] == 5 and holds(record["e0"]["handle"].slot.model, 5)
    assert record["e0"]["torn"] == 0 and "error" not in record["e0"]


# ------------------------------------------------------------------ item 9: handshake fields

@pytest.mark.parametrize("session", [2**70, -1, torch.tensor(3), torch.tensor([1, 2]), "5", 2.0])
def test_a_metadata_session_of_the_wrong_type_or_range_is_refused_before_ok(session):
    meta = hc.genuine_handshake()[0][0]
    bad = dataclasses.replace(meta, session=session)
    sent = []

    async def send(p):
        sent.append(p)

    s = PatchWeightSyncer(init_sync_enabled=True, recv_timeout=1)
    with pytest.raises(HandshakeError):
        anyio.run(s.init_sender, hc.state(1), None, send, hc.recv_from([bad]))
    assert len(sent) == 1 and isinstance(sent[0], SenderHello) and sent[0].ok is False


@pytest.mark.parametrize("session", [torch.tensor([1, 2]), 2**70, "x"])
def test_a_sender_answer_with_a_session_of_the_wrong_type_is_a_handshake_error(session):
    from aiosync.syncers.patch.handshake import check_hello

    with pytest.raises(HandshakeError):
        check_hello(SenderHello(ok=True, session=session), 3, 12345)


# ------------------------------------------------------------------ item 10: checkpoint files

def swapped_after_scan(tmp_path, monkeypatch, swap):
    """A checkpoint directory whose version-1 file is replaced by ``swap(path)`` between the
    directory scan and the open (a concurrent writer, or an attacker)."""
    from aiosync.checkpoints import CheckpointDir

    d = CheckpointDir(tmp_path)
    path = d.publish(hc.state(1), 1)
    scan = CheckpointDir._scan

    def racing_scan(self):
        found = scan(self)
        path.unlink()
        swap(path)
        return found

    monkeypatch.setattr(CheckpointDir, "_scan", racing_scan)
    return d


def test_a_file_swapped_for_a_link_after_the_scan_is_refused_never_followed(tmp_path, monkeypatch):
    d = swapped_after_scan(tmp_path, monkeypatch, lambda path: path.symlink_to("/proc/self/mem"))
    with pytest.raises(PayloadError, match="symbolic link"):
        d.load(1)


def test_a_checkpoint_that_is_no_regular_file_is_a_payload_error(tmp_path, monkeypatch):
    d = swapped_after_scan(tmp_path, monkeypatch, lambda path: path.mkdir())  # reading it: IsADirectoryError
    with pytest.raises(PayloadError, match="not a regular file"):
        d.load(1)


async def test_a_checkpoint_follower_refuses_float_data_for_integer_and_bool_buffers(tmp_path):
    from aiosync.checkpoints import CheckpointDir
    from aiosync.coordination.follower import CheckpointFollower

    CheckpointDir(tmp_path).publish({"n": torch.tensor([1.5, 2.5, 3.5]), "m": torch.ones(3)}, 1)
    model = hc.receiver_model()
    before = {k: v.clone() for k, v in model.items()}
    follower = CheckpointFollower(tmp_path, model, timeout=5)
    with pytest.raises(HandshakeError, match="only floating-point tensors may change dtype"):
        await follower.poll()
    assert follower.version is None and all(torch.equal(model[k], before[k]) for k in model)


# ------------------------------------------------------------------ item 11: nothing waits forever

@pytest.mark.parametrize("value", [float("inf"), float("nan"), None, 0, -1, True])
def test_an_infinite_or_missing_recv_timeout_is_refused(value):
    with pytest.raises(ConfigError, match="finite"):
        PatchConfig(recv_timeout=value)
    with pytest.raises(ConfigError, match="finite"):
        BucketConfig(recv_timeout=value)
    with pytest.raises(ConfigError, match="finite"):
        PatchWeightSyncer(recv_timeout=value)


def test_a_peers_welcome_with_an_infinite_bound_is_refused():
    from aiosync.coordination.config import SynchronizerConfig
    from aiosync.syncers.factory import syncer_factory

    with pytest.raises(ConfigError, match="finite"):
        syncer_factory({"type": "patch", "patch": {"recv_timeout": float("inf")}})
    for key in ("sync_timeout", "delivery_timeout", "liveness_timeout"):
        with pytest.raises(ConfigError, match="finite"):
            SynchronizerConfig.from_any({key: float("inf")})


def test_explorer_and_follower_bounds_are_finite(tmp_path):
    from aiosync import Explorer
    from aiosync.coordination.follower import CheckpointFollower
    from aiosync.transports.inproc import inproc_pair

    a, _ = inproc_pair(timeout=1)
    with pytest.raises(ConfigError, match="finite"):
        Explorer("e", hc.receiver_model(), a, connect_timeout=float("inf"))
    with pytest.raises(ConfigError, match="finite"):
        CheckpointFollower(tmp_path, hc.receiver_model(), timeout=float("inf"))
    assert isinstance(PeerTimeoutError("x"), AiosyncError)
