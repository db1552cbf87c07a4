"""Bucket mode (W16): whole tensors, grouped into buckets of at most ``bucket_size`` bytes.

Each bucket is a state-dict-like ``dict[str, Tensor]`` that the receiver can load directly,
plus reserved metadata entries: ``__aiosync__.version`` (int64, so versions above 2**32
survive), ``__aiosync__.bucket`` (``[index, count]``), in the first bucket
``__aiosync__.manifest`` (names, shapes and dtypes of every bucket of the sync, so the receiver
validates the whole sync before it loads anything) and, with ``verify_checksums``,
``__aiosync__.checksum`` (CRC-32 of the bucket, verified before it is loaded). State keys may
never start with ``__aiosync__.``; one that does is a clear error, never a silent collision.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch

from ..aio import run_sync
from ..errors import AiosyncError, ChecksumError, ConfigError, HandshakeError, PayloadError, VersionError
from ..transports.base import RecvFn, SendFn, payload_nbytes
from .base import WeightSyncer, recv_with_timeout
from .config import BucketConfig
from .integrity import bucket_checksum, decode_manifest, encode_manifest
from .selection import materialize, module_state_dict, select_sync_names

META_PREFIX = "__aiosync__."
VERSION_KEY = META_PREFIX + "version"
BUCKET_KEY = META_PREFIX + "bucket"
MANIFEST_KEY = META_PREFIX + "manifest"
CHECKSUM_KEY = META_PREFIX + "checksum"
SESSION_KEY = META_PREFIX + "session"
META_KEYS = (VERSION_KEY, BUCKET_KEY, MANIFEST_KEY, CHECKSUM_KEY, SESSION_KEY)
_DTYPES = {None: None, "bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
_INT64_MAX = 2**63 - 1


def check_no_reserved_keys(keys: Iterable[str]) -> None:
    """Raise ``ValueError`` if a state key could collide with bucket metadata."""
    for k in keys:
        if k.startswith(META_PREFIX):
            raise HandshakeError(
                f"state key {k!r} uses the prefix {META_PREFIX!r} reserved for aiosync's bucket metadata; rename it"
            )


def check_version(version: Any) -> int:
    if isinstance(version, bool) or not isinstance(version, int):
        raise VersionError(f"version must be an int, got {type(version).__name__}")
    if not 0 <= version <= _INT64_MAX:
        raise VersionError(f"version must be in [0, 2**63), got {version}")
    return version


def iter_named_tensor_buckets(named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_size: int,
                              dtype: torch.dtype | None = None) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Group ``(name, tensor)`` pairs, in order, into buckets of at most ``bucket_size`` bytes.

    A tensor is never split: one larger than ``bucket_size`` travels alone. When ``dtype``
    is given, floating tensors are sized as if cast to it (their size on the wire).
    """
    if bucket_size <= 0:
        raise ValueError(f"bucket_size must be positive, got {bucket_size}")
    bucket: list[tuple[str, torch.Tensor]] = []
    used = 0
    for name, t in named_tensors:
        esize = torch.empty((), dtype=dtype).element_size() if (dtype is not None and t.is_floating_point()) else t.element_size()
        nbytes = t.numel() * esize
        if bucket and used + nbytes > bucket_size:
            yield bucket
            bucket, used = [], 0
        bucket.append((name, t))
        used += nbytes
    if bucket:
        yield bucket


def agent_key(key: str, has_visual: bool) -> str:
    """``is_agent`` naming: ``model.language_model.`` → ``model.`` when the model has visual keys."""
    if has_visual and key.startswith("model.language_model."):
        return "model." + key[len("model.language_model."):]
    return key


def cast_for_bucket(t: torch.Tensor, dtype: torch.dtype | None, device: torch.device | None) -> torch.Tensor:
    """Floating tensors are cast to ``dtype``; integer and bool tensors keep theirs (W16)."""
    t = materialize(t)
    if dtype is not None and t.is_floating_point() and t.dtype != dtype:
        t = t.to(dtype)
    if device is not None and t.device != device:
        t = t.to(device)
    return t


def _parse_dtype(name: str) -> torch.dtype | None:
    dt = getattr(torch, str(name).removeprefix("torch."), None)
    return dt if isinstance(dt, torch.dtype) else None


def check_dtype(key: str, sent: torch.dtype, held: torch.dtype) -> None:
    """Floating tensors may arrive in another floating dtype (they are cast); integer and bool
    tensors must arrive in exactly the receiver's dtype."""
    if sent == held or (sent.is_floating_point and held.is_floating_point):
        return
    raise HandshakeError(f"received {key!r} as {str(sent).removeprefix('torch.')}, receiver holds "
                         f"{str(held).removeprefix('torch.')} (only floating-point tensors may change dtype)")


def validate_against(target: Mapping[str, torch.Tensor], tensors: Mapping[str, torch.Tensor]) -> None:
    """Every key must exist in ``target`` with the same shape and a compatible dtype; raise
    naming the first that does not."""
    for k, v in tensors.items():
        if not isinstance(v, torch.Tensor):
            raise PayloadError(f"received {k!r} as a {type(v).__name__}, not a tensor")
        if k not in target:
            raise HandshakeError(f"received key {k!r} does not exist in the receiver's model")
        if tuple(target[k].shape) != tuple(v.shape):
            raise HandshakeError(f"received {k!r} with shape {tuple(v.shape)}, receiver has {tuple(target[k].shape)}")
        check_dtype(k, v.dtype, target[k].dtype)


def validate_manifest(target: Mapping[str, torch.Tensor], manifest: list) -> None:
    """Check every entry of a decoded manifest against the receiver's tensors (nothing loaded yet)."""
    for bucket in manifest:
        for name, shape, dtype in bucket:
            if name.startswith(META_PREFIX):
                raise PayloadError(f"the bucket manifest names the reserved key {name!r}")
            if name not in target:
                raise HandshakeError(f"received key {name!r} does not exist in the receiver's model")
            if tuple(target[name].shape) != shape:
                raise HandshakeError(f"received {name!r} with shape {shape}, receiver has {tuple(target[name].shape)}")
            dt = _parse_dtype(dtype)
            if dt is None:
                raise PayloadError(f"the bucket manifest gives {name!r} the unknown dtype {dtype!r}")
            check_dtype(name, dt, target[name].dtype)


def load_into(target: Mapping[str, torch.Tensor], tensors: Mapping[str, torch.Tensor]) -> None:
    """Copy ``tensors`` into the live tensors of ``target`` (cast to their dtype and device)."""
    with torch.no_grad():
        for k, v in tensors.items():
            target[k].copy_(v)


def seal_bucket(tensors: dict[str, torch.Tensor], *, index: int, count: int, version: int | None = None,
                manifest: torch.Tensor | None = None, session: int | None = None,
                checksum: bool = False) -> dict[str, torch.Tensor]:
    """Add the metadata entries to one bucket (in place) and return it."""
    if version is not None:
        tensors[VERSION_KEY] = torch.tensor(version, dtype=torch.int64)
    tensors[BUCKET_KEY] = torch.tensor([index, count], dtype=torch.int64)
    if session is not None:
        tensors[SESSION_KEY] = torch.tensor(session, dtype=torch.int64)
    if manifest is not None:
        tensors[MANIFEST_KEY] = manifest
    if checksum:
        tensors[CHECKSUM_KEY] = torch.tensor(bucket_checksum(tensors, CHECKSUM_KEY), dtype=torch.int64)
    return tensors


def bucket_manifest(buckets: list[list[tuple[str, torch.Tensor]]], names: Mapping[str, str] | None = None,
                    dtype: torch.dtype | None = None) -> torch.Tensor:
    """The manifest of ``buckets`` as they travel: wire names, shapes, wire dtypes."""
    def wire_dtype(t: torch.Tensor) -> torch.dtype:
        return dtype if dtype is not None and t.is_floating_point() else t.dtype

    return encode_manifest([[((names or {}).get(k, k), tuple(t.shape), wire_dtype(t)) for k, t in bucket]
                            for bucket in buckets])


def _ints(t: Any, key: str, n: int) -> list[int]:
    if not isinstance(t, torch.Tensor) or t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
        raise PayloadError(f"bucket metadata {key!r} must be an integer tensor")
    if t.numel() != n:
        raise PayloadError(f"bucket metadata {key!r} holds {t.numel()} values, expected {n} (truncated or malformed)")
    return [int(x) for x in t.reshape(-1).to(torch.int64).tolist()]


class BucketReader:
    """Receives the buckets of one sync (or one bootstrap) and validates each before it is loaded.

    The first bucket's manifest is checked against the whole ``target`` before anything is
    loaded; every bucket must then hold exactly what the manifest says, arrive in order,
    carry the same version (``versioned``) and session, and, when a checksum is present or
    ``require_checksum``, match it. Any violation raises a :class:`PayloadError` (a
    :class:`HandshakeError` for keys, shapes or dtypes the receiver does not have, a
    :class:`VersionError` for a version that does not advance past ``min_version``).
    """

    def __init__(self, target: Mapping[str, torch.Tensor], *, versioned: bool = True,
                 min_version: int | None = None, session: int | None = None, require_checksum: bool = False) -> None:
        self.target = target
        self.versioned = versioned
        self.min_version = min_version
        self.session = session
        self.require_checksum = require_checksum
        self.index = 0
        self.count: int | None = None
        self.version: int | None = None
        self.manifest: list | None = None

    @property
    def done(self) -> bool:
        return self.count is not None and self.index >= self.count

    def read(self, payload: Any) -> dict[str, torch.Tensor]:
        """Validate the next bucket; return its state tensors (metadata removed). Loads nothing."""
        try:
            return self._read(payload)
        except AiosyncError:
            raise
        except Exception as exc:  # garbage that slipped past the checks: still the library's error
            raise PayloadError(f"malformed bucket: {type(exc).__name__}: {exc}") from exc

    def _read(self, payload: Any) -> dict[str, torch.Tensor]:
        what = "a bucket" if self.versioned else "a bootstrap bucket"
        if not isinstance(payload, dict) or BUCKET_KEY not in payload or (self.versioned and VERSION_KEY not in payload):
            need = f"{VERSION_KEY!r} and {BUCKET_KEY!r}" if self.versioned else repr(BUCKET_KEY)
            raise PayloadError(f"expected {what} (a dict with {need}), got {type(payload).__name__}")
        for k, v in payload.items():
            if not isinstance(k, str):
                raise PayloadError(f"{what} has a non-string key {k!r}")
            if not isinstance(v, torch.Tensor):
                raise PayloadError(f"{what} entry {k!r} is a {type(v).__name__}, not a tensor")
            if k.startswith(META_PREFIX) and k not in META_KEYS:
                raise PayloadError(f"{what} has the unknown metadata entry {k!r}")
        if CHECKSUM_KEY in payload:
            (want,) = _ints(payload[CHECKSUM_KEY], CHECKSUM_KEY, 1)
            if bucket_checksum(payload, CHECKSUM_KEY) != want:
                raise ChecksumError(f"{what} does not match its checksum (corrupted in transit); nothing was loaded "
                                    "from it")
        elif self.require_checksum:
            raise PayloadError(f"{what} carries no checksum but verify_checksums is on")
        index, count = _ints(payload[BUCKET_KEY], BUCKET_KEY, 2)
        if index != self.index or count < 1 or (self.count is not None and count != self.count):
            expected = f"index {self.index}" + (f" of {self.count}" if self.count is not None else "")
            raise PayloadError(f"bucket [{index}, {count}] arrived out of order (duplicated, reordered or lost); "
                               f"expected {expected}")
        if self.session is not None:
            if SESSION_KEY not in payload or _ints(payload[SESSION_KEY], SESSION_KEY, 1)[0] != self.session:
                raise PayloadError(f"{what} belongs to another handshake (a stale or duplicated payload)")
        if self.versioned:
            (v,) = _ints(payload[VERSION_KEY], VERSION_KEY, 1)
            check_version(v)
            if self.version is not None and v != self.version:
                raise PayloadError(f"bucket of version {v} arrived while receiving version {self.version}")
            if self.min_version is not None and v <= self.min_version:
                raise VersionError(f"received version {v}, not newer than the applied version {self.min_version}")
            self.version = v
        if index == 0:
            if MANIFEST_KEY not in payload:
                raise PayloadError("the first bucket carries no manifest")
            manifest = decode_manifest(payload[MANIFEST_KEY])
            if len(manifest) != count:
                raise PayloadError(f"the manifest lists {len(manifest)} buckets, the first bucket says {count}")
            validate_manifest(self.target, manifest)
            self.manifest = manifest
        elif MANIFEST_KEY in payload:
            raise PayloadError(f"bucket {index} carries a manifest; only the first one does")
        tensors = {k: v for k, v in payload.items() if not k.startswith(META_PREFIX)}
        entries = self.manifest[index]
        if set(tensors) != {name for name, _, _ in entries} or len(tensors) != len(entries):
            extra = sorted(set(tensors) - {n for n, _, _ in entries})
            missing = sorted({n for n, _, _ in entries} - set(tensors))
            raise PayloadError(f"bucket {index} does not hold what the manifest lists (extra: {extra[:3]}, "
                               f"missing: {missing[:3]})")
        for name, shape, dtype in entries:
            t = tensors[name]
            if tuple(t.shape) != shape or str(t.dtype).removeprefix("torch.") != dtype:
                raise PayloadError(f"bucket {index} holds {name!r} as {tuple(t.shape)} {t.dtype}; the manifest says "
                                   f"{shape} {dtype} (truncated or malformed)")
        validate_against(self.target, tensors)
        self.count = count
        self.index += 1
        return tensors


class BucketWeightSyncer(WeightSyncer):
    """Whole-tensor sync in buckets (W16). Simple and robust; not atomic across buckets, so
    it cannot be applied in the background (``sync_weight_no_wait`` rejects it)."""

    supports_no_wait = False

    def __init__(self, bucket_size: int = 536870912, bucket_dtype: str | torch.dtype | None = None,
                 bucket_device: str | None = None, is_agent: bool = False, load_instant: bool = True,
                 recv_timeout: float | None = 600.0, verify_checksums: bool = False, **comm: Any) -> None:
        super().__init__(**comm)
        if isinstance(bucket_dtype, torch.dtype):
            bucket_dtype = str(bucket_dtype).removeprefix("torch.")
        self.config = BucketConfig(bucket_size=bucket_size, bucket_dtype=bucket_dtype, bucket_device=bucket_device,
                                   is_agent=is_agent, load_instant=load_instant, recv_timeout=recv_timeout,
                                   verify_checksums=verify_checksums)
        self._dtype = _DTYPES[bucket_dtype]
        self._device = torch.device(bucket_device) if bucket_device else None
        if self._device is not None and self._device.type == "cuda" and not torch.cuda.is_available():
            raise ConfigError("bucket.bucket_device is cuda but CUDA is not available; use null or cpu")
        self._names: list[str] | None = None
        self._is_sender = True
        self._last_version: int | None = None
        self.version: int | None = None

    @classmethod
    def from_config(cls, cfg: BucketConfig, **comm: Any) -> "BucketWeightSyncer":
        return cls(bucket_size=cfg.bucket_size, bucket_dtype=cfg.bucket_dtype, bucket_device=cfg.bucket_device,
                   is_agent=cfg.is_agent, load_instant=cfg.load_instant, recv_timeout=cfg.recv_timeout,
                   verify_checksums=cfg.verify_checksums, **comm)

    # ---------------------------------------------------------------- sender
    async def init_sender(self, state_dict, param_names_need_sync, send, recv=None, is_sender=True) -> None:
        names = select_sync_names(state_dict, param_names_need_sync)
        if self.config.is_agent:
            names = [k for k in names if not k.endswith("_extra_state")]
        check_no_reserved_keys(names)
        self._names = names
        self._is_sender = is_sender

    def _wire_names(self, names: list[str]) -> list[str]:
        if not self.config.is_agent:
            return names
        has_visual = any("visual" in k for k in names)
        return [agent_key(k, has_visual) for k in names]

    async def sync(self, state_dict: Mapping[str, torch.Tensor], send: SendFn, version: int) -> None:
        if self._names is None:
            raise RuntimeError("call init_sender before sync")
        version = check_version(version)
        if self._last_version is not None and version <= self._last_version:
            raise VersionError(f"version {version} is not greater than the last synced version {self._last_version}")
        t0 = time.perf_counter()
        names = self._names
        missing = [k for k in names if k not in state_dict]
        if missing:
            raise HandshakeError(f"state dict passed to sync lacks synced key {missing[0]!r}")
        wire = dict(zip(names, self._wire_names(names)))
        buckets = list(iter_named_tensor_buckets(((k, state_dict[k]) for k in names), self.config.bucket_size, self._dtype))
        manifest = bucket_manifest(buckets or [[]], wire, self._dtype)
        checksum = self.config.verify_checksums
        sent = 0
        for i, bucket in enumerate(buckets):
            def build(b=bucket, i=i):
                tensors = {wire[k]: cast_for_bucket(t, self._dtype, self._device) for k, t in b}
                if not self._is_sender:  # other FSDP ranks only take part in the gathers
                    return None
                return seal_bucket(tensors, index=i, count=len(buckets), version=version,
                                   manifest=manifest if i == 0 else None, checksum=checksum)

            payload = await run_sync(build)
            if payload is None:
                continue
            await send(payload)
            sent += payload_nbytes(payload)
        if not buckets and self._is_sender:
            await send(seal_bucket({}, index=0, count=1, version=version, manifest=manifest, checksum=checksum))
        self._last_version = version
        self.last_stats = {"version": version, "bytes": sent, "buckets": len(buckets),
                           "elements": sum(state_dict[k].numel() for k in names),
                           "sync_s": time.perf_counter() - t0}

    # -------------------------------------------------------------- receiver
    async def init_receiver(self, state_dict, recv, send=None) -> None:
        check_no_reserved_keys(state_dict.keys())

    async def apply(self, model, recv: RecvFn) -> int:
        """Receive every bucket of one version and load it; return that version.

        With ``load_instant`` each bucket is loaded on arrival (at most one bucket held);
        otherwise all are held and loaded together after the last one arrived. Either way the
        first bucket's manifest is validated against the whole model before anything is
        loaded, and each bucket is validated (and its checksum verified) before it is loaded.
        A stream that breaks off after some buckets were loaded leaves them loaded (the
        :class:`aiosync.PolicySlot` backup restores them when applied through a synchronizer).
        """
        target = module_state_dict(model)
        t0 = time.perf_counter()
        reader = BucketReader(target, min_version=self.version, require_checksum=self.config.verify_checksums)
        pending: dict[str, torch.Tensor] = {}
        nbytes = 0
        while not reader.done:
            payload = await recv_with_timeout(recv, self.config.recv_timeout, "a weight bucket")
            tensors = await run_sync(reader.read, payload)  # validates; loads nothing
            nbytes += payload_nbytes(tensors)
            if self.config.load_instant:
                await run_sync(self._load, target, tensors)
            else:
                pending.update(tensors)
        if pending:
            await run_sync(self._load, target, pending)
        version = reader.version
        self.version = version
        self.last_stats = {"version": version, "bytes": nbytes, "buckets": reader.count,
                           "apply_s": time.perf_counter() - t0}
        return version

    def _load(self, target: Mapping[str, torch.Tensor], tensors: Mapping[str, torch.Tensor]) -> None:
        """Copy validated tensors into the model (a worker thread); fault-injection tests override it."""
        load_into(target, tensors)
