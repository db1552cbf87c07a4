"""Explorers over a wire that serialises every message with the distributed codec, as a
process boundary does (nothing is shared by reference): joining late, leaving, being lost,
refusals, fan-out (S12), and the checkpoint follower. Real processes:
``test_coordination_processes.py``.

Weights are a pure function of the version, so every check is bit-exact. Nothing here asserts
on elapsed time; HANG_GUARD only turns a hang into a failure.
"""

from __future__ import annotations

from typing import Any

import anyio
import pytest
import torch

from aiosync.coordination import CheckpointFollower, Explorer, Synchronizer
from aiosync.coordination.protocol import Ack, Hello, Reinit
from aiosync.checkpoints import CheckpointDir
from aiosync.errors import (ClosedResourceError, EndOfStream, HandshakeError, PeerTimeoutError, TransportError)
from aiosync.syncers import PatchWeightSyncer
from aiosync.transports.base import Transport
from aiosync.transports.distributed import Frame, decode_message, encode_message
from aiosync.transports.inproc import inproc_pair
from helpers import BUCKET, HANG_GUARD, PATCH, holds, rollout_model, train_to, weights

pytestmark = pytest.mark.both_loops


def roundtrip(payload: Any) -> Any:
    frame = encode_message(payload)
    return decode_message(frame.header, frame.host, frame.device)


def test_codec_carries_real_patches_and_acks():
    sender, receiver = PatchWeightSyncer(encoding="flat", compression="zstd"), PatchWeightSyncer(encoding="flat")
    a, b = inproc_pair(timeout=HANG_GUARD)
    live = weights(0)
    model = {k: t.clone() for k, t in weights(0).items()}

    async def run():
        async with anyio.create_task_group() as tg:
            tg.start_soon(receiver.init_receiver, model, b.recv, b.send)
            await sender.init_sender(live, None, a.send, a.recv)
        patches = []
        for v in (1, 2):
            train_to(live, v)
            await sender.sync(live, lambda p: _append(patches, p), v)
        for p in patches:
            wire = roundtrip(p)

            async def recv():
                return wire

            assert await receiver.apply(model, recv) == p.version

    async def _append(out, p):
        out.append(p)

    anyio.run(run)
    assert holds(model, 2)
    ack = roundtrip(Ack(3, 2, None, 0.5))
    assert isinstance(ack, Ack) and (ack.version, ack.applied, ack.apply_s) == (3, 2, 0.5)


class Wire(Transport):
    """An in-process channel that serialises every message with the distributed codec, as a
    process boundary does (nothing is shared by reference). ``cut()`` breaks it like a dead peer."""

    def __init__(self, inner) -> None:
        self.inner, self.frames, self.broken = inner, 0, False

    async def send(self, payload: Any) -> None:
        if self.broken:
            raise TransportError("wire cut")
        frame = encode_message(payload)
        self.frames += 1
        await self.inner.send((frame.header, frame.host))

    async def recv(self) -> Any:
        try:
            if self.broken:
                raise TransportError("wire cut")
            header, host = await self.inner.recv()
        except (ClosedResourceError, EndOfStream) as exc:
            if self.broken:
                raise TransportError("wire cut: connection closed by peer") from exc
            raise
        return decode_message(header, host)

    def cut(self) -> None:
        self.broken = True
        self.inner.close()

    def close(self) -> None:
        self.inner.close()


def wires(n: int) -> list[tuple[Wire, Wire]]:
    return [tuple(Wire(e) for e in inproc_pair(timeout=HANG_GUARD)) for _ in range(n)]


async def explorer_until_stopped(name: str, end: Wire, record: dict, start: anyio.Event | None = None,
                                 leave_at_version: int | None = None) -> None:
    if start is not None:
        await start.wait()
    async with Explorer(name, rollout_model(), end) as ex:
        record[name] = {"first": ex.version, "torn": 0, "handle": ex}
        while not ex.trainer_stopped:
            async with ex.lease() as (model, version):
                record[name]["torn"] += not holds(model, version)
            try:
                await ex.step_done()
            except TransportError as exc:  # the synchronizer's process is gone (or our wire)
                record[name]["error"] = exc
                break
            await anyio.sleep(0.001)
            if leave_at_version is not None and (ex.version or 0) >= leave_at_version:
                break  # leaves while the trainer still trains
    record[name]["final"] = ex.version


@pytest.mark.parametrize("method, style, syncer", [
    ("memory", "trainer_driven", PATCH), ("memory", "fixed", PATCH), ("memory", "explorer_driven", PATCH),
    ("nccl", "trainer_driven", PATCH), ("nccl", "fixed", PATCH), ("checkpoint", "fixed", BUCKET),
])
async def test_remote_explorers_join_late_and_end_bit_exact(method, style, syncer, tmp_path):
    cfg = dict(method=method, style=style, sync_timeout=5, delivery_timeout=HANG_GUARD,
               sync_weight_no_wait=(syncer is PATCH and style == "trainer_driven"))
    if method == "checkpoint":
        cfg["checkpoint_dir"] = str(tmp_path / "ckpt")
    state, record, late = weights(0), {}, anyio.Event()
    (a0, b0), (a1, b1) = wires(2)
    with anyio.fail_after(HANG_GUARD):
        async with anyio.create_task_group() as tg:
            tg.start_soon(explorer_until_stopped, "early", b0, record)
            tg.start_soon(explorer_until_stopped, "late", b1, record, late)
            async with Synchronizer(cfg, syncer) as sync:
                trainer = await sync.attach_trainer(state)
                sync.serve_remote(a0)
                sync.serve_remote(a1)
                await sync.wait_for_explorers(1, timeout=HANG_GUARD)
                for step in range(1, 9):
                    train_to(state, step)
                    await trainer.step_done()
                    if step == 4:
                        late.set()  # an elastic explorer joins in the middle (S12)
                        await sync.wait_for_explorers(2, timeout=HANG_GUARD)
                    await anyio.sleep(0.002)
                await trainer.stop()
    m = sync.metrics()
    for name in ("early", "late"):
        assert record[name]["final"] == 8 and holds(record[name]["handle"].slot.model, 8), name
        assert record[name]["torn"] == 0
        assert m["explorers"][name]["reinits"] == 1
    assert record["late"]["first"] >= 1  # bootstrapped at the version published when it joined...
    assert m["explorers"]["late"]["delivered"] >= 2  # ...then patched like the others
    if method == "nccl":  # the two-way handshake: the trainer went REQUIRE_SYNC and back
        assert any(new.name == "REQUIRE_SYNC" for _, new in trainer.state.history)


async def test_explorer_that_leaves_early_is_detached_and_the_others_go_on():
    state, record = weights(0), {}
    (a0, b0), (a1, b1) = wires(2)
    with anyio.fail_after(HANG_GUARD):
        async with anyio.create_task_group() as tg:
            tg.start_soon(explorer_until_stopped, "stays", b0, record)
            tg.start_soon(explorer_until_stopped, "leaves", b1, record, None, 2)
            async with Synchronizer(dict(style="trainer_driven", sync_weight_no_wait=True), PATCH) as sync:
                trainer = await sync.attach_trainer(state)
                sync.serve_remote(a0)
                sync.serve_remote(a1)
                await sync.wait_for_explorers(2, timeout=HANG_GUARD)
                step = 0
                while "final" not in record.get("leaves", {}):
                    step += 1
                    train_to(state, step)
                    await trainer.step_done()
                    await anyio.sleep(0.005)
                assert "leaves" not in sync.explorers  # detached on its Leave
                train_to(state, step + 1)
                await trainer.step_done()
                await trainer.stop()
    assert holds(record["stays"]["handle"].slot.model, step + 1)
    assert record["leaves"]["handle"].closed and record["leaves"]["handle"].error is None


async def test_a_lost_explorer_is_reported_and_the_trainer_serves_the_others():
    state, record = weights(0), {}
    (a0, b0), (a1, b1) = wires(2)
    cfg = dict(style="trainer_driven", sync_weight_no_wait=True, sync_timeout=5, delivery_timeout=10)
    with anyio.fail_after(HANG_GUARD):
        async with anyio.create_task_group() as tg:
            tg.start_soon(explorer_until_stopped, "ok", b0, record)
            tg.start_soon(explorer_until_stopped, "doomed", b1, record)
            async with Synchronizer(cfg, PATCH) as sync:
                trainer = await sync.attach_trainer(state)
                sync.serve_remote(a0)
                sync.serve_remote(a1)
                await sync.wait_for_explorers(2, timeout=HANG_GUARD)
                train_to(state, 1)
                await trainer.sync_weight(1, wait=True)
                a1.cut()  # the explorer's process is gone
                b1.cut()
                train_to(state, 2)
                result = await trainer.sync_weight(2, wait=True)
                lost = sync.explorers["doomed"]
                while lost.error is None:
                    await anyio.sleep(0.005)
                assert isinstance(lost.error, (TransportError, EndOfStream)) and lost.status.name == "STOPPED"
                assert "doomed" in result["failed"] or "doomed" not in result["handed_to"]
                for v in (3, 4):
                    train_to(state, v)
                    result = await trainer.sync_weight(v, wait=True)  # pushed to every live explorer
                    assert result["handed_to"] == ["ok"] and result["failed"] == []
                await trainer.stop()
    assert holds(record["ok"]["handle"].slot.model, 4)
    doomed = record["doomed"]["handle"]
    assert doomed.error is not None and "error" in record["doomed"]  # the explorer side learnt it too...
    with pytest.raises(TransportError, match="lost the synchronizer"):
        await doomed.sync_weight()  # ...and says so instead of hanging
    assert sync.metrics()["explorers"]["doomed"]["last_error"]


async def test_a_lost_explorer_may_come_back_under_its_name():
    """R2 (e.g. a Ray actor restarted): a lost session's name is free again; the explorer that
    comes back is bootstrapped afresh, and wait_for_explorers counts only sessions still open."""
    state = weights(0)
    (a0, b0), (a1, b1) = wires(2)
    cfg = dict(style="trainer_driven", sync_weight_no_wait=True, sync_timeout=5, delivery_timeout=HANG_GUARD)
    with anyio.fail_after(HANG_GUARD):
        async with Synchronizer(cfg, PATCH) as sync:
            trainer = await sync.attach_trainer(state)
            sync.serve_remote(a0)
            sync.serve_remote(a1)
            async with Explorer("e", rollout_model(), b0):
                train_to(state, 1)
                await trainer.sync_weight(1, wait=True)
                lost = sync.explorers["e"]
                a0.cut()  # the explorer's process is gone
                b0.cut()
                while not lost.closed:
                    await sync.source.changed(HANG_GUARD)
            assert lost.lost
            with pytest.raises(PeerTimeoutError):
                await sync.wait_for_explorers(1, timeout=0.05)  # the lost session does not count
            train_to(state, 2)
            await trainer.sync_weight(2, wait=True)
            async with Explorer("e", rollout_model(), b1) as back:  # a fresh model, under the same name
                assert sync.explorers["e"] is not lost and await sync.wait_for_explorers(1, HANG_GUARD) == ["e"]
                assert back.version == 2 and holds(back.slot.model, 2)
                train_to(state, 3)
                await trainer.sync_weight(3, wait=True)
                assert back.version == 3 and holds(back.slot.model, 3)
                assert sync.metrics()["explorers"]["e"]["reinits"] == 1  # its own bootstrap


async def test_explorer_refused_for_a_taken_name_or_a_dead_synchronizer():
    state = weights(0)
    (a0, b0), (a1, b1) = wires(2)
    async with Synchronizer(dict(style="fixed"), PATCH) as sync:
        await sync.attach_trainer(state)
        sync.serve_remote(a0)
        sync.serve_remote(a1)
        async with Explorer("same", rollout_model(), b0):
            with pytest.raises(HandshakeError, match="already attached"):
                async with Explorer("same", rollout_model(), b1):
                    pass
    a, b = wires(1)[0]
    with pytest.raises(PeerTimeoutError, match="no answer from the synchronizer"):
        async with Explorer("alone", rollout_model(), b, connect_timeout=0.2):
            pass


# ------------------------------------------------------------------ fan-out (S12)

async def test_fan_out_builds_each_version_once_for_explorers_at_the_same_version():
    state = weights(0)
    async with Synchronizer(dict(style="trainer_driven"), PATCH) as sync:
        trainer = await sync.attach_trainer(state)
        explorers = [await sync.attach_explorer(f"e{i}", rollout_model()) for i in range(3)]
        for v in range(1, 5):
            train_to(state, v)
            await trainer.sync_weight(v)
            for ex in explorers:
                assert await ex.sync_weight() == v
        fan = sync.metrics()["fanout"]
    assert fan["builds"] == 4  # once per version, not once per explorer
    assert fan["shared"] == 8 and fan["lineages"] == 1
    assert all(holds(ex.slot.model, 4) for ex in explorers)
    assert sum(sync.explorers[ex.name].line.stats.shared for ex in explorers) == 8


async def test_explorers_listing_their_tensors_in_other_orders_share_one_lineage():
    """A vLLM explorer lists its tensors in checkpoint order, a module explorer in module order:
    the same tensors, so one snapshot on the trainer's side and one encode per version."""
    state = weights(0)
    models = [rollout_model(), dict(reversed(list(rollout_model().items())))]
    assert list(models[0]) != list(models[1])
    async with Synchronizer(dict(style="trainer_driven"), PATCH) as sync:
        trainer = await sync.attach_trainer(state)
        explorers = [await sync.attach_explorer(f"e{i}", m) for i, m in enumerate(models)]
        for v in (1, 2):
            train_to(state, v)
            await trainer.sync_weight(v)
            for ex in explorers:
                assert await ex.sync_weight() == v
        fan = sync.metrics()["fanout"]
    assert (fan["lineages"], fan["lineages_created"], fan["attached"], fan["builds"], fan["shared"]) == (1, 1, 1, 2, 2)
    assert all(holds(m, 2) for m in models)


async def test_without_fan_out_every_explorer_builds_its_own():
    state = weights(0)
    async with Synchronizer(dict(style="trainer_driven"), PATCH, fan_out=False) as sync:
        trainer = await sync.attach_trainer(state)
        explorers = [await sync.attach_explorer(f"e{i}", rollout_model()) for i in range(2)]
        train_to(state, 1)
        await trainer.sync_weight(1)
        for ex in explorers:
            assert await ex.sync_weight() == 1
    assert sync.metrics()["fanout"] is None
    assert all(sync.explorers[ex.name].line.stats.shared == 0 for ex in explorers)


async def test_a_lagging_explorer_gets_the_chain_and_one_too_far_behind_is_rebootstrapped():
    state = weights(0)
    async with Synchronizer(dict(style="trainer_driven"), PATCH) as sync:
        sync.fanout.history = 3
        trainer = await sync.attach_trainer(state)
        fast = await sync.attach_explorer("fast", rollout_model())
        slow = await sync.attach_explorer("slow", rollout_model())
        far = await sync.attach_explorer("far", rollout_model())
        for v in (1, 2):
            train_to(state, v)
            await trainer.sync_weight(v)
            await fast.sync_weight()
        assert await slow.sync_weight() == 2  # two cached patches, each applied atomically
        assert sync.explorers[slow.name].line.stats.versions_applied[-2:] == [1, 2] and sync.explorers[slow.name].line.stats.reinits == 1
        for v in (3, 4, 5, 6):
            train_to(state, v)
            await trainer.sync_weight(v)
            await fast.sync_weight()
        assert await far.sync_weight() == 6  # history (3 packets) no longer reaches version 0
        assert sync.explorers[far.name].line.stats.reinits == 2 and sync.explorers[far.name].line.stats.versions_applied[-1] == 6
        assert await slow.sync_weight() == 6
    for ex in (fast, slow, far):
        assert holds(ex.slot.model, 6), ex.name


async def test_bucket_fan_out_sends_the_newest_packet_to_any_version():
    state = weights(0)
    async with Synchronizer(dict(style="trainer_driven"), BUCKET) as sync:
        trainer = await sync.attach_trainer(state)
        a = await sync.attach_explorer("a", rollout_model())
        b = await sync.attach_explorer("b", rollout_model())
        for v in (1, 2, 3):
            train_to(state, v)
            await trainer.sync_weight(v)
            await a.sync_weight()
        assert await b.sync_weight() == 3 and sync.explorers[b.name].line.stats.reinits == 1  # no chain, no re-bootstrap
    assert holds(a.slot.model, 3) and holds(b.slot.model, 3)
    assert sync.metrics()["fanout"]["builds"] == 3


async def test_checkpoint_follower_applies_newest_versions_atomically(tmp_path):
    d = CheckpointDir(tmp_path)
    follower = CheckpointFollower(d, rollout_model(), poll_interval=0.01, timeout=HANG_GUARD)
    assert await follower.poll() is None
    with pytest.raises(PeerTimeoutError):
        await follower.wait_for_version(0, timeout=0.05)
    d.publish(weights(0), 0)
    assert await follower.wait_for_version(0, timeout=HANG_GUARD) == 0
    d.publish(weights(3), 3)
    assert await follower.poll() == 3
    async with follower.lease() as (model, version):
        assert version == 3 and holds(model, 3)
    d.publish({"w": torch.zeros(2, 2)}, 4)  # wrong shape: refused, the held version stays
    with pytest.raises(HandshakeError, match="'w'"):
        await follower.poll()
    assert follower.version == 3 and holds(follower.slot.model, 3)


def test_hello_is_a_registered_control_message():
    hello = roundtrip(Hello("e1", None))
    assert isinstance(hello, Hello) and hello.name == "e1" and hello.version is None
    assert isinstance(roundtrip(Reinit(3, True)), Reinit)
    assert isinstance(Frame(b"{}", None, None).nbytes, int)


async def test_a_session_nobody_joins_does_not_hold_the_synchronizer_open():
    (a, _b), = wires(1)
    with anyio.fail_after(HANG_GUARD):
        async with Synchronizer(dict(style="fixed"), PATCH) as sync:
            await sync.attach_trainer(weights(0))
            sync.serve_remote(a)  # nobody ever says Hello on this one
            with pytest.raises(PeerTimeoutError, match="0 of 1 explorers"):
                await sync.wait_for_explorers(1, timeout=0.05)
    assert sync.explorers == {}


