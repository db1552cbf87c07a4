"""The :class:`Synchronizer`: coordinates one trainer and many explorers inside an event loop.

Use it as an async context manager inside your own runner; it owns a few background tasks
(one delivery task and one apply task per explorer, and a loop-lag ticker) and nothing else::

    async with Synchronizer(config, weight_syncer) as sync:
        trainer = await sync.attach_trainer(policy)             # publishes version 0
        explorer = await sync.attach_explorer("e0", rollout)    # first sync: always blocking
        ...  # your trainer and explorer coroutines, see TrainerHandle / ExplorerHandle
        await trainer.stop()
    # leaving the block drains: every explorer holds the trainer's last published weights

The trainer and explorer loops stay yours (S1): they call :meth:`TrainerHandle.need_sync` /
:meth:`TrainerHandle.sync_weight` and :meth:`ExplorerHandle.need_sync` /
:meth:`ExplorerHandle.sync_weight` at their check points, or the one-call
``step_done()`` helpers.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import anyio
import torch

from ..errors import ApplyError, ConfigError, PeerTimeoutError, StateTransitionError, VersionError
from ..syncers.base import WeightSyncer
from ..syncers.selection import collect_param_names_need_sync
from ..transports.base import Transport
from ..transports.checkpoint import CheckpointDir
from ..transports.inproc import inproc_pair
from .config import SynchronizerConfig
from .fanout import FanOut
from .link import ReceiverEndpoint, SenderLink, SyncerFactory
from .metrics import LoopLagMonitor, RunningStat, log_metrics
from .slots import PolicySlot
from .sources import CheckpointSource, DirectSource, MemorySource
from .staleness import FilterResult, StalenessFilter
from .states import RunningStatus, StatusCell
from .styles import SyncMethod, SyncStyle, explorer_step_syncs, trainer_step_syncs

log = logging.getLogger("aiosync.sync")

TransportFactory = Callable[[str], "tuple[Transport, Transport]"]



def _syncer_factory(weight_syncer: Any) -> tuple[SyncerFactory, Any, bool]:
    """``(make_syncer(bootstrap), what to check, whether a patch pair skips the bootstrap)``
    from a config or a zero-argument factory."""
    if callable(weight_syncer) and not isinstance(weight_syncer, Mapping) and not dataclasses.is_dataclass(weight_syncer):
        probe = weight_syncer()
        if not isinstance(probe, WeightSyncer):
            raise ConfigError(f"weight_syncer factory returned {type(probe).__name__}, not a WeightSyncer")
        return (lambda bootstrap: weight_syncer()), probe, False
    from ..syncers.config import WeightSyncerConfig

    cfg = WeightSyncerConfig.from_any(weight_syncer)
    repair_cfg = cfg
    if cfg.type == "patch" and (not cfg.patch.init_sync.enabled or cfg.patch.init_sync.prefixes is not None):
        # A repair re-bootstraps every key: it must not trust the receiver's old weights.
        init = dataclasses.replace(cfg.patch.init_sync, enabled=True, prefixes=None)
        repair_cfg = dataclasses.replace(cfg, patch=dataclasses.replace(cfg.patch, init_sync=init))

    def make(bootstrap: bool) -> WeightSyncer:
        return WeightSyncer.create(repair_cfg if bootstrap else cfg)

    return make, cfg, cfg.type == "patch" and not cfg.patch.init_sync.enabled


@dataclass(eq=False)
class TrainerHandle:
    """The trainer's side of a :class:`Synchronizer` (made by :meth:`Synchronizer.attach_trainer`).

    ``step`` counts train steps (advance it with :meth:`step_done`, or set it); ``version`` is
    the last published version. Check points (S1): while waiting for samples and after each
    train step, ``if trainer.need_sync(): await trainer.sync_weight()``.
    """

    sync: "Synchronizer"
    live: Callable[[], Mapping[str, torch.Tensor]]
    names: list[str]
    version: int
    state: StatusCell
    step: int = 0
    syncs: int = 0
    handshake_timeouts: int = 0
    publish_s: RunningStat = field(default_factory=RunningStat)
    sync_s: RunningStat = field(default_factory=RunningStat)

    @property
    def status(self) -> RunningStatus:
        """STOPPED, RUNNING, or REQUIRE_SYNC (only during an NCCL handshake)."""
        return self.state.status

    @property
    def current_version(self) -> int:
        """The version of the trainer's weights now: its step count, or the last published version."""
        return max(self.version, self.step)

    def need_sync(self) -> bool:
        """Whether the trainer should call :meth:`sync_weight` now.

        True when its schedule says so (FIXED, TRAINER_DRIVEN: every ``sync_interval`` steps,
        once per step) or when explorers are waiting for it (EXPLORER_DRIVEN requests, NCCL
        handshakes).
        """
        if self.state.status is RunningStatus.STOPPED:
            return False
        cfg = self.sync.config
        if trainer_step_syncs(cfg.style, self.step, cfg.sync_interval) and self.step > self.version:
            return True
        return bool(self.sync.source.waiting)

    async def sync_weight(self, version: int | None = None, *, wait: bool | None = None) -> dict[str, Any]:
        """Publish the trainer's current weights as ``version`` (default: the step count, or the
        last version + 1) and hand them to the explorers; returns this sync's metrics.

        Without ``version``, when no train step happened since the last publish (``step`` not
        above ``version``), nothing new is published: explorers waiting for the trainer are
        answered with the current version.

        MEMORY / CHECKPOINT: the weights are copied to memory / written to disk and the trainer
        stays RUNNING; explorers pull them. NCCL: a handshake — the trainer is REQUIRE_SYNC
        while the explorers that asked (or, FIXED / TRAINER_DRIVEN, all of them) build their
        payloads from its live tensors, then RUNNING again; its weights must not change
        meanwhile.

        ``wait`` (default: ``not sync_weight_no_wait``) waits until the explorers handed this
        version have applied it; the first sync always waits. A waiting sync first waits for
        outstanding background applies (S9).
        """
        if self.state.status is RunningStatus.STOPPED:
            raise StateTransitionError("trainer: sync_weight after stop()")
        sync, cfg = self.sync, self.sync.config
        if version is None and self.step <= self.version and self.syncs > 0:
            return await self._serve_current()
        if version is None:
            version = self.step if self.step > self.version else self.version + 1
        if version <= self.version:
            raise VersionError(f"trainer: version {version} is not above the last published {self.version}")
        blocking = (not cfg.sync_weight_no_wait if wait is None else wait) or self.syncs == 0
        t0 = time.perf_counter()
        if blocking:
            await sync._wait_links_settled(sync._links(), cfg.delivery_timeout)
        push = cfg.sync_weight_no_wait and cfg.style is SyncStyle.TRAINER_DRIVEN
        handed: list[tuple[SenderLink, int]] = []
        if cfg.method is SyncMethod.NCCL:
            handed = await self._handshake(version, push)
        else:
            pub = await sync.source.publish(self.live(), self.names, version)
            self.publish_s.add(sync.source.publish_s)
            self.version = pub.version
            if push or (blocking and self.syncs == 0):
                handed = [(link, link.request()) for link in sync._links()]
        self.version = version
        self.syncs += 1
        if blocking and handed:
            await sync._wait_served(handed, cfg.sync_timeout + cfg.delivery_timeout)
        dt = time.perf_counter() - t0
        self.sync_s.add(dt)
        failed = [link.name for link, _ in handed if blocking and (link.last_outcome == "failed" or link.closed)]
        return {"version": version, "blocking": blocking, "handed_to": [link.name for link, _ in handed],
                "failed": failed, "sync_s": dt}

    async def _serve_current(self) -> dict[str, Any]:
        """No training since the last publish: answer waiting explorers with that version."""
        sync, cfg = self.sync, self.sync.config
        t0 = time.perf_counter()
        handed: list[tuple[SenderLink, int]] = []
        if cfg.method is SyncMethod.NCCL:
            handed = await self._handshake(self.version, False, reopen=True)
        else:
            sync.source.announce()
        dt = time.perf_counter() - t0
        return {"version": self.version, "blocking": False, "handed_to": [link.name for link, _ in handed],
                "sync_s": dt, "republished": True}

    async def _handshake(self, version: int, push: bool, *, reopen: bool = False,
                         only: "list[SenderLink] | None" = None) -> list[tuple[SenderLink, int]]:
        """NCCL: open a window on the live tensors, wait for the expected links, close it."""
        sync, cfg = self.sync, self.sync.config
        source: DirectSource = sync.source
        links = only if only is not None else sync._links()
        self.state.set_if(RunningStatus.RUNNING, RunningStatus.REQUIRE_SYNC)  # a stopped trainer can still serve
        try:
            window = source.open(self.live(), version, reopen=reopen)
            self.version = version
            handed = []
            expected = set(source.waiting)
            # Pushed requests are answered by the links' own tasks, not by explorer loops, so
            # they get the delivery bound; explorer loops that must come to check get sync_timeout.
            pushed = push or only is not None
            wait = cfg.delivery_timeout if pushed else cfg.sync_timeout
            for link in links:
                if pushed:
                    if link in source.waiting and link.in_flight is not None:
                        # Its request already waits for a window: this one serves it. A pushed
                        # request would queue behind it and then miss the window.
                        handed.append((link, link.in_flight.seq))
                    else:
                        handed.append((link, link.request(deadline=time.monotonic() + wait)))
                if link.in_flight is None and (only is not None or (
                        link.active and cfg.style is not SyncStyle.EXPLORER_DRIVEN)):
                    expected.add(link)
            deadline = time.monotonic() + wait
            missing = await source.wait_window_done(window, expected, deadline)
            if missing:
                self.handshake_timeouts += len(missing)
                log.info("aiosync: NCCL handshake of version %d timed out for %s", version,
                         ", ".join(sorted(link.name for link in missing)))
            joined = [link for link in links if link in window.joined]
            handed_names = {link.name for link, _ in handed}
            handed += [(link, link.in_flight.seq if link.in_flight is not None else link.served_seq)
                       for link in joined if link.name not in handed_names]
        finally:
            source.close_window()
            self.state.set_if(RunningStatus.REQUIRE_SYNC, RunningStatus.RUNNING)
        return handed

    async def step_done(self) -> bool:
        """Count one train step; sync if the schedule (or a waiting explorer) asks. Returns
        whether a sync happened."""
        self.step += 1
        if self.need_sync():
            await self.sync_weight()
            return True
        return False

    async def stop(self, *, publish_final: bool = True) -> None:
        """Stop the trainer (STOPPED). Explorers waiting on it return at once with what they have.

        With ``publish_final`` (default), weights trained since the last sync (``step`` above
        ``version``) are published first, so the final weights reach the explorers. With NCCL,
        explorers that missed the last version get it now, while the live tensors still hold it.
        """
        if self.state.status is RunningStatus.STOPPED:
            return
        sync, cfg = self.sync, self.sync.config
        if publish_final and self.step > self.version:
            await self.sync_weight(self.step)
        if cfg.method is SyncMethod.NCCL:
            for _ in range(3):
                await sync._wait_links_settled(sync._links(), cfg.delivery_timeout)
                behind = [link for link in sync._links()
                          if link.needs_reinit or link.applied_version is None or link.applied_version < self.version]
                if not behind:
                    break
                handed = await self._handshake(self.version, True, reopen=True, only=behind)
                await sync._wait_served(handed, cfg.sync_timeout + cfg.delivery_timeout)
        self.state.set(RunningStatus.STOPPED)
        sync.source.stop()

    def filter_stale(self, samples: Iterable[Any], current_version: int | None = None) -> FilterResult:
        """Apply the synchronizer's staleness filter (``max_staleness``) to samples stamped with
        the version that generated them, relative to ``current_version`` (default: this
        trainer's :attr:`current_version`)."""
        return self.sync.staleness.filter(samples, self.current_version if current_version is None else current_version)


@dataclass(eq=False)
class ExplorerHandle:
    """One explorer's side of a :class:`Synchronizer` (made by :meth:`Synchronizer.attach_explorer`).

    Roll out through ``async with explorer.lease() as (model, version)`` and stamp every
    trajectory with ``version``. Check point (S1): after each explore step,
    ``if explorer.need_sync(): await explorer.sync_weight()`` — or ``await explorer.step_done()``.
    """

    sync: "Synchronizer"
    name: str
    slot: PolicySlot
    link: SenderLink
    endpoint: ReceiverEndpoint
    state: StatusCell
    step: int = 0

    @property
    def status(self) -> RunningStatus:
        """RUNNING, REQUIRE_SYNC (a sync is requested or in progress) or STOPPED."""
        return self.state.status

    @property
    def version(self) -> int | None:
        """The version of the weights the explorer's model holds now (the applied version)."""
        return self.slot.version

    @property
    def timeouts(self) -> int:
        """Requests that timed out waiting for the trainer."""
        return self.link.stats.timeouts

    def lease(self, timeout: float | None = None):
        """``async with explorer.lease() as (model, version)``: see :meth:`PolicySlot.lease`."""
        return self.slot.lease(timeout)

    def need_sync(self) -> bool:
        """Whether the explorer should call :meth:`sync_weight` now (after explore step ``step``)."""
        if self.state.status is RunningStatus.STOPPED or self.link.busy:
            return False
        sync, cfg = self.sync, self.sync.config
        if cfg.style is not SyncStyle.TRAINER_DRIVEN:
            return explorer_step_syncs(cfg.style, self.step, cfg.sync_interval, cfg.sync_offset)
        if cfg.method is SyncMethod.NCCL:
            window = sync.source.window
            return window is not None and self.link not in window.joined
        latest = sync.source.latest
        return latest is not None and (self.slot.version is None or latest.version > self.slot.version)

    async def sync_weight(self, *, wait: bool | None = None) -> int | None:
        """Ask for the newest weights; returns the version the model holds afterwards.

        Moves to REQUIRE_SYNC until the request is served. ``wait`` (default:
        ``not sync_weight_no_wait``) waits until the new weights are applied; otherwise the
        apply runs in the background and the old weights stay in use until it atomically
        swaps them. EXPLORER_DRIVEN and NCCL requests wait for the trainer at most
        ``sync_timeout``; then the explorer carries on (RUNNING) and may ask again next cycle.
        A STOPPED trainer answers at once.
        """
        if self.state.status is RunningStatus.STOPPED:
            raise StateTransitionError(f"explorer {self.name}: sync_weight after stop()")
        sync, cfg = self.sync, self.sync.config
        blocking = not cfg.sync_weight_no_wait if wait is None else wait
        seq = sync._explorer_request(self.link, self.slot.version)
        if seq is None:
            return self.slot.version  # S5: nothing newer will come
        if blocking:
            await self.link.wait_served(seq, cfg.sync_timeout + cfg.delivery_timeout)
        return self.slot.version

    async def step_done(self) -> int | None:
        """Count one explore step; sync if :meth:`need_sync`. Returns the version held."""
        self.step += 1
        if self.need_sync():
            await self.sync_weight()
        return self.slot.version

    async def wait_applied(self, timeout: float | None = None) -> int | None:
        """Wait until no delivery is pending or in flight (background applies done)."""
        timeout = self.sync.config.delivery_timeout if timeout is None else timeout
        if not await self.link.wait_settled(timeout):
            raise PeerTimeoutError(f"explorer {self.name}: deliveries still running after {timeout}s")
        return self.slot.version

    async def stop(self) -> None:
        """Stop the explorer (STOPPED) after its outstanding background applies finished (S9).

        The synchronizer may still deliver to a stopped explorer's model when it drains.
        """
        if self.state.status is RunningStatus.STOPPED:
            return
        await self.link.wait_settled(self.sync.config.delivery_timeout)
        self.link.active = False
        self.state.set(RunningStatus.STOPPED)


class Synchronizer:
    """Coordinates weight syncs between one trainer and any number of explorers (S1-S13).

    ``config``: a :class:`SynchronizerConfig`, mapping or OmegaConf node (``None``: defaults).
    ``weight_syncer``: a ``weight_syncer`` config (default: the shipped
    ``weight_syncer/patch_syncer``: patch mode with init bootstrap), or a
    zero-argument callable returning a fresh :class:`aiosync.syncers.base.WeightSyncer`.
    ``transport_factory(name) -> (synchronizer_end, explorer_end)`` makes each explorer's
    channel (default: in-process, zero copy). ``loop_lag_interval``: period of the event-loop
    lag ticker in seconds (``None`` disables it). ``fan_out`` (S12, default on): explorers at
    the same version share one payload built once per version (see
    :mod:`aiosync.coordination.fanout`); off, every explorer's link builds its own.

    Explorers in other processes attach through :meth:`serve_remote` (see
    ``docs/distributed.md``).

    Invalid combinations (bucket + ``sync_weight_no_wait``, ...) raise
    :class:`aiosync.errors.ConfigError` here, before any sync.
    """

    def __init__(self, config: Any = None, weight_syncer: Any = None, *,
                 transport_factory: TransportFactory | None = None,
                 loop_lag_interval: float | None = 0.002, fan_out: bool = True) -> None:
        self.config = SynchronizerConfig.from_any(config)
        if weight_syncer is None:
            from ..configs import load_config

            weight_syncer = load_config("weight_syncer/patch_syncer")
        self._make_syncer, probe, self._no_init_bootstrap = _syncer_factory(weight_syncer)
        self.config.check_weight_syncer(probe)
        self._syncer_config = None if isinstance(probe, WeightSyncer) else probe  # told to remote explorers
        delivery_timeout = self.config.delivery_timeout
        self._transport_factory = transport_factory or (lambda name: inproc_pair(timeout=delivery_timeout))
        if self.config.method is SyncMethod.MEMORY:
            self.source: Any = MemorySource()
        elif self.config.method is SyncMethod.CHECKPOINT:
            self.source = CheckpointSource(directory=CheckpointDir(self.config.checkpoint_dir))
        else:
            self.source = DirectSource()
        self.staleness = StalenessFilter(self.config.max_staleness, self.config.staleness_mode,
                                         self.config.staleness_decay)
        self.loop_lag = LoopLagMonitor(loop_lag_interval) if loop_lag_interval else None
        self.trainer: TrainerHandle | None = None
        self.explorers: dict[str, ExplorerHandle] = {}
        self._transports: list[Transport] = []
        self._tg: anyio.abc.TaskGroup | None = None
        self._drained = False
        #: S12: payloads built once per version and shared by explorers at the same version.
        self.fanout: FanOut | None = FanOut() if fan_out else None
        self._trainer_attached = anyio.Event()
        self._joined = anyio.Event()
        self._joining: set[str] = set()  # remote explorers whose first sync is running
        self._sessions: set[anyio.CancelScope] = set()  # remote sessions (serve_remote)

    # -- lifecycle -------------------------------------------------------------------------

    async def __aenter__(self) -> "Synchronizer":
        if self._tg is not None:
            raise RuntimeError("a Synchronizer can be entered once")
        self._tg = anyio.create_task_group()
        await self._tg.__aenter__()
        if self.loop_lag is not None:
            self._tg.start_soon(self.loop_lag.run)
        return self

    async def __aexit__(self, exc_type, exc, tb) -> bool | None:
        # A body that failed or was cancelled, or a failed drain, stops the background tasks
        # (applies in progress roll back); the exception propagates unchanged, not wrapped
        # in an exception group.
        drained = False
        try:
            if exc_type is None:
                await self.drain()
                drained = self._drained
        finally:
            await self._close_remote(drained, "synchronizer closed" if exc_type is None else f"trainer failed: {exc!r}")
            self._shutdown(cancel=not drained)
            await self._tg.__aexit__(None, None, None)
        return None

    async def _close_remote(self, drained: bool, reason: str) -> None:
        """End every remote explorer's session (after the drain, they hold the final weights),
        then stop sessions still waiting for an explorer to say Hello."""
        remote = [h for h in self.explorers.values() if getattr(h, "remote", False)]
        if remote:
            timeout = min(self.config.sync_timeout, 30.0) if drained else 5.0
            with anyio.CancelScope(shield=True):
                async with anyio.create_task_group() as tg:
                    for handle in remote:
                        tg.start_soon(functools.partial(handle.close, reason, timeout=timeout))
        for scope in list(self._sessions):
            scope.cancel()

    def _shutdown(self, cancel: bool) -> None:
        for handle in self.explorers.values():
            handle.link.close()
            handle.link.closed = True
            handle.link._notify()
        for transport in self._transports:
            close = getattr(transport, "close", None)
            if close is not None:
                close()
        if self.loop_lag is not None:
            self.loop_lag.stop()
        if cancel:
            self._tg.cancel_scope.cancel()

    def _require_started(self) -> anyio.abc.TaskGroup:
        if self._tg is None:
            raise RuntimeError("use the Synchronizer as `async with Synchronizer(...) as sync:`")
        return self._tg

    # -- attaching -------------------------------------------------------------------------

    async def attach_trainer(self, model: torch.nn.Module | Mapping[str, torch.Tensor], *, version: int = 0,
                             param_names: Iterable[str] | None = None) -> TrainerHandle:
        """Register the trainer's model (or state dict) and publish its weights as ``version``.

        Synced keys default to trainable parameters and persistent buffers of a module (W5), or
        every key of a mapping. The trainer moves STOPPED → RUNNING.
        """
        self._require_started()
        if self.trainer is not None:
            raise RuntimeError("a trainer is already attached")
        if isinstance(model, torch.nn.Module):
            live = model.state_dict
            names = list(param_names) if param_names is not None else collect_param_names_need_sync(model)
        elif isinstance(model, Mapping):
            live = lambda: model  # noqa: E731
            names = list(param_names) if param_names is not None else list(model)
        else:
            raise TypeError(f"attach_trainer takes an nn.Module or a mapping of tensors, got {type(model).__name__}")
        handle = TrainerHandle(self, live, names, version, StatusCell("trainer"))
        if self.config.method is SyncMethod.NCCL:
            self.source.open(live(), version)
            self.source.close_window()
        else:
            await self.source.publish(live(), names, version)
        if self.config.method is SyncMethod.CHECKPOINT:
            self.source.live = live
        handle.state.set(RunningStatus.RUNNING)
        self.trainer = handle
        self._trainer_attached.set()
        return handle

    async def attach_explorer(self, name: str, model: Any, *, version: int | None = None) -> ExplorerHandle:
        """Register an explorer's rollout model (or a ready :class:`PolicySlot`) and give it the
        trainer's current weights: the syncer pair's init conversation (bootstrap), then a
        first, always blocking, sync. Explorers may join at any time (S12); with NCCL call it
        while the trainer's weights are not changing (e.g. from the trainer's task).

        With a patch syncer whose ``init_sync`` is off, the explorer is still bootstrapped
        unless it declares ``version`` equal to the trainer's (its model already holds those
        weights, as the seed assumes).
        """
        tg = self._require_started()
        if self.trainer is None:
            raise RuntimeError("attach the trainer first: explorers are bootstrapped from its weights")
        if name in self.explorers:
            raise ValueError(f"an explorer named {name!r} is already attached")
        slot = model if isinstance(model, PolicySlot) else PolicySlot(model, version)
        sync_end, explorer_end = self._transport_factory(name)
        self._transports += [sync_end, explorer_end]
        state = StatusCell(f"explorer {name}")
        link = SenderLink(name, sync_end, self._make_syncer, self.source, self.trainer.names,
                          self.config.delivery_timeout, on_busy_change=lambda lk: self._on_busy(state, lk),
                          fanout=self.fanout)
        # Patch mode without init_sync trusts the explorer to hold the trainer's weights already
        # (the seed's assumption); only an explorer that declares its version gets that trust.
        link.bootstrap_first = self._no_init_bootstrap and slot.version != self.trainer.version
        endpoint = ReceiverEndpoint(name, slot, explorer_end, self._make_syncer, timeout=self.config.delivery_timeout)
        handle = ExplorerHandle(self, name, slot, link, endpoint, state)
        self.explorers[name] = handle
        tg.start_soon(link.run, name=f"aiosync-link-{name}")
        tg.start_soon(endpoint.run, name=f"aiosync-apply-{name}")
        state.set(RunningStatus.RUNNING)
        cfg = self.config
        if cfg.method is SyncMethod.NCCL:
            handed = await self.trainer._handshake(self.trainer.version, True, reopen=True, only=[link])
            await self._wait_served(handed, cfg.sync_timeout + cfg.delivery_timeout)
        else:
            await self._wait_served([(link, link.request())], cfg.sync_timeout + cfg.delivery_timeout)
        if link.last_outcome != "delivered":
            err = link.stats.last_error or link.last_outcome or "no answer"
            await self.detach_explorer(name)
            raise ApplyError(f"explorer {name}: the first sync failed ({err})")
        return handle

    async def detach_explorer(self, name: str) -> None:
        """Stop an explorer and close its channel (S12: explorers may also leave). A remote
        explorer's session is ended (it is told, bounded by ``sync_timeout``)."""
        handle = self.explorers.pop(name)
        if getattr(handle, "remote", False):
            await handle.stop()
            await handle.close("detached", timeout=min(self.config.sync_timeout, 30.0))
            return
        await handle.stop()
        handle.link.close()
        handle.link.closed = True
        for t in (handle.link.transport, handle.endpoint.transport):
            close = getattr(t, "close", None)
            if close is not None:
                close()

    # -- remote explorers (other processes) ------------------------------------------------

    def serve_remote(self, transport: Transport) -> None:
        """Serve an explorer in another process over ``transport`` (e.g.
        ``WeightSyncGroup.transport(rank)``): it attaches when its
        :class:`~aiosync.coordination.remote.RemoteExplorer` says Hello — now or later (S12,
        elastic joins) — is bootstrapped, then gets the same deliveries, coalescing and
        fan-out as an in-process explorer. Returns at once; the session runs in the background
        until the synchronizer closes, the explorer leaves, or its process is lost (then
        ``explorers[name].error`` says why and the others are served on).
        """
        from .remote import serve_remote_explorer

        tg = self._require_started()
        tg.start_soon(serve_remote_explorer, self, transport, name="aiosync-remote-session")

    async def wait_for_explorers(self, n: int, timeout: float) -> list[str]:
        """Wait until at least ``n`` explorers are attached (local or remote); returns their
        names. :class:`~aiosync.errors.PeerTimeoutError` after ``timeout`` seconds.

        With NCCL, call it from the trainer's task: a joining explorer's first sync reads the
        trainer's live tensors, so the handshake for it is opened here (at other times, at the
        trainer's next check point: ``need_sync()`` is true while an explorer waits).
        """
        deadline = time.monotonic() + timeout
        while len(self.explorers) < n and time.monotonic() < deadline:
            trainer = self.trainer
            if (self.config.method is SyncMethod.NCCL and trainer is not None and self.source.waiting
                    and trainer.status is not RunningStatus.STOPPED):
                await trainer._handshake(trainer.version, True, reopen=True, only=list(self.source.waiting))
            with anyio.move_on_after(min(0.05, max(0.0, deadline - time.monotonic()))):
                await self._joined.wait()
        if len(self.explorers) < n:
            raise PeerTimeoutError(f"{len(self.explorers)} of {n} explorers attached within {timeout}s")
        return list(self.explorers)

    def _remote_joined(self) -> None:
        self._joined.set()
        self._joined = anyio.Event()

    def _syncer_config_dict(self) -> dict | None:
        from .._strict import to_plain

        return None if self._syncer_config is None else to_plain(self._syncer_config)

    def _explorer_request(self, link: SenderLink, held: int | None) -> int | None:
        """Queue an explorer's ask for the newest weights on ``link``; returns the request's seq,
        or ``None`` when nothing newer can come (the trainer stopped, S5). EXPLORER_DRIVEN and
        NCCL requests wait for the trainer at most ``sync_timeout``."""
        cfg, source = self.config, self.source
        needs_trainer = cfg.method is SyncMethod.NCCL or cfg.style is SyncStyle.EXPLORER_DRIVEN
        if source.trainer_stopped:
            latest = source.latest
            if cfg.method is SyncMethod.NCCL or latest is None or (held is not None and latest.version <= held):
                return None
            needs_trainer = False
        if needs_trainer:
            deadline = time.monotonic() + cfg.sync_timeout
            fresh_after = source.seq if cfg.method is not SyncMethod.NCCL else None
            return link.request(fresh_after=fresh_after, deadline=deadline)
        return link.request()

    # -- draining --------------------------------------------------------------------------

    async def drain(self, timeout: float | None = None) -> dict[str, int | None]:
        """Deliver the last published version to every explorer and wait for all applies.

        Run on exit of the ``async with`` block. Failed deliveries are retried (re-bootstrap)
        up to three times. Returns each explorer's applied version.
        """
        cfg = self.config
        timeout = cfg.sync_timeout + cfg.delivery_timeout if timeout is None else timeout

        if cfg.method is not SyncMethod.NCCL:
            self.source.announce()  # the last publish answers requests still waiting for the trainer

        async def drain_one(handle: ExplorerHandle) -> None:
            link = handle.link
            for _ in range(4):
                if link.closed:
                    return  # a lost or detached explorer
                await link.wait_settled(timeout)
                target = self.source.latest.version if self.source.latest is not None else None
                if target is None or (not link.needs_reinit and link.applied_version is not None
                                      and link.applied_version >= target):
                    return
                if cfg.method is SyncMethod.NCCL:
                    return  # only the trainer's live tensors can serve it: TrainerHandle.stop() does
                await link.wait_served(link.request(), timeout)

        if self.trainer is not None:
            async with anyio.create_task_group() as tg:
                for handle in list(self.explorers.values()):
                    tg.start_soon(drain_one, handle)
        self._drained = all(not h.link.busy or h.link.closed for h in self.explorers.values())
        return {name: h.version for name, h in self.explorers.items()}

    # -- internals ---------------------------------------------------------------------------

    def _links(self) -> list[SenderLink]:
        return [h.link for h in self.explorers.values() if not h.link.closed]

    @staticmethod
    def _on_busy(state: StatusCell, link: SenderLink) -> None:
        if link.busy:
            state.set_if(RunningStatus.RUNNING, RunningStatus.REQUIRE_SYNC)
        else:
            state.set_if(RunningStatus.REQUIRE_SYNC, RunningStatus.RUNNING)

    async def _wait_links_settled(self, links: list[SenderLink], timeout: float) -> None:
        for link in links:
            if not await link.wait_settled(timeout):
                raise PeerTimeoutError(f"explorer {link.name}: background apply still running after {timeout}s")

    async def _wait_served(self, handed: list[tuple[SenderLink, int]], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for link, seq in handed:
            if not await link.wait_served(seq, max(0.0, deadline - time.monotonic())) and not link.closed:
                raise PeerTimeoutError(f"explorer {link.name}: sync not applied within {timeout}s")

    # -- metrics ----------------------------------------------------------------------------

    def metrics(self) -> dict[str, Any]:
        """Everything measured so far (B6), as a nested dict of plain values."""
        explorers = {}
        totals = dict(requests=0, coalesced=0, delivered=0, failed=0, bytes_sent=0, changed_elements=0)
        for name, h in self.explorers.items():
            s, p = h.link.stats, h.link.pending.stats
            slot = getattr(h, "slot", None)  # None: a remote explorer (its slot is in its process)
            row = {
                "status": h.status.name,
                "version": h.version,
                "requests": p.puts,
                "coalesced": p.coalesced,
                "max_pending": p.max_pending,
                "delivered": s.delivered,
                "failed": s.failed,
                "timeouts": s.timeouts,
                "up_to_date": s.up_to_date,
                "reinits": s.reinits,
                "repairs": s.repairs,
                "shared": s.shared,
                "bytes_sent": s.bytes_sent,
                "changed_elements": s.changed_elements,
                "build_s": s.build_s.as_dict(),
                "transfer_s": s.transfer_s.as_dict(),
                "apply_s": s.apply_s.as_dict(),
                "last_sync": dict(h.link.sender.last_stats) if h.link.sender is not None else {},
                "lease_wait_s": slot.stats.last_lock_wait_s if slot is not None else None,
                "leases": slot.stats.leases if slot is not None else None,
                "last_error": s.last_error,
                "remote": slot is None,
            }
            if self.trainer is not None and h.version is not None:
                row["staleness"] = self.trainer.current_version - h.version
            explorers[name] = row
            for key in totals:
                totals[key] += row[key]
        out: dict[str, Any] = {"config": self.config.to_dict(), "explorers": explorers, "totals": totals,
                               "staleness": self.staleness.summary()}
        if self.trainer is not None:
            t = self.trainer
            out["trainer"] = {"status": t.status.name, "version": t.version, "step": t.step, "syncs": t.syncs,
                              "handshake_timeouts": t.handshake_timeouts, "publish_s": t.publish_s.as_dict(),
                              "sync_s": t.sync_s.as_dict()}
        if self.loop_lag is not None:
            out["loop_lag"] = self.loop_lag.summary()
        if self.fanout is not None:
            out["fanout"] = self.fanout.summary()
        return out

    def log_metrics(self, logger: logging.Logger | None = None, level: int = logging.INFO) -> None:
        """Log :meth:`metrics` as one line (flattened ``key=value`` pairs)."""
        log_metrics(self.metrics(), logger, level)
