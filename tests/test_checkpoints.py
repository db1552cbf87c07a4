"""The checkpoint directory of the CHECKPOINT method (T3, :mod:`aiosync.checkpoints`): atomic
publish, discovery, removal of superseded files, full checkpoints kept, metadata checked on
load, and :func:`check_tensors_fit`, the one check of a checkpoint against a model."""

from __future__ import annotations

import os

import pytest
import torch

from aiosync.checkpoints import CheckpointDir, check_tensors_fit
from aiosync.errors import HandshakeError, PayloadError, VersionError

from helpers import rollout_model, same_bits, weights


def _state(v: float) -> dict[str, torch.Tensor]:
    return {"w": torch.full((3, 4), v), "b": torch.full((4,), v, dtype=torch.bfloat16),
            "n": torch.tensor(int(v), dtype=torch.int64)}


def test_publish_discover_load_and_remove_superseded(tmp_path):
    d = CheckpointDir(tmp_path / "ckpt")
    assert d.newest() is None and d.newest_version() is None
    d.publish(_state(1), 1)
    d.publish(_state(2), 2, keep=True)  # a full checkpoint: marked and kept
    d.publish(_state(3), 3)
    names = sorted(os.listdir(d.path))
    assert names == ["full-000000000002.safetensors", "sync-000000000003.safetensors"]
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
    assert sorted(os.listdir(tmp_path)) == ["sync-000000000001.safetensors"]  # no temporary file left
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
    assert d.metadata(d.file_for(2, keep=True)) == {"version": "2", "kind": "full"}
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
    with pytest.raises(VersionError):
        d.publish(weights(3), 3)


def test_an_unreadable_file_is_a_payload_error(tmp_path):
    d = CheckpointDir(tmp_path)
    d.file_for(4).write_bytes(b"not safetensors at all")
    with pytest.raises(PayloadError, match="cannot read checkpoint"):
        d.load()


def test_publishing_into_a_directory_of_an_earlier_run_says_how_to_proceed(tmp_path):
    earlier = CheckpointDir(tmp_path)
    earlier.publish(weights(7), 7)  # an earlier run left version 7 behind
    d = CheckpointDir(tmp_path)
    with pytest.raises(VersionError) as info:
        d.publish(weights(1), 1)
    msg = str(info.value)
    assert "version 1" in msg and "not above the newest published 7" in msg
    assert "sync-000000000007.safetensors" in msg  # the newest file, by name
    assert "another (earlier) run" in msg
    assert "empty directory" in msg and "remove the old files" in msg and "version= above 7" in msg
    assert sorted(os.listdir(tmp_path)) == ["sync-000000000007.safetensors"]  # nothing written
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
    with pytest.raises(HandshakeError, match=r"checkpoint sync-000000000003.safetensors: 'w' has shape \(2, 2\)"):
        d.load(target=rollout_model())
    assert d.load()[0] == 3  # without a target, no check
