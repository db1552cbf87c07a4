"""``max_ahead`` means what docs/concepts.md says, for every method, style and no-wait setting
(issue 32): no rollout starts on weights more than ``max_ahead`` versions behind the trainer,
and an explorer that keeps up never costs the trainer a wait (no hold-back runs into its
``sync_timeout``). Versions are counted as published: with ``sync_interval: 2`` versions 2 and 4
are one version apart.

The explorers here are faster than the trainer. Nothing asserts on elapsed time: the bound is a
count of versions, and a hold-back that waits for a version that cannot come shows up as a
counted timeout.
"""

from __future__ import annotations

import anyio
import pytest

from aiosync.coordination import Synchronizer
from aiosync.transports.simulated import simulated_pair
from helpers import HANG_GUARD, PATCH, holds, rollout_model, train_to, trainer_state

STEPS = 6


@pytest.mark.parametrize("no_wait", [False, True], ids=["wait", "no_wait"])
@pytest.mark.parametrize("max_ahead", [0, 1])
@pytest.mark.parametrize("interval", [1, 2])
@pytest.mark.parametrize("style", ["fixed", "explorer_driven", "trainer_driven"])
@pytest.mark.parametrize("method", ["memory", "checkpoint", "nccl"])
async def test_max_ahead_bounds_every_rollout_and_an_explorer_that_keeps_up_costs_no_wait(
        method, style, interval, max_ahead, no_wait, tmp_path):
    cfg = dict(method=method, style=style, sync_interval=interval, max_ahead=max_ahead, sync_weight_no_wait=no_wait,
               sync_timeout=5.0, delivery_timeout=HANG_GUARD)
    if method == "checkpoint":
        cfg["checkpoint_dir"] = str(tmp_path)
    state = trainer_state()
    seen: list[tuple[str, int, int, int]] = []  # (explorer, version, behind the trainer, behind as it knew)
    with anyio.fail_after(HANG_GUARD * 2):
        # A link slower than a train step: without the bound the trainer would run ahead.
        link = lambda name: simulated_pair(latency=0.005, seed=len(name), timeout=HANG_GUARD)  # noqa: E731
        async with Synchronizer(cfg, PATCH, transport_factory=link) as sync:
            trainer = await sync.attach_trainer(state)
            explorers = [await sync.attach_explorer(f"e{i}", rollout_model()) for i in range(2)]
            done = anyio.Event()

            async def explorer_loop(ex) -> None:
                while not done.is_set():
                    async with ex.lease() as (model, version):
                        assert holds(model, version)
                        seen.append((ex.name, version, sync.source.behind(version), ex.behind))
                    await ex.step_done()
                    await anyio.sleep(0.001)  # an explore step, shorter than a train step
                await ex.stop()

            async def trainer_loop() -> None:
                for step in range(1, STEPS * interval + 1):
                    train_to(state, step)
                    await anyio.sleep(0.004)
                    await trainer.step_done()
                done.set()
                await trainer.stop()

            async with anyio.create_task_group() as tg:
                for ex in explorers:
                    tg.start_soon(explorer_loop, ex)
                tg.start_soon(trainer_loop)
    stats = trainer.statistics()
    assert stats.hold_back_timeouts == 0, stats
    assert all(ex.statistics().admission_timeouts == 0 for ex in explorers)
    # Against the trainer: a version the explorer was not told of yet counts too (with max_ahead 0
    # the newest one may be out for the moment its notice travels); as the explorer knew: exact.
    assert all(behind <= max(max_ahead, 1) for _, _, behind, _ in seen), seen
    assert all(known <= max_ahead for _, _, _, known in seen), seen
    assert len({v for _, v, _, _ in seen}) >= 2, seen
    final = trainer.version
    assert all(ex.version == final and holds(ex.slot.model, final) for ex in explorers)
