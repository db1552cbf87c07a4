"""The syncer registry and factory (W2): ``WeightSyncer.create``, ``create_syncer``,
``syncer_factory`` / ``SyncerFactory``, ``fan_out_mode``; and the syncers' layering: no import
cycle, nothing of transports or coordination, ``is_dtensor`` without importing DTensor."""

from __future__ import annotations

import ast
import dataclasses
import pathlib
import subprocess
import sys

import pytest
import torch

import aiosync.syncers as syncers_pkg
from aiosync.errors import ConfigError
from aiosync.syncers import (BucketWeightSyncer, PatchWeightSyncer, SyncerFactory, WeightSyncer, WeightSyncerConfig,
                             create_syncer, syncer_factory)

SYNCERS_DIR = pathlib.Path(syncers_pkg.__file__).parent


# ------------------------------------------------------------------ registry

def test_create_looks_implementations_up_by_type():
    assert WeightSyncer.implementation("patch") is PatchWeightSyncer
    assert WeightSyncer.implementation("bucket") is BucketWeightSyncer
    assert type(WeightSyncer.create({"type": "patch"})) is PatchWeightSyncer
    assert type(create_syncer({"type": "bucket"})) is BucketWeightSyncer
    with pytest.raises(ConfigError, match="patch, bucket|bucket, patch"):
        WeightSyncer.implementation("zip")


def test_a_subclass_without_type_name_does_not_replace_the_registered_one():
    class Custom(PatchWeightSyncer):
        pass

    assert WeightSyncer.implementation("patch") is PatchWeightSyncer
    assert type(WeightSyncer.create({"type": "patch"})) is PatchWeightSyncer


def test_fan_out_mode_is_a_class_attribute():
    assert PatchWeightSyncer.fan_out_mode == "chain"
    assert BucketWeightSyncer.fan_out_mode == "latest"
    assert WeightSyncer.fan_out_mode is None
    assert PatchWeightSyncer.supports_staging and BucketWeightSyncer.supports_staging


def test_base_is_importable_alone_and_create_works_without_importing_implementations_itself():
    """base.py never imports patch.py or bucket.py (no cycle); the package registers them."""
    tree = ast.parse((SYNCERS_DIR / "base.py").read_text())
    imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
    assert not imported & {"patch", "bucket", "factory"}, imported
    code = ("from aiosync.syncers.base import WeightSyncer; "
            "s = WeightSyncer.create({'type': 'patch'}); b = WeightSyncer.create({'type': 'bucket'}); "
            "print(type(s).__name__, type(b).__name__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["PatchWeightSyncer", "BucketWeightSyncer"]


def test_syncers_import_only_the_bottom_layer_and_themselves():
    allowed_parents = {"errors", "messages", "dtypes", "aio", "_strict", "pieces"}
    for path in sorted(SYNCERS_DIR.glob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                mod = node.module or ""
                if node.level == 2:
                    assert mod.split(".")[0] in allowed_parents, (path.name, mod)
                assert not mod.startswith("aiosync.") or mod.split(".")[1] in allowed_parents | {"syncers"}, \
                    (path.name, mod)
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    assert not alias.name.startswith(("aiosync.transports", "aiosync.coordination")), path.name


def test_no_package_file_is_over_600_lines():
    for path in SYNCERS_DIR.glob("*.py"):
        assert len(path.read_text().splitlines()) <= 600, path.name


# ------------------------------------------------------------------ syncer_factory

def test_factory_from_a_patch_config_bootstraps_the_whole_state_on_repair():
    f = syncer_factory({"type": "patch", "patch": {"init_sync": {"enabled": False}}})
    assert isinstance(f, SyncerFactory) and f.supports_no_wait and f.bootstrap_unless_declared
    plain, repair = f.make(False), f.make(True)
    assert type(plain) is type(repair) is PatchWeightSyncer
    assert plain.config.init_sync.enabled is False
    assert repair.config.init_sync.enabled is True and repair.config.init_sync.prefixes is None
    prefixed = syncer_factory({"type": "patch", "patch": {"init_sync": {"prefixes": ["w"]}}})
    assert not prefixed.bootstrap_unless_declared
    assert prefixed.make(False).config.init_sync.prefixes == ["w"]
    assert prefixed.make(True).config.init_sync.prefixes is None


def test_factory_from_a_bucket_config_and_to_dict_round_trips():
    f = syncer_factory({"type": "bucket", "bucket": {"bucket_size": 1024}})
    assert not f.supports_no_wait and not f.bootstrap_unless_declared
    assert type(f.make(True)) is BucketWeightSyncer and f.make(False).config.bucket_size == 1024
    plain = f.to_dict()
    assert isinstance(plain, dict) and plain["bucket"]["bucket_size"] == 1024
    assert WeightSyncerConfig.from_any(plain) == f.config
    assert syncer_factory(WeightSyncerConfig(type="patch")).config == WeightSyncerConfig(type="patch")


def test_factory_from_a_callable():
    made = []

    def make():
        s = PatchWeightSyncer(init_sync_enabled=False)
        made.append(s)
        return s

    f = syncer_factory(make)
    assert len(made) == 1  # probed once
    assert f.config is None and f.to_dict() is None and f.supports_no_wait and not f.bootstrap_unless_declared
    assert f.make(False).config.init_sync.enabled is False
    repair = f.make(True)
    assert repair.config.init_sync.enabled is True and repair.config.init_sync.prefixes is None
    assert not syncer_factory(BucketWeightSyncer).supports_no_wait


@pytest.mark.parametrize("bad", [lambda: 3, lambda: {"type": "patch"}])
def test_factory_probe_refuses_a_callable_returning_something_else(bad):
    with pytest.raises(ConfigError, match="not a WeightSyncer"):
        syncer_factory(bad)


def test_factory_refuses_a_syncer_instance_and_bad_configs():
    with pytest.raises(ConfigError, match="instance"):
        syncer_factory(PatchWeightSyncer())
    with pytest.raises(ConfigError, match="valid types"):
        syncer_factory({"type": "zip"})
    with pytest.raises(ConfigError, match="encodng"):
        syncer_factory({"type": "patch", "patch": {"encodng": "flat"}})
    assert dataclasses.is_dataclass(SyncerFactory) and SyncerFactory.__dataclass_params__.frozen


# ------------------------------------------------------------------ is_dtensor

def test_is_dtensor_does_not_import_torch_distributed_tensor():
    """Importing torch.distributed.tensor on the event-loop thread stalled the loop: while it
    has not been imported, no tensor can be a DTensor and is_dtensor imports nothing."""
    code = """
import sys
import torch
from aiosync.syncers.common.state_dicts import alias_groups, is_dtensor, materialize
sys.modules.pop("torch.distributed.tensor", None)
t = torch.zeros(3)
assert is_dtensor(t) is False
materialize(t)
alias_groups({"a": t, "b": t})
assert "torch.distributed.tensor" not in sys.modules, "is_dtensor imported torch.distributed.tensor"
import torch.distributed.tensor  # once it is imported, DTensors are recognised
assert is_dtensor(t) is False
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


@pytest.mark.skipif(not torch.distributed.is_available(), reason="needs torch.distributed")
def test_is_dtensor_recognises_a_dtensor_once_imported():
    from aiosync.syncers.common.state_dicts import is_dtensor

    tensor_mod = pytest.importorskip("torch.distributed.tensor")
    assert tensor_mod.DTensor is not None and is_dtensor(torch.zeros(1)) is False
