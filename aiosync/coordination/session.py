"""The synchronizer's side of one explorer: :class:`ExplorerSession`.

One session per explorer, whether the explorer runs in the trainer's process (an in-process
transport pair) or in another one (e.g. a ``DistributedTransport``): it waits for the
explorer's Hello, attaches it (Welcome, the first, blocking sync, Attached), answers its
requests, tells it what the trainer does (notices), watches its liveness, and ends the session
(Close) when the synchronizer closes, the explorer leaves, or it is lost.

An explorer is **lost** when its wire fails (its process died) or when it shows no sign of life
for ``liveness_timeout`` seconds while running — no call into its API and no lease held, so its
loop died without ``stop()`` or its process hangs. A lost explorer is STOPPED, its ``error``
says why, handshakes no longer wait for it, and the trainer serves the others on.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from ..errors import EndOfStream, PeerTimeoutError
from ..transports.base import Transport
from .delivery import DeliveryLine, LineStatistics
from .hub import Hub
from .mux import Mux
from .protocol import (PROTOCOL, Attached, Close, Heartbeat, Hello, Leave, Notice, Refused, Served, Stopped,
                       SyncRequest, Welcome)
from .states import RunningStatus, StatusCell
from .styles import SyncMethod
from .verify import StateCheck

log = logging.getLogger("aiosync.sync")


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


@dataclass(frozen=True)
class ExplorerStatistics(LineStatistics):
    """The synchronizer's view of one explorer (B6): its delivery line's counters, plus its
    status, version and whether it was lost. ``model``: the snapshot of the explorer's model's
    own ``statistics()`` for an explorer in this process whose model has one (a ``vllm
    serve`` server's :class:`~aiosync.engines.vllm_server.ServerStatistics`, a
    ``VLLMTarget``'s), else ``None``."""

    name: str
    status: str
    version: int | None
    step: int
    lost: bool
    model: Any = None


class ExplorerSession:
    """Serves one explorer over ``wire`` (made by ``Synchronizer.attach_explorer`` and
    ``Synchronizer.serve_remote``; start :meth:`run` in a task group)."""

    def __init__(self, hub: Hub, wire: Transport) -> None:
        self.hub = hub
        self.wire = wire
        self.mux = Mux(wire, timeout=hub.config.delivery_timeout)
        self.name: str = "?"
        self.line: DeliveryLine | None = None
        self.state = StatusCell("explorer ?")
        self.step = 0
        #: Why the explorer was lost (its process died, its wire broke, it went silent), or ``None``.
        self.error: BaseException | None = None
        #: The explorer's model's ``statistics`` (an explorer in this process), for :meth:`statistics`.
        self.model_statistics: Callable[[], Any] | None = None
        self.closed = False
        self._attached = False
        self._closing = False
        self._notices_tx: MemoryObjectSendStream | None = None
        self._beat = anyio.Event()
        self._tg: Any = None
        #: A Hello that arrived on this wire after the session ended: a new explorer (or the same
        #: one, back) — :meth:`Synchronizer.serve_remote` starts the next session with it.
        self.next_hello: Hello | None = None

    # -- the synchronizer's view ---------------------------------------------------------

    @property
    def status(self) -> RunningStatus:
        return self.state.status

    @property
    def version(self) -> int | None:
        """The version the explorer last reported as applied."""
        return None if self.line is None else self.line.applied_version

    @property
    def lost(self) -> bool:
        return self.error is not None

    @property
    def attached(self) -> bool:
        return self._attached

    @property
    def open(self) -> bool:
        return self._attached and not self.closed

    @property
    def expects_handshakes(self) -> bool:
        """NCCL handshakes wait for this explorer: it runs (not stopped) and is alive."""
        return self.open and self.state.status is not RunningStatus.STOPPED

    def statistics(self) -> ExplorerStatistics:
        line = self.line.statistics()
        fields = {f.name: getattr(line, f.name) for f in dataclasses.fields(line)}
        if self.error is not None:
            fields["last_error"] = f"{type(self.error).__name__}: {self.error}"
        model = None
        if self.model_statistics is not None:
            try:
                model = self.model_statistics()
            except Exception as exc:  # a model's own counters never break the synchronizer's
                model = {"error": f"{type(exc).__name__}: {exc}"}
        return ExplorerStatistics(**fields, name=self.name, status=self.status.name, version=self.version,
                                  step=self.step, lost=self.lost, model=model)

    # -- the task ----------------------------------------------------------------------

    async def run(self, hello: Hello | None = None, *,
                  task_status: anyio.abc.TaskStatus = anyio.TASK_STATUS_IGNORED) -> None:
        """Listen for the explorer's Hello (now or later: elastic joins, S12; ``hello``: one that
        already arrived), attach it, then serve it until the session ends. Signals readiness once
        it listens. Never raises (but cancellation): whatever goes wrong in one session ends that
        session — the explorer is lost, ``error`` says why — never the synchronizer."""
        try:
            async with anyio.create_task_group() as tg:
                self._tg = tg
                await tg.start(self.mux.run)
                task_status.started(self)
                hello = hello or await self._wait_hello()
                if hello is not None and await self._attach(hello, tg):
                    await self._serve_control()
                tg.cancel_scope.cancel()
        except Exception as exc:  # an internal error of this session: it ends, the others go on
            log.error("aiosync: the session of explorer %s failed: %s", self.name, _describe(exc), exc_info=exc)
            self._lose(exc)

    async def _wait_hello(self) -> Hello | None:
        while (msg := await self.mux.control.next_message()) is not None:  # None: it went away before it joined
            if isinstance(msg, Hello):
                return msg
            if isinstance(msg, Close):  # it gave up before its Hello came: answer, the wire is free again
                await self.mux.send_quietly(Close(None, "bye"))
                return None
        return None

    async def _refuse(self, reason: str) -> None:
        log.warning("aiosync: refused explorer %s: %s", self.name, reason)
        self.hub.last_refusal = f"explorer {self.name}: {reason}"
        with anyio.move_on_after(10, shield=True):
            await self.mux.send_quietly(Refused(reason))
            await self.mux.send_quietly(Close(None, reason))
            await self.mux.finished.wait()

    async def _attach(self, hello: Hello, tg: Any) -> bool:
        hub, cfg = self.hub, self.hub.config
        self.name = hello.name
        self.state.who = f"explorer {hello.name}"
        if hello.protocol != PROTOCOL:
            await self._refuse(f"protocol {hello.protocol} is not supported (this synchronizer speaks {PROTOCOL})")
            return False
        with anyio.fail_after(cfg.sync_timeout + cfg.delivery_timeout):
            await hub.trainer_attached.wait()
        held = hub.sessions.get(hello.name)
        if (held is not None and not held.closed) or hello.name in hub.joining:
            # A closed session's name is free: an explorer that was lost (or left) may come back
            # under it (R2, e.g. an actor Ray restarted); its new session replaces the old one.
            await self._refuse(f"an explorer named {hello.name!r} is already attached")
            return False
        hub.joining[hello.name] = self
        try:
            return await self._first_sync(hello, tg)
        finally:
            hub.joining.pop(hello.name, None)

    async def _first_sync(self, hello: Hello, tg: Any) -> bool:
        hub, cfg, trainer = self.hub, self.hub.config, self.hub.trainer
        line = DeliveryLine(hello.name, self.mux.data, hub.senders or hub.syncers, hub.source, trainer.names,
                            cfg.delivery_timeout, fanout=hub.fanout, on_change=self._on_line_change, wire=self.wire,
                            stalled=hub.stalled)
        # A patch syncer without init_sync trusts the explorer to hold the trainer's weights
        # already (the seed's assumption); only an explorer that declares the version gets that trust.
        line.bootstrap_first = hub.syncers.bootstrap_unless_declared and hello.version != trainer.version
        # Whole-state verification (a sharded trainer's state is not digested on one rank)
        line.state_check = StateCheck.for_explorer(cfg.verify_state if hub.shard_peers is None else None,
                                                   hub.syncers.config, trainer.names, hello.dtypes)
        self.line = line
        latest = hub.source.latest
        await self.mux.send_quietly(Welcome(cfg.to_dict(), hub.syncers.to_dict(), trainer.version,
                                            None if latest is None else latest.version, hub.source.trainer_stopped))
        self._notices_tx, notices_rx = anyio.create_memory_object_stream(math.inf)
        hub.source.listeners.append(self._on_source_event)
        await tg.start(line.run)
        tg.start_soon(self._send_notices, notices_rx)
        self.state.set(RunningStatus.RUNNING)
        # NCCL: the first sync joins the trainer's next handshake (its next check point, or
        # attach_explorer / wait_for_explorers in the trainer's task): the live tensors may only
        # be read while the trainer does not change them.
        if cfg.method is SyncMethod.NCCL:
            seq = line.request(deadline=time.monotonic() + cfg.sync_timeout)
        else:
            seq = line.request()
        tg.start_soon(self._watch_join, line)
        await line.wait_served(seq, cfg.sync_timeout + cfg.delivery_timeout)
        if not self.closed and line.state_check is not None and line.state_check.mismatched and line.request_seq > seq:
            seq = line.request_seq  # its state did not verify: the repair that asked for at once
            await line.wait_served(seq, cfg.sync_timeout + cfg.delivery_timeout)
        if self.closed:
            return False  # ended meanwhile (the synchronizer closes, or the join was abandoned)
        if line.served_seq < seq or line.applied_version is None or line.needs_reinit:  # nothing delivered
            err = line.stats.last_error or line.last_outcome or "no answer"
            await self._refuse(f"the first sync of explorer {hello.name} failed ({err})")
            self._end()
            return False
        # Only now does it count as attached: syncs and handshakes include it from here.
        self._attached = True
        hub.sessions[hello.name] = self
        await self.mux.send_quietly(Attached(line.applied_version))
        hub.changed()
        tg.start_soon(self._watch_liveness)
        log.info("aiosync: explorer %s attached at version %s", hello.name, line.applied_version)
        return True

    async def _watch_join(self, line: DeliveryLine) -> None:
        """An explorer that gives up its join (its Close, or its wire broke) ends its first sync
        at once — also while that waits for the trainer (an NCCL window) — so it is answered now,
        not when the first sync's own bound runs out."""
        await self.mux.finished.wait()
        if not self._attached:
            line.close()

    def _on_line_change(self, busy: bool | None, settled: bool | None) -> None:
        """The line went busy / idle (the explorer's status, as the synchronizer sees it), or a
        delivery started / ended (the explorer is told: its ``wait_applied`` waits for it)."""
        if busy is True:
            self.state.set_if(RunningStatus.RUNNING, RunningStatus.REQUIRE_SYNC)
        elif busy is False:
            self.state.set_if(RunningStatus.REQUIRE_SYNC, RunningStatus.RUNNING)
        if settled is not None:
            self._on_source_event("settled" if settled else "delivering", self.version)

    def _on_source_event(self, event: str, version: int | None) -> None:
        if self._notices_tx is not None and not self.closed:
            try:
                self._notices_tx.send_nowait(Notice(event, version))
            except (anyio.ClosedResourceError, anyio.BrokenResourceError):
                pass

    async def _send_notices(self, rx: MemoryObjectReceiveStream) -> None:
        async with rx:
            async for notice in rx:
                await self.mux.send_quietly(notice)

    async def _serve_control(self) -> None:
        """Answer the explorer's control messages until the session ends. Every message is
        weighed against the session's state: once the session is closed (lost, detached: its
        Close is on the way), what crosses that Close on the wire is dropped — the explorer
        learns from the Close — and a Hello means a new explorer on this wire (:attr:`next_hello`)."""
        while (msg := await self.mux.control.next_message()) is not None:
            self._beat.set()  # every message is a sign of life
            if self.closed:
                if isinstance(msg, Hello):  # the explorer came back on this wire without closing the old session
                    self.next_hello = msg
                    break
                if isinstance(msg, Close):
                    break
                log.debug("aiosync: explorer %s: dropped a %s that crossed the end of its session", self.name,
                          type(msg).__name__)
                continue
            if not await self._on_control(msg):
                break
        if not self.closed and not self._closing:
            self._lose(self.mux.error or EndOfStream("the explorer closed its session"))

    async def _on_control(self, msg: Any) -> bool:
        """Handle one control message of an open session; ``False`` ends the session."""
        cfg = self.hub.config
        if isinstance(msg, Heartbeat):
            self.step = max(self.step, msg.step)
        elif isinstance(msg, SyncRequest):
            if msg.lost is not None:  # its model lost its weights (a restarted server): it holds none, bootstrap it
                log.warning("aiosync: explorer %s lost its weights (version %s): %s", self.name,
                            self.line.applied_version, msg.lost)
                line = self.line
                line.applied_version, line.needs_reinit, line.bootstrap_first = None, True, True
                line.stats.last_error = f"lost its weights: {msg.lost}"
            seq = self.hub.request(self.line, self.line.applied_version)
            if seq is None:
                await self.mux.send_quietly(Served(msg.id, "trainer_stopped", self.line.applied_version))
            else:
                self._tg.start_soon(self._answer, msg.id, seq, cfg.sync_timeout + cfg.delivery_timeout)
        elif isinstance(msg, Stopped):
            self.step = max(self.step, msg.step)
            self._stopped()
        elif isinstance(msg, Leave):
            log.info("aiosync: explorer %s leaves: %s", self.name, msg.reason or "done")
            if self.hub.sessions.get(self.name) is self:
                del self.hub.sessions[self.name]
            await self.close("left", timeout=cfg.sync_timeout)
            return False
        elif isinstance(msg, Close):
            if not self._closing:  # the explorer ended the session: answer it
                self._closing = True
                await self.mux.send_quietly(Close(self.line.applied_version, "bye"))
                self._end()
            return False
        else:
            log.warning("aiosync: explorer %s sent an unexpected %s; ignored", self.name, type(msg).__name__)
        return True

    async def _answer(self, request_id: int, seq: int, timeout: float) -> None:
        await self.line.wait_served(seq, timeout)
        outcome = self.line.last_outcome if self.line.served_seq >= seq else "pending"
        await self.mux.send_quietly(Served(request_id, outcome, self.line.applied_version))

    async def _watch_liveness(self) -> None:
        """Declare the explorer lost when it runs but shows no sign of life for ``liveness_timeout``."""
        bound = self.hub.config.liveness_timeout
        while not self.closed:
            self._beat = anyio.Event()
            with anyio.move_on_after(bound) as scope:
                await self._beat.wait()
            if scope.cancelled_caught and not self.closed and self.state.status is not RunningStatus.STOPPED:
                self._lose(PeerTimeoutError(
                    f"explorer {self.name} showed no sign of life for liveness_timeout={bound}s (no call into its "
                    "API, no lease held): its loop ended without stop(), or its process hangs. Call "
                    "explorer.stop() when an explorer loop ends; raise synchronizer.liveness_timeout for explorers "
                    "that pause longer"))
                with anyio.move_on_after(5, shield=True):
                    await self.mux.send_quietly(Close(self.line.applied_version, f"lost: {self.error}"))

    # -- ending ------------------------------------------------------------------------

    def _stopped(self) -> None:
        """Handshakes stop waiting for this explorer (it said Stopped); drains still serve it."""
        self.state.set_if(RunningStatus.REQUIRE_SYNC, RunningStatus.RUNNING)
        self.state.set_if(RunningStatus.RUNNING, RunningStatus.STOPPED)
        self.hub.changed()

    def _lose(self, exc: BaseException) -> None:
        if self.closed:
            return
        self.error = exc
        log.warning("aiosync: lost explorer %s: %s: %s", self.name, type(exc).__name__, exc)
        if self.line is not None:
            self.line.stats.last_error = f"{type(exc).__name__}: {exc}"
        self._end()

    def _end(self) -> None:
        self.closed = True
        if self.line is not None:
            self.line.close()
        self.state.set_if(RunningStatus.REQUIRE_SYNC, RunningStatus.RUNNING)
        self.state.set_if(RunningStatus.RUNNING, RunningStatus.STOPPED)
        try:
            self.hub.source.listeners.remove(self._on_source_event)
        except ValueError:
            pass
        if self._notices_tx is not None:
            self._notices_tx.close()
        self.hub.changed()

    def abandon(self) -> None:
        """End the session now, without a word to the explorer (``Synchronizer.attach_explorer``
        was cancelled: the explorer it made is abandoned too). Its name is free at once."""
        if self.hub.joining.get(self.name) is self:
            del self.hub.joining[self.name]
        if self.hub.sessions.get(self.name) is self:
            del self.hub.sessions[self.name]
        if not self.closed:
            self._closing = True
            self._end()
        if self._tg is not None:
            self._tg.cancel_scope.cancel()

    async def close(self, reason: str = "", *, timeout: float = 10.0) -> None:
        """End the session: send Close, wait (bounded, shielded) for the explorer's Close."""
        if not self.closed:
            self._closing = True
            with anyio.move_on_after(timeout, shield=True):
                if await self.mux.send_quietly(Close(self.version, reason)):
                    await self.mux.finished.wait()  # the reader ends on the answer or a broken wire
            self._end()
        if self._tg is not None:
            self._tg.cancel_scope.cancel()
