"""The synchronizer's side of one explorer's delivery line: :class:`DeliveryLine`.

Per explorer, one task (the "synchronizer task" of the design) serves requests::

    request ──▶ LatestSlot (≤ 1 pending, latest wins) ──▶ serve: borrow the newest weights from
    the source, build with the sender syncer (or take the fan-out's shared packets), send one
    Packet, wait for the explorer's Ack

so at most one delivery is in flight and one request pending; a request made while a delivery
is in flight merges into the pending one, which resolves the *newest* weights when its turn
comes — the newest version is never dropped (S6, B4). A failed delivery leaves the explorer at
its previous version and marks the line for a re-bootstrap on the next request (B3: the patch
chain is repaired, not silently broken). The explorer's side is
:class:`aiosync.coordination.applier.Applier`; the two talk only through a transport lane.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import anyio

from ..errors import ClosedResourceError, EndOfStream, PayloadError, PeerTimeoutError, StateMismatchError
from ..messages import payload_nbytes
from ..syncers.base import WeightSyncer
from ..syncers.factory import SyncerFactory
from ..syncers.common.payloads import ReceiverMetadata
from ..transports.base import Transport
from .fanout import Built, FanOut, changed_elements, receiver_key, restamp
from .metrics import RunningStat, Series
from .protocol import Abort, Ack, Credit, Packet, Part, Reinit
from .slots import LatestSlot
from .sources import Published, Source, own_bytes
from .verify import StateCheck, VerifyStatistics, held_publish, mismatch_message

log = logging.getLogger("aiosync.sync")


def _replay(first: Any, recv: Callable[[], Any]) -> Callable[[], Any]:
    """``recv`` that returns ``first`` once before it reads on."""
    pending = [first]

    async def replay() -> Any:
        return pending.pop() if pending else await recv()

    return replay


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
    return Request(seq=max(old.seq, new.seq), fresh_after=max(fresh) if fresh else None,
                   deadline=max(deadlines) if deadlines else None)


@dataclass
class LineStats:
    """Per-explorer delivery counters (mutable; :meth:`DeliveryLine.statistics` freezes them)."""

    delivered: int = 0
    failed: int = 0
    timeouts: int = 0
    up_to_date: int = 0
    reinits: int = 0
    #: Deliveries whose packet another line built (fan-out, S12).
    shared: int = 0
    #: Re-bootstraps that delivered after a failure (the patch chain repaired).
    repairs: int = 0
    bytes_sent: int = 0
    changed_elements: int = 0
    build_s: RunningStat = field(default_factory=RunningStat)
    transfer_s: RunningStat = field(default_factory=RunningStat)
    apply_s: RunningStat = field(default_factory=RunningStat)
    #: The explorer's exclusive writes and how long they waited for rollouts' leases.
    write_s: RunningStat = field(default_factory=RunningStat)
    lease_wait_s: RunningStat = field(default_factory=RunningStat)
    versions_applied: list[int] = field(default_factory=list)
    last_error: str | None = None


@dataclass(frozen=True)
class LineStatistics:
    """A snapshot of one delivery line (B6)."""

    requests: int
    coalesced: int
    max_pending: int
    delivered: int
    failed: int
    timeouts: int
    up_to_date: int
    reinits: int
    repairs: int
    shared: int
    bytes_sent: int
    changed_elements: int
    build_s: Series
    transfer_s: Series
    apply_s: Series
    write_s: Series
    lease_wait_s: Series
    versions_applied: tuple
    last_error: str | None
    #: Whole-state verification (``None``: this explorer is not verified).
    verify: VerifyStatistics | None


class DeliveryTimeout(PeerTimeoutError):
    """One delivery outlived ``delivery_timeout``; the message says in which phase and what to change."""


_PHASE_HINTS = {
    "building": "building the payload took that long; raise synchronizer.delivery_timeout for very large models",
    "bootstrapping": "the explorer did not complete its init conversation (is it alive? is the link slow?); "
                     "raise synchronizer.delivery_timeout for a slow link",
    "sending": "the transport did not take the payload (a slow or stalled link); raise "
               "synchronizer.delivery_timeout for a slow link",
    "verifying": "the explorer did not answer its whole-state verification (digesting its state, or the answer was "
                 "lost; the next delivery repairs it); raise synchronizer.delivery_timeout for very large models",
    "waiting for the explorer's answer": "the explorer did not confirm the apply: either its answer was lost "
                                         "(the next delivery repairs it) or its write waited for rollouts to "
                                         "release the model; hold leases for shorter than delivery_timeout, or "
                                         "raise synchronizer.delivery_timeout",
}


@dataclass(eq=False)
class DeliveryLine:
    """The synchronizer's side of one explorer: sender syncer, transport lane, pending request,
    counters. Its :meth:`run` task serves one request at a time."""

    name: str
    transport: Transport
    syncers: SyncerFactory
    source: Source
    names: list[str]
    delivery_timeout: float
    fanout: FanOut | None = None
    #: ``on_change(busy, settled)`` when :attr:`busy` or :attr:`settled` changes (the other
    #: argument is ``None``): the session mirrors them in the explorer's status and notices.
    on_change: Callable[[bool | None, bool | None], None] | None = None
    pending: LatestSlot = field(default_factory=lambda: LatestSlot(merge=merge_requests))
    stats: LineStats = field(default_factory=LineStats)
    in_flight: Request | None = None
    #: The version the explorer last reported as applied (``None``: nothing yet).
    applied_version: int | None = None
    needs_reinit: bool = True
    #: Bootstrap every key at the first init (the explorer's weights are unknown).
    bootstrap_first: bool = False
    request_seq: int = 0
    served_seq: int = 0
    last_outcome: str = ""
    closed: bool = False
    #: This line's own sender syncer (``None`` while it follows a shared fan-out lineage).
    sender: WeightSyncer | None = None
    #: The receiver metadata of the last init conversation (the fan-out key; its ``session``).
    receiver_meta: Any = None
    #: The transport under :attr:`transport` (a multicast round sends on it directly).
    wire: Any = None
    _conv: int = field(default=0, repr=False)
    _phase: str = field(default="", repr=False)
    _deadline: float = field(default=0.0, repr=False)
    _was_busy: bool = field(default=False, repr=False)
    _was_settled: bool = field(default=True, repr=False)
    _changed: anyio.Event = field(default_factory=anyio.Event, repr=False)
    #: Whole-state verification of this explorer (``None``: not verified).
    state_check: StateCheck | None = None
    _serving: anyio.Lock = field(default_factory=anyio.Lock, repr=False)

    # -- state -------------------------------------------------------------------------

    def notify(self) -> None:
        """Wake everything waiting on this line's state, and report busy / settled changes."""
        self._changed.set()
        self._changed = anyio.Event()
        busy, settled = self.busy, self.settled
        if self.on_change is not None and (busy != self._was_busy or settled != self._was_settled):
            self.on_change(busy if busy != self._was_busy else None,
                           settled if settled != self._was_settled else None)
        self._was_busy, self._was_settled = busy, settled

    @property
    def busy(self) -> bool:
        """A delivery is in flight or a request is pending."""
        return self.in_flight is not None or self.pending.pending > 0

    @property
    def settled(self) -> bool:
        """Nothing is being delivered: idle, or only waiting for the trainer to publish."""
        return not self.busy or self in self.source.waiting

    @property
    def behind(self) -> bool:
        """The explorer does not hold the newest publish (or its chain needs a repair)."""
        latest = self.source.latest
        return self.needs_reinit or self.applied_version is None or (
            latest is not None and self.applied_version < latest.version)

    def request(self, *, fresh_after: int | None = None, deadline: float | None = None) -> int:
        """Ask for the newest weights; returns the request's seq. Never blocks: merges into a
        pending request if there is one. ``fresh_after`` (a publish seq) waits for a newer
        publish, until ``deadline`` (required with it: every wait has a bound)."""
        if fresh_after is not None and deadline is None:
            raise ValueError("a request for fresh weights needs a deadline: every wait has a timeout")
        self.request_seq += 1
        self.pending.put_nowait(Request(self.request_seq, fresh_after, deadline))
        self.notify()
        return self.request_seq

    async def _wait(self, done: Callable[[], bool], timeout: float | None) -> bool:
        with anyio.move_on_after(timeout):
            while not done() and not self.closed:
                await self._changed.wait()
        return done()

    async def wait_for(self, done: Callable[[], bool], timeout: float | None) -> bool:
        """Wait until ``done()`` (re-checked at every change of this line), the line closes, or
        ``timeout``; returns ``done()``."""
        return await self._wait(done, timeout)

    async def wait_served(self, seq: int, timeout: float | None) -> bool:
        """Wait until request ``seq`` was served (in any outcome); False on timeout or close."""
        return await self._wait(lambda: self.served_seq >= seq, timeout)

    async def wait_settled(self, timeout: float | None) -> bool:
        """Wait until no delivery (build, transfer, apply) is outstanding; False on timeout.
        A request that waits for the trainer does not count: the trainer that waits here is the
        one that will answer it."""
        return await self._wait(lambda: self.settled, timeout)

    def close(self) -> None:
        """No more requests; the task ends after the pending one (if any) was served."""
        self.closed = True
        self.pending.close()
        if self.fanout is not None:
            self.fanout.leave(self)
        self.notify()

    def statistics(self) -> LineStatistics:
        s, p = self.stats, self.pending.statistics()
        return LineStatistics(
            p.puts, p.coalesced, p.max_pending, s.delivered, s.failed, s.timeouts, s.up_to_date, s.reinits,
            s.repairs, s.shared, s.bytes_sent, s.changed_elements, s.build_s.snapshot(), s.transfer_s.snapshot(),
            s.apply_s.snapshot(), s.write_s.snapshot(), s.lease_wait_s.snapshot(), tuple(s.versions_applied),
            s.last_error, None if self.state_check is None else self.state_check.statistics())

    # -- the task ----------------------------------------------------------------------

    async def run(self, *, task_status: anyio.abc.TaskStatus = anyio.TASK_STATUS_IGNORED) -> None:
        """Serve requests one at a time until :meth:`close` (``start()``-able)."""
        task_status.started()
        while True:
            try:
                req = await self.pending.get()
            except EndOfStream:
                return
            self.in_flight = req
            self.notify()
            try:
                async with self._serving:
                    self.last_outcome = await self._serve(req)
            except Exception as exc:  # a failed delivery never ends the line: it is reported and repaired
                self._fail(exc)
            finally:
                self.in_flight = None
                self.served_seq = max(self.served_seq, req.seq)
                self.notify()

    def _fail(self, exc: BaseException) -> None:
        self.stats.failed += 1
        self.stats.last_error = f"{type(exc).__name__}: {exc}"
        self.needs_reinit = True
        self.last_outcome = "failed"
        log.warning("aiosync: delivery to %s failed: %s", self.name, self.stats.last_error)

    async def _bounded(self, phase: str, version: int, coro_fn, *args):
        """Run one phase of a delivery under the delivery bound, with a timeout that says which."""
        self._phase = phase
        try:
            with anyio.fail_after(self._deadline - time.monotonic()):
                return await coro_fn(*args)
        except TimeoutError:
            raise DeliveryTimeout(
                f"delivery of version {version} to explorer {self.name} did not finish within "
                f"delivery_timeout={self.delivery_timeout}s while {phase}: {_PHASE_HINTS[phase]}") from None

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
            self._deadline = time.monotonic() + self.delivery_timeout
            chain = await self._shared_chain(pub)
            if chain is None:
                packet, reinit = await self._build(pub)
            reference = await self._reference(pub, reinit=chain is None and reinit)
        if pub.revoked:  # the trainer's window closed while this build still read its tensors
            raise PayloadError(f"the payload for version {pub.version} was built while the trainer's window closed "
                               "(its build outlived the bound); not sent")
        # The weights were handed off: the trainer may move on (NCCL window released).
        outcome = await (self._transfer_chain(chain) if chain is not None else self._transfer(packet, reinit))
        if outcome == "delivered" and reference is not None and self.applied_version == pub.version:
            await self._check_state(pub.version, reference)
        return outcome

    # -- whole-state verification (:mod:`aiosync.coordination.verify`) -----------------

    async def _reference(self, pub: Published, *, reinit: bool) -> dict | None:
        """The digests the explorer must hold after this delivery, when a check is due."""
        check = self.state_check
        if check is None or not check.due(pub.version, reinit):
            return None
        return await self._bounded("building", pub.version, check.reference, pub)

    async def _check_state(self, version: int, reference: dict) -> None:
        """Verify the explorer's whole state; a mismatch fails this delivery (StateMismatchError)
        and asks for a repair at once (once in a row: a repair that does not help waits for the
        next delivery)."""
        self._deadline = time.monotonic() + self.delivery_timeout
        mismatched = await self._bounded("verifying", version, self.state_check.check, self.transport, version,
                                         reference)
        if mismatched:
            self.needs_reinit = True
            if self.state_check.in_a_row == 1 and not self.closed:
                self.request()
            raise StateMismatchError(mismatch_message(self.name, version, mismatched), tensors=mismatched,
                                     version=version)

    async def verify_held(self, timeout: float) -> bool:
        """The drain's check: verify that the explorer holds exactly the newest publish, when it
        reports it (also when it was verified at it before: it may have drifted since). Returns
        whether it does not (a mismatch, or a check that failed: the line then repairs like
        after a failed delivery)."""
        check, acquired = self.state_check, False
        with anyio.move_on_after(timeout):
            await self._serving.acquire()  # never beside a delivery of this line
            acquired = True
        if not acquired or check is None:  # a delivery outlived the bound: it verifies itself when due
            return False
        try:
            async with held_publish(self.source, self) as pub:
                if pub is None or self.closed or self.needs_reinit or self.applied_version != pub.version:
                    return False
                self._deadline = time.monotonic() + timeout
                reference = await self._bounded("building", pub.version, check.reference, pub)
            if reference is not None:
                await self._check_state(pub.version, reference)
            return False
        except StateMismatchError as exc:
            self.stats.last_error = f"{type(exc).__name__}: {exc}"
            log.warning("aiosync: %s", exc)
            return True
        except (EndOfStream, ClosedResourceError):  # the explorer is leaving: its session ends, not a drain failure
            return False
        except Exception as exc:  # the check itself failed: repaired like a failed delivery
            self._fail(exc)
            return True
        finally:
            self._serving.release()

    async def _shared_chain(self, pub: Published) -> list[Built] | None:
        """Fan-out (S12): the packets built once for every explorer at this one's version, or
        ``None`` when this line builds itself (no fan-out, a re-bootstrap is due, or no lineage
        reaches the explorer's version any more: then it is re-bootstrapped)."""
        if self.fanout is None or self.needs_reinit or not self.fanout.follows(self):
            return None
        shared = await self._bounded("building", pub.version, self.fanout.serve, self, self.applied_version, pub)
        if shared is None:
            self.needs_reinit = True
            return None
        if shared.built_here:
            self.stats.build_s.add(shared.chain[-1].build_s)
        elif shared.chain:
            self.stats.shared += 1
        return shared.chain

    async def _transfer_chain(self, chain: list[Built]) -> str:
        if not chain:
            self.stats.up_to_date += 1
            return "up_to_date"
        outcome = "failed"
        for built in chain:
            packet = restamp(built.packet, getattr(self.receiver_meta, "session", None))
            outcome = await self._transfer(packet, False, built)
            if outcome != "delivered":
                break
        return outcome

    async def _build(self, pub: Published) -> tuple[Packet, bool]:
        reinit = self.needs_reinit
        if reinit:
            joined = await self._bounded("bootstrapping", pub.version, self._init_sender, pub)
            if joined is not None:  # onto a fan-out lineage: its first packet, nothing built
                return joined, True
        payloads: list = []

        async def collect(payload: Any) -> None:
            payloads.append(payload)

        t0 = time.perf_counter()
        await self._bounded("building", pub.version, self.sender.sync, pub.state, collect, pub.version)
        build_s = time.perf_counter() - t0
        self.stats.build_s.add(build_s)
        packet = own_bytes(Packet(pub.version, payloads), pub)
        if reinit and self.fanout is not None and self.fanout.join(self, self.sender, receiver_key(self.receiver_meta),
                                                                   packet, build_s):
            self.sender = None  # the fan-out's lineage owns it now
        return packet, reinit

    async def _init_sender(self, pub: Published) -> Packet | None:
        """(Re)bootstrap: the pair's init conversation — onto the sender of a fan-out lineage
        that serves this explorer's layout (no snapshot of its own; returns the explorer's first
        packet), or with a fresh sender syncer (returns ``None``)."""
        if self.fanout is not None:
            self.fanout.leave(self)
        bootstrap = self.applied_version is not None or self.stats.failed > 0 or self.bootstrap_first
        if self.sender is not None:
            self.sender.close()
        sender = self.syncers.make(bootstrap)
        self.sender = None
        self._conv += 1
        self.receiver_meta = None
        await self.transport.send(Reinit(pub.version, bootstrap, self._conv))

        async def send(payload: Any) -> None:  # bootstrap buckets must own their bytes too
            await self.transport.send(own_bytes(payload, pub))

        recv = self._recv_init
        try:
            if self.fanout is not None and sender.accepts_receivers:
                meta = await self._recv_init()
                recv = _replay(meta, self._recv_init)
                first = await self.fanout.attach(self, receiver_key(meta), meta, pub, send, sender)
                if first is not None:
                    sender.close()
                    self.stats.reinits += 1
                    return own_bytes(Packet(pub.version, [first]), pub)
            await sender.init_sender(pub.state, self.names, send, recv)
        except BaseException as exc:
            with anyio.move_on_after(5, shield=True):
                try:
                    await self.transport.send(Abort(pub.version, f"{type(exc).__name__}: {exc}", self._conv))
                except Exception:  # the original error is the one to report
                    pass
            raise
        self.sender = sender
        self.stats.reinits += 1
        return None

    async def _transfer(self, packet: Packet, reinit: bool, built: Built | None = None) -> str:
        # From here until the Ack, the sender's state (e.g. a patch snapshot) is ahead of the
        # explorer; any failure means the next delivery must re-bootstrap.
        self.needs_reinit = True
        t0 = time.perf_counter()
        self._deadline = time.monotonic() + self.delivery_timeout  # the transfer's own bound
        conv = self._conv if reinit else None
        ack = None
        if len(packet.payloads) > 1:  # streamed: a part at a time, as the explorer stages them
            ack = await self._bounded("sending", packet.version, self._stream, packet, conv)
        elif built is not None and self.fanout is not None:  # perhaps in one round with other explorers
            await self._bounded("sending", packet.version, self.fanout.send, self, built, packet)
        else:
            await self._bounded("sending", packet.version, self.transport.send, packet)
        if ack is None:
            ack = await self._bounded("waiting for the explorer's answer", packet.version, self._recv_ack,
                                      packet.version, conv)
        elapsed = time.perf_counter() - t0
        if ack.applied is not None:
            self.applied_version = ack.applied
        if ack.error is not None:
            self.stats.failed += 1
            self.stats.last_error = ack.error
            log.warning("aiosync: %s could not apply version %d: %s", self.name, packet.version, ack.error)
            return "failed"
        self.needs_reinit = False
        if self.fanout is not None:
            self.fanout.applied(self, self.applied_version)
        if reinit and self.stats.delivered:
            self.stats.repairs += 1
        self._count_delivery(packet, ack, built, elapsed)
        return "delivered"

    def _count_delivery(self, packet: Packet, ack: Ack, built: Built | None, elapsed: float) -> None:
        s = self.stats
        nbytes = built.nbytes if built is not None else payload_nbytes(packet.payloads)
        changed = built.changed if built is not None else (
            changed_elements(self.sender) if self.sender is not None else None)
        s.delivered += 1
        s.bytes_sent += nbytes
        if changed is not None:
            s.changed_elements += changed
        s.apply_s.add(ack.apply_s)
        s.write_s.add(ack.write_s)
        s.lease_wait_s.add(ack.lease_wait_s)
        s.transfer_s.add(max(0.0, elapsed - ack.apply_s))
        s.versions_applied.append(ack.applied)
        log.debug("aiosync: %s applied version %d (%d bytes, build %.2f ms, transfer %.2f ms, apply %.2f ms, "
                  "exclusive write %.2f ms)", self.name, ack.applied, nbytes, s.build_s.last * 1e3,
                  s.transfer_s.last * 1e3, ack.apply_s * 1e3, ack.write_s * 1e3)

    async def _stream(self, packet: Packet, conv: int | None) -> Ack | None:
        """Send ``packet`` streamed (:class:`Part` s, each after the explorer's :class:`Credit`
        for the one before); returns the explorer's Ack if it answered before the last part
        (it refused the delivery), else ``None``."""
        await self.transport.send(Packet(packet.version, [], parts=len(packet.payloads)))
        for i, payload in enumerate(packet.payloads):
            if i:
                while True:
                    msg = await self.transport.recv()
                    if isinstance(msg, Credit) and msg.version == packet.version and msg.index == i - 1:
                        break
                    if isinstance(msg, Ack) and msg.version == packet.version and msg.conv == conv:
                        return msg  # refused half way: the rest is not sent
            await self.transport.send(Part(packet.version, i, payload))
        return None

    async def _recv_init(self) -> Any:
        """Receive for the syncer's init conversation, skipping late Acks."""
        while True:
            msg = await self.transport.recv()
            if isinstance(msg, ReceiverMetadata) and self.receiver_meta is None:
                self.receiver_meta = msg  # what the fan-out lineages are keyed on
            if not isinstance(msg, Ack):
                return msg
            if msg.conv == self._conv and msg.error is not None:
                raise PayloadError(f"{self.name} failed its side of the init conversation: {msg.error}")

    async def _recv_ack(self, version: int, conv: int | None) -> Ack:
        while True:
            msg = await self.transport.recv()
            if isinstance(msg, Ack) and msg.version == version and msg.conv == conv:
                return msg
            # A late Ack of an earlier, timed-out delivery, or stray traffic: skip it.
