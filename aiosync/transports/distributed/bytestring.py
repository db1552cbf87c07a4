"""One aiosync message as one byte string (an HTTP body): :func:`frame_bytes` and
:func:`message_from_bytes`, over the frame codec of :mod:`.wire` (prefix, JSON header, host
body, detached bodies; never pickle). Host bodies only: a device tensor is moved by the caller."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from ...errors import PayloadError
from .wire import _ALIGN, MAX_MESSAGE_BYTES, PREFIX_BYTES, Frame, Prefix, decode_doc, read_header

__all__ = ["frame_bytes", "message_from_bytes"]


def frame_bytes(frame: Frame) -> bytes:
    """A frame as one byte string: prefix, header, host body, then its detached bodies. Device
    bodies cannot travel this way (a :class:`~aiosync.errors.PayloadError`)."""
    if frame.device is not None or any(t.device.type != "cpu" for t in frame.detached):
        raise PayloadError("a message with device tensors cannot travel as one byte string; move them to the CPU")
    # JSON allows trailing spaces: padding the header puts every body at a 64-byte offset
    header = frame.header + b" " * (-(PREFIX_BYTES + len(frame.header)) % _ALIGN)
    frame = dataclasses.replace(frame, header=header)
    parts = [frame.prefix.tensor().numpy().tobytes(), header]
    parts += [t.numpy() for t in ([frame.host] if frame.host is not None else []) + list(frame.detached)]
    return b"".join(parts)


def message_from_bytes(data: bytes | bytearray | memoryview, *, sender: str,
                       max_bytes: int = MAX_MESSAGE_BYTES) -> Any:
    """The payload of :func:`frame_bytes`: every size is checked against ``data`` before
    anything is read; received tensors are views into ``data`` (a ``bytearray`` keeps them
    writable). ``sender`` names the peer in errors (:class:`~aiosync.errors.MessageError`,
    :class:`~aiosync.errors.PayloadError`)."""
    buf = torch.frombuffer(data if isinstance(data, bytearray) else bytearray(data), dtype=torch.uint8) \
        if len(data) else torch.empty(0, dtype=torch.uint8)
    if buf.numel() < PREFIX_BYTES:
        raise PayloadError(f"{sender} sent {buf.numel()} bytes, fewer than an aiosync message's prefix")
    announced = Prefix.parse(buf[:PREFIX_BYTES].view(torch.int64), sender=sender, device_body=False,
                             max_bytes=max_bytes)
    end = PREFIX_BYTES + announced.header_bytes
    doc = read_header(buf[PREFIX_BYTES:end].numpy().tobytes())
    host = buf[end:end + announced.host_bytes] if announced.host_bytes else None
    end += announced.host_bytes
    detached = []
    for nbytes, on_device in doc["ext"]:
        if on_device:
            raise PayloadError(f"{sender} sent a shared device body in a byte string")
        detached.append(buf[end:end + nbytes])
        end += nbytes
    if end != buf.numel():
        raise PayloadError(f"{sender} sent {buf.numel()} bytes, but the message they frame takes {end} "
                           "(truncated or padded)")
    return decode_doc(doc, host, externals=detached)
