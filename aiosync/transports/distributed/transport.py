"""One point-to-point channel between two ranks over torch.distributed (T2).

:class:`DistributedTransport` carries payloads framed by :mod:`.wire` between this rank and
``peer``: prefix, header and host body over the control group (gloo), CUDA tensors over the
data group (NCCL) when one is configured. Syncers and the synchronizer see one
``send(payload)`` / ``recv()`` pair.

Waiting (see :mod:`.ops`). The event loop only posts operations and awaits, with aiosync's own
per-call ``timeout`` (:class:`aiosync.errors.PeerTimeoutError`). A receive interrupted by a
timeout or a cancellation keeps its posted operation, so the next ``recv()`` resumes the same
message and nothing is lost or misframed; a send that timed out was already posted and still
arrives whole if the peer reads it later. The process group's own timeout is a last-resort
bound; keep it well above ``timeout`` (the default group of
:class:`~.group.WeightSyncGroup` uses a day) — gloo tears the whole group down when one of its
waits expires.

A peer process that dies closes its sockets: pending and later operations fail at once with
:class:`aiosync.errors.TransportError` and the transport stays broken (``broken`` holds the
reason). A peer that hangs makes calls raise :class:`aiosync.errors.PeerTimeoutError` after
``timeout`` seconds. A frame whose prefix fails :meth:`.wire.Prefix.parse` breaks the channel
too (its framing can no longer be trusted).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import anyio
import torch
import torch.distributed as dist

from ...errors import ClosedResourceError, PayloadError, PeerTimeoutError, TransportError
from ..base import Transport, TransportStatistics
from .ops import _Op, is_gloo
from .wire import Frame, Prefix, decode_doc, encode_cached, read_header

__all__ = ["DistributedTransport", "DistributedTransportStatistics", "DEFAULT_TAG"]

log = logging.getLogger("aiosync.transport")

DEFAULT_TAG = 0x5A5C

_SKIP = object()  # a message the transport consumed itself


@dataclass(frozen=True)
class DistributedTransportStatistics(TransportStatistics):
    """A snapshot of one :class:`DistributedTransport` end's counters (bytes include framing)."""

    #: sends and receives that ran past ``timeout``
    timeouts: int = 0
    #: seconds spent encoding payloads into frames
    encode_s: float = 0.0


@dataclass
class DistributedStats:
    """The live counters of one :class:`DistributedTransport` end (read them through
    :meth:`DistributedTransport.statistics`)."""

    messages_sent: int = 0
    bytes_sent: int = 0
    messages_received: int = 0
    bytes_received: int = 0
    timeouts: int = 0
    encode_s: float = 0.0


@dataclass
class _Incoming:
    """A message being received: survives timeouts and cancellation of ``recv``."""

    prefix: torch.Tensor
    prefix_op: _Op
    announced: Prefix | None = None
    header: torch.Tensor | None = None
    host: torch.Tensor | None = None
    dev: torch.Tensor | None = None
    body_ops: list = field(default_factory=list)
    #: The header, read (version 2: the detached bodies that follow, and how they travel).
    doc: dict | None = None
    detached: list = field(default_factory=list)
    detached_ops: list = field(default_factory=list)


@dataclass(eq=False)
class DistributedTransport(Transport):
    """One end of a point-to-point channel to rank ``peer`` over torch.distributed.

    * ``group``: the process group for prefixes, headers and host (CPU) tensors — gloo
      (default: the world group; prefer :meth:`~.group.WeightSyncGroup.transport`, which uses a
      dedicated group with a long timeout).
    * ``data_group`` / ``device``: where CUDA tensors travel (an NCCL group and this rank's
      CUDA device). Without them, CUDA tensors are sent through host memory and arrive on the CPU.
    * ``timeout``: seconds one ``send`` or ``recv`` may wait (``None``: forever, tests only).
    * ``tag``: the point-to-point tag (gloo), so several channels between two ranks stay apart.

    Both ends must be made by the two ranks with each other's rank as ``peer``. ``send`` and
    ``recv`` may be used concurrently (one task sending, one receiving); concurrent sends are
    serialised. Never blocks the event loop.
    """

    peer: int
    group: Any = None
    data_group: Any = None
    device: torch.device | None = None
    timeout: float | None = 600.0
    tag: int = DEFAULT_TAG
    stats: DistributedStats = field(default_factory=DistributedStats)
    #: Why the channel is unusable (the peer died, a frame was corrupt), or ``None``.
    broken: BaseException | None = None
    closed: bool = False
    _send_lock: anyio.Lock = field(default_factory=anyio.Lock, repr=False)
    _incoming: _Incoming | None = field(default=None, repr=False)
    #: Receives bodies that do not come point to point (a multicast round: :mod:`.multicast`).
    router: Any = None
    _unread: Any = field(default=None, repr=False)
    _ctrl_threaded: bool = field(default=True, repr=False)
    _data_threaded: bool = field(default=True, repr=False)

    def __post_init__(self) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise TransportError("torch.distributed is not initialised: call dist.init_process_group "
                                 "(or WeightSyncGroup.init()) first")
        if self.peer == dist.get_rank():
            raise ValueError(f"peer {self.peer} is this rank: a channel needs two ranks")
        if self.device is not None:
            self.device = torch.device(self.device)
        if self.data_group is None:
            self.data_group = self.group
        self._ctrl_threaded = is_gloo(self.group)
        self._data_threaded = is_gloo(self.data_group)
        if self.device is not None and self._data_threaded:
            self.device = None  # gloo cannot move CUDA tensors point to point: they go via the host

    # -- helpers -------------------------------------------------------------------

    def _check(self) -> None:
        if self.closed:
            raise ClosedResourceError("the distributed transport was closed")
        if self.broken is not None:
            raise TransportError(f"channel to rank {self.peer} is broken: {self.broken}") from self.broken

    def _deadline(self) -> float | None:
        return None if self.timeout is None else time.monotonic() + self.timeout

    def _fail(self, exc: BaseException, what: str) -> TransportError:
        self.broken = exc
        log.warning("aiosync: channel to rank %d broke during %s: %s", self.peer, what, exc)
        err = TransportError(f"{what} with rank {self.peer} failed: {exc}")
        err.__cause__ = exc
        return err

    def _post(self, fn, tensor: torch.Tensor, *, data: bool, what: str) -> _Op:
        group = self.data_group if data else self.group
        try:
            work = fn(tensor, self.peer, group=group, tag=self.tag)
        except (RuntimeError, ValueError) as exc:
            raise self._fail(exc, what) from exc
        return _Op(work, tensor, what, threaded=self._data_threaded if data else self._ctrl_threaded)

    async def _await(self, op: _Op, deadline: float | None, what: str) -> None:
        try:
            await op.wait(deadline)
        except PeerTimeoutError:
            self.stats.timeouts += 1
            raise PeerTimeoutError(f"{what} with rank {self.peer} timed out after {self.timeout}s: "
                                   "the peer is not answering") from None
        except Exception as exc:  # gloo / NCCL: the connection is gone
            raise self._fail(exc, what) from exc

    # -- Transport -----------------------------------------------------------------

    async def send(self, payload: Any) -> None:
        """Send one payload; returns when the peer received all of it.

        A send that times out was already posted: the message still arrives whole if the
        peer reads it later, so the framing stays intact. Shared parts
        (:class:`aiosync.messages.Shared`) are encoded once per process and their bodies sent
        as they are, after the message (detached bodies).
        """
        self._check()
        t0 = time.perf_counter()
        frame = await encode_cached(payload, self.device, detach_shared=True)
        self.stats.encode_s += time.perf_counter() - t0
        async with self._send_lock:
            await self.send_frame(frame)

    async def send_frame(self, frame: Frame, *, detached: bool = True) -> None:
        """Send an encoded frame (``detached``: and its detached bodies, point to point). The
        caller holds :attr:`send_lock` (a multicast round holds it from a member's header to its
        bodies, so that nothing else comes in between)."""
        self._check()
        prefix, header = frame.prefix.tensor(), frame.header_tensor()
        if self.device is not None and not self._ctrl_threaded:  # an NCCL control group needs CUDA tensors
            prefix, header = prefix.to(self.device), header.to(self.device)
        deadline = self._deadline()
        ops = [self._post(dist.isend, prefix, data=False, what="send (prefix)"),
               self._post(dist.isend, header, data=False, what="send (header)")]
        if frame.host is not None:
            ops.append(self._post(dist.isend, frame.host, data=False, what="send (host body)"))
        if frame.device is not None:
            ops.append(self._post(dist.isend, frame.device, data=True, what="send (device body)"))
        bodies = frame.detached if detached else []
        for body in bodies:
            on_device = self.device is not None and body.device.type == self.device.type
            ops.append(self._post(dist.isend, body, data=on_device, what="send (shared body)"))
        for op in ops:
            await self._await(op, deadline, op.what)
        self.stats.messages_sent += 1
        self.stats.bytes_sent += frame.prefix.nbytes + sum(b.numel() for b in bodies)

    @property
    def send_lock(self) -> anyio.Lock:
        """Held for the whole of one message (its frame and its detached bodies)."""
        return self._send_lock

    async def recv(self) -> Any:
        """Wait for the next payload. A timeout or cancellation loses nothing: the next call
        resumes the same message."""
        while True:
            inc = await self._recv_frame()
            payload = await self._finish(inc)
            if payload is not _SKIP:
                return payload

    async def _recv_frame(self) -> _Incoming:
        """Receive the next frame and its point-to-point detached bodies (resumable)."""
        if self._unread is not None:
            inc, self._unread = self._unread, None
            return inc
        self._check()
        deadline = self._deadline()
        if self._incoming is None:
            prefix = Prefix.buffer(self.device if (self.device is not None and not self._ctrl_threaded) else None)
            self._incoming = _Incoming(prefix, self._post(dist.irecv, prefix, data=False, what="recv (prefix)"))
        inc = self._incoming
        await self._await(inc.prefix_op, deadline, "recv")
        if inc.announced is None:
            try:  # validated before anything is allocated for what it announces
                announced = Prefix.parse(inc.prefix, sender=f"rank {self.peer}", device_body=self.device is not None)
            except PayloadError as err:
                raise self._fail(err, "recv") from err
            inc.announced = announced
            header_dev = self.device if (self.device is not None and not self._ctrl_threaded) else None
            inc.header = torch.empty(announced.header_bytes, dtype=torch.uint8, device=header_dev)
            ops = [self._post(dist.irecv, inc.header, data=False, what="recv (header)")]
            if announced.host_bytes:
                inc.host = torch.empty(announced.host_bytes, dtype=torch.uint8)
                ops.append(self._post(dist.irecv, inc.host, data=False, what="recv (host body)"))
            if announced.device_bytes:
                inc.dev = torch.empty(announced.device_bytes, dtype=torch.uint8, device=self.device)
                ops.append(self._post(dist.irecv, inc.dev, data=True, what="recv (device body)"))
            inc.body_ops = ops
        for op in inc.body_ops:
            await self._await(op, deadline, op.what)
        if inc.doc is None:
            try:
                doc = read_header(inc.header.cpu().numpy().tobytes())
                if any(on_dev and self.device is None for _, on_dev in doc["ext"]):
                    raise PayloadError(f"rank {self.peer} sent shared device bodies, but this end has no device "
                                       "data group")
            except PayloadError as err:  # what follows it cannot be framed
                raise self._fail(err, "recv") from err
            inc.doc = doc
            if doc.get("route") is None:  # detached bodies follow point to point
                for nbytes, on_dev in doc["ext"]:
                    body = torch.empty(nbytes, dtype=torch.uint8, device=self.device if on_dev else None)
                    inc.detached.append(body)
                    inc.detached_ops.append(self._post(dist.irecv, body, data=bool(on_dev),
                                                       what="recv (shared body)"))
        for op in inc.detached_ops:
            await self._await(op, deadline, op.what)
        return inc

    async def _finish(self, inc: _Incoming, *, routed: bool = True) -> Any:
        """Decode a received frame; a routed one (a multicast round) first gets its bodies
        from :attr:`router`, a fallback of a round already complete is consumed here."""
        doc = inc.doc
        self._incoming = None  # the frame's own bytes are in: the next receive reads the next message
        self.stats.messages_received += 1
        self.stats.bytes_received += inc.announced.nbytes
        if doc.get("route") is not None:
            if self.router is None or not routed:
                raise PayloadError(f"rank {self.peer} sent a message routed by {doc['route']!r}, but this end has "
                                   "no router for it here (transports of one WeightSyncGroup route multicasts)")
            inc.detached = await self.router.receive(self, doc)
        else:
            self.stats.bytes_received += sum(b.numel() for b in inc.detached)
        payload = decode_doc(doc, inc.host, inc.dev, externals=inc.detached)
        if routed and self.router is not None and self.router.stale(payload):
            return _SKIP
        return payload

    async def recv_direct(self, want: Any) -> Any:
        """The next message if ``want(payload)`` holds (a multicast round's fallback, read while
        its round is being received), else ``None``: then the message stays for the next
        receive, and so does a routed one."""
        inc = await self._recv_frame()
        if inc.doc.get("route") is not None:
            self._unread = inc
            return None
        payload = decode_doc(inc.doc, inc.host, inc.dev, externals=inc.detached)
        if not want(payload):
            self._unread = inc
            return None
        self._incoming = None
        self.stats.messages_received += 1
        self.stats.bytes_received += inc.announced.nbytes + sum(b.numel() for b in inc.detached)
        return payload

    def statistics(self) -> DistributedTransportStatistics:
        """A frozen snapshot of this end's counters."""
        s = self.stats
        return DistributedTransportStatistics(s.messages_sent, s.bytes_sent, s.messages_received, s.bytes_received,
                                              s.timeouts, s.encode_s)

    async def aclose(self) -> None:
        self.close()

    def close(self) -> None:
        """Refuse further use of this end. Posted operations are not cancelled (torch cannot);
        close both ends after a clean end of the conversation above (the protocol's own goodbye)."""
        self.closed = True
