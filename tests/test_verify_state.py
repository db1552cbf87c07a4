"""Whole-state verification (issue 35, SPEC T6): the state digest, and explorers checked end to
end against the trainer's version — after bootstraps, on the ``verify_state`` schedule and at
the drain — with a mismatch named, counted and repaired.

The faults here are ones no other check sees: a bit flipped in a tensor no later patch touches
(the drift check only covers changed positions), a write that silently leaves one value wrong.
"""

from __future__ import annotations

import pytest
import torch

from aiosync.coordination import Synchronizer
from aiosync.errors import ConfigError, DrainError
from aiosync.syncers.common.integrity import DIGEST_CHUNK, _mix_int, _mix_torch, _s64, _sum64, state_digest
from aiosync.syncers.patch.syncer import PatchWeightSyncer
from helpers import BUCKET, HANG_GUARD, PATCH, PATCH_COO, holds, rollout_model, train_to, trainer_state

pytestmark = pytest.mark.both_loops


@pytest.fixture(scope="module", autouse=True)
def _compiled_kernels():
    from aiosync.syncers.kernels.warmup import warm_up

    warm_up()


# ------------------------------------------------------------------ the digest

def by_definition(t: torch.Tensor, dtype: torch.dtype | None = None) -> int:
    """The digest as docs define it, in plain torch ops over the whole tensor at once."""
    t = t if dtype is None else t.to(dtype)
    raw = (torch.view_as_real(t) if t.is_complex() else t).contiguous().reshape(-1).view(torch.uint8)
    n = raw.numel()
    words = torch.cat([raw, raw.new_zeros(-n % 8)]).view(torch.int64)
    return _s64(_mix_int(n, _sum64(_mix_torch(torch.arange(words.numel()), words))))


@pytest.mark.parametrize("t, dtype", [
    (torch.randn(1000), None), (torch.randn(7, 13), torch.bfloat16), (torch.randn(3), torch.bfloat16),
    (torch.randint(-50, 50, (5,), dtype=torch.int64), None), (torch.tensor(True), None), (torch.tensor(3.5), None),
    (torch.randn(5, 3, dtype=torch.complex128), None), (torch.randn(5, dtype=torch.bfloat16), None),
    (torch.randn(10, 10).t(), torch.float16), (torch.randn(DIGEST_CHUNK + 13), torch.bfloat16),
    (torch.randn(DIGEST_CHUNK + 13), None), (torch.tensor([float("nan"), -0.0, float("inf")]), torch.bfloat16),
], ids=lambda x: str(getattr(x, "dtype", x)))
@pytest.mark.parametrize("path", ["kernels", "torch"])
def test_the_digest_is_its_definition_on_every_dtype_layout_and_chunking(t, dtype, path, monkeypatch):
    """The numba kernels (fused fp32 → bf16 cast included, across chunk boundaries) and the torch
    path a cold start takes until they load compute exactly the documented digest."""
    from aiosync.syncers.kernels.warmup import digest_ready

    if path == "torch":
        monkeypatch.setenv("AIOSYNC_KERNELS", "torch")
    assert digest_ready() == (path == "kernels")
    assert state_digest(t, dtype) == by_definition(t, dtype)


def test_the_digest_sees_every_single_bit_and_follows_a_cast_through_a_bucket_dtype():
    x = torch.randn(4099)
    base = state_digest(x)
    for element, bit in ((0, 0), (17, 31), (4098, 9)):
        y = x.clone()
        y.view(torch.int32)[element] ^= 1 << bit
        assert state_digest(y) != base
    # fp32 trainer → bf16 bucket → fp32 explorer: what that explorer holds
    assert state_digest(x, torch.float32, via=torch.bfloat16) == state_digest(x.to(torch.bfloat16).float())
    z = torch.randn(4, 4, dtype=torch.complex64)
    assert state_digest(z.conj()) == state_digest(z.conj().resolve_conj()) != state_digest(z)


# ------------------------------------------------------------------ explorers checked end to end

FROZEN = "frozen"


def with_frozen(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A synced tensor the trainer never changes: no patch ever touches it (the drift check
    cannot see it drift), a bucket rewrites it only where it differs."""
    state[FROZEN] = torch.linspace(-1, 1, 64)
    return state


def flip_a_bit(model: dict[str, torch.Tensor], key: str = FROZEN) -> None:
    with torch.no_grad():  # behind aiosync's back
        model[key].view(torch.int32 if model[key].element_size() == 4 else torch.int16)[5] ^= 1 << 3


async def publish(sync: Synchronizer, state, version: int) -> None:
    """Push ``version`` to every explorer and wait until each delivery (and a repair it asked
    for) is over."""
    train_to(state, version)
    await sync.trainer.sync_weight(version, wait=True)
    assert not await sync.hub.wait_settled(sync.hub.lines(), HANG_GUARD)


def verify_row(sync: Synchronizer, name: str = "e0") -> dict:
    return sync.metrics()["explorers"][name]["verify"]


NO_WAIT = dict(style="trainer_driven", sync_weight_no_wait=True, sync_timeout=HANG_GUARD, delivery_timeout=HANG_GUARD)


@pytest.mark.parametrize("syncer", [PATCH, PATCH_COO], ids=["flat", "coo"])
async def test_a_bit_flipped_where_no_patch_looks_is_found_on_schedule_and_repaired(syncer):
    state = with_frozen(trainer_state())
    model = with_frozen(rollout_model())
    async with Synchronizer(dict(NO_WAIT, verify_state=2), syncer) as sync:
        await sync.attach_trainer(state)
        ex = await sync.attach_explorer("e0", model)
        assert verify_row(sync)["checks"] == 1  # the bootstrap was verified
        flip_a_bit(model)
        await publish(sync, state, 1)  # not due (every 2 versions): the flip stays
        assert verify_row(sync)["mismatches"] == 0 and not torch.equal(model[FROZEN], state[FROZEN])
        await publish(sync, state, 2)  # due: found, named, repaired at once, verified again
        row = verify_row(sync)
        assert row["mismatches"] == 1 and row["repaired"] == 1 and row["verified_version"] == 2
        assert row["last_mismatch"] == []
        assert "StateMismatchError" in sync.metrics()["explorers"]["e0"]["last_error"]
        assert FROZEN in sync.metrics()["explorers"]["e0"]["last_error"]
        assert ex.version == 2 and holds(model, 2) and torch.equal(model[FROZEN], state[FROZEN])


@pytest.mark.parametrize("method", ["memory", "nccl"])
@pytest.mark.parametrize("syncer", [PATCH, BUCKET], ids=["flat", "bucket"])
async def test_the_drain_always_verifies_and_repairs_what_it_finds(method, syncer):
    """``verify_state: 0`` (no schedule): a bit flipped after the last delivery is found by the
    drain, repaired, and the block is left without a DrainError."""
    state = with_frozen(trainer_state())
    model = with_frozen(rollout_model())
    cfg = dict(method=method, verify_state=0, sync_timeout=HANG_GUARD, delivery_timeout=HANG_GUARD)
    async with Synchronizer(cfg, syncer) as sync:
        await sync.attach_trainer(state)
        ex = await sync.attach_explorer("e0", model)
        flip_a_bit(model)
        flip_a_bit(model, "w")
    row = verify_row(sync)
    assert row["checks"] == 3 and row["mismatches"] == 1 and row["repaired"] == 1, row  # bootstrap, drain, repair
    assert ex.version == 0 and holds(model, 0) and torch.equal(model[FROZEN], state[FROZEN])


class WrongWrite(PatchWeightSyncer):
    """A receiver whose writes of versions from ``wrong_from`` on silently leave one value of
    ``b`` wrong (a bug no payload check sees)."""

    wrong_from = 0

    async def _write_staged(self, model, *args, **kwargs):
        version = await super()._write_staged(model, *args, **kwargs)
        if version >= WrongWrite.wrong_from:
            flip_a_bit(model, "b")
        return version


def wrong_writes() -> WrongWrite:  # the sender never writes: only the explorer's side is wrong
    return WrongWrite(encoding="flat", compression="none", init_sync_enabled=True)


async def test_an_explorer_whose_first_sync_does_not_verify_is_refused_naming_the_tensor():
    WrongWrite.wrong_from = 0
    async with Synchronizer(dict(sync_timeout=HANG_GUARD, delivery_timeout=HANG_GUARD), wrong_writes) as sync:
        await sync.attach_trainer(trainer_state())
        with pytest.raises(Exception, match=r"StateMismatchError.*'b' differ"):
            await sync.attach_explorer("e0", rollout_model())


async def test_a_state_the_repair_cannot_fix_is_a_drain_error_naming_the_tensor():
    WrongWrite.wrong_from = 1
    state = trainer_state()
    sync = Synchronizer(dict(NO_WAIT, verify_state=0), wrong_writes)
    with pytest.raises(DrainError, match=r"'b' differ") as caught:
        async with sync:
            await sync.attach_trainer(state)
            await sync.attach_explorer("e0", rollout_model())
            await publish(sync, state, 1)  # not verified (no schedule): the drain finds it, cannot repair it
    assert caught.value.explorers == {"e0": 1}
    row = verify_row(sync)
    assert row["mismatches"] >= 2 and row["repaired"] == 0 and row["last_mismatch"] == ["b"]


async def test_verification_can_be_switched_off_and_bad_values_are_refused():
    state = trainer_state()
    async with Synchronizer(dict(verify_state=None), PATCH) as sync:
        await sync.attach_trainer(state)
        ex = await sync.attach_explorer("e0", rollout_model())
        flip_a_bit(ex.slot.model, "w")
    assert verify_row(sync) is None  # nothing checked: the flip stays (not recommended)
    for bad in (-1, 1.5, True, "16"):
        with pytest.raises(ConfigError, match="verify_state"):
            Synchronizer(dict(verify_state=bad), PATCH)


# ------------------------------------------------------------------ the verify scenario

def test_the_verify_scenario_finds_and_repairs_every_injected_fault(tmp_path, capsys):
    """``aiosync simulate --scenario verify``: methods × styles, a late joiner per run, one bit
    flipped behind aiosync's back per run; every flip found and repaired, no wrong lease left
    unaccounted for, every explorer exact at the end."""
    import json

    from aiosync.cli.main import main

    out = tmp_path / "verify.json"
    assert main(["simulate", "--scenario", "verify", "--steps", "24", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["runs"] == 9 and report["wrong_leases_undetected"] == 0 and report["final_bit_exact"]
    assert report["injected"] == report["detected"] == report["repaired"] == 9
    assert 0 < report["verify_overhead"] < 1  # measured, not asserted against a budget (docs quote it)
    assert {r["joined_at_version"] for r in report["per_run"] if r["method"] == "nccl"} == {7}  # step 7, not 6
    assert "wrong_leases_undetected" in capsys.readouterr().out
