"""Configuration of the weight syncers: the ``weight_syncer`` config group (W2-W4).

The shipped YAML files live in ``aiosync/configs/weight_syncer/``; see
:func:`aiosync.configs.load_config`. The dataclass defaults below are the one home of every
default: they equal the shipped YAML (a test holds them to it), and the syncers' constructors
take their keyword defaults from them, so ``{"type": "patch"}``,
``load_config("weight_syncer/patch_syncer")`` and ``PatchWeightSyncer()`` mean the same thing.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from .._strict import check_seconds, check_types, from_mapping
from ..errors import ConfigError

SYNCER_TYPES = ("patch", "bucket")
PATCH_ENCODINGS = ("coo", "flat", "ctx", "auto")
COMPRESSIONS = ("none", "zstd", "nvcomp_lz4", "nvcomp_zstd")
BUCKET_DTYPES = (None, "bfloat16", "float16", "float32")
COMM_KEYS = ("use_ring_sync", "nccl_max_ctas", "nccl_min_ctas")

_COMM_HINT = "communication options belong at the top of weight_syncer (next to `type`), not inside {}"


@dataclass(frozen=True)
class CommOptions:
    """Options passed to the collective transport's broadcast/send/recv calls (W4).

    They never change a payload's format. ``nccl_max_ctas`` / ``nccl_min_ctas`` map to the
    NCCL communicator's ``max_ctas`` / ``min_ctas``; ``use_ring_sync`` forces ring broadcast.
    """

    use_ring_sync: bool = False
    nccl_max_ctas: int | None = None
    nccl_min_ctas: int | None = None

    def __post_init__(self) -> None:
        check_types(self, "weight_syncer")
        for name in ("nccl_max_ctas", "nccl_min_ctas"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"weight_syncer.{name} must be null or a positive integer, got {value!r}")
        if (
            self.nccl_max_ctas is not None
            and self.nccl_min_ctas is not None
            and self.nccl_min_ctas > self.nccl_max_ctas
        ):
            raise ConfigError(
                f"nccl_min_ctas ({self.nccl_min_ctas}) must not exceed nccl_max_ctas ({self.nccl_max_ctas})"
            )

    @property
    def is_default(self) -> bool:
        return not self.use_ring_sync and self.nccl_max_ctas is None and self.nccl_min_ctas is None

    @classmethod
    def or_none(cls, use_ring_sync: bool = False, nccl_max_ctas: int | None = None,
                nccl_min_ctas: int | None = None) -> "CommOptions | None":
        """The options, or ``None`` when all are at their defaults."""
        opts = cls(use_ring_sync, nccl_max_ctas, nccl_min_ctas)
        return None if opts.is_default else opts


def _check_positive_int(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ConfigError(f"{name} must be a positive integer (bytes), got {value!r}")


def _check_device(name: str, value: Any, *, allow_none: bool) -> None:
    """A device that exists here: ``cpu``, or ``cuda``/``cuda:N`` where CUDA has that device."""
    import torch

    if value is None and allow_none:
        return
    try:
        device = torch.device(value) if isinstance(value, str) else None
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise ConfigError(f"{name} must be {'null, ' if allow_none else ''}cpu or cuda[:N], got {value!r}")
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0 or (device.index is not None and device.index >= count):
            raise ConfigError(f"{name} is {value!r} but this machine has {count} CUDA device(s)"
                              f"{' (torch.cuda.is_available() is False)' if not count else ''}; use cpu")


def _check_choice(name: str, value: Any, choices: tuple) -> None:
    if value not in choices:
        shown = ", ".join("null" if c is None else str(c) for c in choices)
        raise ConfigError(f"{name} must be one of {shown}; got {value!r}")


@dataclass
class InitSyncConfig:
    """One-time bootstrap of the receiver before patching starts (W8)."""

    enabled: bool = True
    prefixes: list[str] | None = None
    bucket_size: int = 134217728

    def __post_init__(self) -> None:
        if isinstance(self.prefixes, tuple):
            self.prefixes = list(self.prefixes)
        if self.prefixes is not None and (not isinstance(self.prefixes, list)
                                          or not all(isinstance(p, str) and p for p in self.prefixes)):
            raise ConfigError(f"init_sync.prefixes must be null or a list of non-empty strings, got {self.prefixes!r}")
        check_types(self, "weight_syncer.patch.init_sync")
        _check_positive_int("init_sync.bucket_size", self.bucket_size)
        if self.prefixes is not None and not self.enabled:
            raise ConfigError(f"init_sync.prefixes={self.prefixes} applies only when init_sync.enabled is true (a "
                              "repair bootstraps the whole state dict whatever it says); remove prefixes, or set "
                              "enabled: true")


@dataclass
class PatchConfig:
    """Options of :class:`aiosync.PatchWeightSyncer` (the ``patch:`` node)."""

    snapshot_device: str = "cpu"
    transport_device: str | None = "cpu"  # null means cpu
    delta_encoding: bool = True
    compression: str = "zstd"
    encoding: str = "flat"
    compression_level: int = 1
    recv_timeout: float = 600.0
    verify_checksums: bool = False
    init_sync: InitSyncConfig = field(default_factory=InitSyncConfig)

    def __post_init__(self) -> None:
        if isinstance(self.init_sync, dict):
            self.init_sync = from_mapping(InitSyncConfig, self.init_sync, "weight_syncer.patch.init_sync")
        _check_device("patch.snapshot_device", self.snapshot_device, allow_none=False)
        _check_device("patch.transport_device", self.transport_device, allow_none=True)
        check_types(self, "weight_syncer.patch", skip=("init_sync", "recv_timeout"))
        _check_choice("patch.compression", self.compression, COMPRESSIONS)
        _check_choice("patch.encoding", self.encoding, PATCH_ENCODINGS)
        if self.compression.startswith("nvcomp") and str(self.transport_device or "cpu").split(":")[0] != "cuda":
            raise ConfigError(
                f"patch.compression={self.compression} runs on the GPU: set patch.transport_device: cuda "
                "(or use compression: zstd on CPU)"
            )
        if not -7 <= self.compression_level <= 22:
            raise ConfigError(f"patch.compression_level must be an integer in [-7, 22], got {self.compression_level!r}")
        if self.compression_level != 1 and self.compression != "zstd":
            raise ConfigError(f"patch.compression_level={self.compression_level} applies to compression: zstd only "
                              f"(compression is {self.compression}); remove compression_level")
        check_seconds("patch.recv_timeout", self.recv_timeout)  # also a peer's Welcome: never inf


@dataclass
class BucketConfig:
    """Options of :class:`aiosync.BucketWeightSyncer` (the ``bucket:`` node)."""

    bucket_size: int = 536870912
    bucket_dtype: str | None = None
    bucket_device: str | None = None
    is_agent: bool = False
    load_instant: bool = True
    recv_timeout: float = 600.0
    verify_checksums: bool = False

    def __post_init__(self) -> None:
        _check_positive_int("bucket.bucket_size", self.bucket_size)
        _check_choice("bucket.bucket_dtype", self.bucket_dtype, BUCKET_DTYPES)
        _check_device("bucket.bucket_device", self.bucket_device, allow_none=True)
        check_types(self, "weight_syncer.bucket", skip=("recv_timeout",))
        check_seconds("bucket.recv_timeout", self.recv_timeout)  # also a peer's Welcome: never inf


@dataclass
class WeightSyncerConfig:
    """The whole ``weight_syncer`` node: type, shared communication options, per-type options."""

    type: str = "patch"
    use_ring_sync: bool = False
    nccl_max_ctas: int | None = None
    nccl_min_ctas: int | None = None
    patch: PatchConfig = field(default_factory=PatchConfig)
    bucket: BucketConfig = field(default_factory=BucketConfig)

    def __post_init__(self) -> None:
        if self.type not in SYNCER_TYPES:
            raise ConfigError(
                f"unknown weight_syncer.type {self.type!r}; valid types are: {', '.join(SYNCER_TYPES)}"
            )
        CommOptions(self.use_ring_sync, self.nccl_max_ctas, self.nccl_min_ctas)  # validates
        for sub, default in (("patch", PatchConfig), ("bucket", BucketConfig)):
            node = getattr(self, sub)
            if sub != self.type and node != default():
                changed = ", ".join(f"{f.name}={getattr(node, f.name)!r}" for f in fields(node)
                                    if getattr(node, f.name) != getattr(default(), f.name))
                raise ConfigError(f"weight_syncer.{sub} ({changed}) applies to type: {sub} only (type is {self.type}); "
                                  f"move it to weight_syncer.{self.type}, or set type: {sub}")

    @property
    def comm_options(self) -> CommOptions | None:
        return CommOptions.or_none(self.use_ring_sync, self.nccl_max_ctas, self.nccl_min_ctas)

    @classmethod
    def from_any(cls, config: Any) -> "WeightSyncerConfig":
        """Build from a mapping, an OmegaConf node or a config dataclass; unknown keys raise.

        A mapping that holds a single ``weight_syncer`` key (a whole experiment config) is
        unwrapped.
        """
        if isinstance(config, cls):
            return config
        from .._strict import to_plain

        data = to_plain(config)
        if isinstance(data, dict) and set(data) == {"weight_syncer"}:
            data = data["weight_syncer"]
        if isinstance(data, dict) and "type" in data and data["type"] not in SYNCER_TYPES:
            raise ConfigError(
                f"unknown weight_syncer.type {data['type']!r}; valid types are: {', '.join(SYNCER_TYPES)}"
            )
        if isinstance(data, dict):
            data = dict(data)
            for sub, sub_cls in (("patch", PatchConfig), ("bucket", BucketConfig)):
                if sub in data:
                    data[sub] = from_mapping(
                        sub_cls, data[sub], f"weight_syncer.{sub}",
                        hints={k: _COMM_HINT.format(sub + ":") for k in COMM_KEYS},
                    )
        return from_mapping(cls, data, "weight_syncer")
