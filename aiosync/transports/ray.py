"""Ray transport (R1): :class:`RayChannel`, one end of a channel between two Ray actors.

Both ends live in *async* Ray actors whose class includes :class:`RayEndpoint` (two actor
methods, ``aiosync_deliver`` and ``aiosync_watch``). Syncers and the synchronizer see one
``send(payload)`` / ``recv()`` pair, as with every transport.

How one message travels:

* ``send`` encodes the payload with the frame codec of :mod:`.distributed.wire` (a JSON header,
  never pickle: only registered dataclasses are rebuilt on the other side). Every tensor of at
  least ``out_of_band_bytes`` leaves the frame: it is put into Ray's object store
  (``ray.put``, in a worker thread) and the message carries its ``ObjectRef``. The header and
  a small packed body travel inside one actor call, ``peer.aiosync_deliver(...)``, which drops
  the message into this channel's inbox on the peer. ``send`` returns when that call returned:
  the message is in the peer's inbox.
* ``recv`` takes the next message from this end's inbox, fetches its objects (from the node's
  shared-memory store, or pulled from another node by Ray), copies them out of the store into
  tensors of its own (one copy, in a worker thread for large bodies) and decodes.

**Fan-out.** A tensor sent again while it is alive and unmodified (the same object, the same
``_version`` counter) reuses its object: one version fanned out to many explorers is put into
the store once and referenced by every explorer's message (:attr:`RayChannelStatistics.objects_reused`).
Payloads must not be modified after they were sent — the in-process transport hands them over
by reference, so every syncer already treats them as immutable.

**Liveness.** Once both ends exist (after the first message either way, or :meth:`RayChannel.watch`),
each end keeps one call to its peer open: ``peer.aiosync_watch(channel)`` returns when the
peer's end closes. If the peer actor dies or Ray restarts it, Ray fails that call
(``RayActorError``) and the channel breaks at once: pending and later calls raise
:class:`aiosync.errors.TransportError`. That is Ray's own death signal — no polling. It comes
as soon as Ray knows: at once for a process that exits, after Ray's node health checks for a
lost node. A peer that hangs instead makes calls raise :class:`~aiosync.errors.PeerTimeoutError`
after ``timeout`` seconds.

One Ray actor is one process, so the channels a process terminates live in a module registry.
This module knows no protocol above it: it imports nothing from the coordination layer or the
syncers.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
import uuid
import weakref
from dataclasses import dataclass, field
from typing import Any

import anyio
import numpy as np
import torch

try:
    import ray
    from ray.exceptions import RayActorError, RayError
except ImportError as exc:  # pragma: no cover - exercised only without Ray
    raise ImportError("aiosync.transports.ray needs Ray: pip install 'aiosync[ray]'") from exc

from ..aio import run_sync
from ..errors import ClosedResourceError, EndOfStream, PayloadError, PeerTimeoutError, TransportError
from ..messages import payload_nbytes
from .base import Transport, TransportStatistics
from .distributed.wire import decode_message, encode_message

__all__ = ["RayChannel", "RayChannelStatistics", "RayEndpoint", "DEFAULT_OUT_OF_BAND_BYTES"]

log = logging.getLogger("aiosync.transport")

#: Tensors at least this large travel as objects of the object store (shared by every peer).
DEFAULT_OUT_OF_BAND_BYTES = 64 << 10
#: Bodies at least this large are copied out of the store in a worker thread.
_COPY_IN_THREAD = 1 << 20


# ----------------------------------------------------------------------------- the actor side

class RayEndpoint:
    """Mixin for an async Ray actor class: lets the actor terminate :class:`RayChannel` ends.

    Its two methods are called by the peer's :class:`RayChannel`, never by users. Any async
    actor may include it; :mod:`aiosync.integrations.ray` builds its trainer and explorer
    mixins on it.
    """

    async def aiosync_deliver(self, channel: str, seq: int, header: bytes, host: Any, refs: list) -> None:
        """Drop one message into ``channel``'s inbox (the peer's ``send``)."""
        _LOCAL.get(channel).deliver(seq, header, host, refs)

    async def aiosync_watch(self, channel: str) -> str:
        """Return when this actor's end of ``channel`` closes (the peer watches its liveness
        through this call: Ray fails it when this actor dies)."""
        return await _LOCAL.get(channel).wait_closed()


class _Registry:
    """The channel ends this process (one Ray actor) terminates, by channel id."""

    def __init__(self) -> None:
        self.ends: dict[str, RayChannel] = {}

    def add(self, end: "RayChannel") -> None:
        if end.channel in self.ends:
            raise ValueError(f"a channel {end.channel!r} already ends in this process; channel ids must be unique")
        self.ends[end.channel] = end

    def get(self, channel: str) -> "RayChannel":
        end = self.ends.get(channel)
        if end is None:
            raise ClosedResourceError(f"this actor has no open end of channel {channel!r}: it was closed, or this "
                                      "actor was restarted since the channel was made")
        return end

    def discard(self, end: "RayChannel") -> None:
        if self.ends.get(end.channel) is end:
            del self.ends[end.channel]


_LOCAL = _Registry()


# ----------------------------------------------------------------------------- shared objects

@dataclass
class _Entry:
    tensor: weakref.ref
    version: int
    ref: Any


class _ObjectCache:
    """Objects put for tensors that are still alive and unmodified: one ``ray.put`` per
    tensor, however many peers it is sent to. An entry goes when its tensor is collected."""

    def __init__(self) -> None:
        self._entries: dict[int, _Entry] = {}
        self._lock = threading.RLock()  # weakref callbacks may run in any thread, also inside the lock
        self._put_lock: anyio.Lock | None = None

    def put_lock(self) -> anyio.Lock:
        """Serialises encodes that put objects, so concurrent sends of one tensor put it once."""
        if self._put_lock is None:
            self._put_lock = anyio.Lock()
        return self._put_lock

    def get(self, t: torch.Tensor) -> Any:
        version = _version_of(t)
        with self._lock:
            entry = self._entries.get(id(t))
        if entry is None or version is None or entry.tensor() is not t or entry.version != version:
            return None
        return entry.ref

    def add(self, t: torch.Tensor, ref: Any) -> None:
        version = _version_of(t)
        if version is None:
            return
        key = id(t)

        def drop(wr: weakref.ref, key: int = key) -> None:
            with self._lock:
                entry = self._entries.get(key)
                if entry is not None and entry.tensor is wr:
                    del self._entries[key]

        with self._lock:
            self._entries[key] = _Entry(weakref.ref(t, drop), version, ref)

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)


def _version_of(t: torch.Tensor) -> int | None:
    try:
        return int(t._version)
    except RuntimeError:  # inference tensors keep no version counter: never shared
        return None


_OBJECTS = _ObjectCache()


def _as_bytes(t: torch.Tensor) -> np.ndarray:
    """The tensor's bytes as a flat ``uint8`` array (a view for a contiguous CPU tensor)."""
    t = t.detach().resolve_conj().resolve_neg()
    if t.device.type != "cpu":
        t = t.cpu()
    return t.contiguous().reshape(-1).view(torch.uint8).numpy()


def _put_all(tensors: list[torch.Tensor]) -> list:
    return [ray.put(_as_bytes(t)) for t in tensors]


def _own(array: Any) -> torch.Tensor | None:
    """A tensor of our own holding ``array``'s bytes (objects from the store are read-only)."""
    if array is None:
        return None
    return torch.from_numpy(np.array(array, dtype=np.uint8, copy=True).reshape(-1))


def _own_all(host: Any, arrays: list) -> tuple[torch.Tensor | None, list[torch.Tensor]]:
    return _own(host), [_own(a) for a in arrays]


# ----------------------------------------------------------------------------- the channel

@dataclass(frozen=True)
class RayChannelStatistics(TransportStatistics):
    """A snapshot of one :class:`RayChannel` end's counters. ``bytes_sent`` counts every
    message whole (header, packed body and its objects), as it reaches the peer."""

    #: sends and receives that ran past ``timeout``
    timeouts: int = 0
    #: tensors this end put into the object store, and their bytes (each copied once into it)
    objects_put: int = 0
    bytes_put: int = 0
    #: out-of-band tensors sent as a reference to an object put earlier (fan-out: no new copy)
    objects_reused: int = 0
    bytes_reused: int = 0


@dataclass
class RayChannelStats:
    """The live counters of a :class:`RayChannel` end (read them through ``statistics()``)."""

    messages_sent: int = 0
    bytes_sent: int = 0
    messages_received: int = 0
    bytes_received: int = 0
    timeouts: int = 0
    objects_put: int = 0
    bytes_put: int = 0
    objects_reused: int = 0
    bytes_reused: int = 0


@dataclass(eq=False)
class RayChannel(Transport):
    """One end of a channel to the Ray actor ``peer`` (an ``ActorHandle`` whose class includes
    :class:`RayEndpoint`); make it inside this actor's event loop.

    * ``channel``: the id both ends share (default: a fresh one; give it to the peer, which
      makes its end with the same id and this actor's handle as ``peer``);
    * ``timeout``: seconds one ``send`` or ``recv`` may wait (``None``: forever, tests only);
    * ``out_of_band_bytes``: tensors at least this large travel as object-store objects.

    ``send`` and ``recv`` may run concurrently; concurrent sends are serialised and arrive in
    order. A receive interrupted by a timeout or a cancellation keeps its message: the next
    ``recv()`` returns it. A send that timed out may still arrive (in order) if the peer takes
    it later. Once the peer is gone (``broken``), every call raises ``TransportError``.
    """

    peer: Any
    channel: str = field(default_factory=lambda: uuid.uuid4().hex)
    timeout: float | None = 600.0
    out_of_band_bytes: int = DEFAULT_OUT_OF_BAND_BYTES
    stats: RayChannelStats = field(default_factory=RayChannelStats)
    #: Why the channel is unusable (the peer actor died, was restarted, or refused a message), or ``None``.
    broken: BaseException | None = None
    closed: bool = False
    #: The peer closed its end (what it sent before is still received).
    peer_closed: bool = False

    def __post_init__(self) -> None:
        if self.out_of_band_bytes < 1:
            raise ValueError(f"out_of_band_bytes must be at least 1, got {self.out_of_band_bytes}")
        self._tx, self._rx = anyio.create_memory_object_stream(math.inf)
        self._send_lock = anyio.Lock()
        self._closed = anyio.Event()
        self._broken = anyio.Event()
        self._seq = 0
        self._expected = 0
        self._early: dict[int, tuple] = {}
        self._current: tuple | None = None
        self._watch: asyncio.Future | None = None
        _LOCAL.add(self)

    # -- liveness ----------------------------------------------------------------------

    def watch(self) -> None:
        """Watch the peer through Ray (idempotent). Call it once the peer's end exists; the
        first message sent or received either way calls it too."""
        if self._watch is not None or self.closed or self.broken is not None:
            return
        ref = self.peer.aiosync_watch.remote(self.channel)
        self._watch = asyncio.wrap_future(ref.future())
        self._watch.add_done_callback(self._watched)

    def _watched(self, fut: asyncio.Future) -> None:
        if fut.cancelled() or self.closed:
            return
        exc = fut.exception()
        if exc is None:
            self.peer_closed = True
            self._tx.close()  # what arrived is still received, then EndOfStream
        elif isinstance(exc, RayActorError):
            self._break(exc, f"the peer actor died or was restarted ({_first_line(exc)})")
        else:
            self._break(exc, f"the peer refused to watch the channel ({_first_line(exc)})")

    def _break(self, exc: BaseException, why: str) -> TransportError:
        err = TransportError(f"channel {self.channel[:8]} to {_who(self.peer)} is broken: {why}")
        err.__cause__ = exc
        if self.broken is None:
            self.broken = err
            log.warning("aiosync: %s", err)
            self._tx.close()
            self._broken.set()
        return err

    def abort(self, reason: str) -> None:
        """Break the channel from this side (e.g. the peer actor came back on a new channel):
        pending and later calls raise ``TransportError`` naming ``reason``."""
        self._break(TransportError(reason), reason)

    def _check(self) -> None:
        if self.closed:
            raise ClosedResourceError(f"channel {self.channel[:8]} was closed")
        if self.broken is not None:
            raise TransportError(str(self.broken)) from self.broken

    # -- receiving (the peer's aiosync_deliver lands here) ------------------------------

    def deliver(self, seq: int, header: bytes, host: Any, refs: list) -> None:
        """Take message ``seq`` from the peer (called by :meth:`RayEndpoint.aiosync_deliver`);
        messages enter the inbox in the order they were sent."""
        if self.closed or self.broken is not None:
            raise ClosedResourceError(f"channel {self.channel[:8]} is closed on this side")
        if not isinstance(seq, int) or seq < self._expected or seq in self._early:
            raise PayloadError(f"channel {self.channel[:8]}: message number {seq!r} arrived twice or out of range")
        self._early[seq] = (header, host, refs)
        while self._expected in self._early:
            self._tx.send_nowait(self._early.pop(self._expected))
            self._expected += 1

    async def wait_broken(self) -> TransportError:
        """Wait until the channel breaks (the peer actor died or was restarted: Ray's signal,
        see *Liveness*; or :meth:`abort`) and return why (:attr:`broken`). Waits forever on a
        channel that is only closed: bound it (or cancel it) yourself."""
        await self._broken.wait()
        return self.broken

    async def wait_closed(self) -> str:
        """Wait until this end is closed (what :meth:`RayEndpoint.aiosync_watch` serves)."""
        await self._closed.wait()
        return "closed"

    # -- Transport -----------------------------------------------------------------------

    async def _await(self, ref: Any, what: str, timeout: float | None) -> Any:
        try:
            with anyio.fail_after(timeout):
                return await ref
        except TimeoutError:
            self.stats.timeouts += 1
            raise PeerTimeoutError(f"{what} on channel {self.channel[:8]} to {_who(self.peer)} timed out after "
                                   f"{self.timeout}s: the peer is not answering") from None
        except RayActorError as exc:
            raise self._break(exc, f"the peer actor died or was restarted during {what} ({_first_line(exc)})") from exc
        except RayError as exc:
            raise self._break(exc, f"{what} failed ({_first_line(exc)})") from exc

    async def send(self, payload: Any) -> None:
        """Send one payload; returns when it is in the peer's inbox."""
        self._check()
        header, host, refs, nbytes = await self._encode(payload)
        async with self._send_lock:
            self._check()
            seq, self._seq = self._seq, self._seq + 1
            call = self.peer.aiosync_deliver.remote(self.channel, seq, header, host, refs)
            await self._await(call, "send", self.timeout)
        self.watch()  # the peer's end exists: it took a message
        self.stats.messages_sent += 1
        self.stats.bytes_sent += nbytes

    async def _encode(self, payload: Any) -> tuple[bytes, Any, list, int]:
        if payload_nbytes(payload) < self.out_of_band_bytes:  # nothing in it can go out of band
            frame = encode_message(payload)
            host = None if frame.host is None else frame.host.numpy()
            return frame.header, host, [], frame.nbytes
        async with _OBJECTS.put_lock():
            refs: list = []
            slots: dict[int, int] = {}
            fresh: list[tuple[int, torch.Tensor]] = []
            oob = 0

            def place(t: torch.Tensor) -> int | None:
                nonlocal oob
                n = t.numel() * t.element_size()
                if n < self.out_of_band_bytes:
                    return None
                slot = slots.get(id(t))
                if slot is None:
                    slot = slots[id(t)] = len(refs)
                    ref = _OBJECTS.get(t)
                    refs.append(ref)
                    if ref is None:
                        fresh.append((slot, t))
                    else:
                        self.stats.objects_reused += 1
                        self.stats.bytes_reused += n
                oob += n
                return slot

            frame = await run_sync(encode_message, payload, external=place)
            if fresh:
                made = await run_sync(_put_all, [t for _, t in fresh])
                for (slot, t), ref in zip(fresh, made):
                    refs[slot] = ref
                    _OBJECTS.add(t, ref)
                    self.stats.objects_put += 1
                    self.stats.bytes_put += t.numel() * t.element_size()
        host = None if frame.host is None else frame.host.numpy()
        return frame.header, host, refs, frame.nbytes + oob

    async def recv(self) -> Any:
        """Wait for the next payload. A timeout or cancellation loses nothing: the next call
        returns the same message."""
        self._check()
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        if self._current is None:
            try:
                with anyio.fail_after(self.timeout):
                    self._current = await self._rx.receive()
            except TimeoutError:
                self.stats.timeouts += 1
                raise PeerTimeoutError(f"recv on channel {self.channel[:8]} timed out after {self.timeout}s: "
                                       f"nothing arrived from {_who(self.peer)}") from None
            except (anyio.EndOfStream, anyio.ClosedResourceError):
                self._check()
                raise EndOfStream(f"{_who(self.peer)} closed channel {self.channel[:8]}") from None
            self.watch()  # the peer's end exists: it sent a message
        header, host, refs = self._current
        arrays: list = [None] * len(refs)

        async def fetch(i: int, ref: Any) -> None:
            arrays[i] = await self._await(ref, "recv (object)", None if deadline is None
                                          else max(0.0, deadline - time.monotonic()))

        async with anyio.create_task_group() as tg:
            for i, ref in enumerate(refs):
                tg.start_soon(fetch, i, ref)
        size = (0 if host is None else host.nbytes) + sum(a.nbytes for a in arrays)
        if size >= _COPY_IN_THREAD:
            host_t, bodies = await run_sync(_own_all, host, arrays)
        else:
            host_t, bodies = _own_all(host, arrays)
        self._current = None
        self.stats.messages_received += 1
        self.stats.bytes_received += len(header) + size
        return decode_message(header, host_t, None, externals=bodies)

    def statistics(self) -> RayChannelStatistics:
        """A frozen snapshot of this end's counters."""
        s = self.stats
        return RayChannelStatistics(s.messages_sent, s.bytes_sent, s.messages_received, s.bytes_received,
                                    s.timeouts, s.objects_put, s.bytes_put, s.objects_reused, s.bytes_reused)

    async def aclose(self) -> None:
        self.close()

    def close(self) -> None:
        """Close this end: the peer's watch returns (its ``recv`` ends with ``EndOfStream`` once
        it took what was sent), and this end refuses further use."""
        if self.closed:
            return
        self.closed = True
        _LOCAL.discard(self)
        self._closed.set()
        self._tx.close()
        if self._watch is not None:
            self._watch.cancel()


def _who(handle: Any) -> str:
    actor_id = getattr(handle, "_actor_id", None)
    return f"actor {actor_id.hex()[:12]}" if actor_id is not None else repr(handle)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"
