"""The trainer's side of a synchronizer: :class:`TrainerHandle`.

The trainer's loop stays yours (S1): at its check points — while waiting for samples and after
each train step — it calls ``if trainer.need_sync(): await trainer.sync_weight()``, or the
one-call :meth:`TrainerHandle.step_done`.

Publishing a version depends on the method (S2): MEMORY and CHECKPOINT copy the weights (to
memory, to a file) and the trainer stays RUNNING; NCCL opens a *handshake* — the trainer is
REQUIRE_SYNC while the explorers it syncs with build their payloads from its live tensors, and
the window closes only once no build reads them any more (even when the sync is cancelled).
"""

from __future__ import annotations

import logging
import time

import anyio
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from ..errors import PeerTimeoutError, StateTransitionError, TrainerRankLostError, VersionError
from .delivery import DeliveryLine
from .hub import Hub
from .metrics import RunningStat, Series
from .sources import DirectSource
from .staleness import FilterResult, StalenessFilter
from .states import RunningStatus, StatusCell
from .styles import SyncMethod, SyncStyle, trainer_step_syncs

log = logging.getLogger("aiosync.sync")

T = TypeVar("T")


@dataclass(frozen=True)
class TrainerStatistics:
    """A snapshot of the trainer's counters (B6)."""

    status: str
    version: int
    step: int
    syncs: int
    handshake_timeouts: int
    publish_s: Series
    sync_s: Series
    #: Admission control (``max_ahead``): how long publishes waited for explorers to catch up,
    #: and how many went ahead after ``sync_timeout``.
    hold_back_s: Series
    hold_back_timeouts: int


@dataclass(eq=False)
class TrainerHandle:
    """The trainer's side of a :class:`~aiosync.Synchronizer` (made by
    :meth:`~aiosync.Synchronizer.attach_trainer`).

    ``step`` counts train steps (advance it with :meth:`step_done`, or set it); ``version`` is
    the last published version.
    """

    hub: Hub
    live: Callable[[], Mapping[str, torch.Tensor]]
    names: list[str]
    version: int
    state: StatusCell
    staleness: StalenessFilter
    step: int = 0
    syncs: int = 0
    handshake_timeouts: int = 0
    publish_s: RunningStat = field(default_factory=RunningStat)
    sync_s: RunningStat = field(default_factory=RunningStat)
    hold_back_s: RunningStat = field(default_factory=RunningStat)
    hold_back_timeouts: int = 0

    @property
    def status(self) -> RunningStatus:
        """STOPPED, RUNNING, or REQUIRE_SYNC (only during an NCCL handshake)."""
        return self.state.status

    @property
    def current_version(self) -> int:
        """The version of the trainer's weights now: its step count, or the last published version."""
        return max(self.version, self.step)

    def statistics(self) -> TrainerStatistics:
        return TrainerStatistics(self.status.name, self.version, self.step, self.syncs, self.handshake_timeouts,
                                 self.publish_s.snapshot(), self.sync_s.snapshot(), self.hold_back_s.snapshot(),
                                 self.hold_back_timeouts)

    def need_sync(self) -> bool:
        """Whether the trainer should call :meth:`sync_weight` now.

        True when its schedule says so (FIXED, TRAINER_DRIVEN: every ``sync_interval`` steps,
        once per step) or when explorers wait for it (EXPLORER_DRIVEN requests, NCCL handshakes,
        explorers joining under NCCL).
        """
        if self.state.status is RunningStatus.STOPPED:
            return False
        cfg = self.hub.config
        if trainer_step_syncs(cfg.style, self.step, cfg.sync_interval) and self.step > self.version:
            return True
        return bool(self.hub.source.waiting)

    async def sync_weight(self, version: int | None = None, *, wait: bool | None = None) -> dict[str, Any]:
        """Publish the trainer's current weights as ``version`` (default: the step count, or the
        last version + 1) and hand them to the explorers; returns this sync's report.

        Without ``version``, when no train step happened since the last publish (``step`` not
        above ``version``), nothing new is published: explorers waiting for the trainer are
        answered with the current version.

        ``wait`` (default: ``not sync_weight_no_wait``) waits until the explorers handed this
        version have applied it; the first sync always waits. A waiting sync first waits for
        outstanding background applies (S9). With NCCL the trainer's weights must not change
        until this returns (a cancelled call still waits for the builds reading them).

        A sharded trainer's rank that is gone meanwhile ends it at once with
        :class:`~aiosync.errors.TrainerRankLostError` naming the rank.
        """
        return await self._unless_a_rank_is_lost(lambda: self._sync_weight(version, wait=wait))

    async def _sync_weight(self, version: int | None, *, wait: bool | None) -> dict[str, Any]:
        if self.state.status is RunningStatus.STOPPED:
            raise StateTransitionError("trainer: sync_weight after stop()")
        hub, cfg = self.hub, self.hub.config
        if version is None and self.step <= self.version and self.syncs > 0:
            return await self._serve_current()
        if version is None:
            version = self.step if self.step > self.version else self.version + 1
        if version <= self.version:
            raise VersionError(f"trainer: version {version} is not above the last published {self.version}")
        blocking = (not cfg.sync_weight_no_wait if wait is None else wait) or self.syncs == 0
        t0 = time.perf_counter()
        lagging = await self._hold_back() if cfg.max_ahead is not None else []
        if blocking:
            busy = await hub.wait_settled(hub.lines(), cfg.delivery_timeout)
            if busy:
                raise PeerTimeoutError(f"explorer {busy[0].name}: background apply still running after "
                                       f"delivery_timeout={cfg.delivery_timeout}s")
        push = cfg.sync_weight_no_wait and cfg.style is SyncStyle.TRAINER_DRIVEN
        if cfg.method is SyncMethod.NCCL:
            pushed = hub.lines() if push else lagging
            bound = cfg.delivery_timeout if push else cfg.sync_timeout
            handed = await self._handshake(version, push=pushed, bound=bound,
                                           scheduled=cfg.style is not SyncStyle.EXPLORER_DRIVEN)
        else:
            with anyio.CancelScope(shield=True):  # the point of no return: a cancelled call still publishes whole
                pub = await hub.source.publish(self.live(), self.names, version)
                self.publish_s.add(hub.source.publish_s)
                self.version = pub.version
            handed = [(line, line.request()) for line in hub.lines()] if push or (blocking and self.syncs == 0) else []
        self.version = version
        self.syncs += 1
        if blocking and handed:
            late = await hub.wait_served(handed, cfg.sync_timeout + cfg.delivery_timeout)
            if late:
                raise PeerTimeoutError(f"explorer {late[0].name}: version {version} was not applied within "
                                       f"sync_timeout + delivery_timeout = {cfg.sync_timeout + cfg.delivery_timeout}s")
        dt = time.perf_counter() - t0
        self.sync_s.add(dt)
        failed = [line.name for line, _ in handed if blocking and (line.last_outcome == "failed" or line.closed)]
        return {"version": version, "blocking": blocking, "handed_to": [line.name for line, _ in handed],
                "failed": failed, "sync_s": dt}

    async def _hold_back(self) -> list[DeliveryLine]:
        """Admission control (``max_ahead``), every method: publish the next version only once
        every running explorer holds at least :meth:`Source.floor` — the ``max_ahead``-th newest
        version that exists (the newest for ``max_ahead`` 0 and 1) — so that it is at most
        ``max_ahead`` versions behind once the next one is out. An explorer that holds the
        newest version never costs a wait.

        Lagging explorers are sent the newest weights now (MEMORY, CHECKPOINT: whatever their
        schedule). With NCCL only a delivery already under way can land before the next window
        (the live tensors move on): those are waited for, and the other lagging lines are
        returned — the next window is pushed to them. Explorers waiting for the trainer take
        this very publish and are not waited for. The wait is bounded by ``sync_timeout``, then
        the publish goes ahead (counted in ``hold_back_timeouts``)."""
        hub, cfg, source = self.hub, self.hub.config, self.hub.source
        floor = source.floor(cfg.max_ahead)
        if floor is None:
            return []
        nccl = cfg.method is SyncMethod.NCCL

        def lagging() -> list[DeliveryLine]:  # joiners count: their first sync may bring an older version
            running = [s.line for s in hub.open_sessions() if s.expects_handshakes] + hub.joining_lines()
            return [line for line in running if line not in source.waiting and not line.closed
                    and (line.applied_version is None or line.applied_version < floor)]

        t0, deadline, waited = time.perf_counter(), time.monotonic() + cfg.sync_timeout, False
        while True:
            # NCCL: only a delivery under way can land before the next window; the others get it.
            late = [line for line in lagging() if not nccl or line.in_flight is not None]
            if not late or time.monotonic() >= deadline:
                break
            waited = True
            for line in late:
                if not line.busy:
                    line.request()
            await hub.wait_applied(late, floor, deadline - time.monotonic(), until_idle=True)
        if waited:
            self.hold_back_s.add(time.perf_counter() - t0)
        if late:
            self.hold_back_timeouts += 1
            log.warning("aiosync: publishing the next version although %s still hold versions below %d "
                        "(max_ahead=%d): they did not catch up within sync_timeout=%ss",
                        ", ".join(line.name for line in late), floor, cfg.max_ahead, cfg.sync_timeout)
        return [line for line in lagging() if line.in_flight is None] if nccl else []

    async def _serve_current(self) -> dict[str, Any]:
        """No training since the last publish: answer waiting explorers with that version."""
        hub, cfg = self.hub, self.hub.config
        t0 = time.perf_counter()
        handed: list[tuple[DeliveryLine, int]] = []
        if cfg.method is SyncMethod.NCCL:
            handed = await self._handshake(self.version, push=[], bound=cfg.sync_timeout, scheduled=False,
                                           reopen=True)
        else:
            hub.source.announce()
        return {"version": self.version, "blocking": False, "handed_to": [line.name for line, _ in handed],
                "sync_s": time.perf_counter() - t0, "republished": True}

    async def serve_joining(self, lines: Iterable[DeliveryLine]) -> list[tuple[DeliveryLine, int]]:
        """NCCL: serve ``lines`` (explorers joining, or behind after the last version) from the
        live tensors, as the current version — or, when the trainer trained since its last
        publish (``step`` above ``version``: the live tensors are not that version any more), as
        a new version, ``step``, published to every explorer like any other. Call it only where
        the trainer's weights do not change (the trainer's own task)."""
        cfg = self.hub.config
        if self.step <= self.version or self.state.status is RunningStatus.STOPPED:
            return await self._handshake(self.version, push=list(lines), bound=cfg.delivery_timeout,
                                         scheduled=False, reopen=True)
        lagging = await self._hold_back() if cfg.max_ahead is not None else []
        handed = await self._handshake(self.step, push=list(dict.fromkeys([*lines, *lagging])),
                                       bound=cfg.delivery_timeout, scheduled=False)
        self.syncs += 1
        return handed

    async def _handshake(self, version: int, *, push: list[DeliveryLine], bound: float, scheduled: bool,
                         reopen: bool = False) -> list[tuple[DeliveryLine, int]]:
        """NCCL: open a window on the live tensors as ``version``, wait (at most ``bound``) until
        the expected lines built from it, close it. Expected: lines that wait for the trainer,
        the ``push`` lines (asked here on the explorers' behalf), and — for a ``scheduled`` sync
        (FIXED, TRAINER_DRIVEN) — every running explorer, which comes at its next check point.
        Lines that are lost or stop (without asking) meanwhile are no longer waited for."""
        hub = self.hub
        source: DirectSource = hub.source
        self.state.set_if(RunningStatus.RUNNING, RunningStatus.REQUIRE_SYNC)  # a stopped trainer can still serve
        window = source.open(self.live(), version, reopen=reopen)
        self.version = version
        handed: list[tuple[DeliveryLine, int]] = []
        try:
            deadline = time.monotonic() + bound
            for line in push:
                if line in source.waiting and line.in_flight is not None:
                    # Its request already waits for a window: this one serves it. A pushed
                    # request would queue behind it and then miss the window.
                    handed.append((line, line.in_flight.seq))
                else:
                    handed.append((line, line.request(deadline=deadline)))
            pushed = {line for line, _ in handed}
            base = set(source.waiting) | pushed
            if scheduled:
                base |= {line for line in hub.handshake_lines() if line.in_flight is None}

            def expected() -> set:
                running = hub.handshake_lines()
                return {line for line in base if not line.closed
                        and (line in pushed or line in running or line in source.waiting)}

            missing = await source.wait_window_done(window, expected, deadline)
            if missing:
                self.handshake_timeouts += len(missing)
                log.info("aiosync: NCCL handshake of version %d timed out for %s", version,
                         ", ".join(sorted(line.name for line in missing)))
            for line in hub.lines():
                if line in window.joined and line not in pushed:
                    handed.append((line, line.in_flight.seq if line.in_flight is not None else line.served_seq))
        finally:
            await source.close(window, self.hub.config.delivery_timeout)
            self.state.set_if(RunningStatus.REQUIRE_SYNC, RunningStatus.RUNNING)
        return handed

    async def step_done(self) -> bool:
        """Count one train step; sync if the schedule (or a waiting explorer) asks. Returns
        whether a sync happened. Cancelled before anything was published, the step is not
        counted: called again, it is the same check point (a scheduled sync is never skipped;
        a sharded trainer's other ranks wait for it)."""
        self.step += 1
        published = self.version
        try:
            synced = self.need_sync()
            if synced:
                await self.sync_weight()
        except anyio.get_cancelled_exc_class():
            if self.version == published:
                self.step -= 1
            else:
                await self._ranks_go()
            raise
        except BaseException:
            await self._ranks_go()
            raise
        await self._ranks_go()
        return synced

    async def _unless_a_rank_is_lost(self, call: Callable[[], Awaitable[T]]) -> T:
        """``await call()``; a sharded trainer's rank that is gone meanwhile (its channel failed, or
        its transport says it broke) ends it at once with
        :class:`~aiosync.errors.TrainerRankLostError` naming the rank — its deliveries would
        otherwise be repaired, each failing, until their bounds (``ShardPeers.unless_lost``)."""
        peers = self.hub.shard_peers
        return await (call() if peers is None else peers.unless_lost(call))

    async def _ranks_go(self) -> None:
        if self.hub.shard_peers is not None:  # a sharded trainer's other ranks train on
            with anyio.CancelScope(shield=True):
                await self.hub.shard_peers.go(self.step)

    async def stop(self, *, publish_final: bool = True) -> None:
        """Stop the trainer (STOPPED). Explorers waiting on it return at once with what they have.

        With ``publish_final`` (default), weights trained since the last sync (``step`` above
        ``version``) are published first, so the final weights reach the explorers. With NCCL,
        explorers that missed the last version get it now, while the live tensors still hold it.
        """
        if self.state.status is RunningStatus.STOPPED:
            return
        try:
            await self._unless_a_rank_is_lost(lambda: self._final(publish_final))
        except TrainerRankLostError:  # the trainer cannot go on: it is stopped all the same
            self.state.set(RunningStatus.STOPPED)
            self.hub.source.stop()
            raise
        self.state.set(RunningStatus.STOPPED)
        self.hub.source.stop()

    async def _final(self, publish_final: bool) -> None:
        """:meth:`stop`'s syncs: the final weights, and (NCCL) explorers that missed the last version."""
        hub, cfg = self.hub, self.hub.config
        if publish_final and self.step > self.version:
            await self._sync_weight(self.step, wait=None)
        if cfg.method is SyncMethod.NCCL:
            for _ in range(3):
                await hub.wait_settled(hub.lines(), cfg.delivery_timeout)
                behind = [line for line in hub.lines() if line.behind]
                if not behind:
                    break
                handed = await self.serve_joining(behind)
                await hub.wait_served(handed, cfg.sync_timeout + cfg.delivery_timeout)

    def filter_stale(self, samples: Iterable[Any], current_version: int | None = None) -> FilterResult:
        """Apply the synchronizer's staleness filter (``max_staleness``) to samples stamped with
        the version that generated them, relative to ``current_version`` (default: this
        trainer's :attr:`current_version`)."""
        return self.staleness.filter(samples, self.current_version if current_version is None else current_version)
