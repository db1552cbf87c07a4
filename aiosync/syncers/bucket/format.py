"""The bucket format (W16, docs/wire-format.md "Buckets"): used by bucket mode and by the
patch bootstrap.

A bucket is a state-dict-like ``dict[str, Tensor]`` the receiver can load directly, plus
reserved metadata entries: ``__aiosync__.version`` (int64, so versions above 2**32 survive),
``__aiosync__.bucket`` (``[index, count]``), in the first bucket ``__aiosync__.manifest``
(names, shapes and dtypes of every bucket of the sync, so the receiver validates the whole
sync before it loads anything) and ``__aiosync__.shares`` (the keys whose tensors share memory on the
sender, :func:`~aiosync.syncers.common.state_dicts.shared_memory`: a receiver that shares memory
the sender does not cannot hold both), ``__aiosync__.session`` (bootstrap buckets) and, with
``verify_checksums``, ``__aiosync__.checksum`` (CRC-32 of the bucket, verified before it is
loaded). State keys may never start with ``__aiosync__.``; one that does is a clear error,
never a silent collision.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch

from ...dtypes import dtype_from_name, dtype_name
from ...errors import AiosyncError, ChecksumError, HandshakeError, PayloadError, VersionError
from ..common.integrity import bucket_checksum, decode_manifest, encode_manifest
from ..common.state_dicts import is_dtensor, materialize, shared_memory

META_PREFIX = "__aiosync__."
VERSION_KEY = META_PREFIX + "version"
BUCKET_KEY = META_PREFIX + "bucket"
MANIFEST_KEY = META_PREFIX + "manifest"
CHECKSUM_KEY = META_PREFIX + "checksum"
SESSION_KEY = META_PREFIX + "session"
SHARES_KEY = META_PREFIX + "shares"
META_KEYS = (VERSION_KEY, BUCKET_KEY, MANIFEST_KEY, CHECKSUM_KEY, SESSION_KEY, SHARES_KEY)
_INT64_MAX = 2**63 - 1


def check_no_reserved_keys(keys: Iterable[str]) -> None:
    """Raise :class:`HandshakeError` if a state key could collide with bucket metadata."""
    for k in keys:
        if k.startswith(META_PREFIX):
            raise HandshakeError(
                f"state key {k!r} uses the prefix {META_PREFIX!r} reserved for aiosync's bucket metadata; rename it"
            )


def check_version(version: Any) -> int:
    """A version is an int in [0, 2**63) (int64 end to end); anything else is a :class:`VersionError`."""
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
        esize = dtype.itemsize if (dtype is not None and t.is_floating_point()) else t.element_size()
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


def cast_for_bucket(t: torch.Tensor, dtype: torch.dtype | None, device: torch.device | str | None) -> torch.Tensor:
    """``t`` as it travels in a bucket: floating tensors cast to ``dtype`` (integer and bool
    tensors keep theirs, W16), moved to ``device``; DTensors gathered.

    The result always owns its bytes: when no conversion happened (``.to`` returned the same
    storage) it is cloned, so that a payload never aliases the sender's live tensors (an
    in-process transport hands payloads over by reference, and the receiver may read them after
    the trainer moved on).
    """
    gathered = is_dtensor(t)
    src = materialize(t)
    out = src
    if dtype is not None and out.is_floating_point() and out.dtype != dtype:
        out = out.to(dtype)
    if device is not None and out.device != torch.device(device):
        out = out.to(device)
    if not gathered and owns_no_bytes(out, src):
        out = out.clone()
    return out


def owns_no_bytes(out: torch.Tensor, src: torch.Tensor) -> bool:
    """Whether ``out`` (made from ``src``) still shares ``src``'s storage."""
    if out.device != src.device:
        return False
    try:
        return out.untyped_storage().data_ptr() == src.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # tensors without storage (meta, some subclasses)
        return out is src


def check_dtype(key: str, sent: torch.dtype, held: torch.dtype) -> None:
    """Floating tensors may arrive in another floating dtype (they are cast); integer and bool
    tensors must arrive in exactly the receiver's dtype."""
    if sent == held or (sent.is_floating_point and held.is_floating_point):
        return
    raise HandshakeError(f"received {key!r} as {dtype_name(sent)}, receiver holds {dtype_name(held)} "
                         "(only floating-point tensors may change dtype)")


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
            dt = dtype_from_name(dtype)
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
                checksum: bool = False, shares: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Add the metadata entries to one bucket (in place) and return it."""
    if shares is not None:
        tensors[SHARES_KEY] = shares
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


def encode_shares(pairs: list[list]) -> torch.Tensor:
    """:func:`~aiosync.syncers.common.state_dicts.shared_memory` pairs as they travel: UTF-8 JSON."""
    raw = json.dumps(pairs, separators=(",", ":")).encode()
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)


def decode_shares(t: Any) -> set[tuple]:
    """Invert :func:`encode_shares` into comparable tuples; anything malformed is a :class:`PayloadError`."""
    if not isinstance(t, torch.Tensor) or t.dtype != torch.uint8:
        raise PayloadError(f"bucket metadata {SHARES_KEY!r} must be a uint8 tensor of JSON")
    try:
        doc = json.loads(t.reshape(-1).cpu().numpy().tobytes().decode())
    except (UnicodeDecodeError, ValueError) as exc:
        raise PayloadError(f"bucket metadata {SHARES_KEY!r} is not valid JSON: {exc}") from None
    ok = isinstance(doc, list) and all(
        isinstance(p, list) and len(p) == 5 and isinstance(p[0], str) and isinstance(p[1], str)
        and type(p[2]) is int and all(isinstance(st, list) and all(type(x) is int for x in st) for st in p[3:])
        for p in doc)
    if not ok:
        raise PayloadError(f"bucket metadata {SHARES_KEY!r} is malformed (a list of [key, key, offset, strides, "
                           "strides])")
    return {(p[0], p[1], p[2], tuple(p[3]), tuple(p[4])) for p in doc}


def check_shared_like(target: Mapping[str, torch.Tensor], names: list[str], sender: set[tuple]) -> None:
    """The receiver shares memory between two of ``names`` only where the sender (its pairs
    ``sender``) shares it alike, or a :class:`HandshakeError` names them (nothing loaded)."""
    for a, b, offset, sa, sb in shared_memory(target, names):
        if (a, b, offset, tuple(sa), tuple(sb)) not in sender:
            raise HandshakeError(
                f"the receiver's {a!r} and {b!r} share memory (tied weights, or one views the other) but the sender "
                "keeps them apart: the receiver cannot hold the sender's values of both. Build the explorer's model "
                "as the trainer's (untie them there too), or leave one of them out of param_names")


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
    ``target`` is only read.
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
            if SHARES_KEY in payload:
                check_shared_like(self.target, [name for bucket in manifest for name, _, _ in bucket],
                                  decode_shares(payload[SHARES_KEY]))
            self.manifest = manifest
        elif MANIFEST_KEY in payload or SHARES_KEY in payload:
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
            if tuple(t.shape) != shape or dtype_name(t.dtype) != dtype:
                raise PayloadError(f"bucket {index} holds {name!r} as {tuple(t.shape)} {t.dtype}; the manifest says "
                                   f"{shape} {dtype} (truncated or malformed)")
        validate_against(self.target, tensors)
        self.count = count
        self.index += 1
        return tensors
