"""The frame codec of the distributed transport: one message as a prefix, a JSON header and
up to two packed bodies. Point-to-point (:class:`~.transport.DistributedTransport`) and
broadcast (:meth:`~.group.WeightSyncGroup.broadcast`) both frame with it, and both read the
prefix through :meth:`Prefix.parse`, the one place it is validated.

Wire format of one message (see ``docs/distributed.md``)::

    prefix   int64[4]  MAGIC, header bytes, host-body bytes, device-body bytes   (control group)
    header   uint8[]   UTF-8 JSON: the payload's structure; tensors and bytes as references  (control group)
    host     uint8[]   CPU tensors and ``bytes``, each at a 64-byte aligned offset            (control group)
    device   uint8[]   CUDA tensors, when a device (NCCL) data group is configured           (data group)

A transport that ships large tensors on its own (the Ray transport: one object per tensor)
encodes with ``external=``: those tensors are left out of the bodies and the header refers to
external body ``i`` instead; the receiver passes them back to :func:`decode_message`.

**Shared parts** (:class:`aiosync.messages.Shared`, header version 2): a part of many messages
— one version sent to several explorers — is encoded once into a frame of its own (cached on
the ``Shared``; counted by :func:`shared_statistics`). A message holding it carries that
frame's header inline and its bodies by reference: with ``detach_shared=True`` (the
distributed transport) they leave the message as *detached bodies*, listed in the header's
``ext`` (``[bytes, on device]`` each) and sent after the message's own bodies, the same tensors
to every peer — never packed again; a transport with ``external=`` gets them offered like any
other tensor (the Ray transport puts them into the object store once); otherwise they are
packed inline. ``route`` (optional, in the header) says how detached bodies travel when not
point to point (a multicast round: :mod:`.multicast`). A received shared part is a ``Shared``
again, remembering the frame it came in, so a process that relays it sends the same bytes.

The header is JSON, never pickle: only plain values, lists, tuples, dicts, ``torch.dtype``,
tensors, ``bytes`` and *registered* dataclasses (:func:`aiosync.messages.message`; aiosync's
payload and protocol classes are registered) can travel, so a peer cannot make this process
run code. A dataclass travels as ``{"$dc": "module:qualname", "f": {field: value}}`` and is
rebuilt only if that name resolves through :func:`aiosync.messages.message_type`. dtypes
travel by name (:mod:`aiosync.dtypes`). Received tensors are views into the received body
(no copy) on the body's device.
"""

from __future__ import annotations

import dataclasses
import json
import math
import threading
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ...aio import run_sync
from ...dtypes import dtype_from_name, dtype_name
from ...errors import MessageError, PayloadError
from ...messages import Shared, is_message, message_type, payload_nbytes, type_name

__all__ = ["MAGIC", "MAX_HEADER_BYTES", "MAX_MESSAGE_BYTES", "PREFIX_BYTES", "Prefix", "Frame", "SharedStatistics",
           "allocate_frame", "encode_message", "decode_message", "read_header", "decode_doc", "encode_cached",
           "shared_statistics"]

MAGIC = 0x41494F53594E4331  # "AIOSYNC1"
#: The prefix: four int64 words.
PREFIX_WORDS = 4
PREFIX_BYTES = 8 * PREFIX_WORDS
_ALIGN = 64
#: Bodies at least this large are packed in a worker thread, not on the event loop.
_PACK_IN_THREAD = 1 << 20
#: Upper bound on a header, so a corrupt prefix cannot make us allocate gigabytes for it.
MAX_HEADER_BYTES = 256 << 20
#: Tensor entries whose body number is ``_EXTERNAL + i`` live in external body ``i`` (out of band).
_EXTERNAL = 2
#: Default upper bound on one message's bodies (host + device): a corrupt or hostile prefix cannot
#: make a receiver try to allocate more (``DistributedTransport.max_message_bytes`` changes it).
MAX_MESSAGE_BYTES = 1 << 40
#: Deepest nesting of containers a message header may hold (payloads nest a few levels).
MAX_DEPTH = 32


# ----------------------------------------------------------------------------- the prefix


@dataclass(frozen=True)
class Prefix:
    """The ``int64[4]`` that opens every message: :data:`MAGIC`, then the byte sizes of the
    header, the host body and the device body that follow it."""

    header_bytes: int
    host_bytes: int = 0
    device_bytes: int = 0

    @property
    def nbytes(self) -> int:
        """Bytes of the whole message on the wire, prefix included."""
        return PREFIX_BYTES + self.header_bytes + self.host_bytes + self.device_bytes

    def tensor(self, device: torch.device | None = None) -> torch.Tensor:
        """The prefix as it is sent."""
        return torch.tensor([MAGIC, self.header_bytes, self.host_bytes, self.device_bytes], dtype=torch.int64,
                            device=device)

    @staticmethod
    def buffer(device: torch.device | None = None) -> torch.Tensor:
        """An empty prefix to receive into."""
        return torch.zeros(PREFIX_WORDS, dtype=torch.int64, device=device)

    @classmethod
    def parse(cls, words: torch.Tensor | Sequence[int], *, sender: str, device_body: bool = True,
              max_bytes: int = MAX_MESSAGE_BYTES) -> "Prefix":
        """Validate a received prefix before anything is allocated for what follows.

        ``sender`` names the peer in the error (``"rank 3"``); ``device_body``: whether this
        end can receive a device body (it has a device data group). Raises
        :class:`aiosync.errors.PayloadError` for a wrong magic number, a header size outside
        ``(0, MAX_HEADER_BYTES]``, a negative body size, or a device body this end cannot take.
        """
        values = words.cpu().tolist() if isinstance(words, torch.Tensor) else list(words)
        if len(values) != PREFIX_WORDS:
            raise PayloadError(f"{sender} sent a prefix of {len(values)} words, not {PREFIX_WORDS}")
        magic, header_n, host_n, dev_n = (int(v) for v in values)
        shown = f"(prefix {[magic, header_n, host_n, dev_n]})"
        if magic != MAGIC:
            raise PayloadError(f"{sender} sent a frame that is not an aiosync message {shown}")
        if not 0 < header_n <= MAX_HEADER_BYTES:
            raise PayloadError(f"{sender} sent a frame whose header would be {header_n} bytes, outside "
                               f"(0, {MAX_HEADER_BYTES}]: not an aiosync message, or a corrupt one {shown}")
        if host_n < 0 or dev_n < 0:
            raise PayloadError(f"{sender} sent a frame with a negative body size: not an aiosync message {shown}")
        if host_n + dev_n > max_bytes:
            raise PayloadError(f"{sender} sent a frame whose bodies would take {host_n + dev_n} bytes, more than this "
                               f"end accepts ({max_bytes}; raise max_message_bytes if such messages are genuine) "
                               f"{shown}")
        if dev_n and not device_body:
            raise PayloadError(f"{sender} sent {dev_n} bytes of device tensors, but this end has no "
                               "device data group")
        return cls(header_n, host_n, dev_n)


def allocate_frame(announced: Prefix, header_device: torch.device | None, device: torch.device | None, *,
                   sender: str) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Buffers for the header and bodies a validated prefix announces; an allocation that fails
    (more than this process can hold) is a :class:`~aiosync.errors.PayloadError`, not a crash."""
    try:
        header = torch.empty(announced.header_bytes, dtype=torch.uint8, device=header_device)
        host = torch.empty(announced.host_bytes, dtype=torch.uint8) if announced.host_bytes else None
        dev = (torch.empty(announced.device_bytes, dtype=torch.uint8, device=device)
               if announced.device_bytes else None)
    except (RuntimeError, MemoryError) as exc:
        raise PayloadError(f"{sender} announced a frame of {announced.nbytes} bytes, which this process cannot "
                           f"allocate: {str(exc)[:200]}") from None
    return header, host, dev


@dataclass
class Frame:
    """One encoded message: the JSON header, up to two packed bodies, and the detached bodies
    of the shared parts it holds (sent after it; see the module docstring)."""

    header: bytes
    host: torch.Tensor | None
    device: torch.Tensor | None
    detached: list = dataclasses.field(default_factory=list)

    @property
    def prefix(self) -> Prefix:
        """The prefix announcing this frame."""
        return Prefix(len(self.header), 0 if self.host is None else self.host.numel(),
                      0 if self.device is None else self.device.numel())

    @property
    def nbytes(self) -> int:
        """Bytes on the wire, prefix and detached bodies included."""
        return self.prefix.nbytes + sum(t.numel() for t in self.detached)

    def header_tensor(self) -> torch.Tensor:
        """The header as the ``uint8`` tensor that is sent."""
        return torch.frombuffer(bytearray(self.header), dtype=torch.uint8)


# ----------------------------------------------------------------------------- encoding


def _round_up(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def _parse_dtype(name: Any) -> torch.dtype:
    dt = dtype_from_name(name)
    if dt is None:
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

    def __init__(self, device: torch.device | None,
                 external: "Callable[[torch.Tensor], int | None] | None" = None, detach_shared: bool = False) -> None:
        if external is not None and detach_shared:
            raise ValueError("encode with external= or with detach_shared=True, not both")
        self.device = device  # tensors on this device go to the device body
        self.external = external  # tensors it places travel out of band, in bodies of their own
        self.detach_shared = detach_shared  # bodies of shared parts travel after the frame
        self.detached: list[torch.Tensor] = []
        self.shared = False
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
            return {"$dtype": dtype_name(obj)}
        if isinstance(obj, Shared):
            self.shared = True
            frame = shared_frame(obj, self.device)
            return {"$shared": [self.encode(frame.header), self._body(frame.host), self._body(frame.device)]}
        if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            if not is_message(obj):
                raise PayloadError(
                    f"cannot send a {type(obj).__name__}: it is not a registered message type; "
                    "register it with @aiosync.messages.message")
            fields = {f.name: self.encode(getattr(obj, f.name)) for f in dataclasses.fields(obj) if f.init}
            return {"$dc": type_name(type(obj)), "f": fields}
        raise PayloadError(f"cannot send a {type(obj).__name__} over a process boundary: send tensors, bytes, "
                           "numbers, strings, lists, tuples, dicts or registered dataclasses")

    def _body(self, body: torch.Tensor | None) -> int | None:
        """A body of a shared part's frame: detached (sent after this frame, the same tensor to
        every peer), or a tensor of this message like any other."""
        if body is None:
            return None
        if self.detach_shared:
            self.detached.append(body)
            self.tensors.append([_EXTERNAL + len(self.detached) - 1, 0, body.numel(), "uint8", [body.numel()]])
            return len(self.tensors) - 1
        return self._tensor(body)

    def _tensor(self, t: torch.Tensor) -> int:
        original, t = t, _plain_tensor(t)
        nbytes = t.numel() * t.element_size()
        body = None if self.external is None else self.external(original)  # the caller's object, by identity
        if body is not None:
            self.tensors.append([_EXTERNAL + body, 0, nbytes, dtype_name(t.dtype), list(t.shape)])
            return len(self.tensors) - 1
        on_device = self.device is not None and t.device.type == self.device.type
        if on_device:
            off = self.dev_size
            self.dev.append((off, t))
            self.dev_size = _round_up(off + nbytes)
        else:
            off = self.host_size
            self.host.append((off, t))
            self.host_size = _round_up(off + nbytes)
        self.tensors.append([1 if on_device else 0, off, nbytes, dtype_name(t.dtype), list(t.shape)])
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


def encode_message(payload: Any, device: torch.device | None = None, *,
                   external: "Callable[[torch.Tensor], int | None] | None" = None, detach_shared: bool = False,
                   route: Any = None) -> Frame:
    """Encode ``payload`` into a :class:`Frame`. Tensors on ``device`` (a CUDA device) go to the
    device body; every other tensor, and ``bytes``, to the host body.

    ``external(tensor)`` (optional) may place a tensor *out of band*: it returns the index of
    an external body that will carry exactly that tensor's bytes (the caller ships those bodies
    itself, e.g. as Ray objects), or ``None`` to pack it as usual. The header then refers to
    external body ``i``; :func:`decode_message` takes the bodies as ``externals``.

    Shared parts (:class:`aiosync.messages.Shared`) are encoded once and reused; with
    ``detach_shared`` their bodies become :attr:`Frame.detached` (listed in the header's ``ext``),
    which the receiver passes back as ``externals``. ``route`` (any JSON value) is carried in the
    header for the transport (:func:`read_header` returns it)."""
    enc = _Encoder(device, external, detach_shared)
    tree = enc.encode(payload)
    doc: dict[str, Any] = {"v": 1, "tree": tree, "tensors": enc.tensors}
    if enc.shared or route is not None:
        doc["v"] = 2
        doc["ext"] = [[t.numel(), 1 if (device is not None and t.device.type == device.type) else 0]
                      for t in enc.detached]
        if route is not None:
            doc["route"] = route
    header = json.dumps(doc, separators=(",", ":"), allow_nan=False).encode()
    host, dev = enc.pack()
    return Frame(header, host, dev, enc.detached)



# ----------------------------------------------------------------------------- decoding


class _Decoder:
    def __init__(self, tensors: list, host: torch.Tensor | None, dev: torch.Tensor | None,
                 externals: Sequence[torch.Tensor] = ()) -> None:
        self.entries = tensors
        self.host, self.dev = host, dev
        self.externals = externals

    def _body(self, which: int) -> torch.Tensor:
        if isinstance(which, int) and which >= _EXTERNAL:
            if which - _EXTERNAL >= len(self.externals):
                raise PayloadError(f"message references external body {which - _EXTERNAL}, which it does not carry")
            return self.externals[which - _EXTERNAL]
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
        if numel * dtype.itemsize != nbytes:
            raise PayloadError(f"tensor entry {index}: {nbytes} bytes do not hold {shape} of {dtype}")
        body = self._body(which)
        if not (isinstance(off, int) and off >= 0 and off % _ALIGN == 0 and off + nbytes <= body.numel()):
            raise PayloadError(f"tensor entry {index}: bytes [{off}, {off}+{nbytes}) lie outside the body")
        if nbytes == 0:
            return torch.empty(shape, dtype=dtype, device=body.device)
        at = body.storage_offset() + off  # bytes (a body is uint8)
        if body.dtype != torch.uint8 or at % dtype.itemsize or not body.is_contiguous():  # an odd external body
            return body[off:off + nbytes].view(dtype).reshape(shape)
        # On the body's storage, not a view of the body tensor: once the message is decoded only
        # its tensors hold the bytes, so whoever drops them last can give the body back whole
        # (aiosync.reclaim) instead of freeing it, GIL held, with the last of them.
        return torch.empty(0, dtype=dtype, device=body.device).set_(body.untyped_storage(), at // dtype.itemsize, shape)

    def decode(self, node: Any, depth: int = 0) -> Any:
        if depth > MAX_DEPTH:
            raise PayloadError(f"message header nests deeper than {MAX_DEPTH} levels (malformed)")
        if node is None or isinstance(node, (bool, int, float, str)):
            return node
        depth += 1
        if isinstance(node, list):
            return [self.decode(v, depth) for v in node]
        if not isinstance(node, dict) or len(node) not in (1, 2):
            raise PayloadError(f"malformed message header node {str(node)[:80]!r}")
        if "$t" in node:
            return self.tensor(node["$t"])
        if "$tuple" in node:
            return tuple(self.decode(v, depth) for v in node["$tuple"])
        if "$dict" in node:
            out = {}
            for pair in node["$dict"]:
                if not (isinstance(pair, list) and len(pair) == 2):
                    raise PayloadError("malformed dict entry in message header")
                key = self.decode(pair[0], depth)
                try:
                    out[key] = self.decode(pair[1], depth)
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
        if "$shared" in node:
            return self._shared(node["$shared"], depth)
        if "$dc" in node:
            return self._dataclass(node, depth)
        raise PayloadError(f"unknown node {sorted(node)} in message header")

    def _shared(self, node: Any, depth: int) -> Shared:
        if not (isinstance(node, list) and len(node) == 3):
            raise PayloadError("malformed shared part in message header")
        header = self.decode(node[0], depth)
        if not isinstance(header, bytes):
            raise PayloadError("a shared part's header is not a byte string")
        host, dev = (None if n is None else self.tensor(n) for n in node[1:])
        value = decode_message(header, host, dev)
        if isinstance(value, Shared):
            raise PayloadError("a shared part holds another shared part")
        shared = Shared(value)
        device = None if dev is None else dev.device
        shared.encoded[_cache_key(device)] = _Relay(Frame(header, host, dev))  # a relay sends these bytes again
        return shared

    def _dataclass(self, node: dict, depth: int) -> Any:
        name = node["$dc"]
        cls = message_type(name) if isinstance(name, str) else None
        if cls is None:
            raise PayloadError(f"message holds a {name!r}, which is not a registered message type on this side "
                               "(@aiosync.messages.message)")
        fields = node.get("f")
        if not isinstance(fields, dict):
            raise PayloadError("malformed dataclass node in message header")
        try:
            return cls(**{k: self.decode(v, depth) for k, v in fields.items()})
        except TypeError as exc:
            raise PayloadError(f"cannot rebuild {cls.__name__} from the message: {exc}") from None


def read_header(header: bytes) -> dict:
    """Parse and check a received header's outer layout (version 1 or 2). For version 2 the
    ``ext`` list (detached bodies: ``[bytes, on device]`` each) is validated too; a transport
    receives those bodies before it calls :func:`decode_doc`."""
    try:
        doc = json.loads(header.decode())
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:  # ValueError: an integer of thousands of digits
        raise MessageError(f"message header is not valid JSON: {type(exc).__name__}: {str(exc)[:200]}") from None
    if not isinstance(doc, dict) or doc.get("v") not in (1, 2) or not isinstance(doc.get("tensors"), list):
        raise MessageError("message header has an unknown layout (not an aiosync v1 or v2 message)")
    ext = doc.get("ext", [])
    if not isinstance(ext, list) or not all(
            isinstance(e, list) and len(e) == 2 and all(isinstance(v, int) and not isinstance(v, bool) for v in e)
            and 0 <= e[0] <= MAX_MESSAGE_BYTES and e[1] in (0, 1) for e in ext):
        raise MessageError("message header lists malformed detached bodies")
    doc["ext"] = ext
    return doc


def decode_doc(doc: dict, host: torch.Tensor | None = None, device: torch.Tensor | None = None, *,
               externals: Sequence[torch.Tensor] = ()) -> Any:
    """Rebuild a payload from a header read by :func:`read_header` and its bodies; a message that
    cannot be rebuilt is a :class:`~aiosync.errors.MessageError` naming what it claimed to be."""
    try:
        return _Decoder(doc["tensors"], host, device, externals).decode(doc.get("tree"))
    except PayloadError as exc:
        raise _refused(doc, str(exc)) from None
    except (TypeError, ValueError, KeyError, IndexError, RuntimeError, OverflowError, RecursionError) as exc:
        raise _refused(doc, f"malformed message: {type(exc).__name__}: {str(exc)[:200]}") from None


def _refused(doc: dict, why: str) -> MessageError:
    """The error for a message that could not be rebuilt, naming what it claimed to be."""
    tree = doc.get("tree")
    name = tree.get("$dc") if isinstance(tree, dict) else None
    fields = tree.get("f") if isinstance(tree, dict) else None
    plain = {}
    if isinstance(fields, dict):
        for key in ("version", "conv"):
            value = fields.get(key)
            if type(value) is int and 0 <= value < 1 << 63:
                plain[key] = value
    return MessageError(why, message_type=name if isinstance(name, str) else None, **plain)


def decode_message(header: bytes, host: torch.Tensor | None = None, device: torch.Tensor | None = None, *,
                   externals: Sequence[torch.Tensor] = ()) -> Any:
    """Rebuild a payload from a header and its bodies (inverse of :func:`encode_message`);
    ``externals``: the out-of-band bodies (or the detached ones), one ``uint8`` tensor per
    external tensor, in the order ``external`` numbered them."""
    return decode_doc(read_header(header), host, device, externals=externals)


# ----------------------------------------------------------------------------- shared parts


@dataclass(frozen=True)
class SharedStatistics:
    """Shared parts of this process: ``encodes`` (frames built), ``reuses`` (messages that sent
    an already built frame), ``relayed`` (sent as the bytes they were received in)."""

    encodes: int
    reuses: int
    relayed: int


@dataclass(frozen=True)
class _Relay:
    """The frame a shared part was received in (sent on as it is)."""

    frame: Frame


_SHARED = {"encodes": 0, "reuses": 0, "relayed": 0}
_SHARED_LOCK = threading.Lock()


def _cache_key(device: torch.device | None) -> tuple:
    return ("wire", None if device is None else device.type)


def shared_frame(shared: Shared, device: torch.device | None) -> Frame:
    """The frame of ``shared`` for ``device``: built once (the first message that sends it),
    then reused; a received part goes out as the frame it came in."""
    key = _cache_key(device)
    with _SHARED_LOCK:
        frame = shared.encoded.get(key)
        if frame is not None:
            relayed = isinstance(frame, _Relay)
            _SHARED["relayed" if relayed else "reuses"] += 1
            return frame.frame if relayed else frame
        frame = encode_message(shared.value, device)
        if frame.detached:  # pragma: no cover - encode_message without detach_shared packs them inline
            raise PayloadError("a shared part's frame has detached bodies")
        shared.encoded[key] = frame
        _SHARED["encodes"] += 1
        return frame


def shared_statistics() -> SharedStatistics:
    """Counters of shared parts in this process (see :class:`SharedStatistics`)."""
    with _SHARED_LOCK:
        return SharedStatistics(**_SHARED)


# ----------------------------------------------------------------------------- fan-out cache

#: Encoded frames of payloads sent to several peers (fan-out), keyed by the payload object.
_FRAME_CACHE: "weakref.WeakKeyDictionary[Any, tuple[Any, Frame]]" = weakref.WeakKeyDictionary()


async def encode_cached(payload: Any, device: torch.device | None, *, detach_shared: bool = False,
                        route: Any = None) -> Frame:
    """Encode ``payload`` (in a worker thread when it is large, so the event loop never packs
    big bodies); a payload object sent again (to another explorer) reuses its frame. Shared
    parts inside it are encoded once however many payloads hold them."""
    key = (device, detach_shared)
    try:
        hit = None if route is not None else _FRAME_CACHE.get(payload)
    except TypeError:  # not weak-referenceable / hashable: never cached
        hit = None
    if hit is not None and hit[0] == key:
        return hit[1]
    if payload_nbytes(payload) >= _PACK_IN_THREAD:
        frame = await run_sync(lambda: encode_message(payload, device, detach_shared=detach_shared, route=route))
    else:
        frame = encode_message(payload, device, detach_shared=detach_shared, route=route)
    if route is None and dataclasses.is_dataclass(payload) and not isinstance(payload, type):
        try:
            _FRAME_CACHE[payload] = (key, frame)
        except TypeError:
            pass
    return frame
