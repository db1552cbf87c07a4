"""Issue 35: the paths that left an explorer on weights other than the version it reports, with
no error — each closed at its root, one test per path — and the cases that raised a raw error
instead of aiosync's own.

Every test here failed before the fix it names: a joiner stamped with a version it did not
hold, a tied explorer accepted for an untied trainer, a patch applied over a tensor that
changed shape or dtype, a false drift on keys sharing a buffer, raw ``KeyError`` /
``RuntimeError`` s.
"""

from __future__ import annotations

import logging
import tempfile

import anyio
import pytest
import torch

from aiosync.coordination import Synchronizer
from aiosync.errors import AiosyncError, HandshakeError
from helpers import BUCKET, HANG_GUARD, PATCH, PATCH_COO, holds, rollout_model, train_to, trainer_state

PATCH_CTX = {"type": "patch", "patch": {"encoding": "ctx", "compression": "none", "init_sync": {"enabled": True}}}


@pytest.fixture(scope="module", autouse=True)
def _compiled_kernels():
    from aiosync.syncers.kernels.warmup import warm_up

    warm_up()


def last_error(sync: Synchronizer, name: str) -> str | None:
    return sync.metrics()["explorers"][name]["last_error"]


# ------------------------------------------------------------------ 1. an NCCL late joiner between syncs

@pytest.mark.parametrize("syncer", [PATCH, PATCH_COO], ids=["flat", "coo"])
async def test_an_nccl_joiner_between_syncs_holds_the_version_it_reports(syncer):
    """FIXED, ``sync_interval`` 3: steps 1 and 2 are trained but not published when a second
    explorer attaches from the trainer's task. It is bootstrapped from the live tensors, so it
    must be stamped with their version (2), and the drain must leave both explorers at it."""
    state = trainer_state()
    cfg = dict(method="nccl", style="fixed", sync_interval=3, sync_timeout=2.0, delivery_timeout=HANG_GUARD)
    async with Synchronizer(cfg, syncer) as sync:
        trainer = await sync.attach_trainer(state)
        first = await sync.attach_explorer("e0", rollout_model())
        for step in (1, 2):
            train_to(state, step)
            assert not await trainer.step_done()  # not a sync point
        joiner = await sync.attach_explorer("e1", rollout_model())
        async with joiner.lease() as (model, version):
            assert holds(model, version), f"the joiner reports version {version} but holds other weights"
        assert version == 2
    for ex in (first, joiner):
        assert ex.version == 2 and holds(ex.slot.model, 2)


# ------------------------------------------------------------------ 3. structure re-checked at every sync

@pytest.mark.parametrize("syncer", [PATCH, PATCH_COO, BUCKET], ids=["flat", "coo", "bucket"])
@pytest.mark.parametrize("change", ["shape", "dtype"])
async def test_a_tensor_replaced_by_another_structure_is_refused_not_reinterpreted(syncer, change):
    """The trainer replaces ``w`` (4, 6) by a (6, 4) tensor, or its int64 buffer by a float32
    one: the patch used to be applied anyway (the (6, 4) data written as (4, 6), 2.75 as 2).
    Every sync checks the handshake's plan now: refused, named, the explorer keeps version 0."""
    state = {"w": torch.randn(4, 6), "n": torch.tensor([2, 3], dtype=torch.int64)}
    model = {k: torch.zeros_like(v) for k, v in state.items()}
    async with Synchronizer(None, syncer) as sync:
        trainer = await sync.attach_trainer(state)
        ex = await sync.attach_explorer("e0", model)
        before = {k: v.clone() for k, v in model.items()}
        if change == "shape":
            state["w"] = torch.randn(6, 4)
        else:
            state["n"] = torch.tensor([2.75, 3.0])
        await trainer.sync_weight(1)
        assert ex.version == 0 and all(torch.equal(model[k], before[k]) for k in model)
        error = last_error(sync, "e0")
        assert "HandshakeError" in error and ("'w'" if change == "shape" else "'n'") in error
        with pytest.raises(Exception):  # the drain cannot deliver what the explorer cannot hold: loud
            await sync.drain()
        await sync.detach_explorer("e0")  # leave without a second DrainError
