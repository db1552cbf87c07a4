"""An explorer (rollout worker): :class:`Explorer`, one class wherever it runs.

In the trainer's process, :meth:`aiosync.Synchronizer.attach_explorer` makes one over an
in-process transport pair (zero copy) and returns it, attached. In another process, make it
yourself over a transport to the synchronizer's process and enter it::

    async with Explorer("e1", rollout_model, group.transport(trainer_rank)) as explorer:
        while not explorer.trainer_stopped:
            async with explorer.lease() as (model, version):   # one whole version, never torn
                trajectory = await rollout(model)
            trajectory["version"] = version                     # stamp it (staleness, S10)
            await explorer.step_done()                          # check point (S1)

Either way it talks to its :class:`~aiosync.coordination.session.ExplorerSession` with the
messages of :mod:`aiosync.coordination.protocol`, holds its model in a
:class:`~aiosync.coordination.slots.PolicySlot`, and applies deliveries with an
:class:`~aiosync.coordination.applier.Applier` (staged outside the slot's exclusive section).

While its loop shows signs of life — calls into this API, or a lease held — it sends a
heartbeat every ``liveness_timeout / 4`` seconds; an explorer whose loop died without
:meth:`stop` goes silent and is declared lost by the synchronizer (then its next call raises
:class:`~aiosync.errors.TransportError`; leases keep working with the weights held).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

import anyio
import anyio.lowlevel

from .._strict import check_seconds
from ..errors import (ApplyError, EndOfStream, HandshakeError, PeerTimeoutError, StateTransitionError, TransportError,
                      WouldBlock)
from ..syncers.factory import SyncerFactory, syncer_factory
from ..transports.base import Transport
from .applier import Applier
from .config import SynchronizerConfig
from .metrics import RunningStat, Series
from .mux import Mux
from .protocol import (Attached, Close, Control, Heartbeat, Hello, Leave, Notice, Refused, Served, Stopped,
                       SyncRequest, Welcome)
from .slots import Lease, PolicySlot, Rollout
from .states import RunningStatus, StatusCell
from .styles import SyncMethod, SyncStyle, explorer_step_syncs
from .verify import held_dtypes

log = logging.getLogger("aiosync.sync")

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


@dataclass(frozen=True)
class ExplorerSideStatistics:
    """The explorer's own counters."""

    name: str
    status: str
    version: int | None
    step: int
    requests: int
    outcomes: dict
    published: int | None
    trainer_stopped: bool
    leases: int
    error: str | None
    #: Admission control (``max_ahead``): rollouts that waited for newer weights before they
    #: started, how long, and how many started anyway after the bound.
    admission_wait_s: Series
    admission_timeouts: int


class Explorer:
    """One explorer, attached to a synchronizer over ``transport``.

    ``model``: the rollout model (an ``nn.Module``, a dict of tensors, or a ready
    :class:`PolicySlot`). ``weight_syncer``: the receiver's syncer config or factory (default:
    the one the synchronizer announces; required when it uses a syncer factory).
    ``connect_timeout``: bound on the Hello / Welcome exchange. ``close_timeout``: bound on
    waiting for the final drain when leaving an ``async with`` block (default: the
    synchronizer's ``sync_timeout + delivery_timeout``).

    Entering (``async with``) joins — any time, S12: bootstrap and the first, always blocking
    sync. Leaving: if the trainer already stopped, the explorer stops and waits (bounded) for
    the synchronizer's final drain, so it ends holding the trainer's last weights; otherwise it
    leaves at once. If the synchronizer is lost, the next ``sync_weight`` / ``step_done``
    raises :class:`aiosync.errors.TransportError`; leases keep working with the weights held.
    """

    def __init__(self, name: str, model: Any, transport: Transport, *, weight_syncer: Any = None,
                 connect_timeout: float = 120.0, close_timeout: float | None = None) -> None:
        self.name = name
        self.slot: PolicySlot = model if isinstance(model, PolicySlot) else PolicySlot(model)
        self.transport = transport
        self.connect_timeout = check_seconds("Explorer connect_timeout", connect_timeout)
        self.close_timeout = None if close_timeout is None else check_seconds("Explorer close_timeout", close_timeout)
        self._weight_syncer = weight_syncer
        self.mux = Mux(transport, timeout=connect_timeout)
        self.state = StatusCell(f"explorer {name}")
        self.config: SynchronizerConfig | None = None
        self.applier: Applier | None = None
        self.step = 0
        #: The newest version the trainer published, as last told.
        self.published: int | None = None
        self.trainer_stopped = False
        self.closed = False
        #: Why the session was lost (the synchronizer's process died, or it declared this
        #: explorer lost), or ``None``.
        self.error: BaseException | None = None
        self.outcomes: dict[str, int] = {}
        #: Outstanding requests by id.
        self._requests: dict[int, _Request] = {}
        #: The explore step of the last successful sync (the join counts as one, at step 0).
        self._synced_step = 0
        #: The version the last sync point gave (FIXED waits for a newer one at the next).
        self._synced_version: int | None = None
        self._next_id = 0
        self._window: int | None = None  # seq of the open NCCL window
        self._window_seq = 0
        self._joined_window = -1
        #: A delivery to this explorer is due or under way (the session's notices say so).
        self._delivering = False
        self._welcome: Welcome | None = None
        self._answer: Control | None = None
        self._welcomed = anyio.Event()
        self._answered = anyio.Event()
        self._finished = anyio.Event()
        self._changed = anyio.Event()
        self._active = True
        self._admission_wait_s = RunningStat()
        self._admission_timeouts = 0
        self._own_tg: Any = None
        self._running = False
        self._user_stopped = False

    # -- properties -------------------------------------------------------------------

    @property
    def status(self) -> RunningStatus:
        """RUNNING, REQUIRE_SYNC (a request is outstanding) or STOPPED."""
        return self.state.status

    @property
    def version(self) -> int | None:
        """The version of the weights the model holds now (the applied version)."""
        return self.slot.version

    @property
    def timeouts(self) -> int:
        """Requests that timed out waiting for the trainer."""
        return self.outcomes.get("timeout", 0)

    @property
    def busy(self) -> bool:
        """A request is outstanding, or a delivery is due or being applied."""
        return self._outstanding() or self._delivering or (self.applier is not None and self.applier.busy)

    def _outstanding(self) -> bool:
        """Whether a request is outstanding (expired ones are dropped)."""
        now = time.monotonic()
        for rid in [rid for rid, req in self._requests.items() if req.expiry <= now]:
            self._requests.pop(rid).answered.set()
        if not self._requests:
            self.state.set_if(RunningStatus.REQUIRE_SYNC, RunningStatus.RUNNING)
        return bool(self._requests)

    def statistics(self) -> ExplorerSideStatistics:
        err = None if self.error is None else f"{type(self.error).__name__}: {self.error}"
        return ExplorerSideStatistics(self.name, self.status.name, self.slot.version, self.step, self._next_id,
                                      dict(self.outcomes), self.published, self.trainer_stopped,
                                      self.slot.stats.leases, err, self._admission_wait_s.snapshot(),
                                      self._admission_timeouts)

    def _notify(self) -> None:
        self._changed.set()
        self._changed = anyio.Event()

    def _touch(self) -> None:
        self._active = True  # a sign of life: the next heartbeat goes out

    # -- lifecycle --------------------------------------------------------------------

    async def run(self, *, task_status: anyio.abc.TaskStatus = anyio.TASK_STATUS_IGNORED) -> None:
        """Join, signal readiness (``start()``), and serve the session until it ends. A refused
        or failed join raises (:class:`HandshakeError`, :class:`ApplyError`, :class:`PeerTimeoutError`)."""
        if self._running:
            raise RuntimeError(f"explorer {self.name} is already running")
        self._running = True
        failed: Exception | None = None
        async with anyio.create_task_group() as tg:
            await tg.start(self.mux.run)
            tg.start_soon(self._control)
            try:
                await self._join(tg)
            except Exception as exc:  # raised to the caller as it is, not in an exception group
                failed = exc
                tg.cancel_scope.cancel()
            else:
                tg.start_soon(self._heartbeat)
                task_status.started(self)
                await self._finished.wait()
                tg.cancel_scope.cancel()
        if failed is not None:
            raise failed

    async def __aenter__(self) -> "Explorer":
        if not self._running:
            self._own_tg = anyio.create_task_group()
            await self._own_tg.__aenter__()
            try:
                await self._own_tg.start(self.run)
            except BaseException:
                self._own_tg.cancel_scope.cancel()
                await self._own_tg.__aexit__(None, None, None)
                raise
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
            if self._own_tg is not None:
                self._own_tg.cancel_scope.cancel()
                await self._own_tg.__aexit__(None, None, None)

    async def _join(self, tg: Any) -> None:
        await self.mux.send(Hello(self.name, self.slot.version, dtypes=held_dtypes(self.slot.model)))
        with anyio.move_on_after(self.connect_timeout):
            await self._welcomed.wait()
        if self._welcome is None:
            await self._after_refusal()
            if isinstance(self._answer, Refused):
                raise HandshakeError(f"the synchronizer refused explorer {self.name}: {self._answer.reason}")
            raise PeerTimeoutError(f"explorer {self.name}: no answer from the synchronizer within "
                                   f"{self.connect_timeout}s" + (f" ({self.mux.error})" if self.mux.error else ""))
        welcome = self._welcome
        self.config = cfg = SynchronizerConfig.from_any(welcome.config)
        self.published = welcome.published
        self.trainer_stopped = welcome.trainer_stopped
        syncers = self._weight_syncer if self._weight_syncer is not None else welcome.weight_syncer
        if syncers is None:
            raise HandshakeError(f"explorer {self.name}: the synchronizer uses a weight syncer factory; "
                                 "pass weight_syncer= to the explorer")
        if not isinstance(syncers, SyncerFactory):
            syncers = syncer_factory(syncers)
        self.transport.use_comm_options(syncers.comm_options)  # W4 on this end too (ConfigError if it cannot)
        self.mux.set_timeout(cfg.delivery_timeout)
        self.applier = Applier(self.name, self.slot, self.mux.data, syncers, timeout=cfg.delivery_timeout,
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
                self._served(msg)
            elif isinstance(msg, Notice):
                self._on_notice(msg)
            elif isinstance(msg, Close):
                if msg.reason.startswith("lost:"):
                    self.error = TransportError(f"the synchronizer declared explorer {self.name} {msg.reason}")
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
        elif msg.event in ("delivering", "settled"):
            self._delivering = msg.event == "delivering"
        self._notify()

    async def _heartbeat(self) -> None:
        """Tell the session this explorer is alive, while its loop shows signs of life."""
        interval = self.config.liveness_timeout / 4
        while not self.closed:
            await anyio.sleep(interval)
            if (self._active or self.slot.readers) and self.status is not RunningStatus.STOPPED:
                self._active = False
                await self.mux.send_quietly(Heartbeat(self.step))

    def _check_usable(self, what: str) -> None:
        self._touch()
        if self.error is not None:
            raise TransportError(f"explorer {self.name}: lost the synchronizer ({self.error}); cannot {what}") \
                from self.error
        if self._user_stopped:
            raise StateTransitionError(f"explorer {self.name}: {what} after stop()")

    # -- the explorer API -------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def lease(self, timeout: float | None = None) -> AsyncIterator[Lease]:
        """``async with explorer.lease() as (model, version)``: one rollout on one whole version
        (see :meth:`PolicySlot.lease`). With ``max_ahead`` set, it first waits until the
        weights held are recent enough to start a rollout (admission, :meth:`admit`)."""
        self._touch()
        await self.admit()
        async with self.slot.lease(timeout) as lease:
            yield lease
        self._touch()

    @contextlib.contextmanager
    def lease_nowait(self) -> Iterator[Lease]:
        """:meth:`PolicySlot.lease_nowait`; with ``max_ahead`` set, also
        :class:`aiosync.errors.WouldBlock` while the weights held are too old to start a rollout."""
        self._touch()
        if not self.admitted():
            raise WouldBlock(f"explorer {self.name}: the trainer published version {self.published}, more than "
                             f"max_ahead={self.config.max_ahead} ahead of the weights held ({self.slot.version})")
        with self.slot.lease_nowait() as lease:
            yield lease

    @contextlib.asynccontextmanager
    async def rollout(self, timeout: float | None = None) -> AsyncIterator[Rollout]:
        """``async with explorer.rollout() as r``: a long rollout that lets new weights land
        between its segments (in-flight updates). Admission (:meth:`admit`) is checked once, at
        the start; see :meth:`PolicySlot.rollout`."""
        self._touch()
        await self.admit()
        async with self.slot.rollout(timeout) as rollout:
            yield rollout
        self._touch()

    def admitted(self) -> bool:
        """Whether a rollout may start now: ``max_ahead`` is unset, the trainer stopped, or the
        trainer's newest published version is at most ``max_ahead`` ahead of the weights held."""
        limit = None if self.config is None else self.config.max_ahead
        if limit is None or self.trainer_stopped or self.closed or self.published is None:
            return True
        return self.slot.version is not None and self.published - self.slot.version <= limit

    async def admit(self) -> None:
        """Admission control (``max_ahead``): wait until :meth:`admitted`, asking for the newest
        weights if no request is outstanding, at most ``sync_timeout + delivery_timeout``; then
        the rollout starts anyway (counted in ``statistics().admission_timeouts``)."""
        if self.admitted():
            return
        cfg = self.config
        t0 = time.perf_counter()
        with anyio.move_on_after(cfg.sync_timeout + cfg.delivery_timeout):
            while not self.admitted():
                if not self._outstanding() and self.error is None:
                    await self.sync_weight(wait=False)  # gets the newer weights first
                    continue
                await self._changed.wait()
        self._admission_wait_s.add(time.perf_counter() - t0)
        if not self.admitted():
            self._admission_timeouts += 1
            log.warning("aiosync: explorer %s starts a rollout on version %s, %s behind the trainer's %s: newer "
                        "weights did not land within sync_timeout + delivery_timeout", self.name, self.slot.version,
                        None if self.slot.version is None else self.published - self.slot.version, self.published)

    def need_sync(self) -> bool:
        """Whether the explorer should call :meth:`sync_weight` now (after explore step ``step``).

        FIXED: ``step > offset and (step - offset) % interval == 0``; EXPLORER_DRIVEN: once
        ``interval`` steps passed since the last successful sync (a timed-out ask is repeated
        at the next step); TRAINER_DRIVEN: a newer version was published (NCCL: the trainer
        opened a handshake this explorer has not joined). See :mod:`aiosync.coordination.styles`.
        """
        self._touch()
        if self.status is RunningStatus.STOPPED or self.config is None:
            return False
        cfg = self.config
        outstanding = self._outstanding()
        if cfg.style is SyncStyle.FIXED:  # every sync point waits for a newer version (an outstanding request merges)
            return explorer_step_syncs(cfg.style, self.step, cfg.sync_interval, cfg.sync_offset)
        if outstanding:
            return False
        if cfg.style is SyncStyle.EXPLORER_DRIVEN:
            return explorer_step_syncs(cfg.style, self.step, cfg.sync_interval, cfg.sync_offset, self._synced_step)
        if cfg.method is SyncMethod.NCCL:
            return self._window is not None and self._joined_window != self._window
        return self.published is not None and (self.slot.version is None or self.published > self.slot.version)

    async def sync_weight(self, *, wait: bool | None = None) -> int | None:
        """Ask for the newest weights; returns the version the model holds afterwards.

        REQUIRE_SYNC until the request is served. ``wait`` (default: ``not
        sync_weight_no_wait``) waits until the new weights are applied; otherwise the apply runs
        in the background and the old weights stay in use until it atomically swaps them.
        FIXED, EXPLORER_DRIVEN and NCCL requests wait for the trainer at most ``sync_timeout``
        (FIXED: until a version newer than the previous sync point's is published; with
        no-wait it then returns, the apply runs in the background); then the explorer carries
        on (RUNNING) and may ask again. A STOPPED trainer answers at once.
        """
        self._check_usable("sync_weight")
        cfg = self.config
        if self.closed:
            return self.slot.version  # the synchronizer ended the session after its final drain
        if self.trainer_stopped and (cfg.method is SyncMethod.NCCL or self.published is None or (
                self.slot.version is not None and self.published <= self.slot.version)):
            return self.slot.version  # S5: nothing newer will come
        blocking = not cfg.sync_weight_no_wait if wait is None else wait
        self.state.set_if(RunningStatus.RUNNING, RunningStatus.REQUIRE_SYNC)
        if cfg.style is SyncStyle.FIXED and cfg.method is not SyncMethod.NCCL:  # NCCL: the handshake waits
            if not await self._wait_published_after(self._synced_version, cfg.sync_timeout):
                self.outcomes["timeout"] = self.outcomes.get("timeout", 0) + 1
                self.state.set_if(RunningStatus.REQUIRE_SYNC, RunningStatus.RUNNING)
                self._check_usable("sync_weight")
                return self.slot.version  # S3: carries on, and waits again at its next sync point
        self._next_id += 1
        request_id, event = self._next_id, anyio.Event()
        self._requests[request_id] = _Request(event, time.monotonic() + cfg.sync_timeout + cfg.delivery_timeout,
                                              self.step)
        if self._window is not None:
            self._joined_window = self._window
        if not await self.mux.send_quietly(SyncRequest(request_id)):
            self._requests.pop(request_id, None)
            self.state.set_if(RunningStatus.REQUIRE_SYNC, RunningStatus.RUNNING)
            if self.mux.error is None:  # the session is closing (the final drain is done): nothing newer comes
                return self.slot.version
            raise TransportError(f"explorer {self.name}: lost the synchronizer ({self.mux.error}); cannot sync_weight")
        if blocking:
            with anyio.move_on_after(cfg.sync_timeout + cfg.delivery_timeout):
                await event.wait()
            self._synced_version = self.slot.version
        else:
            self._synced_version = self.published  # what the background apply brings
        if self.error is not None:
            self._check_usable("sync_weight")
        return self.slot.version

    async def _wait_published_after(self, version: int | None, timeout: float) -> bool:
        """Wait (at most ``timeout``) until the trainer published a version newer than
        ``version``, stopped, or the session ended; False on timeout."""
        def newer() -> bool:
            return self.published is not None and (version is None or self.published > version)

        with anyio.move_on_after(timeout):
            while not (newer() or self.trainer_stopped or self.closed or self.error is not None):
                await self._changed.wait()
        return newer() or self.trainer_stopped or self.closed

    async def step_done(self) -> int | None:
        """Count one explore step; sync if :meth:`need_sync`. Returns the version held."""
        self._check_usable("step_done")
        self.step += 1
        if self.need_sync():
            await self.sync_weight()
        else:
            await anyio.lowlevel.checkpoint()  # always a checkpoint: a loop of steps never starves the loop
        return self.slot.version

    async def wait_applied(self, timeout: float | None = None) -> int | None:
        """Wait until no request is outstanding and no delivery is being applied."""
        self._touch()
        timeout = self.config.delivery_timeout if timeout is None else timeout
        with anyio.move_on_after(timeout):
            while self.busy and not self.closed:
                expiry = min((req.expiry for req in self._requests.values()), default=None)
                with anyio.move_on_after(None if expiry is None else max(0.0, expiry - time.monotonic())):
                    await self._changed.wait()
        if self.busy and not self.closed:
            raise PeerTimeoutError(f"explorer {self.name}: deliveries still running after {timeout}s")
        return self.slot.version

    async def stop(self) -> None:
        """Stop (STOPPED) after outstanding applies (S9); the synchronizer may still deliver its
        final version to this model while it drains."""
        self._user_stopped = True
        if self.status is RunningStatus.STOPPED:
            return
        if self.error is None and not self.closed:
            try:
                await self.wait_applied()  # bounded by delivery_timeout; a slow one goes on after the stop
            except PeerTimeoutError:
                pass
            await self.mux.send_quietly(Stopped(self.step))
        self.state.set_if(RunningStatus.REQUIRE_SYNC, RunningStatus.RUNNING)
        self.state.set_if(RunningStatus.RUNNING, RunningStatus.STOPPED)


#: Earlier names of the same class: the in-process handle and the remote explorer are one now.
ExplorerHandle = Explorer
RemoteExplorer = Explorer
