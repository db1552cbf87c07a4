"""The checkpoint directory of the CHECKPOINT method (T3, :mod:`aiosync.checkpoints`): atomic
publish, discovery, removal of superseded files, full checkpoints kept, metadata checked on
load, and :func:`check_tensors_fit`, the one check of a checkpoint against a model."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from aiosync.checkpoints import CheckpointDir, TensorSlice, check_tensors_fit
from aiosync.errors import HandshakeError, PayloadError, VersionError

from aiosync.aio import run_sync
from helpers import dead, rollout_model, same_bits, weights


def _state(v: float) -> dict[str, torch.Tensor]:
    return {"w": torch.full((3, 4), v), "b": torch.full((4,), v, dtype=torch.bfloat16),
            "n": torch.tensor(int(v), dtype=torch.int64)}


def _files(path) -> list[str]:
    """The checkpoint files of a directory (not its hold files)."""
    return sorted(n for n in os.listdir(path) if not n.startswith("."))


def test_publish_discover_load_and_remove_superseded(tmp_path):
    d = CheckpointDir(tmp_path / "ckpt", run_id="r1")
    assert d.newest() is None and d.newest_version() is None
    d.publish(_state(1), 1)
    d.publish(_state(2), 2, keep=True)  # a full checkpoint: marked and kept
    d.publish(_state(3), 3)
    assert _files(d.path) == ["full-000000000002.r1.safetensors", "sync-000000000003.r1.safetensors"]
    version, tensors = d.load()
    assert version == 3
    assert all(torch.equal(tensors[k], v) for k, v in _state(3).items())
    assert tensors["b"].dtype == torch.bfloat16
    assert d.load(2)[0] == 2
    with pytest.raises(FileNotFoundError, match="version 1 is not published"):
        d.load(1)


def test_loading_an_empty_directory_says_so(tmp_path):
    with pytest.raises(FileNotFoundError, match="no published checkpoint"):
        CheckpointDir(tmp_path).load()


def test_publish_is_atomic_on_failure(tmp_path):
    d = CheckpointDir(tmp_path)
    d.publish(_state(1), 1)
    bad = {"w": object()}  # not a tensor: the write fails
    with pytest.raises(Exception):
        d.publish(bad, 2)  # type: ignore[arg-type]
    assert [n for n in os.listdir(tmp_path) if not n.startswith(".hold")] == [d.file_for(1).name]  # no temporary
    assert d.load()[0] == 1


def test_tied_tensors_can_be_published(tmp_path):
    w = torch.randn(4, 4)
    d = CheckpointDir(tmp_path)
    d.publish({"emb": w, "head": w}, 0)
    _, tensors = d.load()
    assert torch.equal(tensors["emb"], w) and torch.equal(tensors["head"], w)


def test_checkpoint_metadata_is_checked_and_temporaries_are_cleaned(tmp_path):
    d = CheckpointDir(tmp_path)
    d.publish(weights(1), 1)
    d.publish(weights(2), 2, keep=True)
    meta = d.metadata(d.file_for(2, keep=True))
    assert {k: meta[k] for k in ("version", "kind", "run", "digest")} == {
        "version": "2", "kind": "full", "run": d.run_id, "digest": "blake3-128"}
    assert set(json.loads(meta["digests"])) == set(weights(2))
    assert [v for v, _ in d.versions("full")] == [2] and d.newest_version() == 2
    assert not d.file_for(1).exists()  # superseded by 2
    os.rename(d.file_for(2, keep=True), d.file_for(5))  # a mislabelled file is refused, never applied
    with pytest.raises(PayloadError, match="holds version '2'"):
        d.load()
    stale = tmp_path / ".tmp-crashed.safetensors"
    stale.write_bytes(b"half")
    os.utime(stale, (0, 0))
    fresh = tmp_path / ".tmp-writing.safetensors"
    fresh.write_bytes(b"in progress")
    assert d.remove_stale_temporaries(older_than=60) == 1 and fresh.exists()
    assert d.newest()[0] == 5  # temporaries are never discovered
    d.publish(weights(3), 3)  # above what this run published: the mislabelled file is no version of it
    assert d.read_newest()[0] == 3 and "holds version '2'" in str(d.refused[-1][1])


def test_an_unreadable_file_is_a_payload_error(tmp_path):
    d = CheckpointDir(tmp_path)
    d.publish(weights(1), 1)
    d.file_for(4).write_bytes(b"not safetensors at all")
    with pytest.raises(PayloadError, match=r"checkpoint sync-000000000004\.\w+\.safetensors: header of"):
        d.load()


def test_publishing_into_a_directory_of_an_earlier_run_says_how_to_proceed(tmp_path):
    earlier = CheckpointDir(tmp_path)
    earlier.publish(weights(7), 7)  # an earlier run left version 7 behind
    dead(earlier)
    d = CheckpointDir(tmp_path)
    with pytest.raises(VersionError) as info:
        d.publish(weights(1), 1)
    msg = str(info.value)
    assert "version 1" in msg and "not above the newest published 7" in msg
    assert "an earlier run of this directory" in msg
    assert "empty directory" in msg and "version= above 7" in msg
    assert _files(tmp_path) == [earlier.file_for(7).name]  # nothing written
    d.publish(weights(8), 8)  # above the newest: fine
    assert d.newest_version() == 8


def test_versions_are_non_negative(tmp_path):
    with pytest.raises(VersionError, match="non-negative"):
        CheckpointDir(tmp_path).publish(weights(0), -1)


# ------------------------------------------------------------------ check_tensors_fit

def test_tensors_that_fit_pass_and_floating_point_may_change_dtype():
    model = rollout_model()  # bf16 w, fp32 b, int64 stamp
    check_tensors_fit(model, weights(3), "checkpoint x")  # fp32 w into bf16: cast, fine
    check_tensors_fit(model, {"b": torch.zeros(16, dtype=torch.float16)}, "checkpoint x")  # a subset is fine
    check_tensors_fit(model, {}, "checkpoint x")


@pytest.mark.parametrize("tensors, message", [
    ({"missing": torch.zeros(1)}, r"checkpoint sync-1: key 'missing' does not exist in the model"),
    ({"w": torch.zeros(16, 24)}, r"checkpoint sync-1: 'w' has shape \(16, 24\), the model has \(24, 16\)"),
    ({"stamp": torch.tensor(3, dtype=torch.int32)}, r"'stamp' is int32, the model holds int64 \(only floating"),
    ({"stamp": torch.tensor(3.0)}, r"'stamp' is float32, the model holds int64"),
    ({"b": torch.zeros(16, dtype=torch.int64)}, r"'b' is int64, the model holds float32"),
    ({"b": torch.zeros(16, dtype=torch.bool)}, r"'b' is bool, the model holds float32"),
])
def test_tensors_that_do_not_fit_are_a_handshake_error_naming_the_key(tensors, message):
    model = rollout_model()
    before = {k: t.clone() for k, t in model.items()}
    with pytest.raises(HandshakeError, match=message):
        check_tensors_fit(model, tensors, "checkpoint sync-1")
    assert all(same_bits(model[k], before[k]) for k in model)  # nothing written


def test_bool_and_integer_tensors_must_match_exactly():
    target = {"mask": torch.zeros(3, dtype=torch.bool), "idx": torch.zeros(3, dtype=torch.int32)}
    check_tensors_fit(target, {"mask": torch.ones(3, dtype=torch.bool), "idx": torch.ones(3, dtype=torch.int32)}, "x")
    with pytest.raises(HandshakeError, match="'mask' is uint8, the model holds bool"):
        check_tensors_fit(target, {"mask": torch.ones(3, dtype=torch.uint8)}, "x")


def test_a_value_that_is_not_a_tensor_is_a_payload_error():
    with pytest.raises(PayloadError, match="x: 'w' is a list, not a tensor"):
        check_tensors_fit(rollout_model(), {"w": [1, 2]}, "x")


def test_load_checks_the_file_against_the_model_it_is_for(tmp_path):
    d = CheckpointDir(tmp_path)
    d.publish(weights(2), 2)
    version, tensors = d.load(target=rollout_model())
    assert version == 2 and same_bits(tensors["w"], weights(2)["w"])
    d.publish({"w": torch.zeros(2, 2)}, 3)  # wrong shape for the model
    with pytest.raises(HandshakeError, match=r"checkpoint sync-000000000003\.\w+\.safetensors: 'w' has shape \(2, 2\)"):
        d.load(target=rollout_model())
    assert d.load()[0] == 3  # without a target, no check


# ------------------------------------------------------------------ several writers (sharded trainers)

def _halves(v: float) -> tuple[dict, dict]:
    """Writer 0 and writer 1 of a state whose ``w`` is split by rows; ``b`` and ``n`` are whole."""
    full = _state(v) | {"w": torch.arange(12.0).reshape(3, 4) + v}
    rows = [full["w"][:2], full["w"][2:]]
    w0 = {"w": TensorSlice(rows[0], (0, 0), (3, 4)), "b": full["b"], "n": full["n"]}
    w1 = {"w": TensorSlice(rows[1], (2, 0), (3, 4)), "b": full["b"], "n": full["n"]}  # plain ones: writer 0's
    return w0, w1, full


def _writers(path, n: int = 2) -> list[CheckpointDir]:
    """The handles of ``n`` writers of one run."""
    return [CheckpointDir(path, run_id="run") for _ in range(n)]


def test_a_version_of_two_writers_is_published_only_when_both_shards_are_in(tmp_path):
    d, d1 = _writers(tmp_path)
    w0, w1, full = _halves(1.0)
    d.publish(w0, 1, writer=(0, 2))
    assert d.newest() is None  # one shard of two: not published
    with pytest.raises(FileNotFoundError, match="no published checkpoint"):
        d.load()
    d1.publish(w1, 1, writer=(1, 2))
    version, tensors = d.load()
    assert version == 1 and set(tensors) == set(full)
    assert all(same_bits(tensors[k], full[k]) for k in full)
    # the next version: superseded shards go only once it is complete
    w0, w1, full2 = _halves(2.0)
    d1.publish(w1, 2, writer=(1, 2))
    assert d.newest_version() == 1 and d.load()[0] == 1  # version 1 still readable
    d.publish(w0, 2, writer=(0, 2))
    assert d.newest_version() == 2 and same_bits(d.load()[1]["w"], full2["w"])
    assert _files(tmp_path) == ["sync-000000000002.run.w00000-of-00002.safetensors",
                                "sync-000000000002.run.w00001-of-00002.safetensors"]


@pytest.mark.parametrize("case", ["overlap", "gap", "whole_and_slice"])
def test_shards_that_do_not_tile_a_tensor_are_refused(tmp_path, case):
    d, d1 = _writers(tmp_path)
    w = torch.arange(12.0).reshape(3, 4)
    first = w if case == "whole_and_slice" else TensorSlice(w[:2], (0, 0), (3, 4))
    second = {"overlap": TensorSlice(w[1:], (1, 0), (3, 4)), "gap": TensorSlice(w[2:3, :2], (2, 0), (3, 4)),
              "whole_and_slice": TensorSlice(w[2:], (2, 0), (3, 4))}[case]
    d.publish({"w": first}, 1, writer=(0, 2))
    d1.publish({"w": second}, 1, writer=(1, 2))
    with pytest.raises(PayloadError, match="overlap or leave gaps|written whole"):
        d.load()


def test_writers_other_than_0_do_not_write_plain_tensors(tmp_path):
    """A plain tensor counts as replicated (every rank of a sharded trainer holds it)."""
    d, d1 = _writers(tmp_path)
    w0, w1, full = _halves(1.0)
    d.publish(w0, 1, writer=(0, 2))
    d1.publish(w1 | {"extra": torch.ones(2)}, 1, writer=(1, 2))
    assert set(d.load()[1]) == set(full)


def test_a_shard_whose_name_lies_about_its_writer_is_refused(tmp_path):
    d, d1 = _writers(tmp_path)
    w0, w1, _ = _halves(1.0)
    p0 = d.publish(w0, 1, writer=(0, 2))
    p1 = d1.publish(w1, 1, writer=(1, 2))
    shutil.copyfile(p1, p0)  # writer 1's file as writer 0's
    with pytest.raises(PayloadError, match="says it is writer"):
        d.load()


def test_names_that_only_look_like_checkpoints_are_ignored(tmp_path):
    d = CheckpointDir(tmp_path, run_id="r")
    src = d.publish(_state(1), 1)
    (tmp_path / "sync-000000000002.r.safetensors\n").write_bytes(src.read_bytes())  # a trailing newline
    (tmp_path / "sync-00000000000\u0663.r.safetensors").write_bytes(src.read_bytes())  # an Arabic-Indic digit
    (tmp_path / f"sync-{2**63:012d}.r.safetensors").write_bytes(src.read_bytes())  # above int64
    (tmp_path / "sync-000000000009.r.safetensors").symlink_to(src)  # a symlink may point anywhere
    (tmp_path / "sync-000000000010.r.x.safetensors").write_bytes(src.read_bytes())  # a dot in the run id
    assert d.versions() == [(1, src)]


# ------------------------------------------------------------------ the CHECKPOINT method with two writers

async def test_the_synchronizer_publishes_a_version_only_when_every_writer_wrote_its_shard(tmp_path):
    import anyio

    from helpers import HANG_GUARD, holds, train_to, trainer_state, two_writer_synchronizer

    state = trainer_state()
    async with two_writer_synchronizer(tmp_path, state, {}) as (sync, other):  # writer 1: plain tensors are writer 0's
        trainer = sync.trainer
        ex = await sync.attach_explorer("e0", rollout_model())
        train_to(state, 1)
        done = anyio.Event()

        async def publish_1():
            await trainer.sync_weight(1)
            done.set()

        async with anyio.create_task_group() as tg:
            tg.start_soon(publish_1)
            with anyio.fail_after(HANG_GUARD):
                while not (tmp_path / "sync-000000000001.run.w00000-of-00002.safetensors").exists():
                    await anyio.sleep(0.01)  # writer 0's shard is on disk, the version is not published
            assert not done.is_set() and other.newest_version() == 0 and trainer.version == 0
            other.publish({}, 1, writer=(1, 2))
            await done.wait()
        assert trainer.version == 1 and other.newest_version() == 1
        assert await ex.sync_weight() == 1 and holds(ex.slot.model, 1)
        other.publish({}, 2, writer=(1, 2))
        train_to(state, 2)
        await trainer.sync_weight(2)  # writer 1's shard is already in: published at once
        await trainer.stop()
    assert ex.version == 2 and holds(ex.slot.model, 2)


def test_two_writers_need_a_writer_rank(tmp_path):
    import anyio

    from aiosync.coordination import Synchronizer
    from aiosync.errors import ConfigError
    from helpers import PATCH, trainer_state

    async def attach(**kw):
        async with Synchronizer(dict(method="checkpoint", checkpoint_dir=str(tmp_path), checkpoint_writers=2),
                                PATCH) as sync:
            await sync.attach_trainer(trainer_state(), **kw)

    with pytest.raises(ConfigError, match="run_id="):
        anyio.run(attach)
    with pytest.raises(ConfigError, match="writer_rank"):
        anyio.run(lambda: attach(run_id="r"))
    with pytest.raises(ConfigError, match=r"writer_rank 2 is not in \[0, 2\)"):
        anyio.run(lambda: attach(writer_rank=2, run_id="r"))
    with pytest.raises(ConfigError, match="checkpoint only"):
        Synchronizer(dict(checkpoint_writers=2), PATCH)
