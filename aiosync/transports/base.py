"""The line between syncers and transports.

A syncer only ever sees two plain async callables: ``send(payload)`` and ``recv()``. A
transport is anything that provides them. Payloads are Python objects built from tensors,
bytes, numbers, strings and the small dataclasses in :mod:`aiosync.syncers.payloads`; an
in-process transport moves them without copying, a cross-process transport serialises them.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from typing import Any, Awaitable, Callable

import torch

SendFn = Callable[[Any], Awaitable[None]]
RecvFn = Callable[[], Awaitable[Any]]


class Transport(ABC):
    """One direction-agnostic endpoint: ``await send(payload)`` and ``await recv()``.

    Implementations must raise :class:`aiosync.errors.EndOfStream` from ``recv`` once the peer
    closed and nothing is left, :class:`aiosync.errors.ClosedResourceError` when used after
    :meth:`close`, and :class:`aiosync.errors.PeerTimeoutError` when a wait runs past its timeout.
    """

    @abstractmethod
    async def send(self, payload: Any) -> None:
        """Deliver one payload to the peer."""

    @abstractmethod
    async def recv(self) -> Any:
        """Wait for and return the next payload from the peer."""

    async def aclose(self) -> None:  # pragma: no cover - trivial default
        """Close this endpoint. The default does nothing."""


def payload_nbytes(obj: Any) -> int:
    """Bytes a payload occupies on the wire: tensor storage, ``bytes`` and nested containers.

    Numbers, strings and ``None`` count as the few bytes a header would use; they are small
    next to tensor data and are counted as 8 bytes each (strings by their UTF-8 length).
    """
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, (bytes, bytearray, memoryview)):
        return len(obj)
    if isinstance(obj, str):
        return len(obj.encode())
    if obj is None or isinstance(obj, (bool, int, float)):
        return 8
    if isinstance(obj, dict):
        return sum(payload_nbytes(k) + payload_nbytes(v) for k, v in obj.items())
    if isinstance(obj, (list, tuple)):
        return sum(payload_nbytes(v) for v in obj)
    if dataclasses.is_dataclass(obj):
        return sum(payload_nbytes(getattr(obj, f.name)) for f in dataclasses.fields(obj))
    if hasattr(obj, "nbytes"):
        return int(obj.nbytes)
    return 8
