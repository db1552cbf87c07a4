"""The explorer's end of its session with a synchronizer: :class:`ExplorerEnd`, the base of
:class:`~aiosync.coordination.explorer.Explorer`.

It joins (Hello, Welcome, the first sync), reads the control lane (answers to requests, the
trainer's notices, the synchronizer's Close), sends heartbeats while the explorer's loop shows
signs of life, and leaves. What it was told — the versions published, the NCCL window, whether
the trainer stopped, why the session was lost — is its state; :class:`Explorer` adds the API an
explorer loop calls (leases, admission, the schedule, requests).
"""

from __future__ import annotations

import contextlib
import logging
import time
import weakref
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import anyio

from .._strict import check_seconds
from ..aio import leave_task_group
from ..errors import ApplyError, EndOfStream, ExplorerLostError, HandshakeError, PeerTimeoutError, \
    StateTransitionError, TransportError
from ..syncers.base import LosesWeights
from ..syncers.factory import SyncerFactory, syncer_factory
from ..transports.base import Transport
from .applier import Applier
from .config import SynchronizerConfig
from .metrics import RunningStat
from .shard_routes import RoutedLane
from .mux import Mux
from .protocol import UNSERVED, Attached, Close, Control, Heartbeat, Hello, Leave, Notice, Refused, Served, Welcome
from .slots import PolicySlot
from .sources import HISTORY
from .states import RunningStatus, StatusCell
from .verify import held_dtypes

log = logging.getLogger("aiosync.sync")

#: Wires whose synchronizer closed (the reason of its closing Close): nobody serves them any
#: more, so an explorer that joins on one fails at once, saying why.
_UNSERVED_WIRES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

#: Outcomes of a request that count as a successful sync (EXPLORER_DRIVEN counts steps from it).
_SUCCESS = ("delivered", "up_to_date", "trainer_stopped")


@dataclass
class _Request:
    """An outstanding request: set ``answered`` when served or expired; asked after explore
    step ``step``. A request whose answer never comes (a lossy link) expires at ``expiry``
    (``sync_timeout + delivery_timeout`` after it was made): the explorer asks again."""

    answered: anyio.Event
    expiry: float
    step: int



class ExplorerEnd:
    """The explorer's end of its session (see the module doc); subclassed by :class:`Explorer`,
    whose docstring describes the arguments."""

    def __init__(self, name: str, model: Any, transport: Transport, *, weight_syncer: Any = None,
                 connect_timeout: float = 120.0, close_timeout: float | None = None,
                 shard_routes: Any = None) -> None:
        self.name = name
        self.slot: PolicySlot = model if isinstance(model, PolicySlot) else PolicySlot(model)
        self.transport = transport
        self.connect_timeout = check_seconds("Explorer connect_timeout", connect_timeout)
        self.close_timeout = None if close_timeout is None else check_seconds("Explorer close_timeout", close_timeout)
        self._weight_syncer = weight_syncer
        #: Direct routes to a sharded trainer's ranks (:class:`~aiosync.syncers.patch.shards_direct.ShardRoutes`).
        self.shard_routes = shard_routes
        self.state = StatusCell(f"explorer {name}")
        self.step = 0
        self.outcomes: dict[str, int] = {}
        self._next_id = 0
        #: Requests sent (the point of no return of a call that asks).
        self._sent = 0
        self._admission_wait_s = RunningStat()
        self._admission_timeouts = 0
        self._own_tg: Any = None
        self._run_scope: anyio.CancelScope | None = None
        #: Calls into the API in progress (signs of life while they wait).
        self._calls = 0
        self._running = False
        self._user_stopped = False
        #: Why the model lost its weights outside aiosync, until a request for its repair went out.
        self._lost: str | None = None
        self._lost_event = anyio.Event()
        if isinstance(self.slot.model, LosesWeights):  # a server that may restart: told when it did
            self.slot.model.on_weights_lost(self._weights_lost)
        self._new_session()

    def _new_session(self) -> None:
        """The state of one session (a join that failed or was cancelled may be tried again)."""
        self.mux = Mux(self.transport, timeout=self.connect_timeout)
        self.config: SynchronizerConfig | None = None
        self.applier: Applier | None = None
        #: The newest version the trainer published, as last told.
        self.published: int | None = None
        #: The versions published, as told (newest last): ``max_ahead`` counts those newer than
        #: the weights held.
        self._known: deque[int] = deque(maxlen=HISTORY)
        self.trainer_stopped = False
        self.closed = False
        #: Why the session was lost (the synchronizer's process died, or it declared this
        #: explorer lost), or ``None``.
        self.error: BaseException | None = None
        #: Outstanding requests by id.
        self._requests: dict[int, _Request] = {}
        #: The explore step of the last successful sync (the join counts as one, at step 0).
        self._synced_step = self.step
        #: The version the last sync point gave (FIXED waits for a newer one at the next).
        self._synced_version: int | None = None
        self._window: int | None = None  # seq of the open NCCL window
        self._window_seq = 0
        self._joined_window = -1
        #: A delivery to this explorer is due or under way (the session's notices say so).
        self._delivering = False
        self._welcome: Welcome | None = None
        self._answer: Control | None = None
        self._hello_error: Exception | None = None
        self._welcomed = anyio.Event()
        self._answered = anyio.Event()
        self._finished = anyio.Event()
        self._changed = anyio.Event()
        self._active = True

    @property
    def status(self) -> RunningStatus:
        """RUNNING, REQUIRE_SYNC (a request is outstanding) or STOPPED."""
        return self.state.status

    @property
    def version(self) -> int | None:
        """The version of the weights the model holds now (the applied version)."""
        return self.slot.version

    def _outstanding(self) -> bool:
        """Whether a request is outstanding (expired ones are dropped)."""
        now = time.monotonic()
        for rid in [rid for rid, req in self._requests.items() if req.expiry <= now]:
            self._requests.pop(rid).answered.set()
        if not self._requests:
            self.state.set_if(RunningStatus.REQUIRE_SYNC, RunningStatus.RUNNING)
        return bool(self._requests)

    def _notify(self) -> None:
        self._changed.set()
        self._changed = anyio.Event()

    def _touch(self) -> None:
        self._active = True  # a sign of life: the next heartbeat goes out

    @contextlib.contextmanager
    def _calling(self) -> Iterator[None]:
        """A call into the API in progress (waiting for the trainer, say) is a sign of life."""
        self._calls += 1
        self._touch()
        try:
            yield
        finally:
            self._calls -= 1
            self._touch()

    # -- lifecycle --------------------------------------------------------------------

    async def run(self, *, task_status: anyio.abc.TaskStatus = anyio.TASK_STATUS_IGNORED) -> None:
        """Join, signal readiness (``start()``), and serve the session until it ends. A refused
        or failed join raises (:class:`HandshakeError`, :class:`ApplyError`, :class:`PeerTimeoutError`).
        A join that fails or is cancelled ends its half-made session (bounded) and leaves the
        explorer as it was: it may join again at once."""
        if self._running:
            raise RuntimeError(f"explorer {self.name} is already running")
        self._running = True
        if self.mux.error is not None or self.mux.finished.is_set() or self._welcome is not None:
            self._new_session()  # an earlier join was tried
        failed: Exception | None = None
        started = False
        try:
            async with anyio.create_task_group() as tg:
                self._run_scope = tg.cancel_scope
                await tg.start(self.mux.run)
                tg.start_soon(self._control)
                try:
                    await self._join(tg)
                except BaseException as exc:
                    with anyio.CancelScope(shield=True), anyio.move_on_after(2.0):
                        await self._abandon_join()
                    if not isinstance(exc, Exception):
                        raise
                    failed = exc  # raised to the caller as it is, not in an exception group
                    tg.cancel_scope.cancel()
                else:
                    tg.start_soon(self._heartbeat)
                    tg.start_soon(self._repair_losses)
                    task_status.started(self)
                    started = True
                    await self._finished.wait()
                    tg.cancel_scope.cancel()
        except Exception as exc:
            if not started:
                raise
            # An internal error once it served: this explorer's session ends (its calls say why),
            # never the task group it runs in (the synchronizer's, for an in-process explorer).
            log.error("aiosync: explorer %s failed: %s: %s", self.name, type(exc).__name__, exc, exc_info=exc)
            if self.error is None:
                self.error = exc
            self._finish()
        finally:
            self._run_scope = None
            if not started:
                self._running = False  # it never served: it may try again
        if failed is not None:
            raise failed

    async def _abandon_join(self) -> None:
        """End the session of a join that failed or was cancelled: tell the synchronizer (its
        half-made session ends too) and wait for its answer, so that nothing of it is left on
        the wire for the next join."""
        if not self.mux.finished.is_set() and await self.mux.send_quietly(Close(self.slot.version, "join abandoned")):
            await self.mux.finished.wait()

    def abandon(self) -> None:
        """Stop serving now, without a word to the synchronizer (whose side ends the session
        itself: ``Synchronizer.attach_explorer`` was cancelled)."""
        if self._run_scope is not None:
            self._run_scope.cancel()

    async def __aenter__(self) -> "ExplorerEnd":
        if not self._running:
            tg = anyio.create_task_group()
            await tg.__aenter__()
            try:
                await tg.start(self.run)
            except BaseException as exc:
                await leave_task_group(tg, exc)  # whatever ended the join
                raise
            self._own_tg = tg
        return self

    async def __aexit__(self, exc_type, exc, tb) -> None:
        try:
            if not self.closed and self.error is None:
                cfg = self.config
                bound = self.close_timeout if self.close_timeout is not None else cfg.sync_timeout + cfg.delivery_timeout
                if exc_type is None and self.trainer_stopped:
                    await self.stop()
                    with anyio.move_on_after(bound):
                        await self._finished.wait()  # the final drain, then the synchronizer's Close
                if not self.closed:
                    await self.leave(timeout=min(bound, 30.0) if exc_type is None else 5.0)
        finally:
            tg, self._own_tg = self._own_tg, None
            if tg is not None:
                tg.cancel_scope.cancel()
                await tg.__aexit__(None, None, None)  # the body's exception is not the task group's

    async def _join(self, tg: Any) -> None:
        closed = _UNSERVED_WIRES.get(self.transport)
        if closed is not None:
            raise EndOfStream(f"explorer {self.name}: nobody serves this wire — {closed[len(UNSERVED):].strip()} "
                              "at the end of this wire's last session; join a synchronizer that serves it")
        tg.start_soon(self._hello)  # the answer may come first: a wire nobody serves any more
        with anyio.move_on_after(self.connect_timeout):
            await self._welcomed.wait()
        if self._welcome is None:
            if isinstance(self._answer, Close):  # what was left on the wire for us, before any session
                reason = self._answer.reason
                if reason.startswith(UNSERVED):
                    raise EndOfStream(f"explorer {self.name}: nobody serves this wire — {reason[len(UNSERVED):].strip()}")
                raise EndOfStream(f"explorer {self.name}: the synchronizer ended the session before it began "
                                  f"({reason or 'no reason given'}); join again")
            if self._hello_error is not None:
                raise self._hello_error
            await self._after_refusal()
            if isinstance(self._answer, Refused):
                raise HandshakeError(f"the synchronizer refused explorer {self.name}: {self._answer.reason}")
            raise PeerTimeoutError(f"explorer {self.name}: no answer from the synchronizer within "
                                   f"{self.connect_timeout}s" + (f" ({self.mux.error})" if self.mux.error else ""))
        welcome = self._welcome
        self.config = cfg = SynchronizerConfig.from_any(welcome.config)
        self._note_published(welcome.published)
        self.trainer_stopped = welcome.trainer_stopped
        syncers = self._weight_syncer if self._weight_syncer is not None else welcome.weight_syncer
        if syncers is None:
            raise HandshakeError(f"explorer {self.name}: the synchronizer uses a weight syncer factory; "
                                 "pass weight_syncer= to the explorer")
        if not isinstance(syncers, SyncerFactory):
            syncers = syncer_factory(syncers)
        self.transport.use_comm_options(syncers.comm_options)  # W4 on this end too (ConfigError if it cannot)
        self.mux.set_timeout(cfg.delivery_timeout)
        lane = self.mux.data if self.shard_routes is None else RoutedLane(self.mux.data, self.shard_routes)
        self.applier = Applier(self.name, self.slot, lane, syncers, timeout=cfg.delivery_timeout,
                               on_busy_change=lambda busy: self._notify())
        await tg.start(self.applier.run)
        with anyio.move_on_after(cfg.sync_timeout + cfg.delivery_timeout):
            await self._answered.wait()
        if isinstance(self._answer, Attached):
            self._synced_version = self.slot.version  # the join is the first sync point
            self.state.set(RunningStatus.RUNNING)
            return
        await self._after_refusal()
        if isinstance(self._answer, Refused):
            raise ApplyError(f"explorer {self.name}: {self._answer.reason}")
        raise PeerTimeoutError(f"explorer {self.name}: the first sync did not finish within "
                               f"{cfg.sync_timeout + cfg.delivery_timeout}s"
                               + (f" ({self.mux.error})" if self.mux.error else ""))

    async def _hello(self) -> None:
        """Say Hello; a send that fails ends the join with its error."""
        try:
            await self.mux.send(Hello(self.name, self.slot.version, dtypes=held_dtypes(self.slot.model)))
        except Exception as exc:
            if not self.mux.peer_closed.is_set():  # else the peer's Close came first: it is the answer
                self._hello_error = exc
                self._welcomed.set()

    async def _after_refusal(self) -> None:
        if isinstance(self._answer, Refused):
            with anyio.move_on_after(5):
                await self._finished.wait()  # answer the synchronizer's Close first

    async def leave(self, reason: str = "", *, timeout: float = 30.0) -> None:
        """Detach from the synchronizer now (no final drain); bounded by ``timeout``."""
        if self.closed or self.error is not None:
            return
        with anyio.move_on_after(timeout, shield=True):
            if await self.mux.send_quietly(Leave(reason)):
                await self._finished.wait()
        self._finish()

    def _finish(self) -> None:
        """The session ended: by a Close (the synchronizer is done with us), or lost (``error``)."""
        self.closed = True
        if self.error is None:
            self.trainer_stopped = True
        self.state.set_if(RunningStatus.REQUIRE_SYNC, RunningStatus.RUNNING)
        self.state.set_if(RunningStatus.RUNNING, RunningStatus.STOPPED)
        for req in self._requests.values():
            req.answered.set()
        self._requests.clear()
        self._delivering = False
        self._finished.set()
        self._notify()

    async def _control(self) -> None:
        while (msg := await self.mux.control.next_message()) is not None:
            if isinstance(msg, Welcome):
                self._welcome = msg
                self._welcomed.set()
            elif isinstance(msg, (Attached, Refused)):
                self._answer = msg
                self._welcomed.set()
                self._answered.set()
            elif isinstance(msg, Served):
                self._served(msg)
            elif isinstance(msg, Notice):
                self._on_notice(msg)
            elif isinstance(msg, Close):
                if self._welcome is None and self._answer is None:  # before any answer: the join ends with it
                    self._answer = msg
                    self._welcomed.set()
                    if msg.reason.startswith(UNSERVED):  # nobody reads this wire: nothing to answer
                        return
                if msg.reason.startswith(UNSERVED):  # the synchronizer closed: nobody serves this wire any more
                    with contextlib.suppress(TypeError):
                        _UNSERVED_WIRES[self.transport] = msg.reason
                if msg.reason.startswith("lost:"):
                    reason = msg.reason[len("lost:"):].strip()
                    self.error = ExplorerLostError(f"the synchronizer declared explorer {self.name} lost: {reason}",
                                                   reason=reason)
                with anyio.move_on_after(10):
                    await self.mux.send_quietly(Close(self.slot.version, "bye"))
                self._finish()
                return
        if not self.closed:
            self.error = self.mux.error or TransportError("the synchronizer closed the session")
            log.warning("aiosync: explorer %s lost the synchronizer: %s", self.name, self.error)
            self._finish()
            self._welcomed.set()
            self._answered.set()

    def _served(self, msg: Served) -> None:
        self.outcomes[msg.outcome] = self.outcomes.get(msg.outcome, 0) + 1
        req = self._requests.pop(msg.id, None)
        if req is not None:
            req.answered.set()
            if msg.outcome in _SUCCESS:
                self._synced_step = max(self._synced_step, req.step)
        if not self._requests:
            self.state.set_if(RunningStatus.REQUIRE_SYNC, RunningStatus.RUNNING)
        self._notify()

    def _note_published(self, version: int | None) -> None:
        if version is None:
            return
        self.published = max(self.published if self.published is not None else version, version)
        if not self._known or version > self._known[-1]:
            self._known.append(version)

    @property
    def behind(self) -> int:
        """How many versions the trainer published (as told) are newer than the weights held."""
        held = self.slot.version
        return sum(1 for v in self._known if held is None or v > held)

    def _on_notice(self, msg: Notice) -> None:
        if msg.event == "published":
            self._note_published(msg.version)
        elif msg.event == "window_open":
            self._window_seq += 1
            self._window = self._window_seq
            self._note_published(msg.version)
        elif msg.event == "window_closed":
            self._window = None
        elif msg.event == "trainer_stopped":
            self.trainer_stopped = True
        elif msg.event in ("delivering", "settled"):
            self._delivering = msg.event == "delivering"
        self._notify()

    def _weights_lost(self, reason: str) -> None:
        """The model lost the weights of its version where they live (a server restarted): it
        reports none from now on (leases wait), and asks for a bootstrap (:meth:`_repair_losses`)."""
        self.slot.lose(reason)
        self._lost = reason
        self._lost_event.set()
        self._notify()

    async def _repair_losses(self) -> None:
        """Ask for a bootstrap whenever the model lost its weights (``SyncRequest.lost``)."""
        while not self.closed:
            await self._lost_event.wait()  # the session's end cancels this task
            self._lost_event = anyio.Event()
            reason, self._lost = self._lost, None
            if reason is not None and not self.closed and self.error is None:
                await self._ask(False, lost=reason)

    async def _heartbeat(self) -> None:
        """Tell the session this explorer is alive, while its loop shows signs of life."""
        interval = self.config.liveness_timeout / 4
        while not self.closed:
            await anyio.sleep(interval)
            if (self._active or self.slot.readers or self._calls) and self.status is not RunningStatus.STOPPED:
                self._active = False
                await self.mux.send_quietly(Heartbeat(self.step))

    def _check_usable(self, what: str) -> None:
        self._touch()
        if self.error is not None:
            raise self._lost_error(what) from self.error
        if self._user_stopped:
            raise StateTransitionError(f"explorer {self.name}: {what} after stop()")

    def _lost_error(self, what: str) -> ExplorerLostError:
        """The error a call of a lost explorer raises: why its session ended, and what to do."""
        cause = self.error if self.error is not None else self.mux.error
        if isinstance(cause, ExplorerLostError):
            why, reason = str(cause), cause.reason
        else:
            why = f"lost the synchronizer ({type(cause).__name__}: {cause})"
            reason = why
        return ExplorerLostError(
            f"explorer {self.name}: cannot {what}: {why}. Its session is over (leases still read the weights it "
            "holds); attach it again under its name (Synchronizer.attach_explorer, or a new Explorer in its "
            "process) to start from the newest version", reason=reason)

