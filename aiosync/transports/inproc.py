"""In-process transport (T1): payloads are handed over by reference, never copied."""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from ..errors import ClosedResourceError, EndOfStream, PeerTimeoutError, WouldBlock
from .base import Transport, TransportStatistics, payload_nbytes


@dataclass
class TransportStats:
    """The live counters of a transport endpoint (read them through ``statistics()``)."""

    messages_sent: int = 0
    bytes_sent: int = 0
    messages_received: int = 0
    bytes_received: int = 0


@dataclass(eq=False)
class InProcTransport(Transport):
    """One end of an in-process channel pair made by :func:`inproc_pair`.

    ``timeout`` bounds every wait (``recv``, and ``send`` when the buffer is full);
    ``None`` waits forever and is meant for tests only.
    """

    _tx: MemoryObjectSendStream
    _rx: MemoryObjectReceiveStream
    timeout: float | None = 600.0
    count_bytes: bool = True
    stats: TransportStats = field(default_factory=TransportStats)

    async def send(self, payload: Any) -> None:
        with _send_errors():
            try:
                with anyio.fail_after(self.timeout):
                    await self._tx.send(payload)
            except TimeoutError as exc:
                raise PeerTimeoutError(f"send timed out after {self.timeout}s: the peer is not receiving") from exc
        self._count_sent(payload)

    def send_nowait(self, payload: Any) -> None:
        """Send without waiting; raises :class:`aiosync.errors.WouldBlock` if the buffer is full."""
        with _send_errors():
            try:
                self._tx.send_nowait(payload)
            except anyio.WouldBlock as exc:
                raise WouldBlock("the channel buffer is full") from exc
        self._count_sent(payload)

    def _count_sent(self, payload: Any) -> None:
        self.stats.messages_sent += 1
        if self.count_bytes:
            self.stats.bytes_sent += payload_nbytes(payload)

    async def recv(self) -> Any:
        try:
            with anyio.fail_after(self.timeout):
                payload = await self._rx.receive()
        except TimeoutError as exc:
            raise PeerTimeoutError(f"recv timed out after {self.timeout}s: nothing arrived from the peer") from exc
        except anyio.EndOfStream as exc:
            raise EndOfStream("the peer closed the channel") from exc
        except anyio.ClosedResourceError as exc:
            raise ClosedResourceError("recv on a closed channel") from exc
        self.stats.messages_received += 1
        if self.count_bytes:
            self.stats.bytes_received += payload_nbytes(payload)
        return payload

    def statistics(self) -> TransportStatistics:
        """A frozen snapshot of this end's counters."""
        s = self.stats
        return TransportStatistics(s.messages_sent, s.bytes_sent, s.messages_received, s.bytes_received)

    async def aclose(self) -> None:
        await self._tx.aclose()
        await self._rx.aclose()

    def close(self) -> None:
        """Close both directions of this end without waiting."""
        self._tx.close()
        self._rx.close()


@contextmanager
def _send_errors():
    """Translate anyio's stream errors on send into aiosync's."""
    try:
        yield
    except anyio.BrokenResourceError as exc:
        raise EndOfStream("the peer closed its end of the channel") from exc
    except anyio.ClosedResourceError as exc:
        raise ClosedResourceError("send on a closed channel") from exc


def inproc_pair(
    *, max_buffer_size: float = math.inf, timeout: float | None = 600.0
) -> tuple[InProcTransport, InProcTransport]:
    """Two connected endpoints: what one sends, the other receives, by reference."""
    a_tx, b_rx = anyio.create_memory_object_stream(max_buffer_size)
    b_tx, a_rx = anyio.create_memory_object_stream(max_buffer_size)
    return InProcTransport(a_tx, a_rx, timeout), InProcTransport(b_tx, b_rx, timeout)
