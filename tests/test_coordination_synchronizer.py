"""The Synchronizer end to end, in one process, with the real patch and bucket syncers.

Models are tiny state dicts whose weights are a pure function of the version, so every
check is bit-exact. Nothing here asserts on elapsed time; "does not finish before X" is shown
with gates that hold a delivery until the test opens them.
"""

from __future__ import annotations

import anyio
import pytest
import torch

from aiosync.coordination import Packet, RunningStatus, StalenessFilter, Synchronizer
from aiosync.coordination.metrics import flatten
from aiosync.errors import StateTransitionError
from aiosync.runners import ExplorerLoop, TrainerLoop
from aiosync.syncers import BucketWeightSyncer
from aiosync.cli.simulate import is_delivery
from aiosync.transports.simulated import simulated_pair
from helpers import (HANG_GUARD, PATCH, PATCH_COO, Gate, gated, holds, rollout_model, settle, train_to, trainer_state,
                     weights)

S, R, Q = RunningStatus.STOPPED, RunningStatus.RUNNING, RunningStatus.REQUIRE_SYNC

pytestmark = pytest.mark.both_loops


def transitions_are_well_formed(history) -> bool:
    """Every REQUIRE_SYNC is left again, and the states chain."""
    return all(a[1] == b[0] for a, b in zip(history, history[1:]))


def packets(msg) -> bool:
    return isinstance(msg, Packet)


# ------------------------------------------------------------------ methods x styles

@pytest.mark.parametrize("style", ["fixed", "explorer_driven", "trainer_driven"])
@pytest.mark.parametrize("method", ["memory", "checkpoint", "nccl"])
async def test_each_method_and_style_runs_with_the_seeds_transitions(method, style, tmp_path):
    """User coroutines for one trainer and two explorers; checks the state machine of the seed."""
    config = dict(method=method, style=style, sync_interval=2, sync_timeout=5.0, delivery_timeout=HANG_GUARD)
    if method == "checkpoint":
        config["checkpoint_dir"] = str(tmp_path)
    state = trainer_state()
    seen: list[tuple[RunningStatus, RunningStatus]] = []
    with anyio.fail_after(HANG_GUARD):
        async with Synchronizer(config, PATCH) as sync:
            trainer = await sync.attach_trainer(state)
            explorers = [await sync.attach_explorer(f"e{i}", rollout_model()) for i in range(2)]

            async def trainer_loop():
                for step in range(1, 7):
                    train_to(state, step)
                    await anyio.sleep(0.002)
                    await trainer.step_done()
                    seen.append((trainer.status, max(e.status for e in explorers)))
                await trainer.stop()

            async def explorer_loop(ex):
                while trainer.status is not S:
                    async with ex.lease() as (model, version):
                        assert holds(model, version)
                        await anyio.sleep(0.002)
                    await ex.step_done()
                await ex.stop()

            async with anyio.create_task_group() as tg:
                tg.start_soon(trainer_loop)
                for ex in explorers:
                    tg.start_soon(explorer_loop, ex)
        # leaving the block drained: everyone holds the last published version, bit for bit
    assert trainer.version == 6 and trainer.status is S
    for ex in explorers:
        assert ex.version == 6 and holds(ex.slot.model, 6)
        versions = sync.explorers[ex.name].line.stats.versions_applied
        assert versions == sorted(set(versions)) and versions[-1] == 6
        h = ex.state.history
        assert h[0] == (S, R) and h[-1][1] is S and transitions_are_well_formed(h)
        assert (R, Q) in h and (Q, R) in h  # explorers ask, then run again
    if method == "nccl":  # two-way handshake: the trainer also goes REQUIRE_SYNC and back
        assert (R, Q) in trainer.state.history and (Q, R) in trainer.state.history
    else:  # MEMORY / CHECKPOINT: the trainer only stores weights and stays RUNNING
        assert trainer.state.history == [(S, R), (R, S)]
    if method == "checkpoint":
        assert [p.name for p in tmp_path.iterdir() if p.name[0] != "."] == [sync.source.directory.file_for(6).name]


async def test_memory_fixed_schedule_with_offset():
    state = trainer_state()
    async with Synchronizer(dict(style="fixed", sync_interval=2, sync_offset=1), PATCH) as sync:
        trainer = await sync.attach_trainer(state)
        ex = await sync.attach_explorer("e0", rollout_model())
        # attach: the first sync, always blocking — the synchronizer's view of the explorer went
        # REQUIRE_SYNC and back; the explorer itself starts RUNNING once it holds weights
        assert sync.explorers["e0"].state.history == [(S, R), (R, Q), (Q, R)]
        assert ex.state.history == [(S, R)]
        synced_at = []
        for step in range(1, 6):  # one train step, then one explore step
            train_to(state, step)
            trainer.step = step
            assert trainer.need_sync() == (step % 2 == 0)
            if trainer.need_sync():
                await trainer.sync_weight()
            ex.step = step
            if ex.need_sync():
                synced_at.append(step)
                await ex.sync_weight()
        # trainer published at 2 and 4; the explorer (one step ahead) synced after explore steps 3 and 5
        assert trainer.syncs == 2 and trainer.version == 4
        assert synced_at == [3, 5]
        assert ex.version == 4 and holds(ex.slot.model, 4)
        assert trainer.state.history == [(S, R)]


async def test_checkpoint_trainer_driven_explorer_picks_up_at_its_next_check(tmp_path):
    state = trainer_state()
    cfg = dict(method="checkpoint", checkpoint_dir=str(tmp_path), style="trainer_driven")
    async with Synchronizer(cfg, PATCH_COO) as sync:
        trainer = await sync.attach_trainer(state)
        ex = await sync.attach_explorer("e0", rollout_model())
        train_to(state, 1)
        await trainer.step_done()  # the first sync: blocking, reaches the explorer
        assert ex.version == 1 and not ex.need_sync()
        train_to(state, 2)
        await trainer.step_done()  # published to disk; the explorer has not looked yet
        await settle()  # the synchronizer's notice reaches the explorer
        assert ex.version == 1 and holds(ex.slot.model, 1)
        assert ex.need_sync()
        assert await ex.sync_weight() == 2 and holds(ex.slot.model, 2)
        assert [p.name for p in tmp_path.iterdir() if p.name[0] != "."] == [sync.source.directory.file_for(2).name]
        await trainer.stop()


async def test_nccl_handshake_both_sides_require_sync_then_run():
    state = trainer_state()
    async with Synchronizer(dict(method="nccl", style="trainer_driven", sync_timeout=10), PATCH) as sync:
        trainer = await sync.attach_trainer(state)
        ex = await sync.attach_explorer("e0", rollout_model())
        base = len(trainer.state.history)
        observed = []

        async def explorer_check():
            await trainer.state.wait_for(Q, timeout=HANG_GUARD)  # the trainer asks...
            await settle()  # (its notice reaches the explorer)
            assert ex.need_sync()
            async with anyio.create_task_group() as tg:
                tg.start_soon(ex.sync_weight)
                await ex.state.wait_for(Q, timeout=HANG_GUARD)  # ...the explorer answers
                observed.append((trainer.status, ex.status))

        train_to(state, 1)
        trainer.step = 1
        async with anyio.create_task_group() as tg:
            tg.start_soon(explorer_check)
            await trainer.sync_weight()
        assert observed == [(Q, Q)]
        assert trainer.state.history[base:] == [(R, Q), (Q, R)]
        assert ex.status is R and trainer.status is R and holds(ex.slot.model, 1)

        # Nobody answers: the handshake times out, the trainer carries on.
        async with Synchronizer(dict(method="nccl", style="fixed", sync_timeout=0.05), PATCH) as sync2:
            t2 = await sync2.attach_trainer(trainer_state())
            e2 = await sync2.attach_explorer("e0", rollout_model())
            result = await t2.sync_weight(1, wait=False)
            assert t2.handshake_timeouts == 1 and t2.status is R and result["handed_to"] == []
            assert e2.version == 0
            await t2.stop()  # stop() serves the explorer that missed version 1
            assert e2.version == 1


# ------------------------------------------------------------------ EXPLORER_DRIVEN, S5

async def test_explorer_driven_times_out_then_retries_at_its_next_step():
    """S3: the explorer asks once ``sync_interval`` steps passed since its last *successful*
    sync, so an ask that timed out is repeated at the very next step, not a cycle later."""
    state = trainer_state()
    cfg = dict(style="explorer_driven", sync_interval=2, sync_timeout=0.1)
    async with Synchronizer(cfg, PATCH) as sync:
        trainer = await sync.attach_trainer(state)
        ex = await sync.attach_explorer("e0", rollout_model())
        train_to(state, 1)
        trainer.step = 1  # trained, but the trainer does not check for requests
        assert await ex.step_done() == 0 and ex.timeouts == 0  # step 1: no request
        assert await ex.step_done() == 0  # step 2: asks, nobody serves, times out, carries on
        assert ex.timeouts == 1 and ex.status is R and ex.state.history[-2:] == [(R, Q), (Q, R)]
        assert not trainer.need_sync() and ex.version == 0 and holds(ex.slot.model, 0)
        assert ex.need_sync()  # step 2 did not sync: the next step asks again
        sync.config.sync_timeout = HANG_GUARD  # from here on, only a hang may time out

        async def trainer_check():
            with anyio.fail_after(HANG_GUARD):
                while not trainer.need_sync():  # the trainer notices the request at its next check
                    await anyio.sleep(0.001)
            await trainer.sync_weight()

        async with anyio.create_task_group() as tg:
            tg.start_soon(trainer_check)
            assert await ex.step_done() == 1  # step 3: asks again at once and is served
        assert ex.timeouts == 1 and holds(ex.slot.model, 1) and trainer.version == 1
        requests = ex.statistics().requests
        await ex.step_done()  # step 4: one step since the successful sync at step 3: no request
        assert ex.statistics().requests == requests and not ex.need_sync()
        ex.step += 1  # step 5: two steps since it: due again
        assert ex.need_sync()


@pytest.mark.parametrize("method", ["memory", "nccl"])
async def test_explorer_waiting_on_a_stopped_trainer_returns_at_once(method):
    cfg = dict(method=method, style="explorer_driven", sync_timeout=HANG_GUARD * 10)
    async with Synchronizer(cfg, PATCH) as sync:
        trainer = await sync.attach_trainer(trainer_state())
        ex = await sync.attach_explorer("e0", rollout_model())
        await trainer.stop()
        with anyio.fail_after(HANG_GUARD):  # far below sync_timeout: it must not wait for it
            assert await ex.sync_weight() == 0
        assert ex.status is R and not trainer.need_sync()
        with pytest.raises(StateTransitionError):
            await trainer.sync_weight(1)

        async def pending_request():  # a request already waiting is released by the stop
            return await ex.sync_weight()

    async with Synchronizer(cfg, PATCH) as sync:
        trainer = await sync.attach_trainer(trainer_state())
        ex = await sync.attach_explorer("e0", rollout_model())
        async with anyio.create_task_group() as tg:
            tg.start_soon(ex.sync_weight)
            await ex.state.wait_for(Q, timeout=HANG_GUARD)
            with anyio.fail_after(HANG_GUARD):
                await trainer.stop()
        assert ex.status is R and ex.version == 0


# ------------------------------------------------------------------ no-wait, coalescing, S9

async def test_no_wait_hands_off_and_coalesces_without_dropping_the_newest():
    gate = Gate()
    state = trainer_state()
    cfg = dict(style="trainer_driven", sync_weight_no_wait=True)
    async with Synchronizer(cfg, PATCH, transport_factory=gated(gate, packets)) as sync:
        trainer = await sync.attach_trainer(state)
        ex = await sync.attach_explorer("e0", rollout_model())
        train_to(state, 1)
        await trainer.step_done()  # first sync: blocking
        assert ex.version == 1
        gate.close()
        for step in range(2, 9):
            train_to(state, step)
            result = await trainer.sync_weight(step)  # returns once handed off
            assert result["blocking"] is False
            if step == 2:
                await gate.wait_blocked()  # version 2 is in flight, held by the gate
            assert sync.explorers[ex.name].line.pending.pending <= 1
        # rollouts meanwhile use the old weights, whole
        async with ex.lease() as (model, version):
            assert version == 1 and holds(model, 1)
        assert sync.explorers["e0"].status is Q  # as the synchronizer sees it: a delivery is due
        p = sync.explorers[ex.name].line.pending.stats
        assert p.coalesced == 5 and p.max_pending == 1  # 3..8 merged into one pending request
        gate.open()
        assert await ex.wait_applied() == 8
        assert sync.explorers[ex.name].line.stats.versions_applied == [0, 1, 2, 8]  # in flight, then the newest
        assert holds(ex.slot.model, 8) and ex.status is R and sync.explorers["e0"].status is R


async def test_first_sync_is_blocking_even_with_no_wait():
    gate = Gate()
    state = trainer_state()
    async with Synchronizer(dict(style="trainer_driven", sync_weight_no_wait=True), PATCH,
                            transport_factory=gated(gate, packets)) as sync:
        trainer = await sync.attach_trainer(state)
        ex = await sync.attach_explorer("e0", rollout_model())
        gate.close()
        train_to(state, 1)
        returned = []

        async def first_sync():
            returned.append(await trainer.sync_weight(1))

        async with anyio.create_task_group() as tg:
            tg.start_soon(first_sync)
            await gate.wait_blocked()
            await settle()
            assert returned == [] and ex.version == 0
            gate.open()
        assert returned[0]["blocking"] is True and ex.version == 1


async def test_a_blocking_sync_waits_for_outstanding_background_applies():
    gate = Gate()
    state = trainer_state()
    async with Synchronizer(dict(style="trainer_driven", sync_weight_no_wait=True), PATCH,
                            transport_factory=gated(gate, packets)) as sync:
        trainer = await sync.attach_trainer(state)
        ex = await sync.attach_explorer("e0", rollout_model())
        train_to(state, 1)
        await trainer.sync_weight(1)
        gate.close()
        train_to(state, 2)
        await trainer.sync_weight(2)  # background
        await gate.wait_blocked()
        done = []

        async def blocking_sync():
            train_to(state, 3)
            done.append(await trainer.sync_weight(3, wait=True))

        async with anyio.create_task_group() as tg:
            tg.start_soon(blocking_sync)
            await settle()
            assert done == [] and ex.version == 1
            gate.open()
        assert ex.version == 3 and holds(ex.slot.model, 3)
        assert sync.explorers[ex.name].line.stats.versions_applied == [0, 1, 2, 3]


async def test_shutdown_waits_for_background_applies():
    gate = Gate()
    state = trainer_state()
    exited = []
    handles = {}

    async def runner():
        async with Synchronizer(dict(style="trainer_driven", sync_weight_no_wait=True), PATCH,
                                transport_factory=gated(gate, packets)) as sync:
            trainer = await sync.attach_trainer(state)
            handles["ex"] = await sync.attach_explorer("e0", rollout_model())
            train_to(state, 1)
            await trainer.sync_weight(1)
            gate.close()
            train_to(state, 2)
            await trainer.sync_weight(2)  # returns at once; the apply is outstanding
            await trainer.stop()
        exited.append(True)

    async with anyio.create_task_group() as tg:
        tg.start_soon(runner)
        await gate.wait_blocked()
        await settle()
        assert exited == [] and handles["ex"].version == 1
        gate.open()
    assert exited == [True]
    assert handles["ex"].version == 2 and holds(handles["ex"].slot.model, 2)


# ------------------------------------------------------------------ failures

class FlakyBucket(BucketWeightSyncer):
    """Bucket receiver that can fail after it already loaded its first bucket."""

    fail = False

    async def stage(self, model, recv):
        received = 0

        async def counting_recv():
            nonlocal received
            if FlakyBucket.fail and received == 1:
                raise ConnectionResetError("injected: lost the link after one bucket")
            received += 1
            return await recv()

        return await super().stage(model, counting_recv)


async def test_a_failed_apply_leaves_version_and_weights_untouched_and_is_repaired():
    state = trainer_state()
    FlakyBucket.fail = False
    async with Synchronizer(dict(style="fixed"), lambda: FlakyBucket(bucket_size=512)) as sync:
        trainer = await sync.attach_trainer(state)
        ex = await sync.attach_explorer("e0", rollout_model())
        train_to(state, 1)
        await trainer.sync_weight(1)
        assert ex.version == 1
        FlakyBucket.fail = True
        train_to(state, 2)
        await trainer.sync_weight(2)
        assert await ex.sync_weight() == 1  # the delivery failed half way (while staging)...
        assert holds(ex.slot.model, 1)  # ...and nothing of it was written
        m = sync.metrics()["explorers"]["e0"]
        assert m["failed"] == 1 and "injected: lost the link" in m["last_error"]
        FlakyBucket.fail = False
        assert await ex.sync_weight() == 2 and holds(ex.slot.model, 2)  # repaired next time
        assert sync.metrics()["explorers"]["e0"]["reinits"] == 2


async def test_a_lost_patch_is_repaired_by_a_rebootstrap():
    ends = {}

    def factory(name):
        ends[name] = simulated_pair(seed=5)
        for end in ends[name]:
            end.faults_where = is_delivery  # the lost message is the Packet, not a notice
        return ends[name]

    state = trainer_state()
    async with Synchronizer(dict(style="fixed"), PATCH, transport_factory=factory) as sync:
        trainer = await sync.attach_trainer(state)
        ex = await sync.attach_explorer("e0", rollout_model())
        train_to(state, 1)
        await trainer.sync_weight(1)
        ends["e0"][0].fail_next(1)  # the next packet is lost on the wire
        train_to(state, 2)
        await trainer.sync_weight(2)
        assert await ex.sync_weight() == 1 and holds(ex.slot.model, 1)
        assert sync.explorers[ex.name].line.stats.failed == 1 and sync.explorers[ex.name].line.needs_reinit
        train_to(state, 3)
        await trainer.sync_weight(3)
        assert await ex.sync_weight() == 3 and holds(ex.slot.model, 3)
        assert sync.explorers[ex.name].line.stats.reinits == 2
        assert sync.explorers[ex.name].line.stats.versions_applied == [0, 1, 3]


# ------------------------------------------------------------------ staleness, fan-out, loops

async def test_staleness_is_measured_with_the_applied_version():
    gate = Gate()
    state = trainer_state()
    cfg = dict(style="trainer_driven", sync_weight_no_wait=True, max_staleness=1)
    async with Synchronizer(cfg, PATCH, transport_factory=gated(gate, packets)) as sync:
        trainer = await sync.attach_trainer(state)
        ex = await sync.attach_explorer("e0", rollout_model())
        train_to(state, 1)
        await trainer.step_done()
        gate.close()
        for step in (2, 3, 4):
            train_to(state, step)
            await trainer.step_done()  # requested in the background, not yet applied
        await gate.wait_blocked()
        async with ex.lease() as (_, version):
            old_sample = {"version": version, "obs": 0}
        assert old_sample["version"] == 1  # the version that really produced it
        result = trainer.filter_stale([old_sample])
        assert result.kept == [] and result.dropped == 1 and result.staleness == [3]
        gate.open()
        await ex.wait_applied()
        async with ex.lease() as (_, version):
            new_sample = {"version": version, "obs": 1}
        result = trainer.filter_stale([new_sample, old_sample])
        assert result.kept == [new_sample] and result.weights == [1.0] and result.staleness == [0, 3]
        summary = sync.metrics()["staleness"]
        assert summary["dropped"] == 2 and summary["max"] == 3


def test_staleness_downweighting():
    f = StalenessFilter(max_staleness=2, mode="downweight", decay=0.5)
    res = f.filter([{"version": v} for v in (10, 9, 8, 7, 5)], current_version=10)
    assert res.dropped == 0 and res.weights == [1.0, 1.0, 1.0, 0.5, 0.125]
    with pytest.raises(ValueError, match="newer than the trainer"):
        f.filter([{"version": 11}], current_version=10)
    with pytest.raises(AttributeError, match="stamp every sample"):
        f.filter([object()], current_version=10)


async def test_fan_out_with_a_late_joiner():
    state = trainer_state()
    async with Synchronizer(dict(style="trainer_driven", sync_weight_no_wait=True), PATCH) as sync:
        trainer = await sync.attach_trainer(state)
        early = [await sync.attach_explorer(f"e{i}", rollout_model()) for i in range(2)]
        for step in (1, 2, 3):
            train_to(state, step)
            await trainer.step_done()
        late = await sync.attach_explorer("late", rollout_model())  # bootstrapped to the current version
        assert late.version == 3 and holds(late.slot.model, 3)
        for step in (4, 5):
            train_to(state, step)
            await trainer.step_done()
        await trainer.stop()
    for ex in early + [late]:
        assert ex.version == 5 and holds(ex.slot.model, 5)
    assert sync.explorers[late.name].line.stats.reinits == 1 and sync.explorers[late.name].line.stats.versions_applied[0] == 3
    assert sync.explorers[late.name].line.stats.versions_applied[-1] == 5


async def test_loop_skeletons_with_step_hooks():
    """S1: the trainer checks for syncs while it waits for samples; explorers after each step."""
    state = trainer_state()
    send, receive = anyio.create_memory_object_stream(100)
    versions_trained_on: list[list[int]] = []

    class Trainer(TrainerLoop):
        async def sample(self):
            return [await receive.receive() for _ in range(2)]

        async def train_step(self, batch):
            versions_trained_on.append([s["version"] for s in batch])
            train_to(state, self.trainer.step + 1)
            return {"loss": 0.0}

    class Explorer(ExplorerLoop):
        async def explore_step(self, model, version):
            if self.explorer.trainer_stopped:
                return False
            assert holds(model, version)
            await send.send({"version": version})
            return True

    cfg = dict(style="explorer_driven", sync_interval=2, sync_timeout=HANG_GUARD)
    with anyio.fail_after(HANG_GUARD):
        async with Synchronizer(cfg, PATCH) as sync:
            trainer = await sync.attach_trainer(state)
            ex = await sync.attach_explorer("e0", rollout_model())
            async with anyio.create_task_group() as tg:
                tg.start_soon(Trainer(trainer, total_steps=4, check_interval=0.001).run)
                tg.start_soon(Explorer(ex).run)
    assert trainer.step == 4 and trainer.status is S and ex.status is S
    assert ex.version == 4 and holds(ex.slot.model, 4)
    # explorer-driven: every sync was served while the trainer waited for samples
    assert trainer.syncs >= 1 and ex.timeouts == 0
    assert all(b == sorted(b) for b in versions_trained_on)


def test_usable_from_plain_anyio_code_on_asyncio_and_uvloop():
    async def main() -> int:
        state = trainer_state()
        async with Synchronizer(dict(style="trainer_driven"), PATCH) as sync:
            trainer = await sync.attach_trainer(state)
            ex = await sync.attach_explorer("e0", rollout_model())
            train_to(state, 1)
            await trainer.step_done()
            await trainer.stop()
        return ex.version

    assert anyio.run(main, backend="asyncio") == 1
    assert anyio.run(main, backend="asyncio", backend_options={"use_uvloop": True}) == 1


async def test_metrics_as_dict_and_through_logging(caplog):
    state = trainer_state()
    async with Synchronizer(dict(style="trainer_driven"), PATCH) as sync:
        trainer = await sync.attach_trainer(state)
        ex = await sync.attach_explorer("e0", rollout_model())
        for step in (1, 2):
            train_to(state, step)
            await trainer.step_done()
            await settle()  # the "published" notice reaches the explorer
            await ex.step_done()
        m = sync.metrics()
        e = m["explorers"]["e0"]
        assert e["delivered"] == 3 and e["bytes_sent"] > 0 and e["changed_elements"] > 0
        assert e["build_s"]["count"] == 3 and e["apply_s"]["count"] == 3 and e["transfer_s"]["count"] == 3
        assert m["trainer"]["syncs"] == 2 and m["loop_lag"]["samples"] > 0
        assert {"requests", "coalesced", "max_pending", "staleness"} <= set(e)
        with caplog.at_level("INFO", logger="aiosync.sync"):
            sync.log_metrics()
        assert "explorers/e0/delivered=3" in caplog.text
        assert flatten({"a": {"b": 1}}) == {"a/b": 1}
        await trainer.stop()


async def test_attach_bootstraps_unless_the_explorer_declares_the_trainers_version():
    no_init = {"type": "patch", "patch": {"init_sync": {"enabled": False}}}
    state = trainer_state()
    async with Synchronizer(None, no_init) as sync:
        trainer = await sync.attach_trainer(state)
        stranger = await sync.attach_explorer("stranger", rollout_model())  # unknown weights: bootstrapped
        assert stranger.version == 0 and holds(stranger.slot.model, 0)
        assert sync.explorers["stranger"].line.bootstrap_first
        twin_model = {k: v.to(rollout_model()[k].dtype) for k, v in weights(0).items()}
        twin = await sync.attach_explorer("twin", twin_model, version=0)  # declared: trusted, as the seed does
        assert twin.version == 0 and not sync.explorers["twin"].line.bootstrap_first
        liar_model = {k: v.to(rollout_model()[k].dtype) for k, v in weights(0).items()}
        liar_model["b"][0] = 123.0  # declares version 0 but holds other weights
        liar = await sync.attach_explorer("liar", liar_model, version=0)
        assert liar.version == 0 and holds(liar.slot.model, 0)  # trusted, but verified, and repaired (issue 35)
        row = sync.metrics()["explorers"]["liar"]
        assert (row["verify"]["mismatches"], row["verify"]["repaired"]) == (1, 1) and "Mismatch" in row["last_error"]
        train_to(state, 1)
        await trainer.sync_weight(1)  # the first sync reaches all three
        for ex in (stranger, twin):
            assert ex.version == 1 and holds(ex.slot.model, 1)
        train_to(state, 2)
        await trainer.sync_weight(2)
        for ex in (stranger, twin, liar):
            assert await ex.sync_weight() == 2 and holds(ex.slot.model, 2), ex.name
        await trainer.stop()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
async def test_cuda_models_and_awaitable_cuda_events():
    from aiosync.aio import AwaitableEvent

    state = {k: v.cuda() for k, v in trainer_state().items()}
    async with Synchronizer(dict(style="trainer_driven", sync_weight_no_wait=True), PATCH) as sync:
        trainer = await sync.attach_trainer(state)
        ex = await sync.attach_explorer("e0", {k: v.cuda() for k, v in rollout_model().items()})
        for step in (1, 2, 3):
            train_to(state, step)
            await trainer.step_done()
        await trainer.stop()
        await ex.wait_applied()
        event = torch.cuda.Event()
        event.record()
        await AwaitableEvent(event, timeout=HANG_GUARD)  # S11: awaited without blocking the loop
        assert event.query()
    assert ex.version == 3 and holds({k: v.cpu() for k, v in ex.slot.model.items()}, 3)
