"""Timing semantics (S3): how far an explorer can run ahead of the trainer, and retries.

The trainer here is deliberately slower than the explorer. Nothing asserts on elapsed time:
the bounds are counts of explore steps per version, which the waits guarantee whatever the
speed of the machine.
"""

from __future__ import annotations

import anyio
import pytest

from aiosync.coordination import Packet, RunningStatus, Synchronizer
from aiosync.errors import WouldBlock
from helpers import HANG_GUARD, PATCH, Gate, gated, holds, rollout_model, settle, train_to, trainer_state

pytestmark = pytest.mark.both_loops


def packets(msg) -> bool:
    return isinstance(msg, Packet)


def longest_run(versions: list[int]) -> int:
    """The most consecutive explore steps spent on one version."""
    best = run = 0
    for i, v in enumerate(versions):
        run = run + 1 if i and versions[i - 1] == v else 1
        best = max(best, run)
    return best


@pytest.mark.parametrize("method", ["memory", "checkpoint", "nccl"])
async def test_a_fast_fixed_explorer_never_runs_more_than_offset_plus_interval_steps_on_one_version(
        method, tmp_path):
    interval, offset, steps = 2, 1, 8
    cfg = dict(method=method, style="fixed", sync_interval=interval, sync_offset=offset, sync_timeout=HANG_GUARD,
               delivery_timeout=HANG_GUARD)
    if method == "checkpoint":
        cfg["checkpoint_dir"] = str(tmp_path)
    state = trainer_state()
    held: list[int] = []  # the version of every explore step while the trainer is alive
    with anyio.fail_after(HANG_GUARD * 2):
        async with Synchronizer(cfg, PATCH) as sync:
            trainer = await sync.attach_trainer(state)
            ex = await sync.attach_explorer("e0", rollout_model())

            async def trainer_loop():
                for step in range(1, steps + 1):
                    await anyio.sleep(0.01)  # a train step: slower than an explore step
                    train_to(state, step)
                    await trainer.step_done()
                await trainer.stop()

            async def explorer_loop():
                while trainer.status is not RunningStatus.STOPPED:
                    async with ex.lease() as (model, version):
                        assert holds(model, version)
                    if trainer.status is not RunningStatus.STOPPED:
                        held.append(version)
                    await ex.step_done()  # waits at a sync point for a version newer than it holds
                await ex.stop()

            async with anyio.create_task_group() as tg:
                tg.start_soon(trainer_loop)
                tg.start_soon(explorer_loop)
    assert ex.version == steps and holds(ex.slot.model, steps)
    assert held_versions(held) == sorted(set(held)) and len(set(held)) >= 3  # only ever newer versions
    assert longest_run(held) <= offset + interval + 1, held


def held_versions(held: list[int]) -> list[int]:
    """The versions in the order they were first held (they must only increase)."""
    seen: list[int] = []
    for v in held:
        if not seen or seen[-1] != v:
            seen.append(v)
    return seen


async def test_with_no_wait_a_fixed_sync_point_waits_for_a_newer_version_to_be_published():
    """``sync_weight_no_wait``: the sync point does not wait for the apply, but it does wait for
    the trainer to publish a version newer than the one held (the run-ahead bound)."""
    interval, steps = 2, 6
    cfg = dict(style="fixed", sync_interval=interval, sync_weight_no_wait=True, sync_timeout=HANG_GUARD,
               delivery_timeout=HANG_GUARD)
    state = trainer_state()
    waited: list[tuple[int, int | None]] = []  # (version held before a sync point, newest published after it)
    with anyio.fail_after(HANG_GUARD * 2):
        async with Synchronizer(cfg, PATCH) as sync:
            trainer = await sync.attach_trainer(state)
            ex = await sync.attach_explorer("e0", rollout_model())

            async def trainer_loop():
                for step in range(1, steps + 1):
                    await anyio.sleep(0.01)
                    train_to(state, step)
                    await trainer.step_done()
                await trainer.stop()

            async def explorer_loop():
                while not ex.trainer_stopped:
                    async with ex.lease():
                        await anyio.sleep(0.001)  # a rollout: faster than a train step
                    before = ex.version
                    sync_point = (ex.step + 1) % interval == 0  # FIXED, offset 0
                    await ex.step_done()
                    if sync_point and not ex.trainer_stopped:
                        waited.append((before, ex.published))
                await ex.stop()

            async with anyio.create_task_group() as tg:
                tg.start_soon(trainer_loop)
                tg.start_soon(explorer_loop)
    assert ex.version == steps
    assert waited and all(published is not None and published > before for before, published in waited), waited


# ------------------------------------------------------------------ admission control (max_ahead)

def no_wait_config(**kw) -> dict:
    return {"style": "trainer_driven", "sync_weight_no_wait": True, "delivery_timeout": HANG_GUARD, **kw}


async def test_the_trainer_holds_a_publish_back_until_every_explorer_is_within_max_ahead():
    gate = Gate()
    state = trainer_state()
    cfg = no_wait_config(max_ahead=1, sync_timeout=HANG_GUARD)
    with anyio.fail_after(HANG_GUARD):
        async with Synchronizer(cfg, PATCH, transport_factory=gated(gate, packets)) as sync:
            trainer = await sync.attach_trainer(state)
            ex = await sync.attach_explorer("e0", rollout_model())
            train_to(state, 1)
            await trainer.sync_weight(1)  # the first sync always waits for the explorers
            gate.close()
            train_to(state, 2)
            await trainer.sync_weight(2)  # the explorer holds 1: within max_ahead of 2
            await gate.wait_blocked()  # version 2 waits at the gate
            train_to(state, 3)
            published = anyio.Event()

            async def publish_3():
                await trainer.sync_weight(3)
                published.set()

            async with anyio.create_task_group() as tg:
                tg.start_soon(publish_3)
                await settle()
                assert not published.is_set() and trainer.version == 2  # held back: 3 - 1 > max_ahead
                gate.open()
                await published.wait()
            assert sync.explorers["e0"].line.applied_version >= 2
            stats = trainer.statistics()
            assert stats.hold_back_s.count == 1 and stats.hold_back_timeouts == 0
            await trainer.stop()
    assert ex.version == 3 and holds(ex.slot.model, 3)


async def test_an_explorer_too_far_behind_gets_newer_weights_before_it_starts_a_rollout():
    """The explorer's side of admission: when the trainer went ahead anyway (its hold-back
    timed out: a long rollout kept the explorer from applying), a new rollout waits for newer
    weights instead of starting on old ones."""
    state = trainer_state()
    cfg = no_wait_config(max_ahead=1, sync_timeout=0.05)
    with anyio.fail_after(HANG_GUARD):
        async with Synchronizer(cfg, PATCH) as sync:
            trainer = await sync.attach_trainer(state)
            ex = await sync.attach_explorer("e0", rollout_model())
            train_to(state, 1)
            await trainer.sync_weight(1)  # the first sync always waits for the explorers
            holding, release = anyio.Event(), anyio.Event()
            started: list[int] = []

            async def long_rollout():  # holds version 1: no apply can land meanwhile
                async with ex.lease():
                    holding.set()
                    await release.wait()

            async def rollout():
                async with ex.lease() as (model, version):
                    assert holds(model, version)
                    started.append(version)

            async with anyio.create_task_group() as tg:
                tg.start_soon(long_rollout)
                await holding.wait()
                for v in (2, 3, 4):  # the trainer's hold-back times out: the explorer cannot catch up
                    train_to(state, v)
                    await trainer.sync_weight(v)
                while ex.published != 4:  # the trainer's notices arrive
                    await ex._changed.wait()
                assert not ex.admitted() and ex.version == 1 and trainer.statistics().hold_back_timeouts >= 1
                with pytest.raises(WouldBlock, match="max_ahead=1"):
                    with ex.lease_nowait():
                        pass
                tg.start_soon(rollout)
                await settle()
                assert started == []  # waits for newer weights instead of rolling out on version 1
                release.set()
            assert started and started[0] >= 3  # within max_ahead of the newest (4)
            assert ex.statistics().admission_wait_s.count == 1 and ex.statistics().admission_timeouts == 0
            await trainer.stop()
    assert ex.version == 4


# ------------------------------------------------------------------ in-flight updates (segments)

async def test_an_apply_lands_at_the_next_segment_boundary_not_at_the_end_of_the_rollout():
    state = trainer_state()
    cfg = no_wait_config(sync_timeout=HANG_GUARD)
    with anyio.fail_after(HANG_GUARD):
        async with Synchronizer(cfg, PATCH) as sync:
            trainer = await sync.attach_trainer(state)
            ex = await sync.attach_explorer("e0", rollout_model())
            train_to(state, 1)
            await trainer.sync_weight(1)  # the first sync always waits for the explorers
            in_segment, end_segment = anyio.Event(), anyio.Event()
            versions: list[int] = []

            async def rollout():
                async with ex.rollout() as r:
                    async with r.segment() as (model, version):  # segment 0: held while v1 arrives
                        assert holds(model, version)
                        in_segment.set()
                        await end_segment.wait()
                    async with r.segment() as (model, version):  # segment 1: on the new weights
                        assert holds(model, version)
                    versions.extend(r.versions)

            async with anyio.create_task_group() as tg:
                tg.start_soon(rollout)
                await in_segment.wait()
                train_to(state, 2)
                await trainer.sync_weight(2)  # no-wait: returns once handed off
                while not ex.slot.statistics().writers_waiting:  # the apply waits for segment 0 only
                    await anyio.sleep(0)
                assert ex.version == 1
                end_segment.set()
            assert versions == [1, 2]
            assert ex.slot.statistics().max_leases_waited_for == 1
            await trainer.stop()


async def test_a_long_rollout_in_segments_takes_every_update_without_a_rebootstrap():
    """One 2-second rollout in 20 segments while the trainer publishes every 0.1 s, with a
    delivery_timeout (1 s) shorter than the rollout: with one plain lease every apply would
    wait out the whole rollout and time out into a re-bootstrap."""
    state = trainer_state()
    cfg = no_wait_config(sync_timeout=HANG_GUARD, delivery_timeout=1.0)
    with anyio.fail_after(HANG_GUARD):
        async with Synchronizer(cfg, PATCH) as sync:
            trainer = await sync.attach_trainer(state)
            ex = await sync.attach_explorer("e0", rollout_model())
            done = anyio.Event()

            async def rollout():
                async with ex.rollout() as r:
                    for _ in range(20):
                        async with r.segment() as (model, version):
                            assert holds(model, version)
                            await anyio.sleep(0.1)  # one env step / token batch
                done.set()
                return r

            async def trainer_loop():
                step = 0
                while not done.is_set():
                    await anyio.sleep(0.1)
                    step += 1
                    train_to(state, step)
                    await trainer.sync_weight(step)
                await trainer.stop()

            box = []
            async with anyio.create_task_group() as tg:
                tg.start_soon(trainer_loop)
                tg.start_soon(lambda: _keep(box, rollout()))
            r = box[0]
    line = sync.explorers["e0"].line.stats
    assert r.segments == 20 and r.versions == sorted(r.versions)
    assert len(set(r.versions)) >= 5  # updates landed between segments, during the rollout
    assert r.first_version < r.last_version
    assert line.reinits == 1 and line.failed == 0 and line.repairs == 0  # only the join bootstrapped
    assert ex.slot.statistics().max_leases_waited_for <= 1  # an apply waited for one segment at most


async def _keep(box: list, coro) -> None:
    box.append(await coro)
