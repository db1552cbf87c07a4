"""The bottom layer of the wire: what a message is, and how ``send`` / ``recv`` look.

Everything above imports this module; it imports nothing of aiosync but :mod:`aiosync.errors`.

* ``SendFn`` / ``RecvFn`` — the two async callables a weight syncer sees (W1). A transport is
  anything that provides them (:class:`aiosync.transports.Transport`).
* :func:`message` — a class decorator that registers a dataclass as a *message type*: only
  registered dataclasses are rebuilt by a receiving process (never pickle), so a peer cannot
  make this process run code. The syncers' payloads (:mod:`aiosync.syncers.common.payloads`) and
  the explorer protocol (:mod:`aiosync.coordination.protocol`) register theirs here; register
  the messages of a custom syncer the same way.
* :func:`message_type` — resolve a registered name on the receiving side. aiosync's own
  message modules are imported on demand, so a process need not have imported them yet.
* :func:`payload_nbytes` — the bytes a payload occupies on the wire.
* :class:`Shared` — a part of many messages (one version sent to several explorers): a
  serialising transport encodes it once and sends the same bytes to every peer.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any, Awaitable, Callable, TypeVar

SendFn = Callable[[Any], Awaitable[None]]
RecvFn = Callable[[], Awaitable[Any]]

T = TypeVar("T")

_REGISTRY: dict[str, type] = {}

#: aiosync's own modules that define message types; a name from one of them is importable on
#: demand (and only from these: a peer's message never makes this process import anything else).
_OWN_MESSAGE_MODULES = ("aiosync.syncers.common.payloads", "aiosync.coordination.protocol")


def type_name(cls: type) -> str:
    """The name a message type travels under: ``module:qualname``."""
    return f"{cls.__module__}:{cls.__qualname__}"


def message(cls: type[T]) -> type[T]:
    """Register dataclass ``cls`` as a message type that may travel across processes.

    Use it as a class decorator (below ``@dataclass``). Registering the same class twice is
    harmless; a different class under a name already taken is an error.
    """
    if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
        raise TypeError(f"@message takes a dataclass type, got {cls!r}")
    name = type_name(cls)
    known = _REGISTRY.get(name)
    if known is not None and known is not cls and known.__qualname__ != cls.__qualname__:
        raise TypeError(f"message type name {name!r} is already taken by {known!r}")
    _REGISTRY[name] = cls
    return cls


#: The name earlier releases exported; the same decorator.
register_message = message


def message_type(name: str) -> type | None:
    """The registered message type called ``name``, or ``None``.

    A name from one of aiosync's own message modules is resolved even before that module was
    imported in this process (it is imported then); any other unknown name gives ``None``.
    """
    cls = _REGISTRY.get(name)
    if cls is None and isinstance(name, str):
        module = name.partition(":")[0]
        if module in _OWN_MESSAGE_MODULES:
            importlib.import_module(module)
            cls = _REGISTRY.get(name)
    return cls


def is_message(obj: Any) -> bool:
    """Whether ``obj`` is an instance of a registered message type."""
    return dataclasses.is_dataclass(obj) and not isinstance(obj, type) and \
        _REGISTRY.get(type_name(type(obj))) is type(obj)


class Shared:
    """A part of many messages: the payload of one version sent to several peers.

    A transport that serialises messages encodes :attr:`value` once, the first time it is sent,
    and sends the same bytes to every peer (:mod:`aiosync.transports.distributed.wire`; the
    Ray transport puts its large tensors into the object store once); an in-process transport
    hands the ``Shared`` itself over by reference. What differs per receiver travels beside it,
    in the message that holds it. On the receiving side it is a ``Shared`` again, holding the
    decoded value. Never modify :attr:`value` once it was sent.

    :attr:`encoded` belongs to the transports (their cached encodings, by transport and
    device): a ``Shared`` received from one process and sent on to another goes out as the bytes
    it came in as.
    """

    __slots__ = ("value", "encoded", "__weakref__")

    def __init__(self, value: Any) -> None:
        if isinstance(value, Shared):
            raise TypeError("a Shared cannot hold another Shared")
        self.value = value
        self.encoded: dict = {}

    def __repr__(self) -> str:
        return f"Shared({type(self.value).__name__})"


def unshare(obj: Any) -> Any:
    """The value of a :class:`Shared`, anything else as it is."""
    return obj.value if isinstance(obj, Shared) else obj


def payload_nbytes(obj: Any) -> int:
    """Bytes a payload occupies on the wire: tensor storage, ``bytes`` and nested containers.

    Numbers, strings and ``None`` count as the few bytes a header would use; they are small
    next to tensor data and are counted as 8 bytes each (strings by their UTF-8 length).
    """
    if hasattr(obj, "element_size") and hasattr(obj, "numel"):  # a tensor, without importing torch
        return int(obj.numel()) * int(obj.element_size())
    if isinstance(obj, (bytes, bytearray, memoryview)):
        return len(obj)
    if isinstance(obj, str):
        return len(obj.encode())
    if obj is None or isinstance(obj, (bool, int, float)):
        return 8
    if isinstance(obj, Shared):
        return payload_nbytes(obj.value)
    if isinstance(obj, dict):
        return sum(payload_nbytes(k) + payload_nbytes(v) for k, v in obj.items())
    if isinstance(obj, (list, tuple)):
        return sum(payload_nbytes(v) for v in obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return sum(payload_nbytes(getattr(obj, f.name)) for f in dataclasses.fields(obj))
    if hasattr(obj, "nbytes"):
        return int(obj.nbytes)
    return 8
