"""Explorers in other processes (S2 across processes, S12 elastic joins).

The trainer's process runs the :class:`~aiosync.coordination.Synchronizer` (the source of
published weights and one delivery line per explorer). An explorer in another process runs a
:class:`RemoteExplorer`: its :class:`~aiosync.coordination.PolicySlot` and the apply task of
its delivery line, plus the explorer-side API (``lease``, ``need_sync``, ``sync_weight``,
``step_done``, ``stop``). The two talk over one transport, typically a
:class:`~aiosync.transports.distributed.DistributedTransport`::

    # trainer process (rank 0)
    async with Synchronizer(config, weight_syncer) as sync:
        trainer = await sync.attach_trainer(model)
        for rank in explorer_ranks:
            sync.serve_remote(group.transport(rank))        # explorers may join at any time
        await sync.wait_for_explorers(len(explorer_ranks), timeout=60)
        ...

    # explorer process (rank k)
    async with RemoteExplorer(f"e{k}", model, group.transport(0)) as explorer:
        ...  # exactly the ExplorerHandle API

One wire carries two kinds of messages, split by a :class:`Mux`: the delivery line's own
messages (``Reinit``, ``Packet``, ``Abort``, ``Ack`` and the syncers' init conversation) and
the small control messages below. Conversation::

    explorer                                   synchronizer
    Hello(name, version)            ──▶
                                    ◀──        Welcome(config, weight_syncer, versions)
                                    ◀──        Reinit / init conversation / Packet   (first sync)
    Ack                             ──▶
                                    ◀──        Attached(version)
    SyncRequest(id)                 ──▶        (the same request an in-process explorer makes)
                                    ◀──        Served(id, outcome, version)
                                    ◀──        Notice(published | window_open | window_closed | trainer_stopped)
    Stopped | Leave                 ──▶
                                    ◀──        Close(version)      after the final drain, or on Leave
    Close                           ──▶        (the answer: both readers end, the wire is free again)

States follow the seed: with NCCL the explorer is REQUIRE_SYNC from its request until it is
served while the trainer holds its handshake window open (REQUIRE_SYNC), then both RUNNING;
with MEMORY / CHECKPOINT the trainer stays RUNNING. Every wait is bounded; a peer that
vanishes ends the session with an error instead of a hang (see :class:`RemoteExplorerHandle`).
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from ..errors import (ApplyError, ClosedResourceError, EndOfStream, HandshakeError, PeerTimeoutError,
                      StateTransitionError, TransportError)
from ..transports.base import Transport
from .config import SynchronizerConfig
from .link import ReceiverEndpoint, SenderLink
from .slots import PolicySlot
from .states import RunningStatus, StatusCell
from .styles import SyncMethod, SyncStyle, explorer_step_syncs

log = logging.getLogger("aiosync.sync")

PROTOCOL = 1


# ----------------------------------------------------------------------------- control messages


@dataclass
class Control:
    """Base of the control messages (everything else on the wire belongs to the delivery line)."""


@dataclass
class Hello(Control):
    """Explorer → synchronizer: join as ``name``; ``version`` is what its model holds (or None)."""

    name: str
    version: int | None = None
    protocol: int = PROTOCOL


@dataclass
class Welcome(Control):
    """Synchronizer → explorer: accepted; the synchronizer's config and weight syncer config."""

    config: dict
    weight_syncer: dict | None
    trainer_version: int
    published: int | None
    trainer_stopped: bool = False


@dataclass
class Refused(Control):
    """Synchronizer → explorer: not accepted (name taken, protocol mismatch, first sync failed)."""

    reason: str


@dataclass
class Attached(Control):
    """Synchronizer → explorer: the first (blocking) sync was applied; ``version`` is held."""

    version: int | None


@dataclass
class SyncRequest(Control):
    """Explorer → synchronizer: ask for the newest weights (``ExplorerHandle.sync_weight``)."""

    id: int


@dataclass
class Served(Control):
    """Synchronizer → explorer: request ``id`` was served with ``outcome``; ``version`` is applied."""

    id: int
    outcome: str
    version: int | None


@dataclass
class Notice(Control):
    """Synchronizer → explorer: ``published`` (a new version), ``window_open`` / ``window_closed``
    (an NCCL handshake), ``trainer_stopped``."""

    event: str
    version: int | None


@dataclass
class Stopped(Control):
    """Explorer → synchronizer: the explorer stopped (STOPPED); deliveries may still come (drain)."""

    step: int


@dataclass
class Leave(Control):
    """Explorer → synchronizer: detach me now (no final drain)."""

    reason: str = ""


@dataclass
class Close(Control):
    """Either way: the session ends; the receiver answers with its own Close and stops reading."""

    version: int | None = None
    reason: str = ""


# ----------------------------------------------------------------------------- the wire splitter


class _Lane(Transport):
    """One logical channel of a :class:`Mux`: sends go to the shared wire, receives come from
    the messages the mux routed here."""

    def __init__(self, mux: "Mux", rx: MemoryObjectReceiveStream, timeout: float | None) -> None:
        self.mux, self._rx, self.timeout = mux, rx, timeout

    async def send(self, payload: Any) -> None:
        await self.mux.send(payload)

    async def recv(self) -> Any:
        try:
            with anyio.fail_after(self.timeout):
                return await self._rx.receive()
        except TimeoutError:
            raise PeerTimeoutError(f"nothing arrived from the peer within {self.timeout}s") from None
        except (anyio.EndOfStream, anyio.ClosedResourceError):
            why = f": {self.mux.error}" if self.mux.error is not None else ""
            raise EndOfStream(f"the peer's session ended{why}") from self.mux.error


class Mux:
    """Splits one transport (the wire) into a control lane and a data lane.

    :meth:`run` is the only reader of the wire: :class:`Control` messages go to ``control``,
    everything else to ``data``. It ends when the peer's :class:`Close` arrives (the wire is
    then free for other use) or when the wire fails (``error`` holds why); both lanes then end
    with :class:`aiosync.errors.EndOfStream`.
    """

    def __init__(self, wire: Transport, *, timeout: float | None) -> None:
        self.wire = wire
        self._data_tx: MemoryObjectSendStream
        self._ctl_tx: MemoryObjectSendStream
        self._data_tx, data_rx = anyio.create_memory_object_stream(math.inf)
        self._ctl_tx, ctl_rx = anyio.create_memory_object_stream(math.inf)
        self.data = _Lane(self, data_rx, timeout)
        self.control = _Lane(self, ctl_rx, timeout)
        self.error: BaseException | None = None
        self.peer_closed = anyio.Event()
        self.close_sent = False
        self.finished = anyio.Event()
        self._send_lock = anyio.Lock()

    async def send(self, msg: Any) -> None:
        """Send one message. After a :class:`Close` went either way, only our own Close may
        still go: anything else would never be read, and a point-to-point send nobody reads
        stays pending until the process exits."""
        if self.error is not None:
            raise EndOfStream(f"the session is over: {self.error}") from self.error
        async with self._send_lock:
            if self.close_sent or (self.peer_closed.is_set() and not isinstance(msg, Close)):
                raise EndOfStream(f"the session is closing; not sending {type(msg).__name__}")
            if isinstance(msg, Close):
                self.close_sent = True
            await self.wire.send(msg)

    async def run(self) -> None:
        try:
            while True:
                try:
                    msg = await self.wire.recv()
                except PeerTimeoutError:
                    continue  # idle
                if isinstance(msg, Control):
                    self._ctl_tx.send_nowait(msg)
                    if isinstance(msg, Close):
                        self.peer_closed.set()
                        return
                else:
                    self._data_tx.send_nowait(msg)
        except (TransportError, EndOfStream, ClosedResourceError, OSError) as exc:
            self.error = exc
        except Exception as exc:  # a malformed message: the session cannot be trusted any more
            self.error = exc
            log.warning("aiosync: session reader stopped: %s: %s", type(exc).__name__, exc)
        finally:
            self._data_tx.close()
            self._ctl_tx.close()
            self.finished.set()


# ----------------------------------------------------------------------------- synchronizer side


@dataclass(eq=False)
class RemoteExplorerHandle:
    """The synchronizer's view of an explorer in another process (made by
    :meth:`aiosync.Synchronizer.serve_remote` when the explorer says Hello).

    ``error`` is set when the explorer was lost (its process died, its link broke): it is then
    STOPPED, its link closed, and the trainer keeps serving the others; blocking syncs report it
    in their result's ``failed`` list.
    """

    sync: Any
    name: str
    link: SenderLink
    state: StatusCell
    mux: Mux
    step: int = 0
    error: BaseException | None = None
    closed: bool = False
    remote: bool = True
    _notices: Any = field(default=None, repr=False)
    _scope: anyio.CancelScope | None = field(default=None, repr=False)
    _closing: bool = field(default=False, repr=False)

    @property
    def status(self) -> RunningStatus:
        return self.state.status

    @property
    def version(self) -> int | None:
        """The version the explorer last reported as applied."""
        return self.link.applied_version

    @property
    def lost(self) -> bool:
        return self.error is not None

    async def stop(self) -> None:
        """Handshakes stop waiting for this explorer (it said Stopped or is gone)."""
        self.link.active = False
        if self.state.status is not RunningStatus.STOPPED:
            self.state.set(RunningStatus.STOPPED)

    def _on_source_event(self, event: str, version: int | None) -> None:
        if self._notices is not None and not self.closed:
            try:
                self._notices.send_nowait(Notice(event, version))
            except (anyio.ClosedResourceError, anyio.BrokenResourceError):
                pass

    def _lose(self, exc: BaseException) -> None:
        if self.closed:
            return
        self.error = exc
        log.warning("aiosync: lost explorer %s: %s: %s", self.name, type(exc).__name__, exc)
        self.link.stats.last_error = f"{type(exc).__name__}: {exc}"
        self._end()

    def _end(self) -> None:
        self.closed = True
        self.link.active = False
        self.link.close()
        self.link.closed = True
        self.link._notify()
        self.state.set_if(RunningStatus.REQUIRE_SYNC, RunningStatus.RUNNING)
        self.state.set_if(RunningStatus.RUNNING, RunningStatus.STOPPED)
        try:
            self.sync.source.listeners.remove(self._on_source_event)
        except ValueError:
            pass
        if self._notices is not None:
            self._notices.close()

    async def close(self, reason: str = "", *, timeout: float = 10.0) -> None:
        """End the session: send Close, wait (bounded) for the explorer's Close, stop the tasks."""
        if not self.closed:
            self._closing = True
            with anyio.move_on_after(timeout, shield=True):
                try:
                    await self.mux.send(Close(self.link.applied_version, reason))
                    await self.mux.finished.wait()  # the reader ends on the answer or a broken wire
                except (EndOfStream, TransportError, ClosedResourceError, PeerTimeoutError):
                    pass
            self._end()
        if self._scope is not None:
            self._scope.cancel()

    # -- tasks ---------------------------------------------------------------------

    async def _control(self) -> None:
        sync, cfg = self.sync, self.sync.config
        async with anyio.create_task_group() as tg:
            while True:
                try:
                    msg = await self.mux.control.recv()
                except PeerTimeoutError:
                    continue
                except EndOfStream:
                    break
                if isinstance(msg, SyncRequest):
                    seq = sync._explorer_request(self.link, self.link.applied_version)
                    if seq is None:
                        await self._send(Served(msg.id, "trainer_stopped", self.link.applied_version))
                    else:
                        tg.start_soon(self._answer, msg.id, seq, cfg.sync_timeout + cfg.delivery_timeout)
                elif isinstance(msg, Stopped):
                    self.step = msg.step
                    await self.stop()
                elif isinstance(msg, Leave):
                    log.info("aiosync: explorer %s leaves: %s", self.name, msg.reason or "done")
                    sync.explorers.pop(self.name, None)
                    await self.stop()
                    self._closing = True
                    await self._send(Close(self.link.applied_version, "left"))
                    with anyio.move_on_after(cfg.sync_timeout):
                        await self.mux.finished.wait()  # the reader ends on the answer or a broken wire
                    self._end()
                    break
                elif isinstance(msg, Close):
                    if not self._closing:  # the explorer ended the session: answer it
                        self._closing = True
                        await self._send(Close(self.link.applied_version, "bye"))
                        self._end()
                    break
                else:
                    log.warning("aiosync: explorer %s sent an unexpected %s", self.name, type(msg).__name__)
            tg.cancel_scope.cancel()
        if not self.closed and not self._closing:
            self._lose(self.mux.error or EndOfStream("the explorer closed its session"))

    async def _answer(self, request_id: int, seq: int, timeout: float) -> None:
        await self.link.wait_served(seq, timeout)
        outcome = self.link.last_outcome if self.link.served_seq >= seq else "pending"
        await self._send(Served(request_id, outcome, self.link.applied_version))

    async def _send_notices(self, rx: MemoryObjectReceiveStream) -> None:
        async with rx:
            async for notice in rx:
                await self._send(notice)

    async def _send(self, msg: Any) -> None:
        try:
            await self.mux.send(msg)
        except (EndOfStream, TransportError, ClosedResourceError, PeerTimeoutError) as exc:
            log.debug("aiosync: could not tell %s: %s", self.name, exc)


async def serve_remote_explorer(sync: Any, wire: Transport) -> None:
    """The synchronizer's side of one remote explorer's session (run by
    :meth:`aiosync.Synchronizer.serve_remote`): wait for its Hello, attach it (bootstrap and a
    first blocking sync), then answer its requests until the session ends."""
    cfg = sync.config
    mux = Mux(wire, timeout=cfg.delivery_timeout)
    with anyio.CancelScope() as scope:
        sync._sessions.add(scope)  # cancelled when the synchronizer closes (e.g. nobody said Hello)
        try:
            await _serve(sync, mux, scope)
        finally:
            sync._sessions.discard(scope)


async def _serve(sync: Any, mux: Mux, scope: anyio.CancelScope) -> None:
    async with anyio.create_task_group() as tg:
        tg.start_soon(mux.run)
        hello = None
        while hello is None:
            try:
                msg = await mux.control.recv()
            except PeerTimeoutError:
                continue  # a late joiner: keep listening
            except EndOfStream:
                return  # the peer went away before it joined
            if isinstance(msg, Hello):
                hello = msg
        handle = await _attach(sync, mux, hello, scope, tg)
        if handle is not None:
            await handle._control()
        tg.cancel_scope.cancel()


async def _refuse(mux: Mux, reason: str) -> None:
    log.warning("aiosync: refused a remote explorer: %s", reason)
    with anyio.move_on_after(10):
        try:
            await mux.send(Refused(reason))
            await mux.send(Close(None, reason))
            await mux.finished.wait()
        except (EndOfStream, TransportError, ClosedResourceError, PeerTimeoutError):
            pass


async def _attach(sync: Any, mux: Mux, hello: Hello, scope: anyio.CancelScope, tg: Any) -> RemoteExplorerHandle | None:
    if hello.protocol != PROTOCOL:
        await _refuse(mux, f"protocol {hello.protocol} is not supported (this synchronizer speaks {PROTOCOL})")
        return None
    await sync._trainer_attached.wait()
    if hello.name in sync.explorers or hello.name in sync._joining:
        await _refuse(mux, f"an explorer named {hello.name!r} is already attached")
        return None
    sync._joining.add(hello.name)
    try:
        return await _attach_named(sync, mux, hello, scope, tg)
    finally:
        sync._joining.discard(hello.name)


async def _attach_named(sync: Any, mux: Mux, hello: Hello, scope: anyio.CancelScope, tg: Any
                        ) -> RemoteExplorerHandle | None:
    cfg, trainer = sync.config, sync.trainer
    state = StatusCell(f"explorer {hello.name}")
    link = SenderLink(hello.name, mux.data, sync._make_syncer, sync.source, trainer.names, cfg.delivery_timeout,
                      on_busy_change=lambda lk: sync._on_busy(state, lk), fanout=sync.fanout)
    link.bootstrap_first = sync._no_init_bootstrap and hello.version != trainer.version
    notices_tx, notices_rx = anyio.create_memory_object_stream(math.inf)
    handle = RemoteExplorerHandle(sync, hello.name, link, state, mux, _notices=notices_tx, _scope=scope)
    latest = sync.source.latest
    await handle._send(Welcome(cfg.to_dict(), sync._syncer_config_dict(), trainer.version,
                               None if latest is None else latest.version, sync.source.trainer_stopped))
    sync.source.listeners.append(handle._on_source_event)
    tg.start_soon(link.run, name=f"aiosync-link-{hello.name}")
    tg.start_soon(handle._send_notices, notices_rx)
    state.set(RunningStatus.RUNNING)
    if cfg.method is SyncMethod.NCCL:
        # The first sync joins the trainer's next handshake (its next check point): the live
        # tensors may only be read while the trainer is not changing them.
        seq = link.request(deadline=time.monotonic() + cfg.sync_timeout)
    else:
        seq = link.request()
    await link.wait_served(seq, cfg.sync_timeout + cfg.delivery_timeout)
    if link.last_outcome != "delivered" or link.served_seq < seq:
        err = link.stats.last_error or link.last_outcome or "no answer"
        await _refuse(mux, f"the first sync of explorer {hello.name} failed ({err})")
        handle._end()
        return None
    # Only now does it count as attached: the trainer's syncs and handshakes include it from here
    # (a push coalesced behind its first sync could otherwise miss an NCCL window).
    sync.explorers[hello.name] = handle
    await handle._send(Attached(link.applied_version))
    sync._remote_joined()
    log.info("aiosync: remote explorer %s attached at version %s", hello.name, link.applied_version)
    return handle


# ----------------------------------------------------------------------------- explorer side


class RemoteExplorer:
    """An explorer in its own process, served by a :class:`~aiosync.Synchronizer` elsewhere.

    ``model``: the rollout model (an ``nn.Module``, a dict of tensors, or a ready
    :class:`PolicySlot`). ``transport``: the channel to the synchronizer's process (e.g.
    ``WeightSyncGroup.transport(trainer_rank)``). ``weight_syncer``: the receiver's syncer
    config (default: the one the synchronizer announces; required when it uses a syncer
    factory). ``connect_timeout``: bound on the Hello / Welcome exchange. ``close_timeout``:
    bound on waiting for the final drain when leaving the block (default: the synchronizer's
    ``sync_timeout + delivery_timeout``).

    Use it as ``async with RemoteExplorer(...) as explorer:``; entering joins (bootstrap and
    the first, blocking sync — any time, S12), the body uses the :class:`ExplorerHandle` API.
    Leaving the block: if the trainer already stopped, the explorer stops and waits (bounded)
    for the synchronizer's final drain, so it ends holding the trainer's last weights; if the
    trainer is still training, it leaves at once. If the synchronizer's process dies, the next
    ``sync_weight`` / ``step_done`` raises :class:`aiosync.errors.TransportError`; leases keep
    working with the weights already held.
    """

    def __init__(self, name: str, model: Any, transport: Transport, *, weight_syncer: Any = None,
                 connect_timeout: float = 120.0, close_timeout: float | None = None) -> None:
        self.name = name
        self.slot = model if isinstance(model, PolicySlot) else PolicySlot(model)
        self.transport = transport
        self.connect_timeout = connect_timeout
        self.close_timeout = close_timeout
        self._weight_syncer = weight_syncer
        self.mux = Mux(transport, timeout=connect_timeout)
        self.state = StatusCell(f"explorer {name}")
        self.config: SynchronizerConfig | None = None
        self.endpoint: ReceiverEndpoint | None = None
        self.step = 0
        self.published: int | None = None
        self.trainer_stopped = False
        self.closed = False
        self.error: BaseException | None = None
        self.outcomes: dict[str, int] = {}
        self._next_id = 0
        self._outstanding: dict[int, anyio.Event] = {}
        self._window: int | None = None  # seq of the open NCCL window
        self._window_seq = 0
        self._joined_seq = -1
        self._welcome: Welcome | None = None
        self._answer: Control | None = None
        self._welcomed = anyio.Event()
        self._answered = anyio.Event()
        self._closed_event = anyio.Event()
        self._tg: Any = None

    # -- properties -----------------------------------------------------------------

    @property
    def status(self) -> RunningStatus:
        return self.state.status

    @property
    def version(self) -> int | None:
        """The version the model holds (the applied version)."""
        return self.slot.version

    @property
    def timeouts(self) -> int:
        """Requests that timed out waiting for the trainer."""
        return self.outcomes.get("timeout", 0)

    @property
    def busy(self) -> bool:
        """A request is outstanding or an apply runs."""
        return bool(self._outstanding) or (self.endpoint is not None and self.endpoint.applying)

    # -- lifecycle ------------------------------------------------------------------

    async def __aenter__(self) -> "RemoteExplorer":
        self._tg = anyio.create_task_group()
        await self._tg.__aenter__()
        try:
            await self._join()
        except BaseException:
            self._tg.cancel_scope.cancel()
            await self._tg.__aexit__(None, None, None)
            raise
        return self

    async def _join(self) -> None:
        from .synchronizer import _syncer_factory

        self._tg.start_soon(self.mux.run)
        self._tg.start_soon(self._control)
        await self.mux.send(Hello(self.name, self.slot.version))
        with anyio.move_on_after(self.connect_timeout):
            await self._welcomed.wait()
        if isinstance(self._answer, Refused):
            with anyio.move_on_after(5):
                await self._closed_event.wait()  # answer the synchronizer's Close first
        if self._welcome is None:
            if isinstance(self._answer, Refused):
                raise HandshakeError(f"the synchronizer refused explorer {self.name}: {self._answer.reason}")
            raise PeerTimeoutError(f"explorer {self.name}: no answer from the synchronizer within "
                                   f"{self.connect_timeout}s" + (f" ({self.mux.error})" if self.mux.error else ""))
        welcome = self._welcome
        self.config = cfg = SynchronizerConfig.from_any(welcome.config)
        self.published = welcome.published
        self.trainer_stopped = welcome.trainer_stopped
        syncer = self._weight_syncer if self._weight_syncer is not None else welcome.weight_syncer
        if syncer is None:
            raise HandshakeError(f"explorer {self.name}: the synchronizer uses a weight syncer factory; "
                                 "pass weight_syncer= to RemoteExplorer")
        make_syncer, _, _ = _syncer_factory(syncer)
        self.mux.data.timeout = self.mux.control.timeout = cfg.delivery_timeout
        self.endpoint = ReceiverEndpoint(self.name, self.slot, self.mux.data, make_syncer, timeout=cfg.delivery_timeout)
        self._tg.start_soon(self.endpoint.run)
        with anyio.move_on_after(cfg.sync_timeout + cfg.delivery_timeout):
            await self._answered.wait()
        if isinstance(self._answer, Refused):
            with anyio.move_on_after(5):
                await self._closed_event.wait()  # answer the synchronizer's Close first
        if isinstance(self._answer, Attached):
            self.state.set(RunningStatus.RUNNING)
            return
        if isinstance(self._answer, Refused):
            raise ApplyError(f"explorer {self.name}: {self._answer.reason}")
        raise PeerTimeoutError(f"explorer {self.name}: the first sync did not finish within "
                               f"{cfg.sync_timeout + cfg.delivery_timeout}s"
                               + (f" ({self.mux.error})" if self.mux.error else ""))

    async def __aexit__(self, exc_type, exc, tb) -> None:
        try:
            if not self.closed and self.error is None:
                cfg = self.config
                bound = self.close_timeout if self.close_timeout is not None else cfg.sync_timeout + cfg.delivery_timeout
                if exc_type is None and self.trainer_stopped:
                    await self.stop()
                    with anyio.move_on_after(bound):
                        await self._closed_event.wait()
                if not self.closed:
                    await self.leave(timeout=min(bound, 30.0) if exc_type is None else 5.0)
        finally:
            self._tg.cancel_scope.cancel()
            await self._tg.__aexit__(None, None, None)

    async def leave(self, reason: str = "", *, timeout: float = 30.0) -> None:
        """Detach from the synchronizer now (no final drain); bounded by ``timeout``."""
        if self.closed or self.error is not None:
            return
        with anyio.move_on_after(timeout, shield=True):
            try:
                await self.mux.send(Leave(reason))
                await self._closed_event.wait()
            except (EndOfStream, TransportError, ClosedResourceError, PeerTimeoutError):
                pass
        self._finish()

    def _finish(self) -> None:
        """The session ended: by a Close (the trainer is done with us), or lost (``error``)."""
        self.closed = True
        if self.error is None:
            self.trainer_stopped = True
        if self.state.status is not RunningStatus.STOPPED:
            self.state.set_if(RunningStatus.REQUIRE_SYNC, RunningStatus.RUNNING)
            self.state.set_if(RunningStatus.RUNNING, RunningStatus.STOPPED)
        for ev in self._outstanding.values():
            ev.set()
        self._outstanding.clear()
        self._closed_event.set()

    async def _control(self) -> None:
        while True:
            try:
                msg = await self.mux.control.recv()
            except PeerTimeoutError:
                continue
            except EndOfStream:
                break
            if isinstance(msg, Welcome):
                self._welcome = msg
                self._welcomed.set()
            elif isinstance(msg, (Attached, Refused)):
                self._answer = msg
                self._welcomed.set()
                self._answered.set()
            elif isinstance(msg, Served):
                self.outcomes[msg.outcome] = self.outcomes.get(msg.outcome, 0) + 1
                ev = self._outstanding.pop(msg.id, None)
                if ev is not None:
                    ev.set()
                if not self._outstanding and self.state.status is RunningStatus.REQUIRE_SYNC:
                    self.state.set(RunningStatus.RUNNING)
            elif isinstance(msg, Notice):
                self._on_notice(msg)
            elif isinstance(msg, Close):
                try:
                    with anyio.move_on_after(10):
                        await self.mux.send(Close(self.slot.version, "bye"))
                except (EndOfStream, TransportError, ClosedResourceError, PeerTimeoutError):
                    pass
                self._finish()
                return
        if not self.closed:
            self.error = self.mux.error or EndOfStream("the synchronizer closed the session")
            log.warning("aiosync: explorer %s lost the synchronizer: %s", self.name, self.error)
            self._finish()
            self._welcomed.set()
            self._answered.set()

    def _on_notice(self, msg: Notice) -> None:
        if msg.event == "published" and msg.version is not None:
            self.published = max(self.published or msg.version, msg.version)
        elif msg.event == "window_open":
            self._window_seq += 1
            self._window = self._window_seq
            self.published = msg.version if msg.version is not None else self.published
        elif msg.event == "window_closed":
            self._window = None
        elif msg.event == "trainer_stopped":
            self.trainer_stopped = True

    def _check_usable(self, what: str) -> None:
        if self.error is not None:
            raise TransportError(f"explorer {self.name}: lost the synchronizer ({self.error}); cannot {what}") \
                from self.error
        if self.status is RunningStatus.STOPPED:
            raise StateTransitionError(f"explorer {self.name}: {what} after stop()")

    # -- the ExplorerHandle API -------------------------------------------------------

    def lease(self, timeout: float | None = None):
        """``async with explorer.lease() as (model, version)``: see :meth:`PolicySlot.lease`."""
        return self.slot.lease(timeout)

    def need_sync(self) -> bool:
        """Whether to call :meth:`sync_weight` now (after explore step ``step``); see
        :meth:`aiosync.coordination.ExplorerHandle.need_sync`."""
        if self.status is RunningStatus.STOPPED or self._outstanding or self.config is None:
            return False
        cfg = self.config
        if cfg.style is not SyncStyle.TRAINER_DRIVEN:
            return explorer_step_syncs(cfg.style, self.step, cfg.sync_interval, cfg.sync_offset)
        if cfg.method is SyncMethod.NCCL:
            return self._window is not None and self._joined_seq != self._window
        return self.published is not None and (self.slot.version is None or self.published > self.slot.version)

    async def sync_weight(self, *, wait: bool | None = None) -> int | None:
        """Ask for the newest weights; returns the version held afterwards. Same contract as
        :meth:`aiosync.coordination.ExplorerHandle.sync_weight`."""
        self._check_usable("sync_weight")
        cfg = self.config
        if self.trainer_stopped and (cfg.method is SyncMethod.NCCL or self.published is None or (
                self.slot.version is not None and self.published <= self.slot.version)):
            return self.slot.version  # S5: nothing newer will come
        blocking = not cfg.sync_weight_no_wait if wait is None else wait
        self._next_id += 1
        event = anyio.Event()
        self._outstanding[self._next_id] = event
        if self._window is not None:
            self._joined_seq = self._window
        self.state.set_if(RunningStatus.RUNNING, RunningStatus.REQUIRE_SYNC)
        try:
            await self.mux.send(SyncRequest(self._next_id))
        except (EndOfStream, TransportError) as exc:
            self._outstanding.pop(self._next_id, None)
            raise TransportError(f"explorer {self.name}: could not reach the synchronizer: {exc}") from exc
        if blocking:
            with anyio.move_on_after(cfg.sync_timeout + cfg.delivery_timeout):
                await event.wait()
            if self.error is not None:
                self._check_usable("sync_weight")
        return self.slot.version

    async def step_done(self) -> int | None:
        """Count one explore step; sync if :meth:`need_sync`. Returns the version held."""
        self._check_usable("step_done")
        self.step += 1
        if self.need_sync():
            await self.sync_weight()
        return self.slot.version

    async def wait_applied(self, timeout: float | None = None) -> int | None:
        """Wait until no request is outstanding (background applies done)."""
        timeout = self.config.delivery_timeout if timeout is None else timeout
        with anyio.move_on_after(timeout):
            while self.busy and not self.closed:
                await anyio.sleep(0.005)
        if self.busy and not self.closed:
            raise PeerTimeoutError(f"explorer {self.name}: deliveries still running after {timeout}s")
        return self.slot.version

    async def stop(self) -> None:
        """Stop (STOPPED) after outstanding applies; the synchronizer may still deliver its final
        version to this model while it drains."""
        if self.status is RunningStatus.STOPPED:
            return
        if self.error is None:
            await self.wait_applied()
            try:
                await self.mux.send(Stopped(self.step))
            except (EndOfStream, TransportError):
                pass
        self.state.set_if(RunningStatus.REQUIRE_SYNC, RunningStatus.RUNNING)
        self.state.set_if(RunningStatus.RUNNING, RunningStatus.STOPPED)

    def metrics(self) -> dict[str, Any]:
        """The explorer side's counters: version, step, served outcomes, slot and wire stats."""
        wire = getattr(self.transport, "stats", None)
        return {
            "name": self.name, "status": self.status.name, "version": self.slot.version, "step": self.step,
            "requests": self._next_id, "outcomes": dict(self.outcomes), "published": self.published,
            "trainer_stopped": self.trainer_stopped, "leases": self.slot.stats.leases,
            "error": None if self.error is None else f"{type(self.error).__name__}: {self.error}",
            "wire": None if wire is None else dict(vars(wire)),
        }


# ----------------------------------------------------------------------------- shared storage only


class CheckpointFollower:
    """An explorer that follows a CHECKPOINT directory on shared storage — no process group.

    The trainer's :class:`~aiosync.Synchronizer` (``method: checkpoint``) publishes every
    version as a safetensors file, atomically; this reads the newest one and swaps it into
    ``model`` through a :class:`PolicySlot` (cast to the model's dtypes; rollouts never see a
    half-applied version). For explorers on nodes that share a file system with the trainer
    but no network path a process group could use::

        follower = CheckpointFollower("/shared/run42/sync", rollout_model)
        await follower.wait_for_version(0, timeout=600)          # the first weights
        while ...:
            async with follower.lease() as (model, version): ...
            await follower.poll()                                 # at each check point

    Keys in a file must exist in the model with the same shape; the model's other keys are
    left alone (they are never synced).
    """

    def __init__(self, directory: Any, model: Any, *, poll_interval: float = 0.25,
                 timeout: float = 600.0) -> None:
        from ..transports.checkpoint import CheckpointDir

        self.directory = directory if isinstance(directory, CheckpointDir) else CheckpointDir(directory)
        self.slot = model if isinstance(model, PolicySlot) else PolicySlot(model)
        self.poll_interval = poll_interval
        self.timeout = timeout
        self.loads = 0

    @property
    def version(self) -> int | None:
        return self.slot.version

    def lease(self, timeout: float | None = None):
        """``async with follower.lease() as (model, version)``."""
        return self.slot.lease(timeout)

    async def poll(self) -> int | None:
        """Apply the newest published version if it is newer than the one held; returns the
        version held afterwards."""
        from ..aio import run_sync

        newest = await run_sync(self.directory.newest_version)
        if newest is None or (self.slot.version is not None and newest <= self.slot.version):
            return self.slot.version
        version, tensors = await run_sync(self.directory.load)
        if self.slot.version is not None and version <= self.slot.version:
            return self.slot.version

        async def write(model: Any) -> int:
            await run_sync(_load_into_model, model, tensors)
            return version

        await self.slot.apply(write, timeout=self.timeout)
        self.loads += 1
        return self.slot.version

    async def wait_for_version(self, version: int, *, timeout: float | None = None) -> int:
        """Poll until a version ≥ ``version`` is held; :class:`PeerTimeoutError` after ``timeout``."""
        timeout = self.timeout if timeout is None else timeout
        with anyio.move_on_after(timeout):
            while self.slot.version is None or self.slot.version < version:
                await self.poll()
                if self.slot.version is not None and self.slot.version >= version:
                    break
                await anyio.sleep(self.poll_interval)
        if self.slot.version is None or self.slot.version < version:
            raise PeerTimeoutError(f"version {version} was not published in {self.directory.path} within {timeout}s")
        return self.slot.version


def _load_into_model(model: Any, tensors: dict) -> None:
    import torch

    from ..syncers.selection import module_state_dict

    target = module_state_dict(model)
    for key, value in tensors.items():  # validate everything before writing anything
        if key not in target:
            raise HandshakeError(f"checkpoint key {key!r} is missing in the explorer's model")
        if tuple(target[key].shape) != tuple(value.shape):
            raise HandshakeError(f"shape mismatch for {key!r}: checkpoint {tuple(value.shape)}, "
                                 f"model {tuple(target[key].shape)}")
    with torch.no_grad():
        for key, value in tensors.items():
            target[key].copy_(value)
