"""What the trainer's :class:`~aiosync.engines.vllm_server.VLLMServer` and aiosync's side of a
``vllm serve`` process (:mod:`aiosync.engines.vllm_server_app`) say to each other.

The explorer does not decode what it receives for a server; it forwards it. The receiving
syncer — the patch or bucket syncer the synchronizer's config names — runs in the server
process, over the engine's host copy of the weights, and each step of its work is one signed
HTTP request (``POST /aiosync/call``) carrying a :class:`ServerCall`; the answer is a
:class:`ServerAnswer`. Both travel as aiosync messages in one byte string (the frame codec of
:mod:`aiosync.transports.distributed.wire`: JSON header, raw tensor bodies, never pickle), so a
patch reaches the server as the bytes it was encoded in (a :class:`~aiosync.messages.Shared`
part is encoded once however many servers take it).

A receiver's work is a *conversation*: ``init`` runs its ``stage_init`` (the handshake: the
metadata it answers with goes back in ``out``, the sender's hello and the bootstrap buckets come
in by ``feed``), ``stage`` runs its ``stage`` (the payloads of one sync come in by ``feed``, or
the first one with the call), ``write`` runs the staged write (the engine's update: pause, load,
resume), ``abort`` drops a conversation the explorer gave up on. Each answer says whether the
receiver waits for the next message (``"wants"``), finished (``"done"``) or failed
(``"failed"``, with the error's class and message).

Routes (all under ``/aiosync``): ``GET /aiosync/hello`` (the server run's id, unsigned),
``GET /aiosync/state`` (what the server holds and did, unsigned, read only) and
``POST /aiosync/call`` (signed, :mod:`aiosync.engines.auth`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from .. import errors
from ..aio import run_sync
from ..errors import AiosyncError, ApplyError, ConfigError
from ..messages import message
from ..syncers.base import WeightSyncer
from ..transports.distributed.bytestring import frame_bytes, message_from_bytes
from ..transports.distributed.wire import encode_message

HELLO, STATE, CALL = "/aiosync/hello", "/aiosync/state", "/aiosync/call"
#: The response header that names the versions whose weights generated a completion.
VERSIONS_HEADER = "x-aiosync-weight-versions"
OPS = ("init", "feed", "stage", "write", "abort")
#: Bodies at least this large are framed, parsed and signed in a worker thread.
_IN_THREAD = 1 << 20


@message
@dataclass
class ServerCall:
    """One step of a receiver's work in the server (see the module docstring). ``receiver``
    numbers the explorer's forwarding syncers, ``conv`` the conversations of one of them."""

    op: str
    receiver: int
    conv: int
    #: ``init``: the receiver's syncer config, ``{"type": "patch", "patch": {...}}``.
    config: dict | None = None
    #: ``feed`` / ``stage``: the message the receiver waits for (``stage``: optional).
    payload: Any = None
    #: ``write``: whether the write must be all-or-nothing (it holds a version).
    rollback: bool = True


@message
@dataclass
class ServerAnswer:
    """What a :class:`ServerCall` did: ``state`` (``"wants"``, ``"done"``, ``"failed"``), the
    messages the receiver sent meanwhile (``out``), the version the engine holds now
    (``version``), and for ``stage`` / ``write`` the version staged or written with the
    receiver's figures. ``server``: the server's counters as of this answer (what
    ``GET /aiosync/state`` says: version, writes, bytes received, last error, ...)."""

    state: str
    out: list = field(default_factory=list)
    version: int | None = None
    staged: int | None = None
    nbytes: int = 0
    changed: int | None = None
    stage_s: float = 0.0
    error_type: str | None = None
    error: str | None = None
    server: dict | None = None


def syncer_config(syncer: WeightSyncer) -> dict:
    """The config a server builds the same receiver from (patch and bucket syncers)."""
    names = {cls: name for name, cls in WeightSyncer._registry.items()}
    name = names.get(type(syncer))
    config = getattr(syncer, "config", None)
    if name is None or not dataclasses.is_dataclass(config):
        raise ConfigError(f"a vLLM server receives with the patch or bucket syncer, not {type(syncer).__name__}: "
                          "give the synchronizer a weight_syncer config")
    return {"type": name, name: dataclasses.asdict(config)}


def rebuild_error(name: str | None, text: str | None) -> AiosyncError:
    """The error a server reported, as the aiosync class it names (``ApplyError`` for others)."""
    cls = getattr(errors, name or "", None)
    text = f"the vLLM server: {text}"
    if isinstance(cls, type) and issubclass(cls, AiosyncError):
        for klass in cls.__mro__:  # classes whose constructor takes more than the message: a base that does not
            try:
                return klass(text)
            except TypeError:
                continue
    return ApplyError(f"{text} ({name})" if name else text)


def error_fields(exc: BaseException) -> dict:
    """``error_type`` and ``error`` of an answer that reports ``exc``."""
    return {"error_type": type(exc).__name__, "error": str(exc) or repr(exc)}


async def to_bytes(msg: Any, size_hint: int = 0) -> bytes:
    """``msg`` framed as one byte string (in a worker thread when large)."""
    def encode() -> bytes:
        return frame_bytes(encode_message(msg, detach_shared=True))

    return await run_sync(encode) if size_hint >= _IN_THREAD else encode()


async def from_bytes(data: bytes, sender: str) -> Any:
    """The message of a byte string made by :func:`to_bytes` (in a worker thread when large)."""
    if len(data) >= _IN_THREAD:
        return await run_sync(message_from_bytes, data, sender=sender)
    return message_from_bytes(data, sender=sender)


async def in_thread_if_large(fn: Any, body: bytes, *args: Any) -> Any:
    """``fn(*args)`` — hashing ``body`` — in a worker thread when the body is large."""
    return await run_sync(fn, *args) if len(body) >= _IN_THREAD else fn(*args)
