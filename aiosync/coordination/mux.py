"""Splitting one wire into the two lanes of the explorer protocol.

:class:`Mux` is the only reader of a transport: :class:`~aiosync.coordination.protocol.Control`
messages go to its ``control`` lane, everything else (the delivery line and the syncers' init
conversation) to its ``data`` lane. Both lanes are :class:`~aiosync.transports.Transport`\\ s,
so a syncer still sees a plain ``send`` / ``recv`` pair.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from ..errors import AiosyncError, ClosedResourceError, EndOfStream, MessageError, PeerTimeoutError, TransportError
from ..messages import message_type
from ..transports.base import Transport
from .protocol import Close, Control

log = logging.getLogger("aiosync.sync")


class Lane(Transport):
    """One logical channel of a :class:`Mux`: sends go to the shared wire, receives come from
    the messages the mux routed here. ``timeout`` bounds every receive."""

    def __init__(self, mux: "Mux", rx: MemoryObjectReceiveStream, timeout: float | None) -> None:
        self.mux, self._rx, self.timeout = mux, rx, timeout

    async def send(self, payload: Any) -> None:
        await self.mux.send(payload)

    async def recv(self) -> Any:
        try:
            with anyio.fail_after(self.timeout):
                item = await self._rx.receive()
        except TimeoutError:
            raise PeerTimeoutError(f"nothing arrived from the peer within {self.timeout}s") from None
        except (anyio.EndOfStream, anyio.ClosedResourceError):
            why = f": {self.mux.error}" if self.mux.error is not None else ""
            raise EndOfStream(f"the peer's session ended{why}") from self.mux.error
        if isinstance(item, _Refused):  # a message of this lane that could not be rebuilt
            raise item.error
        return item

    async def next_message(self) -> Any | None:
        """The next message, waiting through receive timeouts (an idle peer); ``None`` once the
        session ended."""
        while True:
            try:
                return await self.recv()
            except PeerTimeoutError:
                continue
            except EndOfStream:
                return None


class _Refused:
    """In a lane's queue: a message that arrived but could not be rebuilt (its error)."""

    __slots__ = ("error",)

    def __init__(self, error: MessageError) -> None:
        self.error = error


class Mux:
    """Splits one transport (the wire) into a control lane and a data lane.

    :meth:`run` is the only reader of the wire. It ends when the peer's
    :class:`~aiosync.coordination.protocol.Close` arrives (the wire is then free for other use)
    or when the wire fails (``error`` holds why); both lanes then end with
    :class:`aiosync.errors.EndOfStream`.
    """

    def __init__(self, wire: Transport, *, timeout: float | None) -> None:
        self.wire = wire
        self._data_tx: MemoryObjectSendStream
        self._ctl_tx: MemoryObjectSendStream
        self._data_tx, data_rx = anyio.create_memory_object_stream(math.inf)
        self._ctl_tx, ctl_rx = anyio.create_memory_object_stream(math.inf)
        self.data = Lane(self, data_rx, timeout)
        self.control = Lane(self, ctl_rx, timeout)
        self.error: BaseException | None = None
        self.peer_closed = anyio.Event()
        self.close_sent = False
        self.finished = anyio.Event()
        #: messages that arrived malformed and were refused (the session went on)
        self.refused = 0
        self._send_lock = anyio.Lock()

    def set_timeout(self, timeout: float | None) -> None:
        """Bound every receive of both lanes by ``timeout`` seconds from now on."""
        self.data.timeout = self.control.timeout = timeout

    async def send(self, msg: Any) -> None:
        """Send one message. After a Close went either way, only our own Close may still go:
        anything else would never be read (and a point-to-point send nobody reads stays pending
        until the process exits)."""
        if self.error is not None:
            raise EndOfStream(f"the session is over: {self.error}") from self.error
        async with self._send_lock:
            if self.close_sent or (self.peer_closed.is_set() and not isinstance(msg, Close)):
                raise EndOfStream(f"the session is closing; not sending {type(msg).__name__}")
            if isinstance(msg, Close):
                self.close_sent = True
            await self.wire.send(msg)

    async def send_quietly(self, msg: Any) -> bool:
        """:meth:`send`, returning ``False`` instead of raising when the session or the wire is
        gone (telling a peer that may have vanished)."""
        try:
            await self.send(msg)
            return True
        except (EndOfStream, TransportError, ClosedResourceError, PeerTimeoutError) as exc:
            log.debug("aiosync: could not send %s: %s", type(msg).__name__, exc)
            return False

    def _refuse(self, exc: MessageError) -> None:
        """A message that could not be rebuilt: the data lane's reader answers for it (the delivery
        it belongs to fails, is reported and repaired); a control message is dropped (the control
        protocol bounds every wait on one)."""
        self.refused += 1
        cls = message_type(exc.message_type) if exc.message_type else None
        control = isinstance(cls, type) and issubclass(cls, Control)
        log.warning("aiosync: refused a malformed %s from the peer (%s): %s", exc.message_type or "message",
                    "dropped" if control else "reported", exc)
        if not control:
            self._data_tx.send_nowait(_Refused(exc))

    async def run(self, *, task_status: anyio.abc.TaskStatus = anyio.TASK_STATUS_IGNORED) -> None:
        """Read the wire until the peer's Close or a failure (``start()``-able)."""
        task_status.started()
        try:
            while True:
                try:
                    msg = await self.wire.recv()
                except PeerTimeoutError:
                    continue  # idle
                except MessageError as exc:  # one bad message, the framing intact: refuse it, read on
                    self._refuse(exc)
                    continue
                if isinstance(msg, Control):
                    self._ctl_tx.send_nowait(msg)
                    if isinstance(msg, Close):
                        self.peer_closed.set()
                        return
                else:
                    self._data_tx.send_nowait(msg)
        except (TransportError, EndOfStream, ClosedResourceError, OSError) as exc:
            self.error = exc
        except (AiosyncError, ValueError, TypeError) as exc:  # a malformed message: the session cannot be trusted
            self.error = exc
            log.warning("aiosync: session reader stopped: %s: %s", type(exc).__name__, exc)
        finally:
            self._data_tx.close()
            self._ctl_tx.close()
            self.finished.set()
