"""The weight_syncer config group: factory (W2), shipped YAMLs (W3), comm options (W4)."""

from __future__ import annotations

import asyncio
import dataclasses
import inspect

import pytest
import torch
from omegaconf import OmegaConf

from aiosync.configs import CONFIG_DIR, config_path, load_config
from aiosync.syncers import BucketWeightSyncer, PatchWeightSyncer, WeightSyncer, WeightSyncerConfig
from aiosync.transports.inproc import inproc_pair
from aiosync.errors import ConfigError
from aiosync.syncers.config import BucketConfig, CommOptions, InitSyncConfig, PatchConfig

PATCH = {
    "type": "patch",
    "patch": {
        "snapshot_device": "cpu",
        "encoding": "flat",
        "delta_encoding": False,
        "compression": "zstd",
        "compression_level": 5,
        "recv_timeout": 12.5,
        "init_sync": {"enabled": True, "prefixes": ["model.layers"], "bucket_size": 4096},
    },
}
BUCKET = {
    "type": "bucket",
    "bucket": {"bucket_size": 1024, "bucket_dtype": "bfloat16", "bucket_device": "cpu", "is_agent": True,
               "load_instant": False, "recv_timeout": 7.0},
}


def _check_patch(s):
    assert type(s) is PatchWeightSyncer
    c = s.config
    assert (c.snapshot_device, c.encoding, c.delta_encoding, c.compression, c.compression_level, c.recv_timeout) == \
        ("cpu", "flat", False, "zstd", 5, 12.5)
    assert (c.init_sync.enabled, c.init_sync.prefixes, c.init_sync.bucket_size) == (True, ["model.layers"], 4096)
    assert s.comm_options is None


def _check_bucket(s):
    assert type(s) is BucketWeightSyncer
    c = s.config
    assert (c.bucket_size, c.bucket_dtype, c.bucket_device, c.is_agent, c.load_instant, c.recv_timeout) == \
        (1024, "bfloat16", "cpu", True, False, 7.0)
    assert s.comm_options is None


@pytest.mark.parametrize("kind", ["dict", "omegaconf", "dataclass", "wrapped"])
def test_create_patch(kind):
    if kind == "dict":
        cfg = PATCH
    elif kind == "omegaconf":
        cfg = OmegaConf.create(PATCH)
    elif kind == "dataclass":
        p = PATCH["patch"]
        cfg = WeightSyncerConfig(type="patch", patch=PatchConfig(
            snapshot_device="cpu", encoding="flat", delta_encoding=False, compression="zstd", compression_level=5,
            recv_timeout=12.5, init_sync=InitSyncConfig(**p["init_sync"])))
    else:  # a whole experiment config holding only weight_syncer
        cfg = OmegaConf.create({"weight_syncer": PATCH})
    _check_patch(WeightSyncer.create(cfg))


@pytest.mark.parametrize("kind", ["dict", "omegaconf", "dataclass", "wrapped"])
def test_create_bucket(kind):
    if kind == "dict":
        cfg = BUCKET
    elif kind == "omegaconf":
        cfg = OmegaConf.create(BUCKET)
    elif kind == "dataclass":
        cfg = WeightSyncerConfig(type="bucket", bucket=BucketConfig(**BUCKET["bucket"]))
    else:
        cfg = {"weight_syncer": BUCKET}
    _check_bucket(WeightSyncer.create(cfg))


def test_create_defaults():
    s = WeightSyncer.create({"type": "patch"})
    assert type(s) is PatchWeightSyncer and s.config == PatchConfig()
    b = WeightSyncer.create({"type": "bucket"})
    assert type(b) is BucketWeightSyncer and b.config == BucketConfig()


@pytest.mark.parametrize("name, cls", [("weight_syncer/patch_syncer", PatchWeightSyncer),
                                       ("weight_syncer/bucket_syncer", BucketWeightSyncer)])
def test_shipped_yaml_loads_and_creates(name, cls):
    data = load_config(name)
    assert isinstance(data, dict)
    assert data["type"] == ("patch" if cls is PatchWeightSyncer else "bucket")
    for key in ("use_ring_sync", "nccl_max_ctas", "nccl_min_ctas"):
        assert key in data  # comm options live at the top of weight_syncer
    s = WeightSyncer.create(data)
    assert type(s) is cls
    assert s.comm_options is None
    sub = data[data["type"]]
    for key, value in sub.items():
        if key == "init_sync":
            assert value == {"enabled": s.config.init_sync.enabled, "prefixes": s.config.init_sync.prefixes,
                             "bucket_size": s.config.init_sync.bucket_size}
        else:
            assert getattr(s.config, key) == value, key
    # the same file through OmegaConf directly (as a Hydra config group node would be)
    node = OmegaConf.load(config_path(name))
    assert type(WeightSyncer.create(node)) is cls
    assert config_path(name).parent == CONFIG_DIR / "weight_syncer"


@pytest.mark.parametrize("name, typ", [("weight_syncer/patch_syncer", "patch"), ("weight_syncer/bucket_syncer", "bucket")])
def test_shipped_yaml_equals_the_dataclass_defaults(name, typ):
    """One home for the defaults: the shipped file, the config dataclasses and the syncers'
    keyword defaults agree, so ``{"type": ...}`` and the shipped file mean the same thing."""
    data = load_config(name)
    node_cls = PatchConfig if typ == "patch" else BucketConfig
    # the file names every option of its node, each at the dataclass default
    assert set(data[typ]) == {f.name for f in dataclasses.fields(node_cls)}
    assert data[typ] == dataclasses.asdict(node_cls())
    assert {k: v for k, v in data.items() if k not in ("patch", "bucket")} == \
        {k: v for k, v in dataclasses.asdict(WeightSyncerConfig(type=typ)).items() if k not in ("patch", "bucket")}
    assert WeightSyncerConfig.from_any(data) == WeightSyncerConfig(type=typ)
    from_file, from_type = WeightSyncer.create(data), WeightSyncer.create({"type": typ})
    plain = PatchWeightSyncer() if typ == "patch" else BucketWeightSyncer()
    assert from_file.config == from_type.config == plain.config == node_cls()


def test_constructor_keyword_defaults_are_the_dataclass_defaults():
    for cls, node in ((PatchWeightSyncer, PatchConfig()), (BucketWeightSyncer, BucketConfig())):
        flat = dataclasses.asdict(node)
        init = flat.pop("init_sync", None)
        if init is not None:
            flat.update({f"init_sync_{k}": v for k, v in init.items()})
        for name, param in inspect.signature(cls.__init__).parameters.items():
            if name in flat:
                assert param.default == flat.pop(name), (cls.__name__, name)
        assert not flat, (cls.__name__, flat)  # every option is a keyword of the constructor


def test_shipped_patch_yaml_is_the_compact_recommended_config():
    data = load_config("weight_syncer/patch_syncer.yaml")
    assert data["patch"]["encoding"] == "flat"  # ctx sends fewer bytes but costs more CPU: for slow links
    assert data["patch"]["compression"] == "zstd"
    assert data["patch"]["init_sync"]["enabled"] is True
    assert data["patch"]["init_sync"]["prefixes"] is None


async def test_shipped_patch_config_round_trip():
    cfg = load_config("weight_syncer/patch_syncer")
    s, r = WeightSyncer.create(cfg), WeightSyncer.create(cfg)
    src = {"w": torch.randn(6, 7), "b": torch.randn(7), "n": torch.tensor(3)}
    dst = {"w": torch.zeros(6, 7, dtype=torch.bfloat16), "b": torch.zeros(7, dtype=torch.bfloat16),
           "n": torch.tensor(0)}
    a, b = inproc_pair(timeout=10)
    await asyncio.gather(s.init_sender(src, None, a.send, a.recv), r.init_receiver(dst, b.recv, b.send))
    src["w"][2, 3] += 1.0
    src["n"] += 1
    await s.sync(src, a.send, 1)
    assert await r.apply(dst, b.recv) == 1
    for k in src:
        want = src[k].to(dst[k].dtype)
        assert torch.equal(want.view(torch.int16) if want.dtype == torch.bfloat16 else want,
                           dst[k].view(torch.int16) if dst[k].dtype == torch.bfloat16 else dst[k]), k


def test_load_config_unknown_name_lists_options():
    with pytest.raises(FileNotFoundError, match="weight_syncer/patch_syncer"):
        load_config("weight_syncer/nope")


# ---------------------------------------------------------------------- comm options (W4)
@pytest.mark.parametrize("typ", ["patch", "bucket"])
def test_comm_options_none_by_default(typ):
    assert WeightSyncer.create({"type": typ}).comm_options is None
    assert WeightSyncer.create({"type": typ, "use_ring_sync": False, "nccl_max_ctas": None,
                                "nccl_min_ctas": None}).comm_options is None


@pytest.mark.parametrize("typ", ["patch", "bucket"])
def test_comm_options_set(typ):
    s = WeightSyncer.create({"type": typ, "use_ring_sync": True, "nccl_max_ctas": 16, "nccl_min_ctas": 4})
    opts = s.comm_options
    assert opts is not None
    assert (opts.use_ring_sync, opts.nccl_max_ctas, opts.nccl_min_ctas) == (True, 16, 4)
    only_one = WeightSyncer.create(OmegaConf.create({"type": typ, "nccl_min_ctas": 2})).comm_options
    assert only_one is not None and only_one.nccl_min_ctas == 2 and only_one.use_ring_sync is False
    assert only_one.nccl_max_ctas is None


def test_comm_options_on_constructors():
    assert PatchWeightSyncer().comm_options is None
    assert BucketWeightSyncer(bucket_size=64).comm_options is None
    assert PatchWeightSyncer(use_ring_sync=True).comm_options == CommOptions(True, None, None)
    assert BucketWeightSyncer(bucket_size=64, nccl_max_ctas=8).comm_options == CommOptions(False, 8, None)


@pytest.mark.parametrize("bad", [{"nccl_max_ctas": 2, "nccl_min_ctas": 4}, {"nccl_max_ctas": 0},
                                 {"nccl_min_ctas": -1}, {"use_ring_sync": "yes"}, {"nccl_max_ctas": 1.5}])
def test_comm_options_invalid_values(bad):
    with pytest.raises(ConfigError):
        WeightSyncer.create({"type": "patch", **bad})


@pytest.mark.parametrize("sub", ["patch", "bucket"])
@pytest.mark.parametrize("key, value", [("use_ring_sync", True), ("nccl_max_ctas", 8), ("nccl_min_ctas", 1)])
def test_comm_options_inside_subnode_raise_saying_where_they_belong(sub, key, value):
    cfg = {"type": sub, sub: {key: value}}
    with pytest.raises(ConfigError) as info:
        WeightSyncer.create(cfg)
    msg = str(info.value)
    assert key in msg
    assert "top of weight_syncer" in msg
    with pytest.raises(ConfigError, match="top of weight_syncer"):
        WeightSyncer.create(OmegaConf.create(cfg))
    # also when the misplaced option sits in the node of the type not selected
    other = "bucket" if sub == "patch" else "patch"
    with pytest.raises(ConfigError, match="top of weight_syncer"):
        WeightSyncer.create({"type": other, sub: {key: value}})


# ---------------------------------------------------------------------- bad configs (W2)
@pytest.mark.parametrize("typ", ["patches", "Patch", "nccl", ""])
def test_unknown_type_names_valid_types(typ):
    with pytest.raises(ValueError) as info:
        WeightSyncer.create({"type": typ})
    msg = str(info.value)
    assert "patch" in msg and "bucket" in msg
    assert repr(typ) in msg
    with pytest.raises(ValueError, match="bucket"):
        WeightSyncer.create(OmegaConf.create({"type": typ}))


@pytest.mark.parametrize("cfg, key", [
    ({"type": "patch", "patch": {"snapshot_devcie": "cpu"}}, "snapshot_devcie"),
    ({"type": "patch", "patch": {"init_sync": {"enabeld": True}}}, "enabeld"),
    ({"type": "bucket", "bucket": {"bucket_sise": 10}}, "bucket_sise"),
    ({"type": "patch", "use_ring_snyc": True}, "use_ring_snyc"),
    ({"type": "patch", "patchh": {}}, "patchh"),
])
def test_unknown_key_is_rejected_naming_it(cfg, key):
    with pytest.raises(ConfigError, match=key):
        WeightSyncer.create(cfg)
    with pytest.raises(ValueError, match=key):
        WeightSyncer.create(OmegaConf.create(cfg))


@pytest.mark.parametrize("cfg, word", [
    ({"type": "patch", "patch": {"compression": "gzip"}}, "compression"),
    ({"type": "patch", "patch": {"encoding": "csr"}}, "encoding"),
    ({"type": "patch", "patch": {"snapshot_device": "tpu"}}, "snapshot_device"),
    ({"type": "patch", "patch": {"delta_encoding": "yes"}}, "delta_encoding"),
    ({"type": "patch", "patch": {"init_sync": {"prefixes": "model"}}}, "prefixes"),
    ({"type": "patch", "patch": {"init_sync": {"bucket_size": 0}}}, "bucket_size"),
    ({"type": "bucket", "bucket": {"bucket_dtype": "int8"}}, "bucket_dtype"),
    ({"type": "bucket", "bucket": {"bucket_size": -1}}, "bucket_size"),
    ({"type": "bucket", "bucket": {"load_instant": 1}}, "load_instant"),
])
def test_invalid_values_raise_config_error(cfg, word):
    with pytest.raises(ConfigError, match=word):
        WeightSyncer.create(cfg)


def test_hydra_compose_optional():
    pytest.importorskip("hydra")
    from hydra import compose, initialize_config_module

    with initialize_config_module(config_module="aiosync.configs", version_base=None):
        cfg = compose(config_name="weight_syncer/patch_syncer")
    node = cfg.get("weight_syncer", cfg)
    assert type(WeightSyncer.create(node)) is PatchWeightSyncer
