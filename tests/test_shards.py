"""Shard-local patches (issue 16) in one process: the ranks of a sharded trainer are tasks here,
each holding its pieces as :class:`~aiosync.checkpoints.TensorSlice` s of one full state, linked
to rank 0 (the synchronizer's) by in-process channels. Real processes and FSDP2: see
``tests/test_shards_processes.py``.

The full state's values are a pure function of the version, so every check is bit-exact.
"""

from __future__ import annotations

import math

import anyio
import pytest
import torch
from anyio import wait_all_tasks_blocked

from aiosync.checkpoints import TensorSlice
from aiosync.coordination import Explorer, Synchronizer
from aiosync.coordination.shards import ShardPeer
from aiosync.errors import ApplyError, ConfigError, HandshakeError, PeerTimeoutError, TrainerRankLostError
from aiosync.messages import Shared, unshare
from aiosync.syncers import PatchWeightSyncer
from aiosync.syncers.patch.handshake import receiver_metadata
from aiosync.syncers.patch.receiver import receiver_shards
from aiosync.coordination.protocol import ShardClose, ShardGo
from aiosync.syncers.common.payloads import ShardBuild, ShardDone, ShardHello, Stamped
from aiosync.syncers.patch.shard_layout import shard_layout, shard_rows
from aiosync.syncers.patch.shards import ShardLink, ShardServer, ShardSet
from aiosync.transports.inproc import inproc_pair
from helpers import HANG_GUARD, PATCH, same_bits

pytestmark = pytest.mark.both_loops

#: Rows of dim 0 each shard holds: uneven; the last one holds nothing of the shorter tensors.
BOUNDS = [(0, 3), (3, 5), (5, 9)]
NCCL = dict(method="nccl", style="trainer_driven", sync_weight_no_wait=True, sync_timeout=10, delivery_timeout=10)


def full(v: int) -> dict[str, torch.Tensor]:
    """The trainer's whole state at version ``v``: fp32 and fp16 matrices, an fp32 vector, an
    int64 and a bool buffer, and a scalar (whole, so it belongs to shard 0)."""
    g = torch.Generator().manual_seed(3)
    return {"w": torch.randn(9, 6, generator=g) * (1 + 0.01 * v), "h": (torch.randn(7, 5, generator=g) + v).half(),
            "b": torch.randn(4, generator=g) - 0.5 * v, "ids": torch.arange(5, dtype=torch.int64) * (v + 1),
            "mask": torch.arange(3) < (v % 3), "scale": torch.tensor(1.0 + v)}


def pieces(state: dict[str, torch.Tensor], rank: int) -> dict:
    """What rank ``rank`` holds of ``state``: views of its rows (empty pieces left out)."""
    lo, hi = BOUNDS[rank]
    out: dict = {}
    for key, t in state.items():
        if t.dim() == 0:
            if rank == 0:
                out[key] = t  # whole: a replicated tensor
            continue
        a, b = min(lo, t.shape[0]), min(hi, t.shape[0])
        out[key] = TensorSlice(t[a:b], (a,) + (0,) * (t.dim() - 1), tuple(t.shape))
    return out


def rollout() -> dict[str, torch.Tensor]:
    """An explorer's copy: floating tensors in bf16, the rest as they are; wrong values."""
    return {k: torch.full_like(v, 7, dtype=torch.bfloat16) if v.is_floating_point() else torch.zeros_like(v)
            for k, v in full(0).items()}


def holds(model: dict[str, torch.Tensor], v: int) -> bool:
    want = full(v)
    return all(same_bits(model[k], want[k].to(model[k].dtype)) for k in want)


class Trainer:
    """One full state, rank 0's pieces, the other ranks' :class:`ShardPeer` s and their channels;
    ``faulty(payload)`` may drop what a rank sends to rank 0 (returns False to drop)."""

    def __init__(self, faulty=None, buffer: float = 1) -> None:
        self.state = full(0)
        self.pairs = [inproc_pair(max_buffer_size=buffer, timeout=10) for _ in BOUNDS[1:]]
        self.peers = []
        for rank, (_, peer_end) in enumerate(self.pairs, start=1):
            if faulty is not None:
                peer_end.send = _filtered(peer_end.send, faulty, rank)
            self.peers.append(ShardPeer(pieces(self.state, rank), peer_end, rank=rank, names=list(self.state),
                                        timeout=10))
        self.gates: dict[int, anyio.Event] = {}

    def train_to(self, v: int) -> None:
        for key, t in full(v).items():
            self.state[key].copy_(t)

    async def run_peer(self, peer: ShardPeer, steps: int) -> None:
        async with peer:
            for step in range(1, steps + 1):
                await self.gates[step].wait()  # a rank cannot finish a step before rank 0 trains it
                await peer.step_done()

    async def run(self, steps: int, explorers: int = 2, sync_config: dict | None = None):
        self.gates = {v: anyio.Event() for v in range(1, steps + 1)}
        with anyio.fail_after(HANG_GUARD):
            async with anyio.create_task_group() as tg:
                for peer in self.peers:
                    tg.start_soon(self.run_peer, peer, steps)
                async with Synchronizer(sync_config or NCCL, PATCH) as sync:
                    trainer = await sync.attach_trainer(pieces(self.state, 0), param_names=list(self.state),
                                                        shard_peers=[a for a, _ in self.pairs])
                    found = [await sync.attach_explorer(f"e{i}", rollout()) for i in range(explorers)]
                    for v in range(1, steps + 1):
                        self.train_to(v)
                        self.gates[v].set()
                        await trainer.step_done()
                    await trainer.stop()
        return sync, found


def _filtered(send, keep, rank):
    async def filtered(payload):
        if keep(rank, payload):
            await send(payload)

    return filtered


async def test_uneven_and_empty_shards_of_mixed_dtypes_reach_two_explorers_bit_exact():
    t = Trainer()
    sync, explorers = await t.run(steps=5)
    for ex in explorers:
        assert ex.version == 5 and holds(ex.slot.model, 5), ex.name
    m = sync.metrics()
    assert m["fanout"]["builds"] == 5  # one sharded patch per version, however many explorers
    assert m["fanout"]["lineages_created"] == 1 and m["fanout"]["attached"] == 1  # e1 joined e0's: one snapshot
    rows = m["explorers"]
    assert rows["e0"]["reinits"] == rows["e1"]["reinits"] == 1
    assert rows["e0"]["shared"] + rows["e1"]["shared"] == 5  # each version: one line built, the other reused
    # every shard built on its own rank: a rank's pieces only, whatever the others hold
    for rank, peer in enumerate(t.peers, start=1):
        # its shard's patch of each version, built once for both explorers (+ the first explorer's first one)
        assert peer.server.builds == 5 + 1
        own = sum(p.tensor.numel() * (2 if p.tensor.is_floating_point() else p.tensor.element_size())
                  for p in pieces(full(0), rank).values())
        assert peer.server.snapshot_nbytes == own  # its own rows only, in the explorers' dtypes


async def test_explorers_at_one_version_share_one_patch_with_their_own_stamps(monkeypatch):
    seen: dict[int, list] = {}
    original = PatchWeightSyncer.stage_payload

    async def spy(self, model, payload):
        if isinstance(payload, Stamped):
            inner = unshare(payload.payload)
            seen.setdefault(inner.version, []).append((payload.session, inner))
        return await original(self, model, payload)

    monkeypatch.setattr(PatchWeightSyncer, "stage_payload", spy)
    _, explorers = await Trainer().run(steps=4)
    assert all(holds(ex.slot.model, 4) for ex in explorers)
    for v in range(1, 5):
        (s0, p0), (s1, p1) = seen[v]
        assert p0 is p1 and s0 != s1  # one object (encoded once), a stamp per explorer beside it
        assert len(p0.shards) == len(BOUNDS) and all(isinstance(part, Shared) for part in p0.shards)


async def test_a_lost_shard_patch_is_repaired_for_that_version_only():
    lost = []

    def keep(rank, payload):  # rank 2's patch of version 3 never reaches rank 0
        if rank == 2 and isinstance(payload, Shared) and payload.value.version == 3:
            lost.append(payload.value.version)
            return False
        return True

    sync, explorers = await Trainer(keep).run(steps=6, explorers=1)
    (ex,) = explorers
    line = sync.explorers["e0"].line.stats
    assert lost == [3]
    assert ex.version == 6 and holds(ex.slot.model, 6)
    assert line.failed == 1 and line.repairs == 1 and line.reinits == 2  # the first bootstrap, one repair
    applied = line.versions_applied
    assert 3 not in applied and applied[-3:] == [4, 5, 6], applied  # repaired at the next step, then patches


async def test_a_shard_write_that_fails_rolls_back_every_shard():
    state, step = full(0), [0]
    names = list(state)
    async with anyio.create_task_group() as tg:
        links = []
        for rank in range(1, len(BOUNDS)):
            a, b = inproc_pair(max_buffer_size=1, timeout=5)
            server = ShardServer(rank, lambda rank=rank: pieces(state, rank), names, b.send, lambda: step[0])
            links.append(ShardLink(rank, a.send, a.recv, server.hello().pieces))
            tg.start_soon(_serve, server, b)
        shards = ShardSet(lambda: pieces(state, 0), names, links, PATCH, lambda: step[0], timeout=5)
        sender, receiver, model = shards.make(bootstrap=True), PatchWeightSyncer(), rollout()
        x, y = inproc_pair(timeout=5)
        async with anyio.create_task_group() as pair:
            pair.start_soon(sender.init_sender, pieces(state, 0), names, x.send, x.recv)
            await receiver.init_receiver(model, y.recv, y.send)
        assert holds(model, 0) and len(receiver._rx.shards) == len(BOUNDS)
        calls = []

        def fail_late(i, n):  # a tensor of the last shard fails, after the other shards were written
            calls.append((i, n))
            if len(calls) == 8:
                raise RuntimeError("injected write failure")

        receiver.after_each_write = fail_late
        for key, t in full(1).items():
            state[key].copy_(t)
        step[0] = 1
        await sender.sync(pieces(state, 0), x.send, 1)
        with pytest.raises(ApplyError, match="injected write failure"):
            await receiver.apply(model, y.recv)
        assert len(calls) == 8 and receiver.version is None  # the commit did not happen...
        assert holds(model, 0)  # ...and nothing of version 1 stayed written, in any shard
        tg.cancel_scope.cancel()


async def _join_late(sync, how: str, name: str, joined: anyio.Event, release: anyio.Event, out: dict,
                     timeout: float = HANG_GUARD) -> None:
    """An explorer that joins now: attached in this task (``attach_explorer``), or one in
    "another process" over a wire that rank 0 serves, taken in by ``wait_for_explorers``."""
    if how == "attach_explorer":
        out[name] = await sync.attach_explorer(name, rollout())
        return
    a, b = inproc_pair(timeout=10)
    sync.serve_remote(a)

    async def remote() -> None:
        try:
            async with Explorer(name, rollout(), b, connect_timeout=HANG_GUARD) as ex:
                out[name] = ex
                joined.set()
                await release.wait()
        except Exception as exc:  # the join failed: say why (its error names who stalled)
            out[name] = exc
            joined.set()

    sync._tg.start_soon(remote)
    await sync.wait_for_explorers(len(sync.explorers) + 1, timeout=timeout)


@pytest.mark.parametrize("how", ["wait_for_explorers", "attach_explorer"])
async def test_a_joiner_between_two_steps_is_served_by_every_rank(how):
    """Issue 34 item 6: a joiner between two steps — the other ranks are stuck in their next
    step's collective, which waits for rank 0 (here: their gate) — is bootstrapped from every
    rank's live shards of the step just done, while rank 0 waits for it (before: rank 1 only
    served it at its next step_done — never: the join failed after delivery_timeout)."""
    t = Trainer()
    t.gates = {v: anyio.Event() for v in (1, 2, 3)}
    joined, release, out = anyio.Event(), anyio.Event(), {}
    with anyio.fail_after(HANG_GUARD):
        async with anyio.create_task_group() as tg:
            for peer in t.peers:
                tg.start_soon(t.run_peer, peer, 3)
            async with Synchronizer(NCCL, PATCH) as sync:
                trainer = await sync.attach_trainer(pieces(t.state, 0), param_names=list(t.state),
                                                    shard_peers=[a for a, _ in t.pairs])
                first = await sync.attach_explorer("e0", rollout())
                for v in (1, 2):
                    t.train_to(v)
                    t.gates[v].set()
                    await trainer.step_done()
                await _join_late(sync, how, "late", joined, release, out)  # ranks 1, 2: between steps 2 and 3
                late = out["late"]
                assert not isinstance(late, Exception), late
                async with late.lease() as (model, version):
                    assert version == 2 and holds(model, 2)  # every rank's shard of step 2
                t.train_to(3)
                t.gates[3].set()
                await trainer.step_done()
                await trainer.stop()
                release.set()
    assert first.version == late.version == 3 and holds(late.slot.model, 3) and holds(first.slot.model, 3)


async def test_a_rank_that_stalls_a_join_is_named():
    """Issue 34 item 6: a rank that is not at rank 0's step (stuck in its training) stalls a
    joiner's bootstrap: the errors name that rank, not the joiner."""
    t = Trainer()
    t.gates = {v: anyio.Event() for v in (1, 2)}
    stuck = anyio.Event()
    joined, release, out = anyio.Event(), anyio.Event(), {}

    async def slow_rank(peer: ShardPeer) -> None:  # rank 1 finishes step 1, then never step 2
        async with peer:
            await t.gates[1].wait()
            await peer.step_done()
            await stuck.wait()

    cfg = dict(NCCL, delivery_timeout=3.0)  # the explorer's part of its join takes far less
    with anyio.fail_after(HANG_GUARD):
        async with anyio.create_task_group() as tg:
            tg.start_soon(slow_rank, t.peers[0])
            tg.start_soon(t.run_peer, t.peers[1], 2)
            async with Synchronizer(cfg, PATCH) as sync:
                trainer = await sync.attach_trainer(pieces(t.state, 0), param_names=list(t.state),
                                                    shard_peers=[a for a, _ in t.pairs])
                for v in (1, 2):
                    t.train_to(v)
                    t.gates[v].set()
                    await trainer.step_done()
                with pytest.raises(PeerTimeoutError) as waited:
                    await _join_late(sync, "wait_for_explorers", "late", joined, release, out, timeout=8.0)
                await joined.wait()
                stuck.set()
                await trainer.stop()
                tg.cancel_scope.cancel()
    assert "shard rank 1" in str(out["late"]) and "shard rank 1" in str(waited.value)
    assert "is it alive" not in str(out["late"])


async def test_a_lost_rank_ends_the_trainer_with_an_error_naming_it():
    """Issue 30: a shard rank that is gone (its process died: its end of the channel closed)
    makes rank 0's step_done raise TrainerRankLostError naming it, at once — a sharded trainer
    cannot go on without it (before: a bare EndOfStream from the channel, naming no rank)."""
    t = Trainer(buffer=math.inf)  # rank 1 answers a conversation rank 0 gave up without blocking
    t.gates = {v: anyio.Event() for v in (1, 2)}

    async def dying_rank(peer: ShardPeer) -> None:  # rank 2 does step 1, then its process dies
        with anyio.CancelScope() as scope:
            async with peer:
                await t.gates[1].wait()
                await peer.step_done()
                t.pairs[1][1].close()
                scope.cancel()

    with anyio.fail_after(HANG_GUARD):
        async with anyio.create_task_group() as tg:
            tg.start_soon(t.run_peer, t.peers[0], 2)
            tg.start_soon(dying_rank, t.peers[1])
            with pytest.raises(TrainerRankLostError) as lost:
                async with Synchronizer(NCCL, PATCH) as sync:
                    trainer = await sync.attach_trainer(pieces(t.state, 0), param_names=list(t.state),
                                                        shard_peers=[a for a, _ in t.pairs])
                    await sync.attach_explorer("e0", rollout())
                    for v in (1, 2):
                        t.train_to(v)
                        t.gates[v].set()
                        await trainer.step_done()
    assert lost.value.rank == 2 and "trainer rank 2 is gone" in str(lost.value)


class _Breaking:
    """Rank 0's end of a channel to a rank whose transport can tell that it broke (as a
    ``RayChannel``'s ``wait_broken()`` does when the rank's actor dies) — here when ``dies`` is set."""

    def __init__(self, end) -> None:
        self.end, self.dies = end, anyio.Event()
        self.send, self.recv = end.send, end.recv

    async def wait_broken(self) -> Exception:
        await self.dies.wait()
        return ConnectionError("the rank's actor died (test)")


async def _lose_rank_2(when: str, *, steps: int = 0, config: dict | None = None, hang: bool = False) -> tuple:
    """Rank 2 serves the explorer's bootstrap (and ``steps`` steps), then its process dies —
    its channel closes, or (``hang``) it stops answering and only its transport says it broke;
    then rank 0 calls ``when`` (``"sync_weight"`` or ``"stop"``). Returns the error raised
    leaving the synchronizer, where rank 0 first saw it, and the trainer."""
    t = Trainer(buffer=math.inf)
    if hang:  # every other bound is longer than the test's: only the transport's signal can end it
        t.pairs[1] = inproc_pair(timeout=4 * HANG_GUARD)
        t.peers[1] = ShardPeer(pieces(t.state, 2), t.pairs[1][1], rank=2, names=list(t.state), timeout=4 * HANG_GUARD)
    rank0_end = _Breaking(t.pairs[1][0])
    t.gates = {v: anyio.Event() for v in range(1, steps + 2)}
    attached, first = anyio.Event(), []
    cfg = dict(config or NCCL, sync_timeout=4 * HANG_GUARD, delivery_timeout=4 * HANG_GUARD) if hang else config

    async def dying_rank(peer: ShardPeer) -> None:
        with anyio.CancelScope() as scope:
            async with peer:
                await attached.wait()
                for v in range(1, steps + 1):
                    await t.gates[v].wait()
                    await peer.step_done()
                if not hang:
                    t.pairs[1][1].close()
                scope.cancel()
        rank0_end.dies.set()

    with anyio.fail_after(HANG_GUARD):
        async with anyio.create_task_group() as tg:
            tg.start_soon(t.run_peer, t.peers[0], steps + 1)
            tg.start_soon(dying_rank, t.peers[1])
            with pytest.raises(TrainerRankLostError) as lost:
                async with Synchronizer(cfg or NCCL, PATCH) as sync:
                    trainer = await sync.attach_trainer(pieces(t.state, 0), param_names=list(t.state),
                                                        shard_peers=[t.pairs[0][0], rank0_end])
                    await sync.attach_explorer("e0", rollout())
                    attached.set()
                    for v in range(1, steps + 1):
                        t.train_to(v)
                        t.gates[v].set()
                        await trainer.step_done()
                    await rank0_end.dies.wait()
                    t.train_to(steps + 1)
                    try:
                        await (trainer.sync_weight() if when == "sync_weight" else trainer.stop())
                    except TrainerRankLostError:
                        first.append(when)
                        raise
            tg.cancel_scope.cancel()  # rank 1 waits for a step that never comes
    return lost.value, first, trainer


@pytest.mark.parametrize("hang", [False, True], ids=["closed", "transport_says"])
async def test_a_rank_lost_before_a_direct_sync_weight_is_named_by_it(hang):
    """Issue 30: a sharded trainer's direct ``sync_weight()`` (not ``step_done``) with a rank
    gone raises TrainerRankLostError naming it, at once — its channel closed, or (``hang``) the
    rank only stopped answering and its transport says it broke (before: the sync's deliveries
    failed and were repaired until their bounds, naming no rank; with ``hang`` every bound is
    longer than the test's)."""
    lost, first, _ = await _lose_rank_2("sync_weight", hang=hang)
    assert first == ["sync_weight"] and lost.rank == 2 and "trainer rank 2 is gone" in str(lost)
    if hang:
        assert "its transport says it broke" in str(lost) and "actor died" in str(lost)


async def test_a_rank_lost_before_stop_is_named_by_stop_which_still_stops():
    """``stop()`` publishing the steps trained since the last sync, with a rank gone: it raises
    TrainerRankLostError naming the rank, and the trainer is stopped all the same."""
    lost, first, trainer = await _lose_rank_2("stop", steps=1, config=dict(NCCL, sync_interval=2))
    assert first == ["stop"] and lost.rank == 2
    assert trainer.status.name == "STOPPED"


async def _serve(server: ShardServer, end) -> None:
    while True:
        await server.handle(await end.recv())


async def test_a_command_for_a_step_a_rank_has_not_reached_waits_for_it():
    to_rank0, peer_end = inproc_pair(timeout=10)
    peer = ShardPeer(pieces(full(0), 1), peer_end, rank=1, names=list(full(0)), timeout=10)
    with anyio.fail_after(HANG_GUARD):
        async with anyio.create_task_group() as tg:
            async with peer:
                assert isinstance(await to_rank0.recv(), ShardHello)
                # rank 0 reached its check point of step 1 first: this rank still trains step 1
                await to_rank0.send(ShardBuild(7, 1, 1))
                await wait_all_tasks_blocked()
                with pytest.raises(anyio.WouldBlock):
                    to_rank0._rx.receive_nowait()  # not refused as out of step: it waits
                tg.start_soon(peer.step_done)  # this rank reaches step 1: now the command runs
                done = await to_rank0.recv()
                assert isinstance(done, ShardDone) and not done.ok and "no sender 7" in done.error  # run, at step 1
                await to_rank0.send(ShardGo(1))
                await to_rank0.send(ShardClose())


async def test_a_cancelled_peer_step_done_is_resumed_by_the_next_call():
    """Issue 34: a shard rank's step_done cancelled while it waits for rank 0's check point is
    resumed by the next call — the same step, not one more (before: the rank counted a step
    rank 0 never reached, and every later command was out of step)."""
    to_rank0, peer_end = inproc_pair(timeout=10)
    peer = ShardPeer(pieces(full(0), 1), peer_end, rank=1, names=list(full(0)), timeout=10)
    with anyio.fail_after(HANG_GUARD):
        async with peer:
            assert isinstance(await to_rank0.recv(), ShardHello)
            with anyio.CancelScope() as scope:
                async with anyio.create_task_group() as tg:
                    tg.start_soon(peer.step_done)
                    await wait_all_tasks_blocked()  # waiting for rank 0's check point of step 1
                    scope.cancel()
            async with anyio.create_task_group() as tg:
                tg.start_soon(peer.step_done)  # the same check point
                await wait_all_tasks_blocked()
                await to_rank0.send(ShardGo(1))
            assert peer.step == 1
            await to_rank0.send(ShardClose())


async def test_a_command_for_another_step_is_refused():
    state = full(0)
    sent = []

    async def send(msg):
        sent.append(msg)

    server = ShardServer(1, lambda: pieces(state, 1), list(state), send, lambda: 4)
    await server.handle(ShardBuild(1, 3, 3))
    (done,) = sent
    assert not done.ok and "step 4" in done.error and "step 3" in done.error


def test_pieces_must_tile_every_tensor():
    state = full(0)
    good = [shard_layout(pieces(state, r), r, list(state))[1] for r in range(len(BOUNDS))]
    assert good[2].get("b") is None and good[2].get("mask") is None  # empty pieces are left out
    gap = [good[0], good[2]]  # rows 3..5 of w belong to nobody
    with pytest.raises(ConfigError, match="not covered exactly once"):
        shard_rows(gap)
    with pytest.raises(ConfigError, match="whole in one shard and also"):
        shard_rows([good[0], {**good[1], "scale": good[0]["scale"]}, good[2]])
    block = {"w": TensorSlice(state["w"][:, :3], (0, 0), (9, 6))}
    with pytest.raises(ConfigError, match="whole rows"):
        shard_layout(block, 1, ["w"])


def test_a_receiver_refuses_a_shard_table_that_does_not_fit_it():
    model = rollout()
    meta = receiver_metadata(model, 5)
    table = [{"rows": {"w": [0, 4]}, "synced": [0], "init_sync": False}, {"rows": {"w": [5, 4]}, "synced": [0],
                                                                            "init_sync": False}]
    with pytest.raises(HandshakeError, match="rows of 'w'"):
        receiver_shards(model, meta, table, 5)
    table[1]["rows"]["w"] = [4, 5]
    table[1]["synced"] = [3]
    with pytest.raises(HandshakeError, match="synced ordinals"):
        receiver_shards(model, meta, table, 5)


async def test_a_sharded_trainer_needs_the_nccl_method_and_a_patch_syncer():
    a, _ = inproc_pair(timeout=1)
    async with Synchronizer(dict(method="memory"), PATCH) as sync:
        with pytest.raises(ConfigError, match="method: nccl"):
            await sync.attach_trainer(pieces(full(0), 0), param_names=list(full(0)), shard_peers=[a])
    async with Synchronizer(dict(method="nccl"), {"type": "bucket"}) as sync:
        with pytest.raises(ConfigError, match="patch weight_syncer"):
            await sync.attach_trainer(pieces(full(0), 0), param_names=list(full(0)), shard_peers=[a])
