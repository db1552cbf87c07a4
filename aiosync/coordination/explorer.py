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

While its loop shows signs of life — calls into this API (made, or still waiting), or a lease held — it sends a
heartbeat every ``liveness_timeout / 4`` seconds; an explorer whose loop died without
:meth:`stop` goes silent and is declared lost by the synchronizer (then its next call raises
:class:`~aiosync.errors.ExplorerLostError`; leases keep working with the weights held).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass

import anyio
import anyio.lowlevel

from ..errors import PeerTimeoutError, WouldBlock
from .metrics import Series
from .protocol import Stopped, SyncRequest
from .slots import Lease, Rollout
from .explorer_end import ExplorerEnd, _Request
from .states import RunningStatus
from .styles import SyncMethod, SyncStyle, explorer_step_syncs

log = logging.getLogger("aiosync.sync")


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


class Explorer(ExplorerEnd):
    """One explorer, attached to a synchronizer over ``transport``.

    ``model``: the rollout model (an ``nn.Module``, a dict of tensors, or a ready
    :class:`PolicySlot`). ``weight_syncer``: the receiver's syncer config or factory (default:
    the one the synchronizer announces; required when it uses a syncer factory).
    ``connect_timeout``: bound on the Hello / Welcome exchange. ``close_timeout``: bound on
    waiting for the final drain when leaving an ``async with`` block (default: the
    synchronizer's ``sync_timeout + delivery_timeout``). ``shard_routes``: a sharded trainer
    whose ranks send their parts directly (:class:`~aiosync.syncers.patch.shards_direct.ShardRoutes`,
    a channel to each of its ranks but the synchronizer's; ``docs/distributed.md``).

    Entering (``async with``) joins — any time, S12: bootstrap and the first, always blocking
    sync. Leaving: if the trainer already stopped, the explorer stops and waits (bounded) for
    the synchronizer's final drain, so it ends holding the trainer's last weights; otherwise it
    leaves at once. If the session is lost (the synchronizer's process died, or it declared
    this explorer lost), the next ``sync_weight`` / ``step_done`` raises
    :class:`aiosync.errors.ExplorerLostError` saying why; leases keep working with the weights
    held. The joining, the control lane and the heartbeats are :class:`ExplorerEnd`'s.
    """

    # -- properties -------------------------------------------------------------------

    @property
    def timeouts(self) -> int:
        """Requests that timed out waiting for the trainer."""
        return self.outcomes.get("timeout", 0)

    @property
    def busy(self) -> bool:
        """A request is outstanding, or a delivery is due or being applied."""
        return self._outstanding() or self._delivering or (self.applier is not None and self.applier.busy)

    def statistics(self) -> ExplorerSideStatistics:
        err = None if self.error is None else f"{type(self.error).__name__}: {self.error}"
        return ExplorerSideStatistics(self.name, self.status.name, self.slot.version, self.step, self._next_id,
                                      dict(self.outcomes), self.published, self.trainer_stopped,
                                      self.slot.stats.leases, err, self._admission_wait_s.snapshot(),
                                      self._admission_timeouts)

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
            raise WouldBlock(f"explorer {self.name}: the weights held (version {self.slot.version}) are {self.behind} "
                             f"versions behind the trainer's {self.published}, more than max_ahead="
                             f"{self.config.max_ahead}")
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
        """Whether a rollout may start now: ``max_ahead`` is unset, the trainer stopped, or at
        most ``max_ahead`` of the versions the trainer published are newer than the weights held
        (:attr:`behind`; versions are counted as published, whatever their numbers)."""
        limit = None if self.config is None else self.config.max_ahead
        if limit is None or self.trainer_stopped or self.closed or self.published is None:
            return True
        return self.slot.version is not None and self.behind <= limit

    async def admit(self) -> None:
        """Admission control (``max_ahead``): wait until :meth:`admitted`, asking for the newest
        weights if no request is outstanding, at most ``sync_timeout + delivery_timeout``; then
        the rollout starts anyway (counted in ``statistics().admission_timeouts``)."""
        if self.admitted():
            return
        cfg = self.config
        t0 = time.perf_counter()
        with self._calling(), anyio.move_on_after(cfg.sync_timeout + cfg.delivery_timeout):
            while not self.admitted():
                if not self._outstanding() and self.error is None and not self._delivering:
                    await self._ask(blocking=False)  # gets the newer weights first (not a sync point)
                    continue
                await self._changed.wait()
        self._admission_wait_s.add(time.perf_counter() - t0)
        if not self.admitted():
            self._admission_timeouts += 1
            log.warning("aiosync: explorer %s starts a rollout on version %s, %s versions behind the trainer's %s: "
                        "newer weights did not land within sync_timeout + delivery_timeout", self.name,
                        self.slot.version, self.behind, self.published)

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
        with self._calling():
            return await self._sync_weight(wait)

    async def _sync_weight(self, wait: bool | None) -> int | None:
        cfg = self.config
        if self.closed:
            return self.slot.version  # the synchronizer ended the session after its final drain
        if self.trainer_stopped and (cfg.method is SyncMethod.NCCL or self.published is None or (
                self.slot.version is not None and self.published <= self.slot.version)):
            return self.slot.version  # S5: nothing newer will come
        blocking = not cfg.sync_weight_no_wait if wait is None else wait
        if cfg.style is SyncStyle.FIXED and cfg.method is not SyncMethod.NCCL:  # NCCL: the handshake waits
            self.state.set_if(RunningStatus.RUNNING, RunningStatus.REQUIRE_SYNC)
            try:
                newer = await self._wait_published_after(self._synced_version, cfg.sync_timeout)
            finally:
                self._outstanding()  # REQUIRE_SYNC only while a request is outstanding: none was sent yet
            if not newer:
                self.outcomes["timeout"] = self.outcomes.get("timeout", 0) + 1
                self._check_usable("sync_weight")
                return self.slot.version  # S3: carries on, and waits again at its next sync point
        await self._ask(blocking)
        self._synced_version = self.slot.version if blocking else self.published  # no-wait: what the apply brings
        return self.slot.version

    async def _ask(self, blocking: bool, lost: str | None = None) -> None:
        """Send one request for the newest weights; with ``blocking``, wait (at most
        ``sync_timeout + delivery_timeout``) for its answer. Cancellation-safe: cancelled before
        the request surely went out, nothing is left of it (an answer that comes anyway is
        ignored); cancelled after, the request stays outstanding until it is answered — the
        delivery lands in the background — and a new call may ask again at once. ``lost``: the
        model lost its weights; this asks for a bootstrap (``ExplorerEnd._weights_lost``)."""
        cfg = self.config
        self._next_id += 1
        request_id, event = self._next_id, anyio.Event()
        self._requests[request_id] = _Request(event, time.monotonic() + cfg.sync_timeout + cfg.delivery_timeout,
                                              self.step)
        joined_before = self._joined_window
        if self._window is not None:
            self._joined_window = self._window
        self.state.set_if(RunningStatus.RUNNING, RunningStatus.REQUIRE_SYNC)
        try:
            sent = await self.mux.send_quietly(SyncRequest(request_id, lost))
        except BaseException:
            self._requests.pop(request_id, None)
            self._joined_window = joined_before
            self._outstanding()
            raise
        if not sent:
            self._requests.pop(request_id, None)
            self._joined_window = joined_before
            self._outstanding()
            if self.mux.error is None and self.error is None:  # the session is closing (final drain done)
                return
            raise self._lost_error("sync_weight") from (self.error or self.mux.error)
        self._sent += 1
        if blocking:
            with anyio.move_on_after(cfg.sync_timeout + cfg.delivery_timeout):
                await event.wait()
        if self.error is not None:
            self._check_usable("sync_weight")

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
        """Count one explore step; sync if :meth:`need_sync`. Returns the version held.
        Cancelled before its request went out, the step is not counted: called again, it is
        the same check point (a sync point is never skipped)."""
        self._check_usable("step_done")
        self.step += 1
        sent = self._sent
        try:
            if self.need_sync():
                await self.sync_weight()
            else:
                await anyio.lowlevel.checkpoint()  # always a checkpoint: a loop of steps never starves the loop
        except anyio.get_cancelled_exc_class():
            if self._sent == sent:
                self.step -= 1  # nothing went out: this check point did not happen
            raise
        return self.slot.version

    async def wait_applied(self, timeout: float | None = None) -> int | None:
        """Wait until no request is outstanding and no delivery is being applied."""
        self._touch()
        timeout = self.config.delivery_timeout if timeout is None else timeout
        with self._calling(), anyio.move_on_after(timeout):
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
