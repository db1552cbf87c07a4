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

from ...aio import bind_cuda
from ...reclaim import LARGE, release_if_only_here
from ...errors import ClosedResourceError, ConfigError, PayloadError, PeerTimeoutError, TransportError
from ..base import COMM_OPTION_NAMES, Transport, TransportStatistics
from .ops import _Op, is_gloo
from .wire import MAX_MESSAGE_BYTES, Frame, Prefix, allocate_frame, decode_doc, encode_cached, read_header

__all__ = ["DistributedTransport", "DistributedTransportStatistics", "DEFAULT_TAG"]

log = logging.getLogger("aiosync.transport")

DEFAULT_TAG = 0x5A5C
#: (data group, peer) -> set once the first NCCL operation to that peer was posted (its communicator exists)
_WARM: dict[tuple[int, int], anyio.Event] = {}

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


def _comm_tuple(options: Any) -> tuple:
    """W4's options as a comparable tuple (``None``: the defaults)."""
    return tuple(getattr(options, name, None) or None for name in COMM_OPTION_NAMES)


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
    #: The W4 options ``data_group``'s NCCL communicator was made with (``None``: defaults).
    comm_options: Any = None
    stats: DistributedStats = field(default_factory=DistributedStats)
    #: The largest message (host + device bodies) this end accepts: a prefix announcing more breaks
    #: the channel before anything is allocated.
    max_message_bytes: int = MAX_MESSAGE_BYTES
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

    async def _post_data(self, fn, tensor: torch.Tensor, deadline: float | None, what: str) -> _Op:
        """Post a data-group operation. Over NCCL the first one to a peer builds that pair's
        communicator, which blocks until the peer posts its side: it is posted from a worker
        thread (the event loop never waits on it), and later posts wait for it, bounded by the
        call's deadline, before posting on the loop. A peer that does not join within the bound
        breaks the channel (part of a frame is posted, part is not)."""
        if self._data_threaded:
            return self._post(fn, tensor, data=True, what=what)
        key = (id(self.data_group), self.peer)
        warm = _WARM.get(key)
        if warm is None:
            warm = _WARM[key] = anyio.Event()
            with anyio.fail_after(None if deadline is None else max(0.0, deadline - time.monotonic())):
                try:
                    op = await anyio.to_thread.run_sync(bind_cuda(self._post), fn, tensor, True, what,
                                                        abandon_on_cancel=True)
                except TimeoutError:  # the post may still complete in its thread: the framing is lost
                    raise self._fail(PeerTimeoutError(f"the peer did not join the NCCL communicator within "
                                                      f"{self.timeout}s"), what) from None
            warm.set()
            return op
        if not warm.is_set():
            try:
                with anyio.fail_after(None if deadline is None else max(0.0, deadline - time.monotonic())):
                    await warm.wait()
            except TimeoutError:  # the frame's other parts are posted, this one not: the framing is lost
                raise self._fail(PeerTimeoutError("its NCCL communicator is still being made (the peer has not "
                                                  "joined)"), what) from None
        return self._post(fn, tensor, data=True, what=what)

    def _post(self, fn, tensor: torch.Tensor, data: bool = False, what: str = "") -> _Op:
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

    def use_comm_options(self, options: Any) -> dict[str, str]:
        """W4 on this channel. Over gloo the options have no effect (gloo has none of them).
        Over NCCL they are properties of the communicator, fixed when it is made: this
        channel's ``data_group`` must have been made with the same options
        (``WeightSyncGroup.init(comm_options=...)``), else :class:`ConfigError` says so."""
        wanted = _comm_tuple(options)
        if not any(wanted):
            return {}
        if self._data_threaded:
            return {name: f"no effect on gloo ({name}={value})" for name, value in zip(COMM_OPTION_NAMES, wanted) if value}
        have = _comm_tuple(self.comm_options)
        if have != wanted:
            raise ConfigError(
                f"the weight syncer asks for comm_options {dict(zip(COMM_OPTION_NAMES, wanted))}, but the NCCL "
                f"communicator of the channel to rank {self.peer} was made with {dict(zip(COMM_OPTION_NAMES, have))}: "
                "NCCL fixes them when a communicator is made. Make the group with "
                "WeightSyncGroup.init(comm_options=WeightSyncerConfig.from_any(cfg).comm_options) on every rank")
        return {name: f"{name}={value} (NCCL communicator)" for name, value in zip(COMM_OPTION_NAMES, wanted) if value}

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
        if frame.host is not None and frame.host.numel() >= LARGE:  # a packed copy of a bucket, sent:
            box, frame = [frame], None  # given back off the loop (a cached frame stays; a failed send's
            await release_if_only_here(box)  # posted ops may still read it: only dropped)

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
            ops.append(await self._post_data(dist.isend, frame.device, deadline, "send (device body)"))
        bodies = frame.detached if detached else []
        for body in bodies:
            on_device = self.device is not None and body.device.type == self.device.type
            ops.append(await self._post_data(dist.isend, body, deadline, "send (shared body)") if on_device
                       else self._post(dist.isend, body, data=False, what="send (shared body)"))
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
                announced = Prefix.parse(inc.prefix, sender=f"rank {self.peer}", device_body=self.device is not None,
                                         max_bytes=self.max_message_bytes)
                header_dev = self.device if (self.device is not None and not self._ctrl_threaded) else None
                inc.header, inc.host, inc.dev = allocate_frame(announced, header_dev, self.device,
                                                               sender=f"rank {self.peer}")
            except PayloadError as err:  # the framing can no longer be trusted
                raise self._fail(err, "recv") from err
            inc.announced = announced
            ops = [self._post(dist.irecv, inc.header, data=False, what="recv (header)")]
            if inc.host is not None:
                ops.append(self._post(dist.irecv, inc.host, data=False, what="recv (host body)"))
            inc.body_ops = ops
            if inc.dev is not None:
                ops.append(await self._post_data(dist.irecv, inc.dev, deadline, "recv (device body)"))
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
                if sum(n for n, _ in doc["ext"]) + inc.announced.nbytes > self.max_message_bytes:
                    raise self._fail(PayloadError(f"rank {self.peer} announced detached bodies beyond "
                                                  f"{self.max_message_bytes} bytes"), "recv")
                for nbytes, on_dev in doc["ext"]:
                    try:
                        body = torch.empty(nbytes, dtype=torch.uint8, device=self.device if on_dev else None)
                    except (RuntimeError, MemoryError) as exc:
                        raise self._fail(PayloadError(f"rank {self.peer} announced a shared body of {nbytes} bytes, "
                                                      f"which this process cannot allocate: {str(exc)[:200]}"),
                                         "recv") from None
                    inc.detached.append(body)
                    inc.detached_ops.append(await self._post_data(dist.irecv, body, deadline, "recv (shared body)")
                                            if on_dev else self._post(dist.irecv, body, data=False,
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
