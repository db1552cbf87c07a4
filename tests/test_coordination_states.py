"""States (S4), styles' scheduling rules (S3), methods (S2) and the coordination config."""

from __future__ import annotations

import anyio
import pytest
from omegaconf import OmegaConf

from aiosync.configs import load_config
from aiosync.coordination import (
    ALLOWED_TRANSITIONS,
    RunningStatus,
    StatusCell,
    Synchronizer,
    SynchronizerConfig,
    SyncMethod,
    SyncStyle,
    explorer_step_syncs,
    trainer_step_syncs,
)
from aiosync.errors import ConfigError, PeerTimeoutError, StateTransitionError
from aiosync.syncers import BucketWeightSyncer, PatchWeightSyncer

S, R, Q = RunningStatus.STOPPED, RunningStatus.RUNNING, RunningStatus.REQUIRE_SYNC


# ------------------------------------------------------------------ states

def test_transition_table_is_the_seeds():
    assert ALLOWED_TRANSITIONS == {S: {R}, R: {Q, S}, Q: {R, S}}


@pytest.mark.parametrize("old,new", [(S, Q), (S, S), (R, R), (Q, Q)])
def test_illegal_transitions_raise(old, new):
    cell = StatusCell("explorer e0", status=old)
    with pytest.raises(StateTransitionError, match=f"explorer e0: illegal transition {old.name} -> {new.name}"):
        cell.set(new)
    assert cell.status is old and cell.history == []


def test_legal_transitions_are_recorded():
    cell = StatusCell("trainer")
    for new in (R, Q, R, Q, S, R, S):
        cell.set(new)
    assert cell.history == [(S, R), (R, Q), (Q, R), (R, Q), (Q, S), (S, R), (R, S)]
    assert cell.set_if(Q, R) is False and cell.status is S


async def test_status_can_be_awaited_with_a_timeout():
    cell = StatusCell("explorer e1")
    with pytest.raises(PeerTimeoutError, match="did not reach RUNNING"):
        await cell.wait_for(R, timeout=0.01)
    async with anyio.create_task_group() as tg:
        tg.start_soon(lambda: cell.wait_for(Q, timeout=10))
        await anyio.sleep(0)
        cell.set(R)
        cell.set(Q)
    assert cell.status is Q


# ------------------------------------------------------------------ styles and methods

def test_fixed_schedule_matches_the_seed_table():
    # interval=10, offset=0: both sides sync every 10 steps, starting together.
    assert [s for s in range(1, 41) if explorer_step_syncs(SyncStyle.FIXED, s, 10, 0)] == [10, 20, 30, 40]
    assert [t for t in range(1, 41) if trainer_step_syncs(SyncStyle.FIXED, t, 10)] == [10, 20, 30, 40]
    # interval=10, offset=5: the explorer runs 5 steps ahead first, then syncs every 10 steps.
    assert [s for s in range(1, 41) if explorer_step_syncs(SyncStyle.FIXED, s, 10, 5)] == [15, 25, 35]


def test_driven_styles_schedules():
    # EXPLORER_DRIVEN counts from the last successful sync: every 3 steps while they succeed...
    assert [s for s in range(1, 8) if explorer_step_syncs(SyncStyle.EXPLORER_DRIVEN, s, 3, 0)] == [3, 4, 5, 6, 7]
    assert [s for s in range(1, 8) if explorer_step_syncs(SyncStyle.EXPLORER_DRIVEN, s, 3, 0, 3 * ((s - 1) // 3))] \
        == [3, 6]
    # ... and at every step after one that did not (the last success stays at step 3)
    assert [s for s in range(4, 10) if explorer_step_syncs(SyncStyle.EXPLORER_DRIVEN, s, 3, 0, 3)] == [6, 7, 8, 9]
    assert not any(trainer_step_syncs(SyncStyle.EXPLORER_DRIVEN, t, 1) for t in range(1, 10))
    assert [t for t in range(1, 8) if trainer_step_syncs(SyncStyle.TRAINER_DRIVEN, t, 2)] == [2, 4, 6]
    assert not any(explorer_step_syncs(SyncStyle.TRAINER_DRIVEN, s, 1, 0) for s in range(1, 10))


@pytest.mark.parametrize("text,member", [("nccl", SyncMethod.NCCL), ("MEMORY", SyncMethod.MEMORY),
                                         ("Checkpoint", SyncMethod.CHECKPOINT)])
def test_methods_parse_by_name_or_value(text, member):
    assert SyncMethod.parse(text) is member
    assert SyncMethod.parse(member) is member


def test_unknown_style_names_the_valid_ones():
    with pytest.raises(ValueError, match="fixed, explorer_driven, trainer_driven"):
        SyncStyle.parse("round_robin")


# ------------------------------------------------------------------ config

def test_shipped_yaml_loads_as_the_defaults():
    data = load_config("synchronizer/default")
    cfg = SynchronizerConfig.from_any(data)
    assert cfg == SynchronizerConfig()
    assert cfg.method is SyncMethod.MEMORY and cfg.style is SyncStyle.FIXED
    assert set(data) == set(SynchronizerConfig().to_dict())


def test_config_from_omegaconf_and_experiment_config():
    node = OmegaConf.create({"synchronizer": {"method": "checkpoint", "checkpoint_dir": "/tmp/x",
                                              "style": "trainer_driven", "sync_interval": 4}})
    cfg = SynchronizerConfig.from_any(node)
    assert cfg.method is SyncMethod.CHECKPOINT and cfg.sync_interval == 4
    assert cfg.to_dict()["style"] == "trainer_driven"


@pytest.mark.parametrize("data,pattern", [
    ({"sync_intervall": 2}, r"unknown key synchronizer\.sync_intervall"),
    ({"sync_interval": -1}, r"sync_interval must be an integer >= 1.*use 1"),
    ({"sync_interval": 0}, r"sync_interval must be an integer >= 1"),
    ({"sync_offset": -2}, r"sync_offset must be an integer >= 0"),
    ({"sync_offset": 3, "style": "trainer_driven"}, r"sync_offset=3 only applies to style: fixed"),
    ({"sync_timeout": 0}, r"sync_timeout must be a positive, finite number"),
    ({"delivery_timeout": float("inf")}, r"delivery_timeout must be a positive, finite number.*no 'wait forever'"),
    ({"liveness_timeout": -1.0}, r"liveness_timeout must be a positive, finite number"),
    ({"method": "carrier_pigeon"}, r"unknown SyncMethod 'carrier_pigeon'"),
    ({"method": "checkpoint"}, r"checkpoint needs synchronizer\.checkpoint_dir"),
    ({"max_staleness": -1}, r"max_staleness must be null or an integer >= 0"),
    ({"staleness_mode": "halve"}, r"staleness_mode must be one of drop, downweight"),
])
def test_invalid_configs_say_what_to_change(data, pattern):
    with pytest.raises(ConfigError, match=pattern):
        SynchronizerConfig.from_any(data)


@pytest.mark.parametrize("weight_syncer", [
    {"type": "bucket"},
    lambda: BucketWeightSyncer(),
    BucketWeightSyncer,
])
def test_bucket_with_no_wait_is_rejected_when_configured(weight_syncer):
    with pytest.raises(ConfigError, match="sync_weight_no_wait: false, or use weight_syncer.type: patch"):
        Synchronizer({"sync_weight_no_wait": True}, weight_syncer)


def test_patch_with_no_wait_and_bucket_without_it_are_accepted():
    Synchronizer({"sync_weight_no_wait": True}, {"type": "patch"})
    Synchronizer({"sync_weight_no_wait": True}, PatchWeightSyncer)
    Synchronizer({"sync_weight_no_wait": False}, {"type": "bucket"})
    SynchronizerConfig(sync_weight_no_wait=True).check_weight_syncer(load_config("weight_syncer/patch_syncer"))
    with pytest.raises(ConfigError, match="got weight_syncer.type: bucket"):
        SynchronizerConfig(sync_weight_no_wait=True).check_weight_syncer(load_config("weight_syncer/bucket_syncer"))


def test_unknown_weight_syncer_key_is_rejected_when_configured():
    with pytest.raises(ConfigError, match="patch.snapshot_devic"):
        Synchronizer(None, {"type": "patch", "patch": {"snapshot_devic": "cpu"}})
