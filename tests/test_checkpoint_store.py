"""The checkpoint directory is a store one can trust (issue 33, SPEC T2/T3): one run owns a
directory, a resumed run never mixes its shards with a dead run's, every file carries digests of
its tensors that every reader verifies, and a write that fails says where and why. Each test
here failed before the fix (items 1, 2, 3 and 7 of the issue; issue 32's item 5)."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import anyio
import pytest
import torch

from aiosync.aio import run_sync
from aiosync.checkpoints import CheckpointDir, TensorSlice
from aiosync.coordination import CheckpointFollower, Synchronizer
from aiosync.errors import ChecksumError, CheckpointHeldError, CheckpointWriteError, PayloadError

from helpers import (HANG_GUARD, PATCH, dead, holds, rollout_model, same_bits, train_to, trainer_state,
                     two_writer_synchronizer, weights)


def _files(path) -> list[str]:
    return sorted(n for n in os.listdir(path) if not n.startswith("."))


# ------------------------------------------------------------------ item 1: one run owns a directory

def test_a_second_run_is_refused_naming_the_holder_and_publishes_nothing(tmp_path):
    first = CheckpointDir(tmp_path, run_id="first")
    first.publish(weights(1), 1)
    second = CheckpointDir(tmp_path, run_id="second")
    with pytest.raises(CheckpointHeldError) as info:
        second.publish(weights(2), 2)  # before the fix: published, and readers took it as the run's version 2
    msg = str(info.value)
    assert str(tmp_path) in msg and "run 'first'" in msg and f"pid {os.getpid()}" in msg
    assert info.value.holder["run"] == "first"
    assert _files(tmp_path) == [first.file_for(1).name]
    assert first.load()[0] == 1 and same_bits(first.load()[1]["w"], weights(1)["w"])
    with pytest.raises(CheckpointHeldError, match="the same run id"):  # a copied launch script
        CheckpointDir(tmp_path, run_id="first").publish(weights(3), 3)


async def test_a_second_trainer_is_refused_at_attach_and_explorers_never_lease_its_weights(tmp_path):
    cfg = dict(method="checkpoint", checkpoint_dir=str(tmp_path), style="trainer_driven",
               sync_timeout=HANG_GUARD, delivery_timeout=HANG_GUARD)
    with anyio.fail_after(HANG_GUARD * 2):
        async with Synchronizer(cfg, PATCH) as one:
            trainer = await one.attach_trainer(trainer_state())
            ex = await one.attach_explorer("e0", rollout_model())
            async with Synchronizer(cfg, PATCH) as two:
                with pytest.raises(CheckpointHeldError, match=f"held by run '{one.source.directory.run_id}'"):
                    await two.attach_trainer(weights(5), version=1)
            state = trainer_state()
            train_to(state, 1)
            trainer.live = lambda: state
            await trainer.sync_weight(1)
            assert await ex.sync_weight() == 1 and holds(ex.slot.model, 1)
            await trainer.stop()


def test_a_stale_hold_is_taken_over_and_its_run_can_no_longer_publish(tmp_path):
    old = CheckpointDir(tmp_path, run_id="old")
    old.publish(weights(3), 3)
    dead(old)  # its process is gone
    new = CheckpointDir(tmp_path, run_id="new")
    new.publish(weights(4), 4)
    assert new.holder() == "new" and new.newest_version() == 4
    with pytest.raises(CheckpointHeldError, match="no longer holds it"):
        old.publish(weights(5), 5)  # the old run, alive after all: refused, nothing written
    assert new.newest_version() == 4 and _files(tmp_path) == [new.file_for(4).name]


def test_publishing_never_replaces_a_file(tmp_path):
    d = CheckpointDir(tmp_path, run_id="r")
    d.publish(weights(1), 1)
    stranger = d.file_for(2)
    stranger.write_bytes(b"a file this run did not write")
    d.publish(weights(2), 2)
    kept = [p for p in tmp_path.iterdir() if p.name.startswith(".stranger-")]
    assert len(kept) == 1 and kept[0].read_bytes() == b"a file this run did not write"  # moved aside, not lost
    assert same_bits(d.load(2)[1]["w"], weights(2)["w"])


# ------------------------------------------------------------------ item 2: resume with several writers

def test_a_resumed_run_discards_a_dead_runs_incomplete_version_and_never_combines_runs(tmp_path):
    a0, a1 = CheckpointDir(tmp_path, run_id="a"), CheckpointDir(tmp_path, run_id="a")
    for v in (2, 3):
        a0.publish(_half(v, 0), v, writer=(0, 2))
        a1.publish(_half(v, 1), v, writer=(1, 2))
    a1.publish(_half(4, 1), 4, writer=(1, 2))  # then run a died: writer 0 never wrote version 4
    dead(a0)
    b0, b1 = CheckpointDir(tmp_path, run_id="b"), CheckpointDir(tmp_path, run_id="b")
    b0.publish(_half(40, 0), 4, writer=(0, 2))  # the resumed run publishes from 4, as the refusal told it
    assert b0.discarded == [a1.file_for(4, writer=(1, 2)).name]
    assert b0.newest_version() is None  # b's version 4 has one shard of two: not a version (no mixing)
    with pytest.raises(CheckpointHeldError, match="no longer holds it"):
        a1.publish(_half(5, 1), 5, writer=(1, 2))  # a writer of the dead run that lived on
    b1.publish(_half(40, 1), 4, writer=(1, 2))  # before the fix: refused, 4 is not above 4
    version, tensors = b0.load()
    assert version == 4 and same_bits(tensors["w"], _full(40))


async def test_a_follower_never_holds_rows_of_two_runs(tmp_path):
    a0, a1 = CheckpointDir(tmp_path, run_id="a"), CheckpointDir(tmp_path, run_id="a")
    a0.publish(_half(3, 0), 3, writer=(0, 2))
    a1.publish(_half(3, 1), 3, writer=(1, 2))
    a1.publish(_half(4, 1), 4, writer=(1, 2))
    follower = CheckpointFollower(tmp_path, {"w": torch.zeros(4, 3)}, timeout=HANG_GUARD)
    assert await follower.poll() == 3
    dead(a0)
    b0, b1 = CheckpointDir(tmp_path, run_id="b"), CheckpointDir(tmp_path, run_id="b")
    b0.publish(_half(40, 0), 4, writer=(0, 2))
    assert await follower.poll() == 3 and same_bits(follower.slot.model["w"], _full(3))
    b1.publish(_half(40, 1), 4, writer=(1, 2))
    assert await follower.poll() == 4 and same_bits(follower.slot.model["w"], _full(40))


def _full(v: float) -> torch.Tensor:
    return torch.arange(12.0).reshape(4, 3) + v


def _half(v: float, rank: int) -> dict:
    rows = _full(v)[2 * rank: 2 * rank + 2]
    return {"w": TensorSlice(rows, (2 * rank, 0), (4, 3))}


# ------------------------------------------------------------------ item 3: digests, verified by every reader

def _flip_bit(path: Path, tensor: str = "w", element: int = 5, bit: int = 3) -> None:
    """Flip one mantissa bit of one fp32 element of ``tensor`` in the file, in place."""
    raw = bytearray(path.read_bytes())
    n = int.from_bytes(raw[:8], "little")
    begin = json.loads(raw[8:8 + n])[tensor]["data_offsets"][0]
    raw[8 + n + begin + 4 * element] ^= 1 << bit
    path.write_bytes(bytes(raw))


def test_a_damaged_file_is_refused_naming_the_file_the_tensor_and_the_version(tmp_path):
    d = CheckpointDir(tmp_path)
    path = d.publish(weights(1), 1)
    _flip_bit(path)
    with pytest.raises(ChecksumError, match=rf"checkpoint {path.name} \(version 1\): tensor 'w' does not match"):
        d.load()
    assert d.read_newest() is None and d.refused[-1][0] == path.name
    os.truncate(path, path.stat().st_size - 7)
    with pytest.raises(PayloadError, match=rf"checkpoint {path.name}: .*truncated"):
        d.load()


async def test_a_bit_flipped_on_storage_never_reaches_an_explorer_or_a_follower(tmp_path):
    cfg = dict(method="checkpoint", checkpoint_dir=str(tmp_path), style="trainer_driven",
               sync_timeout=HANG_GUARD, delivery_timeout=HANG_GUARD)
    state = trainer_state()
    with anyio.fail_after(HANG_GUARD * 2):
        async with Synchronizer(cfg, PATCH) as sync:
            trainer = await sync.attach_trainer(state)
            ex = await sync.attach_explorer("e0", rollout_model())
            follower = CheckpointFollower(tmp_path, rollout_model(), timeout=HANG_GUARD)
            assert await follower.poll() == 0
            publish = sync.source.directory.publish

            def publish_then_damage(*args, **kwargs):
                path = publish(*args, **kwargs)
                _flip_bit(path)  # damage on the storage, after the file was written
                return path

            sync.source.directory.publish = publish_then_damage
            train_to(state, 1)
            await trainer.sync_weight(1)
            sync.source.directory.publish = publish
            assert await ex.sync_weight() == 0 and holds(ex.slot.model, 0)  # before the fix: 1, one element wrong
            assert await follower.poll() == 0 and holds(follower.slot.model, 0)
            assert isinstance(follower.refused[-1][1], ChecksumError) and "tensor 'w'" in str(follower.refused[-1][1])
            train_to(state, 2)
            await trainer.sync_weight(2)  # the next version repairs both
            assert await ex.sync_weight() == 2 and holds(ex.slot.model, 2)
            assert await follower.poll() == 2 and holds(follower.slot.model, 2)
            await trainer.stop()


# ------------------------------------------------------------------ item 7: a full disk

_FULL_DISK = textwrap.dedent("""
    import resource, signal, sys, torch
    from aiosync.checkpoints import CheckpointDir
    from aiosync.errors import CheckpointWriteError
    d = CheckpointDir(sys.argv[1])
    d.publish({"w": torch.ones(4)}, 1)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.RLIM_INFINITY))
    try:
        d.publish({"w": torch.ones(1 << 20)}, 2)
    except CheckpointWriteError as exc:
        print(type(exc).__name__, exc.errno, exc.version, exc.directory == sys.argv[1], str(exc), sep="|")
""")


def test_a_full_disk_is_an_aiosync_error_naming_the_directory_the_version_and_the_os_error(tmp_path):
    out = subprocess.run([sys.executable, "-c", _FULL_DISK, str(tmp_path)], capture_output=True, text=True,
                         timeout=120, env=os.environ | {"PYTHONPATH": str(Path(__file__).parents[1])})
    assert out.returncode == 0, out.stderr[-2000:]
    name, code, version, same_dir, msg = out.stdout.strip().split("|")
    assert (name, int(code), int(version), same_dir) == ("CheckpointWriteError", errno.EFBIG, 2, "True")
    assert f"version 2 to {tmp_path}" in msg and "(EFBIG)" in msg
    d = CheckpointDir(tmp_path)
    assert d.newest_version() == 1 and [n for n in os.listdir(tmp_path) if n.startswith(".tmp")] == []


# ------------------------------------------------------------------ issue 32, item 5: TensorSlice shards

async def test_two_writers_with_tensor_slice_shards_serve_explorers(tmp_path):
    """docs/distributed.md names TensorSlice for shards that are not DTensors; before the fix no
    explorer could be served (``'TensorSlice' object has no attribute 'dtype'``)."""
    full = weights(0)
    rows = {r: full["w"][12 * r: 12 * r + 12] for r in (0, 1)}
    mine = {"w": TensorSlice(rows[0], (0, 0), (24, 16)), "b": full["b"], "stamp": full["stamp"]}
    async with two_writer_synchronizer(tmp_path, mine, {"w": TensorSlice(rows[1], (12, 0), (24, 16))}) as (sync, _):
        ex = await sync.attach_explorer("e0", rollout_model())
        assert ex.version == 0 and holds(ex.slot.model, 0)
        await sync.trainer.stop()
