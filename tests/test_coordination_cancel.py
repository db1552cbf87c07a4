"""Safe to cancel at every await (issue 34, SPEC T4): a cancelled call leaves nothing behind and
the same call works at once afterwards; context managers leave their task groups on any exit;
closing or detaching never waits for a worker thread on the event loop; nested and foreign
leases are told apart at once.

Cancellations are made deterministic with spent budgets (``CancelScope`` cancelled before the
call) and gates; nothing asserts on elapsed time (HANG_GUARD only turns a hang into a failure).
"""

from __future__ import annotations

import functools
import threading

import anyio
import pytest

from aiosync.coordination import Packet, PolicySlot, RunningStatus, Synchronizer
from aiosync.errors import PeerTimeoutError
from aiosync.syncers import PatchWeightSyncer
from helpers import HANG_GUARD, PATCH, Gate, gated, holds, rollout_model, settle, train_to, trainer_state

pytestmark = pytest.mark.both_loops


def packets(msg) -> bool:
    return isinstance(msg, Packet)


async def spent(fn, *args, **kwargs):
    """Call ``fn`` under a budget that is already spent: it is cancelled at its first await."""
    with anyio.CancelScope() as scope:
        scope.cancel()
        await fn(*args, **kwargs)
    return scope.cancelled_caught


# ------------------------------------------------------------------ 1. requests

@pytest.mark.parametrize("style", ["trainer_driven", "explorer_driven", "fixed"])
async def test_a_cancelled_sync_weight_or_step_done_leaves_no_request_behind(style):
    """Item 1: cancelled at its first await, a request was never sent: it must not stay
    registered (before: need_sync() stayed false and REQUIRE_SYNC stuck until it expired)."""
    state = trainer_state()
    cfg = dict(style=style, sync_interval=1, sync_timeout=HANG_GUARD, delivery_timeout=HANG_GUARD)
    with anyio.fail_after(HANG_GUARD):
        async with Synchronizer(cfg, PATCH) as sync:
            trainer = await sync.attach_trainer(state)
            ex = await sync.attach_explorer("e0", rollout_model())
            for v in (1, 2):  # the first sync reaches every explorer; the second waits to be asked for
                train_to(state, v)
                await trainer.sync_weight(v)
            while ex.published != 2:
                await ex._changed.wait()
            await ex.wait_applied()
            assert ex.version == 1
            assert await spent(ex.sync_weight)
            assert ex.status is RunningStatus.RUNNING and not ex.busy
            step = ex.step
            assert await spent(ex.step_done)
            assert ex.step == step  # not counted: the check point is still to come
            if style == "trainer_driven":
                assert ex.need_sync()
            assert await ex.sync_weight() == 2 and holds(ex.slot.model, 2)  # at once
            await trainer.stop()


async def test_a_cancelled_trainer_step_done_does_not_skip_its_scheduled_sync():
    """Cancelled while its publish is held back (max_ahead), the step is not counted: called
    again, it is the same check point and publishes."""
    gate = Gate()
    state = trainer_state()
    cfg = dict(style="fixed", sync_interval=2, sync_timeout=HANG_GUARD, delivery_timeout=HANG_GUARD, max_ahead=1)
    with anyio.fail_after(HANG_GUARD):
        async with Synchronizer(cfg, PATCH, transport_factory=gated(gate, packets)) as sync:
            trainer = await sync.attach_trainer(state)
            ex = await sync.attach_explorer("e0", rollout_model())
            for v in range(1, 6):
                if v == 3:
                    gate.close()  # the explorer keeps version 2 (the first sync reached it)
                train_to(state, v)
                await trainer.step_done()  # publishes 2 and 4
            train_to(state, 6)
            with anyio.CancelScope() as scope:
                async with anyio.create_task_group() as tg:
                    tg.start_soon(trainer.step_done)  # held back: the explorer must hold 4 first
                    await gate.wait_blocked()
                    scope.cancel()
            assert (trainer.step, trainer.version, ex.version) == (5, 4, 2)
            gate.open()
            assert await trainer.step_done() is True and (trainer.step, trainer.version) == (6, 6)
            assert await ex.sync_weight() == 6
            await trainer.stop()


# ------------------------------------------------------------------ 2. entering

@pytest.mark.parametrize("budget", [0.0, 0.0005, 0.002])
async def test_cancelling_the_synchronizers_entry_leaves_the_callers_scopes_intact(budget):
    """Item 2: a cancelled ``async with Synchronizer`` (or Explorer) leaves its task group: the
    caller's own cancel scopes keep working (before: RuntimeError 'Attempted to exit a cancel
    scope that isn't the current task's current cancel scope')."""
    for _ in range(5):
        with anyio.move_on_after(budget):
            async with Synchronizer(None, PATCH) as sync:
                await sync.attach_trainer(trainer_state())
                await anyio.sleep(budget)
        with anyio.move_on_after(HANG_GUARD) as mine:
            await anyio.sleep(0)
        assert not mine.cancelled_caught
    async with Synchronizer(None, PATCH) as sync:  # and a synchronizer still works afterwards
        await sync.attach_trainer(trainer_state())
        ex = await sync.attach_explorer("e0", rollout_model())
        assert ex.version == 0


# ------------------------------------------------------------------ 3. attaching

async def test_a_cancelled_attach_leaves_no_half_joined_session_and_can_be_retried_at_once():
    """Item 3: cancelling attach_explorer while its first sync is held: the name is free at
    once, no session is left RUNNING without an explorer, and the exit is prompt."""
    gate = Gate()
    state = trainer_state()
    cfg = dict(style="trainer_driven", sync_timeout=HANG_GUARD, delivery_timeout=HANG_GUARD)
    with anyio.fail_after(HANG_GUARD):
        async with Synchronizer(cfg, PATCH, transport_factory=gated(gate, packets)) as sync:
            trainer = await sync.attach_trainer(state)
            gate.close()
            async with anyio.create_task_group() as tg:
                async def attach():
                    with anyio.CancelScope() as scope:
                        cancel[0] = scope
                        await sync.attach_explorer("e0", rollout_model())

                cancel = [None]
                tg.start_soon(attach)
                await gate.wait_blocked()  # the first sync waits at the gate
                cancel[0].cancel()
            assert "e0" not in sync.explorers and not sync.hub.joining
            gate.open()
            ex = await sync.attach_explorer("e0", rollout_model())  # the same name, at once
            assert ex.version == 0 and list(sync.explorers) == ["e0"]
            train_to(state, 1)
            await trainer.sync_weight(1)
            assert await ex.sync_weight() == 1
            await trainer.stop()
    assert [s.status for s in sync.explorers.values()] == [RunningStatus.STOPPED]


# ------------------------------------------------------------------ 4. closing while a build runs

class _Recorded(PatchWeightSyncer):
    """A patch sender whose builds wait for ``release`` and whose ``close`` is recorded."""

    building = None
    release = None
    closes: list = []

    async def sync(self, state_dict, send, version):
        if _Recorded.release is not None and version >= 1:
            _Recorded.building.set()
            await _Recorded.release.wait()
        self._in_build = True
        try:
            await super().sync(state_dict, send, version)
        finally:
            self._in_build = False

    def close(self):
        _Recorded.closes.append((threading.get_ident(), getattr(self, "_in_build", False)))
        super().close()


async def test_detaching_while_a_patch_is_built_closes_its_sender_off_the_loop_after_the_build():
    """Item 4: the sender is closed in a worker thread once its build ended (before: on the
    event loop, waiting for the build's thread; then the build failed with AttributeError)."""
    _Recorded.building, _Recorded.release, _Recorded.closes = anyio.Event(), anyio.Event(), []
    loop_thread = threading.get_ident()
    state = trainer_state()

    def make():
        return _Recorded(encoding="flat", compression="zstd")

    with anyio.fail_after(HANG_GUARD):
        async with Synchronizer(dict(style="trainer_driven", sync_weight_no_wait=True), make) as sync:
            trainer = await sync.attach_trainer(state)
            await sync.attach_explorer("e0", rollout_model())
            train_to(state, 1)
            async with anyio.create_task_group() as tg:
                tg.start_soon(trainer.sync_weight, 1)  # pushed: the build starts
                await _Recorded.building.wait()
                session = sync.explorers["e0"]
                await sync.detach_explorer("e0")  # returns while the build waits
                assert not any(in_build for _, in_build in _Recorded.closes)
                _Recorded.release.set()
            await trainer.stop()
    assert _Recorded.closes and all(t != loop_thread and not in_build for t, in_build in _Recorded.closes)
    assert session.line.stats.failed == 0 and session.error is None  # no internal error surfaced


# ------------------------------------------------------------------ 5. leases

async def test_a_nested_lease_of_the_same_task_is_granted_while_an_apply_waits():
    """Item 5: a lease inside a lease of the same task, while an apply waits for the outer one
    (before: deadlock until the lease timeout, then "an apply held the model")."""
    slot = PolicySlot({"w": trainer_state()["w"].clone()}, version=0, timeout=HANG_GUARD)

    async def write(model):
        return 1

    async def rollout(tg) -> None:
        async with slot.lease() as (_, outer):
            tg.start_soon(slot.apply, write)
            while not slot.statistics().writers_waiting:  # its backup copy runs in a worker thread
                await anyio.sleep(0.001)
            async with slot.lease() as (_, inner):  # granted at once: the same version
                assert inner == outer == 0
            with slot.lease_nowait() as (_, inner):
                assert inner == 0
            with pytest.raises(RuntimeError, match="holds a lease"):
                await slot.apply(write)  # would wait for its own caller

    with anyio.fail_after(HANG_GUARD):
        async with anyio.create_task_group() as tg:
            tg.start_soon(rollout, tg)
    assert slot.version == 1


async def test_a_lease_from_another_thread_is_refused_at_once_and_a_timeout_says_what_it_waited_for():
    slot = PolicySlot({"w": trainer_state()["w"].clone()}, version=0, timeout=0.2)
    async with slot.lease():
        pass  # the slot belongs to this loop now

    def elsewhere():
        async def lease():
            async with slot.lease():
                pass

        anyio.run(lease)

    with pytest.raises(RuntimeError, match="belongs to the event loop of thread"):
        await anyio.to_thread.run_sync(elsewhere)
    holding, release = anyio.Event(), anyio.Event()

    async def hold():
        async with slot.lease():
            holding.set()
            await release.wait()

    async def write(model):
        return 1

    async with anyio.create_task_group() as tg:
        tg.start_soon(hold)
        await holding.wait()
        tg.start_soon(functools.partial(slot.apply, write, timeout=HANG_GUARD))
        while not slot.statistics().writers_waiting:
            await anyio.sleep(0.001)
        with pytest.raises(PeerTimeoutError, match="an apply waited for 1 lease"):
            async with slot.lease():
                pass
        release.set()
    assert slot.version == 1
