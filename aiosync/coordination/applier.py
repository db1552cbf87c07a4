"""The explorer's side of its delivery line: :class:`Applier`.

Its :meth:`Applier.run` task is the explorer's background apply task. For every
:class:`~aiosync.coordination.protocol.Packet` (and every re-bootstrap,
:class:`~aiosync.coordination.protocol.Reinit`) it

1. **stages** the delivery outside the exclusive section (F3): the init conversation, the
   download of bootstrap buckets, decompression and validation all run while rollouts keep
   leasing the model — a slow or hung peer never holds rollouts back;
2. **writes** it through :meth:`aiosync.PolicySlot.apply`: the only part that holds the model
   exclusively, all-or-nothing, committing the version only once the whole write succeeded;
3. answers with an :class:`~aiosync.coordination.protocol.Ack` (the version now held, or why
   the delivery was refused — a refusal leaves weights and version as they were).

It also answers whole-state checks (:class:`~aiosync.coordination.protocol.Verify`): the model
is digested in a worker thread, read only, and the tensors that differ from the trainer's are
named (:mod:`aiosync.coordination.verify`).

A syncer that cannot stage (a custom one without ``supports_staging``) still works: its whole
``init_receiver`` / ``apply`` runs inside the exclusive section, with a slot backup for rollback.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import anyio

from ..errors import (AiosyncError, ApplyError, ClosedResourceError, EndOfStream, MessageError, PayloadError,
                      PeerTimeoutError)
from ..messages import type_name
from ..syncers.base import CommitTarget, ReceiverHost, StagedWrite, WeightSyncer
from ..syncers.factory import SyncerFactory
from ..syncers.common.state_dicts import module_state_dict
from ..transports.base import Transport
from .protocol import Abort, Ack, Credit, Packet, Part, Reinit, Verify
from .slots import PolicySlot
from .verify import answer_verify

log = logging.getLogger("aiosync.sync")


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _unstageable(receiver: WeightSyncer) -> ApplyError:
    return ApplyError(f"{type(receiver).__name__} cannot stage, and this explorer's model is a CommitTarget (an "
                      "inference engine) that only a staged write can update; use the patch or bucket syncer")


@dataclass(eq=False)
class Applier:
    """Receives an explorer's deliveries and applies them through its :class:`PolicySlot`.

    ``timeout`` bounds one delivery's staging (a vanished peer) and its wait for the model.
    ``on_busy_change(busy)`` is told when a delivery starts and ends.
    """

    name: str
    slot: PolicySlot
    transport: Transport
    syncers: SyncerFactory
    timeout: float = 600.0
    on_busy_change: Callable[[bool], None] | None = None
    receiver: WeightSyncer | None = None
    busy: bool = False
    #: A Reinit that arrived in the middle of an init conversation: handled next.
    _next: Any = field(default=None, repr=False)
    #: The init conversation in progress (:attr:`Reinit.conv`).
    _conv: int | None = field(default=None, repr=False)

    async def run(self, *, task_status: anyio.abc.TaskStatus = anyio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        while True:
            ack = None
            if self._next is not None:
                msg, self._next = self._next, None
            else:
                try:
                    msg = await self.transport.recv()
                except PeerTimeoutError:
                    continue  # idle: nothing to apply
                except (EndOfStream, ClosedResourceError):
                    return
                except MessageError as exc:  # one malformed delivery: refuse it and go on
                    ack = self._malformed(exc)
                    if ack is None:
                        continue
            if ack is None and isinstance(msg, Verify):  # whole-state verification: read only
                ack = await answer_verify(msg, self.slot.model, self.slot.version, self.name)
            if ack is None:
                if not isinstance(msg, (Reinit, Packet)):
                    log.debug("aiosync: %s skipped a stray %s", self.name, type(msg).__name__)
                    continue
                self._set_busy(True)
                try:
                    ack = await (self._reinit(msg) if isinstance(msg, Reinit) else self._packet(msg))
                finally:
                    self._set_busy(False)
            try:
                await self.transport.send(ack)
            except (EndOfStream, ClosedResourceError):
                return
            except Exception as exc:  # the line times out and repairs; the apply loop goes on
                log.warning("aiosync: %s could not acknowledge version %d: %s", self.name, ack.version, exc)

    def _malformed(self, exc: MessageError) -> Ack | None:
        """The refusal of a delivery message that arrived malformed: an error Ack for the version
        (and init conversation) it names, so the synchronizer fails that delivery at once and
        repairs; ``None`` when it names none (its delivery then runs out its bound)."""
        log.warning("aiosync: %s refused a malformed %s: %s", self.name, exc.message_type or "message", exc)
        if exc.version is None or exc.message_type not in (type_name(Packet), type_name(Reinit)):
            return None
        conv = exc.conv if exc.message_type == type_name(Reinit) else None
        return Ack(exc.version, self.slot.version, _describe(exc), conv=conv)

    def _set_busy(self, busy: bool) -> None:
        self.busy = busy
        if self.on_busy_change is not None:
            self.on_busy_change(busy)

    # -- one delivery ------------------------------------------------------------------

    async def _packet(self, msg: Packet) -> Ack:
        receiver = self.receiver
        if receiver is None:
            return self._refused(msg.version, PayloadError("received weights before the syncer pair was initialised"))
        if not receiver.supports_staging:
            if isinstance(self.slot.model, CommitTarget):
                return self._refused(msg.version, _unstageable(receiver))
            # An all-or-nothing apply (supports_no_wait) needs no backup.
            return await self._unstaged(msg.version, lambda model: self._apply_packet(model, receiver, msg),
                                        backup=False if receiver.supports_no_wait else None)
        return await self._staged(msg.version, lambda: self._stage_packet(receiver, msg), allow_same=False)

    def _make_receiver(self, bootstrap: bool) -> WeightSyncer:
        """A fresh receiver syncer; for a model that hosts its receiver elsewhere (a server),
        the syncer that forwards to it."""
        receiver = self.syncers.make(bootstrap)
        model = self.slot.model
        return model.host_receiver(receiver) if isinstance(model, ReceiverHost) else receiver

    async def _reinit(self, msg: Reinit) -> Ack:
        receiver = self._make_receiver(msg.bootstrap)
        self._conv = msg.conv
        if not receiver.supports_staging and isinstance(self.slot.model, CommitTarget):
            ack = self._refused(msg.version, _unstageable(receiver))
        elif not receiver.supports_staging:
            ack = await self._unstaged(msg.version, lambda model: self._reinit_inside(model, receiver, msg),
                                       backup=None, allow_same=True)
        else:
            async def stage() -> StagedWrite:
                model = self.slot.model  # a ReceiverHost's own syncer reads nothing here
                await receiver.stage_init(model if isinstance(model, ReceiverHost) else module_state_dict(model),
                                          self._conversation_recv, self.transport.send)
                return await self._stage_packet(receiver, await self._conversation_packet(msg))

            ack = await self._staged(msg.version, stage, allow_same=True)
        if ack.error is None:
            self.receiver = receiver
        ack.conv = msg.conv
        return ack

    async def _staged(self, version: int, stage: Callable[[], Awaitable[StagedWrite]], *, allow_same: bool) -> Ack:
        """Stage outside the exclusive section, then write inside it."""
        t0 = time.perf_counter()
        try:
            with anyio.fail_after(self.timeout):
                staged = await stage()
        except TimeoutError:
            return self._refused(version, PeerTimeoutError(
                f"receiving version {version} took longer than {self.timeout}s (the peer stopped sending?)"), t0)
        except Exception as exc:  # refused before anything was written
            return self._refused(version, exc, t0)
        t1 = time.perf_counter()
        rollback = self.slot.version is not None  # nothing to protect before the first version

        async def write(model: Any) -> int:
            return await staged.write(model, rollback=rollback)

        try:
            applied = await self.slot.apply(write, backup=False, allow_same=allow_same, version=staged.version,
                                            timeout=self.timeout)
        except (ApplyError, PeerTimeoutError) as exc:
            return self._refused(version, exc, t0)
        st = self.slot.stats
        return Ack(version, applied, None, time.perf_counter() - t0, stage_s=t1 - t0, write_s=st.last_exclusive_s,
                   lease_wait_s=st.last_lock_wait_s)

    async def _unstaged(self, version: int, write: Callable[[Any], Awaitable[int]], *, backup: bool | None,
                        allow_same: bool = False) -> Ack:
        """A syncer that cannot stage: everything runs inside the exclusive section."""
        t0 = time.perf_counter()

        async def bounded(model: Any) -> int:
            with anyio.fail_after(self.timeout):
                return await write(model)

        try:
            applied = await self.slot.apply(bounded, backup=backup, allow_same=allow_same, timeout=self.timeout)
        except (ApplyError, PeerTimeoutError) as exc:
            return self._refused(version, exc, t0)
        st = self.slot.stats
        return Ack(version, applied, None, time.perf_counter() - t0, write_s=st.last_exclusive_s,
                   lease_wait_s=st.last_lock_wait_s)

    def _refused(self, version: int, exc: BaseException, t0: float | None = None) -> Ack:
        took = 0.0 if t0 is None else time.perf_counter() - t0
        if not isinstance(exc, AiosyncError):
            log.warning("aiosync: %s: applying version %d raised %s", self.name, version, _describe(exc))
        return Ack(version, self.slot.version, _describe(exc), took)

    # -- reading a packet --------------------------------------------------------------

    def _packet_recv(self, receiver: WeightSyncer, packet: Packet):
        """``(recv, check)``: ``recv`` hands the packet's payloads to the syncer one by one;
        ``check()`` raises if the syncer left some unused."""
        if packet.parts is not None:
            return self._stream_recv(packet)
        expected = getattr(receiver, "payloads_per_sync", None)
        if not isinstance(packet.payloads, list) or (expected is not None and len(packet.payloads) != expected):
            n = len(packet.payloads) if isinstance(packet.payloads, list) else "no list of"
            raise PayloadError(f"sync packet of version {packet.version} holds {n} payloads, expected {expected} "
                               "(truncated or duplicated)")
        payloads = iter(packet.payloads)
        used = 0

        async def recv() -> Any:
            nonlocal used
            try:
                item = next(payloads)
            except StopIteration:
                raise PayloadError(f"sync packet of version {packet.version} is truncated: the syncer asked for "
                                   f"payload {used + 1} of {len(packet.payloads)}") from None
            used += 1
            return item

        def check() -> None:
            if used != len(packet.payloads):
                raise PayloadError(f"sync packet of version {packet.version} has {len(packet.payloads) - used} "
                                   "unused payload(s)")

        return recv, check

    def _stream_recv(self, packet: Packet):
        """:meth:`_packet_recv` of a streamed packet: each part is received when the syncer asks
        for it, after a :class:`Credit` for the one before (it is done with it): about one part
        is held at a time, and the sender sends no faster than the syncer stages."""
        parts, used = packet.parts, 0
        if not isinstance(parts, int) or isinstance(parts, bool) or parts < 1:
            raise PayloadError(f"streamed packet of version {packet.version} announces {parts!r} parts")

        async def recv() -> Any:
            nonlocal used
            if used >= parts:
                raise PayloadError(f"streamed packet of version {packet.version} is truncated: the syncer asked for "
                                   f"part {used + 1} of {parts}")
            if used:
                await self.transport.send(Credit(packet.version, used - 1))
            while True:
                msg = await self._conversation_recv()  # a Reinit or Abort here ends the delivery
                if isinstance(msg, Part) and msg.version == packet.version and msg.index == used:
                    used += 1
                    return msg.payload
                log.debug("aiosync: %s skipped a stray %s while receiving a streamed packet", self.name,
                          type(msg).__name__)

        def check() -> None:
            if used != parts:
                raise PayloadError(f"streamed packet of version {packet.version} has {parts - used} unused part(s)")

        return recv, check

    async def _stage_packet(self, receiver: WeightSyncer, packet: Packet) -> StagedWrite:
        recv, check = self._packet_recv(receiver, packet)
        staged = await receiver.stage(self.slot.model, recv)
        check()
        if staged.version != packet.version:
            raise PayloadError(f"sync packet of version {packet.version} carries version {staged.version}")
        return staged

    async def _apply_packet(self, model: Any, receiver: WeightSyncer, packet: Packet) -> int:
        recv, check = self._packet_recv(receiver, packet)
        version = await receiver.apply(model, recv)
        check()
        return version

    # -- the init conversation ---------------------------------------------------------

    async def _conversation_recv(self) -> Any:
        while True:
            msg = await self.transport.recv()
            if isinstance(msg, Abort):
                if msg.conv != self._conv:
                    continue  # a late Abort of an earlier conversation
                raise PayloadError(f"the synchronizer aborted the bootstrap of version {msg.version}: {msg.reason}")
            if isinstance(msg, Reinit):
                # The synchronizer started over (it gave up waiting for this one): abandon this
                # conversation and take the new one next.
                self._next = msg
                raise PayloadError(f"the synchronizer restarted the bootstrap (version {msg.version}); "
                                   "this one was abandoned")
            return msg

    async def _conversation_packet(self, msg: Reinit) -> Packet:
        """This conversation's Packet: the next thing the synchronizer sends after its init."""
        while True:
            packet = await self._conversation_recv()
            if isinstance(packet, Packet) and packet.version == msg.version:
                return packet
            # A late message of an earlier conversation or delivery (a duplicate, a reordered one).
            log.debug("aiosync: %s skipped a stale %s after its init conversation", self.name, type(packet).__name__)

    async def _reinit_inside(self, model: Any, receiver: WeightSyncer, msg: Reinit) -> int:
        """The unstaged re-bootstrap of a syncer that cannot stage."""
        await receiver.init_receiver(module_state_dict(model), self._conversation_recv, self.transport.send)
        return await self._apply_packet(model, receiver, await self._conversation_packet(msg))
