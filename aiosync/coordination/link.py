"""One trainer → explorer delivery line: the synchronizer-side :class:`SenderLink` and the
explorer-side :class:`ReceiverEndpoint`, talking only through a transport.

Per explorer, the link runs one task (the "synchronizer task" of the design):

    request ──▶ LatestSlot (≤ 1 pending, latest wins) ──▶ serve: borrow newest weights from the
    source, build with the sender syncer, send one Packet, wait for the explorer's Ack

so at most one delivery is in flight and one request pending; a request made while a
delivery is in flight is merged into the pending one, which resolves the *newest* weights
when its turn comes — the newest version is never dropped. Messages on the wire:

* :class:`Packet` — every payload of one ``syncer.sync`` call, applied as one unit;
* :class:`Reinit` — (re)bootstrap: the syncer pair's init conversation, then a Packet;
* :class:`Abort` — the synchronizer gave up a Reinit half way (the explorer rolls back);
* :class:`Ack` — explorer → synchronizer: the version now applied, or why applying failed.

The receiver applies a Packet only after it fully arrived, inside
:meth:`aiosync.PolicySlot.apply`, so a rollout never sees a partly applied version. A failed
delivery leaves the explorer at its previous version and marks the link for a re-bootstrap
on the next request (B3: the patch chain is repaired, not silently broken).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import anyio

from ..errors import (
    ApplyError,
    ClosedResourceError,
    EndOfStream,
    PayloadError,
    PeerTimeoutError,
)
from ..syncers.base import WeightSyncer
from ..syncers.payloads import ReceiverMetadata
from ..syncers.selection import module_state_dict
from ..transports.base import Transport, payload_nbytes
from .fanout import receiver_key, restamp as _restamp
from .metrics import RunningStat
from .slots import LatestSlot, PolicySlot

log = logging.getLogger("aiosync.sync")

#: ``make_syncer(bootstrap)`` builds a fresh syncer; ``bootstrap=True`` must make the pair's
#: init send the whole state (a repair must not rely on the receiver's old weights).
SyncerFactory = Callable[[bool], WeightSyncer]


@dataclass(eq=False)
class Packet:
    """All payloads of one sync of ``version``."""

    version: int
    payloads: list


@dataclass(eq=False)
class Reinit:
    """Start of a (re)bootstrap to ``version``: the init conversation follows, then a Packet."""

    version: int
    bootstrap: bool
    #: Id of this init conversation (per link): the explorer's Ack echoes it, so a late answer
    #: to an abandoned conversation is never taken for the answer to this one.
    conv: int = 0


@dataclass(eq=False)
class Abort:
    """The synchronizer gave up the (re)bootstrap of ``version`` it started."""

    version: int
    reason: str
    conv: int = 0


@dataclass(eq=False)
class Ack:
    """The explorer's answer to a Packet or Reinit of ``version``."""

    version: int
    applied: int | None
    error: str | None = None
    apply_s: float = 0.0
    #: The :attr:`Reinit.conv` this answers; ``None`` for the answer to a plain Packet.
    conv: int | None = None


@dataclass
class Request:
    """A pending ask for the newest weights. ``seq`` orders requests; ``fresh_after`` (a publish
    seq) asks for weights published after it; ``deadline`` bounds waiting for the trainer."""

    seq: int
    fresh_after: int | None = None
    deadline: float | None = None


def merge_requests(old: Request, new: Request) -> Request:
    """Coalesce two requests into one that satisfies both."""
    fresh = [r.fresh_after for r in (old, new) if r.fresh_after is not None]
    deadlines = [r.deadline for r in (old, new) if r.deadline is not None]
    return Request(
        seq=max(old.seq, new.seq),
        fresh_after=max(fresh) if fresh else None,
        deadline=max(deadlines) if deadlines else None,
    )


@dataclass
class LinkStats:
    """Per-explorer delivery counters (B6)."""

    delivered: int = 0
    failed: int = 0
    timeouts: int = 0
    up_to_date: int = 0
    reinits: int = 0
    #: Deliveries whose payload was built once for several explorers (fan-out, S12) by another link.
    shared: int = 0
    #: Re-bootstraps that delivered after a failure (the patch chain repaired).
    repairs: int = 0
    bytes_sent: int = 0
    changed_elements: int = 0
    build_s: RunningStat = field(default_factory=RunningStat)
    transfer_s: RunningStat = field(default_factory=RunningStat)
    apply_s: RunningStat = field(default_factory=RunningStat)
    versions_applied: list[int] = field(default_factory=list)
    last_error: str | None = None


@dataclass(eq=False)
class SenderLink:
    """Synchronizer side of one explorer: sender syncer, transport end, pending slot, stats."""

    name: str
    transport: Transport
    make_syncer: SyncerFactory
    source: Any
    names: list[str]
    delivery_timeout: float
    on_busy_change: Callable[["SenderLink"], None] | None = None
    pending: LatestSlot = field(default_factory=lambda: LatestSlot(merge=merge_requests))
    stats: LinkStats = field(default_factory=LinkStats)
    in_flight: Request | None = None
    #: The version the explorer last reported as applied (``None``: nothing yet).
    applied_version: int | None = None
    needs_reinit: bool = True
    request_seq: int = 0
    served_seq: int = 0
    last_outcome: str = ""
    #: False once the explorer stopped: handshakes no longer wait for it.
    active: bool = True
    #: Bootstrap every key at the first init (the explorer's weights are unknown).
    bootstrap_first: bool = False
    closed: bool = False
    sender: WeightSyncer | None = None
    #: Fan-out (S12): the synchronizer's :class:`~aiosync.coordination.fanout.FanOut` (``None``:
    #: this link builds every payload itself) and the lineage whose packets it delivers.
    fanout: Any = None
    lineage: Any = None
    #: The receiver metadata of the last init conversation (the fan-out key; its ``session``).
    receiver_meta: Any = None
    _reinit_version: int | None = field(default=None, repr=False)
    _conv: int = field(default=0, repr=False)
    _changed: anyio.Event = field(default_factory=anyio.Event, repr=False)

    # -- state -------------------------------------------------------------------------

    def _notify(self) -> None:
        self._changed.set()
        self._changed = anyio.Event()

    @property
    def busy(self) -> bool:
        """A delivery is in flight or a request is pending."""
        return self.in_flight is not None or self.pending.pending > 0

    def request(self, *, fresh_after: int | None = None, deadline: float | None = None) -> int:
        """Ask for the newest weights; returns the request's seq. Never blocks: merges into a
        pending request if there is one. ``fresh_after`` (a publish seq) waits for a newer
        publish, until ``deadline`` (required with it)."""
        if fresh_after is not None and deadline is None:
            raise ValueError("a request for fresh weights needs a deadline: every wait has a timeout")
        self.request_seq += 1
        was_busy = self.busy
        self.pending.put_nowait(Request(self.request_seq, fresh_after, deadline))
        if not was_busy and self.on_busy_change:
            self.on_busy_change(self)
        self._notify()
        return self.request_seq

    async def wait_served(self, seq: int, timeout: float | None) -> bool:
        """Wait until request ``seq`` was served (in any outcome); False on timeout."""
        with anyio.move_on_after(timeout):
            while self.served_seq < seq and not self.closed:
                await self._changed.wait()
        return self.served_seq >= seq

    async def wait_idle(self, timeout: float | None) -> bool:
        """Wait until nothing is in flight or pending; False on timeout."""
        with anyio.move_on_after(timeout):
            while self.busy and not self.closed:
                await self._changed.wait()
        return not self.busy

    @property
    def settled(self) -> bool:
        """Nothing is being delivered: idle, or only waiting for the trainer to publish."""
        return not self.busy or self in self.source.waiting

    async def wait_settled(self, timeout: float | None) -> bool:
        """Wait until no delivery (build, transfer, apply) is outstanding; False on timeout.

        Unlike :meth:`wait_idle`, a request that waits for the trainer does not count: the
        trainer that waits here is the one that will answer it.
        """
        with anyio.move_on_after(timeout):
            while not self.settled and not self.closed:
                await self._changed.wait()
        return self.settled

    # -- the task ----------------------------------------------------------------------

    async def run(self) -> None:
        """Serve requests one at a time until :meth:`close`."""
        while True:
            try:
                req = await self.pending.get()
            except EndOfStream:
                return
            self.in_flight = req
            try:
                self.last_outcome = await self._serve(req)
            except Exception as exc:  # a bug in a syncer must not kill the runtime
                self.stats.failed += 1
                self.stats.last_error = f"{type(exc).__name__}: {exc}"
                self.needs_reinit = True
                self.last_outcome = "failed"
                log.warning("aiosync: delivery to %s failed: %s", self.name, self.stats.last_error)
            finally:
                self.in_flight = None
                self.served_seq = max(self.served_seq, req.seq)
                if not self.busy and self.on_busy_change:
                    self.on_busy_change(self)
                self._notify()

    def close(self) -> None:
        """No more requests; the task ends after the pending one (if any) was served."""
        self.pending.close()
        if self.fanout is not None:
            self.fanout.leave(self)

    async def _serve(self, req: Request) -> str:
        async with self.source.borrow(self, req.fresh_after, req.deadline) as pub:
            if pub is None:
                if self.source.trainer_stopped:
                    return "trainer_stopped"  # S5: nothing newer will come
                self.stats.timeouts += 1
                return "timeout"
            if not self.needs_reinit and self.applied_version is not None and pub.version <= self.applied_version:
                self.stats.up_to_date += 1
                return "up_to_date"
            with anyio.fail_after(self.delivery_timeout):
                shared = await self._shared_packets(pub)
                if shared is None:
                    packet, reinit = await self._build(pub)
        # The weights were handed off: the trainer may move on (NCCL window released).
        if shared is not None:
            return await self._transfer_shared(shared)
        return await self._transfer(packet, reinit)

    async def _shared_packets(self, pub) -> list | None:
        """Fan-out (S12): the packets built once for every explorer at this one's version, or
        ``None`` when this link builds itself (no fan-out, a re-bootstrap is due, or no lineage
        reaches the explorer's version any more: then it is re-bootstrapped)."""
        if self.fanout is None or self.needs_reinit or self.lineage is None:
            return None
        got = await self.fanout.packets(self, pub)
        if got is None:
            self.fanout.leave(self)
            self.needs_reinit = True
            return None
        chain, built_here = got
        if built_here:
            self.stats.build_s.add(chain[-1].build_s)
        elif chain:
            self.stats.shared += 1
        return chain

    async def _transfer_shared(self, chain: list) -> str:
        if not chain:
            self.stats.up_to_date += 1
            return "up_to_date"
        outcome = "failed"
        for built in chain:
            packet = _restamp(built.packet, getattr(self.receiver_meta, "session", None))
            outcome = await self._transfer(packet, False, built)
            if outcome != "delivered":
                break
        return outcome

    async def _build(self, pub) -> tuple[Packet, bool]:
        reinit = self.needs_reinit
        if reinit:
            bootstrap = self.applied_version is not None or self.stats.failed > 0 or self.bootstrap_first
            sender = self.make_syncer(bootstrap)
            self._reinit_version = pub.version
            self._conv += 1
            self.receiver_meta = None
            await self.transport.send(Reinit(pub.version, bootstrap, self._conv))
            try:
                await sender.init_sender(pub.state, self.names, self.transport.send, self._recv_payload)
            except BaseException as exc:
                with anyio.move_on_after(5, shield=True):
                    try:
                        await self.transport.send(Abort(pub.version, f"{type(exc).__name__}: {exc}", self._conv))
                    except Exception:
                        pass
                raise
            finally:
                self._reinit_version = None
            self.sender = sender
            self.stats.reinits += 1
        payloads: list = []

        async def collect(payload: Any) -> None:
            payloads.append(payload)

        t0 = time.perf_counter()
        await self.sender.sync(pub.state, collect, pub.version)
        build_s = time.perf_counter() - t0
        self.stats.build_s.add(build_s)
        packet = Packet(pub.version, payloads)
        if reinit and self.fanout is not None:
            self.fanout.adopt(self, self.sender, receiver_key(self.receiver_meta), packet, build_s)
        return packet, reinit

    async def _transfer(self, packet: Packet, reinit: bool, built: Any = None) -> str:
        # From here until the Ack, the sender's state (e.g. a patch snapshot) is ahead of the
        # explorer; any failure means the next delivery must re-bootstrap.
        self.needs_reinit = True
        t0 = time.perf_counter()
        with anyio.fail_after(self.delivery_timeout):
            await self.transport.send(packet)
            ack = await self._recv_ack(packet.version, self._conv if reinit else None)
        elapsed = time.perf_counter() - t0
        nbytes = built.nbytes if built is not None else payload_nbytes(packet.payloads)
        if ack.applied is not None:
            self.applied_version = ack.applied
        if ack.error is not None:
            self.stats.failed += 1
            self.stats.last_error = ack.error
            log.warning("aiosync: %s could not apply version %d: %s", self.name, packet.version, ack.error)
            return "failed"
        self.needs_reinit = False
        if reinit and self.stats.delivered:
            self.stats.repairs += 1
        self.stats.delivered += 1
        self.stats.bytes_sent += nbytes
        if built is not None:
            changed = built.changed
        else:
            changed = (self.sender.last_stats or {}).get("changed") if self.sender is not None else None
        if isinstance(changed, int):
            self.stats.changed_elements += changed
        self.stats.apply_s.add(ack.apply_s)
        self.stats.transfer_s.add(max(0.0, elapsed - ack.apply_s))
        self.stats.versions_applied.append(ack.applied)
        log.debug(
            "aiosync: %s applied version %d (%d bytes, build %.2f ms, transfer %.2f ms, apply %.2f ms%s)",
            self.name, ack.applied, nbytes, self.stats.build_s.last * 1e3, self.stats.transfer_s.last * 1e3,
            ack.apply_s * 1e3, ", re-bootstrapped" if reinit else "",
        )
        return "delivered"

    async def _recv_payload(self) -> Any:
        """Receive for the syncer's init conversation, skipping late Acks."""
        while True:
            msg = await self.transport.recv()
            if isinstance(msg, ReceiverMetadata) and self.receiver_meta is None:
                self.receiver_meta = msg  # what the fan-out lineages are keyed on
            if not isinstance(msg, Ack):
                return msg
            if msg.conv == self._conv and msg.error is not None:
                raise PayloadError(f"{self.name} failed its side of the init conversation: {msg.error}")

    async def _recv_ack(self, version: int, conv: int | None = None) -> Ack:
        while True:
            msg = await self.transport.recv()
            if isinstance(msg, Ack) and msg.version == version and msg.conv == conv:
                return msg
            # A late Ack of an earlier, timed-out delivery, or stray traffic: skip it.


@dataclass(eq=False)
class ReceiverEndpoint:
    """Explorer side of one link: receives Packets and applies them through the slot.

    Its :meth:`run` task is the explorer's background apply task: with
    ``sync_weight_no_wait`` the explorer keeps rolling out while a new version arrives, and
    the swap happens atomically once it has fully arrived.
    """

    name: str
    slot: PolicySlot
    transport: Transport
    make_syncer: SyncerFactory
    #: Bound on one apply (including its init conversation), so a vanished peer cannot hold
    #: the model away from rollouts for long.
    timeout: float = 600.0
    receiver: WeightSyncer | None = None
    applying: bool = False
    #: A Reinit that arrived in the middle of an init conversation: handled next.
    _next: Any = field(default=None, repr=False)
    #: The conversation in progress (:attr:`Reinit.conv`).
    _conv: int | None = field(default=None, repr=False)

    async def run(self) -> None:
        while True:
            if self._next is not None:
                msg, self._next = self._next, None
            else:
                try:
                    msg = await self.transport.recv()
                except PeerTimeoutError:
                    continue  # idle: nothing to apply
                except (EndOfStream, ClosedResourceError):
                    return
            if isinstance(msg, Reinit):
                ack = await self._handle(msg.version, lambda model: self._reinit(model, msg), None, allow_same=True)
                ack.conv = msg.conv
            elif isinstance(msg, Packet):
                # A syncer whose apply is all-or-nothing (supports_no_wait) needs no slot backup.
                atomic = self.receiver is not None and self.receiver.supports_no_wait
                ack = await self._handle(msg.version, lambda model: self._apply_packet(model, self.receiver, msg),
                                         False if atomic else None)
            else:
                log.warning("aiosync: %s ignored an unexpected %s", self.name, type(msg).__name__)
                continue
            try:
                await self.transport.send(ack)
            except (EndOfStream, ClosedResourceError):
                return
            except Exception as exc:
                log.warning("aiosync: %s could not acknowledge version %d: %s", self.name, ack.version, exc)

    async def _handle(self, version: int, write, backup: bool | None, allow_same: bool = False) -> Ack:
        t0 = time.perf_counter()
        self.applying = True
        async def bounded(model: Any) -> int:
            with anyio.fail_after(self.timeout):
                return await write(model)

        try:
            applied = await self.slot.apply(bounded, backup=backup, allow_same=allow_same)
            return Ack(version, applied, None, time.perf_counter() - t0)
        except (ApplyError, PeerTimeoutError) as exc:
            return Ack(version, self.slot.version, f"{type(exc).__name__}: {exc}", time.perf_counter() - t0)
        finally:
            self.applying = False

    async def _conversation_recv(self) -> Any:
        while True:
            msg = await self.transport.recv()
            if isinstance(msg, Abort):
                if msg.conv != self._conv:
                    continue  # a late Abort of an earlier conversation
                raise PayloadError(f"the synchronizer aborted the bootstrap of version {msg.version}: {msg.reason}")
            if isinstance(msg, Reinit):
                # The synchronizer started over (it gave up waiting for this one): abandon this
                # conversation (rolled back) and take the new one next.
                self._next = msg
                raise PayloadError(f"the synchronizer restarted the bootstrap (version {msg.version}); "
                                   "this one was abandoned")
            return msg

    async def _apply_packet(self, model: Any, receiver: WeightSyncer | None, packet: Packet) -> int:
        if receiver is None:
            raise PayloadError("received weights before the syncer pair was initialised")
        expected = getattr(receiver, "payloads_per_sync", None)
        if expected is not None and len(packet.payloads) != expected:
            # An all-or-nothing apply must not fail after it wrote: refuse up front.
            raise PayloadError(f"sync packet of version {packet.version} holds {len(packet.payloads)} payloads, "
                               f"expected {expected} (truncated or duplicated)")
        payloads = iter(packet.payloads)
        used = 0

        async def recv() -> Any:
            nonlocal used
            try:
                item = next(payloads)
            except StopIteration:
                raise PayloadError(
                    f"sync packet of version {packet.version} is truncated: the syncer asked for payload "
                    f"{used + 1} of {len(packet.payloads)}"
                ) from None
            used += 1
            return item

        version = await receiver.apply(model, recv)
        if used != len(packet.payloads):
            raise PayloadError(
                f"sync packet of version {packet.version} has {len(packet.payloads) - used} unused payload(s)"
            )
        return version

    async def _reinit(self, model: Any, msg: Reinit) -> int:
        self._conv = msg.conv
        receiver = self.make_syncer(msg.bootstrap)
        await receiver.init_receiver(module_state_dict(model), self._conversation_recv, self.transport.send)
        while True:
            packet = await self._conversation_recv()
            if isinstance(packet, Packet) and packet.version == msg.version:
                break
            # A late message of an earlier conversation or delivery (a duplicate, a reordered one):
            # this conversation's Packet is the next thing the synchronizer sends.
            log.debug("aiosync: %s skipped a stale %s after its init conversation", self.name, type(packet).__name__)
        version = await self._apply_packet(model, receiver, packet)
        self.receiver = receiver
        return version
