"""torch.distributed transport (T2): gloo on CPU, NCCL on GPU, awaited without blocking the loop.

Syncers and the synchronizer keep seeing one ``send(payload)`` / ``recv()`` pair;
:class:`DistributedTransport` carries payloads between two ranks of a process group started
by ``torchrun`` or ``torch.multiprocessing``. :class:`WeightSyncGroup` makes the groups it
rides on and :meth:`WeightSyncGroup.broadcast` fans one payload out to every rank at once.

Wire format of one message (see ``docs/distributed.md``)::

    prefix   int64[4]  MAGIC, header bytes, host-body bytes, device-body bytes   (control group)
    header   uint8[]   UTF-8 JSON: the payload's structure; tensors and bytes as references  (control group)
    host     uint8[]   CPU tensors and ``bytes``, each at a 64-byte aligned offset            (control group)
    device   uint8[]   CUDA tensors, when a device (NCCL) data group is configured           (data group)

The header is JSON, never pickle: only plain values, lists, tuples, dicts, ``torch.dtype``,
tensors, ``bytes`` and *registered* dataclasses (:func:`register_message`; aiosync's payload
and protocol classes are registered) can travel, so a peer cannot make this process run code.
Received tensors are views into the received body (no copy) on the body's device.

Waiting. gloo's point-to-point work handles cannot be polled (``is_completed()`` stays false
until someone calls ``wait()``) and a gloo wait that times out poisons the whole group, so
each posted gloo operation is waited for by a small daemon thread that calls ``wait()`` and
wakes the event loop when it returns; NCCL work is polled with ``is_completed()`` and
back-off. The event loop only posts operations and awaits, with aiosync's own per-call
``timeout`` (:class:`aiosync.errors.PeerTimeoutError`). A receive interrupted by a timeout or
a cancellation keeps its posted operation, so the next ``recv()`` resumes the same message
and nothing is lost or misframed. The process group's own timeout is a last-resort bound;
keep it well above ``timeout`` (the default group of :class:`WeightSyncGroup` uses a day) —
gloo tears the whole group down when one of its waits expires.

A peer process that dies closes its sockets: pending and later operations fail at once with
:class:`aiosync.errors.TransportError` and the transport stays broken (``broken`` holds the
reason). A peer that hangs makes calls raise :class:`aiosync.errors.PeerTimeoutError` after
``timeout`` seconds.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import math
import os
import threading
import time
import weakref
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import anyio
import torch
import torch.distributed as dist

from ..aio import run_sync
from ..errors import ClosedResourceError, ConfigError, PayloadError, PeerTimeoutError, TransportError
from .base import Transport

log = logging.getLogger("aiosync.transport")

MAGIC = 0x41494F53594E4331  # "AIOSYNC1"
_ALIGN = 64
#: Bodies at least this large are packed in a worker thread, not on the event loop.
_PACK_IN_THREAD = 1 << 20
#: Upper bound on a header, so a corrupt prefix cannot make us allocate gigabytes for it.
MAX_HEADER_BYTES = 256 << 20
DEFAULT_TAG = 0x5A5C

# ----------------------------------------------------------------------------- message types

_REGISTRY: dict[str, type] = {}
_BUILTINS_LOADED = False


def _type_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def register_message(cls: type) -> type:
    """Allow dataclass ``cls`` to travel over cross-process transports (usable as a decorator).

    Only registered dataclasses are rebuilt on the receiving side; anything else is refused
    with :class:`aiosync.errors.PayloadError`. aiosync's own payload and protocol classes
    are registered already; register the messages of a custom :class:`WeightSyncer`.
    """
    if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
        raise TypeError(f"register_message takes a dataclass type, got {cls!r}")
    _REGISTRY[_type_name(cls)] = cls
    return cls


def _load_builtin_types() -> None:
    global _BUILTINS_LOADED
    if _BUILTINS_LOADED:
        return
    from ..coordination import link, remote
    from ..syncers import payloads

    # Message types only: the syncers' payloads, the delivery line's and the session's messages.
    for obj in vars(payloads).values():
        if isinstance(obj, type) and dataclasses.is_dataclass(obj) and obj.__module__ == payloads.__name__:
            register_message(obj)
    for cls in (link.Packet, link.Reinit, link.Abort, link.Ack):
        register_message(cls)
    for obj in vars(remote).values():
        if isinstance(obj, type) and issubclass(obj, remote.Control):
            register_message(obj)
    _BUILTINS_LOADED = True


# ----------------------------------------------------------------------------- codec


@dataclass
class Frame:
    """One encoded message: the JSON header and up to two packed bodies."""

    header: bytes
    host: torch.Tensor | None
    device: torch.Tensor | None

    @property
    def nbytes(self) -> int:
        """Bytes on the wire, prefix included."""
        return 32 + len(self.header) + sum(b.numel() for b in (self.host, self.device) if b is not None)


def _round_up(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _parse_dtype(name: Any) -> torch.dtype:
    dt = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dt, torch.dtype):
        raise PayloadError(f"message header names an unknown dtype {name!r}")
    return dt


def _plain_tensor(t: torch.Tensor) -> torch.Tensor:
    if t.is_sparse or t.layout is not torch.strided:
        raise PayloadError(f"cannot send a {t.layout} tensor; send it dense")
    if type(t) is not torch.Tensor and not isinstance(t, torch.nn.Parameter):
        raise PayloadError(f"cannot send a {type(t).__name__}; materialise it first (e.g. DTensor.full_tensor())")
    return t.detach().resolve_conj().resolve_neg()


class _Encoder:
    """Turns a payload into a JSON-able tree plus the tensors and byte strings it references."""

    def __init__(self, device: torch.device | None) -> None:
        self.device = device  # tensors on this device go to the device body
        self.host: list[tuple[int, Any]] = []  # (offset, tensor or bytes)
        self.dev: list[tuple[int, torch.Tensor]] = []
        self.host_size = 0
        self.dev_size = 0
        self.tensors: list[list] = []

    def encode(self, obj: Any) -> Any:
        if obj is None or isinstance(obj, (bool, str)):
            return obj
        if isinstance(obj, int):
            return obj
        if isinstance(obj, float):
            return obj if math.isfinite(obj) else {"$float": repr(obj)}
        if isinstance(obj, torch.Tensor):
            return {"$t": self._tensor(obj)}
        if isinstance(obj, (bytes, bytearray, memoryview)):
            data = bytes(obj)
            off = self.host_size
            self.host.append((off, data))
            self.host_size = _round_up(off + len(data))
            return {"$b": [off, len(data)]}
        if isinstance(obj, list):
            return [self.encode(v) for v in obj]
        if isinstance(obj, tuple):
            return {"$tuple": [self.encode(v) for v in obj]}
        if isinstance(obj, dict):
            return {"$dict": [[self.encode(k), self.encode(v)] for k, v in obj.items()]}
        if isinstance(obj, torch.dtype):
            return {"$dtype": _dtype_name(obj)}
        if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            _load_builtin_types()
            name = _type_name(type(obj))
            if _REGISTRY.get(name) is not type(obj):
                raise PayloadError(
                    f"cannot send a {type(obj).__name__}: it is not a registered message type; "
                    "register it with aiosync.transports.distributed.register_message")
            fields = {f.name: self.encode(getattr(obj, f.name)) for f in dataclasses.fields(obj) if f.init}
            return {"$dc": name, "f": fields}
        raise PayloadError(f"cannot send a {type(obj).__name__} over a process boundary: send tensors, bytes, "
                           "numbers, strings, lists, tuples, dicts or registered dataclasses")

    def _tensor(self, t: torch.Tensor) -> int:
        t = _plain_tensor(t)
        nbytes = t.numel() * t.element_size()
        on_device = self.device is not None and t.device.type == self.device.type
        if on_device:
            off = self.dev_size
            self.dev.append((off, t))
            self.dev_size = _round_up(off + nbytes)
        else:
            off = self.host_size
            self.host.append((off, t))
            self.host_size = _round_up(off + nbytes)
        self.tensors.append([1 if on_device else 0, off, nbytes, _dtype_name(t.dtype), list(t.shape)])
        return len(self.tensors) - 1

    def pack(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        host = dev = None
        if self.host_size:
            host = torch.empty(self.host_size, dtype=torch.uint8)
            for off, item in self.host:
                if isinstance(item, bytes):
                    if item:
                        host[off:off + len(item)] = torch.frombuffer(bytearray(item), dtype=torch.uint8)
                else:
                    _copy_bytes(host, off, item)
        if self.dev_size:
            dev = torch.empty(self.dev_size, dtype=torch.uint8, device=self.device)
            for off, t in self.dev:
                _copy_bytes(dev, off, t)
        return host, dev


def _copy_bytes(dst: torch.Tensor, off: int, t: torch.Tensor) -> None:
    n = t.numel() * t.element_size()
    if n == 0:
        return
    src = t.contiguous().reshape(-1).view(torch.uint8)
    dst[off:off + n].copy_(src, non_blocking=False)


def encode_message(payload: Any, device: torch.device | None = None) -> Frame:
    """Encode ``payload`` into a :class:`Frame`. Tensors on ``device`` (a CUDA device) go to the
    device body; every other tensor, and ``bytes``, to the host body."""
    enc = _Encoder(device)
    tree = enc.encode(payload)
    header = json.dumps({"v": 1, "tree": tree, "tensors": enc.tensors}, separators=(",", ":"),
                        allow_nan=False).encode()
    host, dev = enc.pack()
    return Frame(header, host, dev)


class _Decoder:
    def __init__(self, tensors: list, host: torch.Tensor | None, dev: torch.Tensor | None) -> None:
        self.entries = tensors
        self.host, self.dev = host, dev
        _load_builtin_types()

    def _body(self, which: int) -> torch.Tensor:
        body = self.dev if which == 1 else self.host
        if body is None:
            raise PayloadError("message references a body it does not carry")
        return body

    def tensor(self, index: Any) -> torch.Tensor:
        if not isinstance(index, int) or not 0 <= index < len(self.entries):
            raise PayloadError(f"message references tensor {index!r}, which it does not describe")
        try:
            which, off, nbytes, dtype, shape = self.entries[index]
        except (TypeError, ValueError):
            raise PayloadError(f"malformed tensor entry {self.entries[index]!r}") from None
        dtype = _parse_dtype(dtype)
        if not (isinstance(shape, list) and all(isinstance(s, int) and s >= 0 for s in shape)):
            raise PayloadError(f"malformed tensor shape {shape!r}")
        numel = math.prod(shape)
        esize = torch.empty((), dtype=dtype).element_size()
        if numel * esize != nbytes:
            raise PayloadError(f"tensor entry {index}: {nbytes} bytes do not hold {shape} of {dtype}")
        body = self._body(which)
        if not (isinstance(off, int) and off >= 0 and off % _ALIGN == 0 and off + nbytes <= body.numel()):
            raise PayloadError(f"tensor entry {index}: bytes [{off}, {off}+{nbytes}) lie outside the body")
        if nbytes == 0:
            return torch.empty(shape, dtype=dtype, device=body.device)
        return body[off:off + nbytes].view(dtype).reshape(shape)

    def decode(self, node: Any) -> Any:
        if node is None or isinstance(node, (bool, int, float, str)):
            return node
        if isinstance(node, list):
            return [self.decode(v) for v in node]
        if not isinstance(node, dict) or len(node) not in (1, 2):
            raise PayloadError(f"malformed message header node {str(node)[:80]!r}")
        if "$t" in node:
            return self.tensor(node["$t"])
        if "$tuple" in node:
            return tuple(self.decode(v) for v in node["$tuple"])
        if "$dict" in node:
            out = {}
            for pair in node["$dict"]:
                if not (isinstance(pair, list) and len(pair) == 2):
                    raise PayloadError("malformed dict entry in message header")
                key = self.decode(pair[0])
                try:
                    out[key] = self.decode(pair[1])
                except TypeError:
                    raise PayloadError(f"unhashable dict key {key!r} in message") from None
            return out
        if "$b" in node:
            off, n = node["$b"]
            body = self._body(0)
            if not (isinstance(off, int) and isinstance(n, int) and 0 <= off and 0 <= n and off + n <= body.numel()):
                raise PayloadError("message bytes lie outside the body")
            return bytes(body[off:off + n].numpy().tobytes())
        if "$float" in node:
            return float(node["$float"])
        if "$dtype" in node:
            return _parse_dtype(node["$dtype"])
        if "$dc" in node:
            cls = _REGISTRY.get(node["$dc"])
            if cls is None:
                raise PayloadError(f"message holds a {node['$dc']!r}, which is not a registered message type "
                                   "(register_message) on this side")
            fields = node.get("f")
            if not isinstance(fields, dict):
                raise PayloadError("malformed dataclass node in message header")
            try:
                return cls(**{k: self.decode(v) for k, v in fields.items()})
            except TypeError as exc:
                raise PayloadError(f"cannot rebuild {cls.__name__} from the message: {exc}") from None
        raise PayloadError(f"unknown node {sorted(node)} in message header")


def decode_message(header: bytes, host: torch.Tensor | None = None, device: torch.Tensor | None = None) -> Any:
    """Rebuild a payload from a header and its bodies (inverse of :func:`encode_message`)."""
    try:
        doc = json.loads(header.decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise PayloadError(f"message header is not valid JSON: {exc}") from None
    if not isinstance(doc, dict) or doc.get("v") != 1 or not isinstance(doc.get("tensors"), list):
        raise PayloadError("message header has an unknown layout (not an aiosync v1 message)")
    try:
        return _Decoder(doc["tensors"], host, device).decode(doc.get("tree"))
    except PayloadError:
        raise
    except (TypeError, ValueError, KeyError, IndexError, RuntimeError) as exc:
        raise PayloadError(f"malformed message: {type(exc).__name__}: {exc}") from None


#: Encoded frames of payloads sent to several peers (fan-out), keyed by the payload object.
_FRAME_CACHE: "weakref.WeakKeyDictionary[Any, tuple[Any, Frame]]" = weakref.WeakKeyDictionary()


async def _encode_cached(payload: Any, device: torch.device | None) -> Frame:
    """Encode ``payload``; a payload object sent again (to another explorer) reuses its frame."""
    try:
        hit = _FRAME_CACHE.get(payload)
    except TypeError:  # not weak-referenceable / hashable: never cached
        hit = None
    if hit is not None and hit[0] == device:
        return hit[1]
    if _payload_bytes_hint(payload) >= _PACK_IN_THREAD:
        frame = await run_sync(encode_message, payload, device)
    else:
        frame = encode_message(payload, device)
    if dataclasses.is_dataclass(payload) and not isinstance(payload, type):
        try:
            _FRAME_CACHE[payload] = (device, frame)
        except TypeError:
            pass
    return frame


def _payload_bytes_hint(obj: Any) -> int:
    from .base import payload_nbytes

    return payload_nbytes(obj)


# ----------------------------------------------------------------------------- waiting on work


def _is_gloo(group: Any) -> bool:
    try:
        return dist.get_backend(group) == "gloo"
    except Exception:  # pragma: no cover - an unusual group object
        return True


class _Op:
    """One posted torch.distributed operation, awaited without blocking the event loop.

    gloo: a daemon thread calls ``work.wait()`` and wakes the waiting loop. NCCL: the loop polls
    ``work.is_completed()`` with back-off. Waiting again after a timeout resumes the same op.
    """

    __slots__ = ("work", "keep", "what", "_done", "_error", "_wakers", "_lock", "_poll")

    def __init__(self, work: Any, keep: Any, what: str, *, threaded: bool) -> None:
        self.work, self.keep, self.what = work, keep, what
        self._done = threading.Event()
        self._error: BaseException | None = None
        self._wakers: list = []
        self._lock = threading.Lock()
        self._poll = not threaded
        if work is None:  # a rank outside the group: nothing to wait for
            self._done.set()
        elif threaded:
            threading.Thread(target=self._wait_in_thread, name=f"aiosync-{what}", daemon=True).start()

    def _wait_in_thread(self) -> None:
        try:
            self.work.wait()
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiting coroutine
            self._error = exc
        with self._lock:
            self._done.set()
            wakers, self._wakers = self._wakers, []
        for wake in wakers:
            wake()

    def done(self) -> bool:
        if not self._done.is_set() and self._poll:
            try:
                if self.work.is_completed():
                    self.work.wait()
                    self._done.set()
            except BaseException as exc:  # noqa: BLE001
                self._error = exc
                self._done.set()
        return self._done.is_set()

    def result(self) -> None:
        if self._error is not None:
            raise self._error

    async def wait(self, deadline: float | None) -> None:
        """Wait until done or until ``deadline`` (monotonic); :class:`PeerTimeoutError` then."""
        if self.done():
            return self.result()
        if self._poll:
            delay = 50e-6
            while not self.done():
                if deadline is not None and time.monotonic() >= deadline:
                    raise PeerTimeoutError(f"{self.what} did not complete in time")
                await anyio.sleep(delay)
                delay = min(delay * 2, 2e-3)
            return self.result()
        loop = asyncio.get_running_loop()
        event = anyio.Event()

        def wake() -> None:
            try:
                loop.call_soon_threadsafe(event.set)
            except RuntimeError:  # the loop is closed: nobody waits any more
                pass

        with self._lock:
            if self._done.is_set():
                return self.result()
            self._wakers.append(wake)
        try:
            timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
            with anyio.move_on_after(timeout):
                await event.wait()
        finally:
            with self._lock:
                if wake in self._wakers:
                    self._wakers.remove(wake)
        if not self._done.is_set():
            raise PeerTimeoutError(f"{self.what} did not complete in time")
        return self.result()


# ----------------------------------------------------------------------------- the transport


@dataclass
class DistributedStats:
    """Counters of one :class:`DistributedTransport` end (bytes include framing)."""

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
    header: torch.Tensor | None = None
    host: torch.Tensor | None = None
    dev: torch.Tensor | None = None
    body_ops: list = field(default_factory=list)


@dataclass(eq=False)
class DistributedTransport(Transport):
    """One end of a point-to-point channel to rank ``peer`` over torch.distributed.

    * ``group``: the process group for prefixes, headers and host (CPU) tensors — gloo
      (default: the world group; prefer :meth:`WeightSyncGroup.transport`, which uses a
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
        self._ctrl_threaded = _is_gloo(self.group)
        self._data_threaded = _is_gloo(self.data_group)
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
        peer reads it later, so the framing stays intact.
        """
        self._check()
        t0 = time.perf_counter()
        frame = await _encode_cached(payload, self.device)
        self.stats.encode_s += time.perf_counter() - t0
        host_n = 0 if frame.host is None else frame.host.numel()
        dev_n = 0 if frame.device is None else frame.device.numel()
        prefix = torch.tensor([MAGIC, len(frame.header), host_n, dev_n], dtype=torch.int64)
        header = torch.frombuffer(bytearray(frame.header), dtype=torch.uint8)
        if self.device is not None and not self._ctrl_threaded:  # an NCCL control group needs CUDA tensors
            prefix, header = prefix.to(self.device), header.to(self.device)
        async with self._send_lock:
            self._check()
            deadline = self._deadline()
            ops = [self._post(dist.isend, prefix, data=False, what="send (prefix)"),
                   self._post(dist.isend, header, data=False, what="send (header)")]
            if frame.host is not None:
                ops.append(self._post(dist.isend, frame.host, data=False, what="send (host body)"))
            if frame.device is not None:
                ops.append(self._post(dist.isend, frame.device, data=True, what="send (device body)"))
            for op in ops:
                await self._await(op, deadline, op.what)
        self.stats.messages_sent += 1
        self.stats.bytes_sent += frame.nbytes

    async def recv(self) -> Any:
        """Wait for the next payload. A timeout or cancellation loses nothing: the next call
        resumes the same message."""
        self._check()
        deadline = self._deadline()
        if self._incoming is None:
            prefix = torch.zeros(4, dtype=torch.int64)
            if self.device is not None and not self._ctrl_threaded:
                prefix = prefix.to(self.device)
            self._incoming = _Incoming(prefix, self._post(dist.irecv, prefix, data=False, what="recv (prefix)"))
        inc = self._incoming
        await self._await(inc.prefix_op, deadline, "recv")
        if inc.header is None:
            magic, header_n, host_n, dev_n = (int(x) for x in inc.prefix.cpu().tolist())
            if magic != MAGIC or not 0 < header_n <= MAX_HEADER_BYTES or host_n < 0 or dev_n < 0:
                err = PayloadError(f"rank {self.peer} sent a frame that is not an aiosync message "
                                   f"(prefix {[magic, header_n, host_n, dev_n]})")
                raise self._fail(err, "recv") from err
            if dev_n and self.device is None:
                err = PayloadError(f"rank {self.peer} sent {dev_n} bytes of device tensors, but this end has no "
                                   "device data group")
                raise self._fail(err, "recv") from err
            header_dev = self.device if (self.device is not None and not self._ctrl_threaded) else None
            inc.header = torch.empty(header_n, dtype=torch.uint8, device=header_dev)
            ops = [self._post(dist.irecv, inc.header, data=False, what="recv (header)")]
            if host_n:
                inc.host = torch.empty(host_n, dtype=torch.uint8)
                ops.append(self._post(dist.irecv, inc.host, data=False, what="recv (host body)"))
            if dev_n:
                inc.dev = torch.empty(dev_n, dtype=torch.uint8, device=self.device)
                ops.append(self._post(dist.irecv, inc.dev, data=True, what="recv (device body)"))
            inc.body_ops = ops
        for op in inc.body_ops:
            await self._await(op, deadline, op.what)
        self._incoming = None
        header = inc.header.cpu().numpy().tobytes()
        self.stats.messages_received += 1
        self.stats.bytes_received += 32 + len(header) + sum(b.numel() for b in (inc.host, inc.dev) if b is not None)
        return decode_message(header, inc.host, inc.dev)

    async def aclose(self) -> None:
        self.close()

    def close(self) -> None:
        """Refuse further use of this end. Posted operations are not cancelled (torch cannot);
        close both ends after a clean protocol end (see :mod:`aiosync.coordination.remote`)."""
        self.closed = True


# ----------------------------------------------------------------------------- groups


def _env_int(name: str, default: int) -> int:
    try:
        return int(os.environ.get(name, default))
    except ValueError:
        return default


@dataclass(eq=False)
class WeightSyncGroup:
    """The process groups aiosync talks over, made collectively by every rank.

    * ``group``: gloo, for frames, control messages and CPU tensors, with a long timeout so that
      an idle channel (an explorer waiting for the next version) never trips gloo's own timeout.
    * ``data_group``: NCCL on GPUs (CUDA tensors travel device to device), else ``group``.

    Build it with :meth:`init` on every rank, in the same order as other collectives.
    """

    group: Any
    data_group: Any
    backend: str
    device: torch.device | None
    timeout: float | None
    #: How each W4 communication option was honoured, e.g. ``{"use_ring_sync": "NCCL_ALGO=Ring"}``.
    comm_report: dict[str, str] = field(default_factory=dict)

    @property
    def rank(self) -> int:
        return dist.get_rank()

    @property
    def world_size(self) -> int:
        return dist.get_world_size()

    @classmethod
    def init(cls, *, backend: str = "auto", comm_options: Any = None, timeout: float | None = 600.0,
             group_timeout: timedelta = timedelta(days=1), ranks: Iterable[int] | None = None,
             init_timeout: timedelta = timedelta(seconds=300)) -> "WeightSyncGroup":
        """Create the weight-sync groups (a collective: call it on every rank).

        Initialises the default process group from the ``torchrun`` environment first if needed
        (``MASTER_ADDR`` / ``MASTER_PORT`` / ``RANK`` / ``WORLD_SIZE``). ``backend``: ``auto``
        (NCCL data when CUDA and NCCL are available, else gloo), ``gloo`` or ``nccl``.
        ``comm_options`` (:class:`aiosync.syncers.config.CommOptions`, e.g.
        ``WeightSyncerConfig.from_any(cfg).comm_options``) is honoured where the backend has it
        (W4): NCCL gets ``max_ctas`` / ``min_ctas`` in its communicator config and
        ``use_ring_sync`` as ``NCCL_ALGO=Ring`` for the weight-sync communicator; gloo has none
        of these, so they are accepted, have no effect, and ``comm_report`` says so.
        ``timeout``: the per-call bound of the transports it makes.
        """
        if not dist.is_available():
            raise TransportError("torch.distributed is not available in this torch build")
        if backend not in ("auto", "gloo", "nccl"):
            raise ConfigError(f"backend must be auto, gloo or nccl, got {backend!r}")
        if backend == "auto":
            backend = "nccl" if (torch.cuda.is_available() and dist.is_nccl_available()) else "gloo"
        if backend == "nccl" and not (torch.cuda.is_available() and dist.is_nccl_available()):
            raise ConfigError("backend nccl needs CUDA and a torch build with NCCL; use backend: gloo on CPU")
        if not dist.is_initialized():
            default = "cpu:gloo,cuda:nccl" if backend == "nccl" else "gloo"
            dist.init_process_group(default, timeout=init_timeout)
        ranks = None if ranks is None else sorted(ranks)
        report: dict[str, str] = {}
        group = dist.new_group(ranks, timeout=group_timeout, backend="gloo")
        device = None
        if backend == "nccl":
            device = torch.device("cuda", _env_int("LOCAL_RANK", 0) % max(1, torch.cuda.device_count()))
            torch.cuda.set_device(device)
            pg_options = _nccl_options(comm_options, report)
            data_group = dist.new_group(ranks, timeout=group_timeout, backend="nccl", pg_options=pg_options)
        else:
            data_group = group
            if comm_options is not None and not getattr(comm_options, "is_default", True):
                for name in ("use_ring_sync", "nccl_max_ctas", "nccl_min_ctas"):
                    value = getattr(comm_options, name)
                    if value not in (None, False):
                        report[name] = f"accepted; no effect on gloo ({name}={value})"
                log.info("aiosync: weight-sync group on gloo: %s", "; ".join(report.values()))
        return cls(group, data_group, backend, device, timeout, report)

    def transport(self, peer: int, *, timeout: float | None | str = "group", tag: int = DEFAULT_TAG
                  ) -> DistributedTransport:
        """A :class:`DistributedTransport` to ``peer`` over these groups. The peer must make the
        matching one (with this rank as its ``peer`` and the same ``tag``)."""
        t = self.timeout if timeout == "group" else timeout
        return DistributedTransport(peer, self.group, self.data_group, self.device, t, tag)

    async def broadcast(self, payload: Any = None, *, src: int, timeout: float | None | str = "group") -> Any:
        """Fan one payload out from ``src`` to every rank of the group (a collective: every rank
        calls it with the same ``src``; ``payload`` matters only on ``src``). Returns the payload
        on every rank. Awaited without blocking the loop; :class:`PeerTimeoutError` after ``timeout``.

        A collective needs every rank at once; the :class:`aiosync.Synchronizer` sends one encoded
        payload to each explorer point to point instead, so that a slow or dead explorer never
        holds the others back.
        """
        limit = self.timeout if timeout == "group" else timeout
        deadline = None if limit is None else time.monotonic() + limit
        me = dist.get_rank()
        meta = torch.zeros(4, dtype=torch.int64)
        frame = None
        if me == src:
            frame = await _encode_cached(payload, self.device)
            meta = torch.tensor([MAGIC, len(frame.header), 0 if frame.host is None else frame.host.numel(),
                                 0 if frame.device is None else frame.device.numel()], dtype=torch.int64)

        async def bcast(tensor: torch.Tensor, group: Any, what: str) -> None:
            try:
                work = dist.broadcast(tensor, src=src, group=group, async_op=True)
            except RuntimeError as exc:
                raise TransportError(f"broadcast ({what}) failed: {exc}") from exc
            op = _Op(work, tensor, f"broadcast ({what})", threaded=_is_gloo(group))
            try:
                await op.wait(deadline)
            except PeerTimeoutError:
                raise PeerTimeoutError(f"broadcast ({what}) from rank {src} timed out after {limit}s") from None
            except Exception as exc:
                raise TransportError(f"broadcast ({what}) from rank {src} failed: {exc}") from exc

        await bcast(meta, self.group, "prefix")
        magic, header_n, host_n, dev_n = (int(x) for x in meta.tolist())
        if magic != MAGIC:
            raise PayloadError(f"broadcast from rank {src} is not an aiosync message")
        header = (torch.frombuffer(bytearray(frame.header), dtype=torch.uint8) if frame is not None
                  else torch.empty(header_n, dtype=torch.uint8))
        await bcast(header, self.group, "header")
        host = frame.host if frame is not None else (torch.empty(host_n, dtype=torch.uint8) if host_n else None)
        if host is not None:
            await bcast(host, self.group, "host body")
        dev = frame.device if frame is not None else (
            torch.empty(dev_n, dtype=torch.uint8, device=self.device) if dev_n else None)
        if dev is not None:
            await bcast(dev, self.data_group, "device body")
        if me == src:
            return payload
        return decode_message(header.numpy().tobytes(), host, dev)

    def destroy(self) -> None:
        """Destroy the groups this object made (not the default group)."""
        for g in {id(self.group): self.group, id(self.data_group): self.data_group}.values():
            try:
                dist.destroy_process_group(g)
            except Exception:  # pragma: no cover - best effort at shutdown
                pass


def _nccl_options(comm_options: Any, report: dict[str, str]) -> Any:
    """ProcessGroupNCCL options carrying W4's ``nccl_max_ctas`` / ``nccl_min_ctas``; ``use_ring_sync``
    becomes ``NCCL_ALGO=Ring`` (NCCL reads it when the communicator is created, lazily, on first use)."""
    if comm_options is None or getattr(comm_options, "is_default", True):
        return None
    opts = dist.ProcessGroupNCCL.Options()
    if comm_options.nccl_max_ctas is not None:
        opts.config.max_ctas = comm_options.nccl_max_ctas
        report["nccl_max_ctas"] = f"ncclConfig.maxCTAs={comm_options.nccl_max_ctas}"
    if comm_options.nccl_min_ctas is not None:
        opts.config.min_ctas = comm_options.nccl_min_ctas
        report["nccl_min_ctas"] = f"ncclConfig.minCTAs={comm_options.nccl_min_ctas}"
    if comm_options.use_ring_sync:
        current = os.environ.get("NCCL_ALGO")
        if current and current.lower() != "ring":
            log.warning("aiosync: use_ring_sync is set but NCCL_ALGO=%s is already set; keeping it", current)
            report["use_ring_sync"] = f"NCCL_ALGO already set to {current}; not changed"
        else:
            os.environ["NCCL_ALGO"] = "Ring"
            report["use_ring_sync"] = "NCCL_ALGO=Ring"
    return opts


# ----------------------------------------------------------------------------- FSDP helper


def gather_full_state(model: torch.nn.Module, names: Iterable[str] | None = None) -> dict[str, torch.Tensor]:
    """The model's state dict with DTensors (FSDP2 shards) gathered into plain tensors.

    A collective when the model is sharded: call it on every rank of the model's mesh, in the
    same order. Use it on the trainer ranks after each step and attach the result (a mapping
    updated in place) to the synchronizer on one of them.
    """
    from ..syncers.selection import materialize

    state = model.state_dict()
    keys = list(state) if names is None else list(names)
    with torch.no_grad():
        return {k: materialize(state[k]).detach() for k in keys}
