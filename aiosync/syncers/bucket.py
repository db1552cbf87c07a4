"""Bucket mode (W16): whole tensors, grouped into buckets of at most ``bucket_size`` bytes.

Each bucket is a state-dict-like ``dict[str, Tensor]`` that the receiver can load directly,
plus two reserved metadata entries: ``__aiosync__.version`` (int64, so versions above 2**32
survive) and ``__aiosync__.bucket`` (``[index, count]``). State keys may never start with
``__aiosync__.``; one that does is a clear error, never a silent collision.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch

from ..aio import run_sync
from ..errors import ConfigError, HandshakeError, PayloadError, VersionError
from ..transports.base import RecvFn, SendFn, payload_nbytes
from .base import WeightSyncer, recv_with_timeout
from .config import BucketConfig
from .selection import materialize, module_state_dict, select_sync_names

META_PREFIX = "__aiosync__."
VERSION_KEY = META_PREFIX + "version"
BUCKET_KEY = META_PREFIX + "bucket"
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


def validate_against(target: Mapping[str, torch.Tensor], tensors: Mapping[str, torch.Tensor]) -> None:
    """Every key must exist in ``target`` with the same shape; raise naming the first that does not."""
    for k, v in tensors.items():
        if k not in target:
            raise HandshakeError(f"received key {k!r} does not exist in the receiver's model")
        if tuple(target[k].shape) != tuple(v.shape):
            raise HandshakeError(f"received {k!r} with shape {tuple(v.shape)}, receiver has {tuple(target[k].shape)}")
        if target[k].is_floating_point() != v.is_floating_point():
            raise HandshakeError(f"received {k!r} as {v.dtype}, receiver holds {target[k].dtype}")


def load_into(target: Mapping[str, torch.Tensor], tensors: Mapping[str, torch.Tensor]) -> None:
    """Copy ``tensors`` into the live tensors of ``target`` (cast to their dtype and device)."""
    with torch.no_grad():
        for k, v in tensors.items():
            target[k].copy_(v)


class BucketWeightSyncer(WeightSyncer):
    """Whole-tensor sync in buckets (W16). Simple and robust; not atomic across buckets, so
    it cannot be applied in the background (``sync_weight_no_wait`` rejects it)."""

    supports_no_wait = False

    def __init__(self, bucket_size: int = 536870912, bucket_dtype: str | torch.dtype | None = None,
                 bucket_device: str | None = None, is_agent: bool = False, load_instant: bool = True,
                 recv_timeout: float | None = 600.0, **comm: Any) -> None:
        super().__init__(**comm)
        if isinstance(bucket_dtype, torch.dtype):
            bucket_dtype = str(bucket_dtype).removeprefix("torch.")
        self.config = BucketConfig(bucket_size=bucket_size, bucket_dtype=bucket_dtype, bucket_device=bucket_device,
                                   is_agent=is_agent, load_instant=load_instant, recv_timeout=recv_timeout)
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
                   is_agent=cfg.is_agent, load_instant=cfg.load_instant, recv_timeout=cfg.recv_timeout, **comm)

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
        sent = 0
        for i, bucket in enumerate(buckets):
            tensors = await run_sync(lambda b=bucket: {wire[k]: cast_for_bucket(t, self._dtype, self._device) for k, t in b})
            if not self._is_sender:
                continue
            payload = dict(tensors)
            payload[VERSION_KEY] = torch.tensor(version, dtype=torch.int64)
            payload[BUCKET_KEY] = torch.tensor([i, len(buckets)], dtype=torch.int64)
            await send(payload)
            sent += payload_nbytes(payload)
        if not buckets and self._is_sender:
            await send({VERSION_KEY: torch.tensor(version, dtype=torch.int64),
                        BUCKET_KEY: torch.tensor([0, 1], dtype=torch.int64)})
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
        otherwise all are held and loaded together after the last one arrived.
        """
        target = module_state_dict(model)
        t0 = time.perf_counter()
        pending: dict[str, torch.Tensor] = {}
        version = None
        index = 0
        count = None
        nbytes = 0
        while count is None or index < count:
            payload = await recv_with_timeout(recv, self.config.recv_timeout, "a weight bucket")
            if not isinstance(payload, dict) or VERSION_KEY not in payload or BUCKET_KEY not in payload:
                raise PayloadError(f"expected a bucket (a dict with {VERSION_KEY!r} and {BUCKET_KEY!r}), got {type(payload).__name__}")
            nbytes += payload_nbytes(payload)
            payload = dict(payload)
            v = int(payload.pop(VERSION_KEY).reshape(-1)[0])
            pos = payload.pop(BUCKET_KEY).reshape(-1).tolist()
            if len(pos) != 2 or pos[0] != index or (count is not None and pos[1] != count) or pos[1] < 1:
                raise PayloadError(f"bucket {pos} arrived out of order; expected index {index}" + (f" of {count}" if count else ""))
            if version is not None and v != version:
                raise PayloadError(f"bucket of version {v} arrived while receiving version {version}")
            if self.version is not None and v <= self.version:
                raise VersionError(f"received version {v}, not newer than the applied version {self.version}")
            version, count = v, pos[1]
            await run_sync(validate_against, target, payload)
            if self.config.load_instant:
                await run_sync(load_into, target, payload)
            else:
                pending.update(payload)
            index += 1
        if pending:
            await run_sync(load_into, target, pending)
        self.version = version
        self.last_stats = {"version": version, "bytes": nbytes, "buckets": count, "apply_s": time.perf_counter() - t0}
        return version
