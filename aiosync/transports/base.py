"""The line between syncers and transports.

A syncer only ever sees two plain async callables: ``send(payload)`` and ``recv()``
(:data:`aiosync.messages.SendFn` / :data:`aiosync.messages.RecvFn`, re-exported here). A
transport is anything that provides them. Payloads are Python objects built from tensors,
bytes, numbers, strings and registered message dataclasses (:func:`aiosync.messages.message`);
an in-process transport moves them without copying, a cross-process transport serialises them.

Every end reports what went through it with :meth:`Transport.statistics`: a frozen snapshot
(:class:`TransportStatistics`, or a subclass with a transport's own counters), never the live
counters.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

from ..messages import RecvFn, SendFn, payload_nbytes

__all__ = ["Transport", "TransportStatistics", "SendFn", "RecvFn", "payload_nbytes"]

#: The names of W4's communication options (``aiosync.syncers.config.CommOptions``).
COMM_OPTION_NAMES = ("use_ring_sync", "nccl_max_ctas", "nccl_min_ctas")


@dataclass(frozen=True)
class TransportStatistics:
    """A snapshot of what one transport end sent and received (bytes as the transport counts
    them: :func:`payload_nbytes`, or bytes on the wire with framing for a serialising one)."""

    messages_sent: int = 0
    bytes_sent: int = 0
    messages_received: int = 0
    bytes_received: int = 0


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

    def use_comm_options(self, options: Any) -> dict[str, str]:
        """Use W4's communication options (``use_ring_sync``, ``nccl_max_ctas``, ``nccl_min_ctas``:
        a ``weight_syncer``'s ``comm_options``) for this channel where the backend has them;
        returns how each was honoured. The synchronizer and the explorer pass their syncer's
        options here when a channel starts. A channel that cannot honour them as asked raises
        :class:`aiosync.errors.ConfigError` saying what to change. The default: an in-process
        channel has no communicator, so the options have no effect."""
        if options is None or getattr(options, "is_default", True):
            return {}
        return {name: "no effect: this channel has no communicator" for name in COMM_OPTION_NAMES
                if getattr(options, name, None) not in (None, False)}

    async def aclose(self) -> None:  # pragma: no cover - trivial default
        """Close this endpoint. The default does nothing."""

    def statistics(self) -> TransportStatistics:
        """A frozen snapshot of this end's counters.

        The default reads the four common counters from a ``stats`` attribute; a transport
        without one must override this.
        """
        stats = getattr(self, "stats", None)
        if stats is None:
            raise NotImplementedError(f"{type(self).__name__} keeps no statistics")
        return TransportStatistics(stats.messages_sent, stats.bytes_sent, stats.messages_received,
                                   stats.bytes_received)
