"""Every config key means what it says (issue 33 item 4, SPEC T5): a table over every key of
``synchronizer`` and ``weight_syncer`` — a value of the wrong type, a value out of range, and a
key set where it does not apply (another type, method, style or mode) — each refused with a
:class:`ConfigError` naming the key. The table must list every key: a new key without its row
fails :func:`test_the_table_covers_every_config_key`."""

from __future__ import annotations

import dataclasses

import pytest

from aiosync.coordination import Synchronizer
from aiosync.coordination.config import SynchronizerConfig
from aiosync.errors import ConfigError
from aiosync.syncers.config import BucketConfig, InitSyncConfig, PatchConfig, WeightSyncerConfig

# key -> (wrong type, out of range or None, wrong mode: a config dict, or None when the key applies always)
SYNCHRONIZER = {
    "method": (3, "carrier_pigeon", None),
    "style": (True, "whenever", None),
    "sync_interval": ("2", 0, None),
    "sync_offset": (1.5, -1, {"sync_offset": 2, "style": "trainer_driven"}),
    "sync_timeout": ("60", 0, None),
    "sync_weight_no_wait": (1, None, "bucket"),  # with a bucket weight_syncer (checked by the Synchronizer)
    "max_staleness": (1.5, -1, None),
    "staleness_mode": (1, "halve", {"staleness_mode": "downweight"}),  # without max_staleness
    "staleness_decay": (True, 1.5, {"staleness_decay": 0.9, "max_staleness": 2}),  # mode drop
    "max_ahead": (1.5, -1, None),
    "delivery_timeout": ("x", float("inf"), None),
    "checkpoint_dir": (True, "", {"checkpoint_dir": "/tmp/x", "method": "memory"}),
    "checkpoint_writers": (2.0, 0, {"checkpoint_writers": 2, "method": "nccl"}),
    "liveness_timeout": (True, -1, None),
    "verify_state": ("16", -1, None),
}
WEIGHT_SYNCER = {
    "type": (1, "patches", None),
    "use_ring_sync": ("yes", None, {"type": "patch", "patch": {"use_ring_sync": True}}),
    "nccl_max_ctas": (1.5, 0, {"type": "bucket", "bucket": {"nccl_max_ctas": 4}}),
    "nccl_min_ctas": (True, -1, {"type": "patch", "patch": {"nccl_min_ctas": 1}}),
    "patch": ("fast", None, {"type": "bucket", "patch": {"verify_checksums": True}}),
    "bucket": ([1], None, {"type": "patch", "bucket": {"bucket_size": 1024}}),
}
# patch / bucket keys: (wrong type, out of range or None, a valid value other than the default)
PATCH = {
    "snapshot_device": (0, "cuda:99", "cpu:0"),
    "transport_device": (1, "tpu", None),
    "delta_encoding": ("yes", None, False),
    "compression": (1, "gzip", "none"),
    "encoding": (1, "csr", "coo"),
    "compression_level": (True, 99, 5),
    "recv_timeout": ("1", 0, 5.0),
    "verify_checksums": (1, None, True),
    "init_sync": ("yes", None, {"bucket_size": 1024}),
}
INIT_SYNC = {
    "enabled": ("true", None, False),
    "prefixes": ("model", [""], ["model"]),
    "bucket_size": (1.5, 0, 1024),
}
BUCKET = {
    "bucket_size": ("1", 0, 1024),
    "bucket_dtype": (16, "int8", "float16"),
    "bucket_device": (0, "cuda:99", "cpu"),
    "is_agent": (1, None, True),
    "load_instant": (1, None, False),
    "recv_timeout": (None, -1, 5.0),
    "verify_checksums": ("no", None, True),
}
#: Mode rows of their own: a key whose applicability depends on another key of its node.
MODE_ROWS = [
    ({"type": "patch", "patch": {"compression": "none", "compression_level": 5}}, "compression_level"),
    ({"type": "patch", "patch": {"init_sync": {"enabled": False, "prefixes": ["model"]}}}, "prefixes"),
    ({"type": "patch", "patch": {"snapshot_device": "cuda"}} if not __import__("torch").cuda.is_available()
     else {"type": "patch", "patch": {"snapshot_device": "cuda:99"}}, "snapshot_device"),
]


def _weight_syncer(data):
    return WeightSyncerConfig.from_any(data)


def _cases():
    for key, (wrong, out, mode) in SYNCHRONIZER.items():
        base = {"method": "checkpoint", "checkpoint_dir": "/tmp/x"} if key == "checkpoint_dir" else {}
        yield f"synchronizer.{key}-type", SynchronizerConfig.from_any, base | {key: wrong}, key
        if out is not None:
            yield f"synchronizer.{key}-range", SynchronizerConfig.from_any, base | {key: out}, key
        if isinstance(mode, dict):
            yield f"synchronizer.{key}-mode", SynchronizerConfig.from_any, mode, key
    for key, (wrong, out, mode) in WEIGHT_SYNCER.items():
        yield f"weight_syncer.{key}-type", _weight_syncer, {"type": "patch", key: wrong} if key != "type" \
            else {"type": wrong}, key
        if out is not None:
            yield f"weight_syncer.{key}-range", _weight_syncer, {"type": "patch", key: out} if key != "type" \
                else {"type": out}, key
        if mode is not None:
            yield f"weight_syncer.{key}-mode", _weight_syncer, mode, key
    for sub, table, other in (("patch", PATCH, "bucket"), ("bucket", BUCKET, "patch")):
        for key, (wrong, out, valid) in table.items():
            yield f"{sub}.{key}-type", _weight_syncer, {"type": sub, sub: {key: wrong}}, key
            if out is not None:
                yield f"{sub}.{key}-range", _weight_syncer, {"type": sub, sub: {key: out}}, key
            yield f"{sub}.{key}-mode", _weight_syncer, {"type": other, sub: {key: valid}}, key  # the other type
    for key, (wrong, out, valid) in INIT_SYNC.items():
        node = lambda v, typ="patch": {"type": typ, "patch": {"init_sync": v}}  # noqa: E731
        yield f"init_sync.{key}-type", _weight_syncer, node({key: wrong}), key
        if out is not None:
            yield f"init_sync.{key}-range", _weight_syncer, node({key: out}), key
        yield f"init_sync.{key}-mode", _weight_syncer, node({key: valid}, "bucket"), key
    for data, key in MODE_ROWS:
        yield f"{key}-mode-row", _weight_syncer, data, key


CASES = list(_cases())


@pytest.mark.parametrize("build, data, key", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_a_bad_value_or_a_key_that_does_not_apply_is_refused_naming_the_key(build, data, key):
    with pytest.raises(ConfigError, match=key):
        build(data)


def test_sync_weight_no_wait_with_bucket_is_refused():
    with pytest.raises(ConfigError, match="sync_weight_no_wait"):
        Synchronizer({"sync_weight_no_wait": True}, {"type": "bucket"})


def test_types_are_named_in_the_message():
    with pytest.raises(ConfigError, match=r"synchronizer\.staleness_decay must be a number, got True \(bool\)"):
        SynchronizerConfig.from_any({"staleness_decay": True, "staleness_mode": "downweight", "max_staleness": 1})
    with pytest.raises(ConfigError, match=r"checkpoint_dir must be a string or null, got \['a'\]"):
        SynchronizerConfig.from_any({"method": "checkpoint", "checkpoint_dir": ["a"]})
    with pytest.raises(ConfigError, match=r"compression_level must be an integer, got True"):
        _weight_syncer({"type": "patch", "patch": {"compression_level": True}})


def test_valid_values_of_the_table_are_accepted():
    """The rows test refusals, not a config that refuses everything: their valid values pass."""
    for key, (_, _, valid) in PATCH.items():
        _weight_syncer({"type": "patch", "patch": {key: valid} | (
            {"compression": "zstd"} if key == "compression_level" else {})})
    for key, (_, _, valid) in BUCKET.items():
        _weight_syncer({"type": "bucket", "bucket": {key: valid}})
    SynchronizerConfig.from_any({"staleness_decay": 0.9, "staleness_mode": "downweight", "max_staleness": 2})
    import pathlib

    assert SynchronizerConfig.from_any({"method": "checkpoint",
                                        "checkpoint_dir": pathlib.Path("/tmp/x")}).checkpoint_dir == "/tmp/x"


def test_the_table_covers_every_config_key():
    names = lambda cls: {f.name for f in dataclasses.fields(cls)}  # noqa: E731
    assert set(SYNCHRONIZER) == names(SynchronizerConfig)
    assert set(WEIGHT_SYNCER) == names(WeightSyncerConfig)
    assert set(PATCH) == names(PatchConfig) and set(BUCKET) == names(BucketConfig)
    assert set(INIT_SYNC) == names(InitSyncConfig)
