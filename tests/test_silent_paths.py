"""Issue 35: the paths that left an explorer on weights other than the version it reports, with
no error — each closed at its root, one test per path — and the cases that raised a raw error
instead of aiosync's own.

Every test here failed before the fix it names: a joiner stamped with a version it did not
hold, a tied explorer accepted for an untied trainer, a patch applied over a tensor that
changed shape or dtype, a false drift on keys sharing a buffer, raw ``KeyError`` /
``RuntimeError`` s.
"""

from __future__ import annotations

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


async def publish(trainer, explorer, version: int, method: str) -> None:
    """Publish ``version``; with NCCL the explorer comes to the trainer's window meanwhile (its
    check point), as its loop would."""
    async with anyio.create_task_group() as tg:
        if method == "nccl":
            tg.start_soon(explorer.sync_weight)
        await trainer.sync_weight(version)


# ------------------------------------------------------------------ 1. an NCCL late joiner between syncs

@pytest.mark.parametrize("style, interval", [("fixed", 3), ("explorer_driven", 1)])
@pytest.mark.parametrize("syncer", [PATCH, PATCH_COO], ids=["flat", "coo"])
async def test_an_nccl_joiner_between_syncs_holds_the_version_it_reports(syncer, style, interval):
    """Steps 1 and 2 are trained but not published when a second explorer attaches from the
    trainer's task. It is bootstrapped from the live tensors, so it must be stamped with their
    version (2), and the drain must leave both explorers at it."""
    state = trainer_state()
    cfg = dict(method="nccl", style=style, sync_interval=interval, sync_timeout=2.0, delivery_timeout=HANG_GUARD)
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


# ------------------------------------------------------------------ 2. tying the trainer does not share

class Tied(torch.nn.Module):
    """An embedding and a head tied to it (``tie``), and optionally a persistent buffer viewing
    the embedding's first rows (``prefix``): keys that share all or part of one tensor."""

    def __init__(self, tie: bool = True, prefix: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(16, 8)
        self.head = torch.nn.Linear(8, 16, bias=False)
        if tie:
            self.head.weight = self.embed.weight
        if prefix:
            self.register_buffer("prefix", self.embed.weight.data[:2])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(x))


def adamw_steps(model: torch.nn.Module, n: int, start: int = 0):
    """``n`` AdamW steps on a fixed batch; yields after each one with its step number."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = torch.arange(16) % 16
    for step in range(start + 1, start + n + 1):
        opt.zero_grad()
        model(x).logsumexp(-1).mean().backward()
        opt.step()
        yield step


def untied() -> Tied:
    model = Tied(tie=True)
    model.head.weight = torch.nn.Parameter(model.embed.weight.detach().clone())  # the trainer unties them
    return model


def same_state(a: torch.nn.Module, b: torch.nn.Module) -> list[str]:
    sa, sb = a.state_dict(), b.state_dict()
    return [k for k in sa if not torch.equal(sa[k], sb[k])]


@pytest.mark.parametrize("syncer", [PATCH, PATCH_COO, BUCKET], ids=["flat", "coo", "bucket"])
async def test_an_explorer_tied_where_the_trainer_is_not_is_refused_naming_the_keys(syncer):
    """The explorer ties ``head.weight`` to ``embed.weight``; the trainer does not. It used to be
    accepted and then silently hold one key's values under both names after AdamW steps."""
    trainer_model = untied()
    async with Synchronizer(None, syncer) as sync:
        await sync.attach_trainer(trainer_model)
        with pytest.raises(AiosyncError) as caught:
            await sync.attach_explorer("e0", Tied(tie=True))
    assert "HandshakeError" in str(caught.value) or isinstance(caught.value, HandshakeError)
    assert "'embed.weight'" in str(caught.value) and "'head.weight'" in str(caught.value)


@pytest.mark.parametrize("method", ["memory", "checkpoint", "nccl"])
@pytest.mark.parametrize("syncer", [PATCH, BUCKET], ids=["flat", "bucket"])
async def test_a_trainer_tied_like_its_explorer_is_accepted_and_exact(method, syncer, tmp_path):
    """The refusal compares the trainer's tying: a published copy (memory) or a file
    (checkpoint) must keep it, or a tied explorer of a tied trainer would be refused."""
    trainer_model, explorer_model = Tied(tie=True), Tied(tie=True)
    with torch.no_grad():
        explorer_model.embed.weight.zero_()
    cfg = dict(method=method, sync_timeout=HANG_GUARD, checkpoint_dir=str(tmp_path) if method == "checkpoint" else None)
    async with Synchronizer(cfg, syncer) as sync:
        trainer = await sync.attach_trainer(trainer_model)
        ex = await sync.attach_explorer("e0", explorer_model)
        for step in adamw_steps(trainer_model, 2):
            await publish(trainer, ex, step, method)
        await ex.wait_applied(HANG_GUARD)
    assert ex.version == 2 and not same_state(trainer_model, explorer_model)
    assert explorer_model.head.weight is explorer_model.embed.weight


# ------------------------------------------------------------------ 4. keys sharing part of one buffer

@pytest.mark.parametrize("syncer", [PATCH, PATCH_CTX, PATCH_COO], ids=["flat", "ctx", "coo"])
async def test_keys_sharing_part_of_a_buffer_are_patched_without_a_false_drift(syncer):
    """A persistent buffer views the embedding's first two rows, on both sides. Every ``flat`` /
    ``ctx`` patch used to be refused with a DriftError ("written behind aiosync's back"): the
    second key was decoded against what the first had just written."""
    trainer_model, explorer_model = Tied(tie=False, prefix=True), Tied(tie=False, prefix=True)
    async with Synchronizer(None, syncer) as sync:
        trainer = await sync.attach_trainer(trainer_model)
        ex = await sync.attach_explorer("e0", explorer_model)
        for step in adamw_steps(trainer_model, 3):
            await trainer.sync_weight(step)
        row = sync.metrics()["explorers"]["e0"]
    assert row["failed"] == 0 and row["repairs"] == 0, row["last_error"]
    assert ex.version == 3 and not same_state(trainer_model, explorer_model)


# ------------------------------------------------------------------ the minor cases: aiosync's own errors

async def test_complex128_in_patch_mode_is_refused_at_the_handshake():
    state = {"z": torch.randn(3, 4, dtype=torch.complex128), "w": torch.randn(3)}
    async with Synchronizer(None, PATCH_COO) as sync:
        await sync.attach_trainer(state)
        with pytest.raises(AiosyncError, match=r"HandshakeError.*'z'.*complex128"):
            await sync.attach_explorer("e0", {k: torch.zeros_like(v) for k, v in state.items()})


async def test_the_checkpoint_method_refuses_a_dtype_safetensors_cannot_store(tmp_path):
    """A raw KeyError from safetensors at attach, before issue 33 made the writer name it."""
    state = {"z": torch.randn(3, 4, dtype=torch.complex128)}
    async with Synchronizer(dict(method="checkpoint", checkpoint_dir=str(tmp_path)), PATCH) as sync:
        with pytest.raises(AiosyncError, match=r"'z'.*complex128"):
            await sync.attach_trainer(state)


@pytest.mark.parametrize("method", ["memory", "checkpoint", "nccl"])
async def test_a_key_removed_from_a_dict_trainer_fails_the_delivery_not_the_synchronizer(method, tmp_path):
    """Every method now says the same: the delivery fails with a HandshakeError naming the key,
    the trainer goes on, the drain raises (the checkpoint method used to raise a raw KeyError out
    of ``sync_weight``)."""
    state = {"a": torch.randn(3), "b": torch.randn(3)}
    cfg = dict(method=method, sync_timeout=HANG_GUARD, checkpoint_dir=str(tmp_path) if method == "checkpoint" else None)
    sync = Synchronizer(cfg, PATCH)
    with pytest.raises(AiosyncError, match="DrainError|could not bring"):
        async with sync:
            trainer = await sync.attach_trainer(state)
            ex = await sync.attach_explorer("e0", {k: torch.zeros_like(v) for k, v in state.items()})
            del state["b"]
            await publish(trainer, ex, 1, method)
            assert ex.version == 0
            assert "HandshakeError" in last_error(sync, "e0") and "'b'" in last_error(sync, "e0")


async def test_conjugate_and_negative_views_are_read_by_value_under_nccl():
    base, neg = torch.randn(3, 4, dtype=torch.complex64), torch.randn(5)
    state = {"z": base.conj(), "n": torch._neg_view(neg)}
    model = {k: torch.zeros(v.shape, dtype=v.dtype) for k, v in state.items()}
    async with Synchronizer(dict(method="nccl"), PATCH) as sync:
        await sync.attach_trainer(state)
        ex = await sync.attach_explorer("e0", model)
    assert ex.version == 0
    assert torch.equal(model["z"], base.conj().resolve_conj()) and torch.equal(model["n"], -neg)
