"""The runtime's correctness under the faults a user meets: one test per defect of the
"runtime correctness" issue, each through the public API where the defect shows there.

Every one of these failed on the runtime before the explorer protocol was rebuilt: an explorer
holding weights other than the version it reports, a repair holding rollouts back, a silent
drain, frees and imports stalling the event loop, timeouts that say nothing, a dead explorer
costing every sync its full timeout, a drifted receiver diverging silently.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import weakref
from typing import Any

import anyio
import pytest
import torch

from aiosync.coordination import Synchronizer
from aiosync.errors import DrainError, VersionError
from aiosync.syncers.config import WeightSyncerConfig
from aiosync.syncers.patch.syncer import PatchWeightSyncer
from aiosync.transports.base import Transport
from aiosync.transports.simulated import simulated_pair
from helpers import HANG_GUARD, PATCH, Gate, GatedTransport, holds, rollout_model, settle, train_to, trainer_state

pytestmark = pytest.mark.both_loops


@pytest.fixture(scope="module", autouse=True)
def _compiled_kernels():
    """Compile the numba kernels before short delivery timeouts start counting."""
    from aiosync.syncers.kernels.warmup import warm_up

    warm_up()


def is_bucket(msg: Any) -> bool:
    return isinstance(msg, dict) and any(str(k).startswith("__aiosync__.bucket") for k in msg)


class GatedRecv(Transport):
    """An explorer end whose receives of messages selected by ``holds`` wait at ``gate``."""

    def __init__(self, inner: Transport, gate: Gate, holds) -> None:
        self.inner, self.gate, self.holds = inner, gate, holds

    async def send(self, payload: Any) -> None:
        await self.inner.send(payload)

    async def recv(self) -> Any:
        msg = await self.inner.recv()
        if self.holds(msg) and not self.gate.opened.is_set():
            self.gate.hold()
            await self.gate.opened.wait()
        return msg

    def close(self) -> None:
        self.inner.close()


async def lose_one_ack(sync: Synchronizer, ends: dict, explorer, state, version: int) -> None:
    """Deliver ``version`` with the explorer's Ack lost on the wire: the line fails after
    ``delivery_timeout`` and its next delivery is a repair (a re-bootstrap)."""
    ends[explorer.name][1].inject("drop")
    train_to(state, version)
    await sync.trainer.sync_weight(version)
    line = sync.explorers[explorer.name].line
    with anyio.fail_after(HANG_GUARD):
        while line.stats.failed == 0:
            await line.wait_served(line.served_seq + 1, None)
    assert line.needs_reinit


# ------------------------------------------------------------------ 1. payloads own their bytes

async def test_a_repair_never_delivers_the_trainers_live_tensors():
    """NCCL, patch, no-wait, one process: a repair's bootstrap buckets are read by the explorer
    after the trainer's window closed and the trainer trained on; they must hold the version
    they are stamped with."""
    gate, ends = Gate(), {}

    def factory(name):
        a, b = simulated_pair(seed=1, timeout=HANG_GUARD)
        ends[name] = (a, b)
        return a, GatedRecv(b, gate, is_bucket)

    state = trainer_state()
    cfg = dict(method="nccl", style="trainer_driven", sync_weight_no_wait=True, delivery_timeout=0.5,
               sync_timeout=HANG_GUARD)
    async with Synchronizer(cfg, PATCH, transport_factory=factory) as sync:
        trainer = await sync.attach_trainer(state)
        ex = await sync.attach_explorer("e0", rollout_model())
        train_to(state, 1)
        await trainer.sync_weight(1)
        await lose_one_ack(sync, ends, ex, state, 2)
        gate.close()  # the repair's bootstrap bucket waits at the explorer's door...
        train_to(state, 3)
        await trainer.sync_weight(3)  # ...while the trainer's window closes (no-wait)
        await gate.wait_blocked()
        train_to(state, 4)  # the trainer trains on, in place
        gate.open()
        await ex.wait_applied(HANG_GUARD)
        async with ex.lease() as (model, version):
            assert version == 3 and holds(model, 3)


# ------------------------------------------------------------------ 2. a cancelled NCCL sync

class HeldPatch(PatchWeightSyncer):
    """A patch sender whose build of a chosen version waits for the test's release."""

    hold: int | None = None
    started = None
    release = None
    order: list = []

    async def sync(self, state_dict, send, version):
        if version == HeldPatch.hold:
            HeldPatch.started.set()
            await HeldPatch.release.wait()
            await super().sync(state_dict, send, version)
            HeldPatch.order.append("built")
            return
        await super().sync(state_dict, send, version)


async def test_a_cancelled_nccl_sync_waits_for_the_builds_reading_the_live_tensors():
    HeldPatch.hold, HeldPatch.started, HeldPatch.release, HeldPatch.order = 2, anyio.Event(), anyio.Event(), []
    state = trainer_state()
    cfg = dict(method="nccl", style="trainer_driven", sync_weight_no_wait=True, sync_timeout=HANG_GUARD)
    syncer = lambda: HeldPatch(encoding="flat", compression="zstd", init_sync_enabled=True)  # noqa: E731
    async with Synchronizer(cfg, syncer) as sync:
        trainer = await sync.attach_trainer(state)
        ex = await sync.attach_explorer("e0", rollout_model())
        train_to(state, 1)
        await trainer.sync_weight(1)
        scope = anyio.CancelScope()

        async def train() -> None:
            train_to(state, 2)
            with scope:
                await trainer.sync_weight(2)  # a timeout / cancel scope around the sync
            HeldPatch.order.append("trainer resumed")
            train_to(state, 3)  # and the trainer trains on

        async with anyio.create_task_group() as tg:
            tg.start_soon(train)
            await HeldPatch.started.wait()  # the build of version 2 reads the live tensors
            scope.cancel()
            await settle()
            HeldPatch.release.set()
        await ex.wait_applied(HANG_GUARD)
        assert HeldPatch.order == ["built", "trainer resumed"]
        async with ex.lease() as (model, version):
            assert holds(model, version) and version == 2


# ------------------------------------------------------------------ 3. repairs are staged

async def test_a_repair_does_not_hold_rollouts_back_while_it_downloads():
    gate, ends = Gate(), {}

    def factory(name):
        a, b = simulated_pair(seed=2, timeout=HANG_GUARD)
        ends[name] = (a, b)
        return GatedTransport(a, gate, is_bucket), b

    state = trainer_state()
    cfg = dict(style="trainer_driven", sync_weight_no_wait=True, delivery_timeout=0.5, sync_timeout=HANG_GUARD)
    async with Synchronizer(cfg, PATCH, transport_factory=factory) as sync:
        trainer = await sync.attach_trainer(state)
        ex = await sync.attach_explorer("e0", rollout_model())
        train_to(state, 1)
        await trainer.sync_weight(1)
        await lose_one_ack(sync, ends, ex, state, 2)
        sync.config.delivery_timeout = HANG_GUARD  # only a hang may time out from here
        sync.explorers["e0"].line.delivery_timeout = HANG_GUARD
        gate.close()
        train_to(state, 3)
        await trainer.sync_weight(3)  # a repair: its bootstrap is held on the wire
        await gate.wait_blocked()
        for _ in range(3):
            with ex.lease_nowait() as (model, version):  # rollouts go on, on the old version
                assert version in (1, 2) and holds(model, version)
            await settle()
        gate.open()
        await ex.wait_applied(HANG_GUARD)
        assert ex.version == 3 and holds(ex.slot.model, 3)
        assert sync.explorers["e0"].line.stats.repairs == 1


async def test_a_patch_apply_takes_the_model_only_to_write():
    """Decompressing and validating a patch run outside the exclusive section: a patch held
    in the middle of staging never blocks a lease."""
    gate = Gate()
    cfg = WeightSyncerConfig.from_any(PATCH)

    class GatedStaging(PatchWeightSyncer):
        async def stage_payload(self, model, payload):
            if not gate.opened.is_set():
                gate.hold()
                await gate.opened.wait()
            return await super().stage_payload(model, payload)

    state = trainer_state()
    async with Synchronizer(dict(style="trainer_driven", sync_weight_no_wait=True),
                            lambda: GatedStaging.from_config(cfg.patch)) as sync:
        trainer = await sync.attach_trainer(state)
        ex = await sync.attach_explorer("e0", rollout_model())
        train_to(state, 1)
        await trainer.sync_weight(1)
        await ex.wait_applied(HANG_GUARD)
        gate.close()
        train_to(state, 2)
        await trainer.sync_weight(2)
        await gate.wait_blocked()  # the explorer is staging version 2...
        with ex.lease_nowait() as (model, version):  # ...and rollouts lease version 1 meanwhile
            assert version == 1 and holds(model, 1)
        gate.open()
        await ex.wait_applied(HANG_GUARD)
        assert holds(ex.slot.model, 2)


# ------------------------------------------------------------------ 4. a drain that cannot deliver raises

async def test_leaving_raises_when_the_drain_cannot_deliver():
    ends = {}

    def factory(name):
        ends[name] = simulated_pair(seed=4, timeout=HANG_GUARD)
        return ends[name]

    state = trainer_state()
    with pytest.raises(DrainError) as caught:
        async with Synchronizer(dict(delivery_timeout=0.5, sync_timeout=1.0), PATCH, transport_factory=factory) as sync:
            trainer = await sync.attach_trainer(state)
            await sync.attach_explorer("e0", rollout_model())
            ends["e0"][0].failure_rate = 1.0  # from now on every send to the explorer fails
            train_to(state, 1)
            trainer.step = 1
    err = caught.value
    assert err.explorers == {"e0": 0} and err.target == 1
    assert "e0 (holds 0" in str(err) and "TransportError" in str(err)


async def test_a_detached_explorer_is_not_a_drain_failure():
    state = trainer_state()
    async with Synchronizer(None, PATCH) as sync:
        trainer = await sync.attach_trainer(state)
        await sync.attach_explorer("e0", rollout_model())
        await sync.detach_explorer("e0")
        train_to(state, 1)
        await trainer.sync_weight(1)
    assert "e0" not in sync.explorers


# ------------------------------------------------------------------ 5. big frees off the loop

@pytest.mark.parametrize("method", ["memory", "checkpoint"])
async def test_superseded_weights_are_freed_off_the_event_loop(method, tmp_path):
    loop_thread = threading.current_thread()
    freed_in: list[threading.Thread] = []
    cfg = dict(method=method, checkpoint_dir=str(tmp_path) if method == "checkpoint" else None)
    state = trainer_state()
    async with Synchronizer(cfg, PATCH) as sync:
        trainer = await sync.attach_trainer(state)
        ex = await sync.attach_explorer("e0", rollout_model())
        train_to(state, 1)
        await trainer.sync_weight(1)
        await ex.sync_weight()
        source = sync.source
        held = source._cache if method == "checkpoint" else source.latest
        weakref.finalize(held.state["w"], lambda: freed_in.append(threading.current_thread()))
        del held
        train_to(state, 2)
        await trainer.sync_weight(2)
        await ex.sync_weight()  # CHECKPOINT: loading version 2 replaces the cached version 1
        assert ex.version == 2
    assert len(freed_in) == 1 and freed_in[0] is not loop_thread


# ------------------------------------------------------------------ 6. no slow imports on the loop

def test_the_first_attaches_import_nothing_heavy_on_the_event_loop_thread():
    """numba and torch.distributed load in worker threads, and ``torch.distributed.tensor``
    (DTensor: ~0.7 s to import) not at all while no tensor can be one."""
    code = textwrap.dedent('''
        import sys, threading, anyio, torch
        from aiosync.coordination import Synchronizer
        on_loop, anywhere = [], []
        watching = [False]
        def hook(event, args):
            if event == "import" and watching[0]:
                anywhere.append(args[0])
                if threading.current_thread() is threading.main_thread():
                    on_loop.append(args[0])
        sys.addaudithook(hook)
        async def main():
            watching[0] = True
            async with Synchronizer(None, {"type": "patch"}) as sync:
                await sync.attach_trainer({"w": torch.zeros(10)})
                await sync.attach_explorer("e0", {"w": torch.zeros(10)})
            watching[0] = False
        anyio.run(main)
        heavy = sorted({m for m in on_loop if m.startswith(("torch.distributed", "numba", "llvmlite"))})
        print("HEAVY", heavy)
        print("DTENSOR", sorted({m for m in anywhere if m.startswith("torch.distributed.tensor")}))
        print("NUMBA", "numba" in anywhere)
    ''')
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "HEAVY []" in out.stdout and "DTENSOR []" in out.stdout, out.stdout
    assert "NUMBA True" in out.stdout, out.stdout  # the hook sees imports in worker threads too


# ------------------------------------------------------------------ 7. timeouts that say what to change

async def test_a_delivery_outliving_its_bound_says_why_and_what_to_change():
    state = trainer_state()
    async with Synchronizer(dict(delivery_timeout=0.3, sync_timeout=HANG_GUARD), PATCH) as sync:
        trainer = await sync.attach_trainer(state)
        ex = await sync.attach_explorer("e0", rollout_model())
        train_to(state, 1)
        trainer.step = 1
        async with ex.lease():  # a rollout holds the model longer than delivery_timeout
            await trainer.sync_weight(1, wait=False)
            await ex.sync_weight(wait=True)
        error = sync.metrics()["explorers"]["e0"]["last_error"]
        assert "delivery_timeout" in error and "lease" in error
        assert await ex.sync_weight() == 1  # repaired once the lease is gone


async def test_reusing_a_checkpoint_directory_of_an_earlier_run_says_how_to_proceed(tmp_path):
    cfg = dict(method="checkpoint", checkpoint_dir=str(tmp_path))
    async with Synchronizer(cfg, PATCH) as sync:
        trainer = await sync.attach_trainer(trainer_state(), version=5)
        await trainer.stop()
    with pytest.raises(VersionError) as caught:
        async with Synchronizer(cfg, PATCH) as sync:
            await sync.attach_trainer(trainer_state())
    text = str(caught.value)
    assert "earlier run" in text and "version= above 5" in text and str(tmp_path) in text


# ------------------------------------------------------------------ 8. a dead explorer is declared lost

async def test_an_explorer_whose_loop_died_is_declared_lost_and_not_waited_for():
    state = trainer_state()
    cfg = dict(method="nccl", style="fixed", sync_timeout=HANG_GUARD * 10, liveness_timeout=0.4)
    async with Synchronizer(cfg, PATCH) as sync:
        trainer = await sync.attach_trainer(state)
        await sync.attach_explorer("e0", rollout_model())  # its loop never runs (it "died")
        alive = await sync.attach_explorer("e1", rollout_model())

        async def explorer_loop() -> None:
            while trainer.status.name != "STOPPED":
                await alive.step_done()
                async with alive.lease():
                    await anyio.sleep(0.01)

        async with anyio.create_task_group() as tg:
            tg.start_soon(explorer_loop)
            with anyio.fail_after(HANG_GUARD):  # far below sync_timeout: the dead one is not waited for
                for step in (1, 2, 3):
                    train_to(state, step)
                    trainer.step = step
                    await trainer.sync_weight()
                await trainer.stop()
        session = sync.explorers["e0"]
        assert session.lost and "liveness_timeout" in str(session.error)
        assert alive.version == 3 and holds(alive.slot.model, 3)
    assert not sync.explorers["e1"].lost


# ------------------------------------------------------------------ 9. a drifted receiver is refused and repaired

async def test_a_receiver_that_drifted_is_refused_then_rebootstrapped():
    state = trainer_state()
    async with Synchronizer(None, PATCH) as sync:
        trainer = await sync.attach_trainer(state)
        ex = await sync.attach_explorer("e0", rollout_model())
        with torch.no_grad():  # written behind aiosync's back, where the next patch changes values
            ex.slot.model["w"].view(torch.int16).add_(1)
        train_to(state, 1)
        await trainer.sync_weight(1)
        assert ex.version == 0  # refused: nothing written
        m = sync.metrics()["explorers"]["e0"]
        assert m["failed"] == 1 and "DriftError" in m["last_error"]
        train_to(state, 2)
        await trainer.sync_weight(2)
        assert await ex.sync_weight() == 2 and holds(ex.slot.model, 2)  # the next delivery re-bootstraps
        assert sync.metrics()["explorers"]["e0"]["repairs"] == 1


# ------------------------------------------------------------------ the faults soak, NCCL

def test_faults_scenario_with_nccl_ends_bit_exact_with_no_torn_read():
    from aiosync.cli.simulate import simulate

    for seed in (2, 5):
        report = simulate("faults", 2, steps=150, seed=seed, method="nccl")
        assert report["torn_reads"] == 0 and report["final_bit_exact"], (seed, report["final_state"])
